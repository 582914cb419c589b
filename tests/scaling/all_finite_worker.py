"""One rank of tests/scaling/test_all_finite.py's FSDP2 run: `famp.all_finite` on DTensor grads.

A `fully_shard` model on gloo ranks; in each case non-finite values sit in one rank's shard only
(or nowhere). Each rank puts what `famp.all_finite` gave (eagerly and compiled) next to torch's
answers: `torch.isfinite` of every full tensor, and `GradScaler.unscale_`'s `found_inf`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

CASES = ("finite", "inf on rank 1", "nan on rank 0", "plain leaf on rank 0", "replicated inf")


def _grads(model: torch.nn.Module, rank: int, case: str) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Replicate

    grads: dict[str, Any] = {n: p.grad.clone() for n, p in model.named_parameters()}
    if case == "inf on rank 1" and rank == 1:
        grads["2.weight"].to_local().view(-1)[3] = math.inf
    elif case == "nan on rank 0" and rank == 0:
        grads["0.bias"].to_local()[1] = math.nan
    elif case == "plain leaf on rank 0":  # a rank-local tensor next to the DTensors
        grads["extra"] = torch.tensor([math.inf if rank == 0 else 1.0], dtype=torch.bfloat16)
    elif case == "replicated inf":
        mesh = grads["0.weight"].device_mesh
        grads["r"] = DTensor.from_local(torch.tensor([1.0, -math.inf]), mesh, [Replicate()])
    return grads


def _gradscaler_found_inf(model: torch.nn.Module, grads: dict[str, Any]) -> float:
    """`GradScaler.unscale_`'s found_inf on these grads (DTensor dispatch reduces it)."""
    params = list(model.parameters())
    for p, name in zip(params, dict(model.named_parameters()), strict=True):
        p.grad = grads[name].clone()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    optimizer = torch.optim.SGD(params, lr=0.1)
    scaler.scale(torch.ones(()))
    scaler.unscale_(optimizer)
    return sum(v.item() for v in scaler._found_inf_per_device(optimizer).values())


def worker(rank: int, world_size: int, port: int, results: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import famp
    from tests.helpers import init_gloo, report_finished

    init_gloo(rank, world_size, port)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        fully_shard(model)
        model(torch.randn(6, 8)).square().mean().backward()
        compiled = torch.compile(famp.all_finite, fullgraph=True)
        for case in CASES:
            grads = _grads(model, rank, case)
            torch_says = all(
                bool(torch.isfinite(g.full_tensor() if isinstance(g, DTensor) else g).all())
                for g in grads.values()
            )
            dist.all_reduce(flag := torch.tensor([float(torch_says)]), op=dist.ReduceOp.MIN)
            ok = famp.all_finite(grads)
            ok_compiled = compiled(grads)
            _, found_inf = famp.unscale_and_check(famp.init_scaler(2.0), grads)
            chosen = famp.select_tree(ok, {"w": torch.zeros(2)}, {"w": torch.ones(2)})
            params = {n: p.detach() for n, p in model.named_parameters()}
            stepped = famp.select_tree(ok, {n: p - 1 for n, p in params.items()}, params)
            results.put(
                (
                    case,
                    rank,
                    [
                        (type(x).__name__, x.dtype, tuple(x.shape), bool(x))
                        for x in (ok, ok_compiled)
                    ],
                    bool(flag.item()),  # torch.isfinite of every full tensor, on every rank
                    found_inf.item(),
                    None if "plain" in case else _gradscaler_found_inf(model, grads),
                    chosen["w"].tolist(),
                    all(
                        torch.equal(s.full_tensor(), (p - int(bool(ok))).full_tensor())
                        for s, p in zip(stepped.values(), params.values(), strict=True)
                    ),
                )
            )
        report_finished(rank, results)
    finally:
        dist.destroy_process_group()
