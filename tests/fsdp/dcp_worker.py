"""Real FSDP2 + DCP, one job for tests/fsdp/test_dcp.py: ``python tests/fsdp/dcp_worker.py DIR``.

Four gloo ranks (forked); smaller world sizes run on sub-meshes of ranks ``0..W-1``, each with its
own process group, so that one launch covers W = 1..4 (see ``run_all`` for the order).

``save_job``: the 4 ranks train a small FSDP2 model with AdamW (two param groups, odd sizes so
some shards are empty) for two steps and ``dcp.save`` ``{"model": msd, "optim": osd}`` from
``get_state_dict`` into ``DIR/ckpt``; each rank writes its local optimizer state (DTensors as
local tensors) to ``DIR/local4_{rank}.pt``, rank 0 the full optimizer state dict
(``get_optimizer_state_dict(full_state_dict=True)``) to ``DIR/full.pt``. Also ``DIR/ckpt_flat``
(``flatten_optimizer_state_dict=True``) and, from the same training with matrices sharded on dim
1 (``shard_placement_fn``), ``DIR/ckpt_dim1`` and its full optimizer state ``DIR/full_dim1.pt``.

``load_job`` on 3 ranks: ``dcp.load`` + ``set_state_dict`` from ``DIR/ckpt`` (DCP reshards) into a
model and optimizer built with other learning rates; each rank writes its optimizer state to
``DIR/local3_{rank}.pt`` and model state to ``DIR/model3_{rank}.pt``. Then famp's outputs
for 3 ranks: ``DIR/dcp3`` (``--format dcp``) loaded by ``dcp.load`` into
``DIR/fromdcp3_{rank}.pt``, and ``DIR/famp3/rank{rank:05d}.pt`` (rank files) loaded by
docs/fsdp-dcp.md's ``load_shard`` (the block run from the page) into ``DIR/fromfamp3_{rank}.pt``.

``MATRIX``: sources saved at 1..4 ranks (float32 and bfloat16 models, so AdamW state of that
dtype), resharded by ``famp-reshard --format dcp`` and loaded at another world size.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

TIMEOUT = datetime.timedelta(seconds=60)
LOAD_W = 3  # the world size ``ckpt`` (saved at 4) is loaded at, resharded by DCP and by famp


class Block(nn.Module):
    """A 3-D parameter with 3 rows (empty on rank 3 of 4) next to a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.kernel = nn.Parameter(torch.randn(3, 2, 2))
        self.proj = nn.Linear(4, 4)  # 4 rows: [2, 2, 0] at W=3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.einsum("bi,kij->bkj", x[:, :2], self.kernel).flatten(1)[:, :4]
        return self.proj(y + x[:, :4])


def build_model() -> nn.Sequential:
    """Odd sizes: 5 rows ([2,2,1,0] at W=4), 1 row ([1,0,0,0]), 6 rows ([2,2,2,0]), 3-D, 4 rows."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 5),
        nn.Tanh(),
        nn.Linear(5, 1),
        nn.Linear(1, 6, bias=False),
        Block(),
    )


def build_optimizer(model: nn.Module, lr_scale: float = 1.0) -> torch.optim.Optimizer:
    """AdamW with two param groups, each with its own hyperparameters."""
    decay = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": 0.1, "lr": 0.01 * lr_scale},
            {"params": no_decay, "weight_decay": 0.0, "lr": 0.005 * lr_scale, "betas": (0.8, 0.95)},
        ]
    )


def shard(model: nn.Module, dim: int = 0, mesh: Any = None) -> None:
    """FSDP2 on each layer and the root; ``dim=1`` shards on dim 1 what divides evenly there.

    (FSDP2 refuses uneven sharding on dims other than 0.)
    """
    kwargs: dict[str, Any] = {} if mesh is None else {"mesh": mesh}
    if dim:
        w = dist.get_world_size()
        kwargs["shard_placement_fn"] = lambda p: Shard(
            dim if p.dim() > dim and p.shape[dim] % w == 0 else 0
        )
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


def train(
    model: nn.Module, optim: torch.optim.Optimizer, rank: int, dtype: torch.dtype = torch.float32
) -> None:
    torch.manual_seed(1 + rank)
    for _ in range(2):
        loss = model(torch.randn(8, 6, dtype=dtype)).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)


def model_local(msd: dict[str, Any]) -> dict[str, Any]:
    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in msd.items()}


def to_local(osd: dict[str, Any]) -> dict[str, Any]:
    state = {
        fqn: {k: v.to_local() if isinstance(v, DTensor) else v for k, v in s.items()}
        for fqn, s in osd["state"].items()
    }
    return {"state": state, "param_groups": osd["param_groups"]}


# (dtype, source W, target W): every W in 1..4 saves a source and loads one; bf16 state too.
MATRIX = (
    ("float32", 1, 4),
    ("float32", 2, 3),
    ("float32", 3, 2),
    ("float32", 4, 1),
    ("float32", 4, 3),
    ("bfloat16", 2, 4),
    ("bfloat16", 3, 1),
)


def fresh(mesh: Any, dtype: torch.dtype, lr_scale: float) -> tuple[nn.Module, Any]:
    model = build_model().to(dtype)
    shard(model, mesh=mesh)
    return model, build_optimizer(model, lr_scale)


def record(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "optim": to_local(get_optimizer_state_dict(model, optim)),
        "model": model_local(get_model_state_dict(model)),
    }


def dcp_load(mesh: Any, dtype: torch.dtype, path: str, group: Any) -> dict[str, Any]:
    """A fresh FSDP2 model and AdamW on ``mesh`` loaded from DCP checkpoint ``path``."""
    model, optim = fresh(mesh, dtype, 10.0)  # other learning rates: the checkpoint's must win
    msd, osd = get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path, process_group=group)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return record(model, optim)


def save_job(rank: int, out: str) -> None:
    """The W=4 checkpoints: ``ckpt``, ``ckpt_flat``, ``ckpt_dim1`` and what the ranks held."""
    world_size = dist.get_world_size()
    model = build_model()
    shard(model)
    optim = build_optimizer(model)
    train(model, optim, rank)
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(out, "ckpt"))
    # torchtitan's layout: the optimizer state flattened to ("optim", "state.<fqn>.<k>")
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    fmsd, fosd = get_state_dict(model, optim, options=flat)
    dcp.save({"model": fmsd, "optim": fosd}, checkpoint_id=os.path.join(out, "ckpt_flat"))
    # The same training with matrices sharded on dim 1 (shard_placement_fn).
    model1 = build_model()
    shard(model1, dim=1)
    optim1 = build_optimizer(model1)
    train(model1, optim1, rank)
    msd1, osd1 = get_state_dict(model1, optim1)
    dcp.save({"model": msd1, "optim": osd1}, checkpoint_id=os.path.join(out, "ckpt_dim1"))
    full_options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full1 = get_optimizer_state_dict(model1, optim1, options=full_options)
    if rank == 0:
        torch.save(full1, os.path.join(out, "full_dim1.pt"))
    torch.save(to_local(osd), os.path.join(out, f"local{world_size}_{rank}.pt"))
    full = get_optimizer_state_dict(model, optim, options=full_options)
    if rank == 0:
        torch.save(full, os.path.join(out, "full.pt"))


def load_job(rank: int, w: int, out: str, mesh: Any, group: Any) -> None:
    """Ranks ``0..w-1`` load ``ckpt`` (DCP reshards) and famp's outputs for ``w`` ranks."""
    direct = dcp_load(mesh, torch.float32, os.path.join(out, "ckpt"), group)
    torch.save(direct["optim"], os.path.join(out, f"local{w}_{rank}.pt"))
    torch.save(direct["model"], os.path.join(out, f"model{w}_{rank}.pt"))
    famp_dcp = os.path.join(out, f"dcp{w}")  # famp-reshard --format dcp output, loaded by DCP
    got = dcp_load(mesh, torch.float32, famp_dcp, group)
    torch.save(got, os.path.join(out, f"fromdcp{w}_{rank}.pt"))
    # famp-reshard's rank file, loaded by the docs' recipe, run from the page
    from tests.fsdp.fsdp_helpers import docs_block

    namespace: dict[str, Any] = {}
    exec(docs_block("fsdp-dcp.md", "def load_shard"), namespace)
    model, optim = fresh(mesh, torch.float32, 10.0)
    namespace["load_shard"](model, optim, os.path.join(out, f"famp{w}", f"rank{rank:05d}.pt"))
    local = to_local(get_optimizer_state_dict(model, optim))
    torch.save(local, os.path.join(out, f"fromfamp{w}_{rank}.pt"))


def run_all(rank: int, world_size: int, out: str) -> None:
    """The whole job on 4 ranks, sub-meshes of 1..4 ranks doing the smaller world sizes.

    1. ``save_job`` on all 4 ranks; each MATRIX source ``src_<dtype>_<W>`` is saved by ranks
       ``0..W-1`` on their own process group.
    2. Rank 0 runs ``famp-reshard``: ``ckpt -n LOAD_W -o famp<LOAD_W>`` (rank files), ``ckpt
       -n LOAD_W -o dcp<LOAD_W> --format dcp``, and ``SOURCE -n T -o out_<dtype>_<W>_<T>
       --format dcp`` for every MATRIX case.
    3. ``load_job`` on ranks ``0..LOAD_W-1``; for every case ranks ``0..T-1`` load the source
       directly (DCP reshards) and famp's output into fresh FSDP2 models and record both in
       ``case_<dtype>_<W>_<T>_<rank>.pt``.
    Each rank writes ``done<rank>`` at the very end.
    """
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from famp._fsdp.cli import main as famp_reshard

    groups = {w: dist.new_group(list(range(w))) for w in range(1, world_size + 1)}
    meshes = {w: DeviceMesh.from_group(g, "cpu") for w, g in groups.items() if rank < w}
    save_job(rank, out)
    for name, w in sorted({(d, s) for d, s, _ in MATRIX}):
        if rank < w:
            model, optim = fresh(meshes[w], getattr(torch, name), 1.0)
            train(model, optim, rank, getattr(torch, name))
            msd, osd = get_state_dict(model, optim)
            path = os.path.join(out, f"src_{name}_{w}")
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=path, process_group=groups[w])
        dist.barrier()
    if rank == 0:
        ckpt, n = os.path.join(out, "ckpt"), str(LOAD_W)
        runs = [
            [ckpt, "-n", n, "-o", os.path.join(out, f"famp{LOAD_W}")],
            [ckpt, "-n", n, "-o", os.path.join(out, f"dcp{LOAD_W}"), "--format", "dcp"],
        ]
        for name, s, t in MATRIX:
            src, dst = (
                os.path.join(out, f"src_{name}_{s}"),
                os.path.join(out, f"out_{name}_{s}_{t}"),
            )
            runs.append([src, "-n", str(t), "-o", dst, "--format", "dcp"])
        for argv in runs:
            if famp_reshard(argv) != 0:
                raise RuntimeError(f"famp-reshard {argv} failed")
    dist.barrier()
    if rank < LOAD_W:
        load_job(rank, LOAD_W, out, meshes[LOAD_W], groups[LOAD_W])
    for name, s, t in MATRIX:
        if rank < t:
            dtype, src = getattr(torch, name), os.path.join(out, f"src_{name}_{s}")
            got = {
                "direct": dcp_load(meshes[t], dtype, src, groups[t]),
                "famp": dcp_load(
                    meshes[t], dtype, os.path.join(out, f"out_{name}_{s}_{t}"), groups[t]
                ),
            }
            torch.save(got, os.path.join(out, f"case_{name}_{s}_{t}_{rank}.pt"))
    dist.barrier()
    with open(os.path.join(out, f"done{rank}"), "w") as f:
        f.write("ok")


def run(rank: int, world_size: int, out: str, port: int) -> None:
    from tests.helpers import init_gloo

    init_gloo(rank, world_size, port)
    try:
        run_all(rank, world_size, out)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    out = sys.argv[1]
    torch.set_num_threads(1)
    mp.start_processes(run, args=(4, out, free_port()), nprocs=4, start_method="fork")


if __name__ == "__main__":
    main()
