"""`famp.all_finite` against `torch.isfinite(x).all()`, eagerly on random bit patterns.

Eagerly, plain dense floating tensors are decided by their minima and maxima (`torch.aminmax`,
one read each); every other tree keeps `torch.isfinite`. Both must give torch's answer.
"""

from __future__ import annotations

import math
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given
from torch.utils._python_dispatch import TorchDispatchMode

import famp
from tests.scaling.test_scaler_unscale import random_bits

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SPECIALS = (math.nan, -math.nan, math.inf, -math.inf)


def _torch_answer(leaves: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(x).all()) for x in leaves)


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(func._overloadpacket.__name__)  # aten names: isfinite decomposes
        return func(*args, **(kwargs or {}))


def _layout(x: torch.Tensor, how: str) -> torch.Tensor:
    if how == "transposed" and x.dim() >= 2:
        return x.transpose(0, 1)
    if how == "strided" and x.dim() >= 1:
        return x[::2]
    return x


@given(
    specs=st.lists(
        st.tuples(
            st.sampled_from(_DTYPES),
            st.sampled_from([(), (0,), (1,), (7,), (3, 5), (2, 0, 4), (300_001,), (513, 1024)]),
            st.sampled_from(["dense", "transposed", "strided"]),
            st.none() | st.sampled_from(_SPECIALS),
            st.integers(0, 2**31 - 1),
        ),
        min_size=1,
        max_size=5,
    ),
    finite_bits=st.booleans(),
)
def test_all_finite_equals_torch_isfinite(
    specs: list[tuple[torch.dtype, tuple[int, ...], str, float | None, int]], finite_bits: bool
) -> None:
    leaves = []
    for dtype, shape, how, special, seed in specs:
        gen = torch.Generator().manual_seed(seed)
        # Random bit patterns hold NaNs and infinities of every payload; finite ones hold none.
        x = (
            torch.rand(shape, generator=gen).to(dtype) * 2 - 1
            if finite_bits
            else random_bits(shape, dtype, gen)
        )
        if special is not None and x.numel():
            x.view(-1)[int(torch.randint(x.numel(), (), generator=gen))] = special
        leaves.append(_layout(x, how))
    expected = _torch_answer(leaves)
    with _Ops() as ops:
        got = famp.all_finite(leaves)
    assert got.dtype == torch.bool
    assert got.shape == ()
    assert bool(got) == expected
    # Eagerly each non-empty tensor is read once, by aminmax; isfinite (which decomposes into
    # abs, ne, eq and mul) reads only the stacked extremes.
    assert ops.names.count("aminmax") == sum(1 for x in leaves if x.numel())
    assert ops.names.count("abs") == (1 if any(x.numel() for x in leaves) else 0)
    assert famp.all_finite({"only": leaves[0]}).item() == _torch_answer(leaves[:1])


def test_trees_the_extremes_cannot_decide_keep_isfinite() -> None:
    # Integer, sparse and complex leaves, and trees that hold one, take isfinite.
    nan = torch.tensor([1.0, math.nan])
    cases: list[tuple[list[torch.Tensor], bool]] = [
        ([torch.ones(3), torch.arange(3)], True),
        ([nan.to_sparse(), torch.ones(2)], False),
        ([torch.ones(2), torch.tensor([1 + 1j, complex(math.inf, 0)])], False),
    ]
    for leaves, expected in cases:
        with _Ops() as ops:
            got = famp.all_finite(leaves)
        assert "aminmax" not in ops.names
        assert bool(got) == expected
    assert famp.all_finite([torch.empty(0), torch.empty(2, 0)]).item() is True
    # Meta tensors: shapes only, as isfinite gives them.
    meta = famp.all_finite([torch.ones(2, device="meta"), torch.ones((), device="meta")])
    assert (meta.device.type, meta.dtype, meta.shape) == ("meta", torch.bool, ())


@pytest.mark.parametrize("threads", [1, 2])
def test_big_tensors_with_one_nan_anywhere(threads: int) -> None:
    # Multithreaded reductions split a tensor: the NaN is in the last, the first or a middle part.
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for position in (0, 1_234_567, 4_999_999):
            for special in _SPECIALS:
                x = torch.ones(5_000_000)
                x[position] = special
                assert famp.all_finite([torch.ones(3), x]).item() is False
        assert famp.all_finite([torch.ones(5_000_000)]).item() is True
    finally:
        torch.set_num_threads(previous)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_fsdp2_dtensor_grads_give_one_plain_answer_on_every_rank_as_torch() -> None:
    # Before 2026-12-01 all_finite returned a DTensor on DTensor leaves (torch 2.13:
    # Partial(product), so each rank read its own shard's answer; 2.14, 2.15: Replicate), and
    # select_tree with it raised "mixed torch.Tensor and DTensor".
    from tests.helpers import spawn_ranks
    from tests.scaling.all_finite_worker import CASES, worker

    rows = spawn_ranks(worker, 2, lambda r, port, q: (r, 2, port, q), 2 * len(CASES), 240)
    assert sorted((row[0], row[1]) for row in rows) == sorted((c, r) for c in CASES for r in (0, 1))
    for case, rank, answers, torch_says, found_inf, scaler_found, chosen, stepped in rows:
        assert torch_says == (case == "finite"), (case, rank)
        for kind, dtype, shape, value in answers:  # eagerly, then compiled
            assert (kind, dtype, shape) == ("Tensor", torch.bool, ())
            assert value == torch_says, (case, rank)
        assert found_inf == float(not torch_says)  # unscale_and_check's, reduced over the mesh
        assert scaler_found in (None, found_inf)  # GradScaler.unscale_'s, through DTensor dispatch
        assert chosen == [0.0 if torch_says else 1.0] * 2
        assert stepped
