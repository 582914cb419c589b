"""Gradients that carry a graph, unscaled: the kernel's values, the recipe's backward.

Under `create_graph=True` or an outer `torch.func.grad`, `famp.unscale_and_check` unscales
through `_Unscale`: its forward is the kernel's (`kernels.out_of_place`, or its arithmetic as
plain ops under `torch.func` transforms), its backward that of torch's gradient-penalty recipe.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor
from torch.autograd import forward_ad

from famp._compat import forward_ad_active
from famp._compat import functorch_transforms_active as are_functorch_transforms_active
from famp._scaling.kernels import out_of_place
from famp._scaling.program import where_program


class _Unscale(torch.autograd.Function):
    """The kernel's results, differentiable: the backward of torch's gradient-penalty recipe.

    torch's recipe unscales with `g * (1.0 / scaler.get_scale())`, a Python float; the backward
    of that multiply is `grad * (1.0 / scale)` with the same scalar arithmetic, which a 0-d
    float64 reciprocal reproduces (float32 and narrower grads compute with `f32(1/f64(scale))`,
    float64 ones with `1/f64(scale)`). Forward mode (`jvp`, `jacfwd`, `hessian` over a function
    of the unscaled grads) gets the recipe's tangents the same way: `tangent * (1.0 / scale)`.
    The forward is the kernel's (`out_of_place`), whose results differ from the recipe's multiply
    only at a scale of 1 (NaN payloads) and, for float64 grads, at scales that are not powers
    of two.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(found: Tensor, inv64: Tensor, *tensors: Tensor) -> tuple[Tensor, ...]:
        inv = inv64.float()
        if are_functorch_transforms_active():
            new, found = where_program(list(tensors), found, inv)
        else:
            new, found = out_of_place(list(tensors), found, inv)
        return (*new, found)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        ctx.save_for_backward(inputs[1])
        ctx.mark_non_differentiable(output[-1])

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        (inv64,) = ctx.saved_tensors
        return (None, None, *(None if g is None else g * inv64 for g in grads[:-1]))


class _UnscaleForwardMode(_Unscale):
    """`_Unscale` with the recipe's tangents. Eager only: Dynamo refuses an autograd Function
    with a custom `jvp` ("Unsupported custom jvp"), so compiled gradient penalties take
    `_Unscale`, whose forward mode is then unsupported as under any Function without `jvp`."""

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        _Unscale.setup_context(ctx, inputs, output)
        ctx.save_for_forward(inputs[1])

    @staticmethod
    def jvp(ctx: Any, _found: Tensor | None, _inv: Tensor | None, *tangents: Tensor | None) -> Any:
        (inv64,) = ctx.saved_tensors
        return (*(None if t is None else t * inv64 for t in tangents), None)


def differentiable_unscale(
    tensors: list[Tensor], found: Tensor, inv64: Tensor
) -> tuple[list[Tensor], Tensor]:
    """The kernel's results through `_Unscale`, for grads that carry a graph."""
    function = _Unscale if torch.compiler.is_compiling() else _UnscaleForwardMode
    *new, found = cast(tuple[Tensor, ...], function.apply(found, inv64, *tensors))  # type: ignore[no-untyped-call]
    return new, found


def carry_tangents(tensors: list[Tensor]) -> bool:
    """Whether a dual level is open and a tensor carries a tangent (forward mode's dual tensors,
    which need not require grad): the kernel would leave the tangent scaled, where the recipe's
    multiply unscales it, so they go through `_Unscale` as grads that carry a graph do."""
    return forward_ad_active() and any(
        forward_ad.unpack_dual(t).tangent is not None  # type: ignore[no-untyped-call]
        for t in tensors
    )
