"""The one module that runs collectives and builds DTensors.

Loss scaling reduces `found_inf` across ranks and unwraps DTensor gradients here; the FSDP
mappings build DTensor shards here. Nothing else in famp talks to `torch.distributed`'s
collectives, so every other module stays pure and runs in one process.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist  # loaded by `import torch` itself; light

# `torch.distributed.tensor` (DTensor; with it sympy, ~250 modules) is imported inside the
# functions that need it, so that loss scaling and autocast never load it: an object can only be
# a DTensor once that module is loaded (see `is_dtensor`).

# --- found_inf reduction across ranks (unscale_and_check's `group=`) and DTensors ---------------


def check_group(group: Any) -> None:
    """Refuse a `group=` that is not a process group (None: no group), before anything runs."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__} "
            f"{group!r}"
        )


def all_reduce_max(found_inf: torch.Tensor, group: Any) -> torch.Tensor:
    """Max-reduce a one-element `found_inf` across `group`, out of place (every rank agrees).

    Max rather than torch's `ShardedGradScaler` sum, so the result stays exactly 0.0 or 1.0.
    """
    check_group(group)
    reduced = found_inf.clone()
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
    return reduced


def is_dtensor(x: object) -> bool:
    """Whether `x` is a `DTensor` (an FSDP2 gradient, say).

    Without importing `torch.distributed.tensor`: no object is a DTensor before it is loaded.
    Dynamo traces the `sys.modules` lookup (and `torch.compile` itself loads the module).
    """
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)


def local_shard(x: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor."""
    from torch.distributed.tensor import DTensor

    assert isinstance(x, DTensor)
    return x.to_local()


def dtensor_like(src: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The DTensor with `src`'s mesh, placements and global shape around `local`."""
    from torch.distributed.tensor import DTensor

    assert isinstance(src, DTensor)
    return DTensor.from_local(
        local,
        src.device_mesh,
        src.placements,
        run_check=False,
        shape=src.shape,
        stride=src.stride(),
    )


def check_mesh(mesh: object, world_size: int, rank: int) -> Any:
    """`mesh` if it is a 1-d `DeviceMesh` of `world_size` and this process is its `rank`."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1 or mesh.size() != world_size:
        raise ValueError(
            f"mesh must be 1-d with the layout's world size {world_size}, got shape "
            f"{tuple(mesh.shape)}"
        )
    if mesh.get_local_rank() != rank:
        raise ValueError(
            f"rank must be this process's rank on the mesh, {mesh.get_local_rank()}, got {rank!r}"
        )
    return mesh


def shard_as_dtensor(
    local: torch.Tensor, mesh: Any, dim: int, shape: Sequence[int]
) -> torch.Tensor:
    """`local` as this rank's `Shard(dim)` of a DTensor of global `shape` (no collective)."""
    from torch.distributed.tensor import DTensor, Shard

    stride = torch.empty(tuple(shape), device="meta").stride()
    return DTensor.from_local(
        local, mesh, (Shard(dim),), run_check=False, shape=torch.Size(shape), stride=stride
    )


def reduce_found_inf_over_meshes(found_inf: torch.Tensor, dtensors: list[Any]) -> torch.Tensor:
    """Max-reduce `found_inf` over every non-replicated mesh dimension of the DTensor grads.

    What `GradScaler` gets through DTensor dispatch of the in-place unscale kernel
    (`torch/distributed/tensor/_dispatch.py`, `found_inf_reduce_handler`): `found_inf` as a
    `Partial("max")` DTensor on the sharded dimensions, made whole with `full_tensor()`.
    """
    from torch.distributed.tensor import DTensor, Partial

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


# --- every rank's nonfinite_report figures (used by nonfinite_report's `group=`) -----------------


def all_gather_report(
    counts: list[torch.Tensor], amaxes: list[torch.Tensor], found_inf: torch.Tensor, group: Any
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, int]:
    """Every rank's counts, amaxes and found_inf, in one all-gather of one int64 vector.

    Each rank packs its counts, the bit patterns of its float32 amaxes and its found_inf into
    one int64 vector (exact: no float conversion of a count or an amax); entry r of each
    returned 1-d tensor is rank r's. `found_inf` is the max over ranks, as `all_reduce_max`.
    """
    check_group(group)
    n = len(counts)
    device = found_inf.device
    packed = torch.cat(
        [
            torch.stack([c.to(device) for c in counts])
            if n
            else torch.zeros(0, dtype=torch.int64, device=device),
            torch.stack([a.to(device).view(torch.int32).to(torch.int64) for a in amaxes])
            if n
            else torch.zeros(0, dtype=torch.int64, device=device),
            found_inf.view(torch.int32).to(torch.int64).reshape(1),
        ]
    )
    world_size = dist.get_world_size(group)
    gathered = [torch.empty_like(packed) for _ in range(world_size)]
    dist.all_gather(gathered, packed, group=group)
    table = torch.stack(gathered)  # (world_size, 2n + 1)
    out_counts = [table[:, i] for i in range(n)]
    out_amax = [table[:, n + i].to(torch.int32).view(torch.float32) for i in range(n)]
    found = table[:, 2 * n].to(torch.int32).view(torch.float32).amax()
    return out_counts, out_amax, found, world_size
