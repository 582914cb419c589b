"""What a module rule reaches: the module's own forward hooks, and the module by its path under
whichever root the call enters it from."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import famp
from tests.helpers import assert_bitwise_equal

BF16 = torch.bfloat16


class _Hooked(nn.Module):
    """A linear layer whose own forward hook adds a product (an adapter added by a hook)."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.w2 = nn.Parameter(torch.randn(8, 8))
        self.checkpointed = checkpointed
        self.lin.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
        self.lin.register_forward_hook(lambda m, args, out: out @ self.w2 + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return torch.relu(checkpoint(self.lin, x, use_reentrant=False))
        return torch.relu(self.lin(x))


def _grads(out: torch.Tensor, model: nn.Module) -> list[torch.Tensor]:
    return [out, *torch.autograd.grad(out.float().pow(2).sum(), list(model.parameters()))]


@pytest.mark.parametrize("checkpointed", [False, True])
def test_module_rule_applies_to_the_modules_own_forward_hooks(checkpointed: bool) -> None:
    # torch runs famp's global forward hook before the module's own: the rule's scope must still
    # hold for the module's hooks, and its output cast apply to what they return, as a nested
    # famp.autocast call of the module gives (the docs' equivalent) and casts written by hand.
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    ruled = _Hooked(checkpointed)
    rules = {"lin": "c=f32,o=bf16"}
    actual = _grads(famp.autocast(ruled, "c=bf16,o=f32", module_rules=rules)(x), ruled)

    nested = _Hooked(checkpointed)
    inner = famp.autocast(nested.lin, "c=f32,o=bf16")
    call = famp.autocast(lambda x: torch.relu(inner(x)), "c=bf16,o=f32")
    by_call = _grads(call(x), nested)

    ref = _Hooked(checkpointed=False)
    with torch.autocast("cpu", dtype=BF16):
        with torch.autocast("cpu", enabled=False):
            h = (torch.nn.functional.linear(x * 2, ref.lin.weight, ref.lin.bias) @ ref.w2 + 1).to(
                BF16
            )
        out = torch.relu(h).float()
    expected = _grads(out, ref)
    for a, b, e in zip(actual, by_call, expected, strict=True):
        assert_bitwise_equal(a, e)
        assert_bitwise_equal(b, e)


@pytest.mark.parametrize("dynamic", [False, True])
def test_module_rule_applies_to_the_modules_own_forward_hooks_compiled(dynamic: bool) -> None:
    # Dynamo cannot trace a hook handle's creation: famp replaces the module's hook dict by a copy
    # with its own hook last while it traces, and puts the module's own back (the same object).
    # Each shape, the first call and a recompile after a new batch size, against eager famp.
    ruled = _Hooked(checkpointed=False)
    own = ruled.lin._forward_hooks
    hooks = list(own.values())
    rules = {"lin": "c=f32,o=bf16"}
    f = famp.autocast(ruled, "c=bf16,o=f32", module_rules=rules)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for batch in (4, 4, 6):
        x = torch.randn(batch, 8, generator=torch.Generator().manual_seed(batch))
        actual = _grads(compiled(x), ruled)
        expected = _grads(f(x), ruled)
        for a, e in zip(actual, expected, strict=True):
            assert_bitwise_equal(a, e)
        assert ruled.lin._forward_hooks is own
        assert list(own.values()) == hooks


class _RootHooked(nn.Module):
    """A root whose own forward hook calls a submodule (`sub`) that a rule matches."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.sub = nn.Linear(8, 8)
        self.register_forward_hook(lambda m, args, out: self.sub(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("of", ["module", "function"])
def test_a_submodule_called_from_the_roots_own_forward_hook_keeps_its_rule(
    of: str, compiled: bool
) -> None:
    # torch runs famp's global forward hook before the root's own: famp left the root there, and
    # a submodule the root's hook called was a root of its own (path "", no rule; outputs 0.003
    # off, eagerly and in a compiled call of a function). famp leaves the root after its own
    # hooks, as it leaves a matched module with hooks of its own.
    model, x = _RootHooked(), torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    rules = {"sub": "c=f16,o=f32"}
    fn = model if of == "module" else (lambda x: model(x))
    f: Callable[..., Any] = famp.autocast(fn, "c=bf16,o=f32", module_rules=rules)

    def by_hand(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16):
            h = model.a(x)
            with torch.autocast("cpu", dtype=torch.float16):
                return model.sub(h.half()).float()  # type: ignore[no-any-return]

    if compiled:
        f = torch.compile(f, fullgraph=True, backend="aot_eager")
        by_hand = torch.compile(by_hand, fullgraph=True, backend="aot_eager")
    for a, e in zip(_grads(f(x), model), _grads(by_hand(x), model), strict=True):
        assert_bitwise_equal(a, e)


class _CatchesChild(nn.Module):
    """Calls `child`, which a global pre-hook refuses, catches that, and goes on (`lin`)."""

    def __init__(self) -> None:
        super().__init__()
        self.child, self.lin = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with contextlib.suppress(LookupError):
            self.child(x)
        return self.lin(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("of", ["module", "function"])
def test_a_global_pre_hook_that_raises_for_a_child_caught_in_the_parent_keeps_the_parents_rule(
    of: str,
) -> None:
    # A global pre-hook registered before famp's raises, so famp's entry hook never runs for the
    # child; torch still runs famp's forward hook (always called). famp left the parent's scope
    # there: the parent's `lin` ran in bfloat16, not its rule's float16 (0.004 off). famp now
    # leaves only a module it entered.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _CatchesChild(), nn.Linear(8, 8))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))

    def refuse(module: nn.Module, args: Any) -> None:
        if module is model[1].child:
            raise LookupError("refused")

    fn = model if of == "module" else (lambda x: model(x))
    f: Callable[..., Any] = famp.autocast(fn, "c=bf16,o=f32", module_rules={"1": "c=f16,o=f32"})
    handle = torch.nn.modules.module.register_module_forward_pre_hook(refuse)
    params = [p for name, p in model.named_parameters() if "child" not in name]  # used ones

    def used(out: torch.Tensor) -> list[torch.Tensor]:
        return [out, *torch.autograd.grad(out.float().pow(2).sum(), params)]

    try:
        actual = used(f(x))
    finally:
        handle.remove()
    with torch.autocast("cpu", dtype=BF16):
        h = model[0](x)
        with torch.autocast("cpu", dtype=torch.float16):
            h = model[1].lin(h.half()).float()
        out = model[2](h).float()
    for a, e in zip(actual, used(out), strict=True):
        assert_bitwise_equal(a, e)


def _linear(m: nn.Linear, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.nn.functional.linear(x.to(dtype), m.weight.to(dtype), m.bias.to(dtype))


@pytest.mark.parametrize("compiled", [False, True])
def test_module_rule_paths_start_at_the_root_each_call_enters(compiled: bool) -> None:
    # A submodule called on its own is a root, its path "" (no rule); inside its parent it is
    # "1", which the rule names. Either order of the two calls gives each its own rule.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    x = torch.randn(4, 8)

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return model[1](x), model(x), model[1](x)

    f: Callable[..., Any] = famp.autocast(fn, "c=bf16,o=f32", module_rules={"1": "c=f32,o=f32"})
    if compiled:
        f = torch.compile(f, fullgraph=True, backend="aot_eager")
    alone, whole, again = f(x)
    in_bf16 = _linear(model[1], x, BF16).float()
    expected = _linear(model[1], _linear(model[0], x, BF16).float(), torch.float32)
    assert_bitwise_equal(alone, in_bf16)
    assert_bitwise_equal(whole, expected)
    assert_bitwise_equal(again, in_bf16)


def _parametrized(kind: str) -> nn.Module:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
    if kind == "orthogonal":
        nn.utils.parametrizations.orthogonal(block[0])
    elif kind == "weight_norm":
        nn.utils.parametrizations.weight_norm(block[0])
    else:
        nn.utils.parametrizations.spectral_norm(block[0])
        block.eval()  # its power iteration writes buffers in train mode: one state for both runs
    model = nn.Sequential(block, nn.Linear(6, 2))
    return model.train() if kind != "spectral_norm" else model


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("kind", ["orthogonal", "weight_norm", "spectral_norm"])
@pytest.mark.parametrize("lower", [torch.float16, BF16])
def test_module_rules_leave_parametrizations_to_the_module_that_reads_the_weight(
    lower: torch.dtype, kind: str, compiled: bool
) -> None:
    # "0.*" matches the modules of a parametrized weight too ("0.0.parametrizations.weight.0"),
    # whose input is the float32 master parameter: cast to the rule's compute dtype, orthogonal's
    # gradient came back NaN in float16, weight_norm's rounded differently, spectral_norm raised.
    # famp leaves them to the scope of the layer that reads the weight, as torch.autocast around
    # the block gives (activation input cast, cache cleared where the dtype switches).
    model, x = _parametrized(kind), torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    name = {torch.float16: "f16", BF16: "bf16"}[lower]
    f: Callable[..., Any] = famp.autocast(
        model, "c=bf16,o=f32", module_rules={"0.*": f"c={name},o={name}"}
    )
    if compiled:
        f = torch.compile(f, fullgraph=True, backend="aot_eager")
    actual = _grads(f(x), model)

    with torch.autocast("cpu", dtype=BF16):
        torch.clear_autocast_cache()
        with torch.autocast("cpu", dtype=lower):
            h = model[0][1](model[0][0](x.to(lower)).to(lower)).to(lower)
        torch.clear_autocast_cache()
        out = model[1](h).float()
    expected = _grads(out, model)
    assert not any(g.isnan().any() for g in expected)
    for a, e in zip(actual, expected, strict=True):
        assert_bitwise_equal(a, e)


class _Interrupted(nn.Module):
    """A linear layer that raises KeyboardInterrupt while `fire` is set (Ctrl-C mid-forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.fire = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fire:
            raise KeyboardInterrupt
        return self.lin(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("rule", ["f32", "c=f16,o=f16"])
def test_a_keyboard_interrupt_in_a_matched_module_with_hooks_leaves_torch_as_it_was(
    rule: str,
) -> None:
    # torch runs always-call forward hooks on an Exception only: after a KeyboardInterrupt the
    # hook famp gave the module to leave its scope stays on it till its next call, outside any
    # famp call. It must do nothing then: it had restored the autocast state the module's entry
    # had found, turning torch's autocast on for the process (a plain call then ran in bfloat16).
    torch.manual_seed(0)
    block = _Interrupted()
    model = nn.Sequential(block, nn.Linear(4, 4))
    block.register_forward_hook(lambda m, args, out: out)  # a hook of the user's own
    x = torch.randn(2, 4)
    before_state = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
    expected = model(x)
    block.fire = True
    with pytest.raises(KeyboardInterrupt):
        famp.autocast(model, "c=bf16,o=f32", module_rules={"0": rule})(x)
    block.fire = False
    assert (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")) == before_state
    assert_bitwise_equal(model(x), expected)
    assert (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")) == before_state
    assert len(block._forward_hooks) == 1  # famp's own left with that call
    assert_bitwise_equal(model(x), expected)


class _InterruptedLayer(nn.TransformerEncoderLayer):
    """An encoder layer (torch's inference fast path in eval mode without grad) that raises
    KeyboardInterrupt while `fire` is set."""

    fire = False

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.fire:
            raise KeyboardInterrupt
        return super().forward(*args, **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [{"track_casts": True}, {"module_rules": {"1": "c=f16,o=f32"}}, {"module_rules": {"0": "f32"}}],
)
def test_a_keyboard_interrupt_in_a_fast_path_module_leaves_no_state_behind(
    kwargs: dict[str, Any],
) -> None:
    # famp leaves the layer to torch's fast path, with torch function handling off (and a rule's
    # autocast state) till its exit, which torch's always-call hooks do not see after a
    # KeyboardInterrupt: the call's region now closes what is left. torch function handling had
    # stayed off in the thread, so a later call's op override did nothing, silently.
    torch.manual_seed(0)
    layer = _InterruptedLayer(16, 2, 32, dropout=0.0, batch_first=True)
    model = nn.Sequential(nn.Linear(16, 16), layer).eval()
    x = torch.randn(2, 5, 16)
    rules = famp.default_rules("cpu").override({"linear": "float32"})
    overridden = famp.autocast(lambda x: model[0](x), "c=bf16,o=f32", rules=rules)
    expected = overridden(x)
    state = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
    layer.fire = True
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        famp.autocast(model, "c=bf16,o=f32", **kwargs)(x)
    layer.fire = False
    assert torch._C._is_torch_function_enabled()
    assert (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")) == state
    assert_bitwise_equal(overridden(x), expected)
    assert expected.dtype == torch.float32
    assert not torch.nn.modules.module._global_forward_pre_hooks
    assert not torch.nn.modules.module._global_forward_hooks


class _SelfCalling(nn.Module):
    """A block whose forward calls the block itself once more (a recursion of depth 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, inner: bool = False) -> torch.Tensor:
        h = self.a(x)
        return self.b(h if inner else self(h, True))  # type: ignore[no-any-return]


@pytest.mark.parametrize("compute", ["bf16", "f16"])
@pytest.mark.parametrize("kind", ["eager", "compiled"])
def test_a_matched_module_that_calls_itself_with_hooks_of_its_own_keeps_its_scope(
    kind: str, compute: str
) -> None:
    # famp leaves a matched module with forward hooks of its own from a hook it adds for that
    # call. A call of the module inside itself adds a second one: both ran at the inner exit,
    # and the rest of the outer call ran out of the rule's scope (before 2026-11-30). The
    # reference: the rule written into the block's forward by hand, for each call of it.
    torch.manual_seed(0)
    block, head = _SelfCalling(), nn.Linear(8, 4)
    model = nn.Sequential(block, head)
    seen: list[torch.dtype] = []
    block.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    dtype = {"bf16": BF16, "f16": torch.float16}[compute]
    x = torch.randn(3, 8)
    f = famp.autocast(model, "f32", module_rules={"0": f"c={compute},o=f32"})
    if kind == "compiled":
        f = torch.compile(f, fullgraph=True, backend="aot_eager")
    actual = _grads(f(x), model)
    forward = _SelfCalling.forward

    def by_hand(self: _SelfCalling, x: torch.Tensor, inner: bool = False) -> torch.Tensor:
        with torch.autocast("cpu", dtype=dtype):
            return forward(self, x.to(dtype), inner).float()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_SelfCalling, "forward", by_hand)
        # Compiled, as torch.autocast compiled: no cast cache, each use of a weight casts it.
        reference = torch.compile(model, backend="aot_eager") if kind == "compiled" else model
        expected = _grads(reference(x), model)
    for a, e in zip(actual, expected, strict=True):
        assert_bitwise_equal(a, e)
    assert seen[:2] == [dtype, dtype]  # the hooks see each call's output before its cast
    assert len(block._forward_hooks) == 1  # famp's own gone with the call
