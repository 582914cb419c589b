"""Loss-scaling state: ``ScalerState``, ``init_scaler`` and ``update_scale``.

The dynamics are ``torch.amp.GradScaler``'s, bit for bit: an update backs off on any non-zero
``found_inf`` and grows only when the tracker *equals* the interval, computing
``f32(f64(scale) * factor)`` and never growing to a non-finite scale. Unlike ``GradScaler`` the
state is an immutable pytree and every transition is pure and branch-free on tensor values, so a
whole training step compiles with ``torch.compile(fullgraph=True)`` and composes with
``torch.func``. Applying the scale to trees lives in ``_unscale.py``.

Deliberately not supported: optimizer bookkeeping (``GradScaler.step``'s per-optimizer stages; skip
an update with ``select_tree``), and ``update(new_scale=...)`` (build a new state instead).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import optree
import torch
import torch.utils._pytree as torch_pytree

from famp._typing import DeviceLike, Tensor

_INT32_MAX = 2**31 - 1


_LEAF = {"leaf": True}  # dataclass-field metadata: a tensor leaf; every other field is static


@dataclasses.dataclass(frozen=True, eq=False)
class ScalerState:
    """Immutable loss-scaling state: tensor leaves plus static hyperparameters.

    A pytree for ``optree`` (no namespace needed), ``torch.utils._pytree``, ``torch.func`` and
    ``torch.compile``. Its leaves are ``scale`` (0-d float32) and ``growth_tracker`` (0-d int32),
    plus ``overflow_count`` (0-d int32) only when ``hysteresis > 1``. Every other field is static
    metadata: changing one recompiles on purpose, and no flatten/unflatten round trip can drop it
    (flattening is derived from the dataclass fields). Build one with ``famp.init_scaler`` or
    ``famp.from_state_dict``; never mutated, every transition returns a new state.

    Attributes:
        scale: 0-d float32 tensor, the current loss scale.
        growth_tracker: 0-d int32 tensor, finite steps since the last growth or overflow.
        overflow_count: 0-d int32 tensor of consecutive overflows (hysteresis only), else ``None``.
        growth_factor: Multiplier applied on growth (> 1).
        backoff_factor: Multiplier applied on overflow (in (0, 1)).
        growth_interval: Number of consecutive finite steps before a growth (>= 1).
        enabled: ``False`` makes every famp function an identity (``found_inf`` 0.0).
        dynamic: ``False`` keeps the scale fixed: ``famp.update_scale`` returns the state unchanged.
        min_scale: Opt-in guard: a backoff never takes the scale below it (``None``: off).
        max_scale: Opt-in guard: a growth never takes the scale above it (``None``: off).
        hysteresis: Opt-in guard: back off only from the ``hysteresis``-th consecutive overflow on.

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
    # The global registry (the one builtins live in), so that plain ``optree.tree_flatten(state)``
    # works without a namespace argument.
    namespace=getattr(optree.registry, "__GLOBAL_NAMESPACE"),
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


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


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
) -> None:
    if not _is_real(growth_factor) or not math.isfinite(growth_factor) or growth_factor <= 1.0:  # type: ignore[arg-type,operator]
        raise ValueError(f"growth_factor must be a finite number > 1.0, got {growth_factor!r}")
    if not _is_real(backoff_factor) or not 0.0 < backoff_factor < 1.0:  # type: ignore[operator]
        raise ValueError(f"backoff_factor must be a number in (0, 1), got {backoff_factor!r}")
    if not isinstance(growth_interval, int) or isinstance(growth_interval, bool):
        raise ValueError(
            f"growth_interval must be an int in [1, 2**31 - 1], got {growth_interval!r}"
        )
    if not 1 <= growth_interval <= _INT32_MAX:
        raise ValueError(
            f"growth_interval must be an int in [1, 2**31 - 1], got {growth_interval!r}"
        )
    for name, flag in (("enabled", enabled), ("dynamic", dynamic)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    for name, bound in (("min_scale", min_scale), ("max_scale", max_scale)):
        if bound is not None and (not _is_real(bound) or not math.isfinite(bound) or bound <= 0):  # type: ignore[arg-type,operator]
            raise ValueError(f"{name} must be None or a finite number > 0, got {bound!r}")
    if min_scale is not None and max_scale is not None and min_scale > max_scale:  # type: ignore[operator]
        raise ValueError(f"min_scale must be <= max_scale, got {min_scale!r} > {max_scale!r}")
    if not isinstance(hysteresis, int) or isinstance(hysteresis, bool) or hysteresis < 1:
        raise ValueError(f"hysteresis must be an int >= 1, got {hysteresis!r}")


def _validate_statics(*statics: object) -> None:
    """Validate the static fields, cached: every transition builds (and so validates) a state."""
    if torch.compiler.is_compiling():  # Dynamo traces through lru_cache (and warns): skip it
        _check_hyperparameters.__wrapped__(*statics)
        return
    try:
        hash(statics)
    except TypeError:  # an unhashable value cannot be valid: the uncached check names it
        _check_hyperparameters.__wrapped__(*statics)
        raise
    _check_hyperparameters(*statics)


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
    """Create a loss-scaling state, the functional ``torch.amp.GradScaler(...)``.

    The arguments and defaults are ``GradScaler``'s; with the guards off (the default) the dynamics
    equal ``torch._amp_update_scale_`` bit for bit. ``dynamic=False`` gives a static scale that
    ``famp.update_scale`` never changes. Unlike ``GradScaler`` the arguments are validated
    whether or not the state is enabled.

    Args:
        init_scale: Initial scale, a finite number > 0.
        growth_factor: Multiplier on growth, finite and > 1.
        backoff_factor: Multiplier on overflow, in (0, 1).
        growth_interval: Consecutive finite steps before a growth, an int in [1, 2**31 - 1].
        enabled: ``False`` makes every famp function an identity, as a disabled ``GradScaler``.
        device: Device of the tensor leaves (``None``: torch's default device).
        dynamic: ``False`` keeps the scale at ``init_scale`` forever.
        min_scale: Opt-in guard: backoffs never take the scale below it.
        max_scale: Opt-in guard: growths never take the scale above it.
        hysteresis: Opt-in guard: back off only from the ``hysteresis``-th consecutive overflow
            on; adds the ``overflow_count`` leaf when > 1.

    Returns:
        A new ``famp.ScalerState``.

    Raises:
        ValueError: An argument is out of range; the message names it and its value.
        TypeError: ``enabled`` or ``dynamic`` is not a bool.

    Examples:
        >>> import famp
        >>> state = famp.init_scaler(2.0**10, growth_interval=3)
        >>> state.scale, state.growth_tracker
        (tensor(1024.), tensor(0, dtype=torch.int32))
    """
    if not _is_real(init_scale) or not math.isfinite(init_scale) or init_scale <= 0:
        raise ValueError(f"init_scale must be a finite number > 0, got {init_scale!r}")
    _validate_statics(
        growth_factor,
        backoff_factor,
        growth_interval,
        enabled,
        dynamic,
        min_scale,
        max_scale,
        hysteresis,
    )
    if min_scale is not None and init_scale < min_scale:
        raise ValueError(f"init_scale must be >= min_scale, got {init_scale!r} < {min_scale!r}")
    if max_scale is not None and init_scale > max_scale:
        raise ValueError(f"init_scale must be <= max_scale, got {init_scale!r} > {max_scale!r}")
    return make_state(
        init_scale,
        0,
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
    scale_value: float,
    tracker_value: int,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    *,
    enabled: bool,
    device: DeviceLike,
    dynamic: bool,
    min_scale: float | None,
    max_scale: float | None,
    hysteresis: int,
) -> ScalerState:
    """Build a validated state from Python values (shared by init_scaler and from_state_dict)."""
    _validate_statics(
        growth_factor,
        backoff_factor,
        growth_interval,
        enabled,
        dynamic,
        min_scale,
        max_scale,
        hysteresis,
    )
    return ScalerState(
        scale=torch.full((), scale_value, dtype=torch.float32, device=device),
        growth_tracker=torch.full((), tracker_value, dtype=torch.int32, device=device),
        overflow_count=(
            torch.zeros((), dtype=torch.int32, device=device) if hysteresis > 1 else None
        ),
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
        enabled=enabled,
        dynamic=dynamic,
        min_scale=min_scale,
        max_scale=max_scale,
        hysteresis=hysteresis,
    )


def update_scale(state: ScalerState, found_inf: Tensor) -> ScalerState:
    """Return the next state after a step, bit-exact with ``torch._amp_update_scale_``.

    Any non-zero ``found_inf`` (NaN, negative and 2.0 included) is an overflow: the scale becomes
    ``f32(f64(scale) * backoff_factor)`` and the tracker 0. Otherwise the tracker counts up, and
    when it *equals* ``growth_interval`` the scale becomes ``f32(f64(scale) * growth_factor)`` if
    that is finite (else it stays) and the tracker 0. The tracker is int32 and wraps like torch's.
    Branch-free and without host sync. Opt-in guards change this: ``min_scale`` floors backoffs,
    ``max_scale`` caps growths, and with ``hysteresis=N`` the first ``N - 1`` consecutive
    overflows leave the scale unchanged (the tracker still resets). A static or disabled state is
    returned unchanged.

    Args:
        state: The current ``famp.ScalerState``.
        found_inf: A one-element tensor (the ``found_inf`` of ``famp.unscale_and_check``, or a sum
            or max of several); non-zero means overflow.

    Returns:
        A new ``famp.ScalerState`` with the same hyperparameters, shapes, dtypes and device.

    Raises:
        TypeError: ``found_inf`` is not a tensor.
        ValueError: ``found_inf`` does not have exactly one element.

    Examples:
        >>> import famp, torch
        >>> state = famp.init_scaler(8.0, growth_interval=1)
        >>> famp.update_scale(state, torch.tensor(0.0)).scale
        tensor(16.)
        >>> famp.update_scale(state, torch.tensor(float("nan"))).scale
        tensor(4.)
    """
    if not isinstance(found_inf, torch.Tensor):
        raise TypeError(f"found_inf must be a Tensor, got {type(found_inf).__name__} {found_inf!r}")
    if found_inf.numel() != 1:
        raise ValueError(
            f"found_inf must have exactly one element, got shape {tuple(found_inf.shape)}"
        )
    if not (state.enabled and state.dynamic):
        return state
    if found_inf.device != state.scale.device:
        found_inf = found_inf.to(state.scale.device, non_blocking=True)
    guarded = state.overflow_count is not None or state.min_scale is not None
    if guarded or state.max_scale is not None or torch._C._are_functorch_transforms_active():
        return _update_where(state, found_inf)
    # No guard: torch's own functional kernel, one call. It has no vmap batching rule, hence the
    # torch.where formulation under torch.func transforms.
    if found_inf.dtype != torch.float32:
        found_inf = (found_inf != 0).to(torch.float32)  # any non-zero, exactly as the kernel reads
    new_scale, new_tracker = torch.ops.aten._amp_update_scale(
        state.scale,
        state.growth_tracker,
        found_inf,
        state.growth_factor,
        state.backoff_factor,
        state.growth_interval,
    )
    return _evolve(state, scale=new_scale, growth_tracker=new_tracker)


def _evolve(state: ScalerState, **leaves: Any) -> ScalerState:
    """``dataclasses.replace`` for new leaves only, without re-validating the static fields."""
    if torch.compiler.is_compiling():  # Dynamo rebuilds the dataclass through its constructor
        return dataclasses.replace(state, **leaves)
    new = object.__new__(ScalerState)  # the statics were validated when ``state`` was built
    new.__dict__.update(state.__dict__, **leaves)
    return new


def _update_where(state: ScalerState, found_inf: Tensor) -> ScalerState:
    """``update_scale`` as a branch-free ``torch.where`` program: guards, and vmap-able.

    Equal to the kernel bit for bit when no guard is set (tested): ``f32(f64(scale) * factor)``,
    ``==`` growth, the finite cap, int32 wrap, any non-zero (NaN too) is an overflow.
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
