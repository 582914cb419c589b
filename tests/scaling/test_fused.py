"""Eager unscale's compiled one-pass program (famp/_scaling/fused.py) against GradScaler.

The program is compiled once per process and dtype; these tests lower `fused.MIN_BYTES` and
`CHUNK_BYTES` to 0 so that small grads take it, and check that it gives `GradScaler`'s bits for
any count and size of tensors without recompiling, that it steps aside under modes, and that a
failure of `torch.compile` leaves torch's kernel with the same bits and one warning.
"""

from __future__ import annotations

import math
import threading
import warnings
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

import famp
from famp._scaling import eager_cpu, fused
from tests.helpers import assert_bitwise_equal
from tests.scaling.test_scaler import torch_unscale

REAL_MIN_BYTES = fused.MIN_BYTES
REAL_CHUNK_BYTES = eager_cpu.CHUNK_BYTES


@pytest.fixture(autouse=True)
def every_big_tensor_takes_the_program(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(eager_cpu, "CHUNK_BYTES", 0)
    monkeypatch.setattr(fused, "MIN_BYTES", 0)


def install_failing_program(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A fresh process's state whose program raises; returns the argument count of each call."""
    calls: list[int] = []

    def program(*args: Any) -> Any:
        calls.append(len(args))
        raise RuntimeError("no C++ compiler here\nsecond line")

    monkeypatch.setattr(fused, "_program", [program])
    monkeypatch.setattr(fused, "_warmed", set())
    monkeypatch.setattr(fused, "_failure", [])
    return calls


def no_kernel_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the chunked kernel path fail, so a test sees that the program ran instead."""

    def chunked(*args: Any) -> Any:
        raise AssertionError("took the chunked kernel, not the compiled program")

    monkeypatch.setattr(eager_cpu, "_chunked", chunked)


def unscale_equals_gradscaler(grads: list[torch.Tensor], scale_value: float) -> None:
    before = [g.clone() for g in grads]
    expected, expected_found = torch_unscale(scale_value, grads)
    out, found = famp.unscale_and_check(famp.init_scaler(scale_value), grads)
    for o, e, g in zip(out, expected, grads, strict=True):
        assert_bitwise_equal(o, e)
        assert o.stride() == torch.empty_like(g).stride()
    assert_bitwise_equal(found, expected_found)
    for g, b in zip(grads, before, strict=True):
        assert_bitwise_equal(g, b)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(2, 3000), min_size=1, max_size=19),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    seed=st.integers(0, 2**31 - 1),
    bad=st.sampled_from([None, math.nan, math.inf, -math.inf]),
    scale_value=st.sampled_from([1024.0, 1.0, 0.25, 3.0, 2.0**-20]),
)
def test_any_count_and_sizes_equal_gradscaler_without_recompiling(
    sizes: list[int],
    dtype: torch.dtype,
    seed: int,
    bad: float | None,
    scale_value: float,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    grads = [(torch.randn(n, generator=gen) * 1e4).to(dtype) for n in sizes]
    if bad is not None:
        grads[seed % len(grads)][seed % sizes[seed % len(grads)]] = bad
    unscale_equals_gradscaler(grads[:1], scale_value)  # traces this dtype, if not yet
    with pytest.MonkeyPatch.context() as patch, torch.compiler.set_stance("fail_on_recompile"):
        no_kernel_fallback(patch)  # and a recompile would warn: warnings are errors here
        unscale_equals_gradscaler(grads, scale_value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_after_a_compiler_reset_new_sizes_do_not_recompile(dtype: torch.dtype) -> None:
    """`torch.compiler.reset()` drops the program's graphs while famp's record says it is warm.
    The next call then traced on its own tensors and on the padding's equal sizes, which tied
    those sizes: every later call with other sizes recompiled (seconds each), and within a
    `fail_on_recompile` stance gave up the program for the rest of the process. famp now sees
    that the graphs are gone and warms up again, as in a fresh process."""
    gen = torch.Generator().manual_seed(0)
    grads = [(torch.randn(n, generator=gen) * 1e4).to(dtype) for n in (375, 2494, 796, 2494)]
    unscale_equals_gradscaler(grads[:1], 1024.0)  # warmed, if not yet
    torch.compiler.reset()
    unscale_equals_gradscaler(grads[:1], 1024.0)  # the first trace after the reset
    with pytest.MonkeyPatch.context() as patch, torch.compiler.set_stance("fail_on_recompile"):
        no_kernel_fallback(patch)  # and a recompile would warn: warnings are errors here
        unscale_equals_gradscaler(grads, 0.25)
        unscale_equals_gradscaler([g.clone() for g in grads[1:3] * 5], 2.0**-20)  # two calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "layout", ["contiguous", "channels_last", "transposed", "offset view", "gapped slice"]
)
def test_layouts_keep_strides_and_gradscaler_bits(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, layout: str
) -> None:
    gen = torch.Generator().manual_seed(1)
    base = (torch.randn(2, 6, 5, 7, generator=gen) * 1e3).to(dtype)
    base.view(-1)[[3, 100]] = torch.tensor([math.nan, -math.inf]).to(dtype)
    grad = {
        "contiguous": base,
        "channels_last": base.to(memory_format=torch.channels_last),
        "transposed": base.transpose(1, 3),
        "offset view": base.view(-1)[5:].view(415, 1),
        "gapped slice": base[:, 1:, :, ::2],  # not dense: the kernel's functional variant
    }[layout]
    if layout != "gapped slice":
        no_kernel_fallback(monkeypatch)
    unscale_equals_gradscaler([grad, base.view(-1)[:3]], 1024.0)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference"])
def test_thread_counts_and_grad_modes_are_traced_and_exact(
    monkeypatch: pytest.MonkeyPatch, threads: int, mode: str
) -> None:
    # Inference mode, inference tensors and tensors that require grad take the kernel.
    if mode != "inference":
        no_kernel_fallback(monkeypatch)
    grads = [torch.randn(n) * 512 for n in (5, 300, 70)]
    grads[1][7] = math.inf
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        context = {
            "grad": torch.enable_grad,
            "no_grad": torch.no_grad,
            "inference": torch.inference_mode,
        }[mode]
        with context():
            unscale_equals_gradscaler(grads, 512.0)
    finally:
        torch.set_num_threads(previous)
    assert (torch.float32, threads) in fused._warmed


def test_a_failure_warns_once_and_torch_kernel_gives_the_same_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = install_failing_program(monkeypatch)
    grads = [torch.randn(n) * 64 for n in (40, 3, 9)]
    grads[2][0] = math.nan
    with pytest.warns(RuntimeWarning, match=r"RuntimeError: no C\+\+ compiler here\)") as caught:
        unscale_equals_gradscaler(grads, 64.0)
    assert len(caught) == 1
    assert "second line" not in str(caught[0].message)
    assert calls == [2 + fused.ARITY]  # the warm-up call, then never again
    unscale_equals_gradscaler(grads, 64.0)  # no second warning (warnings are errors here)
    assert calls == [2 + fused.ARITY]
    assert not fused.usable(grads)


class PassThrough(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "mode", ["torch function", "dispatch", "default device", "dynamo disabled"]
)
def test_modes_and_disabled_dynamo_take_the_kernel(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    calls = install_failing_program(monkeypatch)
    grads = [torch.randn(n) * 8 for n in (33, 2)]
    grads[0][5] = -math.inf
    expected, expected_found = torch_unscale(8.0, grads)
    context = {
        "torch function": PassThrough,
        "dispatch": lambda: FlopCounterMode(display=False),
        "default device": lambda: torch.device("meta"),  # torch.set_default_device's mode
        "dynamo disabled": lambda: torch._dynamo.config.patch(disable=True),
    }[mode]
    state = famp.init_scaler(8.0)
    with warnings.catch_warnings(), context():
        warnings.simplefilter("error")
        out, found = famp.unscale_and_check(state, grads)
    assert calls == []
    for o, e in zip(out, expected, strict=True):
        assert_bitwise_equal(o, e)
    assert_bitwise_equal(found, expected_found)


def test_the_same_grad_twice_and_views_of_one_storage_are_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    no_kernel_fallback(monkeypatch)
    shared = torch.randn(64, 8) * 300
    shared[3, 3] = math.nan
    unscale_equals_gradscaler([shared, shared, shared[10:], shared.t()], 300.0)


@pytest.mark.parametrize("kind", ["requires grad", "inference tensor"])
def test_tensors_the_program_would_recompile_for_take_the_kernel(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    calls = install_failing_program(monkeypatch)
    if kind == "requires grad":
        grads = [torch.randn(50, requires_grad=True) * 4, torch.randn(9) * 4]
    else:
        with torch.inference_mode():
            grads = [torch.randn(50) * 4, torch.randn(9) * 4]
    expected, expected_found = torch_unscale(4.0, [g.detach() for g in grads])
    with torch.no_grad():
        out, found = famp.unscale_and_check(famp.init_scaler(4.0), grads)
    assert calls == []
    for o, e in zip(out, expected, strict=True):
        assert_bitwise_equal(o, e)
    assert_bitwise_equal(found, expected_found)


@pytest.mark.parametrize("over", [True, False])
def test_real_thresholds_take_the_program_from_min_bytes_on(
    monkeypatch: pytest.MonkeyPatch, over: bool
) -> None:
    # Unpatched thresholds: a call whose big float32 grads total MIN_BYTES takes the program,
    # one a few bytes short the chunked kernel; both give GradScaler's bits.
    monkeypatch.setattr(fused, "MIN_BYTES", REAL_MIN_BYTES)
    monkeypatch.setattr(eager_cpu, "CHUNK_BYTES", REAL_CHUNK_BYTES)
    half = REAL_MIN_BYTES // 2 // 4 + (1 if over else -1)  # float32 elements per tensor
    gen = torch.Generator().manual_seed(5)
    grads = [torch.randn(half, generator=gen) * 4096, torch.randn(half, generator=gen) * 4096]
    grads[1][half // 2] = math.nan
    if over:
        no_kernel_fallback(monkeypatch)
    else:
        calls = install_failing_program(monkeypatch)
    unscale_equals_gradscaler([*grads, torch.randn(3)], 4096.0)
    if not over:
        assert calls == []


def test_threads_calling_at_once_get_gradscaler_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    # Data-parallel loops in threads: the program's first trace is locked, its calls are not.
    no_kernel_fallback(monkeypatch)
    monkeypatch.setattr(fused, "_warmed", set())  # every thread may find it untraced
    failures: list[str] = []

    def work(seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        try:
            for step in range(8):
                sizes = torch.randint(2, 5000, (1 + (seed + step) % 11,), generator=gen)
                grads = [torch.randn(int(n), generator=gen) * 100 for n in sizes]
                if step % 3 == 0:
                    grads[-1][0] = math.nan
                unscale_equals_gradscaler(grads, 100.0)
        except Exception as error:  # reported below, with its thread
            failures.append(f"thread {seed}: {error!r}")

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert failures == []
