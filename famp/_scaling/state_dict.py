"""`ScalerState` as a plain dict: `torch.amp.GradScaler.state_dict()`'s format, plus one key.

The dict has GradScaler's five keys and Python types, so it round-trips through JSON and
`torch.load(weights_only=True)` and loads into `GradScaler.load_state_dict` (and back), after
which both continue the same trajectory. A state with `hysteresis > 1` adds one key,
`_overflow_count` (the overflow streak, an int), so that resuming in the middle of a streak
continues bit for bit; `GradScaler.load_state_dict` reads only its own five keys and ignores it.
Loading is validated and atomic, through the same checks as `init_scaler`: a bad dict is
refused whole, with an error naming the key; nothing is half-loaded (`GradScaler.load_state_dict`
applies `scale` before it finds a missing key).

Deliberately not stored: famp-only settings (`dynamic`, `min_scale`, `max_scale`,
`hysteresis`), which GradScaler's format has no place for; pass them to `from_state_dict`
again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from famp._scaling.build import init_scaler, make_state
from famp._scaling.checks import DICT_KEYS as _KEYS
from famp._scaling.checks import check_statics
from famp._scaling.state import ScalerState
from famp._typing import DeviceLike

_OVERFLOW_KEY = "_overflow_count"


def to_state_dict(state: ScalerState) -> dict[str, float | int]:
    """Serialize a state as `GradScaler.state_dict()` does: five keys, Python floats and ints.

    The keys are `scale`, `growth_factor`, `backoff_factor`, `growth_interval` and
    `_growth_tracker`, in that order; a disabled state gives `{}`, as torch does. With
    `hysteresis > 1` a sixth key, `_overflow_count`, holds the overflow streak, so that a
    resume in the middle of one continues bit for bit; `GradScaler.load_state_dict` ignores it.
    `_growth_tracker` is torch's int32 counter as it stands: after 2**31 steps without a
    growth (possible only with a tracker above `growth_interval`) it wraps to a negative int,
    in famp as in torch, and that dict loads and continues like any other. Reads the leaves off
    their device (a host sync: call it when checkpointing, not inside a compiled step). famp-only
    settings (static scale, guards) are not stored; see `famp.from_state_dict`.

    Args:
        state: A `famp.ScalerState`.

    Returns:
        A new plain dict, or `{}` when `state.enabled` is `False`.

    Raises:
        TypeError: `state` is not a `famp.ScalerState`.
        ValueError: A leaf of `state` is on the meta device (shapes only, no values).

    Examples:
        >>> import famp
        >>> famp.to_state_dict(famp.init_scaler(1024.0, growth_interval=100))
        {'scale': 1024.0, 'growth_factor': 2.0, 'backoff_factor': 0.5, 'growth_interval': 100,
         '_growth_tracker': 0}
    """
    if not isinstance(state, ScalerState):
        raise TypeError(f"state must be a famp.ScalerState, got {type(state).__name__}")
    if not state.enabled:
        return {}
    for name in ("scale", "growth_tracker", "overflow_count"):
        leaf = getattr(state, name)
        if isinstance(leaf, torch.Tensor) and leaf.is_meta:
            raise ValueError(
                f"famp.to_state_dict: state.{name} is on the meta device (shapes only, no "
                f"values), so there is no value to save: save a state made on a real device"
            )
    d: dict[str, float | int] = {
        "scale": float(state.scale.item()),
        "growth_factor": float(state.growth_factor),
        "backoff_factor": float(state.backoff_factor),
        "growth_interval": int(state.growth_interval),
        "_growth_tracker": int(state.growth_tracker.item()),
    }
    if state.overflow_count is not None:
        d[_OVERFLOW_KEY] = int(state.overflow_count.item())
    return d


def _validate_keys(d: object) -> None:
    if not isinstance(d, Mapping):
        raise TypeError(f"state dict must be a dict, got {type(d).__name__}")
    non_str = [k for k in d if not isinstance(k, str)]
    if non_str:
        raise KeyError(f"state dict has unknown keys {non_str!r}; expected {list(_KEYS)}")
    missing = [k for k in _KEYS if k not in d]
    unknown = [k for k in d if k not in (*_KEYS, _OVERFLOW_KEY)]
    if missing or unknown:
        raise KeyError(
            f"state dict has missing keys {missing} and unknown keys {unknown}; "
            f"expected exactly {list(_KEYS)}, and {_OVERFLOW_KEY!r} with hysteresis > 1"
        )


def from_state_dict(
    d: Mapping[str, Any],
    *,
    device: DeviceLike = None,
    dynamic: bool = True,
    min_scale: float | None = None,
    max_scale: float | None = None,
    hysteresis: int = 1,
) -> ScalerState:
    """Rebuild a state from `famp.to_state_dict` or `torch.amp.GradScaler().state_dict()`.

    The whole dict is validated before anything is built, by the checks `famp.init_scaler`
    applies to its arguments: exactly the five keys, plus `_overflow_count` when it was saved
    with `hysteresis > 1`; `scale` a number whose float32 value and float32 reciprocal are
    finite and > 0 (a smaller scale makes unscaling return inf for finite gradients without
    reporting an overflow), within `min_scale` and `max_scale` when given; `growth_factor`
    finite and > 1; `backoff_factor` in (0, 1); `growth_interval` an int in [1, 2**31 - 1];
    `_growth_tracker` any int32 (torch's counter wraps negative after 2**31 steps without
    growth; it continues from there as torch does); `_overflow_count` an int in
    `[0, hysteresis]`, only with `hysteresis > 1`. `bool` is neither an int nor a float.
    `{}` (what a disabled state or a disabled `GradScaler` saves) gives a disabled state,
    where `GradScaler.load_state_dict` raises. famp-only settings are passed again here.

    Args:
        d: The plain dict.
        device: Device of the tensor leaves (`None`: torch's default device).
        dynamic: `False` for a static scale.
        min_scale: Opt-in guard, as in `famp.init_scaler`.
        max_scale: Opt-in guard, as in `famp.init_scaler`.
        hysteresis: Opt-in guard, as in `famp.init_scaler`; the overflow count is the dict's
            `_overflow_count`, or 0 for a dict without one (a `GradScaler`'s).

    Returns:
        A new `famp.ScalerState` that continues the saved trajectory bit for bit.

    Raises:
        TypeError: `d` is not a dict, a value has the wrong type (the message names the key),
            or a keyword argument has the wrong type, as in `famp.init_scaler`.
        KeyError: Keys are missing or unknown; the message names them.
        ValueError: A value is out of range (the message names the key and the value),
            `_overflow_count` is present with `hysteresis=1`, or a keyword argument is out
            of range, as in `famp.init_scaler`.

    Examples:
        >>> import famp, torch
        >>> scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
        >>> famp.from_state_dict(scaler.state_dict()).scale
        tensor(512.)
    """
    if isinstance(d, Mapping) and len(d) == 0:  # a disabled state's (or GradScaler's) dict
        # The famp-only settings are checked as init_scaler checks them, then dropped: a
        # disabled state never uses them.
        check_statics(2.0, 0.5, 1, False, dynamic, min_scale, max_scale, hysteresis)
        return init_scaler(1.0, enabled=False, device=device, dynamic=dynamic)
    _validate_keys(d)
    if _OVERFLOW_KEY in d and d[_OVERFLOW_KEY] is None:  # never written so: not "no key"
        raise TypeError(f"state dict key {_OVERFLOW_KEY!r} must be an int, got None")
    famp_only = {"min_scale": min_scale, "max_scale": max_scale, "hysteresis": hysteresis}
    return make_state(
        d["scale"],
        d["_growth_tracker"],
        d.get(_OVERFLOW_KEY),
        d["growth_factor"],
        d["backoff_factor"],
        d["growth_interval"],
        enabled=True,
        device=device,
        dynamic=dynamic,
        in_dict=True,
        **famp_only,
    )
