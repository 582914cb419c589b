"""Forward mode over gradients that carry a graph: the tangents of torch's gradient-penalty recipe.

`famp.unscale_and_check` of gradients that require grad (`create_graph=True`, an outer
`torch.func.jacrev`) goes through an autograd Function; forward mode over it (`forward_ad`,
`torch.func.jvp`, `jacfwd`, `hessian` of a penalty) must give the tangents of the recipe's
`g * (1.0 / scale)`, as it gives its values and its backward. The oracle is that recipe written
by hand in the same composition.
"""

from __future__ import annotations

import optree
import pytest
import torch
from torch.autograd import forward_ad
from torch.func import grad, hessian, jacfwd, jacrev, jvp

import famp
from tests.helpers import assert_bitwise_equal
from tests.scaling.test_scaler_gradient_penalty import CASES

# torch's forward mode scripts its decompositions with `torch.jit.script` on first use, which warns.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is")

X = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))


def loss(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.tanh(X.to(dtype) @ w).square().mean()


def weights(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return torch.randn(4, 3, generator=g).to(dtype), torch.randn(4, 3, generator=g).to(dtype)


def recipe(w: torch.Tensor, dtype: torch.dtype, scale_value: float) -> torch.Tensor:
    """torch's recipe under torch.func: the scaled loss's gradient times `1.0 / scale`."""
    scaled = grad(lambda v: loss(v, dtype) * torch.tensor(scale_value))(w)
    return scaled * (1.0 / scale_value)


def famp_grads(w: torch.Tensor, dtype: torch.dtype, scale_value: float) -> torch.Tensor:
    state = famp.init_scaler(scale_value)
    _, grads, _, _ = famp.value_and_grad(lambda v: loss(v, dtype))(state, w)
    return grads


@pytest.mark.parametrize(("dtype", "scale_value"), CASES)
def test_forward_ad_over_create_graph_unscale_gives_the_recipes_tangents(
    dtype: torch.dtype, scale_value: float
) -> None:
    w, tangent = weights(dtype)
    state = famp.init_scaler(scale_value)
    results = []
    for use_famp in (True, False):
        with forward_ad.dual_level():
            dual = forward_ad.make_dual(w.clone().requires_grad_(), tangent)
            (scaled,) = torch.autograd.grad(
                famp.scale(state, loss(dual, dtype)), dual, create_graph=True
            )
            if use_famp:
                (unscaled,), found_inf = famp.unscale_and_check(state, [scaled])
                assert found_inf.item() == 0.0
            else:
                unscaled = scaled * (1.0 / scale_value)
            primal, tangent_out = forward_ad.unpack_dual(unscaled)
            results.append((primal.detach(), tangent_out))
    (actual, actual_tangent), (expected, expected_tangent) = results
    assert actual.dtype == actual_tangent.dtype == dtype
    assert_bitwise_equal(actual, expected)
    assert_bitwise_equal(actual_tangent, expected_tangent)


@pytest.mark.parametrize(("dtype", "scale_value"), CASES)
@pytest.mark.parametrize("transform", ["hessian", "jacfwd_of_jacrev", "jvp_of_grad"])
def test_forward_over_reverse_of_value_and_grad_gives_the_recipes_bits(
    transform: str, dtype: torch.dtype, scale_value: float
) -> None:
    w, tangent = weights(dtype)

    def penalty(fn):  # type: ignore[no-untyped-def]
        return lambda v: fn(v, dtype, scale_value).square().sum()

    def apply(fn):  # type: ignore[no-untyped-def]
        if transform == "hessian":
            return hessian(penalty(fn))(w)
        if transform == "jacfwd_of_jacrev":
            return jacfwd(jacrev(lambda v: fn(v, dtype, scale_value)))(w)
        return jvp(grad(penalty(fn)), (w,), (tangent,))

    actual, expected = apply(famp_grads), apply(recipe)
    leaves = zip(optree.tree_leaves(actual), optree.tree_leaves(expected), strict=True)
    for a, e in leaves:
        assert a.dtype == dtype
        assert_bitwise_equal(a, e)


# --- dual tensors that do not require grad ------------------------------------------------------


def _sin_loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (w * x).sin().sum()


@pytest.mark.parametrize("dual", ["x", "w", "both", "w in a dict"])
def test_value_and_grad_of_dual_arguments_carries_torch_func_grads_tangents(dual: str) -> None:
    # Eagerly famp differentiated dual arguments with plain autograd, which computes no tangent:
    # the gradients came back with none. torch.func.grad carries them; famp now uses it there.
    g = torch.Generator().manual_seed(5)
    w, x, dw, dx = (torch.randn(3, generator=g) for _ in range(4))
    state = famp.init_scaler(1024.0)
    with forward_ad.dual_level():
        wd = forward_ad.make_dual(w, dw) if dual != "x" else w
        xd = forward_ad.make_dual(x, dx) if dual != "w" and dual != "w in a dict" else x
        expected = grad(lambda w, x: _sin_loss(w, x) * state.scale)(wd, xd) * (1.0 / 1024.0)
        if dual == "w in a dict":
            _, grads, _, _ = famp.value_and_grad(lambda p, x: _sin_loss(p["w"], x))(
                state, {"w": wd}, xd
            )
            got = grads["w"]
        else:
            _, got, _, _ = famp.value_and_grad(_sin_loss)(state, wd, xd)
        primal, tangent = forward_ad.unpack_dual(got)
        want_primal, want_tangent = forward_ad.unpack_dual(expected)
    assert tangent is not None
    assert_bitwise_equal(primal, want_primal)
    assert_bitwise_equal(tangent, want_tangent)


def test_unscale_of_dual_gradients_unscales_their_tangents_as_the_recipe() -> None:
    # The kernel leaves a dual tensor's tangent as it was: out of place, famp gave the primal
    # unscaled and the tangent 1024 times too large. donate=True is GradScaler.unscale_'s kernel
    # in place, which keeps the tangent scaled (torch's own result, kept).
    g = torch.Generator().manual_seed(6)
    w, x, dx = (torch.randn(3, generator=g) for _ in range(3))
    state = famp.init_scaler(1024.0)
    with forward_ad.dual_level():
        scaled = grad(lambda w, x: _sin_loss(w, x) * state.scale)(w, forward_ad.make_dual(x, dx))
        (out,), found_inf = famp.unscale_and_check(state, [scaled])
        got, want = forward_ad.unpack_dual(out), forward_ad.unpack_dual(scaled * (1.0 / 1024.0))
        kernel = scaled.clone()
        torch._amp_foreach_non_finite_check_and_unscale_(
            [kernel], torch.zeros(()), state.scale.double().reciprocal().float()
        )
        (donated,), _ = famp.unscale_and_check(state, [scaled.clone()], donate=True)
        donated_tangent = forward_ad.unpack_dual(donated).tangent
        kernel_tangent = forward_ad.unpack_dual(kernel).tangent
    assert found_inf.item() == 0.0
    assert_bitwise_equal(got.primal, want.primal)
    assert_bitwise_equal(got.tangent, want.tangent)
    assert_bitwise_equal(donated_tangent, kernel_tangent)
