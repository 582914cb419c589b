"""Building scaler states from Python values: `famp.init_scaler` and `make_state`.

`make_state` is the one builder: `init_scaler` calls it with its arguments and
`famp.from_state_dict` with a dict's values. It checks everything before it builds anything
(nothing half-built): the statics (`checks.check_statics`), the scale and the guards around it in
float32, the tracker (any int32: torch's counter wraps), the overflow count, the device.
"""

from __future__ import annotations

import torch

from famp._scaling.checks import (
    INT32_MAX,
    INT32_MIN,
    check_device,
    check_int,
    check_scale,
    check_statics,
    float32_value,
    label,
)
from famp._scaling.state import ScalerState
from famp._typing import DeviceLike


def init_scaler(
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    *,
    enabled: bool = True,
    device: DeviceLike = None,
    dynamic: bool = True,
    min_scale: float | None = None,
    max_scale: float | None = None,
    hysteresis: int = 1,
) -> ScalerState:
    """Create a loss-scaling state, the functional `torch.amp.GradScaler(...)`.

    The arguments and defaults are `GradScaler`'s; with the guards off (the default) the dynamics
    equal `torch._amp_update_scale_` bit for bit. `dynamic=False` gives a static scale that
    `famp.update_scale` never changes. Unlike `GradScaler` the arguments are validated
    whether or not the state is enabled.

    Args:
        init_scale: Initial scale: a number whose float32 value and float32 reciprocal are
            finite and > 0 (about 2.9e-39 to 3.4e38), so that the unscale's factor is finite.
            A scale below 1 can still unscale a finite gradient past its dtype's range to inf,
            which `found_inf` does not flag (it checks the scaled gradients, as `GradScaler`
            does): `min_scale=1.0` keeps backoffs from going below 1.
        growth_factor: Multiplier on growth, finite and > 1.
        backoff_factor: Multiplier on overflow, in (0, 1).
        growth_interval: Consecutive finite steps before a growth, an int in [1, 2**31 - 1].
        enabled: `False` makes every famp function an identity, as a disabled `GradScaler`.
        device: Device of the tensor leaves (`None`: torch's default device).
        dynamic: `False` keeps the scale at `init_scale` forever.
        min_scale: Opt-in guard: backoffs never take the scale below it. `None` or a number
            valid as `init_scale`, and `init_scale` must not be below it (in float32).
        max_scale: Opt-in guard: growths never take the scale above it. `None` or a number
            valid as `init_scale`, >= `min_scale`, and not below `init_scale`.
        hysteresis: Opt-in guard: back off only from the `hysteresis`-th consecutive overflow
            on; adds the `overflow_count` leaf when > 1. An int in [1, 2**31 - 1].

    Returns:
        A new `famp.ScalerState`.

    Raises:
        TypeError: A number is not an int or float (`bool` is neither), `growth_interval`
            or `hysteresis` is not an int, `enabled` or `dynamic` is not a bool, or
            `device` is not a device, str or int; the message names it and its value.
        ValueError: A value is out of range (ints too large for a float, `10**400`, included),
            or `device` names no device or one this torch cannot use; the message names it.

    Examples:
        >>> import famp
        >>> state = famp.init_scaler(2.0**10, growth_interval=3)
        >>> state.scale, state.growth_tracker
        (tensor(1024.), tensor(0, dtype=torch.int32))
    """
    return make_state(
        init_scale,
        0,
        None,
        growth_factor,
        backoff_factor,
        growth_interval,
        enabled=enabled,
        device=device,
        dynamic=dynamic,
        min_scale=min_scale,
        max_scale=max_scale,
        hysteresis=hysteresis,
    )


def make_state(
    scale_value: object,
    tracker_value: object,
    overflow_value: object,
    growth_factor: object,
    backoff_factor: object,
    growth_interval: object,
    *,
    enabled: object,
    device: object,
    dynamic: object,
    min_scale: object,
    max_scale: object,
    hysteresis: object,
    in_dict: bool = False,
) -> ScalerState:
    """Validate Python values and build the state: the one path of `init_scaler` and
    `from_state_dict`. With `in_dict` the messages name the state dict's keys.

    Checks, in order: the hyperparameters (as `ScalerState` checks them); the scale (a usable
    float32 scale, see `check_scale`) and the guards around it, in float32; the tracker (an
    int32: torch's counter wraps, so any int32 value is a state torch can reach); the overflow
    count (`None`, or an int in `[0, hysteresis]` with `hysteresis > 1`); the device.
    """
    check_statics(
        growth_factor,
        backoff_factor,
        growth_interval,
        enabled,
        dynamic,
        min_scale,
        max_scale,
        hysteresis,
        in_dict=in_dict,
    )
    scale_name = label("scale", in_dict) if in_dict else "init_scale"
    scale32 = check_scale(scale_name, scale_value)
    if min_scale is not None and scale32 < float32_value(min_scale):  # type: ignore[arg-type]
        raise ValueError(
            f"{scale_name} must be >= min_scale in float32, got {scale_value!r} < {min_scale!r}"
        )
    if max_scale is not None and scale32 > float32_value(max_scale):  # type: ignore[arg-type]
        raise ValueError(
            f"{scale_name} must be <= max_scale in float32, got {scale_value!r} > {max_scale!r}"
        )
    tracker = check_int(
        label("_growth_tracker", in_dict) if in_dict else "growth_tracker",
        tracker_value,
        INT32_MIN,
        INT32_MAX,
        "[-2**31, 2**31 - 1] (an int32)",
    )
    count_name = "state dict key '_overflow_count'" if in_dict else "overflow_count"
    if overflow_value is not None:
        if hysteresis == 1:
            raise ValueError(
                f"{count_name} is only kept with hysteresis > 1, got {overflow_value!r} with "
                "hysteresis=1: pass the hysteresis it was saved with, or drop the key"
            )
        high = int(hysteresis)  # type: ignore[call-overload]  # an int: check_statics ran
        count = check_int(count_name, overflow_value, 0, high, f"[0, hysteresis={high}]")
    else:
        count = 0
    where = check_device(device)
    try:
        scale = torch.full((), scale32, dtype=torch.float32, device=where)
    except (RuntimeError, AssertionError) as err:  # a device this torch cannot use (CUDA absent)
        raise ValueError(f"device {device!r} cannot hold tensors here: {err}") from None
    return ScalerState(
        scale=scale,
        growth_tracker=torch.full((), tracker, dtype=torch.int32, device=where),
        overflow_count=(
            torch.full((), count, dtype=torch.int32, device=where) if hysteresis != 1 else None
        ),
        growth_factor=growth_factor,  # type: ignore[arg-type]
        backoff_factor=backoff_factor,  # type: ignore[arg-type]
        growth_interval=growth_interval,  # type: ignore[arg-type]
        enabled=enabled,  # type: ignore[arg-type]
        dynamic=dynamic,  # type: ignore[arg-type]
        min_scale=min_scale,  # type: ignore[arg-type]
        max_scale=max_scale,  # type: ignore[arg-type]
        hysteresis=hysteresis,  # type: ignore[arg-type]
    )
