"""Layouts read off live FSDP1 / FSDP2 models (`layout_of`), and checks of live FSDP2 parameters."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from famp._compat import fsdp1_flat_params, fsdp1_unit_settings
from famp._fsdp.build import fsdp1_layout, fsdp2_layout
from famp._fsdp.layout import FSDP1Layout, FSDP2Layout
from famp._fsdp.rekey import clean_fqn

# `torch.distributed.tensor` and `torch.distributed.fsdp` are imported inside the functions that
# need them (heavy imports; see famp/_collectives.py).


def check_fsdp2_param(
    param: torch.Tensor,
    fqn: str,
    shape: Sequence[int],
    dim: int,
    layout: FSDP2Layout,
    rank: int,
) -> None:
    """Refuse an FSDP2 parameter (a DTensor) that the layout's chunk for `rank` would not fit.

    Checks what the optimizer really holds: a 1-d mesh of the layout's world size on which this
    process is `rank`, the placement `Shard(dim)` with the layout's dim, the global shape,
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
    """The layout of a live model wrapped by FSDP2's `fully_shard` or by FSDP1.

    FSDP2: every parameter is a DTensor sharded on one dim of a 1-d mesh; the layout records its
    global shape and shard dim. FSDP1: every unit's flat parameter gives its original parameters'
    names and shapes, and the unit its world size, `use_orig_params` and compute dtype.
    Names are cleaned as in state dicts (no `_fsdp_wrapped_module.`, `_orig_mod.` or
    `_checkpoint_wrapped_module.`). Reads metadata only; runs no collective.

    Args:
        model: the wrapped root module.

    Returns:
        The `famp.FSDP2Layout` or `famp.FSDP1Layout` equal to the one built from
            names and shapes with `famp.fsdp2_layout` or `famp.fsdp1_layout`.

    Raises:
        TypeError: `model` is not a `torch.nn.Module`.
        ValueError: the model is not wrapped, mixes FSDP1 and FSDP2 or plain parameters, uses a
            2-d mesh (HSDP, tensor parallel), `NO_SHARD` or `HYBRID_SHARD`, or its FSDP1 units
            differ in world size, `use_orig_params` or `param_dtype`.

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


def flat_param_names(model: torch.nn.Module) -> dict[torch.Tensor, list[str]]:
    """Every FSDP1 flat parameter of `model` with the names of the parameters it flattens."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    module_names = {id(m): clean_fqn(n) for n, m in model.named_modules()}
    names: dict[torch.Tensor, list[str]] = {}
    for module in FullyShardedDataParallel.fsdp_modules(model):
        handle = fsdp1_flat_params(module)
        if handle is not None:
            prefix = module_names[id(module)]
            fqns = fsdp1_unit_settings(handle)[0]
            names[handle.flat_param] = [f"{prefix}.{n}" if prefix else n for n in fqns]
    return names
