"""Type aliases shared by famp's modules."""

from __future__ import annotations

from typing import Any, TypeAlias, TypeVar

import torch

PyTree: TypeAlias = Any
"""Any optree/torch pytree: nested tuples, lists, dicts, namedtuples, registered nodes."""

TreeT = TypeVar("TreeT")
"""Same tree in, same tree out."""

Tensor: TypeAlias = torch.Tensor
DeviceLike: TypeAlias = "torch.device | str | int | None"
DTypeLike: TypeAlias = "torch.dtype | str"
