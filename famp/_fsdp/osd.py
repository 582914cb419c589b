"""Optimizer state dicts checked against a layout: their parts, which entries shard, and errors.

A state value may hold tensors inside dicts, lists and tuples, at any depth, as torch's
`get_optimizer_state_dict` and `set_optimizer_state_dict` go into them: every tensor leaf is
sharded or replicated by the same rule as a top-level one (`map_leaves`). Every check runs before
any output is built, and every error names the parameter and the key path.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from famp._collectives import is_dtensor
from famp._fsdp.layout import FSDP1Layout, Layout, local_shape, specs
from famp._fsdp.same import same

State = dict[str, dict[str, Any]]
Groups = list[dict[str, Any]]
Path = tuple[Any, ...]  # a state name, then the dict keys and list indices inside its value
Kinds = dict[tuple[str, Path], bool]  # (fqn, key path) -> sharded?


def is_sharded(value: object) -> bool:
    """Whether a (checked) state leaf is a tensor of its parameter's shape or a chunk of one."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


def map_leaves(values: Sequence[Any], fn: Callable[[Path, list[Any]], Any], path: Path) -> Any:
    """`values[0]` rebuilt (dicts as dicts, lists and tuples as such) with `fn(path, leaves)` at
    each leaf, `leaves` the value at that path in every one of `values` (ranks' shards); where
    they differ in structure, that point is a leaf. Dicts, lists and tuples are what torch's
    state dict functions go into (`_iterate_state_dict`)."""
    first = values[0]
    if isinstance(first, (Mapping, list, tuple)) and not first:
        return fn(path, list(values))  # an empty container is a leaf: compared, not walked
    if isinstance(first, Mapping) and all(
        isinstance(v, Mapping) and v.keys() == first.keys() for v in values
    ):
        return {k: map_leaves([v[k] for v in values], fn, (*path, k)) for k in first}
    if isinstance(first, (list, tuple)) and all(
        isinstance(v, type(first)) and len(v) == len(first) for v in values
    ):
        items = [map_leaves([v[i] for v in values], fn, (*path, i)) for i in range(len(first))]
        return items if isinstance(first, list) else tuple(items)
    return fn(path, list(values))


def at(what: str, fqn: str, path: Path) -> str:
    """`what['state'][fqn][key]...` for the leaf at `path` (`state[fqn]...` without `what`)."""
    return (f"{what}['state']" if what else "state") + f"[{fqn!r}]" + "".join(map(_index, path))


def _index(key: object) -> str:
    return f"[{key!r}]"


def refuse_nested_fsdp1(state: Mapping[str, Mapping[str, Any]], layout: Layout, what: str) -> None:
    """A ValueError for a sharded tensor inside a dict, list or tuple under an FSDP1 layout.

    FSDP1 has no such state: its `optim_state_dict` gives every parameter the whole nested value
    of its flat parameter (`use_orig_params=False`) or raises (`True`), and its
    `optim_state_dict_to_load` raises.
    """
    if not isinstance(layout, FSDP1Layout):
        return
    for fqn, entry in state.items():
        for key, value in entry.items():

            def refuse(path: Path, leaves: list[Any], fqn: str = fqn) -> None:
                if len(path) > 1 and is_sharded(leaves[0]):
                    raise ValueError(
                        f"{at(what, fqn, path)} is a tensor of shape {tuple(leaves[0].shape)} "
                        "inside a dict or list: FSDP1 keeps no such state (its optim_state_dict "
                        "and optim_state_dict_to_load fail on it), so FSDP1 layouts refuse it; "
                        "FSDP2 layouts shard it as get_optimizer_state_dict does"
                    )

            map_leaves([value], refuse, (key,))


def split_osd(osd: object, what: str) -> tuple[Mapping[Any, Mapping[str, Any]], Sequence[Any]]:
    """`(state, param_groups)` of an optimizer state dict, or an error naming what is wrong."""
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
        params = group.get("params") if isinstance(group, Mapping) else None
        if not isinstance(params, Sequence) or isinstance(params, str):  # a str: not its letters
            raise ValueError(
                f"{what}['param_groups'][{i}] must be a dict with a 'params' list, got "
                f"params={params!r}"
            )
    return state, groups


def group_fqns(groups: object, where: str) -> list[str]:
    """The FQNs of `groups` (a full state dict's `param_groups`, named `where`) in order; a
    ValueError naming `where` unless a list of dicts with `params` lists of str, none in two."""
    if not isinstance(groups, list):
        raise ValueError(f"{where} must be a list, got {type(groups).__name__}")
    order: list[str] = []
    seen: dict[str, int] = {}
    for i, group in enumerate(groups):
        if not isinstance(group, Mapping) or not isinstance(group.get("params"), list):
            raise ValueError(f"{where}[{i}] must be a dict with a 'params' list")
        for fqn in group["params"]:
            if not isinstance(fqn, str):
                raise ValueError(f"{where}[{i}]['params'] must hold FQN strings, got {fqn!r}")
            if fqn in seen:
                twice = (
                    f"twice in group {i}" if seen[fqn] == i else f"in groups {seen[fqn]} and {i}"
                )
                raise ValueError(f"{where}: parameter {fqn!r} is {twice}")
            seen[fqn] = i
            order.append(fqn)
    return order


def check_names(state: Mapping[str, Any], groups: Sequence[Any], layout: Layout, what: str) -> None:
    """Every name is in the layout, in one param group at most, and every state is in a group."""
    group_of: dict[str, int] = {}
    for i, group in enumerate(groups):
        for fqn in group["params"]:
            if fqn not in specs(layout):
                raise KeyError(
                    f"{what}['param_groups'][{i}] names {fqn!r}, which is not in the layout"
                )
            if fqn in group_of:
                twice = (
                    f"twice in param_groups[{i}]"
                    if group_of[fqn] == i
                    else f"in param_groups {group_of[fqn]} and {i}"
                )
                raise ValueError(f"parameter {fqn!r} is {twice}")
            group_of[fqn] = i
    for fqn in state:
        if fqn not in specs(layout):
            raise KeyError(f"{what}['state'] has parameter {fqn!r}, which is not in the layout")
        if fqn not in group_of:
            raise ValueError(f"{what}['state'][{fqn!r}] belongs to no param group")


def check_dense(value: object, where: str) -> None:
    """A TypeError naming `where` for a DTensor or a sparse (or otherwise non-strided) tensor. A
    DTensor's ops are collectives every rank must call alike: cutting one rank's chunk out of it
    ran mismatched collectives (gloo aborted, NCCL would hang)."""
    if is_dtensor(value):
        raise TypeError(
            f"{where} is a DTensor; famp maps plain tensors, full or (FSDP2) a rank's local "
            "chunk: pass value.to_local(), or get_optimizer_state_dict(..., "
            "options=StateDictOptions(full_state_dict=True))"
        )
    if isinstance(value, torch.Tensor) and value.layout != torch.strided:
        raise TypeError(
            f"{where} is a {value.layout} tensor; optimizer state must be dense (torch.strided) "
            "tensors: convert it with .to_dense()"
        )


def _check_kind(kinds: Kinds, first: dict[Path, str], fqn: str, path: Path, sharded: bool) -> None:
    """One key path is parameter-shaped for every parameter or for none (None aside); the
    dicts and lists on the way to a leaf count as not parameter-shaped."""
    for i in range(1, len(path) + 1):
        kind = sharded and i == len(path)
        other = first.setdefault(path[:i], fqn)
        if other != fqn and kinds[(other, path[:i])] != kind:
            tensor_fqn, plain_fqn = (fqn, other) if kind else (other, fqn)
            raise ValueError(
                f"{at('', plain_fqn, path[:i])} is not a tensor of the parameter's shape, but "
                f"{at('', tensor_fqn, path[:i])} is: a state name must be sharded for every "
                "parameter"
            )
        kinds[(fqn, path[:i])] = kind


def check_full(
    osd: object, layout: Layout, what: str = "full_osd", local_rank: int | None = None
) -> tuple[State, Groups, Kinds]:
    """Validate a full state dict against `layout`; return its parts and which entries shard.

    With `local_rank`, a tensor may also be that rank's chunk already (FSDP2 only).
    """
    state, groups = split_osd(osd, what)
    check_names(state, groups, layout, what)
    kinds: Kinds = {}
    first: dict[Path, str] = {}
    for fqn, entry in state.items():
        shape = specs(layout)[fqn][0]
        shapes = [shape] if local_rank is None else [shape, local_shape(layout, fqn, local_rank)]

        def check(path: Path, leaves: list[Any], fqn: str = fqn, shapes: Any = shapes) -> None:
            value = leaves[0]
            if value is None:
                return
            check_dense(value, at(what, fqn, path))
            if is_sharded(value) and tuple(value.shape) not in shapes:
                local = "" if local_rank is None else f" or rank {local_rank}'s chunk {shapes[1]}"
                raise ValueError(
                    f"{at(what, fqn, path)} has shape {tuple(value.shape)} but the layout says "
                    f"{fqn!r} is {shapes[0]}{local}; only 0-d and parameter-shaped tensors are "
                    "supported"
                )
            _check_kind(kinds, first, fqn, path, is_sharded(value))

        for key, value in entry.items():
            map_leaves([value], check, (key,))
    refuse_nested_fsdp1(state, layout, what)
    return {f: dict(e) for f, e in state.items()}, [dict(g) for g in groups], kinds


def check_shards(shards: object, layout: Layout, what: str) -> tuple[list[State], Groups, Kinds]:
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
            if fqn not in specs(layout):
                raise KeyError(f"{what}[{has}]['state'] has parameter {fqn!r}, not in the layout")
            raise ValueError(f"parameter {fqn!r} has state on rank {has} but not on rank {lacks}")
    kinds: Kinds = {}
    first: dict[Path, str] = {}
    for fqn, entry in states[0].items():
        for r, state in enumerate(states[1:], 1):
            if state[fqn].keys() != entry.keys():
                raise ValueError(
                    f"state[{fqn!r}] has keys {sorted(state[fqn])} on rank {r} but "
                    f"{sorted(entry)} on rank 0"
                )

        def check(path: Path, leaves: list[Any], fqn: str = fqn) -> None:
            for r, value in enumerate(leaves):
                _check_shard_value(value, leaves[0], layout, fqn, at(f"{what}[{r}]", fqn, path), r)
            if leaves[0] is not None:
                _check_kind(kinds, first, fqn, path, is_sharded(leaves[0]))

        for key in entry:
            map_leaves([state[fqn][key] for state in states], check, (key,))
    refuse_nested_fsdp1(states[0], layout, f"{what}[0]")
    return states, groups, kinds


def _check_shard_value(
    value: Any, first: Any, layout: Layout, fqn: str, where: str, r: int
) -> None:
    check_dense(value, where)
    tensors = isinstance(value, torch.Tensor) and isinstance(first, torch.Tensor)
    if tensors and value.device != first.device:  # torch.cat and torch.equal refuse it unnamed
        raise ValueError(f"{where} is on {value.device} but rank 0's is on {first.device}")
    if not is_sharded(first):
        if tensors and value.is_meta:  # torch.equal has no meta kernel
            raise ValueError(
                f"{where} is on the meta device: it holds no values, so famp cannot check that "
                "the ranks hold the same; 0-d tensors and non-tensors must be replicated"
            )
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
            f"{expected} of {fqn!r} {specs(layout)[fqn][0]}"
        )
    if value.dtype != first.dtype:
        raise ValueError(f"{where} is {value.dtype} but rank 0's is {first.dtype}")
