"""The one module that runs collectives and builds DTensors.

Loss scaling reduces `found_inf` across ranks and unwraps DTensor gradients here; the FSDP
mappings build DTensor shards here. Nothing else in famp talks to `torch.distributed`'s
collectives, so every other module stays pure and runs in one process.
"""

from __future__ import annotations

import hashlib
import math
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

NO_RANK = -1  # the dtype code of a leaf that no rank holds (None everywhere)
UNKNOWN = -2  # compiled: the dtype code of a leaf this rank lacks, which it cannot read


def all_gather_report(
    slots: list[tuple[torch.Tensor, torch.Tensor, int] | None],
    found_inf: torch.Tensor,
    group: Any,
    paths: list[str],
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, int, list[int]]:
    """Every rank's figures of each leaf slot, in one all-gather of one int64 vector.

    `slots` holds per leaf path (`None` leaves included) this rank's (count, float32 amax, dtype
    code), or `None` where its leaf is `None`: a count of -1 and a NaN amax there, so that every
    path keeps one slot on every rank. The vector holds the counts, the amaxes' bit patterns
    (exact: no float conversion), the dtype codes and found_inf; entry r of each returned 1-d
    tensor is rank r's, and `found_inf` is the max over ranks, as `all_reduce_max`. Eagerly, the
    ranks first compare their leaf paths (`check_same_paths`). Also returns each slot's dtype
    code: this rank's, or for a `None` leaf the first rank's that holds one (eagerly; `NO_RANK`
    where none does, `UNKNOWN` compiled).
    """
    check_group(group)
    eager = not torch.compiler.is_compiling()
    device = found_inf.device
    if eager:
        check_same_paths(paths, group, device)
    n = len(slots)
    # float32 and int64 whatever torch's default dtype (`torch.set_default_dtype`): a float64
    # NaN would make the stack below float64 and its int32 view twice as long.
    nan = torch.tensor(math.nan, dtype=torch.float32)
    rows = [(torch.tensor(-1, dtype=torch.int64), nan, NO_RANK) if s is None else s for s in slots]
    packed = torch.cat(
        [
            torch.stack([row[0].to(device) for row in rows])
            if n
            else torch.zeros(0, dtype=torch.int64, device=device),
            torch.stack([row[1].to(device).view(torch.int32).to(torch.int64) for row in rows])
            if n
            else torch.zeros(0, dtype=torch.int64, device=device),
            torch.tensor([row[2] for row in rows], dtype=torch.int64, device=device),
            found_inf.view(torch.int32).to(torch.int64).reshape(1),
        ]
    )
    world_size = dist.get_world_size(group)
    gathered = [torch.empty_like(packed) for _ in range(world_size)]
    dist.all_gather(gathered, packed, group=group)
    table = torch.stack(gathered)  # (world_size, 3n + 1)
    out_counts = [table[:, i] for i in range(n)]
    out_amax = [table[:, n + i].to(torch.int32).view(torch.float32) for i in range(n)]
    found = table[:, 3 * n].to(torch.int32).view(torch.float32).amax()
    codes = [NO_RANK if s is None else s[2] for s in slots]
    if any(s is None for s in slots):  # read the others' dtypes: a host sync, eagerly only
        held = table[:, 2 * n : 3 * n].T.tolist() if eager else None
        for i, s in enumerate(slots):
            if s is None:
                codes[i] = (
                    UNKNOWN if held is None else next((c for c in held[i] if c >= 0), NO_RANK)
                )
    return out_counts, out_amax, found, world_size, codes


def check_same_paths(paths: list[str], group: Any, device: torch.device) -> None:
    """Raise the same ValueError on every rank of `group` unless they all hold these leaf paths.

    One all-gather of a fixed size (the number of paths and a 63-bit digest of them), read on
    the host, before any collective whose size depends on the tree: different trees would make
    different sizes, which gloo refuses and NCCL hangs on. On a difference, every rank gathers
    every rank's paths to name it.
    """
    digest = hashlib.blake2b("\0".join(paths).encode(), digest_size=8).digest()
    header = torch.tensor(
        [len(paths), int.from_bytes(digest, "little") >> 1], dtype=torch.int64, device=device
    )
    world_size = dist.get_world_size(group)
    gathered = [torch.empty_like(header) for _ in range(world_size)]
    dist.all_gather(gathered, header, group=group)
    if torch.stack(gathered).eq(header).all():  # a host read: one bool
        return
    every: list[Any] = [None] * world_size
    dist.all_gather_object(every, paths, group=group)
    first = every[0]
    rank, other = next((r, p) for r, p in enumerate(every) if p != first)
    missing = [p for p in first if p not in other]
    extra = [p for p in other if p not in first]
    named = "; ".join(
        f"only on rank {r}: " + ", ".join(repr(p) for p in ps[:3]) + (", ..." if ps[3:] else "")
        for r, ps in ((0, missing), (rank, extra))
        if ps
    )
    raise ValueError(
        f"famp.nonfinite_report: the ranks' trees differ, so their figures cannot be gathered "
        f"leaf by leaf (a None leaf counts as a leaf): rank 0 has {len(first)} leaves, "
        f"rank {rank} has {len(other)}; {named or 'the same paths in another order'}"
    )
