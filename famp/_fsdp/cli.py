"""`famp-reshard`: reshard an FSDP checkpoint to another world size, offline.

No process group. For rank files (the default), the source is read into famp's canonical full
form (`famp.load_dcp_optim_state` for DCP, `torch.load(weights_only=True)` for files), cut
with `famp.shard_optim_state` for an FSDP2 layout of the new world size, and written one file
per rank. From a DCP checkpoint, `--format dcp` (a DCP checkpoint for W ranks) and `--full`
(`dcp_to_torch_save`'s file) stream chunk by chunk instead (`famp/_fsdp/dcp_writer.py`). Every
output is written into a temporary sibling and renamed into place at the end, so a failure
leaves nothing behind.
"""

from __future__ import annotations

import argparse
import math
import os
import pickle
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

import torch

from famp._fsdp.build import fsdp2_layout
from famp._fsdp.dcp import dcp_optim_nbytes, load_optim_state, param_shape_from_state
from famp._fsdp.dcp import read_dcp_param_shapes as _read_dcp_param_shapes
from famp._fsdp.layout import FSDP2Layout
from famp._fsdp.osd import group_fqns
from famp._fsdp.shard import shard_optim_state, unshard_optim_state

PROG = "famp-reshard"
_RANK_FILE = re.compile(r"rank\d+\.pt|__\d+_0\.distcp|\.metadata")
PROGRESS_AUTO_BYTES = 256 * 2**20
_MAX_LISTED = 4

DESCRIPTION = """\
Reshard an FSDP optimizer checkpoint to another world size, offline, in one process.

SOURCE is one of:
  * a DCP checkpoint directory: what dcp.save({"model": msd, "optim": osd}) wrote at any world
    size (FSDP2, or FSDP1 sharded), msd and osd from get_state_dict;
  * a torch.save file holding a full FQN-keyed optimizer state dict ({"state": {fqn: ...},
    "param_groups": [...]}), or a dict holding one under --key (e.g. dcp_to_torch_save output);
  * several torch.save files, one FSDP2 local shard per rank in rank order (e.g. out/rank*.pt
    from an earlier run).
Files are read with torch.load(weights_only=True) and DCP metadata with a restricted unpickler:
nothing is unpickled beyond plain data.

Each output rank file holds what get_optimizer_state_dict(model, optim) returns on that rank
under FSDP2 on the new world size, with every DTensor replaced by its local tensor: state
tensors are the rank's dim-0 torch.chunk (trailing ranks may be empty, (0, *rest)), step and
param_groups are replicated. Load it with torch.load(path, weights_only=True)."""

EPILOG = """\
examples:
  famp-reshard ckpt/step100 -n 3 -o resharded/      # DCP at any world size -> 3 rank files
  famp-reshard ckpt/step100 --full full.pt --workers 4   # DCP -> one file, as dcp_to_torch_save
  famp-reshard ckpt/step100 -n 3 -o w3/ --format dcp --workers 3   # DCP -> DCP for 3 ranks
  famp-reshard resharded/rank*.pt -n 8 -o w8/       # 3 rank files -> 8
  famp-reshard optim_full.pt -n 64 --dry-run        # summary only

exit status: 0 on success, 1 on bad input (nothing written), 2 on a usage error."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run `famp-reshard` with `argv` (`sys.argv[1:]` if None); return the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    usage = _usage_error(args)
    if usage is not None:
        parser.error(usage)  # exits 2, as argparse does for every usage error
    try:
        _check_targets(args)
        return _run(args)
    except (ValueError, KeyError, TypeError, OSError, RuntimeError, pickle.UnpicklingError) as err:
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"{PROG}: error: {_one_line(message)}", file=sys.stderr)
        return 1
    except Exception as err:  # bad input must never end in a traceback
        print(f"{PROG}: error: {type(err).__name__}: {_one_line(err)}", file=sys.stderr)
        return 1


def _one_line(message: object) -> str:
    return " ".join(str(message).split())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("sources", nargs="+", metavar="SOURCE", help="checkpoint to read")
    parser.add_argument(
        "-n", "--world-size", type=_positive_int, help="number of ranks to reshard to"
    )
    parser.add_argument("-o", "--out", metavar="DIR", help="write rank00000.pt ... here (new dir)")
    parser.add_argument(
        "--full",
        metavar="FILE",
        help="write one torch.save file: from a DCP checkpoint, the whole checkpoint as "
        "dcp_to_torch_save writes it (streamed); from files, the full optimizer state dict",
    )
    parser.add_argument(
        "--key",
        default="optim",
        help="key of the optimizer state in a DCP checkpoint or a dict file (default: optim)",
    )
    parser.add_argument(
        "--model-key",
        default="model",
        help="key of the model state, used for parameter "
        "shapes (default: model); without it shapes come from the optimizer state",
    )
    parser.add_argument(
        "--format",
        choices=("rank-files", "dcp"),
        default="rank-files",
        help="what -o DIR holds: rank*.pt files (default), or a DCP checkpoint that dcp.load "
        "reads on WORLD_SIZE ranks (every entry of a DCP SOURCE, re-chunked, streamed)",
    )
    parser.add_argument(
        "--workers",
        type=_positive_int,
        help="processes that write --format dcp output ranks, or the --full file's tensors, in "
        "parallel, from a DCP checkpoint (the same files for any N; default 1)",
    )
    parser.add_argument(
        "--max-memory",
        type=_size,
        metavar="SIZE",
        help="memory budget beyond one tensor, e.g. 512M or 2G, for --full and --format dcp "
        "(which stream chunk by chunk): the copy buffer, and fewer --workers if needed",
    )
    parser.add_argument("--dry-run", action="store_true", help="read and check; write nothing")
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace an existing --full file, or an --out directory of rank*.pt files",
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: for states of 256 MiB or more on a terminal)",
    )
    return parser


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _size(text: str) -> int:
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, flags=re.IGNORECASE)
    if found is None or float(found.group(1)) * _UNITS[found.group(2).upper()] < 1:
        raise argparse.ArgumentTypeError(f"must be a size such as 512M or 2G, got {text!r}")
    return int(float(found.group(1)) * _UNITS[found.group(2).upper()])


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}")
    return value


def _usage_error(args: argparse.Namespace) -> str | None:
    """The message for an impossible option set, or None."""
    if args.out is not None and args.world_size is None:
        return "--out needs --world-size"
    if args.world_size is not None and args.out is None and not args.dry_run:
        return "--world-size needs --out DIR (or --dry-run)"
    if args.out is None and args.full is None and not args.dry_run:
        return "nothing to do: give --world-size N --out DIR, --full FILE or --dry-run"
    if args.format == "dcp" and (args.out is None or args.full is not None or args.dry_run):
        return "--format dcp writes --out DIR only: give -n N -o DIR, without --full or --dry-run"
    dcp_source = len(args.sources) == 1 and os.path.isdir(args.sources[0])
    if args.format == "dcp" and not dcp_source:
        return "--format dcp needs one DCP checkpoint directory as SOURCE"
    if args.max_memory is not None and (
        not dcp_source or (args.out is not None and args.format != "dcp") or args.dry_run
    ):
        return (
            "--max-memory applies to --full and --format dcp from a DCP checkpoint "
            "(rank files and --dry-run hold the whole optimizer state)"
        )
    if args.workers is not None and (
        not dcp_source or args.dry_run or (args.format != "dcp" and args.full is None)
    ):
        return (
            "--workers applies to --full and --format dcp from a DCP checkpoint "
            "(rank files and --dry-run are written in one process)"
        )
    return None


def _check_targets(args: argparse.Namespace) -> None:
    """Reject existing outputs before reading anything."""
    if args.dry_run:
        return
    for path, kind in ((args.out, "--out"), (args.full, "--full")):
        if path is None:
            continue
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise FileNotFoundError(f"{kind} {path!r}: directory {parent!r} does not exist")
        if os.path.lexists(path) and not args.force:
            raise FileExistsError(f"{kind} {path!r} exists; pass --force to replace it")
        if kind == "--out" and os.path.lexists(path):
            _check_replaceable(path)


def _check_replaceable(out: str) -> None:
    """`--force` replaces a directory of rank files only, never one holding anything else."""
    if not os.path.isdir(out) or os.path.islink(out):
        raise ValueError(f"--out {out!r} exists and is not a directory")
    others = [n for n in os.listdir(out) if not _RANK_FILE.fullmatch(n)]
    if others:
        raise ValueError(
            f"--out {out!r} holds files other than rank*.pt ({sorted(others)[:3]}); famp-reshard "
            "replaces only a directory it wrote"
        )


@dataclass
class _Source:
    full: dict[str, Any]
    shapes: dict[str, torch.Size]
    what: str


def _run(args: argparse.Namespace) -> int:
    if args.format == "dcp":
        return _run_dcp(args)
    if not (_is_dcp_source(args) and args.full is not None and not args.dry_run):
        return _run_optim(args)
    tmp, target = _stream_full_dcp(args), args.full
    try:
        if args.out is not None:
            args.full = None
            _run_optim(args)
        _place(tmp, target, args.force)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    print(f"wrote the whole checkpoint (as dcp_to_torch_save does) to {target}")
    return 0


def _run_optim(args: argparse.Namespace) -> int:
    source = _read(args)
    out = sys.stdout
    _print_source(source, out)
    if args.world_size is not None:
        layout = fsdp2_layout(source.shapes, args.world_size)
        if args.dry_run:
            ranks = _LazyShards(source.full, layout, copy=False)
            stats = [_stats(shard, layout, r) for r, (_, shard) in enumerate(ranks)]
        else:
            ranks = _LazyShards(source.full, layout, copy=True)  # a view would save all storage
            stats = _write_ranks(ranks, layout, args.out, args.force, _progress_on(args, source))
        _print_ranks(stats, layout, out)
    if args.full is not None and not args.dry_run:
        _atomic_save(source.full, args.full, args.force)
    if args.dry_run:
        print("dry run: nothing written", file=out)
    else:
        if args.out is not None:
            print(f"wrote {args.world_size} rank files to {args.out}", file=out)
        if args.full is not None:
            print(f"wrote the full state dict to {args.full}", file=out)
    return 0


def _is_dcp_source(args: argparse.Namespace) -> bool:
    return len(args.sources) == 1 and os.path.isdir(args.sources[0])


def _run_dcp(args: argparse.Namespace) -> int:
    """Stream a DCP SOURCE into a DCP checkpoint for `args.world_size` ranks."""
    from famp._fsdp import dcp_reader as reader
    from famp._fsdp.dcp_writer import write_dcp

    path, out = args.sources[0], args.out
    # Check the optimizer entries and shapes (metadata and param_groups only) before writing.
    shapes = _read_dcp_param_shapes(path, key=args.model_key, optim_key=args.key)
    fsdp2_layout(shapes, args.world_size)
    ckpt = reader.Checkpoint(path)
    keys = list(ckpt.metadata.state_dict_metadata)
    ckpt.check_records(keys)
    nbytes = 0
    for md in ckpt.metadata.state_dict_metadata.values():
        if reader.is_tensor_entry(md):
            nbytes += math.prod(md.size) * md.properties.dtype.itemsize  # type: ignore[union-attr]
    print(f"source      DCP checkpoint {path}: {len(keys)} entries, {_human(nbytes)}")
    parent, name = os.path.split(os.path.abspath(out))
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    try:
        bar = _Progress("writing ranks", args.world_size, _progress_wanted(args, nbytes))
        workers = _workers_within(args, ckpt)
        write_dcp(path, tmp, keys, args.world_size, workers=workers, progress=bar.update)
        bar.close()
        _set_default_modes(tmp, [os.path.join(tmp, n) for n in os.listdir(tmp)])
        _replace(tmp, out, args.force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"wrote a DCP checkpoint for {args.world_size} ranks to {out}")
    return 0


def _workers_within(args: argparse.Namespace, ckpt: Any) -> int:
    """`--workers`, lowered so that each worker's two chunks fit in `--max-memory`."""
    workers = 1 if args.workers is None else int(args.workers)
    if args.max_memory is None:
        return workers
    largest = max(
        (
            math.prod(c.sizes) * md.properties.dtype.itemsize
            for md in ckpt.metadata.state_dict_metadata.values()
            if hasattr(md, "chunks")
            for c in md.chunks
        ),
        default=1,
    )
    return max(1, min(workers, int(args.max_memory) // max(1, 2 * largest)))


def _stream_full_dcp(args: argparse.Namespace) -> str:
    """`--full` from a DCP SOURCE: what `dcp_to_torch_save` writes, streamed to a temp file."""
    from famp._fsdp.dcp_reader import Checkpoint
    from famp._fsdp.dcp_writer import largest_piece, write_torch_save

    parent, name = os.path.split(os.path.abspath(args.full))
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.tmp-", dir=parent)
    os.close(fd)
    buffer = 64 * 2**20 if args.max_memory is None else min(64 * 2**20, int(args.max_memory))
    workers = 1 if args.workers is None else int(args.workers)
    try:
        if args.max_memory is not None and workers > 1:  # each worker: one piece and a buffer
            piece = largest_piece(Checkpoint(args.sources[0]))
            workers = max(1, min(workers, int(args.max_memory) // (piece + buffer)))
        write_torch_save(args.sources[0], tmp, buffer_bytes=buffer, workers=workers)
        _set_default_modes(None, [tmp])
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp


def _place(tmp: str, target: str, force: bool) -> None:
    if os.path.lexists(target) and not force:
        raise FileExistsError(f"--full {target!r} exists; pass --force to replace it")
    os.replace(tmp, target)


def _read(args: argparse.Namespace) -> _Source:
    sources: list[str] = args.sources
    if len(sources) == 1 and os.path.isdir(sources[0]):
        path = sources[0]
        total = dcp_optim_nbytes(path, args.key)
        bar = _Progress("reading", total, _progress_wanted(args, total), _human)
        full = load_optim_state(path, args.key, bar.update)
        bar.close()
        shapes = _read_dcp_param_shapes(path, key=args.model_key, optim_key=args.key)
        return _Source(full, shapes, f"DCP checkpoint {path} (key {args.key!r})")
    for path in sources:
        if os.path.isdir(path):
            raise ValueError(f"SOURCE {path!r} is a directory: give one DCP checkpoint alone")
    objs = [_load_file(path) for path in sources]
    if len(objs) == 1:
        obj, path = objs[0], sources[0]
        full = _pick_optim(obj, args.key, path)
        model = obj.get(args.model_key) if "state" not in obj else None
        shapes = _shapes_from_model(full, model) or _shapes_from_state(full, path)
        return _Source(full, shapes, f"full state dict {path}")
    shards = [_pick_optim(obj, args.key, path) for obj, path in zip(objs, sources, strict=True)]
    shapes = _shapes_from_shards(shards, sources)
    full = unshard_optim_state(shards, fsdp2_layout(shapes, len(shards)))
    return _Source(full, shapes, f"{len(shards)} FSDP2 rank files {sources[0]} ...")


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


class _LazyShards(Sequence[tuple[str, dict[str, Any]]]):
    """`(file name, shard)` per rank, each shard cut (as a compact copy) only when asked for."""

    def __init__(self, full: Mapping[str, Any], layout: FSDP2Layout, *, copy: bool) -> None:
        self.full, self.layout, self.copy = full, layout, copy
        self.width = max(5, len(str(layout.world_size - 1)))
        shard_optim_state(full, layout, 0)  # validate everything before any output

    def __len__(self) -> int:
        return self.layout.world_size

    def __getitem__(self, rank: int) -> tuple[str, dict[str, Any]]:  # type: ignore[override]
        if not 0 <= rank < len(self):
            raise IndexError(rank)
        shard = shard_optim_state(self.full, self.layout, rank, copy=self.copy)
        return f"rank{rank:0{self.width}d}.pt", shard

    def __iter__(self) -> Iterator[tuple[str, dict[str, Any]]]:
        return (self[r] for r in range(len(self)))


@dataclass
class _RankStats:
    tensors: int
    nbytes: int
    empty: list[str]


def _stats(shard: Mapping[str, Any], layout: FSDP2Layout, rank: int) -> _RankStats:
    tensors = [
        v for e in shard["state"].values() for v in e.values() if isinstance(v, torch.Tensor)
    ]
    empty = [f for f in shard["state"] if 0 in layout.local_shape(f, rank)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return _RankStats(len(tensors), nbytes, empty)


def _write_ranks(
    ranks: Sequence[tuple[str, dict[str, Any]]],
    layout: FSDP2Layout,
    out: str,
    force: bool,
    progress: bool,
) -> list[_RankStats]:
    parent, name = os.path.split(os.path.abspath(out))
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    stats = []
    try:
        bar = _Progress("writing ranks", len(ranks), progress)
        for rank, (filename, shard) in enumerate(ranks):
            torch.save(shard, os.path.join(tmp, filename))
            stats.append(_stats(shard, layout, rank))
            bar.update(1)
        bar.close()
        _set_default_modes(tmp, [os.path.join(tmp, n) for n in os.listdir(tmp)])
        _replace(tmp, out, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return stats


def _replace(tmp: str, target: str, force: bool) -> None:
    """Rename `tmp` to `target`; with `force`, an existing `target` goes only after."""
    if not os.path.lexists(target):
        os.rename(tmp, target)
        return
    if not force:
        raise FileExistsError(f"{target!r} exists; pass --force to replace it")
    _check_replaceable(target)
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.old-", dir=os.path.dirname(tmp))
    moved = os.path.join(old, "x")
    os.rename(target, moved)
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(moved, target)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _set_default_modes(directory: str | None, files: Sequence[str]) -> None:
    """Give outputs the modes `open`/`mkdir` would (`tempfile` makes them private)."""
    mask = _umask()
    for path in files:
        os.chmod(path, 0o666 & ~mask)
    if directory is not None:
        os.chmod(directory, 0o777 & ~mask)


def _atomic_save(obj: object, path: str, force: bool) -> None:
    parent, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.tmp-", dir=parent)
    os.close(fd)
    try:
        torch.save(obj, tmp)
        _set_default_modes(None, [tmp])
        if os.path.lexists(path) and not force:
            raise FileExistsError(f"--full {path!r} exists; pass --force to replace it")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _nbytes(osd: Mapping[str, Any]) -> tuple[int, int]:
    """Number of state tensors and their bytes."""
    values = [v for entry in osd["state"].values() for v in entry.values()]
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    return len(tensors), sum(t.numel() * t.element_size() for t in tensors)


def _progress_wanted(args: argparse.Namespace, total: int) -> bool:
    if args.progress is not None:
        return bool(args.progress)
    return total >= PROGRESS_AUTO_BYTES and sys.stderr.isatty()


def _progress_on(args: argparse.Namespace, source: _Source) -> bool:
    return _progress_wanted(args, _nbytes(source.full)[1])


class _Progress:
    """A one-line progress bar on stderr, redrawn when the percentage changes."""

    def __init__(
        self, label: str, total: int, enabled: bool, fmt: Callable[[int], str] = str
    ) -> None:
        self.label, self.total, self.enabled, self.fmt = label, max(total, 1), enabled, fmt
        self.done, self.shown = 0, -1

    def update(self, n: int) -> None:
        self.done += n
        percent = min(100, 100 * self.done // self.total)
        if self.enabled and percent != self.shown:
            self.shown = percent
            bar = "#" * (percent // 4)
            amount = f"{self.fmt(min(self.done, self.total))}/{self.fmt(self.total)}"
            sys.stderr.write(f"\r{self.label} [{bar:<25}] {percent:3d}% {amount}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            self.update(self.total - self.done)
            sys.stderr.write("\n")
            sys.stderr.flush()


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def _print_source(source: _Source, out: IO[str]) -> None:
    full = source.full
    groups = full["param_groups"]
    n_params = sum(len(g["params"]) for g in groups)
    n_tensors, nbytes = _nbytes(full)
    print(f"source      {source.what}", file=out)
    print(
        f"parameters  {n_params} in {len(groups)} param groups, {len(full['state'])} with state",
        file=out,
    )
    print(f"tensors     {n_tensors}, {_human(nbytes)}", file=out)


def _print_ranks(stats: Sequence[_RankStats], layout: FSDP2Layout, out: IO[str]) -> None:
    print(f"target      FSDP2, dim-0 chunks on {layout.world_size} ranks", file=out)
    print(f"{'rank':>6}  {'tensors':>7}  {'bytes':>10}  empty shards", file=out)
    for rank, s in enumerate(stats):
        listed = ", ".join(s.empty[:_MAX_LISTED])
        more = f", ... {len(s.empty) - _MAX_LISTED} more" if len(s.empty) > _MAX_LISTED else ""
        empty = f"{len(s.empty)}" + (f": {listed}{more}" if s.empty else "")
        print(f"{rank:>6}  {s.tensors:>7}  {_human(s.nbytes):>10}  {empty}", file=out)
