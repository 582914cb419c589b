"""``ScalerState`` as a plain dict, exactly ``torch.amp.GradScaler.state_dict()``'s format.

The dict has GradScaler's five keys and Python types, so it round-trips through JSON and
``torch.load(weights_only=True)`` and loads into ``GradScaler.load_state_dict`` (and back), after
which both continue the same trajectory. Loading is validated and atomic: a bad dict is refused
whole, with an error naming the key; nothing is half-loaded (``GradScaler.load_state_dict`` applies
``scale`` before it finds a missing key).

Deliberately not stored: famp-only settings (``dynamic``, ``min_scale``, ``max_scale``,
``hysteresis`` and its overflow count), which GradScaler's format has no place for; pass them to
``from_state_dict`` again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from famp._scaler import _INT32_MAX, ScalerState, make_state
from famp._typing import DeviceLike

_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_F32_MAX = float(torch.finfo(torch.float32).max)


def to_state_dict(state: ScalerState) -> dict[str, float | int]:
    """Serialize a state as ``GradScaler.state_dict()`` does: five keys, Python floats and ints.

    The keys are ``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval`` and
    ``_growth_tracker``, in that order; a disabled state gives ``{}``, as torch does. Reads the
    scale and tracker off their device (a host sync: call it when checkpointing, not every step).
    famp-only settings (static scale, guards) are not stored; see ``famp.from_state_dict``.

    Args:
        state: A ``famp.ScalerState``.

    Returns:
        A new plain dict, or ``{}`` when ``state.enabled`` is ``False``.

    Raises:
        TypeError: ``state`` is not a ``famp.ScalerState``.

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
    return {
        "scale": float(state.scale.item()),
        "growth_factor": float(state.growth_factor),
        "backoff_factor": float(state.backoff_factor),
        "growth_interval": int(state.growth_interval),
        "_growth_tracker": int(state.growth_tracker.item()),
    }


def _number(d: Mapping[str, Any], key: str, kind: type) -> Any:
    value = d[key]
    allowed = (int,) if kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, allowed):
        wanted = "an int" if kind is int else "a float"
        raise TypeError(
            f"state dict key {key!r} must be {wanted}, got {type(value).__name__} {value!r}"
        )
    return value


def _validate(d: object) -> tuple[float, float, float, int, int]:
    if not isinstance(d, Mapping):
        raise TypeError(f"state dict must be a dict, got {type(d).__name__}")
    non_str = [k for k in d if not isinstance(k, str)]
    if non_str:
        raise KeyError(f"state dict has unknown keys {non_str!r}; expected {list(_KEYS)}")
    missing = [k for k in _KEYS if k not in d]
    unknown = [k for k in d if k not in _KEYS]
    if missing or unknown:
        raise KeyError(
            f"state dict has missing keys {missing} and unknown keys {unknown}; "
            f"expected exactly {list(_KEYS)}"
        )
    scale_value = _number(d, "scale", float)
    growth_factor = _number(d, "growth_factor", float)
    backoff_factor = _number(d, "backoff_factor", float)
    growth_interval = _number(d, "growth_interval", int)
    tracker = _number(d, "_growth_tracker", int)
    if not (math.isfinite(scale_value) and 0 < scale_value <= _F32_MAX):
        raise ValueError(
            f"state dict key 'scale' must be finite and > 0 in float32, got {scale_value!r}"
        )
    if not (math.isfinite(growth_factor) and growth_factor > 1.0):
        raise ValueError(
            f"state dict key 'growth_factor' must be finite and > 1.0, got {growth_factor!r}"
        )
    if not 0.0 < backoff_factor < 1.0:
        raise ValueError(
            f"state dict key 'backoff_factor' must be in (0, 1), got {backoff_factor!r}"
        )
    if not 1 <= growth_interval <= _INT32_MAX:
        raise ValueError(
            f"state dict key 'growth_interval' must be in [1, 2**31 - 1], got {growth_interval!r}"
        )
    if not 0 <= tracker <= _INT32_MAX:
        raise ValueError(
            f"state dict key '_growth_tracker' must be in [0, 2**31 - 1], got {tracker!r}"
        )
    return float(scale_value), float(growth_factor), float(backoff_factor), growth_interval, tracker


def from_state_dict(
    d: Mapping[str, Any],
    *,
    device: DeviceLike = None,
    dynamic: bool = True,
    min_scale: float | None = None,
    max_scale: float | None = None,
    hysteresis: int = 1,
) -> ScalerState:
    """Rebuild a state from ``famp.to_state_dict`` or ``torch.amp.GradScaler().state_dict()``.

    The whole dict is validated before anything is built: exactly the five keys; ``scale`` a
    finite float (or int) > 0 that fits float32; ``growth_factor`` > 1; ``backoff_factor`` in
    (0, 1); ``growth_interval`` an int >= 1; ``_growth_tracker`` an int >= 0 (``bool`` is not an
    int). ``{}`` (what a disabled state or a disabled ``GradScaler`` saves) gives a disabled state,
    where ``GradScaler.load_state_dict`` raises. famp-only settings are passed again here.

    Args:
        d: The plain dict.
        device: Device of the tensor leaves (``None``: torch's default device).
        dynamic: ``False`` for a static scale.
        min_scale: Opt-in guard, as in ``famp.init_scaler``.
        max_scale: Opt-in guard, as in ``famp.init_scaler``.
        hysteresis: Opt-in guard, as in ``famp.init_scaler``; the overflow count starts at 0.

    Returns:
        A new ``famp.ScalerState`` that continues the saved trajectory bit for bit.

    Raises:
        TypeError: ``d`` is not a dict, or a value has the wrong type; the message names the key.
        KeyError: Keys are missing or unknown; the message names them.
        ValueError: A value is out of range; the message names the key and the value.

    Examples:
        >>> import famp, torch
        >>> scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
        >>> famp.from_state_dict(scaler.state_dict()).scale
        tensor(512.)
    """
    if isinstance(d, Mapping) and len(d) == 0:
        return make_state(
            1.0,
            0,
            2.0,
            0.5,
            2000,
            enabled=False,
            device=device,
            dynamic=dynamic,
            min_scale=None,
            max_scale=None,
            hysteresis=1,
        )
    scale_value, growth_factor, backoff_factor, growth_interval, tracker = _validate(d)
    return make_state(
        scale_value,
        tracker,
        growth_factor,
        backoff_factor,
        growth_interval,
        enabled=True,
        device=device,
        dynamic=dynamic,
        min_scale=min_scale,
        max_scale=max_scale,
        hysteresis=hysteresis,
    )


for _public in (to_state_dict, from_state_dict):
    _public.__module__ = "famp"
