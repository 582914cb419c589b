"""famp.autocast under activation checkpointing, bit for bit against the same block unchecked.

Reference: the same `famp.autocast` function with the block called directly. Each case compares the
loss and the gradients of the input and of every parameter, bit for bit, for op overrides, module
rules and the default rules (whose reference is itself `torch.autocast`'s, see test_autocast_zoo),
with reentrant, non-reentrant and selective checkpointing; also of FSDP2-wrapped blocks, under
`torch.compile`, with famp calls nested inside the checkpointed block, and with saved-tensor hooks
that recompute nothing (activation offloading).
"""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import famp
from famp._autocast import recompute
from tests.helpers import assert_bitwise_equal

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def _save_mm(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op == torch.ops.aten.mm.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


MODES: dict[str, dict[str, Any]] = {
    "reentrant": {"use_reentrant": True},
    "nonreentrant": {"use_reentrant": False},
    "selective": {
        "use_reentrant": False,
        "context_fn": functools.partial(create_selective_checkpoint_contexts, _save_mm),
    },
}


class Block(nn.Module):
    """Linear, GELU, LayerNorm, and one weight used twice (torch's cast cache matters)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.act(self.inp(x)))
        return self.out(torch.tanh(self.out(h)))


class Net(nn.Module):
    def __init__(self, mode: dict[str, Any] | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(8, 8)
        self.block = Block()
        self.head = nn.Linear(8, 4)
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        h = self.block(h) if self.mode is None else checkpoint(self.block, h, **self.mode)
        return self.head(h)


def _rules(kind: str) -> dict[str, Any]:
    # Built per test: famp.default_rules needs the rules tables of the installed torch.
    if kind == "overrides":
        rules = famp.default_rules("cpu").override(
            {"linear": "float32", "gelu": "lower", "layer_norm": "lower"}
        )
        return {"rules": rules}
    if kind == "module_rules":
        return {"module_rules": {"block.norm": "f32", "block.out": "c=f16,o=f16", "head": "f32"}}
    return {}


def _run(
    net: nn.Module, kwargs: dict[str, Any], x: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    params = [x, *net.parameters()]
    for p in params:
        p.grad = None
    loss = famp.autocast(lambda x: net(x).float().pow(2).sum(), "c=bf16,o=f32", **kwargs)(x)
    loss.backward()  # reentrant checkpointing supports .backward(), not autograd.grad
    grads = []
    for p in params:
        assert p.grad is not None
        grads.append(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
    return loss, grads


def _assert_same(
    actual: tuple[torch.Tensor, list[torch.Tensor]],
    expected: tuple[torch.Tensor, list[torch.Tensor]],
) -> None:
    assert_bitwise_equal(actual[0], expected[0])
    assert [g.dtype for g in actual[1]] == [F32] * len(actual[1])
    for a, e in zip(actual[1], expected[1], strict=True):
        assert_bitwise_equal(a, e)


def _x() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).requires_grad_()


def _check(mode: str, kind: str) -> None:
    x, kwargs = _x(), _rules(kind)
    expected = _run(Net(None), kwargs, x)
    _assert_same(_run(Net(MODES[mode]), kwargs, x), expected)


@pytest.mark.parametrize("mode", list(MODES))
def test_checkpoint_mode_overrides(mode: str) -> None:
    _check(mode, "overrides")


@pytest.mark.parametrize("mode", list(MODES))
def test_checkpoint_mode_module_rules(mode: str) -> None:
    _check(mode, "module_rules")


@pytest.mark.parametrize("mode", list(MODES))
def test_checkpoint_mode_default_rules(mode: str) -> None:
    _check(mode, "default")


def test_checkpoint_reentrant_overrides_differ_without_famp_state() -> None:
    # The case the hooks exist for: recomputed without famp's rules, the gradients would differ.
    x, kwargs = _x(), _rules("overrides")
    expected = _run(Net(None), kwargs, x)
    plain = _run(Net(None), {}, x)
    assert not torch.equal(plain[1][1], expected[1][1])


class PlainEnds(Net):
    """A block that ends in an op no rule changes, and whose output such an op reads first.

    famp's mode takes a shorter path for such ops; inside a non-reentrant checkpoint's block
    (where the last op's node may start the recomputation) and after a reentrant one's (where the
    first event that sees its output marks its node) they must be marked as any other.
    """

    def body(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sin(self.block(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        h = self.body(h) if self.mode is None else checkpoint(self.body, h, **self.mode)
        return self.head(torch.tanh(h))


@pytest.mark.parametrize("mode", list(MODES))
def test_checkpoint_mode_overrides_block_between_ops_no_rule_changes(mode: str) -> None:
    x, kwargs = _x(), _rules("overrides")
    expected = _run(PlainEnds(None), kwargs, x)
    # The same transform twice: the shorter path is taken from an op's second call on.
    net = PlainEnds(MODES[mode])
    f = famp.autocast(lambda x: net(x).float().pow(2).sum(), "c=bf16,o=f32", **kwargs)
    params = [x, *net.parameters()]
    for _ in range(2):
        for p in params:
            p.grad = None
        loss = f(x)
        loss.backward()
    _assert_same((loss, [p.grad for p in params]), expected)  # type: ignore[misc]
    plain = _run(PlainEnds(None), {}, x)  # the overrides change the block's gradients
    assert not torch.equal(plain[1][1], expected[1][1])


# --- nested famp calls inside (and around) a checkpointed block ---------------------------------


class Nested(nn.Module):
    """A checkpointed block that calls a famp transform with another policy and rules."""

    def __init__(self, mode: dict[str, Any] | None, inner_kwargs: dict[str, Any]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.b = Block()
        self.inner = famp.autocast(self.b, "c=f16,o=bf16", **inner_kwargs)
        self.mode = mode

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.inner(self.a(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) if self.mode is None else checkpoint(self.body, x, **self.mode)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", ["overrides", "module_rules"])
def test_checkpoint_mode_nested_calls(mode: str, kind: str) -> None:
    x = _x()
    outer = _rules(kind) if kind == "overrides" else {"module_rules": {"a": "f32"}}
    inner = {"module_rules": {"norm": "f32", "out": "c=bf16,o=f16"}}
    expected = _run(Nested(None, inner), outer, x)
    _assert_same(_run(Nested(MODES[mode], inner), outer, x), expected)


class ReadsItsInput(nn.Module):
    """A block that reads its input outside autocast's op lists too (`h * 0.5`)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(h))) + self.a(h * 0.5)


def _nested_by_hand(block: nn.Module, inner: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """`famp.autocast(block, inner)` nested in a call, written with `torch.autocast` by hand."""

    def by_hand(h: torch.Tensor) -> torch.Tensor:
        if inner == "f32":
            with torch.autocast("cpu", enabled=False):
                return block(h.float()).float()
        with torch.autocast("cpu", dtype=torch.float16):
            return block(h.half()).half()

    return by_hand


@pytest.mark.parametrize("mode", [None, *MODES])
@pytest.mark.parametrize("inner", ["c=f16,o=f16", "f32"])
def test_nested_calls_in_a_checkpoint_in_a_call_without_a_mode(
    mode: str | None, inner: str
) -> None:
    """The outer call with the default rules sees no op of the block: before 2026-12-02 the
    nested call, recomputed, ran as an outermost call, its input uncast. Reentrant: x's gradient
    was 0.0039 off; with a float32 nested call, and non-reentrant or selective, it raised
    torch's dtype or metadata errors (found by a differential hunt). The reference is
    `torch.autocast` by hand, the nested call written as a nested autocast with its casts."""
    torch.manual_seed(0)
    pre, block = nn.Linear(8, 8), ReadsItsInput()
    x = _x()
    nested = famp.autocast(block, inner)

    by_hand = _nested_by_hand(block, inner)

    def run(f: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        h = pre(x)
        return (f(h) if mode is None else checkpoint(f, h, **MODES[mode])).float().pow(2).sum()

    params = [x, *pre.parameters(), *block.parameters()]
    loss = famp.autocast(lambda: run(nested), "c=bf16,o=f32", device_type="cpu")()
    actual = [loss, *torch.autograd.grad(loss, params)] if mode != "reentrant" else None
    if actual is None:  # reentrant checkpointing supports .backward(), not autograd.grad
        loss.backward()
        actual = [loss, *(p.grad for p in params)]
        for p in params:
            p.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = run(by_hand)
    if mode != "reentrant":
        expected = [loss, *torch.autograd.grad(loss, params)]
    else:
        loss.backward()
        expected = [loss, *(p.grad for p in params)]
    for a, e in zip(actual, expected, strict=True):
        assert_bitwise_equal(a, e)


@pytest.mark.parametrize("outer", [{}, {"track_casts": True}], ids=["default", "track_casts"])
@pytest.mark.parametrize("inner", ["c=f16,o=f16", "f32"])
def test_a_reentrant_block_whose_output_leaves_by_a_side_channel(
    outer: dict[str, Any], inner: str
) -> None:
    """The block's output leaves the call in a list (an auxiliary loss), never through an op or
    a value famp sees: famp finds the checkpoint as the nested call starts in its forward.
    Before 2026-12-02 its node went unbracketed, with a mode too: x's gradient 0.0078 off, or
    torch's dtype error (found by a differential hunt)."""
    torch.manual_seed(0)
    pre, block, head = nn.Linear(8, 8), ReadsItsInput(), nn.Linear(8, 8)
    x = _x()
    params = [x, *pre.parameters(), *block.parameters(), *head.parameters()]
    policy = famp.get_policy(inner)
    by_hand = _nested_by_hand(block, inner)

    def grads(nested: Callable[[torch.Tensor], torch.Tensor], famps: bool) -> list[torch.Tensor]:
        aux: list[torch.Tensor] = []

        def f(x: torch.Tensor) -> torch.Tensor:
            h = pre(x)
            aux.append(checkpoint(nested, h, use_reentrant=True))
            return head(h)

        if famps:
            out = famp.autocast(f, "c=bf16,o=f32", **outer)(x)
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = f(x).float()
        (out.pow(2).sum() + aux[0].float().pow(2).sum()).backward()
        found = [p.grad for p in params]
        for p in params:
            p.grad = None
        return found  # type: ignore[return-value]

    actual = grads(famp.autocast(block, policy), famps=True)
    for a, e in zip(actual, grads(by_hand, famps=False), strict=True):
        assert_bitwise_equal(a, e)


def test_a_reentrant_block_made_before_a_call_keeps_its_own_state() -> None:
    """famp brackets the reentrant checkpoints a nested call starts in (found on the Python
    stack, up to the outermost call), not those made before the call: a block checkpointed
    before it, around an outermost call, is recomputed as that call (its input left as it is),
    not nested in this one (a nested call with grad off in the later call brings no change)."""
    torch.manual_seed(0)
    pre, block = nn.Linear(8, 8), ReadsItsInput()
    x = _x()
    params = [x, *pre.parameters(), *block.parameters()]
    nested = famp.autocast(block, "c=f16,o=f16")

    def grads(grad_free_call: bool) -> list[torch.Tensor]:
        h = checkpoint(nested, pre(x), use_reentrant=True)

        def g(h: torch.Tensor) -> torch.Tensor:
            if grad_free_call:
                with torch.no_grad():
                    famp.autocast(torch.sin, "c=f16,o=f16")(h)
            return h.float().pow(2).sum()

        famp.autocast(g, "c=bf16,o=f32")(h).backward()
        out = [p.grad for p in params]
        for p in params:
            p.grad = None
        return out  # type: ignore[return-value]

    for a, e in zip(grads(True), grads(False), strict=True):
        assert_bitwise_equal(a, e)


@pytest.mark.parametrize("mode", list(MODES))
def test_checkpoint_mode_of_a_famp_call(mode: str) -> None:
    # The famp call inside the checkpointed block: the recomputation runs the call again.
    torch.manual_seed(0)
    block, x = Block(), _x()
    f = famp.autocast(block, "c=bf16,o=f32", module_rules={"norm": "c=f16,o=f16"})
    params = [x, *block.parameters()]

    def grads(loss: torch.Tensor) -> list[torch.Tensor]:
        for p in params:
            p.grad = None
        loss.backward()
        return [p.grad for p in params if p.grad is not None]

    expected = grads((f(x) * 2).pow(2).sum())
    actual = grads(checkpoint(lambda x: f(x) * 2, x, **MODES[mode]).pow(2).sum())
    assert len(actual) == len(params)
    for a, e in zip(actual, expected, strict=True):
        assert_bitwise_equal(a, e)


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@pytest.mark.parametrize("mode", ["reentrant", "nonreentrant"])
def test_a_compiled_checkpoint_of_a_famp_call_raises_with_fullgraph_and_runs_eagerly_without(
    mode: str,
) -> None:
    """Known limit (docs/autocast.md): Dynamo's checkpoint operator reads whether it may allow
    side effects when it meets the checkpoint, before famp's call inside it runs, and refuses the
    call's changes of famp's own state (this thread's stack of calls, undone before it returns).
    With `fullgraph=True` that raises; without, the checkpoint runs eagerly behind a graph break
    and its gradients are the eager call's bit for bit (found by a differential hunt on 2.15)."""
    torch.manual_seed(0)
    block, x = Block(), _x()
    f = famp.autocast(block, "c=bf16,o=f32", module_rules={"norm": "c=f16,o=f16"})
    params = [x, *block.parameters()]

    def grads(loss_fn: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        for p in params:
            p.grad = None
        loss_fn(x).backward()
        return [p.grad for p in params if p.grad is not None]

    def loss(x: torch.Tensor) -> torch.Tensor:
        return checkpoint(lambda x: f(x) * 2, x, **MODES[mode]).pow(2).sum()

    expected = grads(loss)
    with pytest.raises(Exception, match="side effect"):
        torch.compile(loss, fullgraph=True, backend="aot_eager")(x)
    actual = grads(torch.compile(loss, backend="aot_eager"))
    assert len(actual) == len(params)
    for a, e in zip(actual, expected, strict=True):
        assert_bitwise_equal(a, e)


# --- FSDP2 ---------------------------------------------------------------------------------------


# `one_rank_mesh`: tests/autocast/conftest.py.


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", ["overrides", "module_rules", "default"])
def test_checkpoint_mode_fsdp2(mode: str, kind: str, one_rank_mesh: Any) -> None:
    from torch.distributed.fsdp import fully_shard

    x, kwargs = _x(), _rules(kind)
    results = []
    for m in (None, MODES[mode]):
        net = Net(m)
        fully_shard(net.block, mesh=one_rank_mesh)
        results.append(_run(net, kwargs, x))
    _assert_same(results[1], results[0])


# --- torch.compile -------------------------------------------------------------------------------
# Compiled graphs have no weight-cast cache (a weight used twice is cast twice, eager casts it
# once), so the reference is the same function compiled without checkpointing. aot_eager runs the
# traced aten graph as is.


@functools.cache
def _compiled_run(mode: str | None, kind: str, of_module: bool = False) -> Any:
    """Loss and gradients of `Net` under `mode`'s checkpoint and `kind`'s rules, compiled, on
    `_x()`: computed once per (mode, kind, of_module) and shared by the tests below (a trace of a
    checkpointed block costs a second or two). `of_module`: the call of `Net` itself is compiled
    (module rules give hooks to the matched modules only), not a function calling it."""
    x = _x()
    net = Net(None if mode is None else MODES[mode])
    params = [x, *net.parameters()]
    if of_module:
        f = famp.autocast(net, "c=bf16,o=f32", **_rules(kind))
        loss = torch.compile(f, fullgraph=True, backend="aot_eager")(x).float().pow(2).sum()
    else:
        f = famp.autocast(lambda x: net(x).float().pow(2).sum(), "c=bf16,o=f32", **_rules(kind))
        loss = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    return loss, list(torch.autograd.grad(loss, params))


@pytest.mark.parametrize("mode", list(MODES))  # Dynamo traces reentrant blocks as the others
@pytest.mark.parametrize("kind", ["overrides", "default", "module_rules"])
def test_checkpoint_mode_compiled(mode: str, kind: str) -> None:
    _assert_same(_compiled_run(mode, kind), _compiled_run(None, kind))


def test_checkpoint_compiled_overrides_reach_the_block() -> None:
    # Dynamo hands the checkpoint to famp's mode and would trace the block without it: the
    # overrides must change the compiled result as they change the eager one.
    x = _x()
    overridden = _compiled_run("nonreentrant", "overrides")
    assert not torch.equal(overridden[0], _compiled_run("nonreentrant", "default")[0])
    assert_bitwise_equal(overridden[0], _run(Net(None), _rules("overrides"), x)[0])


def _by_hand(net: Net, x: torch.Tensor, mode: dict[str, Any] | None) -> torch.Tensor:
    """`Net` under `_rules("module_rules")`, written with `torch.autocast` and casts by hand."""
    block = net.block

    def out(t: torch.Tensor) -> torch.Tensor:  # "block.out": "c=f16,o=f16"
        with torch.autocast("cpu", dtype=F16):
            return block.out(t.to(F16)).to(F16)

    def body(h: torch.Tensor) -> torch.Tensor:
        a = block.act(block.inp(h))
        with torch.autocast("cpu", enabled=False):  # "block.norm": "f32"
            a = block.norm(a.float()).float()
        return out(torch.tanh(out(a)))

    with torch.autocast("cpu", dtype=BF16):
        h = net.pre(x)
        h = body(h) if mode is None else checkpoint(body, h, **mode)
        with torch.autocast("cpu", enabled=False):  # "head": "f32"
            y = net.head(h.float()).float()
    return y.pow(2).sum()


def _x_of(batch: int) -> torch.Tensor:
    return torch.randn(batch, 8, generator=torch.Generator().manual_seed(batch)).requires_grad_()


def _grads_of(
    f: Callable[[torch.Tensor], torch.Tensor], net: Net, x: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    loss = f(x)
    return loss, list(torch.autograd.grad(loss, [x, *net.parameters()]))


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("of_module", [False, True], ids=["a function", "the module"])
def test_checkpoint_compiled_module_rules_as_torch_autocast_by_hand(
    mode: str, of_module: bool
) -> None:
    # Dynamo traces a checkpointed block as a subgraph that may not change state outside it, as
    # module scopes do (entered and left inside the block): famp lets it while it traces the call.
    actual = _compiled_run(mode, "module_rules", of_module)
    net = Net(None)
    compiled = torch.compile(
        lambda x: _by_hand(net, x, MODES[mode]), fullgraph=True, backend="aot_eager"
    )
    _assert_same(actual, _grads_of(compiled, net, _x()))
    assert not torch.equal(actual[0], _compiled_run(mode, "default")[0])  # the rules reach it


@pytest.mark.parametrize("dynamic", [True, None])  # None: static, then a recompile (batch 6)
@pytest.mark.parametrize("of_module", [False, True], ids=["a function", "the module"])
def test_checkpoint_compiled_module_rules_dynamic_shapes_and_a_recompile(
    dynamic: bool, of_module: bool
) -> None:
    net, reference = Net(MODES["nonreentrant"]), Net(None)
    rules = _rules("module_rules")
    if of_module:
        f = famp.autocast(net, "c=bf16,o=f32", **rules)
    else:
        f = famp.autocast(lambda x: net(x).float().pow(2).sum(), "c=bf16,o=f32", **rules)
    traced = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=dynamic)

    def compiled(x: torch.Tensor) -> torch.Tensor:
        return traced(x).float().pow(2).sum() if of_module else traced(x)  # type: ignore[no-any-return]

    by_hand = torch.compile(
        lambda x: _by_hand(reference, x, MODES["nonreentrant"]),
        fullgraph=True,
        backend="aot_eager",
        dynamic=dynamic,
    )
    for batch in (4, 6, 5):
        x = _x_of(batch)
        _assert_same(_grads_of(compiled, net, x), _grads_of(by_hand, reference, x))


def test_checkpoint_compiled_module_rules_still_recompute() -> None:
    # With side effects allowed, Dynamo returns the block's intermediates from its subgraph; the
    # block must still be recomputed in backward, not saved (no silent loss of the memory saving).
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def saved(mode: str | None) -> tuple[int, int]:
        seen: dict[str, int] = {}

        def forward(gm: torch.fx.GraphModule, _: Any) -> Any:
            seen["saved"] = len(next(n for n in gm.graph.nodes if n.op == "output").args[0])
            return make_boxed_func(gm.forward)

        def backward(gm: torch.fx.GraphModule, _: Any) -> Any:
            seen["ops"] = sum(n.op == "call_function" for n in gm.graph.nodes)
            return make_boxed_func(gm.forward)

        net = Net(None if mode is None else MODES[mode])
        f = famp.autocast(lambda x: net(x).float().sum(), "c=bf16", **_rules("module_rules"))
        backend = aot_autograd(fw_compiler=forward, bw_compiler=backward)
        torch.compile(f, fullgraph=True, backend=backend)(_x()).backward()
        return seen["saved"], seen["ops"]

    checkpointed, plain = saved("nonreentrant"), saved(None)
    assert checkpointed[0] < plain[0]  # fewer tensors saved for backward
    assert checkpointed[1] > plain[1]  # more ops in backward: the recomputation


class _Checkpointed(nn.Module):
    """`block` checkpointed inside its own forward, as `checkpoint_wrapper` makes it."""

    def __init__(self, block: nn.Module, mode: dict[str, Any]) -> None:
        super().__init__()
        self.block = block
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, **self.mode)


# torch's own: Dynamo reads `.grad` of the non-leaf tensors a compiled block receives.
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@pytest.mark.parametrize("mode", ["nonreentrant", "selective"])
@pytest.mark.parametrize("kind", ["overrides", "module_rules"])
def test_checkpointed_blocks_compiled_inside_an_eager_call(mode: str, kind: str) -> None:
    # torchtitan's recipe: each block checkpointed, then compiled with fullgraph=True, the famp
    # call eager: famp's mode is pushed again inside the block Dynamo traces (a change outside it).
    rules = _rules(kind)
    if kind == "module_rules":  # the same modules, also under the checkpointing wrapper
        rules = {"module_rules": {"*norm": "f32", "*out": "c=f16,o=f16", "head": "f32"}}

    def run(mode: str | None) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
        net = Net(None)
        if mode is not None:
            net.block = _Checkpointed(net.block, MODES[mode])
        net.block.compile(fullgraph=True, backend="aot_eager")
        f = famp.autocast(lambda x: net(x).float().pow(2).sum(), "c=bf16,o=f32", **rules)
        return [_grads_of(f, net, _x_of(batch)) for batch in (4, 6)]  # 6: a recompile

    for actual, expected in zip(run(mode), run(None), strict=True):
        _assert_same(actual, expected)
    assert _side_effects_setting() is False


def _raises_or_equals(
    f: Callable[[torch.Tensor], torch.Tensor],
    net: Net,
    expected: tuple[torch.Tensor, list[torch.Tensor]],
) -> None:
    """`f`'s backward raises torch's check of the recomputation, or its numbers are `expected`'s
    (torch 2.15 recomputes some such blocks with the state they ran in: then they are)."""
    try:
        actual = _grads_of(f, net, _x())
    except torch.utils.checkpoint.CheckpointError as error:
        message = str(error)
    else:
        _assert_same(actual, expected)
        return
    assert "different metadata" in message


@pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global")
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@pytest.mark.parametrize("kind", ["overrides", "module_rules"])
def test_a_compiled_block_checkpointed_inside_an_eager_call_raises_not_wrong_numbers(
    kind: str,
) -> None:
    # The other order, `checkpoint(torch.compile(block))` (non-reentrant): famp sees none of the
    # compiled block's ops, so torch may recompute it without famp's state, and its check of the
    # recomputed tensors' dtypes fails loudly. Compile the checkpointed block instead (above).
    def run(mode: str | None) -> tuple[Callable[[torch.Tensor], torch.Tensor], Net]:
        net = Net(None if mode is None else MODES[mode])
        net.block = torch.compile(net.block, backend="aot_eager")  # type: ignore[assignment]
        return famp.autocast(
            lambda x: net(x).float().pow(2).sum(), "c=bf16,o=f32", **_rules(kind)
        ), net

    torch.compiler.reset()  # else `Block.forward` may be past Dynamo's recompile limit: eager
    expected = _grads_of(*run(None), _x())
    _raises_or_equals(*run("nonreentrant"), expected)


class _BreakingBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.act(self.inp(x)))
        torch._dynamo.graph_break()
        return self.out(torch.tanh(self.out(h)))


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@pytest.mark.parametrize("kind", ["overrides", "module_rules"])
def test_a_graph_break_in_a_checkpointed_block_of_a_compiled_call_raises_not_wrong_numbers(
    kind: str,
) -> None:
    # Dynamo runs the checkpoint eagerly around the block's compiled pieces, which famp's eager
    # bookkeeping does not see: torch may recompute them without famp's state, and says so.
    # torch 2.15 recomputes the block eagerly with the state it ran in: its numbers are then the
    # eager call's (`block.out`'s float16 cast read from torch's cache at its second call), as
    # `torch.autocast` by hand gives there, compiled or not.
    def run(mode: str | None, compiled: bool) -> tuple[Callable[[torch.Tensor], torch.Tensor], Net]:
        net = Net(None if mode is None else MODES[mode])
        net.block = _BreakingBlock()
        f = famp.autocast(lambda x: net(x).float().pow(2).sum(), "c=bf16,o=f32", **_rules(kind))
        return (torch.compile(f, backend="aot_eager") if compiled else f), net

    expected = _grads_of(*run(None, compiled=False), _x())
    _raises_or_equals(*run("nonreentrant", compiled=True), expected)


def _side_effects_setting() -> bool:
    return bool(torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint)


def test_checkpoint_side_effects_stay_refused_outside_famps_traces() -> None:
    net = Net(MODES["nonreentrant"])
    rules = _rules("module_rules")
    f = famp.autocast(lambda x: net(x).float().pow(2).sum(), "c=bf16,o=f32", **rules)
    torch.compile(f, fullgraph=True, backend="aot_eager")(_x())
    assert _side_effects_setting() is False

    def broken(x: torch.Tensor) -> torch.Tensor:  # a trace that raises inside the call
        torch._dynamo.graph_break()
        return net(x).float().sum()

    with pytest.raises(Exception, match="graph_break"):
        torch.compile(famp.autocast(broken, "c=bf16", **rules), fullgraph=True)(_x())
    assert _side_effects_setting() is False
    seen: list[int] = []

    def block(h: torch.Tensor) -> torch.Tensor:  # a side effect of the user's own, outside famp
        seen.append(1)
        return h * 2

    with pytest.raises(Exception, match="side effect"):
        torch.compile(
            lambda x: checkpoint(block, x, use_reentrant=False), fullgraph=True, backend="aot_eager"
        )(_x())


def test_checkpoint_side_effects_setting_of_the_users_own_is_left_as_it_is() -> None:
    net = Net(MODES["nonreentrant"])
    f = famp.autocast(lambda x: net(x).float().sum(), "c=bf16", **_rules("module_rules"))
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        torch.compile(f, fullgraph=True, backend="aot_eager")(_x())
        assert _side_effects_setting() is True
    assert _side_effects_setting() is False


# --- a block that ends in a custom autograd Function --------------------------------------------


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a)
        return a * a

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (a,) = ctx.saved_tensors  # non-reentrant: this read may start the recomputation
        return torch.tanh(a) * grad  # an op famp must not intercept (its backward is not famp's)


class EndsInFunction(nn.Module):
    def __init__(self, mode: dict[str, Any] | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.mode = mode

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return _Square.apply(self.block(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) if self.mode is None else checkpoint(self.body, x, **self.mode)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", ["overrides", "module_rules"])
def test_checkpoint_mode_block_ending_in_a_custom_function(mode: str, kind: str) -> None:
    x = _x()
    kwargs = (
        {"rules": famp.default_rules("cpu").override({"linear": "float32", "tanh": "lower"})}
        if kind == "overrides"
        else {"module_rules": {"block.1": "c=f16,o=f16"}}
    )
    expected = _run(EndsInFunction(None), kwargs, x)
    _assert_same(_run(EndsInFunction(MODES[mode]), kwargs, x), expected)


@pytest.mark.parametrize("mode", list(MODES))
def test_checkpoint_mode_recomputation_that_raises_leaves_nothing_behind(mode: str) -> None:
    import torch.nn.modules.module as torch_module

    from famp._autocast import hooks, recompute

    lin, runs = nn.Linear(4, 4), [0]

    def block(x: torch.Tensor) -> torch.Tensor:
        runs[0] += 1
        if runs[0] == 2:
            raise KeyError("boom in the recomputation")
        return lin(x)

    x = torch.randn(2, 4, requires_grad=True)
    f = famp.autocast(
        lambda x: checkpoint(block, x, **MODES[mode]).float().sum(),
        "c=bf16",
        module_rules={"": "f32"},
    )
    with pytest.raises(KeyError, match="boom in the recomputation"):
        f(x).backward()
    assert famp.autocast(lambda x: x * 2, "c=bf16")(x).dtype == BF16  # the next call cleans up
    assert recompute.calls() == []
    assert hooks.post_hook not in torch_module._global_forward_hooks.values()
    assert torch._C._len_torch_function_stack() == 0


@pytest.mark.parametrize("mode", list(MODES))
def test_modules_called_outside_famp_after_a_recomputation_that_raised_are_torchs(
    mode: str,
) -> None:
    # The raise leaves famp's state of the block entered (its node's exit hook never runs); a
    # module called next, outside any famp call, got its inputs cast by the block's module rule.
    lin, runs = nn.Linear(4, 4), [0]

    def block(x: torch.Tensor) -> torch.Tensor:
        runs[0] += 1
        if runs[0] == 2:
            raise KeyError("boom in the recomputation")
        return lin(x)

    model, x = nn.Sequential(nn.Linear(4, 4), nn.Tanh()), torch.randn(2, 4)
    expected = model(x)
    f = famp.autocast(
        lambda x: checkpoint(block, x, **MODES[mode]).float().sum(),
        "c=bf16",
        module_rules={"": "c=bf16"},
    )
    with pytest.raises(KeyError, match="boom in the recomputation"):
        f(torch.randn(2, 4, requires_grad=True)).backward()
    assert_bitwise_equal(model(x), expected)


class _RaisesInBackward(nn.Module):
    """Runs a backward through a checkpointed block of its own, whose recomputation raises."""

    def __init__(self, mode: dict[str, Any], catches: bool) -> None:
        super().__init__()
        self.lin, self.mode, self.catches, self.runs = nn.Linear(8, 8), mode, catches, 0

    def block(self, h: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        if self.runs % 2 == 0:
            raise KeyError("boom in the recomputation")
        return self.lin(h)  # type: ignore[no-any-return]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = checkpoint(self.block, x.detach().requires_grad_(), **self.mode)
        try:
            y.float().sum().backward()
        except KeyError:
            if not self.catches:
                raise
        return x


class _Catches(nn.Module):
    def __init__(self, mode: dict[str, Any], inside: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.o = _RaisesInBackward(mode, catches=inside)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with contextlib.suppress(KeyError):
            h = self.o(h)
        return self.b(torch.tanh(h) @ self.b.weight)  # type: ignore[no-any-return]


@pytest.mark.parametrize("inside", [False, True], ids=["caught by the parent", "caught inside"])
@pytest.mark.parametrize("mode", ["reentrant", "nonreentrant"])
def test_a_backward_that_raised_in_a_recomputation_and_was_caught_leaves_no_scope_behind(
    mode: str, inside: bool
) -> None:
    # The raise leaves the recomputation's records on famp's stack (its node's exit hook never
    # runs). The ruled module's exit went to them, and famp kept the rule's float16 scope, and
    # torch's state, for the rest of the call: outputs 0.008 off. famp now drops them at the next
    # module exit or op (only outside backward, where no recomputation runs).
    x = _x()
    model = _Catches(MODES[mode], inside)
    f = famp.autocast(model, "c=bf16,o=f32", module_rules={"o": "c=f16,o=f32"})
    out = f(x)
    actual = (out, *torch.autograd.grad(out.pow(2).sum(), [x, model.a.weight, model.b.weight]))
    assert recompute.calls() == []
    with torch.autocast("cpu", dtype=BF16):
        h = model.a(x)
        if inside:  # the rule's casts of its input and output ("c=f16,o=f32")
            h = h.to(F16).float()
        ref = model.b(torch.tanh(h) @ model.b.weight).float()
    expected = (ref, *torch.autograd.grad(ref.pow(2).sum(), [x, model.a.weight, model.b.weight]))
    for a, e in zip(actual, expected, strict=True):
        assert_bitwise_equal(a, e)


@pytest.mark.parametrize("mode", ["reentrant", "nonreentrant"])
def test_overrides_apply_after_a_backward_that_raised_in_a_recomputation_was_caught(
    mode: str,
) -> None:
    # The recomputation's records left on the stack marked the call suspended (a nested call
    # governing), so its mode ran the ops after the raise without their overrides: the linear
    # below in bfloat16, not float32 (0.02 off). No module hook runs there to clean up.
    torch.manual_seed(0)
    w, runs = torch.randn(8, 8, requires_grad=True), [0]

    def block(h: torch.Tensor) -> torch.Tensor:
        runs[0] += 1
        if runs[0] % 2 == 0:
            raise KeyError("boom in the recomputation")
        return F.linear(h, w).tanh()

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = checkpoint(block, x.detach().requires_grad_(), **MODES[mode])
        with contextlib.suppress(KeyError):
            y.float().sum().backward()
        return F.linear(x, w)

    x, rules = _x(), famp.default_rules("cpu").override({"linear": "float32"})
    out = famp.autocast(fn, "c=bf16,o=f32", rules=rules)(x)
    assert recompute.calls() == []
    assert_bitwise_equal(out, F.linear(x, w))


# A view of a non-leaf written through another view of its base, then handed to a custom Function
# (a reentrant checkpoint's too) after an op under no_grad (an EMA step). torch regenerates the
# view's grad_fn holding the view's lock and sets its `_backward_hooks` through Python, which
# reached famp's mode; famp read that grad_fn (looking for a reentrant checkpoint's node after a
# grad-free op) and waited for the lock forever. Run in a process of its own: a deadlock in C++
# outlasts pytest's timeout.
_VIEW_WRITTEN_THEN_APPLIED = """
import sys, torch, torch.nn.functional as F, famp
from torch.utils.checkpoint import checkpoint

class Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2

torch.manual_seed(0)
w = torch.nn.Parameter(torch.randn(8, 8) * 0.4)
x = torch.randn(4, 8, requires_grad=True)

def f(x):
    v = (x * 2).reshape(4, 8)
    with torch.no_grad():
        w.mul_(1.0)
    v.t()[2:5] = x.t()[:3]
    h = Double.apply(v)
    return checkpoint(lambda t: F.linear(t, w), h, use_reentrant=True).float()

def grads(out):
    x.grad = w.grad = None
    out.pow(2).sum().backward()
    return [out, x.grad, w.grad]

with torch.autocast("cpu", dtype=torch.bfloat16):
    expected = grads(f(x))
rules = famp.default_rules("cpu").override({"tanh": "float32"})
for kwargs in ({"track_casts": True}, {"rules": rules}):
    actual = grads(famp.autocast(f, "c=bf16,o=f32", **kwargs)(x))
    assert all(torch.equal(a, e) for a, e in zip(actual, expected)), kwargs
print("equal")
"""


def test_a_view_written_through_another_view_then_applied_after_a_grad_free_op() -> None:
    root = pathlib.Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    result = subprocess.run(
        [sys.executable, "-c", _VIEW_WRITTEN_THEN_APPLIED],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "equal"


def test_a_compiled_call_after_a_recomputation_that_raised_cleans_up() -> None:
    import torch.nn.modules.module as torch_module

    from famp._autocast import hooks, recompute

    lin, runs = nn.Linear(8, 8), [0]

    def block(x: torch.Tensor) -> torch.Tensor:
        runs[0] += 1
        if runs[0] == 2:
            raise KeyError("boom in the recomputation")
        return lin(x)

    f = famp.autocast(
        lambda x: checkpoint(block, x, use_reentrant=False).float().sum(),
        "c=bf16",
        **_rules("overrides"),
    )
    with pytest.raises(KeyError, match="boom in the recomputation"):
        f(_x()).backward()
    net = Net(None)
    rules = _rules("module_rules")
    g = famp.autocast(lambda x: net(x).float().pow(2).sum(), "c=bf16,o=f32", **rules)
    compiled = torch.compile(g, fullgraph=True, backend="aot_eager")  # it failed in Dynamo before
    by_hand = torch.compile(lambda x: _by_hand(net, x, None), fullgraph=True, backend="aot_eager")
    x = _x()
    _assert_same(_grads_of(compiled, net, x), _grads_of(by_hand, net, x))
    assert recompute.calls() == []
    assert torch._C._len_torch_function_stack() == 0
    assert hooks._users == {"pre": 0, "post": 0, "traced": 0}  # the left replay's, taken back
    assert hooks.pre_hook not in torch_module._global_forward_pre_hooks.values()


class _Offloaded(Net):
    """`Net` whose forward saves its activations through `hooks` (`None`: none of its own)."""

    def __init__(self, mode: dict[str, Any] | None, hooks: Callable[[], Any]) -> None:
        super().__init__(mode)
        self.hooks = hooks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.hooks():
            return super().forward(x)


HOOKS: dict[str, Callable[[], Any]] = {
    "save_on_cpu": torch.autograd.graph.save_on_cpu,  # activation offloading
    "clone": functools.partial(
        torch.autograd.graph.saved_tensors_hooks, lambda t: t.clone(), lambda t: t
    ),
}


@pytest.mark.parametrize("where", ["around the call", "inside the call"])
@pytest.mark.parametrize("hooks", list(HOOKS))
@pytest.mark.parametrize("mode", [None, "nonreentrant", "reentrant"])
@pytest.mark.parametrize("kind", ["overrides", "module_rules", "default", "track_casts"])
def test_saved_tensor_hooks_that_recompute_nothing_change_no_bit(
    kind: str, mode: str | None, hooks: str, where: str
) -> None:
    # famp tells a non-reentrant checkpoint's block by the saved-tensor hooks active around an
    # op. Other hooks there (activation offloading, a user's pack and unpack), around the whole
    # call or inside it, with or without a checkpointed block within, make famp bracket nodes
    # that are never recomputed: the loss and the gradients stay those of the plain call. With
    # `track_casts` famp watches every op under the default rules, whose bfloat16 casts of the
    # weight `Block` uses twice come from torch's cast cache: kept for the whole call, as there.
    x = _x()
    kwargs = {"track_casts": True} if kind == "track_casts" else _rules(kind)
    expected = _run(Net(None), kwargs, x)
    if where == "around the call":
        with HOOKS[hooks]():
            actual = _run(Net(MODES[mode] if mode else None), kwargs, x)
    else:
        actual = _run(_Offloaded(MODES[mode] if mode else None, HOOKS[hooks]), kwargs, x)
    _assert_same(actual, expected)


class _DropoutNet(nn.Module):
    """A checkpointed block that draws random numbers (dropout) between overridden ops."""

    def __init__(self, mode: dict[str, Any] | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.drop, self.norm = nn.Linear(8, 16), nn.Dropout(0.5), nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)
        self.mode = mode

    def block(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(F.gelu(self.drop(self.inp(h))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(x) if self.mode is None else checkpoint(self.block, x, **self.mode)
        return self.head(h)


@pytest.mark.parametrize("mode", list(MODES))
def test_checkpoint_mode_block_with_dropout(mode: str) -> None:
    # torch's checkpoint restores the random state for the recomputation; famp's replay must
    # neither draw numbers nor lose its overrides around the dropout: the same mask, the same bits.
    rules = famp.default_rules("cpu").override(
        {"gelu": "lower", "layer_norm": "lower", "dropout": "lower"}
    )
    x = _x()
    results = []
    for net in (_DropoutNet(None), _DropoutNet(MODES[mode])):
        torch.manual_seed(123)
        results.append(_run(net, {"rules": rules}, x))
    _assert_same(results[1], results[0])


@pytest.mark.parametrize("mode", [None, *MODES])
def test_overrides_leave_views_and_inputs_to_torch_in_checkpointed_blocks(mode: str | None) -> None:
    # Calls that return a view of their input (an einsum permutation) or the input itself (an
    # eval dropout) run uncast, as torch's autocast runs them, so writes through their results
    # reach the input, also while a checkpointed block is recomputed; the contraction and the
    # dropout that drops keep the float32 override. Against torch.autocast with the override's
    # casts written out: outputs and gradients, bit for bit.
    rules = famp.default_rules("cpu").override({"einsum": "float32", "dropout": "float32"})
    w = torch.randn(5, 5, requires_grad=True)

    def writes(y: torch.Tensor) -> torch.Tensor:
        h = y * 2
        torch.einsum("bij->bji", h).mul_(3)  # torch: into h, through the view
        F.dropout(h, 0.5, training=False).add_(1)  # torch: into h, the result itself
        return h

    def block(y: torch.Tensor) -> torch.Tensor:
        return F.dropout(torch.einsum("bij,jk->bik", writes(y), w), 0.3, training=True)

    def reference(y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16):
            h = writes(y)
            with torch.autocast("cpu", enabled=False):
                return F.dropout(torch.einsum("bij,jk->bik", h.float(), w), 0.3, training=True)

    def run(f: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor, ...]:
        y = torch.randn(2, 5, 5, generator=torch.Generator().manual_seed(1)).to(BF16)
        y.requires_grad_()
        w.grad = None
        torch.manual_seed(0)
        out = f(y) if mode is None else checkpoint(f, y, **MODES[mode])
        out.float().square().sum().backward()
        assert y.grad is not None
        assert w.grad is not None
        return out, y.grad, w.grad

    ours = run(famp.autocast(block, "c=bf16,o=f32", rules=rules))
    theirs = run(reference)
    assert ours[0].dtype == F32
    assert ours[1].dtype == BF16
    for a, b in zip(ours, theirs, strict=True):
        assert_bitwise_equal(a, b)


def _gelu_tanh_or(kind: str, module_rules: dict[str, str]) -> dict[str, Any]:
    """The overrides of the blocks below (GELU in float32, tanh lowered), or `module_rules`."""
    if kind == "overrides":
        return {"rules": famp.default_rules("cpu").override({"gelu": "float32", "tanh": "lower"})}
    return {"module_rules": module_rules}


class EndsUnseen(nn.Module):
    """A block whose last op makes nodes famp does not see behind its output's: `einsum` (its
    `bmm` inside, a view on top) or `nn.MultiheadAttention` (a torch Python function famp does
    not enter when no override reaches it; a transpose on top)."""

    def __init__(self, mode: dict[str, Any] | None, end: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = Block()
        if end == "einsum":
            self.v = nn.Parameter(torch.randn(8, 8))
        else:
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.end = end
        self.mode = mode

    def body(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(x)
        if self.end == "einsum":
            return torch.einsum("ij,jk->ik", h, self.v)
        return self.attn(h[None], h[None], h[None], need_weights=False)[0][0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) if self.mode is None else checkpoint(self.body, x, **self.mode)


@pytest.mark.parametrize("mode", [*MODES, "nonreentrant, no determinism check"])
@pytest.mark.parametrize("kind", ["overrides", "module_rules"])
@pytest.mark.parametrize("end", ["einsum", "attention"])
def test_checkpoint_mode_block_ending_in_nodes_famp_does_not_see(
    mode: str, kind: str, end: str
) -> None:
    # The checkpoint recomputes from the first node whose backward unpacks a saved tensor: here
    # one behind the block's last output. famp's state must be entered there too (it raised
    # CheckpointError before, or a dtype error in backward without the determinism check).
    x = _x()
    kwargs = _gelu_tanh_or(kind, {"block.out": "c=f16,o=f16"})
    how = MODES.get(mode, {"use_reentrant": False, "determinism_check": "none"})
    expected = _run(EndsUnseen(None, end), kwargs, x)
    _assert_same(_run(EndsUnseen(how, end), kwargs, x), expected)


class EndsInAShift(EndsUnseen):
    """einsum, then a parameter added: the add's node saves nothing, so the walk reaches the
    parameter's accumulator right behind it."""

    def __init__(self, mode: dict[str, Any] | None) -> None:
        super().__init__(mode, "einsum")
        self.shift = nn.Parameter(torch.randn(8))

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return super().body(x) + self.shift


def test_checkpoint_bracketing_reaches_inner_nodes_and_leaves_accumulators_alone() -> None:
    net = EndsInAShift(MODES["nonreentrant"])
    x = _x()
    out = famp.autocast(net, "c=bf16,o=f32", **_gelu_tanh_or("overrides", {}))(x)
    nodes, stack, seen = [], [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append(node)
        stack.extend(n for n, _ in node.next_functions)
    marked = {node.name() for node in nodes if recompute.BRACKETED in node.metadata}
    assert "BmmBackward0" in marked  # einsum's, behind the view famp saw
    leaves = [node for node in nodes if hasattr(node, "variable")]  # AccumulateGrad
    assert len(leaves) == len([x, *net.parameters()])
    assert all(recompute.BRACKETED not in node.metadata for node in leaves)
    out.float().sum().backward()


class NestedBlocks(nn.Module):
    """A checkpointed function that ends in a checkpointed block of its own."""

    def __init__(self, outer: dict[str, Any] | None, inner: dict[str, Any] | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = Block()
        self.b = Block()
        self.outer, self.inner = outer, inner

    def body(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h) if self.inner is None else checkpoint(self.b, h, **self.inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) if self.outer is None else checkpoint(self.body, x, **self.outer)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True")
@pytest.mark.parametrize("outer", list(MODES))
@pytest.mark.parametrize("inner", list(MODES))
@pytest.mark.parametrize("kind", ["overrides", "module_rules"])
def test_checkpoint_modes_nested(outer: str, inner: str, kind: str) -> None:
    # Reentrant in reentrant: the inner node is made in the outer recomputation after famp's
    # last event there, and torch runs its recomputation in a nested backward that drops the
    # torch function modes; it was recomputed under torch's default rules, every gradient off
    # at bfloat16's rounding, silently, before famp wrapped the outer block's function.
    x = _x()
    kwargs = _gelu_tanh_or(kind, {"b.out": "c=f16,o=f16", "a.norm": "f32"})
    expected = _run(NestedBlocks(None, None), kwargs, x)
    _assert_same(_run(NestedBlocks(MODES[outer], MODES[inner]), kwargs, x), expected)


class ThreeDeep(nn.Module):
    """Three checkpointed functions, each ending in the next one's checkpoint."""

    def __init__(self, mode: dict[str, Any] | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = Block(), Block(), Block()
        self.mode = mode

    def _in(self, fn: Callable[..., torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return fn(x) if self.mode is None else checkpoint(fn, x, **self.mode)

    def middle(self, g: torch.Tensor) -> torch.Tensor:
        return self._in(self.c, self.b(g))  # ends in a block

    def outer(self, h: torch.Tensor) -> torch.Tensor:
        return self._in(self.middle, self.a(h))  # ends in a block, which ends in a block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._in(self.outer, x)


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True")
@pytest.mark.parametrize("kind", ["overrides", "module_rules"])
def test_checkpoint_reentrant_three_deep(kind: str) -> None:
    x = _x()
    kwargs = _gelu_tanh_or(kind, {"c.out": "c=f16,o=f16", "b.norm": "f32"})
    expected = _run(ThreeDeep(None), kwargs, x)
    _assert_same(_run(ThreeDeep(MODES["reentrant"]), kwargs, x), expected)


class EndsInAWriteToAView(nn.Module):
    """A block whose result was last written through a view of it: the base's node (torch's
    `CopySlices`) runs the in-place op's backward, which unpacks its saved tensors."""

    def __init__(self, mode: dict[str, Any] | None, after: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = Block()
        self.s = nn.Parameter(torch.randn(4))
        self.mode, self.after = mode, after

    def body(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(x) * 1.0
        h[:, :4].mul_(self.s.to(h.dtype))
        return h * 1 if self.after else h  # `* 1`: a node that saves nothing, in front of it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) if self.mode is None else checkpoint(self.body, x, **self.mode)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", ["overrides", "module_rules"])
@pytest.mark.parametrize("after", [False, True])
def test_checkpoint_mode_block_ending_in_a_write_through_a_view(
    mode: str, kind: str, after: bool
) -> None:
    # Raised CheckpointError before (non-reentrant, selective): the base's node went unbracketed.
    x = _x()
    kwargs = _gelu_tanh_or(kind, {"block.out": "c=f16,o=f16"})
    expected = _run(EndsInAWriteToAView(None, after), kwargs, x)
    _assert_same(_run(EndsInAWriteToAView(MODES[mode], after), kwargs, x), expected)
