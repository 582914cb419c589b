"""Where torch's unscale kernel does not run a dtype on a device, famp computes its arithmetic.

CUDA builds of torch up to at least 2.11 have no bfloat16 unscale kernel (pytorch/pytorch#127176),
so `GradScaler("cuda")` cannot unscale bfloat16 gradients. famp reads which dtypes the kernel runs
off the installed torch (`kernels.kernel_runs`, by running it once) and computes the kernel's
arithmetic as plain ops for the others. On the CPU, whose kernel runs every floating dtype, these
tests mark dtypes as not run, so that the CPU kernel is the oracle of the paths taken then; on
CUDA, `GradScaler` is the oracle where it runs and the CPU kernel where it does not
(`test_scaler.py::test_unscale_and_check_on_cuda_equals_gradscaler_cuda`).
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Iterator
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given

import famp
from famp._scaling import kernels
from tests.helpers import assert_bitwise_equal
from tests.scaling.test_scaler import grad_lists, torch_unscale
from tests.scaling.test_scaler_unscale import random_bits

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@contextlib.contextmanager
def refused() -> Iterator[None]:
    """On the CPU, famp takes every float dtype as one the kernel does not run."""
    saved = dict(kernels._KERNEL_RUNS)
    kernels._KERNEL_RUNS.update(dict.fromkeys((("cpu", d) for d in FLOATS), False))
    try:
        yield
    finally:
        kernels._KERNEL_RUNS.clear()
        kernels._KERNEL_RUNS.update(saved)


scales = st.one_of(
    st.sampled_from([65536.0, 1.0, 3.0, 2.0**-20]), st.floats(2.0**-100, 2.0**100, width=32)
)


@given(grads=grad_lists(FLOATS), scale_value=scales)
def test_donated_grads_are_unscaled_in_place_with_the_kernels_bits(
    grads: list[torch.Tensor], scale_value: float
) -> None:
    expected, expected_found = torch_unscale(scale_value, grads, allow_fp16=True)
    donated = [g.clone() for g in grads]
    with refused():
        state = famp.init_scaler(scale_value)
        out, found_inf = famp.unscale_and_check(state, donated, donate=True)
    for o, d, e in zip(out, donated, expected, strict=True):
        assert o is d  # in place: the buffers given
        assert_bitwise_equal(d, e)
    assert_bitwise_equal(found_inf, expected_found)


@given(grads=grad_lists(FLOATS), scale_value=scales)
def test_the_functional_kernel_path_gives_the_kernels_bits(
    grads: list[torch.Tensor], scale_value: float
) -> None:
    """`_kernel`, the path of every device but the CPU (eager, compiled and differentiable)."""
    inv = torch.tensor(scale_value, dtype=torch.float64).reciprocal().float()
    for dtype in FLOATS:
        group = [g for g in grads if g.dtype == dtype]
        if not group:
            continue
        expected, expected_found = torch_unscale(scale_value, group, allow_fp16=True)
        with refused():
            out, found = kernels._kernel(group, torch.zeros(()), inv)
        for o, e in zip(out, expected, strict=True):
            assert_bitwise_equal(o, e)
        assert_bitwise_equal(found, expected_found)


def _donate(state: famp.ScalerState, grads: list[torch.Tensor]) -> Any:
    return famp.unscale_and_check(state, grads, donate=True)


@pytest.fixture
def kernel_refuses() -> Iterator[None]:
    with refused():
        yield


def test_compiled_donation_reads_the_probe_when_tracing(kernel_refuses: None) -> None:
    # A fresh code object: the probe's answer is a constant of the graph traced under it.
    code = _donate.__code__.replace(co_name="_donate_refused")
    fn = torch.compile(types.FunctionType(code, globals()), fullgraph=True)
    gen = torch.Generator().manual_seed(3)
    grads = [random_bits((7, 5), d, gen) for d in (torch.bfloat16, torch.float32)]
    grads.append(torch.tensor([1.0, math.inf], dtype=torch.bfloat16))
    expected, expected_found = torch_unscale(3.0, grads)
    donated = [g.clone() for g in grads]
    out, found_inf = fn(famp.init_scaler(3.0), donated)
    for o, d, e in zip(out, donated, expected, strict=True):
        assert_bitwise_equal(o, e)
        assert_bitwise_equal(d, e)
    assert_bitwise_equal(found_inf, expected_found)
    assert found_inf.item() == 1.0


@pytest.mark.parametrize("bad", [False, True])
def test_optimizer_step_checks_grads_the_kernel_refuses(kernel_refuses: None, bad: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).to(torch.bfloat16)
    model(torch.randn(3, 4, dtype=torch.bfloat16)).float().sum().backward()
    assert model.weight.grad is not None
    if bad:
        model.weight.grad[0, 0] = math.nan
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    grads = {k: v.grad.clone() for k, v in model.named_parameters() if v.grad is not None}
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    found_inf = famp.optimizer_step(opt, famp.init_scaler(1.0))
    assert found_inf.item() == float(bad)
    for k, p in model.named_parameters():
        assert p.grad is not None
        assert_bitwise_equal(p.grad, grads[k])  # checked, values written back unchanged
        expected = before[k] if bad else before[k] - 0.5 * grads[k]
        assert_bitwise_equal(p.detach(), expected)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_kernel_runs_on_cuda_is_what_gradscaler_can_do(dtype: torch.dtype) -> None:
    """famp's probe against torch: GradScaler('cuda') unscales this dtype or raises."""
    grads = [torch.ones(3, dtype=dtype, device="cuda")]
    try:
        torch_unscale(2.0, grads, allow_fp16=True)
    except NotImplementedError:
        runs = False
    else:
        runs = True
    assert kernels.kernel_runs("cuda", dtype) is runs


@pytest.mark.parametrize("bad", [False, True])
def test_value_and_grad_unscales_its_own_grads_the_kernel_refuses(bad: bool) -> None:
    """Eager `value_and_grad` unscales autograd's fresh grads in place: that path, refused,
    against GradScaler on the same model (torch.autocast-free bfloat16 parameters)."""
    gen = torch.Generator().manual_seed(7)
    params = {
        "w": (torch.randn(6, 5, generator=gen) * 4).to(torch.bfloat16),
        "b": torch.randn(5, generator=gen).to(torch.bfloat16),
    }
    x = torch.randn(3, 6, generator=gen).to(torch.bfloat16)
    if bad:
        x[0, 0] = math.inf

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return (x @ p["w"] + p["b"]).float().square().sum()

    with refused():
        state = famp.init_scaler(2.0**10)
        loss, grads, found_inf, _ = famp.value_and_grad(loss_fn)(state, params, x)
    leaves = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    expected_loss = loss_fn(leaves, x)
    scaler.scale(expected_loss).backward()
    opt = torch.optim.SGD(list(leaves.values()), lr=0.0)
    scaler.unscale_(opt)
    assert_bitwise_equal(loss, expected_loss.detach())
    assert found_inf.item() == float(bad)
    assert_bitwise_equal(found_inf, scaler._found_inf_per_device(opt)[torch.device("cpu")])
    for k, p in leaves.items():
        assert p.grad is not None
        assert_bitwise_equal(grads[k], p.grad)
