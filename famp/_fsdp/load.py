"""What a rank's optimizer holds in memory under FSDP1 or FSDP2, from the full FQN-keyed state.

FSDP1 keeps one flat parameter per unit; its optimizer holds either one flat state per unit
(`use_orig_params=False`) or a 1-D slice of every original parameter that intersects the rank's
shard (`True`). This module computes those slices without a process group, equal to
`FullyShardedDataParallel.optim_state_dict_to_load`. Only the rank's slices are built: the full
flat state is never concatenated.

Where copies happen: by default every tensor of the result owns its memory, as FSDP1's own result
does. `optimizer.load_state_dict` keeps the tensors it is given and the optimizer then updates
them in place, so views would write through to `osd` and keep its full storage alive for the
whole run (PyTorch #116553). `copy=False` returns views where the layout allows (FSDP2 chunks on
dim 0, `use_orig_params=True` slices), for read-only use.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from famp._collectives import dtensor_like, is_dtensor
from famp._fsdp.layout import (
    FlatSlice,
    FSDP1Layout,
    FSDP2Layout,
    Shape,
    check_layout,
    check_rank,
    chunk_range,
    flat_slice,
    flat_units,
    specs,
)
from famp._fsdp.load_ids import optimizer_ids
from famp._fsdp.osd import Kinds, Path, State, check_full, is_sharded, map_leaves
from famp._fsdp.same import same
from famp._fsdp.shard import clone_value, copy_groups, narrow


def _orig_param_state(
    entry: Mapping[str, Any], fqn: str, layout: FSDP1Layout, rank: int, kinds: Kinds, copy: bool
) -> dict[str, Any] | None:
    if layout.world_size == 1:  # FSDP1 runs NO_SHARD: the optimizer sees the original parameters
        return {k: clone_value(v, copy) for k, v in entry.items()}
    start, end = layout.param_slice(fqn, rank)
    if start == end:
        return None  # FSDP1 keeps no state for a parameter outside the rank's shard
    return {
        k: narrow(v.reshape(-1), 0, start, end - start, copy)
        if kinds.get((fqn, (k,)))
        else clone_value(v, copy)
        for k, v in entry.items()
    }


def _flat_state(
    state: State, unit: int, layout: FSDP1Layout, rank: int, kinds: Kinds, copy: bool
) -> dict[str, Any]:
    """The rank's flat state of one FSDP1 unit (`use_orig_params=False`) that has state."""
    slices, numel = flat_units(layout)[unit]
    have = [s.fqn for s in slices if s.fqn in state]
    names = list(state[have[0]])
    for fqn in have[1:]:
        if set(state[fqn]) != set(names):
            raise ValueError(
                f"state[{fqn!r}] has keys {sorted(state[fqn])} but state[{have[0]!r}] has "
                f"{sorted(names)}; one FSDP unit's parameters need the same state names"
            )
    out: dict[str, Any] = {}
    for key in names:
        values = [state[f][key] for f in have]
        present = [v for v in values if v is not None]
        if not present:
            out[key] = None
        elif kinds.get((have[0], (key,))):
            for fqn, v in zip(have, values, strict=True):
                if v is not None and v.dtype != present[0].dtype:
                    raise ValueError(
                        f"state[{fqn!r}][{key!r}] is {v.dtype} but FSDP unit {unit} flattens "
                        f"{present[0].dtype} for {have[0]!r}: one flat state has one dtype"
                    )
            out[key] = _flat_tensor(state, slices, numel, rank, key, present[0], copy)
        else:
            for fqn, v in zip(have, values, strict=True):
                if len(have) < len(slices) or not same(v, values[0]):
                    missing = [s.fqn for s in slices if s.fqn not in state]
                    raise ValueError(
                        f"state[{fqn!r}][{key!r}] = {v!r}: FSDP unit {unit} needs the same 0-d "
                        f"or non-tensor {key!r} for all of its parameters (got "
                        f"{values[0]!r} for {have[0]!r}; missing for {missing})"
                    )
            out[key] = clone_value(values[0], copy)
    return out


def _flat_tensor(
    state: State,
    slices: Sequence[FlatSlice],
    numel: int,
    rank: int,
    key: str,
    like: torch.Tensor,
    copy: bool,
) -> torch.Tensor:
    """Concatenate the rank's part of every parameter's state, zeros for missing and padding."""
    pieces = []
    for s in slices:
        start, end = s.in_shard(numel, rank)
        if start == end:
            continue
        value = state.get(s.fqn, {}).get(key)
        if value is None:  # FSDP1 fills a parameter without this state with zeros
            pieces.append(like.new_zeros(end - start))
            continue
        pieces.append(value.reshape(-1)[start:end])
    filled = sum(p.numel() for p in pieces)
    if filled < numel:  # padding at the end of the flat parameter
        pieces.append(like.new_zeros(numel - filled))
    return torch.cat(pieces) if len(pieces) > 1 else narrow(pieces[0], 0, 0, numel, copy)


def _chunk(
    value: torch.Tensor, shape: Shape, dim: int, start: int, length: int, copy: bool
) -> torch.Tensor:
    """The rank's chunk of a full tensor, or the tensor itself when it is that chunk already."""
    if tuple(value.shape) == shape:
        return narrow(value, dim, start, length, copy)
    return value.clone() if copy else value


def _wrap_like(value: torch.Tensor, param: torch.Tensor | None) -> torch.Tensor:
    """A local chunk as a DTensor placed like the FSDP2 parameter `param`, if it is one."""
    return value if param is None or not is_dtensor(param) else dtensor_like(param, value)


def _cut(
    _: Path, leaves: list[Any], at: tuple[Shape, int, int, int], param: Any, copy: bool
) -> Any:
    """A state leaf as FSDP2 holds it on one rank: its chunk, a DTensor like `param`."""
    if not is_sharded(leaves[0]):
        return clone_value(leaves[0], copy)
    return _wrap_like(_chunk(leaves[0], *at, copy), param)


def optim_state_dict_to_load(
    osd: Mapping[str, Any],
    layout: FSDP1Layout | FSDP2Layout,
    rank: int,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    model: torch.nn.Module | None = None,
    copy: bool = True,
) -> dict[str, Any]:
    """The int-keyed state dict that `rank`'s optimizer holds, ready for `load_state_dict`.

    Under FSDP1 this equals `FullyShardedDataParallel.optim_state_dict_to_load` on `rank`:
    one flat state per unit (`use_orig_params=False`; parameters without state are zeros there,
    as FSDP1 fills them) or one 1-D slice per original parameter that intersects the rank's
    shard (`use_orig_params=True`; no entry for the others; at world size 1, where FSDP1
    switches to `NO_SHARD`, the original shapes). Under FSDP2 it is the rank's chunk
    of every parameter, as DTensors placed like the optimizer's parameters when they are DTensors.

    Ids follow the optimizer. With `model`, each name of `osd` goes to the optimizer's parameter
    of that name in `model.named_parameters()` (matched by identity; FSDP1 flat parameters by
    their unit), as torch matches them (DCP's `set_optimizer_state_dict`, FSDP1's
    `optim_state_dict_to_load`): the optimizer may list its parameters in any order, and the
    i-th group of `osd` must hold the parameters of the optimizer's i-th group. Without
    `model`, the i-th group of `osd` must list the optimizer's i-th group in the same order
    (FSDP1 without `use_orig_params`: its units, in the order of their first parameter); only
    shapes can check that, so two parameters of one group that look the same to the optimizer
    (same shape) are refused: pass `model` to load them. Without `optimizer`, ids follow the
    order of `osd`'s groups. With `optimizer`, what it holds is checked before anything is
    built: FSDP2 DTensor parameters' mesh, rank, placement and global and local shapes; plain
    parameters' local shapes.

    Args:
        osd: the full FQN-keyed optimizer state dict (`{"state": ..., "param_groups": ...}`);
            under FSDP2 also the rank's own shard (`famp.shard_optim_state`'s result, or
            one file of a per-rank checkpoint), so a rank never needs the full state.
        layout: the rank's `famp.FSDP1Layout` or `famp.FSDP2Layout`.
        rank: the rank to load.
        optimizer: the rank's optimizer, to check the ids and shapes against (and for FSDP2, to
            place DTensors); `None` numbers parameters by their order in `osd`'s groups.
        model: the wrapped model whose parameters the optimizer updates, to match `osd`'s
            names to the optimizer's parameters by name, as torch does (needs `optimizer`).
        copy: return tensors that own their memory (the default, as FSDP1 does), so that the
            optimizer's in-place updates neither write into `osd` nor keep its full tensors
            alive (PyTorch #116553). `False` returns views where possible, for read-only use.

    Returns:
        `{"state": {id: {...}}, "param_groups": [{..., "params": [id, ...]}]}`.

    Raises:
        KeyError: a name that is not in the layout.
        ValueError: everything `famp.shard_optim_state` rejects, a rank outside the world,
            an optimizer whose groups or parameter shapes disagree with `osd`, two parameters
            of one group that the optimizer shows alike without `model`, a name that `model`
            gives to no parameter of the optimizer's matching group, an FSDP2
            DTensor parameter on a mesh of another world size, of another rank, placed other
            than `Shard(dim)` with the layout's dim or of other global or local shape, an
            FSDP1 unit whose parameters have differing state names or values. The message names
            the parameter; nothing is built.
        TypeError: `layout` is not a layout (or is an FSDP1 layout for DTensor parameters),
            `rank` is not an int, `optimizer` has no `param_groups` list, `model` is not a
            module, or a state tensor is sparse or a DTensor (famp runs no collective: pass
            its `.to_local()` chunk).

    Examples:
        >>> import famp, torch
        >>> layout = famp.fsdp1_layout([{"w": (3, 2), "b": (3,)}], 2, use_orig_params=False)
        >>> osd = {"state": {n: {"step": torch.tensor(1.0), "m": torch.ones(s)}
        ...                  for n, s in [("w", (3, 2)), ("b", (3,))]},
        ...        "param_groups": [{"lr": 0.1, "params": ["w", "b"]}]}
        >>> famp.optim_state_dict_to_load(osd, layout, rank=1)["state"][0]["m"]
        tensor([1., 1., 1., 1., 0.])
    """
    layout = check_layout(layout)
    check_rank(rank, layout.world_size)
    local_rank = rank if isinstance(layout, FSDP2Layout) else None
    state, groups, kinds = check_full(osd, layout, "osd", local_rank)
    key_of, group_keys, params = optimizer_ids(groups, layout, rank, optimizer, model)
    out: dict[int, dict[str, Any]] = {}
    if isinstance(layout, FSDP2Layout):
        for fqn, entry in state.items():
            shape, dim = specs(layout)[fqn]
            start, length = chunk_range(shape[dim], layout.world_size, rank)
            cut = functools.partial(
                _cut, at=(shape, dim, start, length), param=params[key_of[fqn]], copy=copy
            )
            out[key_of[fqn]] = {k: map_leaves([v], cut, (k,)) for k, v in entry.items()}
    elif layout.use_orig_params:
        for fqn, entry in state.items():
            local = _orig_param_state(entry, fqn, layout, rank, kinds, copy)
            if local is not None:
                out[key_of[fqn]] = local
    else:
        for fqn in state:
            unit = flat_slice(layout, fqn).unit
            if key_of[fqn] not in out:
                out[key_of[fqn]] = _flat_state(state, unit, layout, rank, kinds, copy)
    param_groups = copy_groups(groups, copy)
    for group, keys in zip(param_groups, group_keys, strict=True):
        group["params"] = keys
    return {"state": dict(sorted(out.items())), "param_groups": param_groups}
