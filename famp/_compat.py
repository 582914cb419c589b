"""Every private torch name famp uses, in one place, each with the reason it is needed.

famp follows the installed torch: public API wherever torch has one. Where it has none, the private
name is imported here, and only here, so that a torch upgrade that moves it breaks one module (and
the tests that pin it across the supported window), never a user's numbers.
"""

from __future__ import annotations

# --- reliability: scaler state (_scaler.py), FSDP1 layouts read off live models (_distributed.py)
from typing import Any as _Any

import optree as _optree
import torch as _torch
import torch.utils._pytree as _torch_pytree

# optree's public registration needs a namespace, and a namespaced node is one opaque leaf to
# every optree call that does not pass that namespace: ScalerState registers in the global
# registry (the one builtins live in) so that plain `optree.tree_map(f, state)` sees its tensors.
OPTREE_GLOBAL_NAMESPACE: str = getattr(_optree.registry, "__GLOBAL_NAMESPACE")

# torch has no public pytree module: ScalerState must be a node of torch's own pytree for
# torch.func, torch.compile inputs/outputs and torch.export (treespec_dumps).
torch_pytree = _torch_pytree

# The functional form of GradScaler's update kernel; famp's update is bit-exact with it because it
# calls it (there is no public functional name for it).
amp_update_scale = _torch.ops.aten._amp_update_scale


def functorch_transforms_active() -> bool:
    """Whether a torch.func transform is active: the update kernel has no vmap batching rule."""
    return bool(_torch._C._are_functorch_transforms_active())


def fsdp1_flat_params(module: _Any) -> _Any:
    """An FSDP1 unit's flat-parameter handle, or None for a unit without parameters of its own.

    FSDP1 exposes no public accessor for the flat parameter's original names and shapes, its
    compute dtype or its ``use_orig_params`` flag; ``layout_of`` needs all four.
    """
    return module._handle


def fsdp1_unit_settings(handle: _Any) -> tuple[list[str], list[tuple[int, ...]], _Any, bool]:
    """``(fqns, shapes, compute dtype, use_orig_params)`` of an FSDP1 handle (see above)."""
    flat = handle.flat_param
    shapes = [tuple(s) for s in flat._shapes]
    return list(flat._fqns), shapes, handle._fwd_bwd_param_dtype, bool(handle._use_orig_params)


# --- checkpoints (famp/_dcp_writer.py) -------------------------------------------------------


def dcp_storage_info(relative_path: str, offset: int, length: int) -> object:
    """DCP's per-item storage record, for a ``.metadata`` that ``dcp.load`` reads.

    ``FileSystemReader`` looks up each item's byte range in ``Metadata.storage_data`` as an
    instance of this class (unpickled by name); torch has no public constructor for it. Imported
    lazily: ``torch.distributed.checkpoint`` is heavy.
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path, offset, length)
