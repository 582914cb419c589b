"""A DCP checkpoint read offline, in one process, trusting nothing in it.

famp reads DCP's on-disk format itself (the public metadata classes of
`torch.distributed.checkpoint.metadata`; each saved item is a `torch.save` record at a byte
range of a `.distcp` file) instead of driving DCP's loader, so that every fact the metadata
states is checked against the bytes before it is used:

* `.metadata` (a plain pickle) is read by an unpickler that builds only DCP's metadata classes,
  `torch.Size`, dtypes, layouts and paths; its structure is then checked field by field;
* every storage path stays inside the checkpoint directory, names a regular file (a symlink
  whose target lies outside the directory is refused) and every byte range lies inside its file;
* every tensor record is read with `torch.load(weights_only=True)` and must hold exactly the
  dtype and the chunk shape the metadata states (DCP itself casts silently), on the CPU (a meta
  tensor holds no data); non-tensor items
  are read with `torch.load(weights_only=True)` (DCP uses `weights_only=False`);
* the saved chunks of every tensor must tile it exactly (no gap, no overlap).

Any failure is a `ValueError` (`FileNotFoundError` for a missing directory) naming the file
and the key. DCP stores no checksums: flipped payload bytes read as wrong values, as in torch.
The metadata is read and checked by `dcp_metadata.py`. `dcp.py` imports both lazily, on the
first read, so `import famp` does not pay for `torch.distributed.checkpoint`.
"""

from __future__ import annotations

import io
import math
import os
import pickle
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from famp._fsdp.dcp_metadata import StorageRecord, error_reason, read_metadata
from famp._fsdp.dcp_paths import Path, entry_path, set_element


class Checkpoint:
    """A DCP checkpoint directory whose metadata has been read and checked."""

    def __init__(self, checkpoint_id: str | os.PathLike[str]) -> None:
        self.root = _existing_dir(checkpoint_id)
        self.metadata = read_metadata(self.root)
        self._sizes: dict[str, int] = {}
        self._chunk_bytes: dict[str, dict[tuple[int, ...], int]] = {}  # key -> offsets -> bytes

    def entries(
        self, prefixes: Iterable[Path]
    ) -> list[tuple[str, TensorStorageMetadata | BytesStorageMetadata, Path]]:
        """`(flat key, storage metadata, path)` of every entry whose path starts with a prefix."""
        prefixes = [tuple(p) for p in prefixes]
        out = []
        for key, md in self.metadata.state_dict_metadata.items():
            path = entry_path(self.metadata, key)
            if any(path[: len(p)] == p for p in prefixes):
                out.append((key, md, path))
        return out

    def check_records(self, keys: Iterable[str]) -> None:
        """Check, from the metadata and the files' sizes, every record that `keys` read."""
        for key in keys:
            for index in self._indices(key):
                self._record(key, index)

    def read(self, key: str) -> Any:
        """The entry `key`: a whole tensor assembled from its chunks, or a plain value."""
        md = self.metadata.state_dict_metadata[key]
        if isinstance(md, BytesStorageMetadata):
            return self._load(key, MetadataIndex(key), "item", plain=True)
        return self.read_tensor(key, md)

    def read_tensor(self, key: str, md: TensorStorageMetadata) -> torch.Tensor:
        """The tensor `key` assembled whole, on CPU, in its saved dtype."""
        dtype, size = md.properties.dtype, torch.Size(md.size)
        chunks = [c for c in md.chunks if math.prod(c.sizes) > 0]
        if len(chunks) == 1 and tuple(chunks[0].sizes) == tuple(size):
            return self.read_chunk(key, md, chunks[0]).contiguous()
        out = torch.empty(size, dtype=dtype)
        for chunk in chunks:
            view = out
            for dim, (o, s) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
                view = view.narrow(dim, o, s)
            view.copy_(self.read_chunk(key, md, chunk))
        return out

    def read_region(
        self,
        key: str,
        md: TensorStorageMetadata,
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
    ) -> torch.Tensor:
        """The box `offsets`/`sizes` of tensor `key`, reading only the chunks it overlaps."""
        out: torch.Tensor | None = None
        for chunk in md.chunks:
            if math.prod(chunk.sizes) == 0:
                continue
            lo = [max(o, c) for o, c in zip(offsets, chunk.offsets, strict=True)]
            hi = [
                min(o + s, c + cs)
                for o, s, c, cs in zip(offsets, sizes, chunk.offsets, chunk.sizes, strict=True)
            ]
            if any(a >= b for a, b in zip(lo, hi, strict=True)):
                continue
            saved = self.read_chunk(key, md, chunk)
            if tuple(chunk.offsets) == tuple(offsets) and tuple(chunk.sizes) == tuple(sizes):
                return saved.contiguous()
            if out is None:
                out = torch.empty(sizes, dtype=md.properties.dtype)
            src, dst = saved, out
            for dim, (a, b) in enumerate(zip(lo, hi, strict=True)):
                src = src.narrow(dim, a - chunk.offsets[dim], b - a)
                dst = dst.narrow(dim, a - offsets[dim], b - a)
            dst.copy_(src)
            del saved, src
        return out if out is not None else torch.empty(sizes, dtype=md.properties.dtype)

    def raw_bytes(self, key: str) -> bytes:
        """The stored bytes of the item `key`, as checked by `_record`."""
        record = self._record(key, MetadataIndex(key))
        with open(os.path.join(self.root, record.relative_path), "rb") as f:
            f.seek(record.offset)
            return f.read(record.length)

    def read_chunk(
        self, key: str, md: TensorStorageMetadata, chunk: ChunkStorageMetadata
    ) -> torch.Tensor:
        """One saved chunk of `key`, checked against its metadata."""
        where = f"tensor {key!r} (chunk at offsets {list(chunk.offsets)})"
        value = self._load(key, MetadataIndex(key, chunk.offsets), where, plain=False)
        rel = self._record(key, MetadataIndex(key, chunk.offsets)).relative_path
        if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
            raise ValueError(
                f"DCP file {rel!r}: the record of {where} holds a {type(value).__name__}, "
                "not a dense tensor"
            )
        if value.device.type != "cpu":  # read with map_location="cpu": a meta tensor stays one
            raise ValueError(
                f"DCP file {rel!r}: the record of {where} holds a tensor on device "
                f"{value.device.type!r}, which has no data to read (the saved state dict still "
                "held it there; torch's dcp.load refuses it too)"
            )
        if value.dtype != md.properties.dtype:
            raise ValueError(
                f"DCP file {rel!r}: the record of {where} holds {value.dtype} data where the "
                f"metadata says {md.properties.dtype}"
            )
        if tuple(value.shape) != tuple(chunk.sizes):
            raise ValueError(
                f"DCP file {rel!r}: the record of {where} holds shape {list(value.shape)} where "
                f"the metadata says {list(chunk.sizes)}"
            )
        # A record may say requires_grad (one bit of its pickle) or hold an nn.Parameter: the
        # state holds plain values, as torch's dcp.load copies them into plain tensors.
        return value.detach() if value.requires_grad or type(value) is not torch.Tensor else value

    def _indices(self, key: str) -> list[MetadataIndex]:
        md = self.metadata.state_dict_metadata[key]
        if isinstance(md, BytesStorageMetadata):
            return [MetadataIndex(key)]
        return [MetadataIndex(key, c.offsets) for c in md.chunks if math.prod(c.sizes) > 0]

    def _record(self, key: str, index: MetadataIndex) -> StorageRecord:
        record: StorageRecord | None = self.metadata.storage_data.get(index)
        if record is None:
            raise ValueError(f"DCP metadata has no storage record for {key!r} at {index.offset}")
        rel = record.relative_path
        if rel not in self._sizes:
            self._sizes[rel] = _file_size(self.root, rel)
        end, md = record.offset + record.length, self.metadata.state_dict_metadata.get(key)
        if isinstance(md, TensorStorageMetadata):  # before any allocation of what it claims
            if key not in self._chunk_bytes:  # once per key: a tensor may have many chunks
                size = md.properties.dtype.itemsize
                self._chunk_bytes[key] = {
                    tuple(c.offsets): math.prod(c.sizes) * size for c in md.chunks
                }
            need = self._chunk_bytes[key].get(tuple(index.offset or ()), 0)
            if record.length < need:
                raise ValueError(
                    f"DCP file {rel!r}: the record of {key!r} at {tuple(index.offset or ())} "
                    f"holds {record.length} bytes, fewer than the {need} its chunk's metadata "
                    "claims: the metadata does not describe the file"
                )
        if end > self._sizes[rel]:
            raise ValueError(
                f"DCP file {rel!r}: the record of {key!r} spans bytes {record.offset}..{end}, "
                f"past the file's end ({self._sizes[rel]} bytes): the file is truncated"
            )
        return record

    def _load(self, key: str, index: MetadataIndex, where: str, *, plain: bool) -> Any:
        record = self._record(key, index)
        rel = record.relative_path
        with open(os.path.join(self.root, rel), "rb") as f:
            window = _Window(f, record.offset, record.length)
            try:
                return torch.load(window, map_location="cpu", weights_only=True)  # type: ignore[arg-type]
            except pickle.UnpicklingError as err:
                what = "is not plain data" if plain else "is not a plain tensor"
                raise ValueError(
                    f"DCP file {rel!r}: {where} {key!r} {what}; famp does not unpickle it"
                ) from err
            except Exception as err:  # whatever damaged bytes make torch.load raise
                raise ValueError(
                    f"DCP file {rel!r}: the record of {where} {key!r} "
                    f"(bytes {record.offset}..{record.offset + record.length}) is not a torch.save "
                    f"record: {error_reason(err)}"
                ) from err


class _Window(io.RawIOBase):
    """The byte range `[offset, offset + length)` of an open file, as a seekable file."""

    def __init__(self, f: io.BufferedReader, offset: int, length: int) -> None:
        super().__init__()
        self.f, self.offset, self.length, self.pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = max(0, base + pos)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        self.f.seek(self.offset + self.pos)
        got = self.f.readinto(memoryview(buffer)[:n]) or 0
        self.pos += got
        return got


def _file_size(root: str, rel: str) -> int:
    path = os.path.join(root, rel)
    target, top = os.path.realpath(path), os.path.realpath(root)
    if os.path.commonpath([target, top]) != top:  # a symlink on the way: the file or a folder
        raise ValueError(
            f"DCP file {rel!r} resolves to {target!r}, outside the checkpoint directory "
            "(through a symlink); famp does not follow it"
        )
    if not os.path.isfile(path):
        raise ValueError(f"DCP file {rel!r} named by the metadata is missing from {root!r}")
    return os.path.getsize(path)


def iter_entries(
    ckpt: Checkpoint,
    prefixes: Iterable[Path],
    progress: Callable[[int], None] | None = None,
) -> Iterator[tuple[Path, Any]]:
    """`(path, value)` of every entry under `prefixes`, in the metadata's order, one at a time.

    Every record is checked against the files' sizes before the first is read.
    """
    selected = ckpt.entries(prefixes)
    ckpt.check_records(k for k, _, _ in selected)
    for key, _, path in selected:
        value = ckpt.read(key)
        if progress is not None:
            progress(value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0)
        yield path, value


def read_entries(
    checkpoint_id: str | os.PathLike[str],
    prefixes: Iterable[Path],
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """The nested state dict of every saved entry under `prefixes`, tensors whole, on CPU."""
    state_dict: dict[str, Any] = {}
    for path, value in iter_entries(Checkpoint(checkpoint_id), prefixes, progress):
        set_element(state_dict, path, value)
    return state_dict


def _existing_dir(checkpoint_id: str | os.PathLike[str]) -> str:
    path = os.fspath(checkpoint_id) if isinstance(checkpoint_id, str | os.PathLike) else None
    if not isinstance(path, str):
        raise TypeError(f"checkpoint_id must be a str or os.PathLike path, got {checkpoint_id!r}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint_id {path!r} does not exist")
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint_id {path!r} is not a DCP checkpoint directory")
    return path
