"""The one module that talks to ``torch.distributed``.

Every other famp module is pure and runs in one process; collectives and reading layouts off live
wrapped models live here, so that the import graph stays a tree.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial

# --- found_inf reduction across ranks (used by unscale_and_check's `group=`) ---------------------


def all_reduce_max(found_inf: torch.Tensor, group: Any) -> torch.Tensor:
    """Max-reduce a one-element ``found_inf`` across ``group``, out of place (every rank agrees).

    Max rather than torch's ``ShardedGradScaler`` sum, so the result stays exactly 0.0 or 1.0.
    """
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed.ProcessGroup, got {type(group).__name__}"
        )
    reduced = found_inf.clone()
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
    return reduced


def is_dtensor(x: object) -> bool:
    """Whether ``x`` is a ``DTensor`` (an FSDP2 gradient, say)."""
    return isinstance(x, DTensor)


def local_shard(x: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor."""
    assert isinstance(x, DTensor)
    return x.to_local()


def dtensor_like(src: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The DTensor with ``src``'s mesh, placements and global shape around ``local``."""
    assert isinstance(src, DTensor)
    return DTensor.from_local(
        local,
        src.device_mesh,
        src.placements,
        run_check=False,
        shape=src.shape,
        stride=src.stride(),
    )


def reduce_found_inf_over_meshes(found_inf: torch.Tensor, dtensors: list[Any]) -> torch.Tensor:
    """Max-reduce ``found_inf`` over every non-replicated mesh dimension of the DTensor grads.

    What ``GradScaler`` gets through DTensor dispatch of the in-place unscale kernel
    (``torch/distributed/tensor/_dispatch.py``, ``found_inf_reduce_handler``): ``found_inf`` as a
    ``Partial("max")`` DTensor on the sharded dimensions, made whole with ``full_tensor()``.
    """
    seen = set()
    for grad in dtensors:
        key = (grad.device_mesh, tuple(grad.placements))
        if key in seen:
            continue
        seen.add(key)
        placements = [p if p.is_replicate() else Partial("max") for p in grad.placements]
        if all(p.is_replicate() for p in grad.placements):
            continue
        local = found_inf.to(grad.to_local().device)
        whole = DTensor.from_local(local, grad.device_mesh, placements, run_check=False)
        found_inf = whole.full_tensor().to(found_inf.device)
    return found_inf


# --- layouts read off live FSDP1 / FSDP2 models (layout_of) --------------------------------------
