"""A module rule applies inside the module's own call only: ops that read a matched module's
parameters outside any call of it (`module.forward(x)` called directly, its weight used by other
code) run under the enclosing policy, as `torch.autocast` by hand around `module(x)` would not
reach them either. Eagerly famp warns about that once per transform, naming the module; a
module called as `module(x)`, one not used at all, and tied weights read by another module's
call do not warn, nor do a compiled submodule's graphs (which famp's hooks do not enter).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional

import famp
from tests.helpers import assert_bitwise_equal

BF16 = torch.bfloat16


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).relu()


class _Model(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(8, 8)
        self.block = _Block()
        self.head = nn.Linear(8, 8)
        self.how = how
        if how == "compiled":  # its graph reads the parameters through famp's mode, grad off
            self.block = torch.compile(self.block, backend="aot_eager")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        if self.how == "forward":  # torch's module hooks do not run: famp never enters `block`
            h = self.block.forward(h)
        elif self.how in ("called", "compiled"):
            h = self.block(h)
        elif self.how == "weight":  # `block`'s parameters used by other code
            h = functional.linear(h, self.block.inner.weight, self.block.inner.bias)
        elif self.how == "unused":
            pass
        elif self.how == "tied":  # `head` shares `block.inner`'s weight; `block` is not called
            self.head.weight = self.block.inner.weight
        return self.head(h)


def _outside_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [
        str(w.message)
        for w in caught
        if issubclass(w.category, famp.AutocastWarning) and "outside any call" in str(w.message)
    ]


def _run(model: nn.Module, traced: bool = False) -> tuple[torch.Tensor, list[str]]:
    f: Any = famp.autocast(model, "c=bf16,o=f32", module_rules={"block": "c=f32"})
    if traced:
        f = torch.compile(f, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = f(x)
        again = f(x)
    assert_bitwise_equal(again, out)
    return out, _outside_warnings(caught)


@pytest.mark.parametrize("how", ["forward", "weight"])
def test_a_matched_modules_parameters_read_outside_its_calls_warn_once(how: str) -> None:
    model = _Model(how)
    out, messages = _run(model)
    assert len(messages) == 1  # once per transform, not once per call
    assert "'block' (_Block)" in messages[0]
    # What ran: the enclosing policy, as torch.autocast around the model, with no scope for block.
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=BF16):
        expected = model(x).float()
    assert_bitwise_equal(out, expected)


@pytest.mark.parametrize("how", ["called", "unused", "tied", "compiled"])
def test_matched_modules_called_unused_or_tied_do_not_warn(how: str) -> None:
    _, messages = _run(_Model(how))
    assert messages == []


def test_a_traced_call_does_not_warn() -> None:
    model = _Model("forward")
    out, messages = _run(model, traced=True)
    assert messages == []  # famp sees no op run in a graph
    _, eager_messages = _run(model)
    assert len(eager_messages) == 1
    assert_bitwise_equal(out, _run(model)[0])
