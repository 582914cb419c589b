"""One multi-process job recording what real FSDP2 and FSDP1 produce, for test_fsdp_real.py.

Run as ``python tests/fsdp/fsdp_worker.py WORLD_SIZE OUT_DIR PORT``: it spawns WORLD_SIZE gloo
ranks on 127.0.0.1, trains small models with odd sizes (so that some ranks hold empty shards) under
``fully_shard`` and ``FullyShardedDataParallel``, and writes what torch produced on each rank to
``OUT_DIR/rank{r}.pt``. Process start-up dominates the cost, so one job covers every configuration;
pytest then compares famp against these records. A few checks need the live objects (loading
famp's result into a real optimizer, ``famp.layout_of``); their inputs and outputs are recorded too.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import famp


def _local(tree: Any) -> Any:
    """DTensors as local tensors, ShardedTensors as their local shard (None when they have none)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if isinstance(tree, DTensor):
        return tree.to_local().clone()
    if isinstance(tree, ShardedTensor):
        shards = tree.local_shards()
        return (
            (shards[0].tensor.clone(), list(shards[0].metadata.shard_offsets)) if shards else None
        )
    if isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _local(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_local(v) for v in tree)
    return tree


def _placed(osd: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """How each state tensor is placed: type, mesh, placements, global shape and stride."""
    from torch.distributed.tensor import DTensor

    return {
        fqn: {
            key: (
                type(v).__name__,
                str(v.device_mesh) if isinstance(v, DTensor) else None,
                tuple(v.placements) if isinstance(v, DTensor) else None,
                tuple(v.shape),
                v.stride(),
                v.dtype,
            )
            for key, v in entry.items()
            if isinstance(v, torch.Tensor)
        }
        for fqn, entry in osd["state"].items()
    }


def fsdp2_model() -> nn.Module:
    torch.manual_seed(0)
    # out features 7, 3, 6, 1: uneven chunks and, at W >= 2, empty shards (the (1,) bias)
    return nn.Sequential(
        nn.Linear(10, 7), nn.ReLU(), nn.Linear(7, 3), nn.Linear(3, 6, bias=False), nn.Linear(6, 1)
    )


def fsdp2_sharded(placement: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = fsdp2_model()
    for layer in (model[0], model[2], model[3], model[4]):
        fully_shard(layer, shard_placement_fn=placement)
    fully_shard(model, shard_placement_fn=placement)
    return model


def _fresh_copy(
    model: nn.Module, placement: Any, kind: str
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A new FSDP2 model with ``model``'s parameters and a new optimizer without state."""
    fresh = fsdp2_sharded(placement)
    fresh.load_state_dict(model.state_dict())
    return fresh, fsdp2_optimizer(fresh, kind)


def fsdp2_optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-2)
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return torch.optim.AdamW(
        [
            {"params": weights, "weight_decay": 0.1},
            {"params": biases, "weight_decay": 0.0, "lr": 5e-3},
        ],
        lr=1e-2,
    )


def _saved_by_the_recipe(osd: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """What docs/fsdp.md's save recipe writes from ``get_optimizer_state_dict(model, optim)``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.tensor import DTensor

    local = {
        fqn: {k: v.to_local() if isinstance(v, DTensor) else v for k, v in entry.items()}
        for fqn, entry in osd["state"].items()
    }
    sharding = {
        fqn: {"shape": list(p.shape), "dim": p.placements[0].dim}
        for fqn, p in get_model_state_dict(model).items()
        if isinstance(p, DTensor)
    }
    return {"state": local, "param_groups": osd["param_groups"], "sharding": sharding}


def _train(model: nn.Module, optim: torch.optim.Optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = model(torch.randn(4, 10, generator=gen)).square().sum()
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)


def _refusal(fn: Any) -> tuple[str, str] | None:
    """``(error type, message)`` of ``fn()``, or None when it returns."""
    try:
        fn()
    except (TypeError, ValueError, KeyError) as err:
        return type(err).__name__, str(err)
    return None


def _refusals(
    full: Any,
    params: dict[str, tuple[int, ...]],
    layout: Any,
    rank: int,
    world_size: int,
    optim: torch.optim.Optimizer,
    sharded: dict[str, Any],
) -> dict[str, Any]:
    """optim_state_dict_to_load with layouts that do not match the live optimizer (issue 12);
    famp given ``get_optimizer_state_dict``'s DTensors (``sharded``), not plain tensors."""
    before = _local(optim.state_dict())
    out = {
        "dim0_layout": _refusal(
            lambda: famp.optim_state_dict_to_load(
                full, famp.fsdp2_layout(params, world_size), rank, optim
            )
        ),
        "world_plus_one": _refusal(
            lambda: famp.optim_state_dict_to_load(
                full, famp.fsdp2_layout(params, world_size + 1), rank, optim
            )
        ),
        "other_rank": _refusal(
            lambda: famp.optim_state_dict_to_load(full, layout, (rank + 1) % world_size, optim)
        ),
        # a DTensor's chunk differs per rank: cutting it ran mismatched collectives (gloo abort)
        "dtensor_shard": _refusal(lambda: famp.shard_optim_state(sharded, layout, rank)),
        "dtensor_to_load": _refusal(lambda: famp.optim_state_dict_to_load(sharded, layout, rank)),
        "dtensor_to_load_optim": _refusal(
            lambda: famp.optim_state_dict_to_load(sharded, layout, rank, optim)
        ),
    }
    out["untouched"] = (before, _local(optim.state_dict()))
    return out


def run_fsdp2(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.tensor import Shard

    out: dict[str, Any] = {}
    for shard_dim1 in (False, True):
        # Shard(1) on the (1, 6) weight: 6 divides evenly over 2 and 3 ranks, as FSDP2 requires
        placement = (lambda p: Shard(1) if p.shape == (1, 6) else None) if shard_dim1 else None
        for kind in ("adam", "adamw2"):
            name = f"{kind}{'-dim1' if shard_dim1 else ''}"
            params = {n: tuple(p.shape) for n, p in fsdp2_model().named_parameters()}
            model = fsdp2_sharded(placement)
            optim = fsdp2_optimizer(model, kind)
            _train(model, optim, steps=2, seed=1)
            sharded = get_optimizer_state_dict(model, optim)
            full = get_optimizer_state_dict(
                model, optim, options=StateDictOptions(full_state_dict=True)
            )
            layout = famp.layout_of(model)
            record: dict[str, Any] = {
                "params": params,
                "layout_of": layout,
                "sharded": _local(sharded),
                "recipe": _local(_saved_by_the_recipe(sharded, model)),
                "full": _local(full),
                "raw": _local(optim.state_dict()),
                # famp's rekeying of the raw int-keyed state, against DCP's FQN form above
                "by_fqn": _local(famp.optim_state_by_fqn(optim.state_dict(), model, optim)),
                "by_id": _local(
                    famp.optim_state_by_id(
                        famp.optim_state_by_fqn(optim.state_dict(), model, optim), model, optim
                    )
                ),
            }
            # famp's shard as DTensors on the model's mesh, against torch's sharded dict
            mesh = next(iter(model.parameters())).device_mesh
            on_mesh = famp.shard_optim_state(full, layout, rank, mesh=mesh)
            record["on_mesh_placed"] = _placed(on_mesh)
            record["sharded_placed"] = _placed(sharded)
            record["on_mesh"] = _local(on_mesh)

            # famp's to-load dict into a fresh optimizer, famp's DTensor shard into another
            # through DCP's set_optimizer_state_dict; then one more step on all three
            fresh, fresh_optim = _fresh_copy(model, placement, kind)
            record["refusals"] = _refusals(
                full, params, layout, rank, world_size, fresh_optim, sharded
            )
            fresh_optim.load_state_dict(
                famp.optim_state_dict_to_load(full, layout, rank, fresh_optim)
            )
            record["loaded"] = _local(fresh_optim.state_dict())
            via_dcp, via_dcp_optim = _fresh_copy(model, placement, kind)
            set_optimizer_state_dict(
                via_dcp,
                via_dcp_optim,
                famp.shard_optim_state(full, layout, rank, copy=True, mesh=mesh),
            )
            record["set_from_mesh_shard"] = _local(via_dcp_optim.state_dict())
            _train(model, optim, steps=1, seed=2)
            _train(fresh, fresh_optim, steps=1, seed=2)
            _train(via_dcp, via_dcp_optim, steps=1, seed=2)
            record["after_step"] = _local(dict(model.named_parameters()))
            record["after_step_loaded"] = _local(dict(fresh.named_parameters()))
            record["after_step_set_from_mesh_shard"] = _local(dict(via_dcp.named_parameters()))
            out[name] = record
    out["order"] = _fsdp2_other_order(rank)
    out["frozen"] = _fsdp2_frozen_in_the_optimizer()
    return out


def _fsdp2_frozen_in_the_optimizer() -> dict[str, Any]:
    """The recipe's files of an optimizer that holds a frozen parameter, which has no state."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    model = fsdp2_sharded(None)
    model[2].weight.requires_grad_(False)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optim, steps=2, seed=1)
    options = StateDictOptions(full_state_dict=True)
    return {
        "recipe": _local(_saved_by_the_recipe(get_optimizer_state_dict(model, optim), model)),
        "full": _local(get_optimizer_state_dict(model, optim, options=options)),
    }


def _fsdp2_docs_load_shard(rank: int, world_size: int, out_dir: str) -> dict[str, Any]:
    """docs/fsdp.md's save recipe, famp-reshard, then docs/fsdp-dcp.md's ``load_shard`` (both
    blocks taken from the pages) into fresh FSDP2 optimizers: files for this world size, files
    for one rank more, and this world size's files in a model with a parameter on Shard(1)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.tensor import Shard

    from famp._fsdp.cli import main as famp_reshard
    from tests.fsdp.fsdp_helpers import docs_block

    model = fsdp2_sharded(None)
    optim = fsdp2_optimizer(model, "adamw2")
    _train(model, optim, steps=2, seed=1)
    src, cwd = os.path.join(out_dir, "recipe_saved"), os.getcwd()
    os.makedirs(src, exist_ok=True)
    os.chdir(src)  # the recipe writes optim.rank{rank}.pt to the working directory
    try:
        exec(
            docs_block("fsdp.md", "get_model_state_dict(model)"),
            {"model": model, "optim": optim, "rank": rank},
        )
    finally:
        os.chdir(cwd)
    dist.barrier()
    same, more = (os.path.join(out_dir, f"recipe_w{w}") for w in (world_size, world_size + 1))
    if rank == 0:
        saved = [os.path.join(src, f"optim.rank{r}.pt") for r in range(world_size)]
        for w, dst in ((world_size, same), (world_size + 1, more)):
            if famp_reshard([*saved, "-n", str(w), "-o", dst, "--no-progress"]) != 0:
                raise RuntimeError(f"famp-reshard of the recipe's files to {w} ranks failed")
    dist.barrier()
    namespace: dict[str, Any] = {}
    exec(docs_block("fsdp-dcp.md", "def load_shard"), namespace)
    load_shard, mine = namespace["load_shard"], f"rank{rank:05d}.pt"
    full_options = StateDictOptions(full_state_dict=True)
    full = get_optimizer_state_dict(model, optim, options=full_options)
    loaded, loaded_optim = _fresh_copy(model, None, "adamw2")
    load_shard(loaded, loaded_optim, os.path.join(same, mine))
    by_torch, by_torch_optim = _fresh_copy(model, None, "adamw2")
    # a copy: full's 0-d steps are the trained optimizer's own tensors, which a load would share
    set_optimizer_state_dict(by_torch, by_torch_optim, _local(full), options=full_options)
    record: dict[str, Any] = {
        "trained": _local(optim.state_dict()),
        "loaded": _local(loaded_optim.state_dict()),
        "by_torch": _local(by_torch_optim.state_dict()),
    }
    more_model, more_optim = _fresh_copy(model, None, "adamw2")
    record["more_ranks"] = _refusal(
        lambda: load_shard(more_model, more_optim, os.path.join(more, mine))
    )
    dim1 = fsdp2_sharded(lambda p: Shard(1) if p.shape == (1, 6) else None)
    dim1_optim = fsdp2_optimizer(dim1, "adamw2")
    record["dim1"] = _refusal(lambda: load_shard(dim1, dim1_optim, os.path.join(same, mine)))
    record["untouched"] = [more_optim.state_dict()["state"], dim1_optim.state_dict()["state"]]
    for net, opt in ((model, optim), (loaded, loaded_optim), (by_torch, by_torch_optim)):
        _train(net, opt, steps=1, seed=2)
    record["after_step"] = {
        "trained": _local(dict(model.named_parameters())),
        "loaded": _local(dict(loaded.named_parameters())),
        "by_torch": _local(dict(by_torch.named_parameters())),
    }
    return record


def _fsdp2_frozen_dcp(rank: int, world_size: int, out_dir: str, kind: str) -> dict[str, Any]:
    """A DCP checkpoint of an optimizer that holds a frozen parameter, loaded by DCP itself, and
    famp-reshard's rank files (docs/fsdp-dcp.md's ``load_shard``) and DCP output of it.

    ``adamw``: the parameter has no state, and ``ignore_frozen_params=True`` leaves it out of the
    model entries. ``adagrad``: Adagrad gives every parameter state when it is built, so the
    frozen one's is saved (default options) and famp's rank file holds it.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        get_state_dict,
        set_state_dict,
    )

    from famp._fsdp.cli import main as famp_reshard
    from tests.fsdp.fsdp_helpers import docs_block

    adamw = kind == "adamw"
    saving = StateDictOptions(ignore_frozen_params=adamw)
    loading = StateDictOptions(ignore_frozen_params=adamw, strict=not adamw)  # no model entry

    def frozen() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = fsdp2_sharded(None)
        model[2].weight.requires_grad_(False)
        params = model.parameters()
        optim = torch.optim.AdamW(params, lr=1e-2) if adamw else torch.optim.Adagrad(params, lr=0.1)
        return model, optim

    def dcp_load(path: str) -> tuple[nn.Module, torch.optim.Optimizer]:
        model, optim = frozen()
        msd, osd = get_state_dict(model, optim, options=saving)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            model,
            optim,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=loading,
        )
        return model, optim

    model, optim = frozen()
    _train(model, optim, steps=2, seed=3)
    msd, osd = get_state_dict(model, optim, options=saving)
    ckpt, files, dcp_out = (os.path.join(out_dir, f"frozen_{kind}_{n}") for n in "cwd")
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    dist.barrier()
    if rank == 0:
        for argv in (["-o", files], ["-o", dcp_out, "--format", "dcp"]):
            if famp_reshard([ckpt, "-n", str(world_size), *argv, "--no-progress"]) != 0:
                raise RuntimeError(f"famp-reshard {argv} of the {kind} checkpoint failed")
    dist.barrier()
    namespace: dict[str, Any] = {}
    exec(docs_block("fsdp-dcp.md", "def load_shard"), namespace)
    mine = os.path.join(files, f"rank{rank:05d}.pt")
    by_files = frozen()
    namespace["load_shard"](*by_files, mine)
    by_dcp, from_famp_dcp = dcp_load(ckpt), dcp_load(dcp_out)
    by_to_load = frozen()
    shard = {k: v for k, v in torch.load(mine, weights_only=True).items() if k != "sharding"}
    by_to_load[1].load_state_dict(
        famp.optim_state_dict_to_load(
            shard, famp.layout_of(by_to_load[0]), rank, by_to_load[1], model=by_to_load[0]
        )
    )
    return {
        "model_keys": sorted(msd),
        "trained": _local(optim.state_dict()),
        "file": torch.load(mine, weights_only=True),
        "fqn_state_by_dcp": _local(get_optimizer_state_dict(*by_dcp)),
        **{
            name: {
                "optim": _local(pair[1].state_dict()),
                "model": _local(dict(pair[0].named_parameters())),
            }
            for name, pair in (
                ("by_dcp", by_dcp),
                ("by_famp_files", by_files),
                ("by_famp_dcp", from_famp_dcp),
                ("by_famp_to_load", by_to_load),
            )
        },
    }


def _twins() -> nn.Module:
    torch.manual_seed(0)  # two layers of the same shapes: a swap of their states shows no shape
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


def _reversed_groups(model: nn.Module, reverse: bool) -> torch.optim.Optimizer:
    step = -1 if reverse else 1
    named = {n.replace("_fsdp_wrapped_module.", ""): p for n, p in model.named_parameters()}
    return torch.optim.AdamW(
        [
            {"params": [named[n] for n in ("0.weight", "1.weight")][::step], "weight_decay": 0.1},
            {"params": [named[n] for n in ("0.bias", "1.bias")][::step], "weight_decay": 0.0},
        ],
        lr=1e-2,
    )


def _attempt(fn: Any) -> Any:
    """``fn()``'s local result, or ``(error type, message)`` where it raises."""
    try:
        return _local(fn())
    except (TypeError, ValueError, KeyError) as err:
        return type(err).__name__, str(err)


def _fsdp2_other_order(rank: int) -> dict[str, Any]:
    """A full state loaded into an optimizer that lists same-shaped parameters in another order:
    DCP's set_optimizer_state_dict matches by name; famp with model= must too."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    def sharded() -> nn.Module:
        model = _twins()
        for layer in (model[0], model[1], model):
            fully_shard(layer)
        return model

    options = StateDictOptions(full_state_dict=True)
    model = sharded()
    optim = _reversed_groups(model, reverse=False)
    model(torch.randn(3, 4)).square().sum().backward()
    optim.step()
    full = get_optimizer_state_dict(model, optim, options=options)
    by_dcp = sharded()
    dcp_optim = _reversed_groups(by_dcp, reverse=True)
    set_optimizer_state_dict(by_dcp, dcp_optim, full, options=options)
    by_famp = sharded()
    famp_optim = _reversed_groups(by_famp, reverse=True)
    layout = famp.layout_of(by_famp)
    loaded = _attempt(
        lambda: famp.optim_state_dict_to_load(full, layout, rank, famp_optim, model=by_famp)
    )
    if isinstance(loaded, dict):
        famp_optim.load_state_dict(
            famp.optim_state_dict_to_load(full, layout, rank, famp_optim, model=by_famp)
        )
        loaded = _local(famp_optim.state_dict())
    return {
        "full": _local(full),
        "dcp": _local(dcp_optim.state_dict()),
        "famp": loaded,
        "famp_no_model": _attempt(
            lambda: famp.optim_state_dict_to_load(full, layout, rank, famp_optim)
        ),
    }


def fsdp1_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(10, 7), nn.ReLU(), nn.Linear(7, 3), nn.Linear(3, 5, bias=False), nn.Linear(5, 2)
    )


def run_fsdp1(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        MixedPrecision,
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
        StateDictType,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # noqa: N817

    cpu = torch.device("cpu")
    out: dict[str, Any] = {}
    for use_orig_params, dtype in ((False, None), (True, None), (True, torch.bfloat16)):
        name = f"orig{int(use_orig_params)}-{dtype or 'fp32'}"
        mp_policy = MixedPrecision(param_dtype=dtype) if dtype else None
        kwargs = {
            "device_id": cpu,
            "use_orig_params": use_orig_params,
            "mixed_precision": mp_policy,
        }
        model = fsdp1_model()
        units = [
            {n: tuple(p.shape) for n, p in model.named_parameters() if not n.startswith("4.")},
            {n: tuple(p.shape) for n, p in model.named_parameters() if n.startswith("4.")},
        ]
        model[4] = FSDP(model[4], **kwargs)
        model = FSDP(model, **kwargs)
        if use_orig_params:  # two groups: weights and biases, with their own hyperparameters
            named = list(model.named_parameters())
            optim: torch.optim.Optimizer = torch.optim.AdamW(
                [
                    {"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
                    {"params": [p for n, p in named if n.endswith("bias")], "lr": 5e-3},
                ],
                lr=1e-2,
            )
        else:  # one flat parameter per unit: the root's and the child's, in two groups
            flats = list(model.parameters())
            optim = torch.optim.Adam(
                [{"params": flats[:1]}, {"params": flats[1:], "lr": 5e-3}], lr=1e-2
            )
        _train(model, optim, steps=2, seed=1)
        with FSDP.state_dict_type(
            model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(rank0_only=False),
            FullOptimStateDictConfig(rank0_only=False, offload_to_cpu=False),
        ):
            full = FSDP.optim_state_dict(model, optim)
            to_load = FSDP.optim_state_dict_to_load(model, optim, full)
        with FSDP.state_dict_type(
            model,
            StateDictType.SHARDED_STATE_DICT,
            ShardedStateDictConfig(),
            ShardedOptimStateDictConfig(),
        ):
            sharded = FSDP.optim_state_dict(model, optim)
        layout = famp.layout_of(model)
        out[name] = {
            "units": units,
            "use_orig_params": use_orig_params,
            "param_dtype": dtype or torch.float32,
            "layout_of": layout,
            "full": _local(full),
            "to_load": _local(to_load),
            "raw": _local(optim.state_dict()),
            "sharded": _local(sharded),
            "famp_to_load": _local(
                famp.optim_state_dict_to_load(full, layout, rank, optim, model=model)
            ),
        }
        out[f"order-{name}"] = _fsdp1_other_order(rank, kwargs)
    return out


def _fsdp1_other_order(rank: int, kwargs: dict[str, Any]) -> dict[str, Any]:
    """FSDP.optim_state_dict_to_load for an optimizer that lists same-shaped parameters (or
    equal flat units) in another order than the full state: torch matches by name."""
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        StateDictType,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # noqa: N817

    def wrapped() -> nn.Module:
        model = _twins()
        model[0], model[1] = FSDP(model[0], **kwargs), FSDP(model[1], **kwargs)
        return FSDP(model, **kwargs)

    def optimizer(model: nn.Module, reverse: bool) -> torch.optim.Optimizer:
        if kwargs["use_orig_params"]:
            return _reversed_groups(model, reverse)
        flats = list(model.parameters())  # one flat parameter per layer's unit
        return torch.optim.Adam(flats[::-1] if reverse else flats, lr=1e-2)

    cfg = (
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(rank0_only=False),
        FullOptimStateDictConfig(rank0_only=False, offload_to_cpu=False),
    )
    model = wrapped()
    optim = optimizer(model, reverse=False)
    model(torch.randn(3, 4)).square().sum().backward()
    optim.step()
    with FSDP.state_dict_type(model, *cfg):
        full = FSDP.optim_state_dict(model, optim)
    other = wrapped()
    other_optim = optimizer(other, reverse=True)
    with FSDP.state_dict_type(other, *cfg):
        to_load = FSDP.optim_state_dict_to_load(other, other_optim, full)
    layout = famp.layout_of(other)
    return {
        "full": _local(full),
        "to_load": _local(to_load),
        "famp": _attempt(
            lambda: famp.optim_state_dict_to_load(full, layout, rank, other_optim, model=other)
        ),
        "famp_no_model": _attempt(
            lambda: famp.optim_state_dict_to_load(full, layout, rank, other_optim)
        ),
    }


def main(rank: int, world_size: int, out_dir: str, port: int) -> None:
    from tests.helpers import init_gloo

    init_gloo(rank, world_size, port)
    # torch's own deprecation chatter (FSDP.state_dict_type, _get_pg_default_device)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    try:
        torch.set_num_threads(1)
        result = {"fsdp2": run_fsdp2(rank, world_size), "fsdp1": run_fsdp1(rank, world_size)}
        result["fsdp2"]["docs_load_shard"] = _fsdp2_docs_load_shard(rank, world_size, out_dir)
        for kind in ("adamw", "adagrad"):
            result["fsdp2"][f"frozen_dcp_{kind}"] = _fsdp2_frozen_dcp(
                rank, world_size, out_dir, kind
            )
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    world, out_dir, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    # Forked from a parent that has only imported torch: no rank imports it again.
    mp.start_processes(main, args=(world, out_dir, port), nprocs=world, start_method="fork")
