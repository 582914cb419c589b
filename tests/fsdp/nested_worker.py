"""One multi-process job recording what torch does with optimizer state nested in dicts and lists.

Run as ``python tests/fsdp/nested_worker.py OUT_DIR PORT``: two gloo ranks on 127.0.0.1 train a
small model whose optimizer keeps its buffers inside a dict and a list (``{"step": 0-d,
"aux": {"m": ..., "hist": [..., 2]}}``) under ``fully_shard``, record what torch's state dict
functions give on each rank, load the full state into fresh optimizers by torch's own path
(``set_optimizer_state_dict(full_state_dict=True)``) and by famp's (``optim_state_dict_to_load``
from the full state and from the rank's shard), take one step with each, and ``dcp.save`` the
sharded state for ``famp-reshard``. Under ``FullyShardedDataParallel`` it records that torch's
FSDP1 optimizer state functions fail on such state and what famp says to it. Writes
``OUT_DIR/rank{r}.pt``; test_fsdp_nested.py compares.
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
from tests.fsdp.fsdp_worker import _local  # DTensors as local tensors, containers rebuilt


class NestedMomentum(torch.optim.Optimizer):
    """SGD with momentum whose buffers live in a dict and a list inside the parameter's state."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "step" not in state:
                    state["step"] = torch.tensor(0.0)
                    state["aux"] = {"m": torch.zeros_like(p), "hist": [torch.zeros_like(p), 2]}
                state["step"] += 1
                m, hist = state["aux"]["m"], state["aux"]["hist"][0]
                m.mul_(0.9).add_(p.grad)
                hist.mul_(0.5).add_(p.grad.square())
                p.sub_(group["lr"] * m / (hist.sqrt() + 1.0))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 3))  # 5 and 3 rows: uneven chunks


def _train(model: nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    optim.zero_grad()
    model(torch.randn(6, 4, generator=gen)).square().sum().backward()
    optim.step()


def _after_step(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """One more step; the full parameters and the rank's optimizer state after it."""
    from torch.distributed.tensor import DTensor

    _train(model, optim, seed=5)
    params = {
        n: p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
        for n, p in model.named_parameters()
    }
    return {"params": params, "state": _local(optim.state_dict()["state"])}


def _attempt(fn: Any) -> Any:
    try:
        return ("ok", _local(fn()))
    except Exception as err:  # recorded for the test to read
        return ("raised", type(err).__name__, str(err))


def run_fsdp2(rank: int, out_dir: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        get_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = _model()
        fully_shard(model)
        return model, NestedMomentum(model.parameters())

    full_opts = StateDictOptions(full_state_dict=True)
    model, optim = fresh()
    for seed in range(2):
        _train(model, optim, seed)
    sharded = _local(get_optimizer_state_dict(model, optim))
    full = _local(get_optimizer_state_dict(model, optim, options=full_opts))  # owns its memory
    msd = get_model_state_dict(model, options=full_opts)
    msd_sharded, osd_sharded = get_state_dict(model, optim)
    dcp.save({"model": msd_sharded, "optim": osd_sharded}, checkpoint_id=f"{out_dir}/ckpt")

    by_torch, torch_optim = fresh()
    by_torch.load_state_dict(msd_sharded)
    # torch's load keeps the given 0-d `step` tensors, and the next step adds to them in place
    set_optimizer_state_dict(by_torch, torch_optim, _local(full), options=full_opts)
    loaded_by_torch = _local(torch_optim.state_dict()["state"])
    after = {"torch": _after_step(by_torch, torch_optim)}
    layout = famp.layout_of(by_torch)
    for source in ("full", "shard"):
        model_f, optim_f = fresh()
        model_f.load_state_dict(msd_sharded)
        osd = full if source == "full" else famp.shard_optim_state(full, layout, rank)
        layout_f = famp.layout_of(model_f)
        optim_f.load_state_dict(
            famp.optim_state_dict_to_load(osd, layout_f, rank, optim_f, model=model_f)
        )
        after[f"famp_{source}_loaded"] = _local(optim_f.state_dict()["state"])
        after[f"famp_{source}"] = _attempt(lambda m=model_f, o=optim_f: _after_step(m, o))
    return {
        "params": {n: tuple(t.shape) for n, t in msd.items()},
        "sharded": sharded,
        "full": full,
        "torch_loaded": loaded_by_torch,
        "after": after,
    }


def run_fsdp1(rank: int) -> dict[str, Any]:
    from torch.distributed.fsdp import (
        FullOptimStateDictConfig,
        FullStateDictConfig,
        StateDictType,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # noqa: N817

    cfg = (
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(rank0_only=False),
        FullOptimStateDictConfig(rank0_only=False, offload_to_cpu=False),
    )
    out = {}
    for use_orig_params in (False, True):
        model = FSDP(_model(), device_id=torch.device("cpu"), use_orig_params=use_orig_params)
        optim = NestedMomentum(model.parameters())
        _train(model, optim, seed=0)
        layout = famp.layout_of(model)

        def full(model: nn.Module = model, optim: torch.optim.Optimizer = optim) -> Any:
            with FSDP.state_dict_type(model, *cfg):
                return FSDP.optim_state_dict(model, optim)

        got = _attempt(full)
        out[f"orig{int(use_orig_params)}"] = {
            "layout": layout,
            "optim_state_dict": got,
            "famp": _attempt(
                lambda got=got, layout=layout, optim=optim, model=model: (
                    famp.optim_state_dict_to_load(got[1], layout, rank, optim, model=model)
                )
            )
            if got[0] == "ok"
            else None,
        }
        if got[0] == "ok":

            def to_load(model: nn.Module = model, optim: Any = optim, osd: Any = got[1]) -> Any:
                with FSDP.state_dict_type(model, *cfg):
                    return FSDP.optim_state_dict_to_load(model, optim, osd)

            out[f"orig{int(use_orig_params)}"]["optim_state_dict_to_load"] = _attempt(to_load)
    return out


def main(rank: int, out_dir: str, port: int) -> None:
    from tests.helpers import init_gloo

    init_gloo(rank, 2, port)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's deprecation chatter
    warnings.filterwarnings("ignore", category=UserWarning)
    try:
        torch.set_num_threads(1)
        result = {"fsdp2": run_fsdp2(rank, out_dir), "fsdp1": run_fsdp1(rank)}
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    out_dir, port = sys.argv[1], int(sys.argv[2])
    # Forked from a parent that has only imported torch: no rank imports it again.
    mp.start_processes(main, args=(out_dir, port), nprocs=2, start_method="fork")
