"""`famp-reshard`'s SOURCE: a DCP checkpoint, a full state dict file or rank files, and its shapes.

Each form is read into famp's canonical full FQN-keyed optimizer state; the parameter shapes
come from the model entries where there are some, else from the state tensors (rank files: the
dim-0 chunks' rows summed over the ranks).
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from famp._fsdp.build import fsdp2_layout
from famp._fsdp.cli_report import Progress, human, progress_wanted
from famp._fsdp.dcp import (
    dcp_optim_nbytes,
    load_optim_state,
    param_shape_from_state,
    read_dcp_param_shapes,
)
from famp._fsdp.osd import group_fqns
from famp._fsdp.shard import unshard_optim_state


@dataclass
class Source:
    """A SOURCE read: the full optimizer state, parameter shapes, and a description."""

    full: dict[str, Any]
    shapes: dict[str, torch.Size]
    what: str


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
        shapes = read_dcp_param_shapes(path, key=args.model_key, optim_key=args.key)
        return Source(full, shapes, f"DCP checkpoint {path} (key {args.key!r})")
    for path in sources:
        if os.path.isdir(path):
            raise ValueError(f"SOURCE {path!r} is a directory: give one DCP checkpoint alone")
    objs = [_load_file(path) for path in sources]
    if len(objs) == 1:
        obj, path = objs[0], sources[0]
        full = _pick_optim(obj, args.key, path)
        model = obj.get(args.model_key) if "state" not in obj else None
        shapes = _shapes_from_model(full, model) or _shapes_from_state(full, path)
        return Source(full, shapes, f"full state dict {path}")
    shards = [_pick_optim(obj, args.key, path) for obj, path in zip(objs, sources, strict=True)]
    shapes = _shapes_from_shards(shards, sources)
    full = unshard_optim_state(shards, fsdp2_layout(shapes, len(shards)))
    return Source(full, shapes, f"{len(shards)} FSDP2 rank files {sources[0]} ...")


def _load_file(path: str) -> Mapping[str, Any]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"SOURCE {path!r} does not exist")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\.\s|\n|$)", str(err))
        reason = found.group(1) if found else str(err).splitlines()[0]
        raise ValueError(
            f"SOURCE {path!r} is not a torch.save file of plain data; "
            f"torch.load(weights_only=True) refused it: {reason}"
        ) from err
    if not isinstance(obj, Mapping):
        raise ValueError(f"SOURCE {path!r} holds a {type(obj).__name__}, not a state dict")
    return obj


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


def _shapes_from_state(full: Mapping[str, Any], where: str) -> dict[str, torch.Size]:
    state = full.get("state", {})
    shapes = {}
    for fqn in group_fqns(full.get("param_groups"), f"{where}: param_groups"):
        shape = param_shape_from_state(f"{where}: state[{fqn!r}]", _tensor_shapes(state.get(fqn)))
        if shape is None:
            raise KeyError(f"{where}: parameter {fqn!r} has no state tensor to read its shape from")
        shapes[fqn] = shape
    return shapes


def _shapes_from_model(full: Mapping[str, Any], model: object) -> dict[str, torch.Size] | None:
    if not isinstance(model, Mapping):
        return None
    fqns = group_fqns(full.get("param_groups"), "--key: param_groups")
    if not all(isinstance(model.get(f), torch.Tensor) for f in fqns):
        return None
    return {f: model[f].shape for f in fqns}


def _shapes_from_shards(
    shards: Sequence[Mapping[str, Any]], paths: Sequence[str]
) -> dict[str, torch.Size]:
    """Full shapes of FSDP2 dim-0 shards: the local shapes' rows summed over the ranks."""
    shapes = {}
    for fqn in group_fqns(shards[0].get("param_groups"), f"{paths[0]}: param_groups"):
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
        shapes[fqn] = torch.Size([sum(s[0] for s in locals_), *locals_[0][1:]])
    return shapes
