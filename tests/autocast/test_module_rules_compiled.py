"""Module rules in a compiled call of a module: Dynamo traces hooks on the matched modules only
(`famp._autocast.tree_hooks`), where an eager call or a compiled call of a function sees every
module through global hooks. Each case against `torch.autocast` written by hand, compiled the
same way, and the eager call against it eagerly."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import famp
from tests.helpers import assert_bitwise_equal

BF16, F16 = torch.bfloat16, torch.float16
RULES = {
    "block": "c=f32,o=bf16",  # its own hooks run in its scope: after famp's entry, before its exit
    "block.2": "c=f16,o=f16",  # a rule inside a rule
    "shared": "c=f16,o=f16",  # called twice, once with a keyword input
    "act": "c=f32,o=f32",  # writes into its input: left uncast, as torch leaves it
    "sub": "c=bf16,o=bf16",  # called through a nested famp call in float32, which governs it
}


class _Scaled(nn.Linear):
    def forward(self, input: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        out = super().forward(input)
        return out if scale is None else out * scale


class _Tree(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.block.register_forward_pre_hook(lambda m, args: (args[0] + 0.1,))
        self.block.register_forward_hook(lambda m, args, out: out * 1.1 + 0.01)
        self.shared = _Scaled(8, 8)
        self.act = nn.ReLU(inplace=True)
        self.sub = nn.Linear(8, 8)
        self.nested = famp.autocast(self.sub, "f32")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(self.a(x))
        h = self.shared(h) + self.shared(h, scale=x)  # `x`, float32, cast to float16
        h = h + self.act(h)  # `h` too is relu'd in place: twice relu(h)
        return self.nested(h)  # type: ignore[no-any-return]


def _by_hand(model: _Tree, x: torch.Tensor, root_rule: bool) -> torch.Tensor:
    """torch.autocast nested as the rules say, each input cast to its scope's compute dtype and
    each output to its output dtype."""
    with torch.autocast("cpu", dtype=BF16):
        if root_rule:  # "": c=bf16,o=bf16, the call's own dtype
            x = x.to(BF16)
        h = model.a(x)
        with torch.autocast("cpu", enabled=False):
            b = h.float() + 0.1
            b = model.block[1](model.block[0](b))
            with torch.autocast("cpu", dtype=F16):
                b = model.block[2](b.half()).half()
            h = (b * 1.1 + 0.01).to(BF16)
        with torch.autocast("cpu", dtype=F16):
            h = model.shared(h.half()).half() + model.shared(h.half(), scale=x.half()).half()
        with torch.autocast("cpu", enabled=False):
            r = model.act(h)
        h = h + r.float()
        with torch.autocast("cpu", enabled=False):
            h = model.sub(h.float()).float()
        if root_rule:
            h = h.to(BF16)
    return h.float()


def _run(fn: Any, model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    out = fn(x)
    return [out, *torch.autograd.grad(out.pow(2).sum(), list(model.parameters()))]


@pytest.mark.parametrize("root_rule", [False, True], ids=["root unmatched", "root matched"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_a_compiled_call_of_a_module_gives_each_matched_module_its_scope(
    dynamic: bool, root_rule: bool
) -> None:
    torch._dynamo.reset()
    model, ref = _Tree(), _Tree()
    rules = {"": "c=bf16,o=bf16", **RULES} if root_rule else RULES
    f = famp.autocast(model, "c=bf16,o=f32", module_rules=rules)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    by_hand = torch.compile(
        lambda x: _by_hand(ref, x, root_rule), fullgraph=True, backend="aot_eager", dynamic=dynamic
    )
    own = [(m._forward_pre_hooks, m._forward_hooks) for m in model.modules()]
    for batch in (4, 6):  # a second shape: a recompile, or the dynamic graph
        x = torch.randn(batch, 8, generator=torch.Generator().manual_seed(batch))
        # Compiled graphs cast `shared`'s weight at each of its two calls; eagerly torch's cache
        # casts it once (its gradient then sums in float16), in famp's call as by hand.
        pairs = [(compiled, by_hand), (f, lambda x: _by_hand(ref, x, root_rule))]
        for famp_fn, torch_fn in pairs:
            expected = _run(torch_fn, ref, x)
            assert expected[0].dtype == torch.float32
            for a, e in zip(_run(famp_fn, model, x), expected, strict=True):
                assert_bitwise_equal(a, e)
    # Each module's own hook dicts back, themselves, holding only its own hooks.
    assert own == [(m._forward_pre_hooks, m._forward_hooks) for m in model.modules()]
    assert [len(m._forward_pre_hooks) for m in model.modules()] == [0, 0, 1, 0, 0, 0, 0, 0, 0]
    model.block.register_forward_hook(lambda m, args, out: None, prepend=True).remove()


class _Probe(nn.Module):
    """Writes down, as its forward runs, how many global forward hooks torch holds."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.nn.modules.module as torch_module

        self.seen.append(
            len(torch_module._global_forward_pre_hooks) + len(torch_module._global_forward_hooks)
        )
        return x


@pytest.mark.parametrize("fn", ["the module", "a function calling it"])
def test_a_compiled_call_of_a_module_adds_no_global_hook(fn: str) -> None:
    # Any global hook sends every module call through torch's slow hook path, which Dynamo then
    # traces at each module call. A compiled call of the module itself needs none; a function
    # calling it does (its roots are found as they are entered), as do eager calls.
    torch._dynamo.reset()
    probe = _Probe()
    model = nn.Sequential(nn.Linear(4, 4), probe, nn.Linear(4, 4))
    target = model if fn == "the module" else (lambda x: model(x))
    f = famp.autocast(target, "c=bf16,o=f32", module_rules={"2": "c=f32"})
    x = torch.randn(3, 4)
    expected = f(x)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert_bitwise_equal(compiled(x), expected)
    eager, traced = probe.seen
    assert eager == 3  # famp's pre-hooks (the second: fast-path modules' keywords), forward hook
    assert traced == (0 if fn == "the module" else 2)
