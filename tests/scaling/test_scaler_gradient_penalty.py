"""Differentiable unscale: torch's gradient-penalty recipe, bit for bit.

The oracle is the recipe of torch's "Automatic Mixed Precision examples" (Gradient penalty):
``scaled_grads = torch.autograd.grad(scaler.scale(loss), params, create_graph=True)``,
``grads = [g * (1.0 / scaler.get_scale()) for g in scaled_grads]``, a penalty on their norm, then
``scaler.scale(loss + penalty).backward()`` and ``scaler.unscale_(optimizer)``.
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import example, given

import famp
from tests.helpers import assert_bitwise_equal
from tests.scaling.test_scaler import torch_unscale
from tests.scaling.test_scaler_unscale import random_bits

X = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
Y = torch.randn(16, 1, generator=torch.Generator().manual_seed(2))


def make_model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return model.to(dtype)


def mse(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, Y.to(dtype))


def norm(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt()


def torch_recipe(
    dtype: torch.dtype, scale_value: float
) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """torch's recipe: (the unscaled first grads, the penalty, the final unscaled grads)."""
    model = make_model(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale_value)
    loss = mse(model(X.to(dtype)), dtype)
    scaled_grads = torch.autograd.grad(scaler.scale(loss), model.parameters(), create_graph=True)
    inv_scale = 1.0 / scaler.get_scale()
    grads = [g * inv_scale for g in scaled_grads]
    penalty = norm(grads)
    scaler.scale(loss + penalty).backward()
    scaler._unscale_grads_(opt, scaler._scale.double().reciprocal().float(), torch.zeros(()), True)
    return grads, penalty, [p.grad for p in model.parameters()]  # type: ignore[misc]


# float64: the recipe multiplies by 1/scale in float64 and the kernel by float32(1/scale), which
# agree for powers of two (every scale GradScaler's default factors reach from 2**16).
CASES = [
    (torch.float32, 3.0),
    (torch.float32, 1024.0),
    (torch.float32, 1.0),
    (torch.bfloat16, 3.0),
    (torch.float16, 0.1),
    (torch.float64, 2.0**-3),
]


@pytest.mark.parametrize(("dtype", "scale_value"), CASES)
def test_gradient_penalty_with_create_graph_equals_torch_recipe(
    dtype: torch.dtype, scale_value: float
) -> None:
    expected_grads, expected_penalty, expected = torch_recipe(dtype, scale_value)
    model = make_model(dtype)
    params = list(model.parameters())
    state = famp.init_scaler(scale_value)
    loss = mse(model(X.to(dtype)), dtype)
    scaled_grads = torch.autograd.grad(famp.scale(state, loss), params, create_graph=True)
    grads, found_inf = famp.unscale_and_check(state, list(scaled_grads))
    # The values are the kernel's (GradScaler.unscale_'s), which here are the recipe's too.
    kernel, _ = torch_unscale(scale_value, [g.detach() for g in scaled_grads], allow_fp16=True)
    for g, k, e in zip(grads, kernel, expected_grads, strict=True):
        assert g.dtype == dtype
        assert g.requires_grad
        assert_bitwise_equal(g, k)
        assert_bitwise_equal(g, e)
    assert found_inf.item() == 0.0
    penalty = norm(grads)
    assert_bitwise_equal(penalty, expected_penalty)
    famp.scale(state, loss + penalty).backward()
    out, found_inf = famp.unscale_and_check(state, [p.grad for p in params], donate=True)
    for g, e in zip(out, expected, strict=True):
        assert_bitwise_equal(g, e)
    assert found_inf.item() == 0.0


@pytest.mark.parametrize(("dtype", "scale_value"), CASES[:4])
def test_gradient_penalty_with_nested_value_and_grad_equals_torch_recipe(
    dtype: torch.dtype, scale_value: float
) -> None:
    _, expected_penalty, expected = torch_recipe(dtype, scale_value)
    model = make_model(dtype)
    params = {k: v.detach() for k, v in model.named_parameters()}
    state = famp.init_scaler(scale_value)

    def loss_fn(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return mse(torch.func.functional_call(model, p, (X.to(dtype),)), dtype)

    inner = famp.value_and_grad(loss_fn)  # torch.func.grad inside torch.func.grad

    def with_penalty(p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        loss, grads, _, _ = inner(state, p)
        penalty = norm(list(grads.values()))
        return loss + penalty, penalty

    (_, penalty), grads, found_inf, _ = famp.value_and_grad(with_penalty, has_aux=True)(
        state, params
    )
    assert_bitwise_equal(penalty, expected_penalty)
    for g, e in zip(grads.values(), expected, strict=True):
        assert g.dtype == dtype
        assert_bitwise_equal(g, e)
    assert found_inf.item() == 0.0


def test_value_and_grad_under_create_graph_equals_torch_recipe() -> None:
    _, expected_penalty, expected = torch_recipe(torch.float32, 3.0)
    model = make_model(torch.float32)
    params = dict(model.named_parameters())
    state = famp.init_scaler(3.0)

    def loss_fn(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return mse(torch.func.functional_call(model, p, (X,)), torch.float32)

    loss, grads, _, _ = famp.value_and_grad(loss_fn)(state, params)
    penalty = norm(list(grads.values()))
    assert_bitwise_equal(penalty, expected_penalty)
    famp.scale(state, loss + penalty).backward()
    out, _ = famp.unscale_and_check(state, [p.grad for p in params.values()])
    for g, e in zip(out, expected, strict=True):
        assert_bitwise_equal(g, e)


@given(
    seed=st.integers(0, 2**32 - 1),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]),
    scale_value=st.sampled_from([3.0, 65536.0, 2.0**-20, 1.0, 0.1]),
)
@example(seed=159133, dtype=torch.float64, scale_value=1.0)  # a signalling NaN at index 7
def test_differentiable_unscale_values_are_the_kernels_and_its_backward_the_recipes(
    seed: int, dtype: torch.dtype, scale_value: float
) -> None:
    gen = torch.Generator().manual_seed(seed)
    scaled = random_bits((67,), dtype, gen).requires_grad_()
    state = famp.init_scaler(scale_value)
    (out,), found_inf = famp.unscale_and_check(state, [scaled])
    expected, expected_found = torch_unscale(scale_value, [scaled.detach()], allow_fp16=True)
    assert_bitwise_equal(out, expected[0])  # NaN payloads included
    assert_bitwise_equal(found_inf, expected_found)
    upstream = random_bits((67,), dtype, gen)
    (grad,) = torch.autograd.grad(out, scaled, upstream)
    # The recipe's backward: the incoming gradient times the Python float 1 / scale.
    recipe_scale = torch.tensor(scale_value, dtype=torch.float32).item()
    assert_bitwise_equal(grad, upstream * (1.0 / recipe_scale))
    if dtype == torch.float64 and math.log2(scale_value).is_integer():
        # The recipe's multiply, except at scale 1, where torch's kernel skips the multiply and
        # returns each value as it is: a signalling NaN stays signalling (the multiply quiets it).
        recipe = scaled.detach() if scale_value == 1.0 else scaled.detach() * (1.0 / recipe_scale)
        assert_bitwise_equal(out, recipe)


def _penalised_grads(state: famp.ScalerState, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """famp's gradient penalty: nested `value_and_grad`, so the inner grads carry a graph."""

    def loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return (w * x).tanh().sum()

    def with_penalty(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        _, g, _, _ = famp.value_and_grad(loss)(state, w, x)
        return loss(w, x) + g.pow(2).sum()

    return famp.value_and_grad(with_penalty)(state, w, x)[1]


def _recipe_grads(scale: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """torch's recipe, functionally: grads of the scaled loss times 1/scale, penalised."""

    def loss(w: torch.Tensor) -> torch.Tensor:
        return (w * x).tanh().sum()

    def with_penalty(w: torch.Tensor) -> torch.Tensor:
        g = torch.func.grad(lambda w: loss(w) * scale)(w) * (1.0 / scale.double()).float()
        return loss(w) + g.pow(2).sum()

    return torch.func.grad(lambda w: with_penalty(w) * scale)(w) * (1.0 / scale.double()).float()


# Dynamo, tracing an autograd Function under torch.func.grad, instantiates it (torch's warning).
@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_a_gradient_penalty_compiles_fullgraph_with_the_recipes_bits(dynamic: bool) -> None:
    # Before 2026-12-02 Dynamo refused famp's differentiable unscale ("Unsupported custom jvp"):
    # its autograd Function defined forward mode's tangents, which compiled calls now leave out.
    state = famp.init_scaler(3.0)
    w, x = torch.randn(4, generator=torch.Generator().manual_seed(3)), X[:4, 0].clone()
    ours = torch.compile(_penalised_grads, fullgraph=True, dynamic=dynamic)(state, w, x)
    recipe = torch.compile(_recipe_grads, fullgraph=True, dynamic=dynamic)(state.scale, w, x)
    assert_bitwise_equal(ours, recipe)
    assert_bitwise_equal(_penalised_grads(state, w, x), _recipe_grads(state.scale, w, x))
