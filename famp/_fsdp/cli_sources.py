"""`famp-reshard`'s SOURCE: a DCP checkpoint, a full state dict file or rank files, and its shapes.

Each form is read into famp's canonical full FQN-keyed optimizer state; the parameter shapes
come from the model entries where there are some, else from the state tensors. Rank files give
each parameter's global shape and shard dim in their `sharding` entry (docs/fsdp.md's recipe,
and famp-reshard's own rank files). Files without it: the local shards alone cannot tell dim 0
from another dim where they are the same shape on every rank (rows `n` on each of `W` ranks look
like a dim-0 split of `W * n` rows), so such parameters need `--assume-dim0`; where they differ,
only dim 0 fits (FSDP2 shards other dims evenly) and their rows are summed.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from famp._fsdp.build import fsdp2_layout
from famp._fsdp.cli_report import Progress, human, progress_wanted
from famp._fsdp.dcp import (
    dcp_optim_nbytes,
    dcp_param_shapes,
    load_optim_state,
    param_shape_from_state,
)
from famp._fsdp.osd import check_shards, group_fqns
from famp._fsdp.shard import unshard_optim_state
from famp._fsdp.torch_save_reader import load_file

SHARDING = "sharding"  # a rank file's {fqn: {"shape": [...], "dim": d}} of its DTensor states


class UsageError(ValueError):
    """A source that needs a command-line option to be read (exit status 2)."""


@dataclass
class Source:
    """A SOURCE read: the full optimizer state, parameter shapes, and a description; `inferred`
    names the parameters whose shapes were read off the optimizer state (no model entry), and
    `shapeless` those of no known shape and no state (`layout_shapes`)."""

    full: dict[str, Any]
    shapes: dict[str, torch.Size]
    what: str
    inferred: set[str] = field(default_factory=set)
    shapeless: list[str] = field(default_factory=list)


_STAND_IN = torch.Size([1])


def layout_shapes(shapes: Mapping[str, torch.Size], shapeless: Sequence[str]) -> dict[str, Any]:
    """`shapes` for a layout, with a stand-in `(1,)` for each parameter of no known shape: one
    with no model entry and no state (a frozen parameter saved with `ignore_frozen_params=True`)
    has nothing to cut, so its shape changes no shard; rank files record no sharding for it."""
    return {**shapes, **dict.fromkeys(shapeless, _STAND_IN)}


def check_inferred_shapes(
    shapes: Mapping[str, torch.Size], inferred: set[str], model_key: str
) -> None:
    """Refuse a shape read off the optimizer state as 0-d: it may hold the shaped tensors in lists
    or dicts, which are not read (`read_dcp_param_shapes` documents torch.Size([]) then)."""
    for fqn, shape in shapes.items():
        if fqn in inferred and len(shape) == 0:
            raise ValueError(
                f"parameter {fqn!r}: its shape cannot be read off its optimizer state, which "
                "holds only 0-d tensors at its top level (tensors inside lists or dicts are not "
                f"read): save the model's state dict beside it under {model_key!r} "
                "(--model-key) to give the shapes"
            )


def check_model_key(args: argparse.Namespace, path: str, held: bool | None = None) -> None:
    """Refuse a `--model-key` given that SOURCE `path` lacks (`held`; None: a DCP path, read)."""
    if not args.model_key_given:
        return
    if held is None:
        from famp._fsdp.dcp_reader import Checkpoint

        held = next(iter(Checkpoint(path).entries([(args.model_key,)])), None) is not None
    if not held:
        raise UsageError(
            f"--model-key {args.model_key!r}: {path!r} holds no model state under that key "
            "(read from a DCP checkpoint or a full state-dict file; rank files record their "
            "shapes): give the key it was saved under, or leave --model-key out"
        )


def is_dcp_source(sources: Sequence[str]) -> bool:
    """Whether SOURCE is one DCP checkpoint directory."""
    return len(sources) == 1 and os.path.isdir(sources[0])


def read_source(args: argparse.Namespace) -> Source:
    """Read SOURCE (`args.sources`) into its full state and the parameters' shapes."""
    sources: list[str] = args.sources
    if is_dcp_source(sources):
        path = sources[0]
        total = dcp_optim_nbytes(path, args.key)
        bar = Progress("reading", total, progress_wanted(args, total), human)
        full = load_optim_state(path, args.key, bar.update)
        bar.close()
        check_model_key(args, path)
        shapes, inferred, shapeless = dcp_param_shapes(path, args.model_key, args.key)
        what = f"DCP checkpoint {path} (key {args.key!r})"
        return Source(full, shapes, what, inferred, shapeless)
    for path in sources:
        if os.path.isdir(path):
            raise ValueError(f"SOURCE {path!r} is a directory: give one DCP checkpoint alone")
    _check_rank_order(sources)
    objs = [load_file(path) for path in sources]
    shards = [_pick_optim(obj, args.key, path) for obj, path in zip(objs, sources, strict=True)]
    if len(objs) == 1 and SHARDING not in shards[0]:  # one rank's file is read as rank files
        obj, path, full = objs[0], sources[0], shards[0]
        check_model_key(args, path, "state" not in obj and args.model_key in obj)
        model = obj.get(args.model_key) if "state" not in obj else None
        shapes, inferred, shapeless = _full_shapes(full, model, path)
        return Source(full, shapes, f"full state dict {path}", inferred, shapeless)
    check_model_key(args, sources[0], False)  # rank files record their shapes
    shapes, dims, unknown, shapeless = _shapes_from_shards(shards, sources)
    layout = fsdp2_layout(layout_shapes(shapes, shapeless), len(shards), shard_dims=dims)
    if unknown and not args.assume_dim0:
        check_shards(shards, layout, "shards")  # bad input first (exit 1), then the dims
        more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
        raise UsageError(
            f"the rank files record no shard dims ({SHARDING!r}), and the shards of "
            f"{', '.join(map(repr, unknown[:3]))}{more} are the same shape on every rank, as "
            "shards on dim 0 or on another dim (shard_placement_fn) would be: save each rank "
            f"file with a {SHARDING!r} entry (docs/fsdp.md), or pass --assume-dim0 if every "
            "parameter was sharded on dim 0 (FSDP2's default)"
        )
    try:
        full = unshard_optim_state(shards, layout)
    except ValueError as err:
        if len(shards) > 1:
            raise
        raise ValueError(
            f"SOURCE {sources[0]!r} has a {SHARDING!r} entry, so it is one rank's file, and its "
            f"state is not the whole of the parameters that entry records ({err}): give every "
            "rank's file, in rank order"
        ) from err
    what = f"{len(shards)} FSDP2 rank files {sources[0]} ..."
    return Source(full, shapes, what, shapeless=shapeless)


def _check_rank_order(sources: list[str]) -> None:
    """Refuse rank files whose names number them out of order: a shell glob sorts
    `optim.rank10.pt` before `optim.rank2.pt`, and shards of one shape would be read in that
    order silently. Names that differ in one run of digits only are checked."""
    split = [re.split(r"(\d+)", os.path.basename(path)) for path in sources]
    if len(sources) < 2 or len({len(parts) for parts in split}) != 1:
        return
    varying = [i for i in range(1, len(split[0]), 2) if len({p[i] for p in split}) > 1]
    fixed = all(p[i] == split[0][i] for p in split for i in range(0, len(p), 2))
    if len(varying) != 1 or not fixed:
        return
    numbers = [int(parts[varying[0]]) for parts in split]
    for i in range(1, len(numbers)):
        if numbers[i] <= numbers[i - 1]:
            raise ValueError(
                f"SOURCE files must be given in rank order, but {sources[i]!r} comes after "
                f"{sources[i - 1]!r} "
                "(a shell glob sorts names as text: rank10 before rank2); pass them sorted by "
                "rank, as `ls -v` lists them, or name them with zero-padded ranks"
            )


def _pick_optim(obj: Mapping[str, Any], key: str, path: str) -> dict[str, Any]:
    if "state" in obj and "param_groups" in obj:
        osd, where = obj, path
    elif key in obj and isinstance(obj[key], Mapping):
        osd, where = obj[key], f"{path}[{key!r}]"
    else:
        raise KeyError(
            f"SOURCE {path!r} is neither an optimizer state dict ('state' and 'param_groups') "
            f"nor a dict with one under --key {key!r}; its keys are {sorted(map(str, obj))}"
        )
    state = osd.get("state")
    if not isinstance(state, Mapping):
        raise ValueError(f"{where}['state'] must be a dict, got {type(state).__name__}")
    for fqn, entry in state.items():
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where}['state'][{fqn!r}] must be a dict, got {entry!r}")
    return dict(osd)


def _tensor_shapes(entry: object) -> list[torch.Size]:
    values = entry.values() if isinstance(entry, Mapping) else ()
    return [v.shape for v in values if isinstance(v, torch.Tensor)]


def _full_shapes(
    full: Mapping[str, Any], model: object, where: str
) -> tuple[dict[str, torch.Size], set[str], list[str]]:
    """A full state's parameter shapes: from the model's tensors, else from the state tensors
    (`inferred`); a parameter with neither a model tensor nor state is `shapeless`."""
    state, model = full.get("state", {}), model if isinstance(model, Mapping) else {}
    shapes, inferred, shapeless = {}, set(), []
    for fqn in group_fqns(full.get("param_groups"), f"{where}: param_groups"):
        if isinstance(model.get(fqn), torch.Tensor):
            shapes[fqn] = model[fqn].shape
            continue
        if fqn not in state:
            shapeless.append(fqn)
            continue
        shape = param_shape_from_state(f"{where}: state[{fqn!r}]", _tensor_shapes(state[fqn]))
        if shape is None:
            raise KeyError(f"{where}: parameter {fqn!r} has no state tensor to read its shape from")
        shapes[fqn] = shape
        inferred.add(fqn)
    return shapes, inferred, shapeless


def _recorded(shards: Sequence[Mapping[str, Any]], paths: Sequence[str]) -> Any:
    """The rank files' common `sharding` entry, None if none has one; a ValueError otherwise."""
    found = [shard.get(SHARDING) for shard in shards]
    if all(entry is None for entry in found):
        return None
    for entry, path in zip(found, paths, strict=True):
        if entry != found[0]:
            raise ValueError(
                f"{path}[{SHARDING!r}] = {entry!r} differs from {paths[0]}[{SHARDING!r}]: "
                "the rank files must come from one job"
            )
    if not isinstance(found[0], Mapping):
        raise ValueError(f"{paths[0]}[{SHARDING!r}] must be a dict, got {found[0]!r}")
    return found[0]


def _recorded_spec(entry: Any, fqn: str, path: str) -> tuple[list[int], int]:
    shape = entry.get("shape") if isinstance(entry, Mapping) else None
    dim = entry.get("dim") if isinstance(entry, Mapping) else None
    ints = isinstance(shape, (list, tuple)) and all(type(n) is int for n in shape)
    if not isinstance(shape, (list, tuple)) or not ints or type(dim) is not int:
        raise ValueError(
            f"{path}[{SHARDING!r}][{fqn!r}] must be {{'shape': [int, ...], 'dim': int}}, "
            f"got {entry!r}"
        )
    return list(shape), dim


def _shapes_from_shards(
    shards: Sequence[Mapping[str, Any]], paths: Sequence[str]
) -> tuple[dict[str, torch.Size], dict[str, int], list[str], list[str]]:
    """Global shapes and shard dims of FSDP2 rank files, the parameters whose dim is unknown,
    and those of no known shape (neither recorded nor with state on any rank).

    Recorded in `sharding`, or else dim 0: certain where the rows differ between ranks, unknown
    where the shards are the same shape on every rank (the third result).
    """
    recorded = _recorded(shards, paths)
    shapes, dims, unknown, shapeless = {}, {}, [], []
    for fqn in group_fqns(shards[0].get("param_groups"), f"{paths[0]}: param_groups"):
        if recorded is not None and fqn in recorded:
            shape, dims[fqn] = _recorded_spec(recorded[fqn], fqn, paths[0])
            shapes[fqn] = torch.Size(shape)
            continue
        if all(fqn not in shard.get("state", {}) for shard in shards):
            shapeless.append(fqn)  # no state on any rank: no shape needed (`layout_shapes`)
            continue
        if recorded is not None:
            raise KeyError(
                f"{paths[0]}[{SHARDING!r}] has no entry for parameter {fqn!r}, which has "
                "state: record every parameter (docs/fsdp.md's save recipe)"
            )
        locals_ = []
        for shard, path in zip(shards, paths, strict=True):
            entry = shard.get("state", {}).get(fqn) if isinstance(shard, Mapping) else None
            local = param_shape_from_state(f"{path}: state[{fqn!r}]", _tensor_shapes(entry))
            if local is None or len(local) == 0:
                raise KeyError(f"{path}: parameter {fqn!r} has no sharded state tensor")
            locals_.append(local)
        if len({tuple(s[1:]) for s in locals_}) > 1:
            listed = [tuple(s) for s in locals_]
            raise ValueError(f"parameter {fqn!r}: rank shards differ past dim 0: {listed}")
        if len(locals_[0]) > 1 and len(shards) > 1 and len(set(locals_)) == 1:
            unknown.append(fqn)  # the same on every rank: dim 0, or any dim that divides evenly
        shapes[fqn] = torch.Size([sum(s[0] for s in locals_), *locals_[0][1:]])
    return shapes, dims, unknown, shapeless
