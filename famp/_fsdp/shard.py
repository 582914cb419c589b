"""Pure maps between the full FQN-keyed optimizer state and per-rank shards.

The canonical form is the full state dict that FSDP1's FULL `optim_state_dict` and
`get_optimizer_state_dict(full_state_dict=True)` return::

    {"state": {fqn: {"step": 0-d tensor, "exp_avg": tensor of the parameter's shape, ...}},
     "param_groups": [{"lr": ..., ..., "params": [fqn, ...]}, ...]}

A rank's shard is the same dict with every parameter-shaped tensor replaced by the rank's chunk
(what `get_optimizer_state_dict(model, optim)` returns under FSDP2, DTensors as local tensors),
also inside dicts, lists and tuples, as torch's own functions go into them (FSDP1 has no such
nested state, and FSDP1 layouts refuse it). 0-d tensors and non-tensors are replicated. Any
other tensor shape is rejected.

Where copies happen: `shard_optim_state` returns views of the full tensors (dim 0 of a
contiguous tensor) unless `copy=True`; a shard on another dim is made contiguous, which copies.
`unshard_optim_state` always copies (`torch.cat`). `reshard_optim_state` returns
views of the old shards where a new shard lies inside one old shard, and concatenates otherwise.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from famp._collectives import check_mesh, shard_as_dtensor
from famp._fsdp.layout import (
    FSDP2Layout,
    Layout,
    check_layout,
    check_rank,
    chunk_range,
    specs,
)
from famp._fsdp.osd import (
    Groups,
    Path,
    State,
    check_full,
    check_shards,
    is_sharded,
    map_leaves,
    refuse_nested_fsdp1,
)


def clone_value(value: Any, copy: bool) -> Any:
    """`value.clone()` for a tensor when `copy`, else `value`."""
    return value.clone() if copy and isinstance(value, torch.Tensor) else value


def copy_groups(groups: Sequence[Mapping[str, Any]], copy: bool) -> Groups:
    """New param-group dicts (new `params` lists; tensors cloned when `copy`)."""
    return [
        {k: list(v) if k == "params" else clone_value(v, copy) for k, v in group.items()}
        for group in groups
    ]


def narrow(tensor: torch.Tensor, dim: int, start: int, length: int, copy: bool) -> torch.Tensor:
    """A contiguous chunk of `tensor`: a view where possible, a compact copy when `copy`."""
    piece = tensor.narrow(dim, start, length)
    return piece.clone(memory_format=torch.contiguous_format) if copy else piece.contiguous()


def _cut(
    _: Path, leaves: list[Any], shape: Any, dim: int, span: tuple[int, int], copy: bool, mesh: Any
) -> Any:
    """A full state leaf on one rank: its chunk (a DTensor on `mesh`) if it is sharded."""
    if not is_sharded(leaves[0]):
        return clone_value(leaves[0], copy)
    piece = narrow(leaves[0], dim, *span, copy)
    return piece if mesh is None else shard_as_dtensor(piece, mesh, dim, shape)


def _join(_: Path, leaves: list[Any], dim: int) -> Any:
    """Every rank's value of one leaf, as one full value."""
    return torch.cat(leaves, dim) if is_sharded(leaves[0]) else clone_value(leaves[0], True)


def shard_optim_state(
    full_osd: Mapping[str, Any],
    layout: Layout,
    rank: int,
    *,
    copy: bool = False,
    mesh: Any = None,
) -> dict[str, Any]:
    """One rank's piece of a full FQN-keyed optimizer state dict.

    Every tensor of its parameter's shape becomes the rank's chunk along the layout's shard dim
    (`torch.chunk`; possibly `(0, *rest)`); 0-d tensors (`step`) and non-tensors are shared;
    `param_groups` are copied. Under FSDP2 this equals `get_optimizer_state_dict(model, optim)`
    on `rank` with every DTensor replaced by its local tensor, and with `mesh` (FSDP2's 1-d
    device mesh) it is that dict itself: the chunks are wrapped as `DTensor`s placed
    `Shard(dim)` on the mesh with the parameter's global shape (no collective runs), ready for
    `set_optimizer_state_dict(model, optim, shard)` on that rank. Under FSDP1 it is the SHARDED
    state dict's per-parameter chunks. Parameters without state stay without state.

    Args:
        full_osd: `{"state": {fqn: {...}}, "param_groups": [...]}`, full tensors.
        layout: a `famp.FSDP2Layout` or `famp.FSDP1Layout`.
        rank: the rank whose shard to return.
        copy: clone every tensor, so that the shard keeps no reference to `full_osd`'s storage
            (PyTorch #116553). By default shards on dim 0 are views.
        mesh: FSDP2 only: a 1-d `torch.distributed.DeviceMesh` of the layout's world size on
            which this process is `rank`; the sharded tensors come back as DTensors on it.

    Returns:
        The rank's state dict, FQN-keyed, with the structure of `full_osd`.

    Raises:
        KeyError: a name that is not in the layout, or a missing `state`/`param_groups` entry.
        ValueError: a rank outside the world, a tensor whose shape disagrees with the layout, a
            state name that is a tensor for one parameter and not for another, a parameter in two
            param groups or in none; `mesh` with an FSDP1 layout, of another size or shape, or
            on which this process is not `rank`.
        TypeError: `layout` is not a layout, `rank` is not an int, a state tensor is sparse
            (not `torch.strided`) or a DTensor, or `mesh` is not a `DeviceMesh`.

    Examples:
        >>> import famp, torch
        >>> layout = famp.fsdp2_layout({"w": (3, 2)}, world_size=2)
        >>> full = {"state": {"w": {"step": torch.tensor(1.0), "exp_avg": torch.ones(3, 2)}},
        ...         "param_groups": [{"lr": 0.1, "params": ["w"]}]}
        >>> famp.shard_optim_state(full, layout, rank=1)["state"]["w"]["exp_avg"].shape
        torch.Size([1, 2])
    """
    layout = check_layout(layout)
    check_rank(rank, layout.world_size)
    state, groups, _ = check_full(full_osd, layout)
    if mesh is not None:
        if not isinstance(layout, FSDP2Layout):
            raise ValueError("mesh applies to FSDP2 layouts only, got a famp.FSDP1Layout")
        mesh = check_mesh(mesh, layout.world_size, rank)
    out: State = {}
    for fqn, entry in state.items():
        shape, dim = specs(layout)[fqn]
        start, length = chunk_range(shape[dim], layout.world_size, rank)

        cut = functools.partial(
            _cut, shape=shape, dim=dim, span=(start, length), copy=copy, mesh=mesh
        )
        out[fqn] = {key: map_leaves([value], cut, (key,)) for key, value in entry.items()}
    return {"state": out, "param_groups": copy_groups(groups, copy)}


def unshard_optim_state(shards: Sequence[Mapping[str, Any]], layout: Layout) -> dict[str, Any]:
    """The full FQN-keyed optimizer state dict from every rank's shard: the inverse of sharding.

    Tensor shards are concatenated along the layout's shard dim (a copy); 0-d tensors and
    non-tensors must be equal on every rank and are taken from rank 0 (0-d tensors cloned).

    Args:
        shards: one FQN-keyed local state dict per rank, in rank order (e.g. each rank's
            `get_optimizer_state_dict(model, optim)` with DTensors as local tensors).
        layout: the layout the shards were taken with.

    Returns:
        The full state dict, equal to what `get_optimizer_state_dict` returns with
            `StateDictOptions(full_state_dict=True)`.

    Raises:
        KeyError: a name that is not in the layout.
        ValueError: a missing or extra shard, a shard of the wrong shape or dtype, a tensor on
            another device than rank 0's, parameters or state names or `param_groups` that
            differ between ranks, replicated values that differ, non-tensor state where other
            ranks hold tensors.
        TypeError: `shards` is not a list, or a state tensor is sparse or a DTensor.

    Examples:
        >>> import famp, torch
        >>> layout = famp.fsdp2_layout({"w": (3,)}, world_size=2)
        >>> groups = [{"lr": 0.1, "params": ["w"]}]
        >>> shards = [{"state": {"w": {"m": torch.tensor([1.0, 2.0])}}, "param_groups": groups},
        ...           {"state": {"w": {"m": torch.tensor([3.0])}}, "param_groups": groups}]
        >>> famp.unshard_optim_state(shards, layout)["state"]["w"]["m"]
        tensor([1., 2., 3.])
    """
    layout = check_layout(layout)
    states, groups, _ = check_shards(shards, layout, "shards")
    out: State = {}
    for fqn, entry in states[0].items():
        dim = specs(layout)[fqn][1]

        join = functools.partial(_join, dim=dim)
        out[fqn] = {key: map_leaves([s[fqn][key] for s in states], join, (key,)) for key in entry}
    return {"state": out, "param_groups": copy_groups(groups, False)}


def _new_chunks(
    pieces: list[torch.Tensor], old: Layout, new: Layout, fqn: str, copy: bool
) -> list[torch.Tensor]:
    """One parameter's state tensor moved from `old`'s chunks to `new`'s, one per new rank."""
    shape, old_dim = specs(old)[fqn]
    new_dim = specs(new)[fqn][1]
    size = shape[new_dim]
    if old_dim != new_dim:  # only this parameter is gathered
        full = torch.cat(pieces, old_dim)
        return [
            narrow(full, new_dim, *chunk_range(size, new.world_size, r), copy)
            for r in range(new.world_size)
        ]
    old_ranges = [chunk_range(size, old.world_size, r) for r in range(old.world_size)]
    chunks = []
    for r in range(new.world_size):
        start, length = chunk_range(size, new.world_size, r)
        parts = []
        for piece, (o_start, o_len) in zip(pieces, old_ranges, strict=True):
            lo, hi = max(start, o_start), min(start + length, o_start + o_len)
            if lo < hi:
                parts.append((piece, lo - o_start, hi - lo))
        if len(parts) > 1:
            chunks.append(torch.cat([p.narrow(new_dim, s, n) for p, s, n in parts], new_dim))
        else:
            piece, s, n = parts[0] if parts else (pieces[0], 0, 0)
            chunks.append(narrow(piece, new_dim, s, n, copy))
    return chunks


def _move(
    cuts: dict[Path, list[Any]],
    layouts: tuple[Layout, Layout],
    fqn: str,
    copy: bool,
    path: Path,
    leaves: list[Any],
) -> None:
    """Record in `cuts` the new ranks' values of one leaf from the old ranks' `leaves`."""
    if is_sharded(leaves[0]):
        cuts[path] = _new_chunks(leaves, *layouts, fqn, copy)
    else:
        cuts[path] = [clone_value(leaves[0], copy) for _ in range(layouts[1].world_size)]


def _pick(cuts: dict[Path, list[Any]], rank: int, path: Path, _: list[Any]) -> Any:
    return cuts[path][rank]


def reshard_optim_state(
    shards: Sequence[Mapping[str, Any]],
    old_layout: Layout,
    new_layout: Layout,
    *,
    copy: bool = False,
) -> list[dict[str, Any]]:
    """Move every rank's shard from one layout to another without gathering the full state.

    Equal to `[shard_optim_state(unshard_optim_state(shards, old_layout), new_layout, r) for r in
    range(new_layout.world_size)]`, but each new chunk is cut from the old chunks it overlaps:
    a view when it lies inside one old chunk, a concatenation of the overlapping pieces otherwise.
    Only a parameter whose shard dim changes is gathered, one at a time. Layouts may be of
    different kinds (FSDP1's SHARDED form and FSDP2 share the per-parameter chunking).

    Args:
        shards: one FQN-keyed local state dict per old rank, in rank order.
        old_layout: the layout of `shards`.
        new_layout: the target layout: same parameter names and shapes, any world size.
        copy: clone views too, so no new shard keeps an old shard's storage alive.

    Returns:
        A list of `new_layout.world_size` FQN-keyed local state dicts.

    Raises:
        KeyError: a name that is not in the layouts.
        ValueError: layouts with different parameters or shapes, and everything
            `famp.unshard_optim_state` rejects.
        TypeError: what `famp.unshard_optim_state` refuses as a TypeError.

    Examples:
        >>> import famp, torch
        >>> full = {"state": {"w": {"m": torch.arange(5.0)}}, "param_groups": [{"params": ["w"]}]}
        >>> old, new = famp.fsdp2_layout({"w": (5,)}, 2), famp.fsdp2_layout({"w": (5,)}, 4)
        >>> shards = [famp.shard_optim_state(full, old, r) for r in range(2)]
        >>> [s["state"]["w"]["m"].tolist() for s in famp.reshard_optim_state(shards, old, new)]
        [[0.0, 1.0], [2.0, 3.0], [4.0], []]
    """
    old_layout = check_layout(old_layout, "old_layout")
    new_layout = check_layout(new_layout, "new_layout")
    old_shapes = {f: s for f, (s, _) in specs(old_layout).items()}
    new_shapes = {f: s for f, (s, _) in specs(new_layout).items()}
    if old_shapes != new_shapes:
        for fqn in [*old_shapes, *new_shapes]:
            if old_shapes.get(fqn) != new_shapes.get(fqn):
                raise ValueError(
                    f"old_layout and new_layout disagree on {fqn!r}: {old_shapes.get(fqn)} vs "
                    f"{new_shapes.get(fqn)} (None: absent)"
                )
    states, groups, _ = check_shards(shards, old_layout, "shards")
    refuse_nested_fsdp1(states[0], new_layout, "shards[0]")
    outs: list[State] = [{} for _ in range(new_layout.world_size)]
    for fqn, entry in states[0].items():
        for key in entry:
            values = [s[fqn][key] for s in states]
            cuts: dict[Path, list[Any]] = {}  # each leaf's new chunks, cut once for all ranks
            move = functools.partial(_move, cuts, (old_layout, new_layout), fqn, copy)
            map_leaves(values, move, (key,))
            for r, out in enumerate(outs):
                pick = functools.partial(_pick, cuts, r)
                out.setdefault(fqn, {})[key] = map_leaves(values, pick, (key,))
    return [{"state": out, "param_groups": copy_groups(groups, copy)} for out in outs]
