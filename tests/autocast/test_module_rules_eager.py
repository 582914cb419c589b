"""Module rules eagerly, on the short paths: ops outside every matched module go straight to
torch, and famp's own casts of a matched module's (or a nested call's) inputs and outputs go
round famp's modes. Neither may change a number, a user's torch function mode's view of the ops,
or a tensor subclass's."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.overrides import TorchFunctionMode

import famp
from tests.helpers import assert_bitwise_equal

BF16, F32 = torch.bfloat16, torch.float32
RULES = {"1": "f32", "3": "f32"}  # LayerNorm and the last Linear in float32


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 4))


def _by_hand(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """`RULES` under "c=bf16,o=f32", written with torch.autocast."""
    with torch.autocast("cpu", dtype=BF16):
        h = model[0](x)
        with torch.autocast("cpu", enabled=False):
            h = model[1](h.float())
        h = model[2](h)
        with torch.autocast("cpu", enabled=False):
            return model[3](h.float())


class _Log(TorchFunctionMode):
    """A user's torch function mode: records each function it sees, with its first argument's
    dtype and the dtype it was asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[Any, Any]] = []

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        self.seen.append((func, kwargs.get("dtype")))
        return func(*args, **kwargs)


class _Logged(torch.Tensor):
    """A tensor subclass that records the torch functions called on it."""

    calls: ClassVar[list[Any]] = []

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        cls.calls.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("override", [False, True])
def test_module_rules_give_torch_autocast_by_hand_bits_forward_and_backward(
    override: bool,
) -> None:
    model, x = _model(), torch.randn(4, 8)
    rules = famp.default_rules("cpu").override({"softmax": "lower"}) if override else None
    f = famp.autocast(model, "c=bf16,o=f32", rules=rules, module_rules=RULES)
    for _ in range(2):  # the second call with the first call's paths and caches gone
        out = f(x)
        expected = _by_hand(model, x)
        assert_bitwise_equal(out, expected)
        params = list(model.parameters())
        grads = torch.autograd.grad(out.pow(2).sum(), params)
        expected_grads = torch.autograd.grad(expected.pow(2).sum(), params)
        for a, e in zip(grads, expected_grads, strict=True):
            assert_bitwise_equal(a, e)


def test_a_weight_written_between_two_uses_outside_a_matched_module_is_cast_afresh() -> None:
    # The op after the write runs outside every matched module, where famp hands it straight to
    # torch: the write must still drop the cast of the weight made before it.
    model, x = _model(), torch.randn(4, 8)
    first_layer = model[0]

    def twice(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        first = model(x)
        with torch.no_grad():
            first_layer.weight.mul_(0.5)
        return first, model(x)

    f = famp.autocast(twice, "c=bf16,o=f32", module_rules=RULES)
    weight = first_layer.weight.detach().clone()
    first, second = f(x)
    with torch.no_grad():
        first_layer.weight.copy_(weight)
    assert_bitwise_equal(first, _by_hand(model, x))
    with torch.no_grad():
        first_layer.weight.mul_(0.5)
    assert_bitwise_equal(second, _by_hand(model, x))  # a fresh torch.autocast: a fresh cast
    assert not torch.equal(first, second)


def test_a_users_torch_function_mode_sees_famps_casts_of_a_matched_modules_inputs() -> None:
    model, x = _model(), torch.randn(4, 8)
    log = _Log()

    def under_log(x: torch.Tensor) -> torch.Tensor:
        with log:
            return F.relu(model(x))

    out = famp.autocast(under_log, "c=bf16,o=f32", module_rules=RULES)(x)
    assert_bitwise_equal(out, F.relu(_by_hand(model, x)))
    assert (torch.Tensor.to, F32) in log.seen  # LayerNorm's input, cast to float32 by famp
    # A nested call casts its inputs as a matched module does: the user's mode sees that too.
    log.seen.clear()
    inner = famp.autocast(model[1], "f32")

    def nested(x: torch.Tensor) -> torch.Tensor:
        with log:
            return inner(model[0](x))

    famp.autocast(nested, "c=bf16,o=f32")(x)
    assert (torch.Tensor.to, F32) in log.seen


def test_a_tensor_subclass_input_of_a_matched_module_sees_famps_cast() -> None:
    model, x = _model(), torch.randn(4, 8)
    _Logged.calls = []
    logged = x.as_subclass(_Logged)
    out = famp.autocast(model, "c=bf16,o=f32", module_rules={"0": "bf16"})(logged)
    assert torch.Tensor.to in _Logged.calls  # the rule's cast of the input went through it
    assert_bitwise_equal(out.as_subclass(torch.Tensor), _by_hand_first_bf16(model, x))


def _by_hand_first_bf16(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """`module_rules={"0": "bf16"}` under "c=bf16,o=f32", written with torch.autocast."""
    with torch.autocast("cpu", dtype=BF16):
        h = model[0](x.to(BF16))
        return model[3](model[2](model[1](h))).float()


def test_calls_with_module_rules_leave_no_global_hook_behind() -> None:
    # torch 2.13-2.15: removing a global forward hook registered with keyword inputs leaves its
    # id in torch's private dict of such hooks. famp's calls with module rules register one each:
    # the dict grew by one entry per call, and `torch.compile(module)` then warned of global
    # hooks for the rest of the process (before 2026-11-30).
    import torch.nn.modules.module as torch_module

    model, x = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), torch.randn(2, 4)
    model[0].register_forward_hook(lambda m, args, out: None)  # famp leaves it from its own hook
    f = famp.autocast(model, "f32", module_rules={"0": "c=bf16,o=f32"})
    with_kwargs = dict(torch_module._global_forward_hooks_with_kwargs)
    for _ in range(3):
        f(x)
    assert torch_module._global_forward_hooks_with_kwargs == with_kwargs
    # The suite's warnings are errors: "Using `torch.compile(module)` when there are global hooks"
    torch.compile(model, backend="eager")(x)


class _Shared(nn.Module):
    """`l0` is also `layers.2`: one module under two paths (`named_modules()` lists it once)."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.l0 = nn.Linear(8, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8), self.l0])
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("pattern", ["layers.[12]", "layers.2", "l0"])
def test_a_rule_naming_either_path_of_a_shared_module_applies(pattern: str, compiled: bool) -> None:
    """A module held under two paths took a rule only through the first (`l0`): `layers.[12]`
    left `layers.2` in bfloat16 silently, and `layers.2` warned that it matched nothing, before
    2026-12-01. Against torch by hand: `layers.1` (where matched) and `layers.2` in float32."""
    m, x = _Shared(), torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = m.layers[0](x)
        if pattern == "layers.[12]":
            with torch.autocast("cpu", enabled=False):
                h = m.layers[1](h.float())
        else:
            h = m.layers[1](h)
        with torch.autocast("cpu", enabled=False):
            expected = m.layers[2](h.float())
    f = famp.autocast(m, "c=bf16,o=f32", module_rules={pattern: "f32"})
    if compiled:
        torch._dynamo.reset()
        f = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert_bitwise_equal(f(x), expected)


def test_rules_giving_a_shared_module_two_policies_are_refused() -> None:
    m = _Shared()
    f = famp.autocast(m, "c=bf16", module_rules={"l0": "f32", "layers.2": "c=f16,o=f16"})
    with pytest.raises(ValueError, match=r"held under the paths 'l0' and 'layers.2', two policies"):
        f(torch.randn(4, 8))
