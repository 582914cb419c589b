"""Compiled on the CPU, `famp.value_and_grad` unscales big gradients where autograd wrote them.

Its gradients are new tensors that only the step reads. Where its float32/float64 gradients
total `fused.MIN_BYTES` (the out-of-place operator would compile famp's eager one-pass program
at the step's first run), famp copies them and unscales the copies in place with torch's kernel
(`famp::unscale_`); inductor drops each copy and writes the kernel's results into the
gradient's own buffer, unless something else may still read it. Smaller ones keep the
out-of-place `famp::unscale`, which compiles faster. Checked here, on both paths (the `path`
fixture lowers `fused.MIN_BYTES` to 0 for the first): the code inductor writes, torch's bits
(its kernel on the same scaled gradients, NaN payloads included) in static and dynamic shapes,
and gradients that share memory (one tensor for two parameters, expanded, a transposed view of
another), where unscaling in place would unscale some element twice. On CUDA (tests marked
`cuda`) every such gradient takes `famp::unscale_`, whatever its size."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._inductor.utils import run_and_get_code

import famp
from famp._scaling import fused
from tests.helpers import assert_bitwise_equal
from tests.scaling.test_scaler import torch_unscale, torch_unscale_anywhere
from tests.scaling.test_scaler_unscale import random_bits

SHAPES = {"a": (12, 20), "b": (20, 12), "c": (7,)}


def _loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ p["a"]) @ p["b"]
    return h.square().mean() + (p["c"] * 3).sum()


def _sgd_step(state: famp.ScalerState, p: dict[str, torch.Tensor], x: torch.Tensor) -> Any:
    _, grads, found_inf, new_state = famp.value_and_grad(_loss)(state, p, x)
    new = {k: p[k] - 0.1 * grads[k] for k in p}
    return new, grads, found_inf, new_state


PATHS = ["in place", "out of place"]


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which operator unscales: `famp::unscale_` for any size where `fused.MIN_BYTES` is 0."""
    if request.param == "in place":
        monkeypatch.setattr(fused, "MIN_BYTES", 0)
    return str(request.param)


def compiled(
    fn: Any, path: str, dynamic: bool | None = None, backend: str = "inductor", tag: str = ""
) -> Any:
    """`fn` compiled with a code object of its own per path: Dynamo caches graphs per code."""
    name = f"{fn.__name__}_{path}_{dynamic}_{backend}_{tag}".replace(" ", "_")
    copy = types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name)
    return torch.compile(copy, fullgraph=True, dynamic=dynamic, backend=backend)


def test_small_gradients_keep_the_out_of_place_operator() -> None:
    """Below `fused.MIN_BYTES`, one out-of-place `famp::unscale` call, as before."""
    gen = torch.Generator().manual_seed(0)
    p = {k: torch.randn(shape, generator=gen) for k, shape in SHAPES.items()}
    x = torch.randn(5, 12, generator=gen)
    step = compiled(_sgd_step, "out of place")
    _, (code,) = run_and_get_code(step, famp.init_scaler(2.0**16), p, x)
    call = code[code.index("def call(") :]
    assert call.count("torch.ops.famp.unscale.default(") == 1
    assert "torch.ops.famp.unscale_.default(" not in call


def test_compiled_value_and_grad_unscales_the_gradients_where_autograd_wrote_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One `famp::unscale_` call on the gradients' own buffers: no copy, no out-of-place unscale.

    The step returns the gradients and the updated parameters, so inductor allocates one buffer
    for each of them (matrix products write the gradients of `a` and `b`, a loop that of `c`).
    A kept copy, or the out-of-place `famp::unscale`, would give each gradient a second buffer.
    """
    gen = torch.Generator().manual_seed(0)
    p = {k: torch.randn(shape, generator=gen) for k, shape in SHAPES.items()}
    x = torch.randn(5, 12, generator=gen)
    monkeypatch.setattr(fused, "MIN_BYTES", 0)  # as if these gradients were big
    state = famp.init_scaler(2.0**16)
    step = compiled(_sgd_step, "in place")
    (new, grads, found_inf, _), (code,) = run_and_get_code(step, state, p, x)
    call = code[code.index("def call(") :]
    assert call.count("torch.ops.famp.unscale_.default(") == 1
    assert "torch.ops.famp.unscale.default(" not in call
    for key, shape in SHAPES.items():
        sizes = r",\s*".join(str(s) for s in shape) + r",?\s*"  # inductor writes (7, )
        allocated = re.findall(rf"empty_strided_cpu\(\({sizes}\)", call)
        assert len(allocated) == 2, (key, allocated)  # the gradient and the new parameter
    # The kernel runs on the buffers the matrix products wrote a's and b's gradients into.
    (unscaled,) = re.findall(r"famp\.unscale_\.default\(\[([^\]]*)\]", call)
    written = set(re.findall(r"extern_kernels\.mm\(.*out=(buf\d+)\)", call))
    assert len(written & set(unscaled.split(", "))) == 2, (unscaled, written)
    eager = _sgd_step(state, p, x)
    assert found_inf.item() == 0.0
    for key in p:  # inductor's matrix products and tanh may round differently from eager's
        torch.testing.assert_close(grads[key], eager[1][key], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(new[key], eager[0][key], rtol=1e-5, atol=1e-6)


# --- torch's bits: its kernel on the same scaled gradients ------------------------------------

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def _bits_loss(p: dict[str, torch.Tensor], c: dict[str, torch.Tensor]) -> torch.Tensor:
    # Each gradient is c[k] times the scale (in c's dtype): the bits of c, NaN payloads and
    # infinities included, scaled by the same inductor loop in both compiled functions below.
    return sum((p[k] * c[k]).sum().float() for k in p)  # type: ignore[return-value]


def _famp_grads(state: famp.ScalerState, p: Any, c: Any) -> Any:
    _, grads, found_inf, new_state = famp.value_and_grad(_bits_loss)(state, p, c)
    return grads, found_inf, new_state


def _scaled_grads(scale: torch.Tensor, p: Any, c: Any) -> Any:
    return torch.func.grad(lambda p: _bits_loss(p, c) * scale)(p)


_COMPILED: dict[tuple[str, str, bool], Any] = {}


def _compiled(name: str, path: str, dynamic: bool) -> Any:
    key = (name, path, dynamic)
    if key not in _COMPILED:
        fn = _famp_grads if name == "famp" else _scaled_grads
        _COMPILED[key] = compiled(fn, path, dynamic)
    return _COMPILED[key]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("scale", [2.0**16, 3.0, 1.0])
def test_compiled_value_and_grad_on_random_bits_equals_torchs_kernel(
    path: str, dynamic: bool, scale: float
) -> None:
    """Random bit patterns of every float dtype, a third of them infinities or NaNs.

    At a scale of 1 the kernel skips its multiply, which keeps NaN payloads: so must famp.
    """
    gen = torch.Generator().manual_seed(int(scale) + dynamic)
    for n in (9, 13):  # dynamic: the second size runs the same graph
        p = {f"g{i}": torch.zeros(n + i, dtype=d) for i, d in enumerate(DTYPES)}
        c = {k: random_bits(v.shape, v.dtype, gen) for k, v in p.items()}
        for v in c.values():
            v[::3] = math.inf if n % 2 else math.nan
        state = famp.init_scaler(scale)
        grads, found_inf, new_state = _compiled("famp", path, dynamic)(state, p, c)
        scaled = _compiled("torch", path, dynamic)(state.scale, p, c)
        expected, expected_found = torch_unscale(scale, list(scaled.values()), allow_fp16=True)
        for key, want in zip(scaled, expected, strict=True):
            assert grads[key].dtype == want.dtype
            assert_bitwise_equal(grads[key], want)
        assert_bitwise_equal(found_inf, expected_found)
        assert found_inf.item() == 1.0
        assert new_state.scale.item() == scale / 2


# --- gradients that share memory -------------------------------------------------------------

CASES: dict[str, Callable[[Any, torch.Tensor], torch.Tensor]] = {
    # the gradient of a + b is one tensor, returned for both
    "one tensor twice": lambda p, x: ((p["a"] + p["b"]) * x).square().sum(),
    # the gradient of a sum is an expanded 0-d tensor
    "expanded": lambda p, x: p["a"].sum() * 3 + (p["b"] * x).sum(),
    # b's gradient is a transposed view of a's
    "a view of another": lambda p, x: ((p["a"] + p["b"].t()) * x).square().sum(),
    # slices of one gradient (torch.cat's): b's at a storage offset, which inductor read from
    # offset 0 before 2026-12-01 (a's values given for b)
    "slices of one": lambda p, x: (torch.cat([p["a"], p["b"]]) * x.repeat(2, 1)).square().sum(),
}


def _case_step(state: famp.ScalerState, p: Any, x: torch.Tensor, case: str) -> Any:
    return famp.value_and_grad(CASES[case])(state, p, x)


def _two_steps(run: Any, case: str, device: str, on_code: Any = None) -> None:
    """Two steps of `case`, the second overflowing (an infinity in x): each gradient is torch's
    kernel on `torch.func.grad`'s scaled gradients, unscaled once; the parameters, inputs of the
    step, are never written. `on_code` reads the code inductor wrote for the first step.

    The values are small integers times powers of two, so eager and inductor agree exactly on
    the scaled gradients.
    """
    fn = CASES[case]
    p = {"a": torch.arange(12.0).reshape(3, 4), "b": torch.arange(12.0).reshape(3, 4) - 5}
    if case == "a view of another":
        p["b"] = p["b"].t().contiguous()
    p = {k: v.to(device) for k, v in p.items()}
    x = (torch.arange(12.0).reshape(3, 4) % 5 - 2).to(device)
    for bad in (False, True):
        if bad:
            x[1, 2] = math.inf
        state = famp.init_scaler(2.0**10, device=device)
        originals = {k: v.clone() for k, v in p.items()}
        if on_code is None or bad:
            _, grads, found_inf, _ = run(state, p, x, case)
        else:
            (_, grads, found_inf, _), (code,) = run_and_get_code(run, state, p, x, case)
            on_code(code[code.index("def call(") :])
        scaled = torch.func.grad(lambda p, x: fn(p, x) * 2.0**10)(p, x)
        expected, expected_found = torch_unscale(2.0**10, list(scaled.values()))
        for key, want in zip(scaled, expected, strict=True):
            assert_bitwise_equal(grads[key], want)
        assert_bitwise_equal(found_inf, expected_found)
        assert found_inf.item() == float(bad)
        for key, value in p.items():
            assert_bitwise_equal(value, originals[key])


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_value_and_grad_of_gradients_that_share_memory(
    path: str, case: str, backend: str
) -> None:
    """Each gradient unscaled once, in place or out of place."""
    _two_steps(compiled(_case_step, path, backend=backend, tag=case), case, "cpu")


# --- CUDA: every gradient that only the step reads is unscaled in place ----------------------


@pytest.mark.cuda
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_value_and_grad_on_cuda_unscales_in_place_once(case: str) -> None:
    """On CUDA, whatever their sizes, one `famp::unscale_` call and no out-of-place kernel, and
    each gradient unscaled once where they share memory."""

    def one_kernel_in_place(call: str) -> None:
        assert call.count("torch.ops.famp.unscale_.default(") == 1
        assert "_amp_foreach_non_finite_check_and_unscale" not in call

    _two_steps(compiled(_case_step, "cuda", tag=case), case, "cuda", one_kernel_in_place)


@pytest.mark.cuda
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_compiled_value_and_grad_on_cuda_on_random_bits_equals_torchs_kernel(
    dynamic: bool,
) -> None:
    """Every float dtype on CUDA: torch's kernel in place for those it runs there, the CPU
    kernel's bits for bfloat16 where the CUDA kernel lacks it (`torch_unscale_anywhere`)."""
    famp_run = compiled(_famp_grads, "cuda", dynamic)
    torch_run = compiled(_scaled_grads, "cuda", dynamic)
    gen = torch.Generator().manual_seed(7 + dynamic)
    for scale in (2.0**16, 1.0):
        for n in (9, 13):
            p = {f"g{i}": torch.zeros(n + i, dtype=d) for i, d in enumerate(DTYPES)}
            c = {k: random_bits(v.shape, v.dtype, gen) for k, v in p.items()}
            for v in c.values():
                v[::3] = math.inf if n % 2 else math.nan
            p, c = ({k: v.cuda() for k, v in d.items()} for d in (p, c))
            state = famp.init_scaler(scale, device="cuda")
            grads, found_inf, _ = famp_run(state, p, c)
            scaled = torch_run(state.scale, p, c)
            expected, expected_found = torch_unscale_anywhere(
                scale, list(scaled.values()), allow_fp16=True
            )
            for key, want in zip(scaled, expected, strict=True):
                assert_bitwise_equal(grads[key], want)
            assert_bitwise_equal(found_inf, expected_found)
            assert found_inf.item() == 1.0


# --- activation checkpointing: compiled, refused, never other numbers -------------------------

_CHECKPOINTED = """
import torch, famp
def loss(p, x):
    block = lambda h: (h * p["a"]).square()
    return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False).sum()
# aot_eager: AOTAutograd refuses while tracing, before a backend compiles (inductor refuses the
# same; its import alone costs the fresh process a second)
step = torch.compile(
    lambda s, p, x: famp.value_and_grad(loss)(s, p, x), fullgraph=True, backend="aot_eager"
)
try:
    print(step(famp.init_scaler(2.0), {"a": torch.ones(3)}, torch.ones(3)))
except Exception as error:
    print("refused:", error)
"""


def test_compiled_value_and_grad_of_a_checkpointed_loss_is_refused() -> None:
    """Compiled, `value_and_grad` differentiates with `torch.func.grad`, which refuses saved
    tensor hooks: an error, where eager `value_and_grad` gives the gradients without
    checkpointing (`test_grad.py`). In a fresh process: after the failed compile, torch leaves
    saved tensor hooks disabled in the process (torch 2.13 to 2.15), which would fail the
    eager checkpoint tests that run after this one."""
    out = subprocess.run(
        [sys.executable, "-c", _CHECKPOINTED], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert "refused:" in out.stdout, out.stdout
    assert "don't yet support saved tensor hooks" in out.stdout, out.stdout
