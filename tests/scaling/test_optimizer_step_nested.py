"""famp.optimizer_step undoes a skipped step inside nested optimizer state, against GradScaler.

Optimizers beyond `torch.optim` keep tensors inside lists and dicts and write into them in place:
SOAP and Shampoo ports keep a list of preconditioner statistics per parameter
(`state['GG'][i].lerp_(...)`), some keep a list in a param group they append to, and a schedule may
write into tensor `betas` inside a tuple. GradScaler never calls `step()` on a skipped step, so
none of it moves; famp steps and undoes, and must reach into those containers.
"""

from __future__ import annotations

import math
from collections import OrderedDict, defaultdict
from typing import Any

import optree
import pytest
import torch
from hypothesis import example, given, settings

import famp
from tests.helpers import assert_bitwise_equal
from tests.scaling.test_optimizer_step import (
    assert_models_equal,
    assert_no_host_sync_after_the_first_step,
    inject,
    loss_of,
    make_model,
    overflows,
    side_by_side,
)


class NestedState(torch.optim.Optimizer):
    """Preconditioned momentum in the style of SOAP: per parameter a list of Kronecker statistics
    updated in place and a dict holding the momentum; per group a tuple of tensor betas decayed in
    place. `python_count` adds Python values (step counts in state and group, a list in the group
    appended each step), which famp can only restore after one host read; without them the undo
    needs none."""

    def __init__(self, params: Any, python_count: bool) -> None:
        betas = (torch.tensor(0.9), torch.tensor(0.99))
        super().__init__(params, {"lr": 0.05, "betas": betas})
        self.python_count = python_count
        for group in self.param_groups:
            group["betas"] = tuple(b.clone() for b in group["betas"])  # a tuple per group
            group["seen"] = []

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            b1, b2 = group["betas"]
            b1.mul_(0.999)  # a tensor inside a tuple, written in place
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.reshape(p.shape[0], -1)
                state = self.state[p]
                if "GG" not in state:
                    state["GG"] = [torch.zeros(g.shape[0], g.shape[0]), torch.zeros(g.shape[1], 1)]
                    state["m"] = {"avg": torch.zeros_like(p)}
                    if self.python_count:
                        state["step"] = 0
                if self.python_count:
                    state["step"] += 1
                state["GG"][0].lerp_(g @ g.T, 1 - b2)  # tensors inside a list, in place
                state["GG"][1].lerp_((g * g).sum(0, keepdim=True).T, 1 - b2)
                state["m"]["avg"].lerp_(p.grad, 1 - b1)  # a tensor inside a dict
                scale = state["GG"][0].diagonal().mean() + state["GG"][1].mean()
                p.sub_(group["lr"] * state["m"]["avg"] / (1 + scale).sqrt())
            if self.python_count:
                group["seen"].append(len(group["seen"]))  # a list, appended in place
                group["step"] = group.get("step", 0) + 1


def assert_trees_equal(actual: Any, expected: Any) -> None:
    leaves, spec = optree.tree_flatten(actual, none_is_leaf=True)
    expected_leaves, expected_spec = optree.tree_flatten(expected, none_is_leaf=True)
    assert spec == expected_spec
    for a, e in zip(leaves, expected_leaves, strict=True):
        if isinstance(e, torch.Tensor):
            assert_bitwise_equal(a, e)
        else:
            assert type(a) is type(e)
            assert a == e


def assert_nested_states_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    for pa, pb in zip(
        (p for g in a.param_groups for p in g["params"]),
        (p for g in b.param_groups for p in g["params"]),
        strict=True,
    ):
        assert (pa in a.state) == (pb in b.state)
        if pa in a.state:
            assert_trees_equal(dict(a.state[pa]), dict(b.state[pb]))
    for ga, gb in zip(a.param_groups, b.param_groups, strict=True):
        assert_trees_equal(
            {k: v for k, v in ga.items() if k != "params"},
            {k: v for k, v in gb.items() if k != "params"},
        )


@pytest.mark.parametrize("python_count", [True, False])
@settings(max_examples=6, deadline=None)
@given(pattern=overflows)
@example(pattern=[None, math.inf, None, math.nan, None])
@example(pattern=[math.inf, None, math.nan])  # a skipped first step: state created, then dropped
def test_optimizer_step_undoes_nested_state_as_gradscaler_never_steps(
    python_count: bool, pattern: list[float | None]
) -> None:
    model, famp_model = make_model(), make_model()
    opt = NestedState(model.parameters(), python_count)
    famp_opt = NestedState(famp_model.parameters(), python_count)
    betas = [b for g in famp_opt.param_groups for b in g["betas"]]
    for _ in side_by_side((model, opt), (famp_model, famp_opt), [*pattern, None], 2.0**10):
        assert_models_equal(famp_model, model)
        assert_nested_states_equal(famp_opt, opt)
    # the group's tensors are the same objects, restored in place (a scheduler may hold them)
    assert [b for g in famp_opt.param_groups for b in g["betas"]] == betas


def test_optimizer_step_undoes_nested_tensors_without_a_host_sync() -> None:
    model = make_model()
    opt = NestedState(model.parameters(), python_count=False)
    assert_no_host_sync_after_the_first_step(model, opt)
    assert opt.param_groups[0]["betas"][0].item() == pytest.approx(0.9 * 0.999**2)
    for p in model.parameters():
        assert all(torch.isfinite(t).all() for t in opt.state[p]["GG"])


# --- optimizers that wrap another: the state lives in the wrapped one ----------------------------


class Lookahead(torch.optim.Optimizer):
    """Lookahead as timm and its ports write it: the wrapped optimizer keeps its own state (the
    fast weights' moments, in `base.state`), the wrapper keeps the slow weights in its `state`,
    and both share the param groups, which count the steps (`lookahead_step`)."""

    def __init__(self, base: torch.optim.Optimizer, alpha: float = 0.5, k: int = 2) -> None:
        self.base = base
        self.param_groups = base.param_groups
        self.defaults = {**base.defaults, "lookahead_alpha": alpha, "lookahead_k": k}
        self.state: dict[Any, Any] = defaultdict(dict)
        self._optimizer_step_pre_hooks: dict[int, Any] = OrderedDict()
        self._optimizer_step_post_hooks: dict[int, Any] = OrderedDict()
        for group in self.param_groups:
            group.setdefault("lookahead_alpha", alpha)
            group.setdefault("lookahead_k", k)
            group.setdefault("lookahead_step", 0)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.base.step()
        for group in self.param_groups:
            group["lookahead_step"] += 1
            if group["lookahead_step"] % group["lookahead_k"]:
                continue
            for p in group["params"]:
                if p.grad is None:
                    continue
                slow = self.state[p].setdefault("slow", p.detach().clone())
                slow.add_(p - slow, alpha=group["lookahead_alpha"])
                p.copy_(slow)


@pytest.mark.parametrize("base", ["adam_foreach", "sgd_momentum"])
@settings(max_examples=4, deadline=None)
@given(pattern=overflows)
@example(pattern=[None, math.inf, None, None, math.nan, None])
def test_optimizer_step_undoes_the_wrapped_optimizers_state_as_gradscaler_never_steps(
    base: str, pattern: list[float | None]
) -> None:
    def build(model: torch.nn.Module) -> Lookahead:
        if base == "adam_foreach":
            return Lookahead(torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True))
        return Lookahead(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))

    model, famp_model = make_model(), make_model()
    opt, famp_opt = build(model), build(famp_model)
    for _ in side_by_side((model, opt), (famp_model, famp_opt), [*pattern, None, None], 2.0**10):
        assert_models_equal(famp_model, model)
        assert_nested_states_equal(famp_opt, opt)  # the slow weights, the shared groups
        assert_nested_states_equal(famp_opt.base, opt.base)  # the moments


def test_optimizer_step_hooks_of_the_wrapped_optimizer_see_what_they_see_under_gradscaler() -> None:
    # GradScaler never steps on a skipped step, so a hook of the wrapped optimizer never runs
    # there; famp then steps only where the step applies (one host read), as for the wrapper's.
    model, famp_model = make_model(), make_model()
    opt = Lookahead(torch.optim.Adam(model.parameters(), lr=1e-2))
    famp_opt = Lookahead(torch.optim.Adam(famp_model.parameters(), lr=1e-2))
    seen: list[list[torch.Tensor]] = [[], []]
    for o, record in zip((opt.base, famp_opt.base), seen, strict=True):
        o.register_step_post_hook(
            lambda optimizer, args, kwargs, record=record: record.append(  # type: ignore[misc]
                next(p for g in optimizer.param_groups for p in g["params"]).detach().clone()
            )
        )
    pattern = [None, math.inf, None, math.nan, None]
    for _ in side_by_side((model, opt), (famp_model, famp_opt), pattern, 2.0**10):
        assert_models_equal(famp_model, model)
    assert len(seen[1]) == len(seen[0]) == 3
    for a, e in zip(seen[1], seen[0], strict=True):
        assert_bitwise_equal(a, e)


# --- writes that version counters do not see ---------------------------------------------------


class DataWrites(torch.optim.Optimizer):
    """Momentum written through `.data` (older optimizer code does): `.data` is a tensor with its
    own version counter, so the state's counter never moves. (FSDP2's DTensor state is the other
    case: foreach ops leave a DTensor's counter as it was; tests/scaling/test_distributed_step.py.)
    """

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})
        for group in self.param_groups:
            group["decay"] = torch.tensor(0.9)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            group["decay"].data.mul_(0.99)  # a group tensor, written through .data too
            for p in group["params"]:
                if p.grad is not None:
                    moment = self.state[p].setdefault("m", torch.zeros_like(p))
                    moment.data.mul_(group["decay"]).add_(p.grad)
                    p.data.add_(moment, alpha=-group["lr"])


def test_optimizer_step_undoes_writes_through_data_as_gradscaler_never_steps() -> None:
    model, famp_model = make_model(), make_model()
    opt, famp_opt = DataWrites(model.parameters()), DataWrites(famp_model.parameters())
    pattern = [None, math.inf, None, math.nan, None]
    for _ in side_by_side((model, opt), (famp_model, famp_opt), pattern, 2.0**10):
        assert_models_equal(famp_model, model)
        assert_nested_states_equal(famp_opt, opt)
    assert famp_opt.param_groups[0]["decay"].item() == pytest.approx(0.9 * 0.99**3)


# --- state that holds a parameter's grad itself -------------------------------------------------


class KeepsGrad(torch.optim.Optimizer):
    """Sign-agreement step sizes in the style of Rprop ports that keep the last gradient as the
    grad tensor itself (`state['prev'] = p.grad`, no clone): the state holds `p.grad`'s object."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.05})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                prev = state.get("prev", torch.zeros_like(p))
                agree = torch.where(prev * p.grad >= 0, 1.0, 0.5)
                p.sub_(group["lr"] * agree * p.grad)
                state["prev"] = p.grad  # the grad itself


def test_optimizer_step_undoes_state_that_holds_the_grad_as_gradscaler_never_steps() -> None:
    # A skipped step must leave `state['prev']` the old tensor and `p.grad` the unscaled grad
    # (before, famp wrote the old `prev` values into the grad through the state's alias).
    model, famp_model = make_model(), make_model()
    opt, famp_opt = KeepsGrad(model.parameters()), KeepsGrad(famp_model.parameters())
    pattern = [None, math.inf, None, None, math.nan, None]
    for _ in side_by_side((model, opt), (famp_model, famp_opt), pattern, 2.0**10):
        assert_models_equal(famp_model, model)  # the grads too
        assert_nested_states_equal(famp_opt, opt)


# --- state kept outside the parameters' entries: unkeyed state, the optimizer's attributes ------


class KeepsStateElsewhere(torch.optim.Optimizer):
    """Optimizers that keep training state where torch's do not. MADGRAD counts its steps in a
    tensor under a key of `state` that is no parameter (`state['k']`, created on the first step,
    `+= 1` in place), and Ranger21 in attributes of the optimizer (`self.current_iter += 1`); others
    keep an EMA of the gradient norm in a tensor attribute, or a dict of buffers keyed by the
    parameters themselves (keys that do not sort). `python_count` adds the Python values, which
    famp can only restore after a host read; the tensors need none."""

    def __init__(self, params: Any, python_count: bool) -> None:
        super().__init__(params, {"lr": 0.05})
        self.python_count = python_count
        self.params = [p for g in self.param_groups for p in g["params"]]  # held: not copied
        self.grad_norm = torch.zeros(())
        self.momentum = {p: torch.zeros_like(p) for p in self.params}
        self.current_iter = 0
        self.seen: list[int] = []

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if "k" not in self.state:
            self.state["k"] = torch.zeros((), dtype=torch.long)
        lr = 0.05 * (self.state["k"] + 1).sqrt()
        for p in self.params:
            if p.grad is None:
                continue
            self.grad_norm.lerp_(p.grad.norm(), 0.1)
            self.momentum[p].mul_(0.9).add_(p.grad)
            p.sub_(lr * self.momentum[p] / (1 + self.grad_norm))
        self.state["k"] += 1
        if self.python_count:
            self.current_iter += 1
            self.seen.append(self.current_iter)


def assert_kept_elsewhere_equal(a: KeepsStateElsewhere, b: KeepsStateElsewhere) -> None:
    assert_bitwise_equal(a.state["k"], b.state["k"])
    assert_bitwise_equal(a.grad_norm, b.grad_norm)
    for pa, pb in zip(a.params, b.params, strict=True):
        assert_bitwise_equal(a.momentum[pa], b.momentum[pb])
    assert (a.current_iter, a.seen) == (b.current_iter, b.seen)


@pytest.mark.parametrize("python_count", [True, False])
@settings(max_examples=6, deadline=None)
@given(pattern=overflows)
@example(pattern=[None, math.inf, None, math.nan, None])
@example(pattern=[math.inf, None, math.nan])  # a skipped first step: `state['k']` not created
def test_optimizer_step_undoes_state_kept_outside_the_parameters_as_gradscaler_never_steps(
    python_count: bool, pattern: list[float | None]
) -> None:
    model, famp_model = make_model(), make_model()
    opt = KeepsStateElsewhere(model.parameters(), python_count)
    famp_opt = KeepsStateElsewhere(famp_model.parameters(), python_count)
    grad_norm, momentum = famp_opt.grad_norm, famp_opt.momentum
    for _ in side_by_side((model, opt), (famp_model, famp_opt), [*pattern, None], 2.0**10):
        assert_models_equal(famp_model, model)
        assert ("k" in famp_opt.state) == ("k" in opt.state)
        if "k" in opt.state:
            assert_kept_elsewhere_equal(famp_opt, opt)
    assert_kept_elsewhere_equal(famp_opt, opt)
    # tensors restored in place: the same objects (a user may hold them), their values put back
    assert famp_opt.grad_norm is grad_norm
    assert all(famp_opt.momentum[p] is momentum[p] for p in famp_opt.params)
    assert all(p is q for p, q in zip(famp_opt.params, famp_model.parameters(), strict=True))


def test_optimizer_step_undoes_tensors_kept_outside_the_parameters_without_a_host_sync() -> None:
    model = make_model()
    opt = KeepsStateElsewhere(model.parameters(), python_count=False)
    assert_no_host_sync_after_the_first_step(model, opt)
    assert opt.state["k"].item() == 2
    assert torch.isfinite(opt.grad_norm)
    assert all(torch.isfinite(m).all() for m in opt.momentum.values())


class Noisy(torch.optim.Optimizer):
    """Gradient noise from torch's default generator (SGLD, noisy SGD) and stochastic rounding
    from a generator of its own: a skipped step must not advance either, or every later draw
    (the next batch's dropout masks too) differs from a GradScaler loop's."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.05})
        self.rounding = torch.Generator().manual_seed(7)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    noise = torch.randn(p.shape) * 1e-3
                    jitter = torch.rand(p.shape, generator=self.rounding) * 1e-4
                    p.sub_(group["lr"] * p.grad + noise + jitter)


def _noisy_run(
    pattern: list[float | None], famp_side: bool
) -> list[tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]]:
    """One loop alone (each side draws from torch's default generator): after each step the
    parameters, the default generator's state and the optimizer's own generator's."""
    model = make_model()
    opt = Noisy(model.parameters())
    torch.manual_seed(3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    state = famp.init_scaler(2.0**10, growth_interval=2)
    seen = []
    for step, bad in enumerate(pattern):
        opt.zero_grad()
        loss = loss_of(model, step)
        (famp.scale(state, loss) if famp_side else scaler.scale(loss)).backward()
        inject(model, bad)
        if famp_side:
            state = famp.update_scale(state, famp.optimizer_step(opt, state))
        else:
            scaler.step(opt)
            scaler.update()
        params = [p.detach().clone() for p in model.parameters()]
        seen.append((params, torch.get_rng_state(), opt.rounding.get_state()))
    return seen


@settings(max_examples=6, deadline=None)
@given(pattern=overflows)
@example(pattern=[None, math.inf, None, math.nan, None])
@example(pattern=[math.inf, None])
def test_optimizer_step_leaves_the_random_generators_as_gradscaler_never_steps(
    pattern: list[float | None],
) -> None:
    pattern = [*pattern, None]
    expected, actual = _noisy_run(pattern, famp_side=False), _noisy_run(pattern, famp_side=True)
    for (params, rng, own), (e_params, e_rng, e_own) in zip(actual, expected, strict=True):
        for p, e in zip(params, e_params, strict=True):
            assert_bitwise_equal(p, e)
        assert torch.equal(rng, e_rng)
        assert torch.equal(own, e_own)
