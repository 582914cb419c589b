"""FSDP1 and FSDP2 layouts built from parameter names and shapes (`fsdp2_layout`, `fsdp1_layout`).

Nothing but `{fqn: shape}` is needed, so a 64-rank checkpoint can be resharded on one machine;
`famp/_fsdp/live.py` reads the same layouts off a live wrapped model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from famp._fsdp.layout import FSDP1Layout, FSDP2Layout, Shape, check_shape


def _shapes(params: object, what: str) -> tuple[tuple[str, ...], tuple[Shape, ...]]:
    if not isinstance(params, Mapping):
        raise TypeError(f"{what} must be a mapping {{fqn: shape}}, got {type(params).__name__}")
    fqns = tuple(params)
    return fqns, tuple(check_shape(f, params[f]) for f in fqns)


def fsdp2_layout(
    params: Mapping[str, Sequence[int]],
    world_size: int,
    *,
    shard_dims: Mapping[str, int] | None = None,
) -> FSDP2Layout:
    """The layout `fully_shard` gives these parameters on `world_size` ranks.

    Every parameter is chunked on dim 0 (`torch.chunk`; trailing ranks may be empty) unless
    `shard_dims` names another dim, as FSDP2's `shard_placement_fn` would; a dim other than 0
    must divide evenly. Negative dims count from the end.

    Args:
        params: `{fqn: shape}` in the model's `named_parameters()` order, e.g.
            `{n: p.shape for n, p in model.named_parameters()}`.
        world_size: number of ranks.
        shard_dims: optional `{fqn: dim}` for parameters not sharded on dim 0.

    Returns:
        A frozen `famp.FSDP2Layout`.

    Raises:
        TypeError: `params` or `shard_dims` is not a mapping, or `world_size` is not an int.
        ValueError: a world size < 1, a bad name or shape, an out-of-range dim, or uneven
            sharding on dim > 0.
        KeyError: `shard_dims` names a parameter that is not in `params`.

    Examples:
        >>> import famp
        >>> layout = famp.fsdp2_layout({"w": (5, 4), "b": (1,)}, world_size=4)
        >>> [layout.local_shape("w", r) for r in range(4)]
        [(2, 4), (2, 4), (1, 4), (0, 4)]
        >>> layout
        FSDP2Layout(world_size=4, params={'w': (5, 4), 'b': (1,)})
    """
    fqns, shapes = _shapes(params, "params")
    dims = dict.fromkeys(fqns, 0)
    if shard_dims is not None and not isinstance(shard_dims, Mapping):
        raise TypeError(f"shard_dims must be a dict {{fqn: dim}}, got {shard_dims!r}")
    for fqn, dim in (shard_dims or {}).items():
        if fqn not in dims:
            raise KeyError(f"shard_dims names {fqn!r}, which is not in params")
        ndim = len(shapes[fqns.index(fqn)])
        if isinstance(dim, int) and not isinstance(dim, bool) and -ndim <= dim < 0:
            dim += ndim
        dims[fqn] = dim
    return FSDP2Layout(world_size, fqns, shapes, tuple(dims.values()))


def fsdp1_layout(
    units: Sequence[Mapping[str, Sequence[int]]],
    world_size: int,
    *,
    use_orig_params: bool = True,
    param_dtype: torch.dtype = torch.float32,
) -> FSDP1Layout:
    """The layout `FullyShardedDataParallel` gives these FSDP units on `world_size` ranks.

    One mapping per FSDP unit (every wrapped module, root last or first as you like), holding the
    parameters that unit flattens, in `named_parameters()` order and without the parameters of
    nested units; a parameter shared within a unit appears once, under its first name.

    Args:
        units: `[{fqn: shape}, ...]`, one mapping per FSDP unit.
        world_size: number of ranks.
        use_orig_params: FSDP1's flag of that name.
        param_dtype: `MixedPrecision.param_dtype`, or the parameters' dtype without mixed
            precision: the 16-byte alignment of `use_orig_params=True` counts in it.

    Returns:
        A frozen `famp.FSDP1Layout`.

    Raises:
        ValueError: a world size < 1, a bad name or shape, a `param_dtype` that is not
            floating (FSDP1 computes in it), an empty unit, a name in two units.
        TypeError: `units` is not a sequence of mappings, `world_size` is not an int,
            `use_orig_params` is not a bool, or `param_dtype` is not a `torch.dtype`.

    Examples:
        >>> import famp, torch
        >>> layout = famp.fsdp1_layout([{"w": (7, 10), "b": (7,)}], 2, param_dtype=torch.bfloat16)
        >>> layout.flat_numel(0)  # 70 + 2 alignment + 7 = 79, padded to 80 over 2 ranks
        40
    """
    if isinstance(units, Mapping) or not isinstance(units, Sequence):
        raise TypeError(
            f"units must be a sequence of {{fqn: shape}} mappings, one per FSDP unit, got "
            f"{type(units).__name__}; wrap a single unit in a list"
        )
    unit_tuples: list[tuple[tuple[str, Shape], ...]] = []
    for i, unit in enumerate(units):
        fqns, shapes = _shapes(unit, f"units[{i}]")
        unit_tuples.append(tuple(zip(fqns, shapes, strict=True)))
    return FSDP1Layout(world_size, tuple(unit_tuples), use_orig_params, param_dtype)
