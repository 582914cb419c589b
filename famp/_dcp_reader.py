"""DCP's own storage reader and load planner, restricted for offline use in one process.

This is the only famp module that imports ``torch.distributed.checkpoint``. It runs no collective
and needs no process group: it drives DCP's ``FileSystemReader`` and a ``DefaultLoadPlanner``
through ``_load_state_dict(..., no_dist=True)``, the same path ``dcp_to_torch_save`` takes.
``famp/_dcp.py`` imports it lazily, on the first read, so ``import famp`` does not pay for DCP.

Two things differ from DCP's defaults, both so that an untrusted checkpoint is never unpickled:

* the ``.metadata`` file (a plain pickle) is read with an unpickler that builds only DCP's metadata
  classes, ``torch.Size``, dtypes, layouts and paths; anything else raises ``ValueError``;
* non-tensor items (``param_groups`` values) are read with ``torch.load(weights_only=True)``
  instead of DCP's ``weights_only=False``. Tensor items already are.

Storage paths in the metadata must stay inside the checkpoint directory, and the saved chunks of
every tensor that is read must tile it exactly (no gap, no overlap), so no element is left
uninitialized.
"""

from __future__ import annotations

import io
import itertools
import math
import os
import pathlib
import pickle
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

Path = tuple[str | int, ...]
"""A key's path in the nested state dict, e.g. ``("optim", "state", "0.weight", "exp_avg")``."""

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
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _RefusedGlobalError(ValueError):
    """A global that the metadata unpickler does not build."""


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes and plain data only."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and (
            name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return getattr(torch, name)
        msg = f"DCP .metadata refers to {module}.{name}, which famp does not unpickle"
        raise _RefusedGlobalError(msg)


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is read without arbitrary unpickling."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        if not os.path.isfile(path):
            raise ValueError(f"checkpoint_id {str(self.path)!r} is not a DCP checkpoint: no {path}")
        with self.fs.create_stream(path, "rb") as stream:
            try:
                metadata = _MetadataUnpickler(stream).load()
            except _RefusedGlobalError:
                raise
            except Exception as err:  # whatever a malformed pickle makes the unpickler raise
                msg = f"DCP metadata {str(path)!r} is not readable: {type(err).__name__}: {err}"
                raise ValueError(msg) from err
        if not isinstance(metadata, Metadata):
            raise ValueError(f"DCP metadata {str(path)!r} holds a {type(metadata).__name__}")
        for index, info in (metadata.storage_data or {}).items():
            rel = pathlib.PurePath(str(getattr(info, "relative_path", "")))
            if rel.is_absolute() or ".." in rel.parts or not rel.parts:
                raise ValueError(f"DCP item {index.fqn!r} points outside the checkpoint: {rel}")
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id  # as FileSystemReader.read_metadata does
        metadata.storage_meta = storage_meta
        return metadata


class OfflineLoadPlanner(DefaultLoadPlanner):
    """Rebuilds the saved entries under some path prefixes as full tensors and plain values.

    Like DCP's ``_EmptyStateDictLoadPlanner``, but selects entries by their unflattened path, reads
    non-tensor items with ``weights_only=True`` and reports progress.
    """

    def __init__(
        self, prefixes: Iterable[Path], progress: Callable[[int], None] | None = None
    ) -> None:
        super().__init__()
        self.prefixes = [tuple(p) for p in prefixes]
        self.progress = progress

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        if metadata is None:
            raise ValueError("DCP metadata is missing")
        for key, md, path in selected_entries(metadata, self.prefixes):
            if isinstance(md, TensorStorageMetadata):
                check_chunks_tile(key, md)
                value: Any = torch.empty(md.size, dtype=md.properties.dtype)
            else:
                value = md
            set_element(state_dict, path, value)
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise ValueError(
                f"DCP item {fqn!r} is not plain data; famp does not unpickle it"
            ) from err
        set_element(self.original_state_dict, self.mappings[fqn], obj)
        if self.progress is not None:
            self.progress(0)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        if self.progress is not None:
            self.progress(tensor.numel() * tensor.element_size())


def entry_path(metadata: Metadata, key: str) -> Path:
    """The unflattened path of a flattened metadata key."""
    planner_data = metadata.planner_data or {}
    return tuple(planner_data.get(key, (key,)))


def selected_entries(
    metadata: Metadata, prefixes: Iterable[Path]
) -> list[tuple[str, TensorStorageMetadata | BytesStorageMetadata, Path]]:
    """``(flat key, storage metadata, path)`` of every entry whose path starts with a prefix."""
    prefixes = [tuple(p) for p in prefixes]
    out = []
    for key, md in metadata.state_dict_metadata.items():
        path = entry_path(metadata, key)
        if any(path[: len(p)] == p for p in prefixes):
            out.append((key, md, path))
    return out


def check_chunks_tile(key: str, md: TensorStorageMetadata) -> None:
    """Raise ``ValueError`` unless the saved chunks of ``key`` cover it exactly once."""
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


def read_metadata(checkpoint_id: str | os.PathLike[str]) -> Metadata:
    """The checkpoint's metadata, read without arbitrary unpickling."""
    return SafeFileSystemReader(_existing_dir(checkpoint_id)).read_metadata()


def read_entries(
    checkpoint_id: str | os.PathLike[str],
    prefixes: Iterable[Path],
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """The nested state dict of every saved entry under ``prefixes``, tensors whole, on CPU."""
    path = _existing_dir(checkpoint_id)
    state_dict: dict[str, Any] = {}
    try:
        _load_state_dict(
            state_dict,
            storage_reader=SafeFileSystemReader(path),
            planner=OfflineLoadPlanner(prefixes, progress),
            no_dist=True,
        )
    except CheckpointException as err:  # DCP wraps what failed inside its steps
        (exc, _), *_ = err.failures.values()
        if isinstance(exc, (ValueError, KeyError, OSError)):
            raise exc from None
        raise ValueError(
            f"DCP checkpoint {path!r} is not readable: {type(exc).__name__}: {exc}"
        ) from exc
    return state_dict


def is_tensor_entry(md: object) -> bool:
    """Whether ``md`` describes a saved tensor (not pickled bytes)."""
    return isinstance(md, TensorStorageMetadata)


def _existing_dir(checkpoint_id: str | os.PathLike[str]) -> str:
    path = os.fspath(checkpoint_id)
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint_id {path!r} does not exist")
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint_id {path!r} is not a DCP checkpoint directory")
    return path
