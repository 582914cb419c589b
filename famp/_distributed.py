"""The one module that talks to ``torch.distributed``.

Every other famp module is pure and runs in one process; collectives and reading layouts off live
wrapped models live here, so that the import graph stays a tree.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist  # loaded by `import torch` itself; light

from famp._compat import fsdp1_flat_params, fsdp1_unit_settings
from famp._fsdp_layout import FSDP1Layout, FSDP2Layout, fsdp1_layout, fsdp2_layout
from famp._rekey import clean_fqn

# `torch.distributed.tensor` (DTensor; with it sympy, ~250 modules) and `torch.distributed.fsdp`
# are imported inside the functions that need them, so that loss scaling and autocast never load
# them: an object can only be a DTensor once that module is loaded (see `is_dtensor`).

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
    """Whether ``x`` is a ``DTensor`` (an FSDP2 gradient, say).

    Without importing ``torch.distributed.tensor``: no object is a DTensor before it is loaded.
    Dynamo traces the ``sys.modules`` lookup (and ``torch.compile`` itself loads the module).
    """
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(x, module.DTensor)


def local_shard(x: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor."""
    from torch.distributed.tensor import DTensor

    assert isinstance(x, DTensor)
    return x.to_local()


def dtensor_like(src: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The DTensor with ``src``'s mesh, placements and global shape around ``local``."""
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
    """``mesh`` if it is a 1-d ``DeviceMesh`` of ``world_size`` and this process is its ``rank``."""
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
    """``local`` as this rank's ``Shard(dim)`` of a DTensor of global ``shape`` (no collective)."""
    from torch.distributed.tensor import DTensor, Shard

    stride = torch.empty(tuple(shape), device="meta").stride()
    return DTensor.from_local(
        local, mesh, (Shard(dim),), run_check=False, shape=torch.Size(shape), stride=stride
    )


def reduce_found_inf_over_meshes(found_inf: torch.Tensor, dtensors: list[Any]) -> torch.Tensor:
    """Max-reduce ``found_inf`` over every non-replicated mesh dimension of the DTensor grads.

    What ``GradScaler`` gets through DTensor dispatch of the in-place unscale kernel
    (``torch/distributed/tensor/_dispatch.py``, ``found_inf_reduce_handler``): ``found_inf`` as a
    ``Partial("max")`` DTensor on the sharded dimensions, made whole with ``full_tensor()``.
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


def check_fsdp2_param(
    param: torch.Tensor,
    fqn: str,
    shape: Sequence[int],
    dim: int,
    layout: FSDP2Layout,
    rank: int,
) -> None:
    """Refuse an FSDP2 parameter (a DTensor) that the layout's chunk for ``rank`` would not fit.

    Checks what the optimizer really holds: a 1-d mesh of the layout's world size on which this
    process is ``rank``, the placement ``Shard(dim)`` with the layout's dim, the global shape,
    and the local shape. Runs no collective.
    """
    from torch.distributed.tensor import DTensor, Shard

    assert isinstance(param, DTensor)
    mesh, placements = param.device_mesh, tuple(param.placements)
    where = f"the optimizer's parameter for {fqn!r} on rank {rank}"
    if mesh.ndim != 1 or mesh.size() != layout.world_size:
        raise ValueError(
            f"{where} is sharded over a mesh of shape {tuple(mesh.shape)}, but the layout has "
            f"world size {layout.world_size}: was the layout built for another world size?"
        )
    if mesh.get_local_rank() != rank:
        raise ValueError(
            f"{where} belongs to rank {mesh.get_local_rank()} of its mesh: pass that rank"
        )
    if placements != (Shard(dim),):
        raise ValueError(
            f"{where} has placements {placements}, but the layout shards it as (Shard(dim={dim}),)"
            ": pass shard_dims to famp.fsdp2_layout, or build the layout with famp.layout_of"
        )
    local = tuple(param.to_local().shape)
    expected = layout.local_shape(fqn, rank)
    if tuple(param.shape) != tuple(shape) or local != expected:
        raise ValueError(
            f"{where} has global shape {tuple(param.shape)} and local shape {local}, but the "
            f"layout gives {tuple(shape)} and {expected}"
        )


# --- layouts read off live FSDP1 / FSDP2 models (layout_of) --------------------------------------


def _layout_fsdp2(params: Sequence[tuple[str, torch.Tensor]]) -> FSDP2Layout:
    from torch.distributed.tensor import DTensor, Shard

    shapes: dict[str, tuple[int, ...]] = {}
    dims: dict[str, int] = {}
    world_sizes: dict[int, str] = {}
    for name, param in params:
        fqn = clean_fqn(name)
        if not isinstance(param, DTensor):
            raise ValueError(f"parameter {fqn!r} is not sharded by fully_shard (not a DTensor)")
        placements = param.placements
        if param.device_mesh.ndim != 1 or not isinstance(placements[0], Shard):
            raise ValueError(
                f"parameter {fqn!r} has placements {placements} on a {param.device_mesh.ndim}-d "
                "mesh; famp supports FSDP2's plain Shard(dim) on a 1-d mesh"
            )
        world_sizes.setdefault(param.device_mesh.size(), fqn)
        shapes[fqn] = tuple(param.shape)
        dims[fqn] = placements[0].dim
    if len(world_sizes) > 1:
        raise ValueError(f"parameters are sharded over different world sizes: {world_sizes}")
    return fsdp2_layout(shapes, next(iter(world_sizes)), shard_dims=dims)


def _layout_fsdp1(model: torch.nn.Module) -> FSDP1Layout:
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    units: list[dict[str, tuple[int, ...]]] = []
    settings: dict[tuple[int, bool, torch.dtype], str] = {}
    module_names = {id(m): clean_fqn(n) for n, m in model.named_modules()}
    for module in FullyShardedDataParallel.fsdp_modules(model):
        handle = fsdp1_flat_params(module)
        if handle is None:
            continue  # a unit without parameters of its own
        prefix = module_names[id(module)]
        strategy = module.sharding_strategy
        sharded = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP)
        # FSDP1 itself switches to NO_SHARD on one rank
        if strategy not in sharded and (module.world_size, strategy) != (
            1,
            ShardingStrategy.NO_SHARD,
        ):
            raise ValueError(
                f"FSDP unit {prefix!r} uses {strategy}; famp supports FULL_SHARD and SHARD_GRAD_OP"
            )
        fqns, shapes, dtype, use_orig_params = fsdp1_unit_settings(handle)
        assert dtype is not None, "FSDP1 sets the compute dtype at construction"
        setting = (module.world_size, use_orig_params, dtype)
        settings.setdefault(setting, prefix)
        units.append(
            {
                (f"{prefix}.{name}" if prefix else name): shape
                for name, shape in zip(fqns, shapes, strict=True)
            }
        )
    if len(settings) != 1:
        raise ValueError(
            "FSDP units differ in (world_size, use_orig_params, param_dtype): "
            f"{sorted(settings.items(), key=lambda kv: kv[1])}; one layout needs them equal"
        )
    ((world_size, use_orig_params, param_dtype),) = settings
    return fsdp1_layout(units, world_size, use_orig_params=use_orig_params, param_dtype=param_dtype)


def layout_of(model: torch.nn.Module) -> FSDP1Layout | FSDP2Layout:
    """The layout of a live model wrapped by FSDP2's ``fully_shard`` or by FSDP1.

    FSDP2: every parameter is a DTensor sharded on one dim of a 1-d mesh; the layout records its
    global shape and shard dim. FSDP1: every unit's flat parameter gives its original parameters'
    names and shapes, and the unit its world size, ``use_orig_params`` and compute dtype.
    Names are cleaned as in state dicts (no ``_fsdp_wrapped_module.``, ``_orig_mod.`` or
    ``_checkpoint_wrapped_module.``). Reads metadata only; runs no collective.

    Args:
        model: the wrapped root module.

    Returns:
        The `famp.FSDP2Layout` or `famp.FSDP1Layout` equal to the one built from
        names and shapes with `famp.fsdp2_layout` or `famp.fsdp1_layout`.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
        ValueError: the model is not wrapped, mixes FSDP1 and FSDP2 or plain parameters, uses a
            2-d mesh (HSDP, tensor parallel), ``NO_SHARD`` or ``HYBRID_SHARD``, or its FSDP1 units
            differ in world size, ``use_orig_params`` or ``param_dtype``.

    Examples:
        >>> import famp, torch
        >>> famp.layout_of(torch.nn.Linear(2, 2))
        Traceback (most recent call last):
        ...
        ValueError: the model has no FSDP1 or FSDP2 sharded parameters
    """
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    params = list(model.named_parameters())
    fsdp2 = any(isinstance(p, DTensor) for _, p in params)
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        if fsdp2:
            raise ValueError("the model mixes FSDP1 and FSDP2 (DTensor) parameters")
        return _layout_fsdp1(model)
    if not fsdp2:
        raise ValueError("the model has no FSDP1 or FSDP2 sharded parameters")
    return _layout_fsdp2(params)


layout_of.__module__ = "famp"


# --- every rank's nonfinite_report figures (used by nonfinite_report's `group=`) -----------------


def all_gather_report(
    counts: list[torch.Tensor], amaxes: list[torch.Tensor], found_inf: torch.Tensor, group: Any
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, int]:
    """Every rank's counts, amaxes and found_inf, in one all-gather of one int64 vector.

    Each rank packs its counts, the bit patterns of its float32 amaxes and its found_inf into
    one int64 vector (exact: no float conversion of a count or an amax); entry r of each
    returned 1-d tensor is rank r's. ``found_inf`` is the max over ranks, as ``all_reduce_max``.
    """
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed.ProcessGroup, got {type(group).__name__}"
        )
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
