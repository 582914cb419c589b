"""One rank of tests/scaling/test_report.py's gloo runs: famp.nonfinite_report(group=), each case.

Each case puts non-finite values (and a huge finite value) on one rank only; every rank puts what
it received on the queue, and the test judges the ranks by what they report.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def case_tree(case: int, rank: int, bad_rank: int) -> dict[str, torch.Tensor]:
    """The tree rank `rank` holds in `case`; only `bad_rank` has non-finite values."""
    tree = {
        "embed.weight": torch.full((4, 3), float(rank + 1)),
        "head.weight": torch.arange(6.0, dtype=torch.bfloat16) * (rank + 1),
        "head.bias": torch.full((2,), -0.5 * (rank + 1), dtype=torch.float16),
        "empty": torch.zeros(0),
    }
    if rank == bad_rank:
        if case == 0:
            tree["head.weight"][1] = math.inf
            tree["head.weight"][4] = math.nan
        elif case == 1:
            tree["head.bias"][0] = -math.inf
            tree["embed.weight"][2, 2] = 3.0e38  # huge but finite
    return tree


def worker(rank: int, world_size: int, port: int, cases: list[int], results: Any) -> None:
    """Run every case over the whole world and over the group of ranks 0 and 1."""
    import torch.distributed as dist

    import famp
    from tests.helpers import init_gloo, report_finished

    init_gloo(rank, world_size, port)
    try:
        pair = dist.new_group([0, 1])
        for group, size in ((dist.group.WORLD, world_size), (pair, 2)):
            if rank >= size:
                continue
            for case in cases:
                bad_rank = case % size if case < 2 else -1
                tree = case_tree(case, rank, bad_rank)
                report = famp.nonfinite_report(tree, group=group)
                _, found = famp.unscale_and_check(famp.init_scaler(2.0), tree, group=group)
                local = famp.nonfinite_report(tree)
                results.put(
                    (
                        size,
                        rank,
                        case,
                        bad_rank,
                        {
                            k: (v.dtype, tuple(v.shape), v.tolist())
                            for k, v in report.counts.items()
                        },
                        {k: (v.dtype, tuple(v.shape), v.tolist()) for k, v in report.amax.items()},
                        (report.found_inf.dtype, report.found_inf.item()),
                        found.item(),
                        local.found_inf.item(),
                        report.summary(),
                    )
                )
        results.put(("dtensor", rank, *dtensor_case(rank, world_size)))
        report_finished(rank, results)
    finally:
        dist.destroy_process_group()


def dtensor_case(rank: int, world_size: int) -> tuple[Any, ...]:
    """A DTensor leaf sharded over the ranks, an inf in the last rank's shard only."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import famp

    mesh = init_device_mesh("cpu", (world_size,))
    shard = torch.arange(3.0) + 10 * rank
    if rank == world_size - 1:
        shard[1] = math.inf
    tree = {"w": DTensor.from_local(shard, mesh, [Shard(0)], run_check=False)}
    local = famp.nonfinite_report(tree)
    gathered = famp.nonfinite_report(tree, group=dist.group.WORLD)
    _, found = famp.unscale_and_check(famp.init_scaler(2.0), tree)
    return (
        local.counts["w"].item(),
        local.amax["w"].item(),
        local.found_inf.item(),
        found.item(),
        gathered.counts["w"].tolist(),
        gathered.amax["w"].tolist(),
    )
