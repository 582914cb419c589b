"""FSDP1 and FSDP2 layouts: which piece of every parameter each rank holds, from names and shapes.

A layout is plain data (frozen, comparable, picklable). It is built from `{fqn: shape}` alone
(`build.py`), so a 64-rank checkpoint can be resharded on one machine, or read off a live wrapped
model with `famp.layout_of` (`live.py`). The rules were read off torch 2.13's `fully_shard`
(`_fsdp_param.py`) and `FullyShardedDataParallel` (`_flat_param.py`) and are checked against both
in the tests.

Not supported: 0-d and zero-element parameters, HSDP and tensor-parallel meshes, FSDP1's
`NO_SHARD` strategy and parameters that FSDP1 does not manage (`ignored_modules`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

Shape = tuple[int, ...]
_ALIGNMENT_BYTES = 16  # FSDP1 use_orig_params=True aligns every parameter to 16 bytes (inductor)
_REPR_PARAMS = 6


def chunk_range(size: int, world_size: int, rank: int) -> tuple[int, int]:
    """`(start, length)` of `torch.chunk(range(size), world_size)[rank]`, empty past the end."""
    step = -(-size // world_size)
    start = min(rank * step, size)
    return start, min(step, size - start)


def _check_world_size(world_size: object) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(
            f"world_size must be an int >= 1, got {type(world_size).__name__} {world_size!r}"
        )
    if world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    return world_size


def check_rank(rank: object, world_size: int, name: str = "rank") -> int:
    """`rank` as an int in `[0, world_size)`: a TypeError or ValueError naming it."""
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(
            f"{name} must be an int in [0, {world_size}), got {type(rank).__name__} {rank!r}"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"{name} must be an int in [0, {world_size}), got {rank!r}")
    return rank


def check_shape(fqn: object, shape: object) -> Shape:
    """`shape` as a tuple of ints of a parameter FSDP2 can shard; else a ValueError naming `fqn`."""
    if not isinstance(fqn, str) or not fqn:
        raise ValueError(f"parameter names must be non-empty strings, got {fqn!r}")
    if isinstance(shape, torch.Tensor) or not isinstance(shape, Iterable):
        raise ValueError(f"shape of {fqn!r} must be a sequence of ints, got {shape!r}")
    dims = tuple(shape)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
        raise ValueError(f"shape of {fqn!r} must hold non-negative ints, got {shape!r}")
    if not dims or math.prod(dims) == 0:
        raise ValueError(
            f"parameter {fqn!r} has shape {dims}: 0-d and zero-element parameters are not "
            "supported (FSDP2 cannot shard them)"
        )
    return dims


def _check_params(fqns: Sequence[str], shapes: Sequence[Shape]) -> None:
    if len(fqns) != len(shapes):
        raise ValueError(f"got {len(fqns)} names but {len(shapes)} shapes")
    seen: set[str] = set()
    for fqn, shape in zip(fqns, shapes, strict=True):
        if check_shape(fqn, shape) != shape:
            raise ValueError(f"shape of {fqn!r} must be a tuple of ints, got {shape!r}")
        if fqn in seen:
            raise ValueError(f"parameter {fqn!r} appears twice in the layout")
        seen.add(fqn)


def _repr_params(items: Iterable[str]) -> str:
    listed = list(items)
    shown = listed[:_REPR_PARAMS] + (
        [f"... {len(listed) - _REPR_PARAMS} more"] * (len(listed) > _REPR_PARAMS)
    )
    return "{" + ", ".join(shown) + "}"


@dataclasses.dataclass(frozen=True, repr=False)
class FSDP2Layout:
    """How `fully_shard` (FSDP2) splits every parameter across `world_size` ranks.

    Each parameter is cut along its shard dim (0 unless `shard_placement_fn` chose another) with
    `torch.chunk` semantics: chunks of `ceil(n / world_size)` rows, so trailing ranks may hold
    fewer rows or none (shape `(0, *rest)`). A dim other than 0 must divide evenly, as FSDP2
    requires. Optimizer state follows the parameters; 0-d state such as `step` is replicated.
    Build it with `famp.fsdp2_layout` or `famp.layout_of`. Equal by content.

    Attributes:
        world_size: number of ranks.
        fqns: parameter names in order.
        shapes: full (unsharded) shape of each parameter.
        shard_dims: the dim each parameter is sharded on (non-negative).
    """

    world_size: int
    fqns: tuple[str, ...]
    shapes: tuple[Shape, ...]
    shard_dims: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_world_size(self.world_size)
        _check_params(self.fqns, self.shapes)
        if len(self.shard_dims) != len(self.fqns):
            raise ValueError(f"got {len(self.fqns)} names but {len(self.shard_dims)} shard dims")
        for fqn, shape, dim in zip(self.fqns, self.shapes, self.shard_dims, strict=True):
            if isinstance(dim, bool) or not isinstance(dim, int) or not 0 <= dim < len(shape):
                raise ValueError(f"shard dim of {fqn!r} must be in [0, {len(shape)}), got {dim!r}")
            if dim > 0 and shape[dim] % self.world_size:
                raise ValueError(
                    f"FSDP2 shards dim {dim} of {fqn!r} {shape} only evenly: {shape[dim]} is not "
                    f"divisible by world_size {self.world_size}"
                )

    @functools.cached_property
    def _specs(self) -> dict[str, tuple[Shape, int]]:
        triples = zip(self.fqns, self.shapes, self.shard_dims, strict=True)
        return {f: (s, d) for f, s, d in triples}

    def local_shape(self, fqn: str, rank: int) -> Shape:
        """Shape of `fqn`'s shard on `rank`, e.g. `(0, 4)` for an empty trailing rank."""
        return local_shape(self, fqn, rank)

    def __repr__(self) -> str:
        items = (
            f"{f!r}: {s}" + (f" dim {d}" if d else "")
            for f, s, d in zip(self.fqns, self.shapes, self.shard_dims, strict=True)
        )
        return f"FSDP2Layout(world_size={self.world_size}, params={_repr_params(items)})"


@dataclasses.dataclass(frozen=True)
class FlatSlice:
    """Where one original parameter lies in its FSDP1 unit's flat parameter (private)."""

    fqn: str
    unit: int
    start: int  # offset in the unsharded flat parameter, alignment padding included
    numel: int

    def in_shard(self, shard_numel: int, rank: int) -> tuple[int, int]:
        """Intra-parameter `[start, end)` on `rank`; `(0, 0)` when it is not there."""
        lo = max(self.start, rank * shard_numel)
        hi = min(self.start + self.numel, (rank + 1) * shard_numel)
        return (lo - self.start, hi - self.start) if lo < hi else (0, 0)


@dataclasses.dataclass(frozen=True, repr=False)
class FSDP1Layout:
    """How `FullyShardedDataParallel` (FSDP1) lays out parameters and optimizer state.

    Every FSDP unit flattens its parameters, in `named_parameters()` order, into one 1-D flat
    parameter. With `use_orig_params=True` each parameter starts on a 16-byte boundary measured
    in `param_dtype` (zero padding before it: 4 elements for float32, 8 for bfloat16) and the
    total is padded to a multiple of `world_size`. Rank `r` holds flat elements
    `[r*c, (r+1)*c)` with `c = ceil(total / world_size)`, zero padded at the end. Its optimizer
    then holds one flat state per unit (`use_orig_params=False`) or one 1-D slice per original
    parameter that intersects its shard, and no state at all for the others (`True`). FSDP1's
    SHARDED state dict cuts each parameter on dim 0 like FSDP2 (`shard_dims` are 0).
    Build it with `famp.fsdp1_layout` or `famp.layout_of`. Equal by content.

    Attributes:
        world_size: number of ranks.
        units: per FSDP unit, its `(fqn, shape)` pairs in flattening order.
        use_orig_params: FSDP1's flag of that name.
        param_dtype: the dtype FSDP1 computes in (`MixedPrecision.param_dtype`, or the
            parameters' dtype without mixed precision); it sets the alignment.
    """

    world_size: int
    units: tuple[tuple[tuple[str, Shape], ...], ...]
    use_orig_params: bool
    param_dtype: torch.dtype

    def __post_init__(self) -> None:
        _check_world_size(self.world_size)
        if not isinstance(self.use_orig_params, bool):
            raise TypeError(f"use_orig_params must be a bool, got {self.use_orig_params!r}")
        if not isinstance(self.param_dtype, torch.dtype):
            raise TypeError(f"param_dtype must be a torch.dtype, got {self.param_dtype!r}")
        if not self.param_dtype.is_floating_point:
            raise ValueError(
                "param_dtype must be a floating dtype (FSDP1 computes in it), got "
                f"{self.param_dtype}"
            )
        for i, unit in enumerate(self.units):
            if not unit:
                raise ValueError(f"FSDP unit {i} has no parameters")
        _check_params(self.fqns, self.shapes)

    @property
    def fqns(self) -> tuple[str, ...]:
        """Parameter names, unit after unit."""
        return tuple(fqn for unit in self.units for fqn, _ in unit)

    @property
    def shapes(self) -> tuple[Shape, ...]:
        """Full shape of each parameter, in the order of `fqns`."""
        return tuple(shape for unit in self.units for _, shape in unit)

    @property
    def shard_dims(self) -> tuple[int, ...]:
        """All 0: FSDP1's SHARDED state dict chunks every parameter on dim 0."""
        return (0,) * len(self.fqns)

    @functools.cached_property
    def _specs(self) -> dict[str, tuple[Shape, int]]:
        return {f: (s, 0) for f, s in zip(self.fqns, self.shapes, strict=True)}

    @functools.cached_property
    def _flat(self) -> tuple[tuple[tuple[FlatSlice, ...], int], ...]:
        """Per unit: its parameters' slices and the shard length `c`."""
        align = _ALIGNMENT_BYTES // self.param_dtype.itemsize if self.use_orig_params else 0
        units = []
        for u, unit in enumerate(self.units):
            total, slices = 0, []
            for fqn, shape in unit:
                if align and total % align:
                    total += align - total % align
                slices.append(FlatSlice(fqn, u, total, math.prod(shape)))
                total += math.prod(shape)
            units.append((tuple(slices), -(-total // self.world_size)))
        return tuple(units)

    @functools.cached_property
    def _slices(self) -> dict[str, FlatSlice]:
        return {s.fqn: s for slices, _ in self._flat for s in slices}

    def local_shape(self, fqn: str, rank: int) -> Shape:
        """Shape of `fqn`'s dim-0 chunk on `rank` in FSDP1's SHARDED state dict."""
        return local_shape(self, fqn, rank)

    def flat_numel(self, unit: int) -> int:
        """Elements of unit `unit`'s flat parameter on each rank (padding included)."""
        return self._flat[check_rank(unit, len(self._flat), "unit")][1]

    def param_slice(self, fqn: str, rank: int) -> tuple[int, int]:
        """`(start, stop)` of `fqn`'s flattened elements in `rank`'s shard; equal if none.

        With `use_orig_params=True` this 1-D slice is the parameter `rank`'s optimizer sees.
        """
        if fqn not in self._slices:
            raise KeyError(f"parameter {fqn!r} is not in the layout")
        check_rank(rank, self.world_size)
        piece = self._slices[fqn]
        return piece.in_shard(self.flat_numel(piece.unit), rank)

    def __repr__(self) -> str:
        units = ", ".join(_repr_params(f"{f!r}: {s}" for f, s in unit) for unit in self.units)
        return (
            f"FSDP1Layout(world_size={self.world_size}, use_orig_params={self.use_orig_params}, "
            f"param_dtype={self.param_dtype}, units=[{units}])"
        )


def local_shape(layout: FSDP1Layout | FSDP2Layout, fqn: str, rank: int) -> Shape:
    """Shape of `fqn`'s dim-`d` chunk on `rank` (shared by both layouts)."""
    if fqn not in layout._specs:
        raise KeyError(f"parameter {fqn!r} is not in the layout")
    check_rank(rank, layout.world_size)
    shape, dim = layout._specs[fqn]
    _, length = chunk_range(shape[dim], layout.world_size, rank)
    return (*shape[:dim], length, *shape[dim + 1 :])


Layout = FSDP1Layout | FSDP2Layout


def check_layout(layout: Any, name: str = "layout") -> Layout:
    """`layout` if it is one, else a TypeError naming what it is."""
    if not isinstance(layout, (FSDP1Layout, FSDP2Layout)):
        raise TypeError(
            f"{name} must be a famp.FSDP1Layout or famp.FSDP2Layout, got {type(layout).__name__}"
        )
    return layout


def specs(layout: Layout) -> dict[str, tuple[Shape, int]]:
    """`{fqn: (full shape, shard dim)}` of every parameter of `layout`, in its order (cached)."""
    return layout._specs


def flat_units(layout: FSDP1Layout) -> tuple[tuple[tuple[FlatSlice, ...], int], ...]:
    """Per FSDP1 unit: its parameters' `FlatSlice`s and the per-rank shard length (cached)."""
    return layout._flat


def flat_slice(layout: FSDP1Layout, fqn: str) -> FlatSlice:
    """Where parameter `fqn` lies in its FSDP1 unit's flat parameter."""
    return layout._slices[fqn]
