"""Loss-scaling state: `ScalerState`, `init_scaler` and `update_scale`.

The dynamics are `torch.amp.GradScaler`'s, bit for bit: an update backs off on any non-zero
`found_inf` and grows only when the tracker *equals* the interval, computing
`f32(f64(scale) * factor)` and never growing to a non-finite scale. Unlike `GradScaler` the
state is an immutable pytree and every transition is pure and branch-free on tensor values, so a
whole training step compiles with `torch.compile(fullgraph=True)` and composes with
`torch.func`. Applying the scale to trees lives in `_unscale.py`.

Deliberately not supported: optimizer bookkeeping (`GradScaler.step`'s per-optimizer stages; skip
an update with `select_tree`), and `update(new_scale=...)` (build a new state instead).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import optree
import torch

from famp._compat import (
    OPTREE_GLOBAL_NAMESPACE,
    amp_update_scale,
    functorch_transforms_active,
    torch_pytree,
)
from famp._typing import DeviceLike, Tensor

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
_F32_MAX = float(torch.finfo(torch.float32).max)
_F32_OVERFLOW = 2.0**128 * (1 - 2.0**-25)  # the smallest double that rounds to float32 inf
_MIN_SCALE = 2.0**-128 + 2.0**-149  # the smallest float32 whose float32 reciprocal is finite
_DICT_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


_LEAF = {"leaf": True}  # dataclass-field metadata: a tensor leaf; every other field is static


@dataclasses.dataclass(frozen=True, eq=False)
class ScalerState:
    """Immutable loss-scaling state: tensor leaves plus static hyperparameters.

    A pytree for `optree` (in every namespace, none needed), torch's pytree, `torch.func`
    and `torch.compile`. Its leaves are `scale` (0-d float32) and `growth_tracker`
    (0-d int32), plus `overflow_count` (0-d int32) only when `hysteresis > 1`.
    Every other field is static metadata: changing one recompiles on purpose, and no
    flatten/unflatten round trip can drop it (flattening is derived from the dataclass fields).
    Build one with `famp.init_scaler` or
    `famp.from_state_dict`; never mutated, every transition returns a new state.

    Attributes:
        scale: 0-d float32 tensor, the current loss scale.
        growth_tracker: 0-d int32 tensor, finite steps since the last growth or overflow.
        overflow_count: 0-d int32 tensor of consecutive overflows (hysteresis only), else `None`.
        growth_factor: Multiplier applied on growth (> 1).
        backoff_factor: Multiplier applied on overflow (in (0, 1)).
        growth_interval: Number of consecutive finite steps before a growth (>= 1).
        enabled: `False` makes every famp function an identity (`found_inf` 0.0).
        dynamic: `False` keeps the scale fixed: `famp.update_scale` returns the state unchanged.
        min_scale: Opt-in guard: a backoff never takes the scale below it (`None`: off).
        max_scale: Opt-in guard: a growth never takes the scale above it (`None`: off).
        hysteresis: Opt-in guard: back off only from the `hysteresis`-th consecutive overflow on.

    Raises:
        TypeError: A static field has the wrong type, as `famp.init_scaler` refuses it.
        ValueError: A static field is out of range, as `famp.init_scaler` refuses it, or
            `overflow_count` is given without `hysteresis > 1` or missing with it. The
            tensor leaves are not read (that would be a host sync): build states with
            `famp.init_scaler` or `famp.from_state_dict`, which check their values.

    Examples:
        >>> import famp, optree
        >>> state = famp.init_scaler(1024.0)
        >>> leaves, spec = optree.tree_flatten(state)
        >>> leaves
        [tensor(1024.), tensor(0, dtype=torch.int32)]
        >>> optree.tree_unflatten(spec, leaves).growth_interval
        2000
    """

    scale: Tensor = dataclasses.field(metadata=_LEAF)
    growth_tracker: Tensor = dataclasses.field(metadata=_LEAF)
    overflow_count: Tensor | None = dataclasses.field(default=None, metadata=_LEAF)
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True
    dynamic: bool = True
    min_scale: float | None = None
    max_scale: float | None = None
    hysteresis: int = 1

    def __post_init__(self) -> None:
        if torch.compiler.is_compiling():  # traced values came from a validated state
            return
        statics = (
            self.growth_factor,
            self.backoff_factor,
            self.growth_interval,
            self.enabled,
            self.dynamic,
            self.min_scale,
            self.max_scale,
            self.hysteresis,
        )
        _validate_statics(*statics)
        if (self.overflow_count is None) != (self.hysteresis == 1):
            raise ValueError(
                "overflow_count must be a 0-d int32 tensor when hysteresis > 1 and None otherwise, "
                f"got hysteresis={self.hysteresis!r} and overflow_count={self.overflow_count!r}"
            )


_LEAF_NAMES = tuple(f.name for f in dataclasses.fields(ScalerState) if f.metadata.get("leaf"))
_STATIC_NAMES = tuple(f.name for f in dataclasses.fields(ScalerState) if not f.metadata.get("leaf"))


def _flatten(state: ScalerState) -> tuple[list[Any], tuple[Any, ...]]:
    present = tuple(n for n in _LEAF_NAMES if getattr(state, n) is not None)
    statics = tuple(getattr(state, n) for n in _STATIC_NAMES)
    return [getattr(state, n) for n in present], (present, statics)


def _unflatten(aux: tuple[Any, ...], children: Sequence[Any]) -> ScalerState:
    present, statics = aux
    return ScalerState(
        **dict(zip(present, children, strict=True)),
        **dict(zip(_STATIC_NAMES, statics, strict=True)),
    )


def _flatten_with_keys(
    state: ScalerState,
) -> tuple[list[tuple[torch_pytree.KeyEntry, Any]], tuple[Any, ...]]:
    children, aux = _flatten(state)
    return [(torch_pytree.GetAttrKey(n), c) for n, c in zip(aux[0], children, strict=True)], aux


def _optree_flatten(state: ScalerState) -> tuple[list[Any], tuple[Any, ...], tuple[str, ...]]:
    children, aux = _flatten(state)
    return children, aux, aux[0]  # path entries: the leaf names, read as attributes


_register_optree: Any = optree.register_pytree_node  # typed for Collection subclasses only
_register_optree(
    ScalerState,
    _optree_flatten,
    lambda aux, children: _unflatten(aux, list(children)),
    path_entry_type=optree.GetAttrEntry,
    namespace=OPTREE_GLOBAL_NAMESPACE,
)
torch_pytree.register_pytree_node(
    ScalerState,
    _flatten,
    lambda children, aux: _unflatten(aux, list(children)),
    serialized_type_name="famp.ScalerState",
    # JSON turns the context's tuples into lists (treespec_dumps/loads, torch.export): undo that.
    to_dumpable_context=lambda aux: [list(aux[0]), list(aux[1])],
    from_dumpable_context=lambda dumped: (tuple(dumped[0]), tuple(dumped[1])),
    flatten_with_keys_fn=_flatten_with_keys,
)


# --- validation: the one path every state goes through -------------------------------------------


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-8:]} ({len(text)} characters)"


def _real(name: str, value: object) -> float:
    """`value` as a float: TypeError unless an int or float (not bool), ValueError if too big."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{name} must be an int or float, got {type(value).__name__} {_show(value)}"
        )
    try:
        return float(value)
    except OverflowError:  # an int beyond the float range, e.g. 10**400
        raise ValueError(f"{name} must be finite, got {_show(value)}") from None


def _int(name: str, value: object, low: int, high: int, bounds: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{name} must be an int in {bounds}, got {type(value).__name__} {_show(value)}"
        )
    if not low <= value <= high:
        raise ValueError(f"{name} must be an int in {bounds}, got {_show(value)}")
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


def check_scale(name: str, value: object, *, none_ok: bool = False) -> float:
    """`value` if it is a usable float32 scale: it and its float32 reciprocal finite and > 0.

    torch itself refuses a double above float32's maximum (`torch.full` raises); below about
    2.9e-39 the reciprocal that unscaling multiplies by (`f32(1 / f64(scale))`) is infinite,
    and below 2**-150 the scale is 0.0: either way every gradient becomes inf or NaN while the
    overflow check, which reads the scaled gradients, passes.
    """
    x = _real(name, value)
    s = to_float32(x)
    if not (0.0 < x <= _F32_MAX and s > 0.0 and math.isfinite(to_float32(1.0 / s))):
        raise ValueError(
            f"{name} must be {'None or ' if none_ok else ''}a number whose float32 value and "
            f"float32 reciprocal are finite and > 0 (from about {_MIN_SCALE:.3g} to "
            f"{_F32_MAX:.4g}), got {_show(value)}"
        )
    return x


def _label(name: str, in_dict: bool) -> str:
    return f"state dict key {name!r}" if in_dict and name in _DICT_KEYS else name


@functools.lru_cache(maxsize=256, typed=True)
def _check_hyperparameters(
    growth_factor: object,
    backoff_factor: object,
    growth_interval: object,
    enabled: object,
    dynamic: object,
    min_scale: object,
    max_scale: object,
    hysteresis: object,
    in_dict: bool = False,
) -> None:
    name = _label("growth_factor", in_dict)
    gf = _real(name, growth_factor)
    if not (math.isfinite(gf) and gf > 1.0):
        raise ValueError(f"{name} must be a finite number > 1.0, got {_show(growth_factor)}")
    name = _label("backoff_factor", in_dict)
    if not 0.0 < _real(name, backoff_factor) < 1.0:
        raise ValueError(f"{name} must be a number in (0, 1), got {_show(backoff_factor)}")
    _int(_label("growth_interval", in_dict), growth_interval, 1, _INT32_MAX, "[1, 2**31 - 1]")
    for flag_name, flag in (("enabled", enabled), ("dynamic", dynamic)):
        if not isinstance(flag, bool):
            raise TypeError(f"{flag_name} must be a bool, got {type(flag).__name__} {flag!r}")
    bounds = {}
    for bound_name, bound in (("min_scale", min_scale), ("max_scale", max_scale)):
        if bound is not None:
            bounds[bound_name] = to_float32(check_scale(bound_name, bound, none_ok=True))
    if len(bounds) == 2 and bounds["min_scale"] > bounds["max_scale"]:
        raise ValueError(f"min_scale must be <= max_scale, got {min_scale!r} > {max_scale!r}")
    _int("hysteresis", hysteresis, 1, _INT32_MAX, "[1, 2**31 - 1]")


def _validate_statics(*statics: object, in_dict: bool = False) -> None:
    """Validate the static fields, cached: every transition builds (and so validates) a state."""
    if torch.compiler.is_compiling():  # Dynamo traces through lru_cache (and warns): skip it
        _check_hyperparameters.__wrapped__(*statics, in_dict)
        return
    try:
        hash(statics)
    except TypeError:  # an unhashable value cannot be valid: the uncached check names it
        _check_hyperparameters.__wrapped__(*statics, in_dict)
        raise
    _check_hyperparameters(*statics, in_dict)


def _check_device(device: object) -> torch.device | None:
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
            finite and > 0 (about 2.9e-39 to 3.4e38), so that unscaling can never turn finite
            gradients into inf silently.
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
    _validate_statics(
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
    scale_name = "state dict key 'scale'" if in_dict else "init_scale"
    scale32 = to_float32(check_scale(scale_name, scale_value))
    if min_scale is not None and scale32 < to_float32(float(min_scale)):  # type: ignore[arg-type]
        raise ValueError(
            f"{scale_name} must be >= min_scale in float32, got {scale_value!r} < {min_scale!r}"
        )
    if max_scale is not None and scale32 > to_float32(float(max_scale)):  # type: ignore[arg-type]
        raise ValueError(
            f"{scale_name} must be <= max_scale in float32, got {scale_value!r} > {max_scale!r}"
        )
    tracker = _int(
        "state dict key '_growth_tracker'" if in_dict else "growth_tracker",
        tracker_value,
        _INT32_MIN,
        _INT32_MAX,
        "[-2**31, 2**31 - 1] (an int32)",
    )
    count_name = "state dict key '_overflow_count'" if in_dict else "overflow_count"
    if overflow_value is not None:
        if hysteresis == 1:
            raise ValueError(
                f"{count_name} is only kept with hysteresis > 1, got {overflow_value!r} with "
                "hysteresis=1: pass the hysteresis it was saved with, or drop the key"
            )
        count = _int(count_name, overflow_value, 0, hysteresis, f"[0, hysteresis={hysteresis}]")  # type: ignore[arg-type]
    else:
        count = 0
    where = _check_device(device)
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


def update_scale(state: ScalerState, found_inf: Tensor) -> ScalerState:
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
            or max of several); non-zero means overflow.

    Returns:
        A new `famp.ScalerState` with the same hyperparameters, shapes, dtypes and device.

    Raises:
        TypeError: `state` is not a `famp.ScalerState`, or `found_inf` is not a tensor.
        ValueError: `found_inf` does not have exactly one element.

    Examples:
        >>> import famp, torch
        >>> state = famp.init_scaler(8.0, growth_interval=1)
        >>> famp.update_scale(state, torch.tensor(0.0)).scale
        tensor(16.)
        >>> famp.update_scale(state, torch.tensor(float("nan"))).scale
        tensor(4.)
    """
    if not isinstance(state, ScalerState):
        raise TypeError(f"state must be a famp.ScalerState, got {type(state).__name__}")
    if not isinstance(found_inf, torch.Tensor):
        raise TypeError(f"found_inf must be a Tensor, got {type(found_inf).__name__} {found_inf!r}")
    if found_inf.numel() != 1:
        raise ValueError(
            f"found_inf must have exactly one element, got shape {tuple(found_inf.shape)}"
        )
    if not (state.enabled and state.dynamic):
        return state
    scale = state.scale
    if found_inf.device != scale.device:
        found_inf = found_inf.to(scale.device, non_blocking=True)
    if (
        state.overflow_count is not None
        or state.min_scale is not None
        or state.max_scale is not None
        or functorch_transforms_active()
    ):
        return _update_where(state, found_inf)
    # No guard: torch's own functional kernel, one call. It has no vmap batching rule, hence the
    # torch.where formulation under torch.func transforms.
    if found_inf.dtype != torch.float32:
        found_inf = (found_inf != 0).to(torch.float32)  # any non-zero, exactly as the kernel reads
    # The overload itself, not the packet, which resolves the overload on every call (~0.4 µs).
    new_scale, new_tracker = amp_update_scale.default(
        scale,
        state.growth_tracker,
        found_inf,
        state.growth_factor,
        state.backoff_factor,
        state.growth_interval,
    )
    if torch.compiler.is_compiling():  # Dynamo rebuilds the dataclass through its constructor
        return dataclasses.replace(state, scale=new_scale, growth_tracker=new_tracker)
    # _evolve inlined (the hot path; ~0.5 µs less): the statics were validated when `state` was
    # built, so the new state copies them without re-validating.
    new = object.__new__(ScalerState)
    fields = new.__dict__
    fields.update(state.__dict__)
    fields["scale"] = new_scale
    fields["growth_tracker"] = new_tracker
    return new


def _evolve(state: ScalerState, **leaves: Any) -> ScalerState:
    """`dataclasses.replace` for new leaves only, without re-validating the static fields."""
    if torch.compiler.is_compiling():  # Dynamo rebuilds the dataclass through its constructor
        return dataclasses.replace(state, **leaves)
    new = object.__new__(ScalerState)  # the statics were validated when `state` was built
    new.__dict__.update(state.__dict__, **leaves)
    return new


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
        floor = torch.minimum(scale_, scale_.new_tensor(state.min_scale))
        backed = torch.maximum(backed, floor)
    grown = (wide * state.growth_factor).float()
    if state.max_scale is not None:
        grown = torch.minimum(grown, torch.maximum(scale_, scale_.new_tensor(state.max_scale)))
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
    return _evolve(
        state, scale=new_scale, growth_tracker=new_tracker, overflow_count=overflow_count
    )


for _public in (ScalerState, init_scaler, update_scale):
    _public.__module__ = "famp"
