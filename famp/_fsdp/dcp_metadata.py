"""A DCP checkpoint's `.metadata`, read without arbitrary unpickling and checked field by field.

The file is a plain pickle: an unpickler that builds only DCP's metadata classes (the public ones
of `torch.distributed.checkpoint.metadata`), `torch.Size`, dtypes, layouts and paths reads it;
then every entry's path, dtype, size and chunks and every storage record's file, offset and
length are checked, and the saved chunks of every tensor must tile it exactly (no gap, no
overlap). Any failure is a `ValueError` naming the file and the key. `dcp_reader.py` then checks
the records against the files' bytes.
"""

from __future__ import annotations

import itertools
import math
import os
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.serialization": {"_get_layout"},
    "collections": {"OrderedDict"},
}
# The checkpoint's path (`StorageMeta.checkpoint_id`). Python 3.13 pickles pathlib's classes as
# `pathlib._local.*` (pathlib became a package), earlier ones as `pathlib.*`: either is read as
# pathlib's public class, so a checkpoint saved under one Python reads under any other.
_PATH_MODULES = frozenset({"pathlib", "pathlib._local"})
_PATH_CLASSES = frozenset(
    {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"}
)


class StorageRecord:
    """Where one saved item lies: DCP's per-item storage info, rebuilt without DCP's class."""

    relative_path: Any = None
    offset: Any = None
    length: Any = None
    transform_descriptors: Any = None

    def __setstate__(self, state: object) -> None:
        if not isinstance(state, dict):
            raise ValueError(f"a storage record holds a {type(state).__name__}, not fields")
        self.__dict__.update(state)


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes and plain data only."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo":
            return StorageRecord
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module in _PATH_MODULES and name in _PATH_CLASSES:
            return getattr(pathlib, name)
        if module == "torch" and (
            name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return getattr(torch, name)
        raise ValueError(f"DCP .metadata refers to {module}.{name}, which famp does not unpickle")


def read_metadata(root: str) -> Metadata:
    """The `.metadata` of the checkpoint directory `root`, read and checked."""
    path = os.path.join(root, ".metadata")
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint_id {root!r} is not a DCP checkpoint: no {path}")
    with open(path, "rb") as stream:
        try:
            metadata = _MetadataUnpickler(stream).load()
        except ValueError as err:
            if "famp does not unpickle" in str(err):
                raise
            raise ValueError(f"DCP metadata {path!r} is not readable: {err}") from err
        except Exception as err:  # whatever a malformed pickle makes the unpickler raise
            why = error_reason(err)
            raise ValueError(f"DCP metadata {path!r} is not readable: {why}") from err
    if not isinstance(metadata, Metadata):
        raise ValueError(f"DCP metadata {path!r} holds a {type(metadata).__name__}")
    _check_metadata(metadata, path)
    return metadata


def _check_metadata(metadata: Metadata, where: str) -> None:
    """Raise `ValueError` naming the field unless `metadata` is well formed."""
    sdm = getattr(metadata, "state_dict_metadata", None)
    planner = getattr(metadata, "planner_data", None)
    storage = getattr(metadata, "storage_data", None)
    for name, value in (("state_dict_metadata", sdm), ("storage_data", storage)):
        if not isinstance(value, dict):
            raise ValueError(
                f"DCP metadata {where!r}: {name} is a {type(value).__name__}, not a dict"
            )
    if planner is not None and not isinstance(planner, dict):
        raise ValueError(f"DCP metadata {where!r}: planner_data is a {type(planner).__name__}")
    assert isinstance(sdm, dict)
    assert isinstance(storage, dict)
    for key, md in sdm.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"DCP metadata {where!r}: entry key {key!r} is not a non-empty str")
        if planner and key not in planner:  # DCP's planner lists every key it flattened
            raise ValueError(
                f"DCP metadata {where!r}: entry {key!r} has no path in planner_data, which "
                f"lists {len(planner)} others: the metadata is damaged (read as a top-level "
                "entry, it would drop out of the optimizer state silently)"
            )
        path = (planner or {}).get(key, (key,))
        if (
            not isinstance(path, (tuple, list))
            or not path
            or not all(type(p) in (str, int) for p in path)
            or not isinstance(path[0], str)
        ):
            raise ValueError(f"DCP metadata {where!r}: the path of {key!r} is malformed: {path!r}")
        if (joined := ".".join(map(str, path))) != key:  # DCP's flattening: the path, joined
            raise ValueError(
                f"DCP metadata {where!r}: entry {key!r} has the path {tuple(path)!r}, which DCP "
                f"stores under {joined!r}: the metadata's paths do not match its keys"
            )
        if isinstance(md, TensorStorageMetadata):
            _check_tensor_md(key, md, where)
        elif not isinstance(md, BytesStorageMetadata):
            raise ValueError(f"DCP metadata {where!r}: entry {key!r} is a {type(md).__name__}")
    for index, record in storage.items():
        fqn = getattr(index, "fqn", None)
        if not isinstance(index, MetadataIndex) or not isinstance(record, StorageRecord):
            raise ValueError(f"DCP metadata {where!r}: storage_data entry for {fqn!r} is malformed")
        rel, offset, length = record.relative_path, record.offset, record.length
        if not isinstance(rel, str) or not _inside(rel):
            raise ValueError(f"DCP item {fqn!r} points outside the checkpoint: {rel!r}")
        if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
            raise ValueError(
                f"DCP file {rel!r}: the record of {fqn!r} has offset {offset!r} and length "
                f"{length!r}; both must be ints >= 0"
            )
        if record.transform_descriptors:
            raise ValueError(
                f"DCP file {rel!r}: the record of {fqn!r} is stored through extensions "
                f"{record.transform_descriptors!r}, which famp does not read"
            )


def _inside(rel: str) -> bool:
    parts = rel.replace("\\", "/").split("/")
    return bool(rel) and not os.path.isabs(rel) and ".." not in parts and "\x00" not in rel


_INT64 = 2**63  # torch's sizes, offsets and strides are int64


def _is_index(value: object, ndim: int) -> bool:
    return (
        isinstance(value, (tuple, list))
        and len(value) == ndim
        and all(type(v) is int and 0 <= v < _INT64 for v in value)
    )


def _check_tensor_md(key: str, md: TensorStorageMetadata, where: str) -> None:
    props = getattr(md, "properties", None)
    size, chunks = getattr(md, "size", None), getattr(md, "chunks", None)
    if not isinstance(props, TensorProperties) or not isinstance(
        getattr(props, "dtype", None), torch.dtype
    ):
        raise ValueError(f"DCP metadata {where!r}: tensor {key!r} has no dtype ({props!r})")
    if not isinstance(size, tuple) or not _is_index(size, len(size)):
        raise ValueError(
            f"DCP metadata {where!r}: tensor {key!r} has size {size!r}; its dims must be ints "
            "from 0 to 2**63 - 1"
        )
    if math.prod(max(n, 1) for n in size) >= _INT64:  # torch.empty's strides overflow
        raise ValueError(
            f"DCP metadata {where!r}: tensor {key!r} has size {list(size)}, whose dims multiply "
            "(zeros counted as 1) past 2**63 - 1: no torch tensor has it"
        )
    if not isinstance(chunks, list) or not all(
        isinstance(c, ChunkStorageMetadata)
        and _is_index(getattr(c, "offsets", None), len(size))
        and _is_index(getattr(c, "sizes", None), len(size))
        for c in chunks
    ):
        raise ValueError(
            f"DCP metadata {where!r}: tensor {key!r} has malformed chunks (offsets and sizes "
            "must be one int from 0 to 2**63 - 1 per dim)"
        )
    check_chunks_tile(key, md)


def check_chunks_tile(key: str, md: TensorStorageMetadata) -> None:
    """Raise `ValueError` unless the saved chunks of `key` cover it exactly once."""
    size = tuple(md.size)
    total = math.prod(size)
    boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks if math.prod(c.sizes) > 0]
    for offsets, sizes in boxes:
        if len(offsets) != len(size) or any(
            o < 0 or o + s > n for o, s, n in zip(offsets, sizes, size, strict=True)
        ):
            raise ValueError(
                f"DCP tensor {key!r} of size {list(size)} has a chunk outside it: "
                f"offsets {list(offsets)}, sizes {list(sizes)}"
            )
    covered = sum(math.prod(s) for _, s in boxes)
    if covered == total and _disjoint(boxes):
        return
    raise ValueError(
        f"DCP tensor {key!r} of size {list(size)}: its saved chunks cover {covered} of {total} "
        "elements or overlap"
    )


def _disjoint(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    slabs = all(len(o) > 0 and not any(o[1:]) for o, _ in boxes)
    if slabs and len({s[1:] for _, s in boxes}) <= 1:  # dim-0 slabs (FSDP2): sort, O(k log k)
        rows = sorted((o[0], o[0] + s[0]) for o, s in boxes)
        return all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(rows))
    return all(
        any(ao + asz <= bo or bo + bsz <= ao for ao, asz, bo, bsz in zip(a, sa, b, sb, strict=True))
        for i, (a, sa) in enumerate(boxes)
        for b, sb in boxes[i + 1 :]
    )


def error_reason(err: BaseException) -> str:
    """A short reason for what unpickling damaged bytes raised, for an error message."""
    if isinstance(err, EOFError):
        return "it ends early (truncated or damaged)"
    text = next((ln.strip() for ln in str(err).splitlines() if ln.strip()), "")
    if not text or "weights_only" in text:
        return f"{type(err).__name__} (damaged bytes)"
    return text[:200]


def is_tensor_entry(md: object) -> bool:
    """Whether `md` describes a saved tensor (not pickled bytes)."""
    return isinstance(md, TensorStorageMetadata)
