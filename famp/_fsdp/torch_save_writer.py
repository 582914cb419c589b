"""`dcp_to_torch_save`'s file written offline, streamed: one saved chunk in memory at a time.

`torch.save` writes the nested dict with every tensor a placeholder whose bytes are skipped;
then each tensor's bytes are written into its zip record, chunk by chunk, and what torch derives
from them is set (`zip_records.py`: the records' CRC-32s and the file's serialization id), so
the file equals, byte for byte, what `dcp_to_torch_save` writes to the same name (`torch.save`
names the records after the file: `full.pt` holds `full/data.pkl`, ...). Records are disjoint
byte ranges of one file: `workers` processes may write shares of them in parallel.
"""

from __future__ import annotations

import concurrent.futures
import math
import multiprocessing
import os
import struct
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from famp._fsdp.dcp_paths import set_element
from famp._fsdp.dcp_reader import Checkpoint
from famp._fsdp.zip_records import set_crcs, set_serialization_id


def write_torch_save(
    root: str,
    path: str,
    *,
    buffer_bytes: int = 64 * 2**20,
    workers: int = 1,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Write what `dcp_to_torch_save(root, path)` writes, holding one saved chunk at a time.

    `torch.save` first writes the whole nested dict with every tensor a placeholder whose bytes
    are skipped (`torch.serialization.skip_data`; `torch.empty` pages are never touched, so
    they cost no memory); then each tensor's bytes are written into its record, chunk by chunk,
    through a buffer of `buffer_bytes`, and the records' CRC-32 fields are set. With
    `workers` > 1, that many processes write disjoint shares of the records (balanced by
    bytes); the file is the same for any number.
    """
    ckpt = Checkpoint(root)
    entries = ckpt.entries([()])  # every entry, in the metadata's order
    ckpt.check_records(k for k, _, _ in entries)
    tree: dict[str, Any] = {}
    tensors: list[tuple[str, TensorStorageMetadata, torch.Tensor]] = []
    for key, md, p in entries:
        if isinstance(md, TensorStorageMetadata):
            placeholder = torch.empty(md.size, dtype=md.properties.dtype)
            tensors.append((key, md, placeholder))
            set_element(tree, p, placeholder)
        else:
            set_element(tree, p, ckpt.read(key))
    with torch.serialization.skip_data(), warnings.catch_warnings():
        # A meta tensor (inside a tuple) has no data to skip: torch warns that skipping is a no-op.
        warnings.filterwarnings("ignore", "Serializing tensors on the meta device", UserWarning)
        torch.save(tree, path)
    by_id = {id(t): (key, md) for key, md, t in tensors}
    jobs: list[tuple[str, int, str, int]] = []  # record name, data offset, key, bytes
    in_memory: list[tuple[str, int, torch.Tensor]] = []  # record name, data offset, bytes
    with open(path, "rb") as f, zipfile.ZipFile(path) as zf:
        infos = {info.filename: info for info in zf.infolist()}
        prefix = next(n for n in infos if n.endswith("/data.pkl"))[: -len("data.pkl")]
        records = _storages(tree)  # storage keys "0", "1", ... in this order
        if len(records) != sum(n.startswith(f"{prefix}data/") for n in infos):
            raise AssertionError("tensors pickled in an unexpected order")
        for storage_key, tensor in enumerate(records):
            info = infos[f"{prefix}data/{storage_key}"]
            data = None if id(tensor) in by_id else _storage_bytes(tensor)
            nbytes = tensor.numel() * tensor.element_size() if data is None else data.numel()
            if info.file_size != nbytes:
                raise AssertionError(f"record {info.filename} holds {info.file_size} bytes")
            f.seek(info.header_offset + 26)
            name_len, extra_len = struct.unpack("<HH", f.read(4))
            offset = info.header_offset + 30 + name_len + extra_len
            if data is None:
                jobs.append((info.filename, offset, by_id[id(tensor)][0], nbytes))
            else:  # a tensor inside a non-tensor item (betas=(tensor, tensor)): read already
                in_memory.append((info.filename, offset, data))
    largest = max((job[3] for job in jobs), default=1)
    buffer_bytes = max(1, min(buffer_bytes, largest))
    crcs: dict[str, int] = {}
    with open(path, "r+b") as f:
        for record, start, data in in_memory:
            f.seek(start)
            crcs[record] = _write_bytes(f, data, bytearray(max(1, data.numel())), 0)
    if workers <= 1 or len(jobs) <= 1:
        crcs.update(_write_records(root, path, jobs, buffer_bytes, progress))
    else:
        # Records are disjoint byte ranges of one file: each worker writes its own share of
        # them in place and returns their CRC-32s; the bytes do not depend on who wrote them.
        shares: list[list[tuple[str, int, str, int]]] = [[] for _ in range(workers)]
        loads = [0] * workers
        for job in sorted(jobs, key=lambda j: -j[3]):
            least = loads.index(min(loads))
            shares[least].append(job)
            loads[least] += job[3]
        context = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
            futures = {
                pool.submit(_write_records, root, path, share, buffer_bytes): load
                for share, load in zip(shares, loads, strict=True)
                if share
            }
            for future in concurrent.futures.as_completed(futures):
                crcs.update(future.result())
                if progress is not None:
                    progress(futures[future])
    with open(path, "r+b") as f, zipfile.ZipFile(path) as zf:
        set_crcs(f, zf, crcs)
    set_serialization_id(path, crcs)


def _write_records(
    root: str,
    path: str,
    jobs: Sequence[tuple[str, int, str, int]],
    buffer_bytes: int,
    progress: Callable[[int], None] | None = None,
) -> dict[str, int]:
    """Write each `(record, offset, key, _)` tensor's bytes at `offset`; return the CRC-32s."""
    ckpt = Checkpoint(root)
    buffer = bytearray(buffer_bytes)
    crcs: dict[str, int] = {}
    with open(path, "r+b") as f:
        for record, start, key, _ in jobs:
            md = ckpt.metadata.state_dict_metadata[key]
            assert isinstance(md, TensorStorageMetadata)
            crc = 0
            for byte_offset, data in _row_slabs(ckpt, key, md):
                f.seek(start + byte_offset)
                crc = _write_bytes(f, data, buffer, crc)
                if progress is not None:
                    progress(data.numel() * data.element_size())
            crcs[record] = crc
    return crcs


def _pickling_order(obj: Any, out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Tensors in the order `pickle` meets them: a dict's keys and values in insertion order,
    lists, tuples and sets in their iteration order."""
    out = [] if out is None else out
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            _pickling_order(key, out)
            _pickling_order(value, out)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for value in obj:
            _pickling_order(value, out)
    return out


def _storages(tree: Any) -> list[torch.Tensor]:
    """A tensor of each storage `torch.save` writes a record for, in the records' order.

    `pickle` saves a tensor object once (later references are memo hits), and `torch.save`
    writes a storage once: tensors read from one non-tensor item may share one (views).
    Placeholders own their storages; a storage of no bytes is told apart by its tensor. A meta
    tensor (plain data to DCP, inside a tuple) is pickled without a storage: no record.
    """
    seen: set[tuple[str, int]] = set()
    records = []
    for tensor in _pickling_order(tree):
        if tensor.device.type == "meta":
            continue
        storage = tensor.untyped_storage()
        idents = {("tensor", id(tensor))}
        if storage.nbytes():
            idents.add(("storage", storage.data_ptr()))
        if not idents & seen:
            records.append(tensor)
        seen |= idents
    return records


def _storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of `tensor`'s whole storage (what `torch.save` writes), as a uint8 tensor."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))


def _row_slabs(
    ckpt: Checkpoint, key: str, md: TensorStorageMetadata
) -> Iterator[tuple[int, torch.Tensor]]:
    """`(byte offset, contiguous tensor)` pieces of `key` in row-major order, lazily.

    Saved chunks that are whole rows (dim-0 slabs: FSDP2) are written as they are read; any
    other chunking is assembled whole first.
    """
    size = tuple(md.size)
    chunks = [c for c in md.chunks if math.prod(c.sizes) > 0]
    row_bytes = math.prod(size[1:]) * md.properties.dtype.itemsize if size else 0
    if _is_slabs(md):
        for chunk in chunks:
            yield chunk.offsets[0] * row_bytes, ckpt.read_chunk(key, md, chunk).contiguous()
    else:
        yield 0, ckpt.read_tensor(key, md)


def _is_slabs(md: TensorStorageMetadata) -> bool:
    """Whether `md`'s saved chunks are whole rows (dim-0 slabs), written as they are read."""
    size = tuple(md.size)
    chunks = [c for c in md.chunks if math.prod(c.sizes) > 0]
    return bool(size) and all(
        tuple(c.sizes[1:]) == size[1:] and not any(c.offsets[1:]) for c in chunks
    )


def largest_piece(ckpt: Checkpoint) -> int:
    """The most bytes `write_torch_save` holds at once for one tensor of `ckpt`.

    A saved chunk for dim-0 slabs; the whole tensor for any other chunking (assembled first).
    """
    largest = 1
    for md in ckpt.metadata.state_dict_metadata.values():
        if isinstance(md, TensorStorageMetadata):
            itemsize = md.properties.dtype.itemsize
            if _is_slabs(md):
                sizes = [math.prod(c.sizes) for c in md.chunks]
                largest = max(largest, max(sizes, default=0) * itemsize)
            else:
                largest = max(largest, math.prod(md.size) * itemsize)
    return largest


def _write_bytes(f: Any, data: torch.Tensor, buffer: bytearray, crc: int) -> int:
    """Write `data`'s bytes at `f`'s position; return the running CRC-32."""
    flat = data.reshape(-1).view(torch.uint8) if data.dim() else data.reshape(1).view(torch.uint8)
    try:  # numpy exposes the tensor's own memory: no copy (torch does not need numpy)
        view = memoryview(flat.numpy())  # type: ignore[arg-type]
    except (ImportError, RuntimeError, TypeError):
        view = None
    if view is not None:
        f.write(view)
        return zlib.crc32(view, crc)
    step = len(buffer)
    for start in range(0, flat.numel(), step):
        n = min(step, flat.numel() - start)
        chunk = memoryview(buffer)[:n]
        torch.frombuffer(chunk, dtype=torch.uint8).copy_(flat[start : start + n])
        f.write(chunk)
        crc = zlib.crc32(chunk, crc)
    return crc
