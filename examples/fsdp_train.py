"""Train with FSDP2 and famp on CPU, checkpoint with DCP, resume at another world size.

    torchrun --nproc-per-node 2 examples/fsdp_train.py --steps 20 --out runs/fsdp
    python examples/fsdp_train.py --steps 30 --resume runs/fsdp/step-20 --out runs/fsdp-w1
    torchrun --nproc-per-node 3 examples/fsdp_train.py --steps 30 --resume runs/fsdp/step-20

Each rank runs the forward pass under ``famp.autocast`` (bfloat16), scales the loss with an
immutable ``famp.ScalerState`` and checks *its own shard* of the gradients (FSDP2's DTensors):
``found_inf`` is max-reduced over the mesh, so when a single rank overflows (``--overflow-at``
injects an inf into the last rank's shard) every rank skips the step and backs off the scale
identically. The fused AdamW kernel unscales and skips; no ``.item()`` anywhere in the step.
(bfloat16 needs no loss scaling; it is on here to show the ranks agreeing, as they must with
float16 on GPUs.)

Checkpoints are written with ``torch.distributed.checkpoint`` (DCP): parameters, optimizer state,
famp's scaler state (a plain dict) and the step. Resuming reads them at any world size: DCP
reshards the parameters, and famp reads the optimizer state offline
(``famp.load_dcp_optim_state``) and cuts it for this rank's layout
(``famp.optim_state_dict_to_load``), or rekeys it for a plain model in one process
(``famp.optim_state_by_id``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import pathlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
)
from torch.nn import functional

import famp

GLOBAL_BATCH = 24


def build_model() -> torch.nn.Module:
    """Odd sizes on purpose: FSDP2's dim-0 chunks are uneven across 2 or 3 ranks."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 33),
        torch.nn.GELU(),
        torch.nn.Linear(33, 33),
        torch.nn.GELU(),
        torch.nn.Linear(33, 5),
    )


def shard(model: torch.nn.Module, world: int) -> torch.nn.Module:
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    return model


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, fused=True)


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the global batch of ``step`` (all of them in one process)."""
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, 16, generator=gen)
    y = (x[:, :5] * x[:, 5:10]).argmax(dim=1)
    rows = GLOBAL_BATCH // world
    return x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (possibly DTensor) gradient."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


@contextlib.contextmanager
def quiet_dcp(world: int) -> Iterator[None]:
    """In one process DCP warns that it assumes one process: we know."""
    with warnings.catch_warnings():
        if world == 1:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_checkpoint(
    path: pathlib.Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: famp.ScalerState,
    step: int,
    world: int,
) -> None:
    msd, osd = get_state_dict(model, optimizer)
    checkpoint = {"model": msd, "optim": osd, "scaler": famp.to_state_dict(state), "step": step}
    with quiet_dcp(world):
        dcp.save(checkpoint, checkpoint_id=path, no_dist=world == 1)


def load_checkpoint(
    path: pathlib.Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    world: int,
) -> tuple[famp.ScalerState, int]:
    """Load a checkpoint saved at any world size into this rank's model and optimizer."""
    # DCP loads in place: tensors are filled, other values replaced in this dict.
    loaded: dict[str, Any] = {
        "model": get_model_state_dict(model),
        "scaler": dict.fromkeys(famp.to_state_dict(famp.init_scaler()), 0),
        "step": 0,
    }
    with quiet_dcp(world):
        dcp.load(loaded, checkpoint_id=path, no_dist=world == 1)
    set_model_state_dict(model, loaded["model"])
    full = famp.load_dcp_optim_state(path)  # offline: DCP's reader, no process group
    if world > 1:
        layout = famp.layout_of(model)  # names matched to the optimizer's parameters by model
        to_load = famp.optim_state_dict_to_load(full, layout, rank, optimizer, model=model)
    else:
        to_load = famp.optim_state_by_id(full, model, optimizer)
    optimizer.load_state_dict(to_load)
    return famp.from_state_dict(loaded["scaler"]), loaded["step"]


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: famp.ScalerState,
    steps: range,
    *,
    rank: int,
    world: int,
    overflow_at: frozenset[int] = frozenset(),
    checkpoint_every: int = 0,
    out: pathlib.Path | None = None,
) -> tuple[famp.ScalerState, list[torch.Tensor]]:
    forward = famp.autocast(
        model, famp.get_policy("params=float32,compute=bfloat16,output=float32")
    )
    found_infs = []
    for step in steps:
        x, y = batch(step, rank, world)
        optimizer.zero_grad()
        loss = functional.cross_entropy(forward(x), y)
        famp.scale(state, loss).backward()
        if step in overflow_at and rank == world - 1:  # an overflow in one rank's shard only
            local(next(model.parameters()).grad).view(-1)[0] = float("inf")
        # One pass over this rank's shards of the scaled DTensor grads: found_inf is max-reduced
        # over the mesh, so every rank skips together; the fused kernel unscales and skips.
        found_inf = famp.optimizer_step(optimizer, state)
        state = famp.update_scale(state, found_inf)
        found_infs.append(found_inf)
        due = (checkpoint_every and (step + 1) % checkpoint_every == 0) or step + 1 == steps.stop
        if out is not None and due:
            save_checkpoint(out / f"step-{step + 1}", model, optimizer, state, step + 1, world)
    return state, found_infs


def main(argv: list[str] | None = None) -> famp.ScalerState:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="train until this step")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/fsdp"))
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--resume", type=pathlib.Path, help="a checkpoint directory (step-N)")
    parser.add_argument("--overflow-at", type=int, nargs="*", default=[5], help="inject an inf")
    args = parser.parse_args(argv)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    owner = world > 1 and not dist.is_initialized()  # torchrun started us: start the group
    if owner:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank() if world > 1 else 0
    try:
        model = shard(build_model(), world)
        optimizer = make_optimizer(model)
        state, start = famp.init_scaler(2.0**16, growth_interval=4), 0
        if args.resume is not None:
            state, start = load_checkpoint(args.resume, model, optimizer, rank, world)
        state, found_infs = train(
            model,
            optimizer,
            state,
            range(start, args.steps),
            rank=rank,
            world=world,
            overflow_at=frozenset(args.overflow_at),
            checkpoint_every=args.checkpoint_every,
            out=args.out,
        )
        skipped = [start + i for i, f in enumerate(found_infs) if f.item()]  # sync once, at the end
        print(
            f"rank {rank}/{world}: steps {start}..{args.steps}, skipped {skipped}, "
            f"scale {famp.to_state_dict(state)['scale']:g}, "
            f"tracker {famp.to_state_dict(state)['_growth_tracker']}",
            flush=True,
        )
        return state
    finally:
        if owner:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
