"""famp.optimizer_step on CUDA against a `GradScaler("cuda")` loop, bit for bit.

The optimizers of tests/scaling/test_optimizer_step.py, in every form they have on CUDA: the
for-loop and foreach forms (famp unscales with torch's CUDA kernel, steps, and undoes a skipped
step with `torch.where` on the device, the step counts kept on the CPU included), the fused CUDA
kernels (which take the scale and `found_inf` themselves; a fused form torch does not run on
CUDA, as torch 2.11's Adagrad, whose first step raises, skips with torch's error), and the
capturable forms (step counts on the device). Each runs a sequence of steps with overflows
injected, the first step skipped among them; after each step the parameters, gradients,
optimizer states, scale and growth tracker equal the GradScaler loop's.
"""

from __future__ import annotations

import math
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import example, given, settings
from torch.nn import functional

from tests.helpers import assert_bitwise_equal
from tests.scaling.test_optimizer_step import (
    IMPLEMENTATIONS,
    OPTIMIZERS,
    Factory,
    assert_models_equal,
    assert_optimizer_states_equal,
    batch,
    make_model,
    side_by_side,
)

pytestmark = pytest.mark.cuda

CUDA = "cuda"


def _takes_capturable(factory: Factory) -> bool:
    """Whether the optimizer has a capturable form (built on the CPU: collection runs no CUDA)."""
    try:
        built = factory([torch.nn.Parameter(torch.zeros(2, 2))], {"capturable": True})
    except (TypeError, ValueError):
        return False
    return built.defaults.get("capturable") is True  # Muon's factory passes no options


FORMS = {**IMPLEMENTATIONS, "capturable": {"capturable": True, "foreach": True}}
CASES = [(name, impl) for name, (_, impls) in OPTIMIZERS.items() for impl in impls] + [
    (name, "capturable") for name, (factory, _) in OPTIMIZERS.items() if _takes_capturable(factory)
]


def _skip_what_torch_does_not_run(name: str, factory: Factory, impl: str) -> None:
    """Skip a fused form that the installed torch does not run on CUDA (torch 2.11's Adagrad:
    its first step raises), read off torch by one step of it."""
    if impl != "fused":
        return
    p = torch.nn.Parameter(torch.zeros(2, 2, device=CUDA))
    p.grad = torch.zeros_like(p)
    try:
        factory([p], dict(FORMS[impl])).step()
    except RuntimeError as e:
        if "fused=True" not in str(e):
            raise
        pytest.skip(f"torch has no fused {name} on CUDA: {e}")


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    x, y = batch(step)
    return functional.cross_entropy(model(x.to(CUDA)), y.to(CUDA))


@pytest.mark.parametrize(("name", "impl"), CASES)
@settings(max_examples=2, deadline=None)
@given(
    pattern=st.lists(st.sampled_from([None, None, math.inf, -math.inf, math.nan]), max_size=6),
    init_scale=st.sampled_from([1.0, 2.0**10, 3000.0]),
)
@example(pattern=[math.inf, None, None, math.nan, None], init_scale=2.0**10)  # skipped first step
def test_optimizer_step_on_cuda_equals_a_gradscaler_loop_for_every_optimizer(
    name: str, impl: str, pattern: list[float | None], init_scale: float
) -> None:
    if name.startswith("sgd_") and impl == "fused" and pattern and pattern[0] is not None:
        # torch's fused SGD reads uninitialized momentum after a skipped first step (famp zeroes
        # it; tests/scaling/test_step.py)
        pattern = [None, *pattern[1:]]
    factory, _ = OPTIMIZERS[name]
    _skip_what_torch_does_not_run(name, factory, impl)
    model, famp_model = make_model().to(CUDA), make_model().to(CUDA)
    opt: Any = factory(model.parameters(), dict(FORMS[impl]))
    famp_opt: Any = factory(famp_model.parameters(), dict(FORMS[impl]))
    for bad, found_inf, state, scaler in side_by_side(
        (model, opt), (famp_model, famp_opt), [*pattern, None], init_scale, CUDA, _loss
    ):
        assert found_inf.device.type == CUDA
        assert found_inf.item() == float(bad is not None)
        assert_bitwise_equal(state.scale, scaler._scale)
        assert_bitwise_equal(state.growth_tracker, scaler._growth_tracker)
        assert_models_equal(famp_model, model)
        assert_optimizer_states_equal(famp_opt, opt)
