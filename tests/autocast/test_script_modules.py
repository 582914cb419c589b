"""TorchScript modules inside a famp.autocast call: rules as a whole, the rest said aloud.

A TorchScript module runs its ops in TorchScript's interpreter, past famp's torch function mode
and module hooks; torch's autocast still casts them by the autocast state around the module.
famp sets that state to the module's scope, so a module rule matching the script module (or a
module around it) applies to it as a whole, as `torch.autocast` written by hand around it does;
op overrides and rules for modules inside it cannot apply, and famp warns once instead of
computing other numbers silently. References: `torch.autocast` by hand, bit for bit.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import famp
from tests.helpers import assert_trees_bitwise_equal

BF16 = torch.bfloat16


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.lin(x)) * x


def _torchscript(block: nn.Module, how: str) -> nn.Module:
    with warnings.catch_warnings():  # torch 2.13 deprecates TorchScript, 2.15 warns of it too
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        if how == "script":
            return torch.jit.script(block)  # type: ignore[no-any-return]
        return torch.jit.trace(block, torch.randn(4, 8))  # type: ignore[no-any-return]


class _Model(nn.Module):
    def __init__(self, how: str, nest: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        block = _torchscript(_Block(), how)
        self.b = nn.Sequential(block) if nest else block  # "b" or "b.0": the script module
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(self.a(x)))


def _x() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def _outputs_and_grads(f: Any, model: nn.Module) -> list[torch.Tensor]:
    model.zero_grad()
    y = f(_x())
    y.float().pow(2).sum().backward()
    return [y.detach(), *(p.grad for p in model.parameters())]  # type: ignore[misc]


def _by_hand(model: _Model, block_in_float32: bool, linear_in_float32: bool = False) -> list[Any]:
    """torch.autocast(bfloat16) with the block under autocast off (its inputs cast), and the
    model's own linears (not the block's) in float32 where an override says so."""

    def linear(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        if not linear_in_float32:
            return layer(h)  # type: ignore[no-any-return]
        with torch.autocast("cpu", enabled=False):
            return layer(h.float())  # type: ignore[no-any-return]

    model.zero_grad()
    with torch.autocast("cpu", dtype=BF16):
        h = linear(model.a, _x())
        if block_in_float32:
            with torch.autocast("cpu", enabled=False):
                h = model.b(h.float())
        else:
            h = model.b(h)
        y = linear(model.head, h).float()
    y.pow(2).sum().backward()
    return [y.detach(), *(p.grad for p in model.parameters())]


def _autocast_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, famp.AutocastWarning)]


@pytest.mark.parametrize("how", ["script", "trace"])
@pytest.mark.parametrize(
    ("pattern", "nest"),
    [("b", False), ("b.0", True), ("b", True)],  # the script module, a module around it
)
def test_a_module_rule_applies_to_a_script_module_as_a_whole(
    how: str, pattern: str, nest: bool
) -> None:
    model = _Model(how, nest)
    f = famp.autocast(model, "c=bf16,o=f32", module_rules={pattern: "c=f32"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = [_outputs_and_grads(f, model) for _ in range(2)]
    assert _autocast_warnings(caught) == []
    expected = _by_hand(model, block_in_float32=True)
    assert_trees_bitwise_equal(actual[0], expected)
    assert_trees_bitwise_equal(actual[1], expected)


@pytest.mark.parametrize("how", ["script", "trace"])
def test_op_overrides_warn_once_and_apply_outside_a_script_module(how: str) -> None:
    model = _Model(how)
    rules = famp.default_rules("cpu").override({"linear": "float32"})
    f = famp.autocast(model, "c=bf16,o=f32", rules=rules)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = [_outputs_and_grads(f, model) for _ in range(2)]
    messages = _autocast_warnings(caught)
    assert len(messages) == 1, messages
    assert "op overrides do not apply inside the TorchScript module _Block" in messages[0]
    # Inside the script module torch's default rule casts its linear to bfloat16.
    expected = _by_hand(model, block_in_float32=False, linear_in_float32=True)
    assert_trees_bitwise_equal(actual[0], expected)
    assert_trees_bitwise_equal(actual[1], expected)


@pytest.mark.parametrize("pattern", ["b.lin", "*lin"])
def test_a_rule_for_a_module_inside_a_script_module_warns(pattern: str) -> None:
    model = _Model("script")
    f = famp.autocast(model, "c=bf16,o=f32", module_rules={pattern: "c=f32"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = _outputs_and_grads(f, model)
    messages = _autocast_warnings(caught)
    assert len(messages) == 1, messages
    assert "module rules matching Linear do not apply inside" in messages[0]
    assert_trees_bitwise_equal(y, _by_hand(model, block_in_float32=False))


def _mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w


class _CallsScripted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) / 3)
        with warnings.catch_warnings():  # deprecated, as above
            warnings.simplefilter("ignore", DeprecationWarning)
            warnings.simplefilter("ignore", FutureWarning)
            self.mm = torch.jit.script(_mm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.mm(x, self.w))


@pytest.mark.parametrize(("rule", "inner"), [("f32", None), ("c=f16,o=f16", torch.float16)])
def test_a_scripted_function_inside_a_matched_module_follows_its_rule_eagerly(
    rule: str, inner: torch.dtype | None
) -> None:
    # famp sees no op of a torch.jit.script function; torch's autocast casts them by torch's
    # state, which eagerly is the matched module's from its entry to its exit.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _CallsScripted())
    x = torch.randn(4, 8)
    actual = famp.autocast(model, "c=bf16,o=f32", module_rules={"1": rule})(x)
    with torch.autocast("cpu", dtype=BF16):
        h = model[0](x)
        with torch.autocast("cpu", dtype=inner or BF16, enabled=inner is not None):
            out = model[1](h.to(inner or torch.float32))
        expected = out.to(inner or torch.float32).float()
    assert_trees_bitwise_equal(actual, expected)


@pytest.mark.parametrize("how", ["script", "trace"])
def test_torchscript_casts_leave_nothing_in_torchs_cast_cache(how: str) -> None:
    # famp does not watch a TorchScript module's ops (its module rules' switches between lower
    # dtypes empty torch's cache only where a weight read in one is read in the other): it
    # relies on TorchScript's autocast casting without torch's cache, checked here on the
    # installed torch. A float16 read of a weight a TorchScript module read in bfloat16 gets a
    # float16 cast, not the bfloat16 one.
    lin = nn.Linear(8, 8)
    scripted = _torchscript(lin, how)
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for _ in range(3):  # the profiling executor optimizes after its first runs
            assert scripted(x).dtype == torch.bfloat16
        with torch.autocast("cpu", dtype=torch.float16):
            assert lin(x.half()).dtype == torch.float16
