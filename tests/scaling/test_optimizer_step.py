"""famp.optimizer_step for every torch.optim optimizer, against a GradScaler loop, bit for bit."""

from __future__ import annotations

import functools
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import example, given, settings
from torch.nn import functional
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.overrides import TorchFunctionMode

import famp
from tests.helpers import assert_bitwise_equal

FAMP_DIR = os.path.join(os.path.dirname(os.path.abspath(famp.__file__)), "")  # ends in a separator

Factory = Callable[[Iterable[torch.nn.Parameter], dict[str, Any]], torch.optim.Optimizer]

# name -> (factory, implementations it has)
OPTIMIZERS: dict[str, tuple[Factory, tuple[str, ...]]] = {
    "sgd": (lambda ps, kw: torch.optim.SGD(ps, lr=0.1, **kw), ("for-loop", "foreach", "fused")),
    "sgd_momentum": (
        lambda ps, kw: torch.optim.SGD(
            ps, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01, **kw
        ),
        ("for-loop", "foreach", "fused"),
    ),
    "sgd_nesterov": (
        lambda ps, kw: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, **kw),
        ("for-loop", "foreach", "fused"),
    ),
    "adam": (lambda ps, kw: torch.optim.Adam(ps, lr=1e-2, **kw), ("for-loop", "foreach", "fused")),
    "adam_amsgrad": (
        lambda ps, kw: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, weight_decay=0.1, **kw),
        ("for-loop", "foreach", "fused"),
    ),
    "adamw": (
        lambda ps, kw: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, **kw),
        ("for-loop", "foreach", "fused"),
    ),
    "rmsprop": (
        lambda ps, kw: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.9, centered=True, **kw),
        ("for-loop", "foreach"),
    ),
    "adagrad": (
        lambda ps, kw: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.01, **kw),
        ("for-loop", "foreach", "fused"),
    ),
    "adadelta": (lambda ps, kw: torch.optim.Adadelta(ps, **kw), ("for-loop", "foreach")),
    "adamax": (lambda ps, kw: torch.optim.Adamax(ps, lr=1e-2, **kw), ("for-loop", "foreach")),
    "nadam": (lambda ps, kw: torch.optim.NAdam(ps, lr=1e-2, **kw), ("for-loop", "foreach")),
    "radam": (lambda ps, kw: torch.optim.RAdam(ps, lr=1e-2, **kw), ("for-loop", "foreach")),
    "asgd": (lambda ps, kw: torch.optim.ASGD(ps, lr=1e-2, t0=2, **kw), ("for-loop", "foreach")),
    "rprop": (lambda ps, kw: torch.optim.Rprop(ps, lr=1e-2, **kw), ("for-loop", "foreach")),
    # Factored second moments (row and column statistics of each matrix, another shape).
    "adafactor": (
        lambda ps, kw: torch.optim.Adafactor(ps, lr=1e-2, weight_decay=0.1, **kw),
        ("for-loop", "foreach"),
    ),
    # Matrices only (the biases keep their scaled grads on both sides); no foreach form.
    "muon": (
        lambda ps, kw: torch.optim.Muon([p for p in ps if p.dim() == 2], lr=1e-2),
        ("for-loop",),
    ),
}
IMPLEMENTATIONS = {
    "for-loop": {"foreach": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}
CASES = [(name, impl) for name, (_, impls) in OPTIMIZERS.items() for impl in impls]


def make(name: str, impl: str, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    factory, _ = OPTIMIZERS[name]
    return factory(params, IMPLEMENTATIONS[impl])


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(6, 8, generator=gen), torch.randint(0, 4, (6,), generator=gen)


def loss_of(model: torch.nn.Module, step: int) -> torch.Tensor:
    """float32: the optimizer bridge is the subject (tests/test_recipes.py adds autocast)."""
    x, y = batch(step)
    return functional.cross_entropy(model(x), y)


def inject(model: torch.nn.Module, value: float | None) -> None:
    """Put ``value`` (inf or NaN) into one element of the first parameter's (scaled) gradient."""
    if value is not None:
        grad = next(model.parameters()).grad
        assert grad is not None
        grad[0, 0] = value


def assert_optimizer_states_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    for k in sa["state"]:
        assert sa["state"][k].keys() == sb["state"][k].keys(), k
        for name, value in sa["state"][k].items():
            expected = sb["state"][k][name]
            if isinstance(value, torch.Tensor):
                assert_bitwise_equal(value, expected)
            else:
                assert type(value) is type(expected)
                assert value == expected
    for ga, gb in zip(sa["param_groups"], sb["param_groups"], strict=True):
        assert ga.keys() == gb.keys()
        for name, value in ga.items():
            if isinstance(value, torch.Tensor):
                assert_bitwise_equal(value, gb[name])
            else:
                assert type(value) is type(gb[name]), name
                assert value == gb[name], name


def assert_models_equal(actual: torch.nn.Module, expected: torch.nn.Module) -> None:
    for p, q in zip(actual.parameters(), expected.parameters(), strict=True):
        assert p.dtype == torch.float32
        assert_bitwise_equal(p.detach(), q.detach())
        if q.grad is None:
            assert p.grad is None
        else:
            assert p.grad is not None
            assert_bitwise_equal(p.grad, q.grad)


Pair = tuple[torch.nn.Module, torch.optim.Optimizer]


def side_by_side(
    torch_side: Pair,
    famp_side: Pair,
    pattern: list[float | None],
    init_scale: float,
    device: str = "cpu",
    loss: Callable[[torch.nn.Module, int], torch.Tensor] = loss_of,
) -> Iterator[tuple[float | None, torch.Tensor, famp.ScalerState, torch.amp.GradScaler]]:
    """One GradScaler loop and one famp loop over the same losses, overflows injected per step,
    on `device` (the models and `loss`'s batches on it).

    Yields after each step `(bad, found_inf, state, scaler)`: what was injected (`None`: no
    overflow), famp's found_inf, and both scalers as they stand.
    """
    (model, opt), (famp_model, famp_opt) = torch_side, famp_side
    scaler = torch.amp.GradScaler(device, init_scale=init_scale, growth_interval=2)
    state = famp.init_scaler(init_scale, growth_interval=2, device=device)
    for step, bad in enumerate(pattern):
        opt.zero_grad()
        scaler.scale(loss(model, step)).backward()
        inject(model, bad)
        scaler.step(opt)
        scaler.update()

        famp_opt.zero_grad()
        famp.scale(state, loss(famp_model, step)).backward()
        inject(famp_model, bad)
        found_inf = famp.optimizer_step(famp_opt, state)
        state = famp.update_scale(state, found_inf)
        yield bad, found_inf, state, scaler


overflows = st.lists(st.sampled_from([None, None, math.inf, -math.inf, math.nan]), max_size=6)


@pytest.mark.parametrize(("name", "impl"), CASES)
@settings(max_examples=2)
@given(pattern=overflows, init_scale=st.sampled_from([1.0, 2.0**10, 3000.0]))
@example(pattern=[math.inf, None, None, math.nan, None], init_scale=2.0**10)  # skipped first step
def test_optimizer_step_equals_a_gradscaler_loop_for_every_optimizer(
    name: str, impl: str, pattern: list[float | None], init_scale: float
) -> None:
    if name.startswith("sgd_") and impl == "fused" and pattern and pattern[0] is not None:
        # torch's fused SGD reads uninitialized momentum after a skipped first step (famp zeroes
        # it: test_step.py::test_optimizer_step_fused_sgd_skipped_first_step...)
        pattern = [None, *pattern[1:]]
    model, famp_model = make_model(), make_model()
    opt, famp_opt = make(name, impl, model.parameters()), make(name, impl, famp_model.parameters())
    for bad, found_inf, state, scaler in side_by_side(
        (model, opt), (famp_model, famp_opt), [*pattern, None], init_scale
    ):
        assert found_inf.dtype == torch.float32
        assert found_inf.shape == ()
        assert found_inf.item() == float(bad is not None)
        assert_bitwise_equal(state.scale, scaler._scale)
        assert_bitwise_equal(state.growth_tracker, scaler._growth_tracker)
        assert_models_equal(famp_model, model)
        assert_optimizer_states_equal(famp_opt, opt)


SPARSE: dict[str, Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "sparse_adam": lambda ps: torch.optim.SparseAdam(ps, lr=0.1),
    # Its momentum buffer is a sparse tensor that a step writes in place (a skipped step once
    # raised there: the undo put it back by its storage, which a sparse tensor has none of, and
    # left the buffer written, infinities in).
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1),
    "sgd_nesterov_foreach": lambda ps: torch.optim.SGD(
        ps, lr=0.1, momentum=0.9, nesterov=True, foreach=True
    ),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
}


# torch's own Adagrad and foreach SGD build sparse tensors that warn once (torch's warning).
@pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled")
@pytest.mark.parametrize("name", list(SPARSE))
@settings(max_examples=8)
@given(pattern=overflows)
@example(pattern=[math.inf, None, math.nan, None])
@example(pattern=[None, math.inf, None])  # skipped once the state exists
def test_optimizer_step_with_sparse_gradients_equals_gradscaler(
    name: str, pattern: list[float | None]
) -> None:
    def build() -> tuple[torch.nn.Embedding, torch.optim.Optimizer]:
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 3, sparse=True)
        return emb, SPARSE[name](emb.parameters())

    def backward(emb: torch.nn.Embedding, step: int, scale: Any, bad: float | None) -> None:
        index = torch.tensor([step % 10, (3 * step + 1) % 10, step % 10])
        scale(emb(index).square().sum()).backward()
        assert emb.weight.grad is not None
        assert emb.weight.grad.is_sparse
        if bad is not None:
            grad = emb.weight.grad.coalesce()
            grad.values()[0, 0] = bad
            emb.weight.grad = grad

    emb, opt = build()
    famp_emb, famp_opt = build()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)
    state = famp.init_scaler(2.0**12, growth_interval=2)
    for step, bad in enumerate([*pattern, None]):
        opt.zero_grad()
        backward(emb, step, scaler.scale, bad)
        scaler.step(opt)
        scaler.update()

        famp_opt.zero_grad()
        backward(famp_emb, step, functools.partial(famp.scale, state), bad)
        found_inf = famp.optimizer_step(famp_opt, state)
        state = famp.update_scale(state, found_inf)

        assert found_inf.item() == float(bad is not None)
        assert_bitwise_equal(state.scale, scaler._scale)
        assert_models_equal(famp_emb, emb)
        assert_optimizer_states_equal(famp_opt, opt)


@pytest.mark.parametrize(
    ("name", "impl"),
    [("adam", "for-loop"), ("adam", "foreach"), ("adam", "fused"), ("sgd_momentum", "for-loop")],
)
@pytest.mark.parametrize("grouped", [False, True], ids=["no group", "a one-rank group"])
@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")  # torch's
def test_optimizer_step_after_a_backward_with_create_graph_equals_gradscaler(
    name: str, impl: str, grouped: bool
) -> None:
    # `backward(create_graph=True)` (a gradient penalty, a Hessian-based method) leaves grads that
    # require grad. GradScaler unscales them in place; famp's non-fused path refused them
    # ("donate=True cannot unscale in place ... which requires grad", words the caller never
    # used) and now unscales them as GradScaler does.
    model, famp_model = make_model(), make_model()
    opt, famp_opt = make(name, impl, model.parameters()), make(name, impl, famp_model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    state = famp.init_scaler(2.0**10, growth_interval=2)
    for step, bad in enumerate([None, math.inf, None, None]):
        opt.zero_grad()
        scaler.scale(loss_of(model, step)).backward(create_graph=True)
        with torch.no_grad():
            inject(model, bad)
        scaler.step(opt)
        scaler.update()

        famp_opt.zero_grad()
        famp.scale(state, loss_of(famp_model, step)).backward(create_graph=True)
        assert all(p.grad is not None and p.grad.requires_grad for p in famp_model.parameters())
        with torch.no_grad():
            inject(famp_model, bad)
        if grouped:  # found_inf max-reduced across a group: the general check
            torch.distributed.init_process_group(
                "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
            )
            try:
                found_inf = famp.optimizer_step(
                    famp_opt, state, group=torch.distributed.group.WORLD
                )
            finally:
                torch.distributed.destroy_process_group()
        else:
            found_inf = famp.optimizer_step(famp_opt, state)
        state = famp.update_scale(state, found_inf)

        assert found_inf.item() == float(bad is not None)
        assert_bitwise_equal(state.scale, scaler._scale)
        assert_models_equal(famp_model, model)
        assert_optimizer_states_equal(famp_opt, opt)
    for p in [*model.parameters(), *famp_model.parameters()]:
        p.grad = None  # the grads' graphs hold their parameters: a reference cycle


class HostSyncs(TorchFunctionMode):
    """Records every host sync (``bool``, ``item``, ...) called from famp's code."""

    SYNCS = frozenset({"__bool__", "item", "__float__", "__int__", "__index__", "tolist"})

    def __init__(self) -> None:
        super().__init__()
        self.from_famp: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", None) in self.SYNCS:
            frame = sys._getframe(1)
            while frame is not None and "torch/overrides" in frame.f_code.co_filename:
                frame = frame.f_back  # type: ignore[assignment]
            # famp's own modules, by path: a checkout in a directory named famp holds torch too.
            if frame is not None and frame.f_code.co_filename.startswith(FAMP_DIR):
                self.from_famp.append(f"{frame.f_code.co_filename}:{frame.f_lineno}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("name", "impl"), CASES)
def test_optimizer_step_has_no_host_sync_once_the_state_exists(name: str, impl: str) -> None:
    model = make_model()
    opt = make(name, impl, model.parameters())
    state = famp.init_scaler(2.0**10)
    for step, bad in enumerate([None, math.inf, None]):
        opt.zero_grad()
        famp.scale(state, loss_of(model, step)).backward()
        inject(model, bad)
        with HostSyncs() as syncs:
            found_inf = famp.optimizer_step(opt, state)
            state = famp.update_scale(state, found_inf)
        if step > 0:  # the first step creates the state: the one step that may read found_inf
            assert syncs.from_famp == []


@pytest.mark.parametrize("found_inf", [2.0, math.nan, -1.0, math.inf, 0.5])
@pytest.mark.parametrize(
    ("name", "impl"), [("adam", "fused"), ("sgd_momentum", "fused"), ("adam", "foreach")]
)
def test_optimizer_step_skips_on_any_nonzero_or_nan_found_inf(
    name: str, impl: str, found_inf: float
) -> None:
    """One reading of found_inf: what update_scale and skip_on_overflow call an overflow skips.

    torch's fused kernels skip on exactly 1.0 only: with 2.0 fused Adam stepped and its ``step``
    went to -1; with fused SGD famp zeroed the momentum the applied step had just written.
    """
    model, expected = make_model(), make_model()
    opt, expected_opt = (
        make(name, impl, model.parameters()),
        make(name, impl, expected.parameters()),
    )
    for step in range(2):  # two applied steps first: state and momentum exist
        for m, o in ((model, opt), (expected, expected_opt)):
            o.zero_grad()
            loss_of(m, step).backward()
            assert famp.optimizer_step(o, found_inf=torch.zeros(())).item() == 0.0
    opt.zero_grad()
    loss_of(model, 5).backward()
    skipped = famp.optimizer_step(opt, found_inf=torch.tensor(found_inf))
    assert skipped.dtype == torch.float32
    assert skipped.item() == 1.0
    for p, q in zip(model.parameters(), expected.parameters(), strict=True):
        assert_bitwise_equal(p.detach(), q.detach())
    assert_optimizer_states_equal(opt, expected_opt)
    # and the next applied step is an ordinary third step
    for m, o in ((model, opt), (expected, expected_opt)):
        o.zero_grad()
        loss_of(m, 6).backward()
        famp.optimizer_step(o, found_inf=torch.zeros(1))
    for p, q in zip(model.parameters(), expected.parameters(), strict=True):
        assert_bitwise_equal(p.detach(), q.detach())
    assert_optimizer_states_equal(opt, expected_opt)


@pytest.mark.parametrize(
    ("name", "impl"),
    [("sgd_momentum", "for-loop"), ("adam", "for-loop"), ("adam", "foreach"), ("adam", "fused")],
)
def test_optimizer_step_in_a_compiled_step_equals_gradscaler(name: str, impl: str) -> None:
    """Inside torch.compile (graph breaks allowed), Dynamo traced the undo of a non-fused step
    and raised `NameError: name '___tuple_iterator_getitem' is not defined` at the second step,
    where `GradScaler.step`, which Dynamo skips, runs. Now the step, fused or not, runs eagerly
    behind a graph break (`torch.compiler.disable`). Against GradScaler eagerly."""
    model, expected = make_model(), make_model()
    opt, expected_opt = (
        make(name, impl, model.parameters()),
        make(name, impl, expected.parameters()),
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)

    @torch.compile(backend="eager")
    def step(state: famp.ScalerState) -> tuple[torch.Tensor, famp.ScalerState]:
        found_inf = famp.optimizer_step(opt, state)
        return found_inf, famp.update_scale(state, found_inf)

    state = famp.init_scaler(2.0**10, growth_interval=2)
    for i, bad in enumerate([None, None, math.inf, None]):
        expected_opt.zero_grad()
        scaler.scale(loss_of(expected, i)).backward()
        inject(expected, bad)
        scaler.step(expected_opt)
        scaler.update()
        opt.zero_grad()
        famp.scale(state, loss_of(model, i)).backward()
        inject(model, bad)
        found_inf, state = step(state)
        assert found_inf.item() == float(bad is not None)
        assert_bitwise_equal(state.scale, scaler._scale)
        assert_models_equal(model, expected)
        assert_optimizer_states_equal(opt, expected_opt)


def test_optimizer_step_in_a_compiled_step_equals_eager_gradscaler() -> None:
    """famp runs a non-fused step eagerly inside torch.compile, so a compiled loop ends where an
    eager GradScaler loop ends, bit for bit (a compiled GradScaler loop does not: Dynamo compiles
    the `optimizer.step()` that `GradScaler.step` calls, and `aot_eager` rounds AdamW's update
    otherwise, 2.1e-7 off after three steps with torch 2.13; docs/recipes.md)."""
    model, expected = make_model(), make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    expected_opt = torch.optim.AdamW(expected.parameters(), lr=1e-2, foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)

    @torch.compile(backend="aot_eager")
    def step(state: famp.ScalerState) -> famp.ScalerState:
        return famp.update_scale(state, famp.optimizer_step(opt, state))

    state = famp.init_scaler(2.0**10, growth_interval=2)
    for i in range(4):
        expected_opt.zero_grad()
        scaler.scale(loss_of(expected, i)).backward()
        scaler.step(expected_opt)
        scaler.update()
        opt.zero_grad()
        famp.scale(state, loss_of(model, i)).backward()
        state = step(state)
        assert_models_equal(model, expected)
        assert_optimizer_states_equal(opt, expected_opt)


@pytest.mark.parametrize("fused", [False, True])
def test_a_meta_found_inf_is_refused_before_the_step(fused: bool) -> None:
    """A found_inf on the meta device was found only where the skip read it: the grads were
    unscaled, the state made, and a non-fused Adam had moved its parameter by then."""
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([w], lr=0.1, fused=fused)
    w.grad = torch.full((3,), 1024.0)
    meta = torch.zeros((), device="meta")
    with pytest.raises(ValueError, match="found_inf must hold a value, got a tensor on the meta"):
        famp.optimizer_step(opt, famp.init_scaler(1024.0), found_inf=meta)
    assert w.grad.eq(1024.0).all()
    assert w.eq(1.0).all()
    assert not opt.state


_DUPLICATE_WARNING = "ignore:optimizer contains a parameter group with duplicate parameters"


@pytest.mark.filterwarnings(_DUPLICATE_WARNING)
@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("SGD", {"momentum": 0.9}),
        ("SGD", {"momentum": 0.9, "foreach": True}),
        ("Adam", {}),
        ("Adam", {"foreach": True}),
        ("SGD", {"momentum": 0.9, "fused": True}),
        ("Adam", {"fused": True}),
    ],
)
def test_a_parameter_listed_twice_in_a_group(name: str, kwargs: dict[str, Any]) -> None:
    """A parameter listed twice in one param group (torch warns that this is deprecated).
    GradScaler unscales its gradient once per listing: divided by the scale twice, a non-fused
    optimizer steps with grad / scale**2. famp unscales shared memory once (docs/loss-scaling.md,
    item 14), so a non-fused optimizer steps as in training without scaling. A fused kernel
    unscales per listing under both; famp claims only GradScaler's bits there. Found by a
    differential hunt, 2026-12-01; pinned here on every release."""

    def run(how: str) -> tuple[torch.Tensor, torch.Tensor]:
        w = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
        opt = getattr(torch.optim, name)([w, w], lr=0.1, **kwargs)
        for _ in range(2):
            opt.zero_grad()
            loss = (w * torch.tensor([1.0, 10.0, 100.0])).sum()
            if how == "famp":
                state = famp.init_scaler(1024.0)
                famp.scale(state, loss).backward()
                famp.optimizer_step(opt, state)
            elif how == "GradScaler":
                scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
                scaler.scale(loss).backward()
                scaler.step(opt)
            else:  # no loss scaling at all
                loss.backward()
                opt.step()
        assert w.grad is not None
        return w.detach().clone(), w.grad.clone()

    famp_w, famp_grad = run("famp")
    torch_w, torch_grad = run("GradScaler")
    plain_w, plain_grad = run("unscaled")
    if kwargs.get("fused"):
        assert_bitwise_equal(famp_w, torch_w)
        assert_bitwise_equal(famp_grad, torch_grad)
        assert not torch.equal(torch_w, plain_w)  # the kernel's second listing: grad / scale**2
    else:
        assert_bitwise_equal(famp_w, plain_w)
        assert_bitwise_equal(famp_grad, plain_grad)
        assert_bitwise_equal(torch_grad, plain_grad / 1024.0)  # GradScaler divided it twice
        assert not torch.equal(torch_w, plain_w)


def test_optimizer_step_refuses_closure_optimizers_in_public_terms() -> None:
    w = torch.nn.Parameter(torch.ones(2))
    w.grad = torch.ones(2)
    with pytest.raises(TypeError, match=r"cannot step LBFGS: its step\(\) requires a closure") as e:
        famp.optimizer_step(torch.optim.LBFGS([w]), famp.init_scaler())
    assert "_step_supports" not in str(e.value)
    with pytest.raises(TypeError, match=r"optimizer must be a torch\.optim\.Optimizer, got list"):
        famp.optimizer_step([w], famp.init_scaler())  # type: ignore[arg-type]
    assert_bitwise_equal(w.grad, torch.ones(2))  # nothing was unscaled


class GradScalerArgumentSGD(torch.optim.Optimizer):
    """SGD with the contract GradScaler.step still honours (with a FutureWarning): marked
    `_step_supports_amp_scaling`, its step() takes `grad_scaler=` and unscales and skips itself."""

    _step_supports_amp_scaling = True

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure: Any = None, grad_scaler: Any = None) -> None:  # type: ignore[override]
        if grad_scaler is not None:
            grad_scaler.unscale_(self)
            if any(f.item() for f in grad_scaler._found_inf_per_device(self).values()):
                return
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(group["lr"] * p.grad)


@pytest.mark.parametrize("bad", [None, math.inf])
def test_optimizer_step_refuses_the_grad_scaler_argument_contract(bad: float | None) -> None:
    """GradScaler.step hands such an optimizer itself and no grad_scale/found_inf attributes;
    stepped without it, it applied the scaled gradients (a 1024 times larger update, and no skip
    on an overflow). famp refuses it, with or without a state, and touches nothing."""
    w, v = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(w.sum()).backward()
    if bad is not None:
        w.grad[0] = bad  # type: ignore[index]
    with pytest.warns(FutureWarning, match="GradScaler is going to stop passing itself"):
        scaler.step(GradScalerArgumentSGD([w]))
    expected = torch.ones(2) if bad is not None else torch.full((2,), 0.9)
    assert_bitwise_equal(w.detach(), expected)
    state = famp.init_scaler(1024.0)
    famp.scale(state, v.sum()).backward()
    if bad is not None:
        v.grad[0] = bad  # type: ignore[index]
    grad = v.grad.clone()  # type: ignore[union-attr]
    for kwargs in ({"state": state}, {"found_inf": torch.zeros(())}):
        with pytest.raises(TypeError, match=r"GradScalerArgumentSGD: .* grad_scaler= argument"):
            famp.optimizer_step(GradScalerArgumentSGD([v]), **kwargs)  # type: ignore[arg-type]
    assert_bitwise_equal(v.detach(), torch.ones(2))
    assert_bitwise_equal(v.grad, grad)  # type: ignore[arg-type]


@pytest.mark.parametrize("impl", ["for-loop", "foreach"])
def test_optimizer_step_param_groups_and_a_parameter_without_grad_equal_gradscaler(
    impl: str,
) -> None:
    """Two groups with their own hyperparameters; a frozen parameter keeps no grad and no state."""

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = make_model()
        model[2].bias.requires_grad_(False)  # type: ignore[union-attr]
        groups = [
            {"params": list(model[0].parameters()), "lr": 1e-2},
            {"params": list(model[2].parameters()), "lr": 3e-3, "weight_decay": 0.1},
        ]
        return model, torch.optim.AdamW(groups, **IMPLEMENTATIONS[impl])

    (model, opt), (famp_model, famp_opt) = build(), build()
    pattern = [math.inf, None, math.nan, None, None]
    for _, _, state, scaler in side_by_side((model, opt), (famp_model, famp_opt), pattern, 2.0**10):
        assert famp_model[2].bias.grad is None
        assert_models_equal(famp_model, model)
        assert_optimizer_states_equal(famp_opt, opt)
        assert_bitwise_equal(state.scale, scaler._scale)


# --- optimizers that keep counters in their param groups (timm's Lamb, apex FusedLAMB, Lion) ---


class GroupCounting(torch.optim.Optimizer):
    """Bias-corrected momentum SGD that keeps its counters in each param group: a Python step
    count (`group['step'] += 1`, timm's Lamb), a tensor one advanced in place, and a key it adds
    on its first step; `python_counter=False` keeps only the tensor (and no added key)."""

    def __init__(self, params: Any, python_counter: bool = True) -> None:
        super().__init__(params, {"lr": 0.1, "beta": 0.9})
        self.python_counter = python_counter
        for group in self.param_groups:
            group["count"] = torch.zeros((), dtype=torch.float32)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            group["count"].add_(1)
            correction = 1 - group["beta"] ** group["count"]
            if self.python_counter:
                group["step"] = group.get("step", 0) + 1
                group.setdefault("started_lr", group["lr"])
                correction = correction * (1 - group["beta"] ** group["step"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "m" not in state:
                    state["m"] = torch.zeros_like(p)
                state["m"].mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
                p.sub_(group["lr"] * state["m"] / correction)


def group_counting(model: torch.nn.Module, python_counter: bool) -> torch.optim.Optimizer:
    first, *rest = model.children()
    groups = [
        {"params": list(first.parameters())},
        {"params": [p for m in rest for p in m.parameters()], "lr": 0.05},
    ]
    return GroupCounting(groups, python_counter=python_counter)


@pytest.mark.parametrize("python_counter", [True, False])
@settings(max_examples=6)
@given(pattern=overflows)
@example(pattern=[math.inf, None, math.nan, None])  # a skipped first step
def test_optimizer_step_undoes_param_group_counters_as_gradscaler_never_steps(
    python_counter: bool, pattern: list[float | None]
) -> None:
    """A skipped step leaves each param group as it was: a tensor advanced in place (restored
    with torch.where), a Python count and a key added (restored after one host read)."""
    model, famp_model = make_model(), make_model()
    opt, famp_opt = (
        group_counting(model, python_counter),
        group_counting(famp_model, python_counter),
    )
    counts = [g["count"] for g in famp_opt.param_groups]
    for _ in side_by_side((model, opt), (famp_model, famp_opt), [*pattern, None], 2.0**10):
        assert_models_equal(famp_model, model)
        assert_optimizer_states_equal(famp_opt, opt)
        for group, expected in zip(famp_opt.param_groups, opt.param_groups, strict=True):
            assert group.keys() == expected.keys()
            assert group.get("step") == expected.get("step")
    assert [g["count"] for g in famp_opt.param_groups] == counts  # the same tensors, in place
    assert counts[0].item() == sum(bad is None for bad in [*pattern, None])


def assert_no_host_sync_after_the_first_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer
) -> None:
    """Four steps, two of them skipped: famp reads found_inf on none after the first."""
    state = famp.init_scaler(2.0**10)
    for step, bad in enumerate([None, math.inf, None, math.nan]):
        opt.zero_grad()
        famp.scale(state, loss_of(model, step)).backward()
        inject(model, bad)
        with HostSyncs() as syncs:
            state = famp.update_scale(state, famp.optimizer_step(opt, state))
        if step > 0:  # the first step creates the state: the one step that may read found_inf
            assert syncs.from_famp == []


def test_optimizer_step_undoes_a_tensor_group_counter_without_a_host_sync() -> None:
    model = make_model()
    opt = group_counting(model, python_counter=False)
    assert_no_host_sync_after_the_first_step(model, opt)
    assert opt.param_groups[0]["count"].item() == 2.0


# --- optimizer step hooks: GradScaler never calls step() on a skipped non-fused step -----------

HOOK_KINDS = ("pre", "post", "global_pre", "global_post")
HOOKED_CASES = [
    ("sgd_momentum", "for-loop"),
    ("adamw", "foreach"),
    ("asgd", "foreach"),
    ("adam", "fused"),
    ("adagrad", "fused"),
]


def watch(kind: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[Any, list[Any]]:
    """A step hook of `kind` on `opt` that records what it sees: per call, the parameters and
    their grads, and (post-hooks) an EMA of the weights, as an EMA-of-weights hook keeps one."""
    seen: list[Any] = []
    ema = [p.detach().clone() for p in model.parameters()]

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if optimizer is not opt:  # a global hook sees the other loop's optimizer too
            return
        params = list(model.parameters())
        grads = [None if p.grad is None else p.grad.clone() for p in params]
        seen.append(([p.detach().clone() for p in params], grads))
        if kind.endswith("post"):
            with torch.no_grad():
                for e, p in zip(ema, params, strict=True):
                    e.mul_(0.9).add_(p.detach(), alpha=0.1)

    register = {
        "pre": opt.register_step_pre_hook,
        "post": opt.register_step_post_hook,
        "global_pre": register_optimizer_step_pre_hook,
        "global_post": register_optimizer_step_post_hook,
    }[kind]
    return register(hook), [seen, ema]


def assert_saw_the_same(actual: list[Any], expected: list[Any]) -> None:
    (seen, ema), (expected_seen, expected_ema) = actual, expected
    assert len(seen) == len(expected_seen)
    for (params, grads), (expected_params, expected_grads) in zip(seen, expected_seen, strict=True):
        for p, q in zip(params, expected_params, strict=True):
            assert_bitwise_equal(p, q)
        for g, h in zip(grads, expected_grads, strict=True):
            assert (g is None) == (h is None)
            if g is not None:
                assert_bitwise_equal(g, h)
    for e, f in zip(ema, expected_ema, strict=True):
        assert_bitwise_equal(e, f)


@pytest.mark.parametrize("kind", HOOK_KINDS)
@pytest.mark.parametrize(("name", "impl"), HOOKED_CASES)
@settings(max_examples=2)
@given(pattern=overflows)
@example(pattern=[None, math.inf, None, math.nan, None])
@example(pattern=[math.inf, None])  # a skipped first step: no state, no hook call
def test_optimizer_step_hooks_see_what_they_see_under_gradscaler(
    name: str, impl: str, kind: str, pattern: list[float | None]
) -> None:
    """Step hooks run exactly when GradScaler runs them and see the same parameters and grads:
    never on a skipped non-fused step (famp then calls step() only if the step applies, one host
    read), on every step of a fused one (whose kernel skips). An EMA post-hook of the weights
    stays finite and equal."""
    model, famp_model = make_model(), make_model()
    opt, famp_opt = make(name, impl, model.parameters()), make(name, impl, famp_model.parameters())
    handle, saw = watch(kind, model, opt)
    famp_handle, famp_saw = watch(kind, famp_model, famp_opt)
    try:
        for _ in side_by_side((model, opt), (famp_model, famp_opt), [*pattern, None], 2.0**10):
            assert_models_equal(famp_model, model)
            assert_optimizer_states_equal(famp_opt, opt)
            assert_saw_the_same(famp_saw, saw)
    finally:
        handle.remove()
        famp_handle.remove()
    applied = sum(bad is None for bad in [*pattern, None])
    assert len(saw[0]) == (len(pattern) + 1 if impl == "fused" else applied)
    assert all(e.isfinite().all() for e in famp_saw[1])


# --- fused optimizers: the user's own optimizer.grad_scale, as GradScaler.step multiplies it ---

FUSED_CASES = [name for name, (_, impls) in OPTIMIZERS.items() if "fused" in impls]


@pytest.mark.parametrize("unscale_first", [False, True])
@pytest.mark.parametrize("name", FUSED_CASES)
@settings(max_examples=2)
@given(pattern=overflows, user_scale=st.sampled_from([4.0, 0.25, 3.0]))
@example(pattern=[None, math.inf, None], user_scale=4.0)
def test_optimizer_step_fused_multiplies_the_users_grad_scale_as_gradscaler(
    name: str, unscale_first: bool, pattern: list[float | None], user_scale: float
) -> None:
    """A user's `optimizer.grad_scale` (e.g. accumulated micro-batches) is multiplied by the
    scale of scaled grads, and passed alone for grads unscaled first, as GradScaler.step does.
    GradScaler deletes the attribute after each step (set again here before each); famp restores
    it, so it applies on every famp step while it is set."""
    if name.startswith("sgd_") and pattern and pattern[0] is not None:
        pattern = [None, *pattern[1:]]  # see test_optimizer_step_equals_a_gradscaler_loop...
    model, famp_model = make_model(), make_model()
    opt, famp_opt = (
        make(name, "fused", model.parameters()),
        make(name, "fused", famp_model.parameters()),
    )
    user = torch.tensor(user_scale)
    famp_opt.grad_scale = user  # type: ignore[attr-defined]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    state = famp.init_scaler(2.0**10, growth_interval=2)
    for step, bad in enumerate([*pattern, None]):
        opt.zero_grad()
        scaler.scale(loss_of(model, step)).backward()
        inject(model, bad)
        if unscale_first:
            scaler.unscale_(opt)
        opt.grad_scale = user  # type: ignore[attr-defined]
        scaler.step(opt)
        scaler.update()
        assert not hasattr(opt, "grad_scale")

        famp_opt.zero_grad()
        famp.scale(state, loss_of(famp_model, step)).backward()
        inject(famp_model, bad)
        if unscale_first:
            grads = [p.grad for p in famp_model.parameters()]
            _, found_inf = famp.unscale_and_check(state, grads, donate=True)
            found_inf = famp.optimizer_step(famp_opt, found_inf=found_inf)
        else:
            found_inf = famp.optimizer_step(famp_opt, state)
        state = famp.update_scale(state, found_inf)
        assert famp_opt.grad_scale is user  # type: ignore[attr-defined]
        assert not hasattr(famp_opt, "found_inf")
        assert found_inf.item() == float(bad is not None)
        assert_bitwise_equal(state.scale, scaler._scale)
        assert_models_equal(famp_model, model)
        assert_optimizer_states_equal(famp_opt, opt)
    assert_bitwise_equal(user, torch.tensor(user_scale))


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_fused_sgd_in_a_compiled_step_with_dynamic_shapes_equals_gradscaler(
    momentum: float,
) -> None:
    """Before 2026-12-01 famp traced a fused step: with `dynamic=True` and `backward()` in the
    compiled function, Dynamo gave up the rest of the frame at a graph break inside fused SGD's
    step, which then ran without `grad_scale` (the scaled gradients applied: 256 times the
    update) before famp raised `AttributeError`. The step now runs eagerly behind a graph break,
    as `GradScaler.step`'s does. Against GradScaler eagerly, over steps with an overflow."""

    def make_pair() -> tuple[torch.nn.Linear, torch.optim.SGD]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum, fused=True)

    (model, opt), (expected, expected_opt) = make_pair(), make_pair()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
    state = famp.init_scaler(2.0**8, growth_interval=1)

    @torch.compile(backend="eager", dynamic=True)
    def step(
        state: famp.ScalerState, x: torch.Tensor, y: torch.Tensor
    ) -> tuple[torch.Tensor, famp.ScalerState]:
        famp.scale(state, functional.mse_loss(model(x), y)).backward()
        found_inf = famp.optimizer_step(opt, state)
        return found_inf, famp.update_scale(state, found_inf)

    g = torch.Generator().manual_seed(1)
    for bad in (False, True, False):
        x, y = torch.randn(3, 4, generator=g), torch.randn(3, 2, generator=g)
        x = x.index_fill(0, torch.tensor([1]), math.inf) if bad else x
        expected_opt.zero_grad()
        scaler.scale(functional.mse_loss(expected(x), y)).backward()
        scaler.step(expected_opt)
        scaler.update()
        opt.zero_grad()
        found_inf, state = step(state, x, y)
        assert found_inf.item() == float(bad)
        assert_bitwise_equal(state.scale, scaler._scale)
        assert_models_equal(model, expected)
        assert_optimizer_states_equal(opt, expected_opt)
