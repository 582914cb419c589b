"""`famp-reshard`'s runs: rank files cut from the full state, or a DCP source streamed.

Rank files: the source's full state is cut with `famp.shard_optim_state` for an FSDP2 layout of
the new world size, one rank at a time. From a DCP checkpoint, `--format dcp` and `--full` stream
chunk by chunk through `dcp_writer.py` and `torch_save_writer.py`.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from famp._fsdp.build import fsdp2_layout
from famp._fsdp.cli_files import (
    discard,
    place,
    replace_dir,
    save_temp,
    set_default_modes,
    temp_path,
)
from famp._fsdp.cli_report import (
    Progress,
    RankStats,
    human,
    print_ranks,
    print_source,
    progress_wanted,
    rank_stats,
    state_nbytes,
)
from famp._fsdp.cli_sources import (
    SHARDING,
    Source,
    check_inferred_shapes,
    check_model_key,
    is_dcp_source,
    layout_shapes,
    read_source,
)
from famp._fsdp.dcp import dcp_param_shapes
from famp._fsdp.layout import FSDP2Layout, specs
from famp._fsdp.shard import shard_optim_state


def run(args: argparse.Namespace) -> int:
    """Run a parsed, checked command; return the exit status."""
    if args.format == "dcp":
        return _run_dcp(args)
    if not (is_dcp_source(args.sources) and args.full is not None and not args.dry_run):
        return _run_optim(args)
    check_model_key(args, args.sources[0])  # --full alone writes the whole checkpoint: unread
    tmp, target = _stream_full_dcp(args), args.full
    try:
        if args.out is not None:
            args.full = None
            _run_optim(args)
        place(tmp, target, args.force)
    finally:
        discard(tmp)
    print(f"wrote the whole checkpoint (as dcp_to_torch_save does) to {target}")
    return 0


def _run_optim(args: argparse.Namespace) -> int:
    source = read_source(args)
    out = sys.stdout
    print_source(source, out)
    ranks = layout = None
    if args.world_size is not None:
        check_inferred_shapes(source.shapes, source.inferred, args.model_key)
        layout = fsdp2_layout(layout_shapes(source.shapes, source.shapeless), args.world_size)
        # checks every shard's input; copies: a view would save all of its storage
        ranks = _LazyShards(source.full, layout, source.shapeless, copy=not args.dry_run)
    # --full first, placed last: a failure anywhere leaves no output
    tmp = None if args.full is None or args.dry_run else save_temp(source.full, args.full)
    try:
        if ranks is not None and layout is not None:
            if args.dry_run:
                stats = [rank_stats(shard, layout, r) for r, (_, shard) in enumerate(ranks)]
            else:
                stats = _write_ranks(
                    ranks, layout, args.out, args.force, _progress_on(args, source)
                )
            print_ranks(stats, layout, out)
        if tmp is not None:
            place(tmp, args.full, args.force)
    finally:
        if tmp is not None:
            discard(tmp)
    if args.dry_run:
        print("dry run: nothing written", file=out)
    else:
        if args.out is not None:
            print(f"wrote {args.world_size} rank files to {args.out}", file=out)
        if args.full is not None:
            print(f"wrote the full state dict to {args.full}", file=out)
    return 0


def _run_dcp(args: argparse.Namespace) -> int:
    """Stream a DCP SOURCE into a DCP checkpoint for `args.world_size` ranks."""
    from famp._fsdp import dcp_reader as reader
    from famp._fsdp.dcp_metadata import is_tensor_entry
    from famp._fsdp.dcp_writer import write_dcp

    path, out = args.sources[0], args.out
    # Check the optimizer entries and shapes (metadata and param_groups only) before writing.
    check_model_key(args, path)
    shapes, inferred, _ = dcp_param_shapes(path, args.model_key, args.key)  # state's shapes
    check_inferred_shapes(shapes, inferred, args.model_key)
    fsdp2_layout(shapes, args.world_size)
    ckpt = reader.Checkpoint(path)
    keys = list(ckpt.metadata.state_dict_metadata)
    ckpt.check_records(keys)
    nbytes = 0
    for md in ckpt.metadata.state_dict_metadata.values():
        if is_tensor_entry(md):
            nbytes += math.prod(md.size) * md.properties.dtype.itemsize  # type: ignore[union-attr]
    print(f"source      DCP checkpoint {path}: {len(keys)} entries, {human(nbytes)}")
    parent, name = os.path.split(os.path.abspath(out))
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    try:
        bar = Progress("writing ranks", args.world_size, progress_wanted(args, nbytes))
        workers = _workers_within(args, ckpt)
        write_dcp(path, tmp, keys, args.world_size, workers=workers, progress=bar.update)
        bar.close()
        set_default_modes(tmp, [os.path.join(tmp, n) for n in os.listdir(tmp)])
        replace_dir(tmp, out, args.force, "dcp")
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
    from famp._fsdp.torch_save_writer import largest_piece, write_torch_save

    tmp = temp_path(args.full)  # its name, so that torch.save names the records as for args.full
    buffer = 64 * 2**20 if args.max_memory is None else min(64 * 2**20, int(args.max_memory))
    workers = 1 if args.workers is None else int(args.workers)
    try:
        if args.max_memory is not None and workers > 1:  # each worker: one piece and a buffer
            piece = largest_piece(Checkpoint(args.sources[0]))
            workers = max(1, min(workers, int(args.max_memory) // (piece + buffer)))
        write_torch_save(args.sources[0], tmp, buffer_bytes=buffer, workers=workers)
        set_default_modes(None, [tmp])
    except BaseException:
        discard(tmp)
        raise
    return tmp


class _LazyShards(Sequence[tuple[str, dict[str, Any]]]):
    """`(file name, shard)` per rank, each shard cut (as a compact copy) only when asked for."""

    def __init__(
        self, full: Mapping[str, Any], layout: FSDP2Layout, shapeless: Sequence[str], *, copy: bool
    ) -> None:
        self.full, self.layout, self.copy = full, layout, copy
        self.shapeless = set(shapeless)  # stand-ins in `layout`, recorded in no `sharding`
        self.width = max(5, len(str(layout.world_size - 1)))
        shard_optim_state(full, layout, 0)  # validate everything before any output

    def __len__(self) -> int:
        return self.layout.world_size

    def __getitem__(self, rank: int) -> tuple[str, dict[str, Any]]:  # type: ignore[override]
        if not 0 <= rank < len(self):
            raise IndexError(rank)
        shard = shard_optim_state(self.full, self.layout, rank, copy=self.copy)
        spec = {f: v for f, v in specs(self.layout).items() if f not in self.shapeless}
        shard[SHARDING] = sharding_entry(  # recorded, so that these files read back as a source
            {f: s for f, (s, _) in spec.items()}, {f: d for f, (_, d) in spec.items()}
        )
        return f"rank{rank:0{self.width}d}.pt", shard

    def __iter__(self) -> Iterator[tuple[str, dict[str, Any]]]:
        return (self[r] for r in range(len(self)))


def _write_ranks(
    ranks: Sequence[tuple[str, dict[str, Any]]],
    layout: FSDP2Layout,
    out: str,
    force: bool,
    progress: bool,
) -> list[RankStats]:
    parent, name = os.path.split(os.path.abspath(out))
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    stats = []
    try:
        bar = Progress("writing ranks", len(ranks), progress)
        for rank, (filename, shard) in enumerate(ranks):
            torch.save(shard, os.path.join(tmp, filename))
            stats.append(rank_stats(shard, layout, rank))
            bar.update(1)
        bar.close()
        set_default_modes(tmp, [os.path.join(tmp, n) for n in os.listdir(tmp)])
        replace_dir(tmp, out, force, "rank-files")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return stats


def _progress_on(args: argparse.Namespace, source: Source) -> bool:
    return progress_wanted(args, state_nbytes(source.full)[1])


def sharding_entry(shapes: Mapping[str, Sequence[int]], dims: Mapping[str, int]) -> dict[str, Any]:
    """A rank file's `sharding` entry: every parameter's global shape and shard dim."""
    return {f: {"shape": [int(n) for n in shape], "dim": dims[f]} for f, shape in shapes.items()}
