"""Advancing the loss scale after a step: `famp.update_scale`.

The dynamics are `torch.amp.GradScaler`'s, bit for bit: an update backs off on any non-zero
`found_inf` and grows only when the tracker *equals* the interval, computing
`f32(f64(scale) * factor)` and never growing to a non-finite scale. Without guards it is torch's
own functional kernel, one call; with guards, or under `torch.func` transforms (the kernel has
no batching rule), the same arithmetic as a branch-free `torch.where` program.

Deliberately not supported: `GradScaler.update(new_scale=...)` (build a new state instead).
"""

from __future__ import annotations

import torch

from famp._compat import amp_update_scale, amp_update_scale_, functorch_transforms_active
from famp._scaling.checks import float32_value
from famp._scaling.state import ScalerState, rebuilt, with_leaves
from famp._scaling.trees import to_device
from famp._typing import Tensor


def update_scale(state: ScalerState, found_inf: Tensor, *, donate: bool = False) -> ScalerState:
    """Return the next state after a step, bit-exact with `torch._amp_update_scale_`.

    Any non-zero `found_inf` (NaN, negative and 2.0 included) is an overflow: the scale becomes
    `f32(f64(scale) * backoff_factor)` and the tracker 0. Otherwise the tracker counts up, and
    when it *equals* `growth_interval` the scale becomes `f32(f64(scale) * growth_factor)` if
    that is finite (else it stays) and the tracker 0. The tracker is int32 and wraps like torch's.
    Branch-free and without host sync. Opt-in guards change this: `min_scale` floors backoffs,
    `max_scale` caps growths, and with `hysteresis=N` the first `N - 1` consecutive
    overflows leave the scale unchanged (the tracker still resets). A static or disabled state is
    returned unchanged.

    Args:
        state: The current `famp.ScalerState`.
        found_inf: A one-element tensor (the `found_inf` of `famp.unscale_and_check`, or a sum
            or max of several); non-zero means overflow. One that requires grad is read
            detached: the new state never carries its graph.
        donate: `True` consumes `state`: eagerly and without guards, torch's kernel updates its
            scale and tracker in place, as `GradScaler.update` does, and the returned state
            holds those same tensors (no copies: the speed of `GradScaler.update`). Do not use
            `state` afterwards; donate after the backward of a loss it scaled (before it,
            autograd raises: the graph holds the scale). Elsewhere (guards, `torch.func`
            transforms, compiled) `state` may be left as it was; either way the returned state
            has the same values as without donation.

    Returns:
        The next `famp.ScalerState`, with the same hyperparameters, shapes, dtypes and device:
            a new one, or with `donate=True` eagerly and without guards `state` itself, its tensors
            updated.

    Raises:
        TypeError: `state` is not a `famp.ScalerState`, `found_inf` is not a tensor, or
            `donate` is not a bool.
        ValueError: `found_inf` does not have exactly one element, or is on the meta device
            (no values) while the state's scale is not; or, with `donate=True`, a state tensor
            requires grad or is an inference tensor (torch cannot update it in place).

    Examples:
        >>> import famp, torch
        >>> state = famp.init_scaler(8.0, growth_interval=1)
        >>> famp.update_scale(state, torch.tensor(0.0)).scale
        tensor(16.)
        >>> famp.update_scale(state, torch.tensor(float("nan"))).scale
        tensor(4.)
        >>> state = famp.update_scale(state, torch.tensor(0.0), donate=True)  # in place
        >>> state.scale
        tensor(16.)
    """
    if not isinstance(state, ScalerState):
        raise TypeError(f"state must be a famp.ScalerState, got {type(state).__name__}")
    if not isinstance(found_inf, torch.Tensor):
        raise TypeError(f"found_inf must be a Tensor, got {type(found_inf).__name__} {found_inf!r}")
    if donate is not False and donate is not True:
        raise TypeError(f"famp.update_scale: donate must be a bool, got {donate!r}")
    if found_inf.numel() != 1:
        raise ValueError(
            f"found_inf must have exactly one element, got shape {tuple(found_inf.shape)}"
        )
    if not (state.enabled and state.dynamic):
        return state
    if found_inf.requires_grad:  # a decision, not a value: the scale must not carry its graph
        found_inf = found_inf.detach()
    scale = state.scale
    if not (found_inf.is_cpu and scale.is_cpu) and found_inf.device != scale.device:
        found_inf = _moved(found_inf, scale)  # device objects only off the CPU: 0.2 µs each
    if (
        state.overflow_count is not None
        or state.min_scale is not None
        or state.max_scale is not None
        or functorch_transforms_active()
    ):
        return _update_where(state, found_inf)
    # No guard: torch's own kernel, one call. It has no vmap batching rule, hence the torch.where
    # formulation under torch.func transforms.
    if found_inf.dtype is not torch.float32:
        found_inf = (found_inf != 0).to(torch.float32)  # any non-zero, exactly as the kernel reads
    if torch.compiler.is_compiling():
        new_scale, new_tracker = amp_update_scale.default(
            scale,
            state.growth_tracker,
            found_inf,
            state.growth_factor,
            state.backoff_factor,
            state.growth_interval,
        )
        return with_leaves(state, scale=new_scale, growth_tracker=new_tracker)
    # Eagerly, what the functional operator does (copies, then the in-place kernel) without its
    # operator-call overhead: 3.6 µs against the operator's 4.4 (an Intel Xeon, quiet). Donated,
    # GradScaler.update's own call: the kernel on the state's tensors, no copies.
    if donate:
        _check_donatable(state)
        new_scale, new_tracker = scale, state.growth_tracker
    else:
        new_scale, new_tracker = scale.clone(), state.growth_tracker.clone()
    amp_update_scale_(
        new_scale,
        new_tracker,
        found_inf,
        state.growth_factor,
        state.backoff_factor,
        state.growth_interval,
    )
    if donate:
        return state
    # The new state is built from a copy of the old one's fields: no keyword dict, no second check.
    fields = state.__dict__.copy()
    fields["scale"], fields["growth_tracker"] = new_scale, new_tracker
    return rebuilt(fields)


def _check_donatable(state: ScalerState) -> None:
    """Refuses, before anything is written, the state tensors that torch cannot update in place."""
    for name in ("scale", "growth_tracker"):
        leaf: Tensor = getattr(state, name)
        why = (
            "requires grad"
            if leaf.requires_grad
            else "is an inference tensor (made under torch.inference_mode)"
            if leaf.is_inference()
            else None
        )
        if why is not None:
            raise ValueError(
                f"famp.update_scale: with donate=True, state.{name} ({leaf!r}) {why}, so it "
                f"cannot be updated in place; pass donate=False"
            )


def _moved(found_inf: Tensor, scale: Tensor) -> Tensor:
    """`found_inf` on the scale's device; a meta `found_inf` has no value to move there."""
    if found_inf.is_meta:
        raise ValueError(
            f"found_inf is on the meta device (shapes only, no values) but the state's scale is "
            f"on {scale.device}: pass the found_inf of a step on {scale.device}"
        )
    return to_device(found_inf, scale.device, "found_inf")


def _guard(scale: Tensor, value: float) -> Tensor:
    """A guard's float32 value (`float32_value`) as a 0-d tensor beside `scale`.

    Compiled, Dynamo may make the guard a symbolic float or int (`dynamic=True`, or a second
    state with another value), which no Python function can round: a float64 tensor of a float
    or an int64 tensor of an int, cast to float32, rounds it as `float32_value` does (an int
    straight, not through a double). Ints beyond int64 (constants to Dynamo) keep the latter.
    """
    if not torch.compiler.is_compiling() or (isinstance(value, int) and abs(value) >= 2**63):
        return scale.new_tensor(float32_value(value))
    dtype = torch.int64 if isinstance(value, int) else torch.float64
    return torch.full((), value, dtype=dtype, device=scale.device).float()


def _update_where(state: ScalerState, found_inf: Tensor) -> ScalerState:
    """`update_scale` as a branch-free `torch.where` program: guards, and vmap-able.

    Equal to the kernel bit for bit when no guard is set (tested): `f32(f64(scale) * factor)`,
    `==` growth, the finite cap, int32 wrap, any non-zero (NaN too) is an overflow.
    """
    scale_, tracker = state.scale, state.growth_tracker
    overflow = (found_inf != 0).reshape(scale_.shape)
    wide = scale_.double()
    backed = (wide * state.backoff_factor).float()
    if state.min_scale is not None:
        floor = torch.minimum(scale_, _guard(scale_, state.min_scale))
        backed = torch.maximum(backed, floor)
    grown = (wide * state.growth_factor).float()
    if state.max_scale is not None:
        cap = _guard(scale_, state.max_scale)
        grown = torch.minimum(grown, torch.maximum(scale_, cap))
    grown = torch.where(torch.isfinite(grown), grown, scale_)
    counted = tracker + 1
    grow = counted == state.growth_interval
    overflow_count = state.overflow_count
    back_off = overflow
    if overflow_count is not None:
        overflow_count = torch.where(
            overflow, torch.clamp(overflow_count + 1, max=state.hysteresis), 0
        ).to(torch.int32)
        back_off = overflow & (overflow_count >= state.hysteresis)
    new_scale = torch.where(back_off, backed, torch.where(overflow | ~grow, scale_, grown))
    new_tracker = torch.where(overflow | grow, torch.zeros_like(tracker), counted)
    return with_leaves(
        state, scale=new_scale, growth_tracker=new_tracker, overflow_count=overflow_count
    )
