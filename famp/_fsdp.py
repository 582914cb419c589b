"""Pure maps between the full FQN-keyed optimizer state and per-rank shards.

The canonical form is the full state dict that FSDP1's FULL ``optim_state_dict`` and
``get_optimizer_state_dict(full_state_dict=True)`` return::

    {"state": {fqn: {"step": 0-d tensor, "exp_avg": tensor of the parameter's shape, ...}},
     "param_groups": [{"lr": ..., ..., "params": [fqn, ...]}, ...]}

A rank's shard is the same dict with every parameter-shaped tensor replaced by the rank's chunk
(what ``get_optimizer_state_dict(model, optim)`` returns under FSDP2, DTensors as local tensors).
0-d tensors and non-tensors are replicated. Any other tensor shape is rejected.

Where copies happen: :func:`shard_optim_state` returns views of the full tensors (dim 0 of a
contiguous tensor) unless ``copy=True``; a shard on another dim is made contiguous, which copies.
:func:`unshard_optim_state` always copies (``torch.cat``). :func:`reshard_optim_state` returns
views of the old shards where a new shard lies inside one old shard, and concatenates otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from famp._fsdp_layout import Layout, check_layout, check_rank, chunk_range, local_shape

__all__ = ["reshard_optim_state", "shard_optim_state", "unshard_optim_state"]

State = dict[str, dict[str, Any]]
Groups = list[dict[str, Any]]
Kinds = dict[tuple[str, str], bool]  # (fqn, state name) -> sharded?


def split_osd(osd: object, what: str) -> tuple[Mapping[Any, Mapping[str, Any]], Sequence[Any]]:
    """``(state, param_groups)`` of an optimizer state dict, or an error naming what is wrong."""
    if not isinstance(osd, Mapping):
        raise TypeError(f"{what} must be an optimizer state dict, got {type(osd).__name__}")
    for key in ("state", "param_groups"):
        if key not in osd:
            raise KeyError(f"{what} has no {key!r} entry")
    state, groups = osd["state"], osd["param_groups"]
    if not isinstance(state, Mapping):
        raise ValueError(f"{what}['state'] must be a dict, got {type(state).__name__}")
    for fqn, entry in state.items():
        if not isinstance(entry, Mapping):
            raise ValueError(f"{what}['state'][{fqn!r}] must be a dict, got {type(entry).__name__}")
    if not isinstance(groups, Sequence) or isinstance(groups, str):
        raise ValueError(f"{what}['param_groups'] must be a list, got {type(groups).__name__}")
    for i, group in enumerate(groups):
        if not isinstance(group, Mapping) or not isinstance(group.get("params"), Sequence):
            raise ValueError(f"{what}['param_groups'][{i}] must be a dict with a 'params' list")
    return state, groups


def check_names(state: Mapping[str, Any], groups: Sequence[Any], layout: Layout, what: str) -> None:
    """Every name is in the layout, in one param group at most, and every state is in a group."""
    group_of: dict[str, int] = {}
    for i, group in enumerate(groups):
        for fqn in group["params"]:
            if fqn not in layout._specs:
                raise KeyError(
                    f"{what}['param_groups'][{i}] names {fqn!r}, which is not in the layout"
                )
            if fqn in group_of:
                raise ValueError(f"parameter {fqn!r} is in param_groups {group_of[fqn]} and {i}")
            group_of[fqn] = i
    for fqn in state:
        if fqn not in layout._specs:
            raise KeyError(f"{what}['state'] has parameter {fqn!r}, which is not in the layout")
        if fqn not in group_of:
            raise ValueError(f"{what}['state'][{fqn!r}] belongs to no param group")


def _check_kind(kinds: Kinds, first: dict[str, str], fqn: str, key: str, sharded: bool) -> None:
    """One state name is parameter-shaped for every parameter or for none (None aside)."""
    other = first.setdefault(key, fqn)
    if other != fqn and kinds[(other, key)] != sharded:
        tensor_fqn, plain_fqn = (fqn, other) if sharded else (other, fqn)
        raise ValueError(
            f"state[{plain_fqn!r}][{key!r}] is not a tensor of the parameter's shape, but "
            f"state[{tensor_fqn!r}][{key!r}] is: a state name must be sharded for every parameter"
        )
    kinds[(fqn, key)] = sharded


def check_full(
    osd: object, layout: Layout, what: str = "full_osd", local_rank: int | None = None
) -> tuple[State, Groups, Kinds]:
    """Validate a full state dict against ``layout``; return its parts and which entries shard.

    With ``local_rank``, a tensor may also be that rank's chunk already (FSDP2 only).
    """
    state, groups = split_osd(osd, what)
    check_names(state, groups, layout, what)
    kinds: Kinds = {}
    first: dict[str, str] = {}
    for fqn, entry in state.items():
        shape = layout._specs[fqn][0]
        for key, value in entry.items():
            if value is None:
                continue
            sharded = isinstance(value, torch.Tensor) and value.dim() > 0
            shapes = (
                [shape] if local_rank is None else [shape, local_shape(layout, fqn, local_rank)]
            )
            if sharded and tuple(value.shape) not in shapes:
                local = "" if local_rank is None else f" or rank {local_rank}'s chunk {shapes[1]}"
                raise ValueError(
                    f"{what}['state'][{fqn!r}][{key!r}] has shape {tuple(value.shape)} but the "
                    f"layout says {fqn!r} is {shape}{local}; only 0-d and parameter-shaped "
                    "tensors are supported"
                )
            _check_kind(kinds, first, fqn, key, sharded)
    return {f: dict(e) for f, e in state.items()}, [dict(g) for g in groups], kinds


def same(a: object, b: object) -> bool:
    """Equal values, tensors bit for bit (dtype and shape included), containers recursively."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and (a.dtype, a.shape) == (b.dtype, b.shape)
            and bool(torch.equal(a, b))
        )
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and bool(a == b)


def clone_value(value: Any, copy: bool) -> Any:
    """``value.clone()`` for a tensor when ``copy``, else ``value``."""
    return value.clone() if copy and isinstance(value, torch.Tensor) else value


def copy_groups(groups: Sequence[Mapping[str, Any]], copy: bool) -> Groups:
    """New param-group dicts (new ``params`` lists; tensors cloned when ``copy``)."""
    return [
        {k: list(v) if k == "params" else clone_value(v, copy) for k, v in group.items()}
        for group in groups
    ]


def narrow(tensor: torch.Tensor, dim: int, start: int, length: int, copy: bool) -> torch.Tensor:
    """A contiguous chunk of ``tensor``: a view where possible, a compact copy when ``copy``."""
    piece = tensor.narrow(dim, start, length)
    return piece.clone(memory_format=torch.contiguous_format) if copy else piece.contiguous()


def shard_optim_state(
    full_osd: Mapping[str, Any], layout: Layout, rank: int, *, copy: bool = False
) -> dict[str, Any]:
    """One rank's piece of a full FQN-keyed optimizer state dict.

    Every tensor of its parameter's shape becomes the rank's chunk along the layout's shard dim
    (``torch.chunk``; possibly ``(0, *rest)``); 0-d tensors (``step``) and non-tensors are shared;
    ``param_groups`` are copied. Under FSDP2 this equals ``get_optimizer_state_dict(model, optim)``
    on ``rank`` with every DTensor replaced by its local tensor; under FSDP1 it is the SHARDED
    state dict's per-parameter chunks. Parameters without state stay without state.

    Args:
        full_osd: ``{"state": {fqn: {...}}, "param_groups": [...]}``, full tensors.
        layout: a :class:`famp.FSDP2Layout` or :class:`famp.FSDP1Layout`.
        rank: the rank whose shard to return.
        copy: clone every tensor, so that the shard keeps no reference to ``full_osd``'s storage
            (PyTorch #116553). By default shards on dim 0 are views.

    Returns:
        The rank's state dict, FQN-keyed, with the structure of ``full_osd``.

    Raises:
        KeyError: a name that is not in the layout, or a missing ``state``/``param_groups`` entry.
        ValueError: a rank outside the world, a tensor whose shape disagrees with the layout, a
            state name that is a tensor for one parameter and not for another, a parameter in two
            param groups or in none.

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
    state, groups, kinds = check_full(full_osd, layout)
    out: State = {}
    for fqn, entry in state.items():
        shape, dim = layout._specs[fqn]
        start, length = chunk_range(shape[dim], layout.world_size, rank)
        out[fqn] = {
            key: narrow(value, dim, start, length, copy)
            if kinds.get((fqn, key))
            else clone_value(value, copy)
            for key, value in entry.items()
        }
    return {"state": out, "param_groups": copy_groups(groups, copy)}


def _check_shards(shards: object, layout: Layout, what: str) -> tuple[list[State], Groups, Kinds]:
    """Validate one local state dict per rank; return their states, rank 0's groups, and kinds."""
    if not isinstance(shards, Sequence) or isinstance(shards, (str, Mapping)):
        raise TypeError(
            f"{what} must be a list of per-rank state dicts, got {type(shards).__name__}"
        )
    if len(shards) != layout.world_size:
        raise ValueError(
            f"{what} has {len(shards)} state dicts but the layout has world_size "
            f"{layout.world_size}: one per rank is needed"
        )
    parts = [split_osd(s, f"{what}[{r}]") for r, s in enumerate(shards)]
    states = [{f: dict(e) for f, e in state.items()} for state, _ in parts]
    groups = [dict(g) for g in parts[0][1]]
    check_names(states[0], groups, layout, f"{what}[0]")
    for r, (state, rank_groups) in enumerate(parts[1:], 1):
        if not same(list(rank_groups), groups):
            raise ValueError(f"{what}[{r}]['param_groups'] differs from {what}[0]['param_groups']")
        for fqn in set(state) ^ set(states[0]):
            has, lacks = (r, 0) if fqn in state else (0, r)
            if fqn not in layout._specs:
                raise KeyError(f"{what}[{has}]['state'] has parameter {fqn!r}, not in the layout")
            raise ValueError(f"parameter {fqn!r} has state on rank {has} but not on rank {lacks}")
    kinds: Kinds = {}
    first: dict[str, str] = {}
    for fqn, entry in states[0].items():
        for r, state in enumerate(states[1:], 1):
            if state[fqn].keys() != entry.keys():
                raise ValueError(
                    f"state[{fqn!r}] has keys {sorted(state[fqn])} on rank {r} but "
                    f"{sorted(entry)} on rank 0"
                )
        for key, value in entry.items():
            sharded = isinstance(value, torch.Tensor) and value.dim() > 0
            for r, state in enumerate(states):
                _check_shard_value(state[fqn][key], value, sharded, layout, fqn, key, r, what)
            if value is not None:
                _check_kind(kinds, first, fqn, key, sharded)
    return states, groups, kinds


def _check_shard_value(
    value: Any, first: Any, sharded: bool, layout: Layout, fqn: str, key: str, r: int, what: str
) -> None:
    where = f"{what}[{r}]['state'][{fqn!r}][{key!r}]"
    if not sharded:
        if not same(value, first):
            raise ValueError(
                f"{where} = {value!r} differs from rank 0's {first!r}; 0-d tensors "
                "and non-tensors must be replicated"
            )
        return
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{where} is a {type(value).__name__}, but rank 0 holds a tensor shard")
    expected = local_shape(layout, fqn, r)
    if tuple(value.shape) != expected:
        raise ValueError(
            f"{where} has shape {tuple(value.shape)}, but the layout gives rank {r} the chunk "
            f"{expected} of {fqn!r} {layout._specs[fqn][0]}"
        )
    if value.dtype != first.dtype:
        raise ValueError(f"{where} is {value.dtype} but rank 0's is {first.dtype}")


def unshard_optim_state(shards: Sequence[Mapping[str, Any]], layout: Layout) -> dict[str, Any]:
    """The full FQN-keyed optimizer state dict from every rank's shard: the inverse of sharding.

    Tensor shards are concatenated along the layout's shard dim (a copy); 0-d tensors and
    non-tensors must be equal on every rank and are taken from rank 0 (0-d tensors cloned).

    Args:
        shards: one FQN-keyed local state dict per rank, in rank order (e.g. each rank's
            ``get_optimizer_state_dict(model, optim)`` with DTensors as local tensors).
        layout: the layout the shards were taken with.

    Returns:
        The full state dict, equal to ``get_optimizer_state_dict(model, optim,
        options=StateDictOptions(full_state_dict=True))``.

    Raises:
        KeyError: a name that is not in the layout.
        ValueError: a missing or extra shard, a shard of the wrong shape or dtype, parameters or
            state names or ``param_groups`` that differ between ranks, replicated values that
            differ, non-tensor state where other ranks hold tensors.
        TypeError: ``shards`` is not a list.

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
    states, groups, kinds = _check_shards(shards, layout, "shards")
    out: State = {}
    for fqn, entry in states[0].items():
        dim = layout._specs[fqn][1]
        out[fqn] = {
            key: torch.cat([s[fqn][key] for s in states], dim)
            if kinds.get((fqn, key))
            else clone_value(value, True)
            for key, value in entry.items()
        }
    return {"state": out, "param_groups": copy_groups(groups, False)}


def _new_chunks(
    pieces: list[torch.Tensor], old: Layout, new: Layout, fqn: str, copy: bool
) -> list[torch.Tensor]:
    """One parameter's state tensor moved from ``old``'s chunks to ``new``'s, one per new rank."""
    shape, old_dim = old._specs[fqn]
    new_dim = new._specs[fqn][1]
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


def reshard_optim_state(
    shards: Sequence[Mapping[str, Any]],
    old_layout: Layout,
    new_layout: Layout,
    *,
    copy: bool = False,
) -> list[dict[str, Any]]:
    """Move every rank's shard from one layout to another without gathering the full state.

    Equal to ``[shard_optim_state(unshard_optim_state(shards, old_layout), new_layout, r) for r in
    range(new_layout.world_size)]``, but each new chunk is cut from the old chunks it overlaps:
    a view when it lies inside one old chunk, a concatenation of the overlapping pieces otherwise.
    Only a parameter whose shard dim changes is gathered, one at a time. Layouts may be of
    different kinds (FSDP1's SHARDED form and FSDP2 share the per-parameter chunking).

    Args:
        shards: one FQN-keyed local state dict per old rank, in rank order.
        old_layout: the layout of ``shards``.
        new_layout: the target layout: same parameter names and shapes, any world size.
        copy: clone views too, so no new shard keeps an old shard's storage alive.

    Returns:
        A list of ``new_layout.world_size`` FQN-keyed local state dicts.

    Raises:
        KeyError: a name that is not in the layouts.
        ValueError: layouts with different parameters or shapes, and everything
            :func:`famp.unshard_optim_state` rejects.

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
    old_shapes = {f: s for f, (s, _) in old_layout._specs.items()}
    new_shapes = {f: s for f, (s, _) in new_layout._specs.items()}
    if old_shapes != new_shapes:
        for fqn in [*old_shapes, *new_shapes]:
            if old_shapes.get(fqn) != new_shapes.get(fqn):
                raise ValueError(
                    f"old_layout and new_layout disagree on {fqn!r}: {old_shapes.get(fqn)} vs "
                    f"{new_shapes.get(fqn)} (None: absent)"
                )
    states, groups, kinds = _check_shards(shards, old_layout, "shards")
    outs: list[State] = [{} for _ in range(new_layout.world_size)]
    for fqn, entry in states[0].items():
        for out in outs:
            out[fqn] = {}
        for key, value in entry.items():
            if kinds.get((fqn, key)):
                pieces = [s[fqn][key] for s in states]
                chunks = _new_chunks(pieces, old_layout, new_layout, fqn, copy)
            else:
                chunks = [clone_value(value, copy) for _ in outs]
            for out, chunk in zip(outs, chunks, strict=True):
                out[fqn][key] = chunk
    return [{"state": out, "param_groups": copy_groups(groups, copy)} for out in outs]


for _fn in (shard_optim_state, unshard_optim_state, reshard_optim_state):
    _fn.__module__ = "famp"
