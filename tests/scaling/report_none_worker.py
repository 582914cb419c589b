"""One rank of tests/scaling/test_report.py's runs of `nonfinite_report(group=)` on trees whose
`None` leaves differ between ranks (FSDP1 with `use_orig_params=True` gives a parameter that has
no element on a rank a `None` grad there), and on trees whose structures differ.

Every rank puts on the queue what it got (its figures, or the ValueError's message) next to its
own local report, and the test judges the ranks by what they report.
"""

from __future__ import annotations

import math
from typing import Any

import torch

# Trees of the same structure (a `None` leaf is a leaf) with `None` in different places:
# "b" is None on rank 0 only, "a" on rank 1 only, "c" on both. The overflow is rank 1's "b".
MOVED = (
    lambda: {
        "a": torch.tensor([1.0, -2.0], dtype=torch.float16),
        "b": None,
        "c": None,
        "h": torch.tensor([1.0, 0.5]),
    },
    lambda: {
        "a": None,
        "b": torch.tensor([math.inf, 3.0], dtype=torch.bfloat16),
        "c": None,
        "h": torch.tensor([4.0, math.nan]),
    },
)
# Trees of different structures: every rank must raise the same ValueError (before the fix,
# gloo aborted on different sizes, and same-size trees were matched by position).
EXTRA = (
    lambda: {"a": torch.ones(2), "b": None},
    lambda: {"a": None, "b": None, "c": torch.ones(1)},
)
RENAMED = (
    lambda: {"a": torch.ones(2), "b": torch.ones(1)},
    lambda: {"a": None, "z": torch.ones(1)},
)


def figures(report: Any) -> dict[str, Any]:
    """A report's counts and amax per key, as Python values (None for a None leaf)."""
    return {
        key: None
        if count is None
        else (count.dtype, count.tolist(), report.amax[key].dtype, report.amax[key].tolist())
        for key, count in report.counts.items()
    }


def _fsdp1_grads(rank: int) -> dict[str, Any]:
    """FSDP1(use_orig_params=True) gradients: rank 0 holds no element of three parameters."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    import famp

    torch.manual_seed(0)
    model = FullyShardedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)),
        device_id=torch.device("cpu"),
        use_orig_params=True,
    )
    famp.scale(famp.init_scaler(2.0**10), model(torch.randn(6, 8)).square().mean()).backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    if rank == 1:
        grads["_fsdp_wrapped_module.2.weight"].view(-1)[0] = math.inf
    return grads


def worker(rank: int, world_size: int, port: int, results: Any) -> None:
    import torch.distributed as dist

    import famp
    from tests.helpers import init_gloo, report_finished

    init_gloo(rank, world_size, port)
    group = dist.group.WORLD

    def report(tree: Any) -> famp.NonfiniteReport:
        return famp.nonfinite_report(tree, group=group)

    compiled = torch.compile(report, fullgraph=True, backend="eager")

    def report_float64_default(tree: Any) -> famp.NonfiniteReport:
        # Before 2026-12-02 famp's NaN for a `None` leaf took the default dtype: float64 made
        # this rank raise "cannot view Double as Int" and the other hang up.
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            return report(tree)
        finally:
            torch.set_default_dtype(default)

    try:
        cases = [
            ("moved", MOVED[rank](), report),
            ("extra", EXTRA[rank](), report),
            ("renamed", RENAMED[rank](), report),
            ("fsdp1", _fsdp1_grads(rank), report),
            ("moved compiled", MOVED[rank](), compiled),
            ("moved float64-default", MOVED[rank](), report_float64_default),
        ]
        for name, tree, run in cases:
            local = famp.nonfinite_report(tree)
            try:
                got = run(tree)
            except ValueError as error:
                results.put((name, rank, "ValueError", str(error), figures(local)))
                continue
            _, found = famp.unscale_and_check(famp.init_scaler(2.0), tree, group=group)
            results.put(
                (
                    name,
                    rank,
                    figures(got),
                    figures(local),
                    got.dtypes,
                    got.paths,
                    got.summary(),
                    got.found_inf.item(),
                    found.item(),
                )
            )
        report_finished(rank, results)
    finally:
        dist.destroy_process_group()
