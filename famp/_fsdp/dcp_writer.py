"""A DCP checkpoint re-chunked for W ranks, written offline, one output rank at a time.

What `dcp.load` reads does not depend on how the saved chunks are cut: it copies from every
saved chunk that overlaps what a rank asks for. famp therefore writes every tensor of one
dimension or more as FSDP2's dim-0 `torch.chunk` over W ranks, rank `r`'s chunks in
`__<r>_0.distcp`, and 0-d tensors and non-tensor items whole in `__0_0.distcp` (their
records are copied byte for byte after they are read and checked). Paths, dtypes and
`planner_data` are the source's: a nested or flattened optimizer state stays what it was, and
a job on W ranks loads the output as it would load the source.

Each output rank reads only the saved chunks that overlap its rows and holds one saved chunk
and one output chunk at a time, so memory stays within about twice the largest saved chunk. The
ranks are independent: `workers` processes write them in parallel, and the files do not
depend on how many.
"""

from __future__ import annotations

import concurrent.futures
import math
import multiprocessing
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from famp import _compat
from famp._fsdp.dcp_reader import Checkpoint

Box = tuple[tuple[int, ...], tuple[int, ...]]
Record = tuple[str, int, int]  # relative path, offset, length


def rank_boxes(size: Sequence[int], world_size: int) -> list[Box | None]:
    """Each rank's `(offsets, sizes)` of a tensor of `size`: FSDP2's dim-0 `torch.chunk`."""
    if len(size) == 0:
        return [((), ())] + [None] * (world_size - 1)
    rows = size[0]
    step = max(1, math.ceil(rows / world_size))
    boxes: list[Box | None] = []
    for r in range(world_size):
        start, stop = min(rows, r * step), min(rows, (r + 1) * step)
        rest = tuple(size[1:])
        boxes.append(((start, *([0] * len(rest))), (stop - start, *rest)) if stop > start else None)
    if all(b is None for b in boxes):  # a tensor with no element: one empty chunk on rank 0
        boxes[0] = (tuple([0] * len(size)), tuple(size))
    return boxes


def _plan(
    ckpt: Checkpoint, keys: Sequence[str], world_size: int
) -> list[list[tuple[str, Box | None]]]:
    """Per output rank, the `(key, box)` it writes (box None: a non-tensor item)."""
    plan: list[list[tuple[str, Box | None]]] = [[] for _ in range(world_size)]
    for key in keys:
        md = ckpt.metadata.state_dict_metadata[key]
        if isinstance(md, TensorStorageMetadata):
            for r, box in enumerate(rank_boxes(tuple(md.size), world_size)):
                if box is not None:
                    plan[r].append((key, box))
        else:
            plan[0].append((key, None))
    return plan


def _write_rank(
    root: str, out_dir: str, rank: int, items: Sequence[tuple[str, Box | None]]
) -> list[Record]:
    """Write rank `rank`'s file; return each item's record, in `items` order."""
    ckpt = Checkpoint(root)
    name = f"__{rank}_0.distcp"
    records: list[Record] = []
    with open(os.path.join(out_dir, name), "wb") as f:
        for key, box in items:
            offset = f.tell()
            if box is None:
                ckpt.read(key)  # checked: plain data only
                f.write(ckpt.raw_bytes(key))
            else:
                md = ckpt.metadata.state_dict_metadata[key]
                assert isinstance(md, TensorStorageMetadata)
                torch.save(ckpt.read_region(key, md, *box), f)
            records.append((name, offset, f.tell() - offset))
    return records


def write_dcp(
    root: str,
    out_dir: str,
    keys: Sequence[str],
    world_size: int,
    *,
    workers: int = 1,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Write the entries `keys` of checkpoint `root` to `out_dir` for `world_size` ranks."""
    ckpt = Checkpoint(root)
    ckpt.check_records(keys)
    plan = _plan(ckpt, keys, world_size)
    results: list[list[Record]] = [[] for _ in range(world_size)]
    if workers <= 1:
        for rank in range(world_size):
            results[rank] = _write_rank(root, out_dir, rank, plan[rank])
            if progress is not None:
                progress(1)
    else:
        context = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
            futures = {
                pool.submit(_write_rank, root, out_dir, rank, plan[rank]): rank
                for rank in range(world_size)
            }
            for future in concurrent.futures.as_completed(futures):
                results[futures[future]] = future.result()
                if progress is not None:
                    progress(1)
    _write_metadata(ckpt, out_dir, keys, plan, results)


def _write_metadata(
    ckpt: Checkpoint,
    out_dir: str,
    keys: Sequence[str],
    plan: list[list[tuple[str, Box | None]]],
    results: list[list[Record]],
) -> None:
    source = ckpt.metadata
    chunks: dict[str, list[ChunkStorageMetadata]] = {k: [] for k in keys}
    storage: dict[MetadataIndex, object] = {}
    for items, records in zip(plan, results, strict=True):
        for (key, box), (name, offset, length) in zip(items, records, strict=True):
            if box is None:
                index = MetadataIndex(key)
            else:
                offsets, sizes = torch.Size(box[0]), torch.Size(box[1])
                index = MetadataIndex(key, offsets, len(chunks[key]))
                chunks[key].append(ChunkStorageMetadata(offsets=offsets, sizes=sizes))
            storage[index] = _compat.dcp_storage_info(name, offset, length)
    state_dict_metadata: dict[str, Any] = {}
    for key in keys:
        md = source.state_dict_metadata[key]
        if isinstance(md, TensorStorageMetadata):
            md = TensorStorageMetadata(properties=md.properties, size=md.size, chunks=chunks[key])
        state_dict_metadata[key] = md
    planner = source.planner_data or {}
    metadata = Metadata(
        state_dict_metadata=state_dict_metadata,
        planner_data={k: planner[k] for k in keys if k in planner},
        storage_data=storage,
        version=getattr(source, "version", None),
    )
    with open(os.path.join(out_dir, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)
