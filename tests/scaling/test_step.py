"""value_and_grad, skip_on_overflow and optimizer_step against GradScaler, bit for bit."""

from __future__ import annotations

import collections
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import hypothesis.strategies as st
import optree
import pytest
import torch
from hypothesis import given, settings
from torch.func import functional_call
from torch.nn import functional

import famp
from tests.helpers import assert_bitwise_equal
from tests.scaling.test_scaler_unscale import random_bits

LR = 0.1


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def make_batch(step: int, bad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``step``; ``bad`` puts an inf in the input, so every gradient is NaN."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(6, 8, generator=gen)
    y = torch.randint(0, 4, (6,), generator=gen)
    if bad:
        x[0, 0] = math.inf
    return x, y


def clone_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


MODEL = make_model()


def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = functional_call(MODEL, params, (x,))
        assert logits.dtype == torch.bfloat16
        return functional.cross_entropy(logits, y)


def torch_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return functional.cross_entropy(model(x), y)


scaler_configs = st.fixed_dictionaries(
    {
        "init_scale": st.one_of(
            st.integers(0, 127).map(lambda e: 2.0**e), st.floats(1.0, 2.0**127, width=32)
        ),
        "growth_factor": st.one_of(st.just(2.0), st.floats(1.01, 16.0)),
        "backoff_factor": st.one_of(st.just(0.5), st.floats(0.01, 0.99)),
        "growth_interval": st.integers(1, 4),
    }
)


# --- value_and_grad -----------------------------------------------------------------------------


@settings(max_examples=25)
@given(config=scaler_configs, pattern=st.lists(st.booleans(), min_size=1, max_size=10))
def test_value_and_grad_sgd_trajectory_equals_gradscaler(
    config: dict[str, Any], pattern: list[bool]
) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", **config)
    params = clone_params(model)
    state = famp.init_scaler(**config)
    step = famp.value_and_grad(loss_fn)
    for i, bad in enumerate(pattern):
        x, y = make_batch(i, bad)
        opt.zero_grad(set_to_none=True)
        expected_loss = torch_loss(model, x, y)
        scaler.scale(expected_loss).backward()
        scaler.step(opt)
        skipped = bool(sum(scaler._found_inf_per_device(opt).values()))
        scaler.update()

        loss, grads, found_inf, state = step(state, params, x, y)
        new_params = {k: torch.add(p, grads[k], alpha=-LR) for k, p in params.items()}
        params = famp.skip_on_overflow(found_inf, new_params, params)

        assert_bitwise_equal(loss, expected_loss.detach())
        assert found_inf.dtype == torch.float32
        assert found_inf.item() == float(skipped)
        assert_bitwise_equal(state.scale, scaler._scale)
        assert_bitwise_equal(state.growth_tracker, scaler._growth_tracker)
        for k, p in model.named_parameters():
            assert params[k].dtype == torch.float32
            assert_bitwise_equal(params[k], p.detach())


def test_value_and_grad_has_aux_argnums_and_kwargs() -> None:
    def fn(
        w: torch.Tensor, b: torch.Tensor, x: torch.Tensor, *, shift: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        out = (w * x + b + shift).square().mean()
        return out, {"out": out * 2, "x": x}

    w, b, x, shift = torch.randn(5), torch.randn(5), torch.randn(5), torch.tensor(0.25)
    state = famp.init_scaler(2.0**8, growth_interval=1)
    (loss, aux), grads, found_inf, new_state = famp.value_and_grad(fn, (0, 1), has_aux=True)(
        state, w, b, x, shift=shift
    )
    (ew, eb), (eloss, eaux) = torch.func.grad_and_value(fn, (0, 1), has_aux=True)(
        w, b, x, shift=shift
    )
    assert isinstance(grads, tuple)
    assert_bitwise_equal(grads[0], ew)  # power-of-two scale: unscaling is exact
    assert_bitwise_equal(grads[1], eb)
    assert_bitwise_equal(loss, eloss)
    assert_bitwise_equal(aux["out"], eaux["out"])
    assert not aux["out"].requires_grad
    assert found_inf.item() == 0.0
    assert new_state.scale.item() == 2.0**9


def test_value_and_grad_disabled_state_is_plain_grad() -> None:
    params = clone_params(MODEL)
    x, y = make_batch(0, False)
    state = famp.init_scaler(enabled=False)
    _, grads, found_inf, new_state = famp.value_and_grad(loss_fn)(state, params, x, y)
    expected = torch.func.grad(loss_fn)(params, x, y)
    for k in params:
        assert_bitwise_equal(grads[k], expected[k])
    assert found_inf.item() == 0.0
    assert new_state is state


def test_value_and_grad_returns_nonfinite_grads_and_the_backed_off_state() -> None:
    params = clone_params(MODEL)
    state = famp.init_scaler(2.0**16)
    _, grads, found_inf, new_state = famp.value_and_grad(loss_fn)(
        state, params, *make_batch(0, True)
    )
    assert found_inf.item() == 1.0
    assert not bool(famp.all_finite(grads))
    assert new_state.scale.item() == 2.0**15
    assert new_state.growth_tracker.item() == 0


def test_value_and_grad_under_vmap_equals_a_loop_over_samples() -> None:
    """Per-sample grads: each sample gets its own found_inf and its own next scale."""
    params = clone_params(MODEL)
    xs, ys = make_batch(0, False)
    xs[2, 1] = math.inf
    state = famp.init_scaler(2.0**10, growth_interval=1)

    def sample_loss(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return functional.cross_entropy(functional_call(MODEL, p, (x[None],)), y[None])

    step = famp.value_and_grad(sample_loss)
    losses, grads, found_infs, states = torch.func.vmap(step, in_dims=(None, None, 0, 0))(
        state, params, xs, ys
    )
    # torch.func's own per-sample grads (a power-of-two scale unscales exactly)
    expected = torch.func.vmap(torch.func.grad(sample_loss), in_dims=(None, 0, 0))(params, xs, ys)
    for k in params:
        assert_bitwise_equal(grads[k], expected[k])
    expected_losses = torch.func.vmap(sample_loss, in_dims=(None, 0, 0))(params, xs, ys)
    torch.testing.assert_close(losses, expected_losses, rtol=0, atol=0, equal_nan=True)
    assert found_infs.dtype == torch.float32
    for i in range(len(xs)):
        loss, grad, found_inf, new_state = step(state, params, xs[i], ys[i])
        torch.testing.assert_close(losses[i], loss, equal_nan=True)  # vmap sums in another order
        assert_bitwise_equal(found_infs[i], found_inf)
        assert found_inf.item() == float(i == 2)
        assert_bitwise_equal(states.scale[i], new_state.scale)
        assert_bitwise_equal(states.growth_tracker[i], new_state.growth_tracker)
        for k in params:  # vmap's batched matmuls sum in another order than one sample's
            torch.testing.assert_close(grads[k][i], grad[k], equal_nan=True)


def test_value_and_grad_bad_input() -> None:
    with pytest.raises(TypeError, match="argnums must be an int"):
        famp.value_and_grad(loss_fn, argnums="0")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="argnums must be an int"):
        famp.value_and_grad(loss_fn, argnums=())
    with pytest.raises(TypeError, match="has_aux must be a bool"):
        famp.value_and_grad(loss_fn, has_aux=1)  # type: ignore[arg-type]
    w = torch.ones(3)
    with pytest.raises(TypeError, match=r"famp\.ScalerState, got dict"):
        famp.value_and_grad(lambda w: w.sum())({"scale": 1.0}, w)
    with pytest.raises(
        TypeError,
        match=r"one-element floating tensor as loss, got a torch.float32 "
        r"tensor of shape \(3,\)",
    ):
        famp.value_and_grad(lambda w: w * 2)(famp.init_scaler(), w)
    with pytest.raises(TypeError, match="pair \\(loss, aux\\), got Tensor"):
        famp.value_and_grad(lambda w: w.sum(), has_aux=True)(famp.init_scaler(), w)


def test_value_and_grad_accepts_a_loss_of_any_one_element_shape() -> None:
    """The docstring's "one element": shape (1,) and (1, 1) give the 0-d loss's grads."""
    w, x = torch.tensor([1.5, -2.0]), torch.tensor([3.0, 0.25])
    state = famp.init_scaler(2.0**4)
    _, expected, expected_found_inf, expected_state = famp.value_and_grad(lambda w: (w * x).sum())(
        state, w
    )
    for shape in [(1,), (1, 1)]:
        loss, grads, found_inf, new_state = famp.value_and_grad(
            lambda w, shape=shape: (w * x).sum().reshape(shape)
        )(state, w)
        assert loss.shape == shape  # the loss as fn returned it
        assert grads.dtype == torch.float32
        assert_bitwise_equal(grads, expected)
        assert_bitwise_equal(found_inf, expected_found_inf)
        assert_bitwise_equal(new_state.scale, expected_state.scale)


@pytest.mark.parametrize("fn", [None, 3, "loss"])
def test_value_and_grad_refuses_a_non_callable(fn: object) -> None:
    with pytest.raises(TypeError, match=f"fn must be callable, got {type(fn).__name__}"):
        famp.value_and_grad(fn)  # type: ignore[arg-type]


def test_optimizer_step_accepts_found_inf_of_any_one_element_shape() -> None:
    for found_inf, skipped in [(torch.zeros(1), False), (torch.ones(1, 1), True)]:
        w = torch.nn.Parameter(torch.ones(2))
        w.grad = torch.ones(2)
        opt = torch.optim.SGD([w], lr=0.5, fused=True)
        out = famp.optimizer_step(opt, found_inf=found_inf)
        assert out.shape == ()
        assert out.dtype == torch.float32
        expected = torch.ones(2) if skipped else torch.full((2,), 0.5)
        assert_bitwise_equal(w.detach(), expected)


# --- skip_on_overflow: step counters and schedules ----------------------------------------------


def adam_update(
    params: dict[str, torch.Tensor],
    grads: dict[str, torch.Tensor],
    opt_state: dict[str, Any],
    lr: torch.Tensor,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A pure Adam whose step counter is a tensor in its state."""
    count = opt_state["count"] + 1
    mu = optree.tree_map(lambda m, g: 0.9 * m + 0.1 * g, opt_state["mu"], grads)
    nu = optree.tree_map(lambda v, g: 0.999 * v + 0.001 * g * g, opt_state["nu"], grads)
    c1, c2 = 1 - 0.9**count, 1 - 0.999**count
    new = optree.tree_map(
        lambda p, m, v: p - lr * (m / c1) / ((v / c2).sqrt() + 1e-8), params, mu, nu
    )
    return new, {"count": count, "mu": mu, "nu": nu}


def schedule(count: torch.Tensor) -> torch.Tensor:
    return 0.01 * 0.9 ** count.to(torch.float32)


def run(
    pattern: Sequence[bool], keep: Sequence[int], by: str
) -> tuple[dict[str, torch.Tensor], dict[str, Any], famp.ScalerState]:
    """Train on batches ``keep`` of ``pattern`` with a power-of-two scale and an fp32 model."""
    params = clone_params(MODEL)
    opt_state: dict[str, Any] = {
        "count": torch.zeros((), dtype=torch.int64),
        "mu": optree.tree_map(torch.zeros_like, params),
        "nu": optree.tree_map(torch.zeros_like, params),
    }
    state = famp.init_scaler(2.0**10, growth_interval=1000)
    step = famp.value_and_grad(
        lambda p, x, y: functional.cross_entropy(functional_call(MODEL, p, (x,)), y)
    )
    for i in keep:
        _, grads, found_inf, state = step(state, params, *make_batch(i, pattern[i]))
        lr = schedule(opt_state["count"] if by == "optimizer" else torch.tensor(i))
        new = adam_update(params, grads, opt_state, lr)
        params, opt_state = famp.skip_on_overflow(found_inf, new, (params, opt_state))
    return params, opt_state, state


@settings(max_examples=15)
@given(
    pattern=st.lists(st.booleans(), min_size=1, max_size=8),
    by=st.sampled_from(["optimizer", "iteration"]),
)
def test_skipped_steps_never_happened_for_the_optimizer(pattern: list[bool], by: str) -> None:
    """Skipping rolls back params, moments and the optimizer's step counter.

    A schedule read off the optimizer's counter then sees only the applied steps; a schedule read
    off the iteration counter advances on skipped steps too.
    """
    params, opt_state, state = run(pattern, range(len(pattern)), by)
    good = [i for i, bad in enumerate(pattern) if not bad]
    expected_params, expected_opt, _ = run(pattern, good, by)
    assert opt_state["count"].item() == len(good)
    leaves = optree.tree_leaves((params, opt_state))
    expected = optree.tree_leaves((expected_params, expected_opt))
    for a, b in zip(leaves, expected, strict=True):
        assert_bitwise_equal(a, b)
    assert state.scale.item() == 2.0 ** (10 - sum(pattern))


@pytest.mark.parametrize("found_inf", [0.0, -0.0, 1.0, 2.0, -1.0, math.nan, math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_skip_on_overflow_treats_any_nonzero_found_inf_as_overflow(
    found_inf: float, dtype: torch.dtype
) -> None:
    new, old = (
        {"w": torch.zeros(3), "n": torch.tensor(1)},
        {"w": torch.ones(3), "n": torch.tensor(0)},
    )
    flag = torch.tensor([found_inf], dtype=dtype)
    out = famp.skip_on_overflow(flag, new, old)
    expected = new if found_inf == 0.0 else old
    for key in ("w", "n"):
        assert out[key] is expected[key]  # eagerly famp reads found_inf: no copy
        assert_bitwise_equal(out[key], torch.where(flag.reshape(()) == 0, new[key], old[key]))


@pytest.mark.parametrize("found_inf", [torch.tensor(0), torch.tensor(3), torch.tensor([True])])
def test_skip_on_overflow_reads_integer_and_bool_found_inf_as_torch_where_does(
    found_inf: torch.Tensor,
) -> None:
    new, old = {"w": torch.zeros(2)}, {"w": torch.ones(2)}
    out = famp.skip_on_overflow(found_inf, new, old)
    assert_bitwise_equal(out["w"], torch.where(found_inf.reshape(()) == 0, new["w"], old["w"]))


def test_skip_on_overflow_bad_input() -> None:
    tree = {"w": torch.zeros(2)}
    with pytest.raises(TypeError, match="found_inf must be a Tensor, got float"):
        famp.skip_on_overflow(1.0, tree, tree)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"exactly one element, got shape \(2,\)"):
        famp.skip_on_overflow(torch.zeros(2), tree, tree)
    # in its own names, not select_tree's (on_true, on_false) as before
    same = "famp.skip_on_overflow: updated and current must have the same structure"
    with pytest.raises(ValueError, match=same):
        famp.skip_on_overflow(torch.zeros(()), tree, {"v": torch.zeros(2)})
    with pytest.raises(ValueError, match=same):  # a subtree where a leaf should be
        famp.skip_on_overflow(torch.zeros(()), tree, {"w": [torch.zeros(2)]})
    with pytest.raises(
        TypeError,
        match=r"famp.skip_on_overflow: the leaves at tree\['w'\] differ in dtype: torch\.float64",
    ):
        famp.skip_on_overflow(torch.zeros(()), {"w": torch.zeros(2, dtype=torch.float64)}, tree)
    with pytest.raises(ValueError, match=r"skip_on_overflow: .* differ in shape: \(3,\) and \(2,"):
        famp.skip_on_overflow(torch.zeros(()), {"w": torch.zeros(3)}, tree)
    with pytest.raises(TypeError, match=r"skip_on_overflow: .* must be a Tensor or None, got"):
        famp.skip_on_overflow(torch.zeros(()), {"w": 1.0}, {"w": 2.0})
    with pytest.raises(ValueError, match=r"famp\.select_tree: on_true and on_false must have"):
        famp.select_tree(torch.tensor(True), tree, {"v": torch.zeros(2)})


# --- select_tree eagerly: the chosen leaves themselves, torch.where's values --------------------


@settings(deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    pred=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
)
def test_select_tree_eagerly_returns_the_chosen_leaves_with_torch_where_values(
    seed: int, pred: bool, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(seed)
    on_true = {"w": random_bits((5, 3), dtype, gen), "n": torch.tensor(seed % 7), "none": None}
    on_false = {"w": random_bits((5, 3), dtype, gen), "n": torch.tensor(1), "none": None}
    flag = torch.tensor(pred)
    out = famp.select_tree(flag, on_true, on_false)
    chosen = on_true if pred else on_false
    assert out["none"] is None
    for key in ("w", "n"):
        assert out[key] is chosen[key]  # no copy eagerly
        assert_bitwise_equal(out[key], torch.where(flag, on_true[key], on_false[key]))


def test_select_tree_keeps_torch_where_for_leaves_that_require_grad() -> None:
    # torch.where gives both trees gradients, zeros for the one not chosen; the pairs of the
    # same trees that carry no graph are the chosen leaves themselves.
    a = torch.randn(4, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    c, d = torch.randn(2), torch.randn(2)
    for pred in (True, False):
        out = famp.select_tree(torch.tensor(pred), {"w": a * 2, "n": c}, {"w": b * 3, "n": d})
        assert out["n"] is (c if pred else d)
        got = torch.autograd.grad(out["w"].sum(), (a, b))
        where = torch.where(torch.tensor(pred), a * 2, b * 3)
        expected = torch.autograd.grad(where.sum(), (a, b))
        for g, e in zip(got, expected, strict=True):
            assert_bitwise_equal(g, e)
        with torch.no_grad():  # no graph to keep: chosen leaves, whatever requires grad
            assert famp.select_tree(torch.tensor(pred), {"w": a}, {"w": b})["w"] is (
                a if pred else b
            )


def test_select_tree_under_vmap_selects_per_sample() -> None:
    preds = torch.tensor([True, False, True])
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    out = torch.func.vmap(lambda p, x, y: famp.select_tree(p, {"w": x}, {"w": y}))(preds, a, b)
    assert_bitwise_equal(out["w"], torch.where(preds[:, None], a, b))


def test_skip_on_overflow_with_in_place_writes_gives_torch_where_numbers() -> None:
    # EMA-style in-place writes into the parameters famp returns, and an EMA read from them,
    # over steps with overflows: eagerly famp returns the chosen leaves themselves, and the
    # numbers equal a loop that skips with torch.where copies.
    def run(skip: Callable[[torch.Tensor, Any, Any], Any]) -> list[torch.Tensor]:
        params = {"w": torch.linspace(-1, 1, 6), "b": torch.ones(2)}
        ema = [torch.zeros(6), torch.zeros(2)]
        for step in range(6):
            grads = {k: torch.full_like(v, 0.1 * (step + 1)) for k, v in params.items()}
            found_inf = torch.tensor(float(step in (2, 3)))
            new = {k: v - LR * grads[k] for k, v in params.items()}
            params = skip(found_inf, new, params)
            with torch.no_grad():
                for p in params.values():
                    p.mul_(0.999)  # in place into the result: decoupled weight decay
                torch._foreach_lerp_(ema, list(params.values()), 0.1)
        return [*params.values(), *ema]

    def where_skip(found_inf: torch.Tensor, new: Any, old: Any) -> Any:
        keep = found_inf == 0
        return {k: torch.where(keep, new[k], old[k]) for k in new}

    for got, expected in zip(run(famp.skip_on_overflow), run(where_skip), strict=True):
        assert_bitwise_equal(got, expected)


def _rich_trees() -> tuple[Any, Any]:
    """Two trees of every container kind famp meets: dicts in other key orders, None leaves,
    a namedtuple, nested lists and tuples, and a famp.ScalerState (an optree node)."""
    pair = collections.namedtuple("pair", "x y")
    gen = torch.Generator().manual_seed(3)
    new = {
        "w": torch.randn(3, generator=gen),
        "n": None,
        "p": pair(torch.randn(2, generator=gen), torch.randn(1, dtype=torch.float64)),
        "l": [torch.randn(2, generator=gen), (torch.tensor(7),)],
        "s": famp.init_scaler(8.0),
    }
    old = {
        "s": famp.init_scaler(2.0),
        "l": [torch.randn(2, generator=gen), (torch.tensor(1),)],
        "p": pair(torch.randn(2, generator=gen), torch.randn(1, dtype=torch.float64)),
        "n": None,
        "w": torch.randn(3, generator=gen),
    }
    return new, old


_COMPILED_SKIP = torch.compile(famp.skip_on_overflow, fullgraph=True)


@pytest.mark.parametrize("found_inf", [0.0, 1.0, math.nan])
def test_skip_on_overflow_compiled_over_every_container_equals_torch_where(
    found_inf: float,
) -> None:
    new, old = _rich_trees()
    found = torch.tensor(found_inf)
    out = _COMPILED_SKIP(found, new, old)
    keep = found == 0
    expected = optree.tree_map(lambda a, b: torch.where(keep, a, b), new, old)
    assert optree.tree_structure(out) == optree.tree_structure(expected)
    assert list(out) == list(new)  # the updated tree's key order
    for got, want in zip(optree.tree_leaves(out), optree.tree_leaves(expected), strict=True):
        assert_bitwise_equal(got, want)


@pytest.mark.parametrize("found_inf", [0.0, 1.0, math.nan])
def test_skip_on_overflow_eagerly_over_every_container_returns_the_chosen_leaves(
    found_inf: float,
) -> None:
    # Eagerly the choice is read once and each result is the chosen leaf itself, in new
    # containers of the updated tree's structure and key order, with torch.where's values.
    new, old = _rich_trees()
    found = torch.tensor(found_inf)
    out = famp.skip_on_overflow(found, new, old)
    keep = found == 0
    expected = optree.tree_map(lambda a, b: torch.where(keep, a, b), new, old)
    assert optree.tree_structure(out) == optree.tree_structure(expected)
    assert list(out) == list(new)
    assert out is not new
    assert out is not old
    chosen = new if found_inf == 0 else old
    # `chosen` (`old` after an overflow) laid out as `new`: the leaves that were chosen, in order.
    chosen_leaves = optree.tree_structure(new).flatten_up_to(chosen)
    got_leaves = optree.tree_leaves(out)
    for got, want, leaf in zip(
        got_leaves, optree.tree_leaves(expected), chosen_leaves, strict=True
    ):
        assert got is leaf
        assert_bitwise_equal(got, want)


# Plain trees (dicts, lists, tuples, None, tensors), which famp walks by hand when it reads the
# predicate: a structure is drawn, then filled twice, the second time with dict keys reversed.
_PLAIN_SHAPES = st.recursive(
    st.sampled_from(["tensor", "param", "none"]),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.sampled_from("abcde"), inner, max_size=3),
    ),
    max_leaves=10,
)


def _filled(shape: Any, gen: torch.Generator, reverse: bool) -> Any:
    if isinstance(shape, dict):
        items = list(shape.items())
        return {k: _filled(v, gen, reverse) for k, v in (items[::-1] if reverse else items)}
    if isinstance(shape, (list, tuple)):
        return type(shape)(_filled(v, gen, reverse) for v in shape)
    if shape == "none":
        return None
    leaf = torch.randn(2, 3, generator=gen)
    return torch.nn.Parameter(leaf) if shape == "param" and not reverse else leaf


def _key_orders(tree: Any) -> Any:
    """The tree's containers with their dict keys in order, leaves blanked: what `==` misses."""
    if isinstance(tree, dict):
        return [(k, _key_orders(v)) for k, v in tree.items()]
    if isinstance(tree, (list, tuple)):
        return (type(tree).__name__, [_key_orders(v) for v in tree])
    return None if tree is None else "leaf"


@given(shape=_PLAIN_SHAPES, found_inf=st.sampled_from([0.0, 1.0, math.nan]))
def test_skip_on_overflow_eagerly_over_plain_containers_is_optrees_tree_map(
    shape: Any, found_inf: float
) -> None:
    """The hand-walked plain trees give what optree's `tree_map` gives: the chosen leaves
    themselves, in new containers of the updated tree's structure and key order. The
    parameters (`nn.Parameter`) pair with plain tensors, as leaves of any tensor type do."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # parameters require grad: without grad they carry no graph
        new, old = _filled(shape, gen, False), _filled(shape, gen, True)
        out = famp.skip_on_overflow(torch.tensor(found_inf), new, old)
    keep = found_inf == 0
    expected = optree.tree_map(lambda a, b: a if keep else b, new, old)
    assert optree.tree_structure(out) == optree.tree_structure(expected)
    assert _key_orders(out) == _key_orders(expected) == _key_orders(new)
    for got, want in zip(optree.tree_leaves(out), optree.tree_leaves(expected), strict=True):
        assert got is want
    if isinstance(new, (dict, list)) or (isinstance(new, tuple) and new):  # () is one object
        assert out is not new
        assert out is not old


def test_skip_on_overflow_eagerly_over_plain_containers_names_a_bad_pair() -> None:
    def trees() -> tuple[Any, Any]:
        gen = torch.Generator().manual_seed(1)
        new = {"b": [torch.randn(2, generator=gen), None], "a": (torch.randn(3, generator=gen),)}
        old = {"a": (torch.randn(3, generator=gen),), "b": [torch.randn(2, generator=gen), None]}
        return new, old

    new, old = trees()
    old["a"] = (old["a"][0].double(),)
    with pytest.raises(TypeError, match=r"\['a'\]\[0\] differ in dtype"):
        famp.skip_on_overflow(torch.tensor(0.0), new, old)
    new, old = trees()
    old["b"][0] = torch.zeros(5)
    with pytest.raises(ValueError, match=r"\['b'\]\[0\] differ in shape: \(2,\) and \(5,\)"):
        famp.skip_on_overflow(torch.tensor(1.0), new, old)
    for change in ({"c": None}, {"b": [None, None]}):
        new, old = trees()
        old.update(change)
        with pytest.raises(ValueError, match="same structure"):
            famp.skip_on_overflow(torch.tensor(0.0), new, old)
    new, old = trees()
    old["b"][0] = 3  # a leaf famp cannot choose
    with pytest.raises(TypeError, match=r"\['b'\]\[0\] must be a Tensor or None, got int"):
        famp.skip_on_overflow(torch.tensor(0.0), new, old)


def test_skip_on_overflow_eagerly_over_plain_containers_keeps_where_for_a_graph() -> None:
    for found_inf in (0.0, 1.0):
        a = torch.randn(2, requires_grad=True)
        new = {"w": [a * 2, torch.ones(3)], "b": torch.ones(1)}
        old = {"b": torch.zeros(1), "w": [torch.zeros(2), torch.zeros(3)]}
        out = famp.skip_on_overflow(torch.tensor(found_inf), new, old)
        keep = torch.tensor(found_inf == 0)
        assert_bitwise_equal(out["w"][0], torch.where(keep, a * 2, old["w"][0]))
        (grad,) = torch.autograd.grad(out["w"][0].sum(), a)
        assert_bitwise_equal(grad, torch.full((2,), 2.0 if found_inf == 0 else 0.0))
        chosen = new if found_inf == 0 else old
        assert out["b"] is chosen["b"]
        assert out["w"][1] is chosen["w"][1]
        assert list(out) == ["w", "b"]


def test_skip_on_overflow_eagerly_names_a_bad_pair_after_good_ones() -> None:
    new, old = _rich_trees()
    old["w"] = old["w"].double()  # the last leaf of optree's (sorted) order
    with pytest.raises(
        TypeError, match=r"\['w'\] differ in dtype: torch\.float32 and torch\.float64"
    ):
        famp.skip_on_overflow(torch.tensor(0.0), new, old)
    new, old = _rich_trees()
    old["l"][1] = (torch.tensor([1, 2]),)
    with pytest.raises(ValueError, match=r"\['l'\]\[1\]\[0\] differ in shape: \(\) and \(2,\)"):
        famp.skip_on_overflow(torch.tensor(1.0), new, old)
    new, old = _rich_trees()
    old["l"][1] = [torch.tensor(1)]  # a list where new has a tuple
    with pytest.raises(ValueError, match="same structure"):
        famp.skip_on_overflow(torch.tensor(0.0), new, old)


def test_skip_on_overflow_eagerly_keeps_torch_where_for_pairs_with_a_graph() -> None:
    # One pair that carries a graph deep in a rich tree: torch.where there (gradients for both
    # trees), the chosen leaves themselves elsewhere.
    for found_inf in (0.0, 1.0):
        new, old = _rich_trees()
        a = torch.randn(2, requires_grad=True)
        new["p"] = new["p"]._replace(x=a * 2)
        out = famp.skip_on_overflow(torch.tensor(found_inf), new, old)
        keep = torch.tensor(found_inf == 0)
        assert_bitwise_equal(out["p"].x, torch.where(keep, a * 2, old["p"].x))
        (grad,) = torch.autograd.grad(out["p"].x.sum(), a)
        assert_bitwise_equal(grad, torch.full((2,), 2.0 if found_inf == 0 else 0.0))
        assert out["w"] is (new if found_inf == 0 else old)["w"]


def _many_leaves(gen: torch.Generator, n: int) -> list[torch.Tensor]:
    """n leaves of six dtypes and varied shapes: random bit patterns (NaN payloads, -0.0, infs)."""
    dtypes = [torch.float32, torch.bfloat16, torch.float64, torch.float16]
    out = []
    for i in range(n):
        shape = (i % 3 + 1, 5)
        if i % 5 == 3:
            out.append(torch.randint(-9, 9, shape, generator=gen))
        elif i % 5 == 4:
            out.append(torch.rand(shape, generator=gen) < 0.5)
        else:
            out.append(random_bits(shape, dtypes[i % 4], gen))
    return out


def _skip_many(found: torch.Tensor, new: Any, old: Any) -> Any:
    return famp.skip_on_overflow(found, new, old)


_SKIP_MANY = {
    "static": torch.compile(_skip_many, fullgraph=True),
    "dynamic": torch.compile(
        lambda found, new, old: famp.skip_on_overflow(found, new, old), fullgraph=True, dynamic=True
    ),
}


@pytest.mark.parametrize("mode", sorted(_SKIP_MANY))
@pytest.mark.parametrize("found_inf", [0.0, 1.0, math.nan])
def test_skip_on_overflow_compiled_over_many_leaves_equals_torch_where(
    mode: str, found_inf: float
) -> None:
    # 21 leaves of six dtypes, chosen compiled by one famp::select_ (tests/scaling/test_choice.py).
    gen = torch.Generator().manual_seed(11)
    new, old = _many_leaves(gen, 21), _many_leaves(gen, 21)
    found = torch.tensor(found_inf)
    out = _SKIP_MANY[mode](found, new, old)
    keep = found == 0
    assert len(out) == len(new)
    for got, a, b in zip(out, new, old, strict=True):
        assert_bitwise_equal(got, torch.where(keep, a, b))


def test_select_tree_compiled_reads_each_predicate_copy_from_at_most_eight_leaves() -> None:
    """What keeps a `torch.where` skip's compile time linear: no one predicate read by every leaf.

    Inductor pairs up the nodes that read one buffer to look for fusions; with one predicate
    read by the `where` of 120 parameters that search took 13 s of a step's compile. The
    graph Dynamo hands the backend must read the predicate itself from 8 leaves and copies of
    it, 8 leaves each, that are reductions (which inductor does not inline into their readers).
    Leaves that require grad take `torch.where` (plain CPU leaves take `famp::select_`, see
    tests/scaling/test_choice.py).
    """
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    select = torch.compile(famp.select_tree, fullgraph=True, backend=backend)
    gen = torch.Generator().manual_seed(5)
    new = [torch.randn(i % 3 + 1, 5, generator=gen, requires_grad=True) for i in range(40)]
    old = [torch.randn(i % 3 + 1, 5, generator=gen) for i in range(40)]
    out = select(torch.tensor(True), new, old)
    for got, a in zip(out, new, strict=True):
        assert_bitwise_equal(got, a)
    (graph,) = graphs
    wheres = [n for n in graph.graph.nodes if n.target in (torch.where, torch.ops.aten.where.self)]
    assert len(wheres) == 40
    readers = collections.Counter(n.args[0] for n in wheres)
    assert len(readers) == 5
    assert max(readers.values()) == 8
    first, *copies = readers  # in the order the leaves read them
    assert first.target != "all", first.format_node()  # the predicate itself
    for copy in copies:  # each copy is `all` over an expansion: a reduction
        assert copy.op == "call_method", copy.format_node()
        assert copy.target == "all", copy.format_node()


@pytest.mark.parametrize(
    ("other", "error", "message"),
    [
        ({"w": torch.ones(2, dtype=torch.float64)}, TypeError, r"tree\['w'\] differ in dtype"),
        ({"w": torch.ones(3)}, ValueError, r"tree\['w'\] differ in shape"),
        ({"w": 1.0}, TypeError, r"tree\['w'\] must be a Tensor or None, got float"),
        ({"v": torch.ones(2)}, ValueError, "key"),
    ],
)
def test_select_tree_compiled_names_the_bad_leaf(
    other: dict[str, Any], error: type, message: str
) -> None:
    def select(pred: torch.Tensor, a: Any, b: Any) -> Any:
        return famp.select_tree(pred, a, b)

    torch._dynamo.reset()
    compiled = torch.compile(select, fullgraph=True, backend="eager")  # errors raise while tracing
    with pytest.raises(Exception) as info:  # noqa: PT011 - Dynamo wraps the error; its cause is famp's
        compiled(torch.tensor(True), {"w": torch.ones(2)}, other)
    chain, seen = "", info.value  # Dynamo reports it as an "observed" error: famp's is inside
    while seen is not None:
        chain += f"{type(seen).__name__}: {seen}\n"
        seen = seen.__cause__
    assert re.search(message, chain)
    assert error.__name__ in chain


# --- optimizer_step: the bridge to fused torch.optim optimizers ---------------------------------


FUSED = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9, nesterov=True, fused=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=LR, fused=True),
}


def assert_optimizers_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].keys() == sb[k].keys()
        for name in sa[k]:
            assert_bitwise_equal(sa[k][name], sb[k][name])


@pytest.mark.parametrize("name", sorted(FUSED))
@settings(max_examples=5)
@given(config=scaler_configs, pattern=st.lists(st.booleans(), min_size=1, max_size=8))
def test_optimizer_step_equals_gradscaler_with_fused_optimizer(
    name: str, config: dict[str, Any], pattern: list[bool]
) -> None:
    if name == "sgd_momentum":  # torch's fused SGD reads uninitialized buffers after a skipped
        pattern[0] = False  # first step (see test_optimizer_step_fused_sgd_skipped_first_step)
    model, famp_model = make_model(), make_model()
    opt, famp_opt = FUSED[name](model.parameters()), FUSED[name](famp_model.parameters())
    scaler = torch.amp.GradScaler("cpu", **config)
    state = famp.init_scaler(**config)
    for i, bad in enumerate(pattern):
        x, y = make_batch(i, bad)
        opt.zero_grad()
        scaler.scale(torch_loss(model, x, y)).backward()
        scaler.step(opt)
        expected_found_inf = sum(scaler._found_inf_per_device(opt).values())
        scaler.update()

        famp_opt.zero_grad()
        famp.scale(state, torch_loss(famp_model, x, y)).backward()
        found_inf = famp.optimizer_step(famp_opt, state)
        state = famp.update_scale(state, found_inf)

        assert_bitwise_equal(found_inf, expected_found_inf)
        assert found_inf.item() == float(bad)
        assert_bitwise_equal(state.scale, scaler._scale)
        assert_bitwise_equal(state.growth_tracker, scaler._growth_tracker)
        for p, q in zip(model.parameters(), famp_model.parameters(), strict=True):
            assert_bitwise_equal(q.detach(), p.detach())
            assert_bitwise_equal(q.grad, p.grad)  # the kernel wrote the unscaled grads back
        assert_optimizers_equal(famp_opt, opt)
    assert not hasattr(famp_opt, "grad_scale")
    assert not hasattr(famp_opt, "found_inf")


def test_optimizer_step_fused_sgd_skipped_first_step_is_as_if_it_never_happened() -> None:
    """Fused SGD keeps ``empty_like`` buffers after a skipped first step: famp zeroes them."""
    pattern = [True, False, False, True, False]
    model, expected_model = make_model(), make_model()
    make = FUSED["sgd_momentum"]
    opt, expected_opt = make(model.parameters()), make(expected_model.parameters())
    state = famp.init_scaler(2.0**10, growth_interval=1000)
    for i, bad in enumerate(pattern):
        x, y = make_batch(i, bad)
        opt.zero_grad()
        famp.scale(state, torch_loss(model, x, y)).backward()
        # fill the allocator's free list with NaN so that an uninitialized buffer would show
        del_me = torch.full((16 * 8 + 16 + 4 * 16 + 4,), math.nan)
        del del_me
        found_inf = famp.optimizer_step(opt, state)
        state = famp.update_scale(state, found_inf)
        if i == 0:
            for p in model.parameters():
                assert_bitwise_equal(opt.state[p]["momentum_buffer"], torch.zeros_like(p))
        if not bad:  # the reference run sees only the applied steps, from a fresh first step
            expected_opt.zero_grad()
            torch_loss(expected_model, x, y).backward()
            expected_opt.step()
    for p, q in zip(model.parameters(), expected_model.parameters(), strict=True):
        assert_bitwise_equal(p.detach(), q.detach())
    assert_optimizers_equal(opt, expected_opt)


def test_optimizer_step_with_unscaled_grads_from_value_and_grad() -> None:
    """value_and_grad's grads in ``.grad``, and its found_inf: GradScaler's numbers (2**k scale)."""
    model, famp_model = make_model(), make_model()
    opt, famp_opt = FUSED["adamw"](model.parameters()), FUSED["adamw"](famp_model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=2)
    state = famp.init_scaler(2.0**20, growth_interval=2)
    step = famp.value_and_grad(loss_fn)
    for i, bad in enumerate([False, True, False, False, True, False]):
        x, y = make_batch(i, bad)
        opt.zero_grad()
        scaler.scale(torch_loss(model, x, y)).backward()
        scaler.step(opt)
        scaler.update()

        params = dict(famp_model.named_parameters())
        _, grads, found_inf, state = step(state, params, x, y)
        for k, p in params.items():
            p.grad = grads[k]
        assert_bitwise_equal(famp.optimizer_step(famp_opt, found_inf=found_inf), found_inf)
        assert_bitwise_equal(state.scale, scaler._scale)
        for p, q in zip(model.parameters(), famp_model.parameters(), strict=True):
            assert_bitwise_equal(q.detach(), p.detach())
        assert_optimizers_equal(famp_opt, opt)


def test_optimizer_step_never_triggers_the_scheduler_warning() -> None:
    """A skipped first step makes lr_scheduler warn under GradScaler (#44511); famp always steps."""
    x, y = make_batch(0, True)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters())  # GradScaler skips by not calling step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch_loss(model, x, y)).backward()
    scaler.step(opt)
    scaler.update()
    with pytest.warns(UserWarning, match="before `optimizer.step\\(\\)`"):
        sched.step()

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    state = famp.init_scaler()
    famp.scale(state, torch_loss(model, x, y)).backward()
    assert famp.optimizer_step(opt, state).item() == 1.0
    sched.step()  # filterwarnings=error: a warning would fail here
    assert opt.state_dict()["state"][0]["step"].item() == 0.0


def test_optimizer_step_disabled_state_steps_plainly() -> None:
    model, expected = make_model(), make_model()
    opt, expected_opt = FUSED["adam"](model.parameters()), FUSED["adam"](expected.parameters())
    x, y = make_batch(0, False)
    state = famp.init_scaler(enabled=False)
    famp.scale(state, torch_loss(model, x, y)).backward()
    torch_loss(expected, x, y).backward()
    assert famp.optimizer_step(opt, state).item() == 0.0
    expected_opt.step()
    for p, q in zip(model.parameters(), expected.parameters(), strict=True):
        assert_bitwise_equal(p.detach(), q.detach())


def test_optimizer_step_restores_attributes_when_step_raises() -> None:
    class Failing(torch.optim.SGD):
        def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
            assert self.found_inf is not None
            raise RuntimeError("boom")

    w = torch.nn.Parameter(torch.ones(2))
    opt = Failing([w], lr=0.1, fused=True)
    mine = torch.tensor(4.0)
    opt.grad_scale = mine  # type: ignore[attr-defined]
    w.grad = torch.ones(2)
    with pytest.raises(RuntimeError, match="boom"):
        famp.optimizer_step(opt, famp.init_scaler())
    assert opt.grad_scale is mine  # type: ignore[attr-defined]
    assert not hasattr(opt, "found_inf")


def test_optimizer_step_bad_input() -> None:
    w = torch.nn.Parameter(torch.ones(2))
    w.grad = torch.ones(2)
    fused = torch.optim.SGD([w], lr=0.1, fused=True)
    with pytest.raises(
        ValueError, match="needs state \\(scaled grads\\) or found_inf, got neither"
    ):
        famp.optimizer_step(fused)
    with pytest.raises(TypeError, match=r"state must be a famp\.ScalerState or None, got float"):
        famp.optimizer_step(fused, 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"found_inf must be a float32 tensor, got torch\.bool"):
        famp.optimizer_step(fused, found_inf=torch.tensor(True))
    with pytest.raises(ValueError, match=r"exactly one element, got shape \(2,\)"):
        famp.optimizer_step(fused, found_inf=torch.zeros(2))
    with pytest.raises(TypeError, match="found_inf must be a float32 tensor, got float"):
        famp.optimizer_step(fused, found_inf=1.0)  # type: ignore[arg-type]
    assert_bitwise_equal(w.detach(), torch.ones(2))  # nothing was applied


# --- a whole step under torch.compile(fullgraph=True) -------------------------------------------


POLICY = famp.get_policy("params=float32,compute=bfloat16,output=float32")
FORWARD = famp.autocast(lambda params, x: functional_call(MODEL, params, (x,)), POLICY)


def famp_loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = FORWARD(params, x)
    assert logits.dtype == torch.float32  # the policy's output dtype
    return functional.cross_entropy(logits, y)


def make_whole_step(loss: Callable[..., torch.Tensor]) -> Callable[..., tuple[Any, ...]]:
    """A whole functional AMP step (value_and_grad, Adam, skip_on_overflow) around `loss`."""

    def whole_step(
        params: dict[str, torch.Tensor],
        opt_state: dict[str, Any],
        state: famp.ScalerState,
        x: torch.Tensor,
        y: torch.Tensor,
    ) -> tuple[Any, ...]:
        loss_value, grads, found_inf, state = famp.value_and_grad(loss)(state, params, x, y)
        new = adam_update(params, grads, opt_state, schedule(opt_state["count"]))
        params, opt_state = famp.skip_on_overflow(found_inf, new, (params, opt_state))
        return params, opt_state, state, loss_value, found_inf

    return whole_step


whole_step = make_whole_step(famp_loss_fn)
whole_step_torch_autocast = make_whole_step(loss_fn)


@pytest.mark.slow
def test_whole_step_compiles_fullgraph_and_equals_eager_bitwise() -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    compiled_step = torch.compile(whole_step, fullgraph=True, backend=counter)
    params = clone_params(MODEL)
    opt_state = {
        "count": torch.zeros((), dtype=torch.int64),
        "mu": optree.tree_map(torch.zeros_like, params),
        "nu": optree.tree_map(torch.zeros_like, params),
    }
    eager = compiled = (params, opt_state, famp.init_scaler(2.0**16, growth_interval=2))
    for i, bad in enumerate([False, True, False, False, False]):
        x, y = make_batch(i, bad)
        eager_out = whole_step(*eager, x, y)
        compiled_out = compiled_step(*compiled, x, y)
        eager, compiled = eager_out[:3], compiled_out[:3]
        leaves, spec = optree.tree_flatten(eager_out)
        compiled_leaves, compiled_spec = optree.tree_flatten(compiled_out)
        assert spec == compiled_spec
        for a, b in zip(leaves, compiled_leaves, strict=True):
            assert_bitwise_equal(b, a)
        assert eager_out[4].item() == float(bad)
        assert eager_out[3].dtype == torch.float32
    assert eager[2].scale.item() == 2.0**16  # backed off once, grown once
    # famp.autocast gives torch.autocast's numbers: the same step with torch.autocast
    expected = whole_step_torch_autocast(
        params, opt_state, famp.init_scaler(2.0**16), *make_batch(0, False)
    )
    actual = whole_step(params, opt_state, famp.init_scaler(2.0**16), *make_batch(0, False))
    pairs = zip(
        optree.tree_leaves(actual),
        optree.tree_leaves(expected),
        strict=True,
    )
    for a, b in pairs:
        assert_bitwise_equal(a, b)
    assert counter.frame_count == 1  # one graph, no recompilation as the scale changes


# --- long runs: guards keep the scale finite and positive; without them, torch's numbers --------


LONG_STEPS = 10_000
LONG_BATCH = 16  # trajectories per example, run side by side under vmap
LONG_EXAMPLES = max(1, settings.default.max_examples // 60)


def overflow_patterns(seed: int, batch: int, steps: int, max_burst: int) -> torch.Tensor:
    """``(steps, batch)`` found_inf values: finite runs and overflow bursts of random lengths."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.zeros(steps, batch)
    values = torch.tensor([1.0, 2.0, math.nan, -1.0, math.inf])
    for b in range(batch):
        t, p_burst = 0, torch.rand((), generator=gen).item()
        while t < steps:
            run = int(torch.randint(1, 400, (), generator=gen))
            if torch.rand((), generator=gen).item() < p_burst:
                run = int(torch.randint(1, max_burst + 1, (), generator=gen))
                pick = torch.randint(0, len(values), (run,), generator=gen)
                out[t : t + run, b] = values[pick][: steps - t]
            t += run
    return out


def batched(state: famp.ScalerState, batch: int) -> famp.ScalerState:
    leaves, spec = optree.tree_flatten(state)
    return optree.tree_unflatten(spec, [x.expand(batch).clone() for x in leaves])  # type: ignore[no-any-return]


long_configs = st.fixed_dictionaries(
    {
        "init_scale": st.integers(-20, 127).map(lambda e: 2.0**e),
        "growth_factor": st.one_of(st.just(2.0), st.floats(1.01, 16.0)),
        "backoff_factor": st.one_of(st.just(0.5), st.floats(0.01, 0.99)),
        "growth_interval": st.integers(1, 50),
    }
)


@pytest.mark.slow
@settings(max_examples=LONG_EXAMPLES)
@given(config=long_configs, seed=st.integers(0, 2**31))
def test_long_run_without_guards_equals_torch_kernel(config: dict[str, Any], seed: int) -> None:
    found = overflow_patterns(seed, LONG_BATCH, LONG_STEPS, max_burst=300)
    update = torch.func.vmap(famp.update_scale)
    state = batched(famp.init_scaler(**config), LONG_BATCH)
    scales, trackers = [], []
    for row in found:
        state = update(state, row)
        scales.append(state.scale)
        trackers.append(state.growth_tracker)
    for b in range(LONG_BATCH):
        scale = torch.tensor(config["init_scale"])
        tracker = torch.zeros((), dtype=torch.int32)
        expected_scales, expected_trackers = [], []
        for value in found[:, b]:
            torch._amp_update_scale_(
                scale,
                tracker,
                value,
                config["growth_factor"],
                config["backoff_factor"],
                config["growth_interval"],
            )
            expected_scales.append(scale.clone())
            expected_trackers.append(tracker.clone())
        assert_bitwise_equal(torch.stack(scales)[:, b], torch.stack(expected_scales))
        assert_bitwise_equal(torch.stack(trackers)[:, b], torch.stack(expected_trackers))


@pytest.mark.slow
@settings(max_examples=LONG_EXAMPLES)
@given(
    config=long_configs,
    seed=st.integers(0, 2**31),
    min_exp=st.integers(-30, 0),
    max_exp=st.integers(1, 127),
    hysteresis=st.integers(1, 4),
)
def test_long_run_with_guards_keeps_the_scale_finite_and_positive(
    config: dict[str, Any], seed: int, min_exp: int, max_exp: int, hysteresis: int
) -> None:
    min_scale, max_scale = 2.0**min_exp, 2.0**max_exp
    config["init_scale"] = min(max(config["init_scale"], min_scale), max_scale)
    state = famp.init_scaler(
        **config, min_scale=min_scale, max_scale=max_scale, hysteresis=hysteresis
    )
    found = overflow_patterns(seed, LONG_BATCH, LONG_STEPS, max_burst=1000)
    update = torch.func.vmap(famp.update_scale)
    state = batched(state, LONG_BATCH)
    low, high = torch.full((LONG_BATCH,), math.inf), torch.zeros(LONG_BATCH)
    for row in found:
        state = update(state, row)
        low, high = torch.minimum(low, state.scale), torch.maximum(high, state.scale)
    assert state.scale.dtype == torch.float32
    assert bool(torch.isfinite(high).all())
    assert bool((low >= min_scale).all()), low
    assert bool((high <= max_scale).all()), high
    assert bool((low > 0).all())


def test_failure_mode_scale_underflows_to_zero_and_nan_params_go_unnoticed() -> None:
    """torch's footgun without guards: 150 backoffs reach 0.0, then NaN grads slip through."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    opt0 = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))])
    state = famp.init_scaler(1.0)
    scaler.scale(torch.ones(()))  # creates _scale and _growth_tracker
    for _ in range(150):
        scaler._found_inf_per_device(opt0)[torch.device("cpu")] = torch.tensor(1.0)
        scaler.update()
        state = famp.update_scale(state, torch.tensor(1.0))
    assert scaler._scale.item() == 0.0
    assert_bitwise_equal(state.scale, scaler._scale)

    model, params = make_model(), clone_params(MODEL)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = make_batch(0, False)
    scaler.scale(torch_loss(model, x, y)).backward()
    scaler.step(opt)  # no inf in the scaled (zero) grads: the NaN update is applied
    _, grads, found_inf, _ = famp.value_and_grad(loss_fn)(state, params, x, y)
    assert found_inf.item() == 0.0
    assert all(bool(g.isnan().all()) for g in grads.values())
    assert all(bool(p.isnan().all()) for p in model.parameters())

    guarded = famp.init_scaler(1.0, min_scale=2.0**-10)
    for _ in range(150):
        guarded = famp.update_scale(guarded, torch.tensor(1.0))
    assert guarded.scale.item() == 2.0**-10
    _, grads, found_inf, _ = famp.value_and_grad(loss_fn)(guarded, params, x, y)
    assert found_inf.item() == 0.0
    assert bool(famp.all_finite(grads))


@pytest.mark.parametrize("found_inf", [0.0, 1.0])
@pytest.mark.parametrize(
    ("new_leaf", "old_leaf", "what"),
    [
        (torch.ones(2, device="meta"), torch.zeros(2), r"meta \(torch.strided\) and cpu"),
        (torch.eye(2).to_sparse(), torch.zeros(2, 2), r"cpu \(torch.sparse_coo\) and cpu"),
    ],
)
def test_eager_choice_refuses_paired_leaves_on_different_devices_or_layouts(
    found_inf: float, new_leaf: torch.Tensor, old_leaf: torch.Tensor, what: str
) -> None:
    """torch.where refuses such a pair; before 2026-12-01 eager famp took it, and the result's
    device (meta or cpu) or layout followed found_inf's value."""
    keep = torch.tensor(found_inf == 0)
    with pytest.raises((RuntimeError, NotImplementedError)):
        torch.where(keep, new_leaf, old_leaf)
    new, old = {"a": torch.ones(1), "w": new_leaf}, {"a": torch.zeros(1), "w": old_leaf}
    match = rf"\['w'\] differ in device or layout: {what}"
    with pytest.raises(ValueError, match=rf"skip_on_overflow: .*{match}"):
        famp.skip_on_overflow(torch.tensor(found_inf), new, old)
    with pytest.raises(ValueError, match=rf"select_tree: .*{match}"):
        famp.select_tree(keep, new, old)


def test_eager_choice_leaves_the_predicates_device_out_of_the_pairing() -> None:
    """A 0-d CPU predicate with leaves on another device (meta here) is what torch.where takes."""
    new, old = {"w": torch.ones(2, device="meta")}, {"w": torch.zeros(2, device="meta")}
    for pred in (torch.tensor(True), torch.tensor(False)):
        want = torch.where(pred, new["w"], old["w"])
        got = famp.select_tree(pred, new, old)["w"]
        assert (got.device, got.shape, got.dtype) == (want.device, want.shape, want.dtype)
