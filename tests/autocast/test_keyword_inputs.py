"""Keyword inputs of a matched module or a nested call: left as given, and said so.

famp casts a matched module's positional inputs to its rule's compute dtype through a global
forward pre-hook, which torch gives no keyword inputs; a nested `famp.autocast` call casts its
positional inputs the same way. Keyword inputs a cast would change are left as they are, and
eagerly famp warns once per transformed function (`famp.AutocastWarning`) instead of computing a
different number silently. What famp computes then is pinned against `torch.autocast` by hand.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

import famp
from tests.helpers import assert_bitwise_equal

BF16 = torch.bfloat16


class _Product(nn.Module):
    """Elementwise ops only: autocast casts nothing here, so only famp's input cast can."""

    def forward(self, x: Any = None, scale: Any = None, mask: Any = None) -> torch.Tensor:
        y = x * scale if scale is not None else x * x
        return y if mask is None else y.masked_fill(mask, 0.0)


class _Model(nn.Module):
    def __init__(self, call: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.b = _Product()
        self.call = call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, g = self.a(x), self.a(x * 0.7)  # bfloat16 under the call's policy
        if self.call == "keywords":
            return self.b(x=h, scale=g)
        if self.call == "positional":
            return self.b(h, g)
        if self.call == "compute_dtype":  # keyword inputs a cast would not change
            return self.b(x=h.float(), scale=g.float())
        if self.call == "not_castable":  # float64, bool, an int: no cast changes them
            return self.b(h.float(), scale=g.double(), mask=h > 0).float()
        raise AssertionError(self.call)


def _x() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def _call(model: nn.Module) -> Any:
    return famp.autocast(model, "c=bf16,o=f32", module_rules={"b": "c=f32"})


def _keyword_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [
        str(w.message)
        for w in caught
        if issubclass(w.category, famp.AutocastWarning) and "keyword inputs" in str(w.message)
    ]


def test_a_matched_modules_keyword_inputs_are_left_as_given_with_one_warning() -> None:
    model = _Model("keywords")
    f = _call(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = f(_x()), f(_x())
    messages = _keyword_warnings(caught)
    assert len(messages) == 1, messages  # once per transformed function
    assert "'x', 'scale'" in messages[0], messages[0]
    assert "'b' (_Product)" in messages[0], messages[0]
    assert "torch.float32" in messages[0], messages[0]
    # What famp computes: the product of the bfloat16 keyword inputs, in bfloat16, as torch
    # computes it inside `torch.autocast(enabled=False)` given them uncast.
    with torch.autocast("cpu", dtype=BF16):
        h, g = model.a(_x()), model.a(_x() * 0.7)
        with torch.autocast("cpu", enabled=False):
            expected = (h * g).float()
    assert_bitwise_equal(first, expected)
    assert_bitwise_equal(second, expected)


@pytest.mark.parametrize("call", ["positional", "compute_dtype", "not_castable"])
def test_inputs_famp_casts_or_no_cast_would_change_give_no_warning(call: str) -> None:
    model = _Model(call)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = _call(model)(_x())
    assert _keyword_warnings(caught) == []
    if call == "positional":  # cast to float32 by the rule, as torch by hand
        with torch.autocast("cpu", dtype=BF16):
            h, g = model.a(_x()), model.a(_x() * 0.7)
            with torch.autocast("cpu", enabled=False):
                expected = h.float() * g.float()
        assert_bitwise_equal(y, expected)


def test_a_matched_module_with_forward_hooks_of_its_own_warns_too() -> None:
    # famp leaves such a module's scope from a hook of the module's own (after theirs).
    model = _Model("keywords")
    model.b.register_forward_hook(lambda module, args, output: output * 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = _call(model)(_x())
    assert len(_keyword_warnings(caught)) == 1
    with torch.autocast("cpu", dtype=BF16):
        h, g = model.a(_x()), model.a(_x() * 0.7)
        with torch.autocast("cpu", enabled=False):
            expected = (h * g * 2).float()
    assert_bitwise_equal(y, expected)


def test_a_nested_calls_keyword_inputs_warn_and_positional_ones_do_not() -> None:
    inner = famp.autocast(_Product(), "c=f32")
    h = torch.randn(4, 8).to(BF16)
    for by_keyword in (True, False):
        outer = famp.autocast(
            (lambda x: inner(x=x, scale=x)) if by_keyword else (lambda x: inner(x, x)), "c=bf16"
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y = outer(h)
        messages = _keyword_warnings(caught)
        if by_keyword:
            assert len(messages) == 1
            assert "nested famp.autocast call of _Product" in messages[0]
            assert_bitwise_equal(y, (h * h).to(BF16))  # as given: bfloat16 in, bfloat16 product
        else:
            assert messages == []
            assert_bitwise_equal(y, (h.float() * h.float()).to(BF16))


class _Raises(nn.Module):
    def forward(self, x: Any = None, scale: Any = None) -> torch.Tensor:
        raise RuntimeError("inside the matched module")


def _raising_hook(module: nn.Module, args: Any, output: Any) -> None:
    if isinstance(module, _Product):  # the matched module
        raise RuntimeError("inside the matched module")


@pytest.mark.parametrize("where", ["forward", "a global forward hook before famp's"])
def test_a_matched_module_that_raises_with_keyword_inputs_leaves_famp_clean(where: str) -> None:
    # torch calls always-called global hooks without the keyword inputs after a forward or a hook
    # before them raised (after a hook, with the forward's output).
    model = _Model("keywords")
    if where == "forward":
        model.b = _Raises()
    f = _call(model)
    handle = None
    if where != "forward":
        handle = torch.nn.modules.module.register_module_forward_hook(_raising_hook)
    try:
        with pytest.raises(RuntimeError, match="inside the matched module"):
            f(_x())
    finally:
        if handle is not None:
            handle.remove()
    good = _Model("positional")
    y = _call(good)(_x())  # no scope or hook left behind: the next call computes as torch
    with torch.autocast("cpu", dtype=BF16):
        h, g = good.a(_x()), good.a(_x() * 0.7)
        with torch.autocast("cpu", enabled=False):
            expected = h.float() * g.float()
    assert_bitwise_equal(y, expected)
    assert not torch.nn.modules.module._global_forward_hooks
