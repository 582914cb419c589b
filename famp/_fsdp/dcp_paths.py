"""Paths of DCP entries: a flat metadata key's path in the nested state dict, and nesting by path.

DCP flattens a nested state dict to keys such as `optim.state.0.weight.exp_avg` and records each
key's path (`("optim", "state", "0.weight", "exp_avg")`) in the metadata's `planner_data`;
`set_element` puts a value back at its path (int keys make lists), as DCP nests entries.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

Path = tuple[str | int, ...]
"""A key's path in the nested state dict, e.g. `("optim", "state", "0.weight", "exp_avg")`."""


def entry_path(metadata: Metadata, key: str) -> Path:
    """The unflattened path of a flattened metadata key."""
    planner_data = metadata.planner_data or {}
    return tuple(planner_data.get(key, (key,)))


def set_element(root: dict[str, Any], path: Path, value: Any) -> None:
    """Put `value` at `path` in `root`, as DCP nests entries (int keys make lists)."""
    container: Any = root
    for key, nxt in itertools.pairwise(path):
        container = _child(container, key, [] if type(nxt) is int else {}, path)
    _put(container, path[-1], value, path)


def _child(container: Any, key: str | int, default: Any, path: Path) -> Any:
    _put(container, key, None, path, only_if_missing=True)
    child = container[key]
    if child is None:
        container[key] = child = default
    if type(child) is not type(default):
        raise ValueError(f"DCP entry {'.'.join(map(str, path))!r} conflicts with another entry")
    return child


def _put(
    container: Any, key: str | int, value: Any, path: Path, only_if_missing: bool = False
) -> None:
    if isinstance(container, dict) and type(key) is str:
        if not only_if_missing or key not in container:
            container[key] = value
    elif isinstance(container, list) and type(key) is int:
        if key > 1_000_000:
            raise ValueError(f"DCP entry {'.'.join(map(str, path))!r}: list index {key} too large")
        container.extend([None] * (key + 1 - len(container)))
        if not only_if_missing or container[key] is None:
            container[key] = value
    else:
        raise ValueError(f"DCP entry {'.'.join(map(str, path))!r} conflicts with another entry")
