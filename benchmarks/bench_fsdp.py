"""FSDP optimizer state: famp's pure maps vs torch's collectives, side by side in one run.

Two gloo ranks (forked, 127.0.0.1, one thread each) train a ``fully_shard``-ed model of
``--layers`` x Linear(``--width``, ``--width``) (default: 100.7M parameters, 806 MB of Adam state)
for one step, then time, on the same state:

* torch ``set_optimizer_state_dict(full_state_dict=True)`` (full -> every rank's shard, 2 ranks)
  vs ``famp.shard_optim_state`` (full -> one rank's shard, one process);
* torch ``get_optimizer_state_dict(full_state_dict=True)`` (shards -> full on every rank)
  vs ``famp.unshard_optim_state`` (both ranks' shards -> full, one process), and ``torch.cat``
  of the same tensors (the memory-bandwidth bound);
* torch get full + set full (the in-job way to reshard) vs ``famp.reshard_optim_state`` (2 -> 3);
* ``dcp.load`` + ``set_state_dict`` on 2 ranks vs ``famp.load_dcp_optim_state`` (one process) +
  ``famp.shard_optim_state``, from the same DCP checkpoint.

While famp runs on rank 0, rank 1 waits in a barrier. Times are the best of ``--repeat`` runs.
Peak extra memory is the rise of the process's peak RSS over its RSS before the call
(``/proc/self/status`` VmHWM, reset through ``/proc/self/clear_refs``; glibc set to mmap blocks of
1 MiB and more, so freed tensors leave the RSS), in units of one full copy of the optimizer state.

Usage: ``python benchmarks/bench_fsdp.py [--layers 24 --width 2048 --repeat 3]``.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import math
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import famp

WORLD = 2
STATE_NAMES = ("exp_avg", "exp_avg_sq")
FULL = StateDictOptions(full_state_dict=True)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        found = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    assert found is not None, field
    return int(found.group(1)) * 1024


def exact_rss() -> None:
    """Make RSS follow tensor memory: blocks of 1 MiB and more are mmap-ed and unmapped on free.

    glibc otherwise raises its mmap threshold to 32 MiB after the first free, keeps freed tensors
    in its heap, and a new tensor reuses them without raising the RSS.
    """
    libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD; setting it also stops the dynamic threshold


libc = ctypes.CDLL("libc.so.6")


def measure_many(fns: dict[str, Callable[[], Any]], repeat: int) -> list[tuple[str, float, int]]:
    """``(name, best seconds, peak extra bytes of the first run)`` per function, runs interleaved.

    Every rank calls it with the same functions: a barrier (untimed) follows each call.
    Interleaving spreads the noise of other processes on the machine over all functions alike.
    """
    best = dict.fromkeys(fns, float("inf"))
    peak = dict.fromkeys(fns, 0)
    for i in range(repeat):
        for name, fn in fns.items():
            gc.collect()
            libc.malloc_trim(0)
            with open("/proc/self/clear_refs", "w") as f:  # reset VmHWM to the current RSS
                f.write("5")
            before = _status("VmRSS")
            start = time.perf_counter()
            out = fn()
            best[name] = min(best[name], time.perf_counter() - start)
            if i == 0:
                peak[name] = _status("VmHWM") - before
            out = None  # noqa: F841 (freed before the next call is measured)
            dist.barrier()
    return [(name, best[name], peak[name]) for name in fns]


def to_local(osd: dict[str, Any]) -> dict[str, Any]:
    state = {
        f: {k: v.to_local() if isinstance(v, DTensor) else v for k, v in e.items()}
        for f, e in osd["state"].items()
    }
    return {"state": state, "param_groups": osd["param_groups"]}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["state"].keys() == b["state"].keys() and all(
        torch.equal(a["state"][f][k], b["state"][f][k]) for f in a["state"] for k in a["state"][f]
    )


def nbytes(osd: dict[str, Any]) -> int:
    return sum(
        v.numel() * v.element_size()
        for e in osd["state"].values()
        for v in e.values()
        if isinstance(v, torch.Tensor)
    )


def run(rank: int, port: int, args: argparse.Namespace, ckpt: str) -> None:
    torch.set_num_threads(1)
    exact_rss()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=600),
    )
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, args.width)).square().mean().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    layout2, layout3 = famp.fsdp2_layout(shapes, WORLD), famp.fsdp2_layout(shapes, 3)

    def everyone(fn: Callable[[], Any]) -> Callable[[], Any]:
        """A collective: timed until both ranks are done."""
        return lambda: (fn(), dist.barrier())[0]

    def alone(fn: Callable[[], Any]) -> Callable[[], Any]:
        """famp on rank 0; rank 1 goes straight to the (untimed) barrier after each call."""
        return lambda: fn() if rank == 0 else None

    # Correctness first (untimed): famp's results equal torch's, bit for bit.
    full = get_optimizer_state_dict(model, optim, options=FULL)
    local = to_local(get_optimizer_state_dict(model, optim))
    full_bytes = nbytes(full)
    shards: list[dict[str, Any]] = []
    pairs: list[list[torch.Tensor]] = []
    if rank == 0:
        assert same(famp.shard_optim_state(full, layout2, 0), local), "shard differs from torch"
        shards = [famp.shard_optim_state(full, layout2, r, copy=True) for r in range(WORLD)]
        assert same(famp.unshard_optim_state(shards, layout2), full), "unshard differs from torch"
        pairs = [[s["state"][f][k] for s in shards] for f in full["state"] for k in STATE_NAMES]

    def torch_reshard() -> None:
        got = get_optimizer_state_dict(model, optim, options=FULL)
        set_optimizer_state_dict(model, optim, got, options=FULL)

    rows = measure_many(
        {
            "torch get_full": everyone(
                lambda: get_optimizer_state_dict(model, optim, options=FULL)
            ),
            "torch set_full": everyone(
                lambda: set_optimizer_state_dict(model, optim, full, options=FULL)
            ),
            "torch get_full+set_full": everyone(torch_reshard),
            "famp shard": alone(lambda: famp.shard_optim_state(full, layout2, 0)),
            "famp unshard": alone(lambda: famp.unshard_optim_state(shards, layout2)),
            "torch.cat (same tensors)": alone(lambda: [torch.cat(p) for p in pairs]),
            "famp reshard 2->3": alone(lambda: famp.reshard_optim_state(shards, layout2, layout3)),
        },
        args.repeat,
    )
    full, shards, pairs = {}, [], []

    # DCP: the same state saved by torch at W=2, loaded by torch at W=2 and by famp offline.
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    msd, osd = {}, {}

    def torch_dcp_load() -> None:
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=ckpt)
        set_state_dict(
            model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )

    def famp_dcp_load() -> Any:
        loaded = famp.load_dcp_optim_state(ckpt)
        layout = famp.fsdp2_layout(famp.read_dcp_param_shapes(ckpt), WORLD)
        return famp.shard_optim_state(loaded, layout, 0)

    if rank == 0:
        assert same(famp_dcp_load(), local), "famp's DCP read differs from torch's local shard"
    rows += measure_many(
        {
            "torch dcp.load+set_state_dict": everyone(torch_dcp_load),
            "famp load_dcp_optim_state+shard": alone(famp_dcp_load),
        },
        args.repeat,
    )
    if rank == 0:
        report(rows, full_bytes, sum(math.prod(s) for s in shapes.values()), args)
    dist.barrier()
    dist.destroy_process_group()


def report(
    rows: list[tuple[str, float, int]], full_bytes: int, n_params: int, args: argparse.Namespace
) -> None:
    by = {name: (s, peak) for name, s, peak in rows}
    gib = full_bytes / 2**30
    print(
        f"\n{n_params / 1e6:.1f}M parameters, Adam state {full_bytes / 1e6:.0f} MB; "
        f"{WORLD} gloo ranks, 1 thread each; best of {args.repeat}; torch {torch.__version__}"
    )
    print(f"{'operation':<36} {'time':>10} {'peak extra (full copies)':>26}")
    for name, seconds, peak in rows:
        print(f"{name:<36} {seconds * 1e3:>8.1f}ms {peak / full_bytes:>26.2f}")

    def t(name: str) -> float:
        return by[name][0]

    cat_bw = gib / t("torch.cat (same tensors)")
    unshard_bw = gib / t("famp unshard")
    print("\nratios (famp / torch; lower is faster)")
    ratios = [
        ("shard / set_optimizer_state_dict", t("famp shard") / t("torch set_full"), "<= 0.01"),
        ("unshard / get_optimizer_state_dict", t("famp unshard") / t("torch get_full"), ""),
        (
            "reshard 2->3 / (get_full + set_full)",
            t("famp reshard 2->3") / t("torch get_full+set_full"),
            "",
        ),
        (
            "load_dcp+shard / dcp.load+set_state_dict",
            t("famp load_dcp_optim_state+shard") / t("torch dcp.load+set_state_dict"),
            "",
        ),
    ]
    for name, value, target in ratios:
        print(f"  {name:<42} {value:10.4f}  {('target ' + target) if target else ''}")
    print(
        f"  unshard bandwidth {unshard_bw:.2f} GiB/s = {unshard_bw / cat_bw:.0%} of torch.cat's "
        f"{cat_bw:.2f} GiB/s (target >= 70%)"
    )
    for name in ("famp shard", "famp unshard", "famp reshard 2->3"):
        print(
            f"  {name} peak extra memory: {by[name][1] / full_bytes:.2f} full copies (target <= 1)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ckpt = tempfile.mkdtemp(prefix="famp-bench-dcp-")
    try:
        mp.start_processes(run, args=(port, args, ckpt), nprocs=WORLD, start_method="fork")
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)


if __name__ == "__main__":
    main()
