"""Checks of Python values for loss scaling: the one validation path of every scaler state.

`check_statics` is the one check of a state's static fields (hyperparameters and guards):
`ScalerState.__post_init__` runs it, so a hand-built state is checked as `init_scaler`'s; and
`make_state` (behind `init_scaler` and `from_state_dict`) runs it first of all, so that errors
name a state dict's keys and come before the leaves' values are read (the constructor's call is
then a lookup). A validated combination is remembered, so the transitions of a step, which
rebuild states with the same statics, do not check again. `check_scale`,
`check_int` and `check_device` validate the values that become tensor leaves, before any tensor
is built. Errors name the argument (or the state dict's key) and the value.
"""

from __future__ import annotations

import math

import torch

from famp._compat import assume_constant_result

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
_F32_MAX = float(torch.finfo(torch.float32).max)
_F32_OVERFLOW = 2.0**128 * (1 - 2.0**-25)  # the smallest double that rounds to float32 inf
_MIN_SCALE = 2.0**-128 + 2.0**-149  # the smallest float32 whose float32 reciprocal is finite
# The largest number that rounds below it (the tie between it and 2**-128 goes to the even one).
_LOWEST_SCALE = 2.0**-128 + 2.0**-150
# Formatted once: Dynamo (2.13) formats a float with a format spec in an f-string as a float.
_SCALE_RANGE = f"(from about {_MIN_SCALE:.3g} to {_F32_MAX:.4g})"
DICT_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")

# The floating dtypes loss scaling reads (unscaling, overflow checks, reports).
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def show(value: object) -> str:
    """`repr(value)`, shortened to about 40 characters for error messages."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-8:]} ({len(text)} characters)"


def _real(name: str, value: object) -> float:
    """`value` as a float: TypeError unless an int or float (not bool), ValueError if too big."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be an int or float, got {type(value).__name__} {show(value)}")
    try:
        return float(value)
    except OverflowError:  # an int beyond the float range, e.g. 10**400
        raise ValueError(f"{name} must be finite, got {show(value)}") from None


def check_int(name: str, value: object, low: int, high: int, bounds: str) -> int:
    """`value` if it is an int (not bool) in `[low, high]`, which `bounds` spells out."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{name} must be an int in {bounds}, got {type(value).__name__} {show(value)}"
        )
    if not low <= value <= high:
        raise ValueError(f"{name} must be an int in {bounds}, got {show(value)}")
    return value


def to_float32(x: float) -> float:
    """`x` rounded to the nearest float32 (ties to even), as a Python float; pure Python."""
    if x == 0.0 or not math.isfinite(x):
        return x
    if abs(x) >= _F32_OVERFLOW:  # rounds to infinity
        return math.copysign(math.inf, x)
    exponent = math.frexp(x)[1]  # |x| = m * 2**exponent, 0.5 <= m < 1
    quantum = max(exponent - 24, -149)  # 24 significant bits, or the subnormal spacing 2**-149
    return math.ldexp(round(math.ldexp(x, -quantum)), quantum)


@assume_constant_result  # compiled (a guard of `update_scale`): a constant, read when tracing
def float32_value(value: int | float) -> float:
    """The float32 that torch makes of a Python int or float, as a Python float; inf beyond.

    What `torch.full((), value, dtype=torch.float32)` holds: a float rounded once to float32
    (`to_float32`), an int rounded straight to float32 (ties to even), as torch converts an
    integer. Not through a double: from 2**53 on, that first rounding can make a tie which the
    second then breaks the other way (2**60 + 2**36 + 1 is 2**60 + 2**37 in float32, and 2**60
    through a double). torch reads no int beyond int64; famp rounds those the same way.
    `update_scale`'s guards use it too, not `new_tensor` of the guard, which takes an int
    through a double.
    """
    if isinstance(value, float):
        return to_float32(value)
    size = abs(value)
    shift = size.bit_length() - 24  # the bits below float32's 24 significant ones
    if shift > 0:
        kept, dropped = size >> shift, size & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        if dropped > half or (dropped == half and kept & 1):
            kept += 1
        size = kept << shift
    magnitude = math.inf if size >= 1 << 128 else float(size)  # at most 25 bits: exact
    return -magnitude if value < 0 else magnitude


def check_scale(name: str, value: object, *, none_ok: bool = False) -> float:
    """The float32 value of `value` (`float32_value`) if it is a usable float32 scale: it and
    its float32 reciprocal finite and > 0.

    torch itself refuses a double above float32's maximum (`torch.full` raises), and famp an int
    above it too; below about 2.9e-39 the reciprocal that unscaling multiplies by
    (`f32(1 / f64(scale))`) is infinite, and below 2**-150 the scale is 0.0: either way every
    gradient becomes inf or NaN while the overflow check, which reads the scaled gradients,
    passes.
    """
    x = _real(name, value)
    exact = value if isinstance(value, int) else x  # an int compares with floats exactly
    if torch.compiler.is_compiling():  # Dynamo may hold it as symbolic: comparisons only
        s, usable = x, _LOWEST_SCALE < exact <= _F32_MAX  # the same set of values
    else:
        s = float32_value(value)  # type: ignore[arg-type]  # an int or a float: _real checked
        usable = 0.0 < exact <= _F32_MAX and s > 0.0 and math.isfinite(to_float32(1.0 / s))
    if not usable:
        raise ValueError(
            f"{name} must be {'None or ' if none_ok else ''}a number whose float32 value and "
            f"float32 reciprocal are finite and > 0 {_SCALE_RANGE}, got {show(value)}"
        )
    return s


def label(name: str, in_dict: bool) -> str:
    """How an error names a field: as the state dict's key when the value came from one."""
    return f"state dict key {name!r}" if in_dict and name in DICT_KEYS else name


def _check_statics(
    growth_factor: object,
    backoff_factor: object,
    growth_interval: object,
    enabled: object,
    dynamic: object,
    min_scale: object,
    max_scale: object,
    hysteresis: object,
    *,
    in_dict: bool,
) -> None:
    name = label("growth_factor", in_dict)
    # Comparisons only: compiled, Dynamo may make a default a symbolic float (no math.isfinite).
    if not 1.0 < _real(name, growth_factor) < math.inf:  # NaN fails both
        raise ValueError(f"{name} must be a finite number > 1.0, got {show(growth_factor)}")
    name = label("backoff_factor", in_dict)
    if not 0.0 < _real(name, backoff_factor) < 1.0:
        raise ValueError(f"{name} must be a number in (0, 1), got {show(backoff_factor)}")
    check_int(label("growth_interval", in_dict), growth_interval, 1, INT32_MAX, "[1, 2**31 - 1]")
    for flag_name, flag in (("enabled", enabled), ("dynamic", dynamic)):
        if not isinstance(flag, bool):
            raise TypeError(f"{flag_name} must be a bool, got {type(flag).__name__} {flag!r}")
    bounds = {}
    for bound_name, bound in (("min_scale", min_scale), ("max_scale", max_scale)):
        if bound is not None:
            bounds[bound_name] = check_scale(bound_name, bound, none_ok=True)
    if len(bounds) == 2 and bounds["min_scale"] > bounds["max_scale"]:
        raise ValueError(f"min_scale must be <= max_scale, got {min_scale!r} > {max_scale!r}")
    check_int("hysteresis", hysteresis, 1, INT32_MAX, "[1, 2**31 - 1]")


# Static-field combinations already validated, keyed with their types (1 and 1.0 hash alike).
_VALID: set[tuple[object, ...]] = set()


def check_statics(*statics: object, in_dict: bool = False) -> None:
    """Validate a state's static fields, in `ScalerState`'s field order.

    `in_dict` names the fields as the state dict's keys in errors. A combination that passed is
    remembered: every transition of a step builds a state with the same statics.
    """
    if torch.compiler.is_compiling():  # no global set to mutate while Dynamo traces
        _check_statics(*statics, in_dict=in_dict)
        return
    try:
        key = (*statics, *map(type, statics))
        if key in _VALID:
            return
    except TypeError:  # unhashable: never valid, and the check below names the field
        key = None
    _check_statics(*statics, in_dict=in_dict)
    if key is not None and len(_VALID) < 1024:
        _VALID.add(key)


def check_device(device: object) -> torch.device | None:
    """`device` as a `torch.device` (`None` stays `None`: torch's default device)."""
    if device is None:
        return None
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(
            f"device must be None, a torch.device, a str or an int, got {type(device).__name__} "
            f"{device!r}"
        )
    try:
        return torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"device must name a torch device, got {device!r}") from None
