"""famp's `torch.library` operators pass `torch.library.opcheck`.

`famp::unscale` (out of place), `famp::unscale_` (the kernel in place, whose mutations inductor
reinplaces) and `famp::select_` (a whole tree's choice in place) stand for famp's work in compiled
graphs. A schema that hides a mutation or an alias, or a fake function whose sizes or strides
differ from the real outputs, would let the compiler reorder, reuse or drop buffers: other
numbers, silently. opcheck runs each operator and checks its schema against what it does, its
autograd registration, its fake function against the real results, and AOT dispatch with dynamic
shapes.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from famp._scaling import choice, kernels

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _grads(device: str, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    grads = [
        torch.randn(3, 4, generator=gen),
        torch.randn(5, generator=gen),
        torch.randn(4, 2, generator=gen).t(),  # not contiguous: the fake must keep its strides
        torch.randn(2, 3, 4, 4, generator=gen).to(memory_format=torch.channels_last),
        torch.randn(0, generator=gen),
    ]
    grads[1][2] = math.inf
    return [g.to(device=device, dtype=dtype) for g in grads]


def _cases(device: str) -> dict[str, tuple[Any, tuple[Any, ...]]]:
    """Each operator on gradients of each dtype the kernel runs on `device`."""
    inv = torch.tensor(0.5, device=device)
    cases: dict[str, tuple[Any, tuple[Any, ...]]] = {}
    for dtype in (torch.float32, torch.float16, torch.float64):
        if not kernels.kernel_runs(device, dtype):
            continue
        found = torch.zeros((), device=device)
        cases[f"unscale {dtype}"] = (kernels.unscale_op, (_grads(device, dtype), found, inv))
        cases[f"unscale_ {dtype}"] = (
            kernels.unscale_in_place_op,
            (_grads(device, dtype), found.clone(), inv),
        )
    if device == "cpu":  # famp::select_ has a CPU kernel only: elsewhere select_tree uses where
        pred = torch.tensor(False)
        others = [g * 2 - 1 for g in _grads(device, F32)]  # what a false pred copies in
        cases["select_"] = (choice.select_op, (pred, _grads(device, F32), others))
    return cases


F32 = torch.float32


@pytest.mark.parametrize("device", DEVICES)
def test_famps_operators_pass_torchs_opcheck(device: str) -> None:
    for name, (op, args) in _cases(device).items():
        results = torch.library.opcheck(op, args)
        assert set(results.values()) == {"SUCCESS"}, (name, results)
