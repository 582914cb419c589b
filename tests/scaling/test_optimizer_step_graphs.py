"""famp.optimizer_step where the step is differentiated, or writes parameters without a grad.

Against a `GradScaler` loop, bit for bit: meta-learning with `differentiable=True` optimizers (the
parameters carry a graph to the initial weights; a skipped step must leave no term in the
meta-gradient), gradients that carry a graph (a tensor saved for backward must keep its version),
and an optimizer torch does not ship that writes every parameter of its groups. Before
2026-12-02 famp stepped and undid them all: the meta-gradient kept the skipped step's term, Adam,
AdamW, RMSprop and Adagrad raised at the meta-backward ("modified by an inplace operation"), and
a parameter without a grad kept the skipped step's decay.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

import famp
from tests.helpers import assert_bitwise_equal

DIFFERENTIABLE: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, differentiable=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.1, differentiable=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.1, differentiable=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, differentiable=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, differentiable=True),
    # a tensor lr that requires grad: its hypergradient
    "sgd_tensor_lr": lambda ps: torch.optim.SGD(
        ps, lr=torch.tensor(0.1, requires_grad=True), differentiable=True
    ),
}


def _meta_run(name: str, use_famp: bool) -> tuple[torch.Tensor, ...]:
    """Three inner steps on a clone of `w0`, the second overflowing; the meta-gradients."""
    torch.manual_seed(0)
    w0 = torch.nn.Parameter(torch.randn(4, 3))
    x, y = torch.randn(5, 4), torch.randn(5, 3)
    w = w0.clone()
    opt = DIFFERENTIABLE[name]([w])
    scaler, state = torch.amp.GradScaler("cpu", init_scale=1024.0), famp.init_scaler(1024.0)
    for bad in (None, math.inf, None):
        loss = ((x @ w - y) ** 2).mean()
        scaled = famp.scale(state, loss) if use_famp else scaler.scale(loss)
        (g,) = torch.autograd.grad(scaled, w, create_graph=True)
        if bad is not None:
            g = g.clone()
            with torch.no_grad():
                g[0, 0] = bad
        w.grad = g
        if use_famp:
            state = famp.update_scale(state, famp.optimizer_step(opt, state))
        else:
            scaler.step(opt)
            scaler.update()
        w.grad = None
    ((x @ w - y) ** 2).mean().backward()
    lr = opt.param_groups[0]["lr"]
    hyper = (lr.grad,) if isinstance(lr, torch.Tensor) else ()
    return (w.detach(), w0.grad, *hyper)


@pytest.mark.parametrize("name", sorted(DIFFERENTIABLE))
def test_a_differentiable_step_gives_gradscalers_meta_gradient(name: str) -> None:
    expected = _meta_run(name, use_famp=False)
    got = _meta_run(name, use_famp=True)
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert_bitwise_equal(a, b)


def test_grads_that_carry_a_graph_keep_the_versions_autograd_saved() -> None:
    # A non-differentiable SGD on unscaled grads that carry a graph (create_graph=True) to
    # another leaf `a`, and a penalty on them differentiated after the step: torch's step leaves
    # the grads as they are, so their version is the one the penalty saved.
    def run(use_famp: bool) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(3))
        a = torch.randn(3, requires_grad=True)
        opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
        state = famp.init_scaler(64.0)
        (g,) = torch.autograd.grad(famp.scale(state, (w * a**3).sum()), w, create_graph=True)
        (g,), found_inf = famp.unscale_and_check(state, [g])
        penalty = (g**2).sum()  # saves g for backward
        w.grad = g
        if use_famp:
            famp.optimizer_step(opt, found_inf=found_inf)
        elif found_inf.item() == 0:  # GradScaler.step's host read
            opt.step()
        (d,) = torch.autograd.grad(penalty, a)
        return w.detach(), d

    expected = run(False)
    torch.manual_seed(0)
    assert not torch.equal(expected[0], torch.randn(3))  # the step applied
    for got, want in zip(run(True), expected, strict=True):
        assert_bitwise_equal(got, want)


class DecaysEveryParameter(torch.optim.Optimizer):
    """A decoupled decay of every parameter of its groups, then SGD on those with a grad."""

    def __init__(self, params: Any, lr: float = 0.1, decay: float = 0.1) -> None:
        super().__init__(params, {"lr": lr, "decay": decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.mul_(1 - group["lr"] * group["decay"])
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


def test_a_custom_optimizer_that_writes_parameters_without_a_grad_is_undone() -> None:
    def run(use_famp: bool) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        used, unused = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3))
        opt = DecaysEveryParameter([used, unused])
        scaler, state = torch.amp.GradScaler("cpu", init_scale=1024.0), famp.init_scaler(1024.0)
        for bad in (None, math.inf, None, math.nan):
            opt.zero_grad()
            loss = (used * 2).sum()  # `unused` gets no grad
            (famp.scale(state, loss) if use_famp else scaler.scale(loss)).backward()
            if bad is not None:
                assert used.grad is not None
                used.grad[0] = bad
            if use_famp:
                state = famp.update_scale(state, famp.optimizer_step(opt, state))
            else:
                scaler.step(opt)
                scaler.update()
        return used.detach(), unused.detach()

    got, expected = run(True), run(False)
    torch.manual_seed(0)
    _, unused_start = torch.randn(3), torch.randn(3)
    assert not torch.equal(expected[1], unused_start)  # the applied steps decayed it
    for a, b in zip(got, expected, strict=True):
        assert_bitwise_equal(a, b)


def _torch_optimizers() -> list[type[torch.optim.Optimizer]]:
    """Every optimizer class the installed torch exports from `torch.optim`, but `LBFGS`: it adds
    its flat update to every parameter (a zero where there is no grad), and famp refuses it."""
    found = {
        v
        for v in vars(torch.optim).values()
        if inspect.isclass(v)
        and issubclass(v, torch.optim.Optimizer)
        and v not in (torch.optim.Optimizer, torch.optim.LBFGS)
    }
    return sorted(found, key=lambda c: c.__name__)


@pytest.mark.parametrize("cls", _torch_optimizers(), ids=lambda c: c.__name__)
def test_torchs_optimizers_leave_a_parameter_without_a_grad_untouched(
    cls: type[torch.optim.Optimizer],
) -> None:
    # What lets famp copy only the parameters with a grad before a torch optimizer's step.
    torch.manual_seed(0)
    used, unused = torch.nn.Parameter(torch.randn(3, 3)), torch.nn.Parameter(torch.randn(3, 3))
    before, version = unused.detach().clone(), unused._version
    start = used.detach().clone()
    opt = cls([used, unused], lr=0.1)
    for _ in range(3):
        grad = torch.randn(3, 3)
        used.grad = grad.to_sparse() if cls is torch.optim.SparseAdam else grad
        opt.step()
    assert unused.grad is None
    assert_bitwise_equal(unused.detach(), before)
    assert unused._version == version
    assert not torch.equal(used.detach(), start)  # the optimizer stepped
