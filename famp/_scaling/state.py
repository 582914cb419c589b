"""The loss-scaling state, `ScalerState`: an immutable pytree of tensor leaves and statics.

Tensor leaves carry what changes from step to step (the scale and counters); hyperparameters are
static pytree metadata, so changing one recompiles on purpose and no flatten/unflatten round trip
can drop it (flattening is derived from the dataclass fields). The state is a node of optree's
global registry and of torch's pytree, so `torch.func`, `torch.compile` and users' tree maps see
its leaves. Built by `famp.init_scaler` and `famp.from_state_dict` (`build.py`), advanced by
`famp.update_scale` (`update.py`), applied to trees by `unscale.py` and `trees.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import optree
import torch

from famp._compat import OPTREE_GLOBAL_NAMESPACE, torch_pytree
from famp._scaling.checks import check_statics
from famp._typing import Tensor

_LEAF = {"leaf": True}  # dataclass-field metadata: a tensor leaf; every other field is static
_LEAF_DTYPES = (
    ("scale", torch.float32),
    ("growth_tracker", torch.int32),
    ("overflow_count", torch.int32),
)


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
        TypeError: A static field has the wrong type, as `famp.init_scaler` refuses it, or a
            tensor leaf has the wrong dtype (`dataclasses.replace(state,
            scale=torch.tensor(1024))` is int64: the first `famp.update_scale` would fail).
        ValueError: A static field is out of range, as `famp.init_scaler` refuses it, or
            `overflow_count` is given without `hysteresis > 1` or missing with it. The
            tensor leaves' values are not read (that would be a host sync): build states with
            `famp.init_scaler` or `famp.from_state_dict`, which check their values.

    The leaves' types and shapes are not checked either, on purpose: pytree utilities rebuild
    the state with other leaves (`optree.tree_map(lambda t: None, state)`, a `tree_map` to
    shapes, `torch.func.vmap`'s `in_dims=(ScalerState(scale=0, growth_tracker=0), ...)`), and
    `torch.func.vmap` returns a batch of states whose leaves have one element per sample. So
    the contract is the caller's: famp's functions take a state whose leaves are one-element
    tensors of the dtypes above (0-d as `famp.init_scaler` makes them). A state built by hand
    with a Python number fails in the first famp call that reads it (an `AttributeError`), and
    a scale of two elements scales a loss into two values, as `torch.mul` broadcasts.

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
        # Also while Dynamo traces: a state built there (`dataclasses.replace`, the constructor)
        # may not come from a validated one, and a bad static compiles into every later step.
        check_statics(*statics)
        for name, dtype in _LEAF_DTYPES:  # metadata only: no value is read
            leaf = getattr(self, name)
            if isinstance(leaf, torch.Tensor) and leaf.dtype != dtype:
                raise TypeError(
                    f"ScalerState.{name} must be a {dtype} tensor, got {leaf.dtype} (torch's "
                    f"update kernel refuses it): torch.tensor(..., dtype={dtype})"
                )
        # Not `(... is None) != (hysteresis == 1)`: compiled, the second may be a symbolic bool.
        if self.hysteresis == 1 if self.overflow_count is not None else self.hysteresis != 1:
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


def with_leaves(state: ScalerState, **leaves: Any) -> ScalerState:
    """`state` with new tensor leaves and the same statics: how every transition builds a state.

    The statics were validated when `state` was built, so the new state copies them without
    running `__post_init__` again (a fresh dataclass costs a few microseconds, the whole budget
    of `update_scale`). While Dynamo traces, through the constructor, which it rebuilds.
    """
    if torch.compiler.is_compiling():
        return dataclasses.replace(state, **leaves)
    fields = state.__dict__.copy()
    fields.update(leaves)
    return rebuilt(fields)


def rebuilt(fields: dict[str, Any]) -> ScalerState:
    """A `ScalerState` of a validated state's fields, some leaves replaced; eagerly only."""
    new = object.__new__(ScalerState)
    object.__setattr__(new, "__dict__", fields)  # frozen: the dataclass refuses plain setattr
    return new
