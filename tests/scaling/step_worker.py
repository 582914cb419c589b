"""One rank of tests/scaling/test_distributed_step.py, started by torchrun on 2 gloo ranks.

Records what famp and torch did on this rank in ``OUT/rank{r}.pt``:

- ``value_and_grad``: ``famp.value_and_grad(group=)`` on local shards, rank 1 overflowing.
- ``fsdp1``: FSDP1 with an inf injected into rank 1's gradient shard at one step. famp
  (``unscale_and_check(group=)`` + the fused SGD bridge), ``ShardedGradScaler`` with plain SGD (the
  oracle), and two torch setups that let the ranks diverge: plain ``GradScaler``, and
  ``ShardedGradScaler`` with a fused SGD (its fused path never all-reduces found_inf).
- ``fsdp2``: FSDP2 (``fully_shard``, DTensor grads) trained by ``examples/fsdp_train.py``'s
  ``train`` with an inf in the last rank's shard, next to ``GradScaler`` + fused AdamW (the oracle).
  A DCP checkpoint at step 3; torch's own full state at step 3 (for the W=1 resume in the test);
  a fresh model and optimizer resumed from the checkpoint at W=2 and trained to the end.
- ``zero``: ``ZeroRedundancyOptimizer`` (Adam) stepped by ``famp.optimizer_step`` next to a
  ``GradScaler`` loop, with an inf at one step: each rank's local optimizer keeps the moments of
  its shard, which a skipped step must leave as they were.
- ``nonfused``: non-fused (foreach and for-loop) optimizers stepped by ``famp.optimizer_step``
  on FSDP1 (``group=``; ``ShardedGradScaler`` the oracle) and FSDP2 (DTensor reductions;
  ``GradScaler`` the oracle), an inf in one rank's shard at some steps: every step's local
  parameters, unscaled gradients, optimizer state, param-group tensors, scale and found_inf, on
  every rank.
- Finally the example's ``main`` runs at W=2 in this process group, writing ``OUT/cli``.
"""

from __future__ import annotations

import datetime
import math
import pathlib
import sys
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import famp  # noqa: E402
from tests.helpers import load_example  # noqa: E402

FSDP1_STEPS, FSDP1_BAD_STEP = 5, 2
FSDP2_STEPS, CHECKPOINT_STEP, FSDP2_BAD_STEPS = 6, 3, frozenset({2, 4})


def fsdp1(ex: Any, rank: int) -> dict[str, Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    out: dict[str, Any] = {}
    for name in ["famp", "famp_bridge", "sharded", "gradscaler", "sharded_fused"]:
        model = FullyShardedDataParallel(ex.build_model(), device_id=torch.device("cpu"))
        optimizer = torch.optim.SGD(
            model.parameters(), lr=0.1, fused=name in ("famp", "famp_bridge", "sharded_fused")
        )
        kwargs = {"init_scale": 2.0**10, "growth_interval": 2}
        scaler: Any = (
            torch.amp.GradScaler("cpu", **kwargs)
            if name == "gradscaler"
            else ShardedGradScaler("cpu", **kwargs)
        )
        state = famp.init_scaler(**kwargs)
        scales, found_infs = [], []
        for step in range(FSDP1_STEPS):
            x, y = ex.batch(step, rank, 2)
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            uses_famp = name.startswith("famp")
            (famp.scale(state, loss) if uses_famp else scaler.scale(loss)).backward()
            if step == FSDP1_BAD_STEP and rank == 1:
                next(model.parameters()).grad.view(-1)[0] = math.inf
            if name == "famp":
                params = list(model.parameters())
                grads, found_inf = famp.unscale_and_check(
                    state, [p.grad for p in params], group=dist.group.WORLD
                )
                for p, g in zip(params, grads, strict=True):
                    p.grad = g
                famp.optimizer_step(optimizer, found_inf=found_inf)
                state = famp.update_scale(state, found_inf)
                scales.append(state.scale)
                found_infs.append(found_inf)
            elif name == "famp_bridge":  # the scaled grads straight to the fused kernel
                found_inf = famp.optimizer_step(optimizer, state, group=dist.group.WORLD)
                state = famp.update_scale(state, found_inf)
                scales.append(state.scale)
                found_infs.append(found_inf)
            else:
                scaler.step(optimizer)
                scaler.update()
                scales.append(scaler._scale.clone())
        out[name] = {
            "scales": torch.stack(scales),
            "found_infs": torch.stack(found_infs) if found_infs else None,
            "params": [p.detach().clone() for p in model.parameters()],
        }
    return out


def value_and_grad_group(rank: int) -> dict[str, Any]:
    """value_and_grad(group=): each rank differentiates its own shard; rank 1's overflows."""
    w = torch.full((4,), float(rank + 1))
    x = torch.arange(4.0)
    if rank == 1:
        x[0] = math.inf
    state = famp.init_scaler(2.0**10)
    out = {}
    for name, group in [("local", None), ("group", dist.group.WORLD)]:
        step = famp.value_and_grad(lambda w, x: (w * x).sum(), group=group)
        _, _, found_inf, new_state = step(state, w, x)
        out[name] = (found_inf, new_state.scale)
    return out


def local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "params": [ex_local(p).detach().clone() for p in model.parameters()],
        "optim": {
            i: {k: ex_local(v).clone() for k, v in s.items()}
            for i, s in enumerate(optimizer.state[p] for p in model.parameters())
        },
    }


def full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """torch's own full state dicts, copied (``step`` would alias the live optimizer state)."""
    msd, osd = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    copy = optree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, (msd, osd))
    return {"model": copy[0], "optim": copy[1]}


def ex_local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def fsdp2(ex: Any, rank: int, out_dir: pathlib.Path) -> dict[str, Any]:
    ckpt = out_dir / "ckpt"
    # famp, through the example's own functions, with a DCP checkpoint at CHECKPOINT_STEP
    model = ex.shard(ex.build_model(), 2)
    optimizer = ex.make_optimizer(model)
    state = famp.init_scaler(2.0**16, growth_interval=2)
    kwargs = {"rank": rank, "world": 2, "overflow_at": FSDP2_BAD_STEPS}
    state, first = ex.train(
        model, optimizer, state, range(CHECKPOINT_STEP), checkpoint_every=0, out=ckpt, **kwargs
    )
    at_checkpoint = {**full_state(model, optimizer), "scaler": famp.to_state_dict(state)}
    state, second = ex.train(model, optimizer, state, range(CHECKPOINT_STEP, FSDP2_STEPS), **kwargs)
    famp_run = {
        "found_infs": torch.stack(first + second),
        "scaler": famp.to_state_dict(state),
        "local": local_state(model, optimizer),
        "full": full_state(model, optimizer),
    }

    # the oracle: GradScaler with the fused AdamW (DTensor dispatch reduces found_inf)
    model = ex.shard(ex.build_model(), 2)
    optimizer = ex.make_optimizer(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)
    forward = famp.autocast(
        model, famp.get_policy("params=float32,compute=bfloat16,output=float32")
    )
    scales, found_infs, direct = [], [], []
    for step in range(FSDP2_STEPS):
        x, y = ex.batch(step, rank, 2)
        optimizer.zero_grad()
        scaler.scale(torch.nn.functional.cross_entropy(forward(x), y)).backward()
        if step in FSDP2_BAD_STEPS and rank == 1:
            ex.local(next(model.parameters()).grad).view(-1)[0] = math.inf
        # famp on the same DTensor grads, no extra argument: unscaled shards and found_inf
        same = famp.from_state_dict(scaler.state_dict())
        unscaled, found_inf = famp.unscale_and_check(same, [p.grad for p in model.parameters()])
        scaler.unscale_(optimizer)
        direct.append(
            {
                "found_inf": found_inf,
                "type": type(unscaled[0]).__name__,
                "equal": all(
                    torch.equal(ex.local(a).view(torch.int32), ex.local(p.grad).view(torch.int32))
                    for a, p in zip(unscaled, model.parameters(), strict=True)
                ),
            }
        )
        scaler.step(optimizer)
        found_infs.append(sum(scaler._found_inf_per_device(optimizer).values()))
        scaler.update()
        scales.append(scaler._scale.clone())
    oracle = {
        "scales": torch.stack(scales),
        "found_infs": torch.stack(found_infs),
        "direct": direct,
        "scaler": scaler.state_dict(),
        "local": local_state(model, optimizer),
    }

    # resume from the checkpoint at W=2 in fresh objects
    model = ex.shard(ex.build_model(), 2)
    optimizer = ex.make_optimizer(model)
    state, step = ex.load_checkpoint(ckpt / f"step-{CHECKPOINT_STEP}", model, optimizer, rank, 2)
    state, _ = ex.train(model, optimizer, state, range(step, FSDP2_STEPS), **kwargs)
    resumed = {
        "step": step,
        "scaler": famp.to_state_dict(state),
        "local": local_state(model, optimizer),
    }
    return {
        "famp": famp_run,
        "oracle": oracle,
        "resumed": resumed,
        "at_checkpoint": at_checkpoint,
    }


ZERO_STEPS, ZERO_BAD_STEP = 5, 2


def zero(rank: int) -> dict[str, Any]:
    """famp.optimizer_step on a ZeroRedundancyOptimizer next to GradScaler.step, per step."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    runs: dict[str, Any] = {}
    for name in ("torch", "famp"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        opt = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2, foreach=True
        )
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        state = famp.init_scaler(2.0**10, growth_interval=2)
        steps = []
        for step in range(ZERO_STEPS):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            loss = model(x).square().mean()
            (scaler.scale(loss) if name == "torch" else famp.scale(state, loss)).backward()
            if step == ZERO_BAD_STEP:
                next(model.parameters()).grad[0, 0] = math.inf  # type: ignore[index]
            if name == "torch":
                scaler.step(opt)
                scaler.update()
            else:
                state = famp.update_scale(state, famp.optimizer_step(opt, state))
            local = opt.optim.state  # this rank's shard of the state
            steps.append(
                {
                    "params": [p.detach().clone() for p in model.parameters()],
                    "optim": [
                        {k: v.clone() for k, v in local[p].items()}
                        for p in model.parameters()
                        if p in local
                    ],
                }
            )
        runs[name] = steps
    return runs


NONFUSED_STEPS, NONFUSED_BAD = 5, {1: 1, 3: 0}  # step -> the rank whose shard gets an inf


class GroupCounter(torch.optim.Optimizer):
    """Momentum SGD counting its steps in a tensor of each param group, in place (timm's Lamb)."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1})
        for group in self.param_groups:
            group["count"] = torch.zeros(())

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            group["count"] += 1
            for p in group["params"]:
                if p.grad is not None:
                    moment = self.state[p].setdefault("m", torch.zeros_like(p))
                    moment.mul_(0.9).add_(p.grad)
                    p.add_(moment, alpha=-0.1)


NONFUSED_CASES: dict[str, dict[str, Any]] = {
    # name: FSDP version, optimizer, how famp steps, FSDP2 options
    "fsdp2_adam_foreach": {"fsdp": 2, "opt": "adam_foreach", "famp": "step"},
    "fsdp2_sgd_nesterov_foreach_mp_accumulate": {
        "fsdp": 2,
        "opt": "sgd_foreach",
        "famp": "step",
        "mp": True,
        "reshard": False,
        "micro": 2,
    },
    "fsdp2_adamw_loop_offload_unscale": {
        "fsdp": 2,
        "opt": "adamw_loop",
        "famp": "unscale",
        "offload": True,
    },
    "fsdp1_adam_foreach_orig_params": {"fsdp": 1, "opt": "adam_foreach", "famp": "step"},
    "fsdp1_group_counter_unscale": {"fsdp": 1, "opt": "counter", "famp": "unscale"},
}


def _nonfused_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "counter":
        return GroupCounter(params)
    if name == "sgd_foreach":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, foreach=True)
    adam = torch.optim.AdamW if name.startswith("adamw") else torch.optim.Adam
    return adam(params, lr=1e-2, weight_decay=0.1, foreach=name.endswith("foreach"))


def _nonfused_model(case: dict[str, Any]) -> torch.nn.Module:
    """Uneven shards: a (1, 9) weight and a (1,) bias leave rank 1 an empty FSDP2 shard; FSDP1's
    flat parameter puts every parameter but the first wholly on rank 1."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(7, 9), torch.nn.Tanh(), torch.nn.Linear(9, 1), torch.nn.Linear(1, 3)
    )
    if case["fsdp"] == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel

        orig = case["opt"] != "counter"
        return FullyShardedDataParallel(model, device_id=torch.device("cpu"), use_orig_params=orig)
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {"reshard_after_forward": case.get("reshard", True)}
    if case.get("mp"):
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if case.get("offload"):
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, **kwargs)
    return fully_shard(model, **kwargs)


def _clone_local(x: Any) -> Any:
    return ex_local(x).detach().clone() if isinstance(x, torch.Tensor) else x


def _nonfused_run(case: dict[str, Any], oracle: bool, rank: int) -> list[dict[str, Any]]:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    model = _nonfused_model(case)
    optimizer = _nonfused_optimizer(case["opt"], model.parameters())
    kwargs = {"init_scale": 2.0**10, "growth_interval": 2}
    scaler = (ShardedGradScaler if case["fsdp"] == 1 else torch.amp.GradScaler)("cpu", **kwargs)
    state = famp.init_scaler(**kwargs)
    group = dist.group.WORLD if case["fsdp"] == 1 else None  # FSDP2: the DTensors' mesh
    steps = []
    for step in range(NONFUSED_STEPS):
        optimizer.zero_grad()
        micro = case.get("micro", 1)
        for m in range(micro):
            if micro > 1:
                model.set_requires_gradient_sync(m == micro - 1)  # type: ignore[operator]
            gen = torch.Generator().manual_seed(100 * (step * micro + m) + rank)
            x, y = torch.randn(4, 7, generator=gen), torch.randn(4, 3, generator=gen)
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            (scaler.scale(loss) if oracle else famp.scale(state, loss)).backward()
        if NONFUSED_BAD.get(step) == rank:
            shard = next(ex_local(p.grad) for p in model.parameters() if p.grad is not None)
            shard.view(-1)[0] = math.inf
        if oracle:
            scaler.step(optimizer)
            found = sum(v.item() for v in scaler._found_inf_per_device(optimizer).values())
            found_inf = torch.tensor(float(found != 0))
            scaler.update()
            scale = scaler._scale.clone()
        else:
            if case["famp"] == "step":
                found_inf = famp.optimizer_step(optimizer, state, group=group)
            else:  # unscale_and_check(group=) then the unscaled grads with found_inf=
                params = [p for p in model.parameters() if p.grad is not None]
                grads, found_inf = famp.unscale_and_check(
                    state, [p.grad for p in params], group=group, donate=rank == 0
                )
                for p, g in zip(params, grads, strict=True):
                    p.grad = g
                famp.optimizer_step(optimizer, found_inf=found_inf)
            state = famp.update_scale(state, found_inf)
            scale = state.scale.clone()
        steps.append(
            {
                "params": [_clone_local(p) for p in model.parameters()],
                "grads": [_clone_local(p.grad) for p in model.parameters()],  # unscaled
                "optim": [
                    {k: _clone_local(v) for k, v in optimizer.state[p].items()}
                    for p in model.parameters()
                ],
                "groups": [
                    {k: _clone_local(v) for k, v in g.items() if k != "params"}
                    for g in optimizer.param_groups
                ],
                "scale": scale.reshape(()),
                "found_inf": found_inf.reshape(()).clone(),
            }
        )
    return steps


def nonfused(rank: int) -> dict[str, Any]:
    return {
        name: {"famp": _nonfused_run(case, False, rank), "oracle": _nonfused_run(case, True, rank)}
        for name, case in NONFUSED_CASES.items()
    }


def main() -> None:
    out_dir = pathlib.Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    ex = load_example("fsdp_train")
    try:
        record = {
            "value_and_grad": value_and_grad_group(rank),
            "fsdp1": fsdp1(ex, rank),
            "fsdp2": fsdp2(ex, rank, out_dir),
            "zero": zero(rank),
            "nonfused": nonfused(rank),
        }
        torch.save(record, out_dir / f"rank{rank}.pt")
        ex.main(["--steps", "4", "--checkpoint-every", "2", "--out", str(out_dir / "cli")])
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
