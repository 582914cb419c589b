"""famp.optimizer_step where a non-fused step meets what GradScaler's skipped step never meets.

GradScaler never calls `step()` on a skipped step; famp calls it and undoes it. These tests cover
the steps that make that harder, against a GradScaler loop, bit for bit: a `step()` that replaces
or frees `.grad`, a step inside `torch.inference_mode()` (its state has no version counters), and
the documented limits (a `step()` that raises on non-finite gradients, another thread drawing
from torch's default generator during the step) with their workaround, a step hook.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch

import famp
from tests.scaling.test_optimizer_step import (
    assert_models_equal,
    assert_optimizer_states_equal,
    inject,
    loss_of,
    make_model,
    side_by_side,
)


class FreesGrad(torch.optim.SGD):
    """Frees each gradient once applied (a memory-saving pattern)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        out = super().step(closure)
        for p in (p for g in self.param_groups for p in g["params"]):
            p.grad = None
        return out


class ReplacesGrad(torch.optim.SGD):
    """Clips each gradient by value into a new tensor before stepping."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for p in (p for g in self.param_groups for p in g["params"]):
            if p.grad is not None:
                p.grad = p.grad.clamp(-1, 1)
        return super().step(closure)


@pytest.mark.parametrize("cls", [FreesGrad, ReplacesGrad])
def test_optimizer_step_puts_back_a_grad_the_step_replaced_as_gradscaler_never_steps(
    cls: type[torch.optim.SGD],
) -> None:
    # Before, a skipped step left `.grad` None (freed) or the clipped tensor (replaced), where
    # GradScaler leaves the unscaled gradient with its overflow.
    model, famp_model = make_model(), make_model()
    opt, famp_opt = cls(model.parameters(), lr=0.1), cls(famp_model.parameters(), lr=0.1)
    pattern = [None, math.inf, None, math.nan, None, -math.inf]
    for _ in side_by_side((model, opt), (famp_model, famp_opt), pattern, 2.0**10):
        assert_models_equal(famp_model, model)  # the grads too
        assert_optimizer_states_equal(famp_opt, opt)


INFERENCE_OPTIMIZERS: dict[str, Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=False),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False),
    "adam_foreach": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.9),
    "nadam_foreach": lambda ps: torch.optim.NAdam(ps, lr=1e-2, foreach=True),
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
}


def _inference_run(
    famp_side: bool, name: str, pattern: list[float | None], inside_from: int
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """One loop whose steps from `inside_from` on run inside `torch.inference_mode()`."""
    model = make_model()
    opt = INFERENCE_OPTIMIZERS[name](model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    state = famp.init_scaler(2.0**10, growth_interval=2)
    for step, bad in enumerate(pattern):
        opt.zero_grad()
        loss = loss_of(model, step)
        (famp.scale(state, loss) if famp_side else scaler.scale(loss)).backward()
        inject(model, bad)
        inside = torch.inference_mode() if step >= inside_from else contextlib.nullcontext()
        with inside:
            if famp_side:
                found_inf = famp.optimizer_step(opt, state)
            else:
                scaler.step(opt)
        if famp_side:
            state = famp.update_scale(state, found_inf)
        else:
            scaler.update()
    return model, opt


@pytest.mark.parametrize("name", INFERENCE_OPTIMIZERS)
@pytest.mark.parametrize(
    ("pattern", "inside_from"),
    [
        ([None, math.inf, None, math.nan, None], 0),  # state created inside: inference tensors
        ([math.inf, None, math.inf, None], 0),  # a skipped first step inside
        ([None, None, math.inf, None, math.nan], 2),  # state created outside, stepped inside
    ],
)
def test_optimizer_step_inside_inference_mode_equals_gradscaler(
    name: str, pattern: list[float | None], inside_from: int
) -> None:
    # Before, the step after the state was created inside inference mode raised "Inference
    # tensors do not track version counter." (famp read the state's versions), the step run.
    model, opt = _inference_run(False, name, pattern, inside_from)
    famp_model, famp_opt = _inference_run(True, name, pattern, inside_from)
    assert_models_equal(famp_model, model)
    assert_optimizer_states_equal(famp_opt, opt)


# --- documented limits and their workaround: a step hook --------------------------------------


class RaisesOnNonfinite(torch.optim.SGD):
    """Refuses non-finite gradients inside `step()`, a common guard."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            torch.nn.utils.clip_grad_norm_(group["params"], 1e9, error_if_nonfinite=True)
        return super().step(closure)


def _no_op_hook(*_: Any) -> None:
    pass


def test_a_step_hook_lets_a_step_that_raises_on_overflow_equal_gradscaler() -> None:
    # Without a hook famp calls step() on a skipped step (to undo it), so the guard raises where
    # GradScaler never calls it; with one, famp reads found_inf and calls step() as GradScaler.
    model, famp_model = make_model(), make_model()
    opt = RaisesOnNonfinite(model.parameters(), lr=0.1, momentum=0.9)
    famp_opt = RaisesOnNonfinite(famp_model.parameters(), lr=0.1, momentum=0.9)
    pattern = [None, math.inf, None, math.nan, None]
    with pytest.raises(RuntimeError, match="non-finite"):
        for _ in side_by_side((model, opt), (famp_model, famp_opt), pattern, 2.0**10):
            pass
    model, famp_model = make_model(), make_model()
    opt = RaisesOnNonfinite(model.parameters(), lr=0.1, momentum=0.9)
    famp_opt = RaisesOnNonfinite(famp_model.parameters(), lr=0.1, momentum=0.9)
    famp_opt.register_step_post_hook(_no_op_hook)
    for _ in side_by_side((model, opt), (famp_model, famp_opt), pattern, 2.0**10):
        assert_models_equal(famp_model, model)
        assert_optimizer_states_equal(famp_opt, opt)


def _capturable_run(famp_side: bool, hooked: bool) -> int:
    """The step at which a CPU Adam with `capturable=True` raises, its first step skipped."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, capturable=True, foreach=False)
    if hooked:
        opt.register_step_post_hook(_no_op_hook)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    state = famp.init_scaler(2.0**10)
    for step, bad in enumerate([math.inf, None]):
        opt.zero_grad()
        loss = loss_of(model, step)
        (famp.scale(state, loss) if famp_side else scaler.scale(loss)).backward()
        inject(model, bad)
        try:
            if famp_side:
                state = famp.update_scale(state, famp.optimizer_step(opt, state))
            else:
                scaler.step(opt)
                scaler.update()
        except AssertionError as e:  # torch's check of capturable's devices
            if "capturable=True" not in str(e):
                raise
            return step
    raise AssertionError("no step raised")


def test_a_step_hook_makes_a_capturable_cpu_optimizer_raise_where_gradscaler_does() -> None:
    # GradScaler first calls step() on the second step, which raises; famp steps the skipped
    # first one too, unless a step hook is registered.
    assert _capturable_run(famp_side=False, hooked=False) == 1
    assert _capturable_run(famp_side=True, hooked=False) == 0
    assert _capturable_run(famp_side=True, hooked=True) == 1


def _draws_during_skipped_steps(step: Callable[[torch.optim.Optimizer], None]) -> list[int]:
    """What a thread draws from torch's default CPU generator while `step` runs skipped steps."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(256, 256)) for _ in range(16)]
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=False)
    opt.register_step_post_hook(_no_op_hook)
    draws: list[int] = []
    stop = threading.Event()

    def draw() -> None:
        while not stop.is_set():
            draws.append(int(torch.randint(0, 2**62, (1,))))

    thread = threading.Thread(target=draw)
    thread.start()
    try:
        for _ in range(12):
            for p in params:
                p.grad = torch.ones_like(p)
            params[0].grad[0, 0] = math.inf  # type: ignore[index]
            step(opt)
    finally:
        stop.set()
        thread.join()
    return draws


def test_a_step_hook_leaves_another_threads_draws_as_gradscaler() -> None:
    # Without a hook a skipped step puts back the default generator's state, draws that another
    # thread made during the step included (it then draws them again); with one, famp does not
    # call step() on a skipped step, as GradScaler.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    scaler.scale(torch.zeros(()))  # the scaler's state, lazily created

    def torch_step(opt: torch.optim.Optimizer) -> None:
        scaler.step(opt)
        scaler.update(2.0**16)

    def famp_step(opt: torch.optim.Optimizer) -> None:
        found_inf = famp.optimizer_step(opt, famp.init_scaler(2.0**16))
        assert found_inf.item() == 1.0

    for step in (torch_step, famp_step):
        draws = _draws_during_skipped_steps(step)
        assert draws
        assert len(set(draws)) == len(draws)
