"""Consolidating and resharding a DCP checkpoint: famp-reshard's streaming vs torch's ways.

For each size (GB of checkpoint: model + AdamW ``exp_avg``/``exp_avg_sq``, float32), 4 gloo ranks
(forked, one thread each) build a ``fully_shard``-ed stack of ``Linear(--width, --width)`` layers
on the meta device, materialize their shards, take one AdamW step and ``dcp.save`` the state of
``get_state_dict``. Then, each in a fresh process, measured by that process's peak RSS
(``ru_maxrss``) and wall time:

* ``baseline``: the interpreter with torch, DCP and famp imported (no work);
* ``famp --full``: ``famp-reshard CKPT --full FILE --max-memory 64M``;
* ``dcp_to_torch_save``: torch's own consolidation to one file (the same file contents);
* ``famp -n 3 --format dcp``: a DCP checkpoint for 3 ranks, ``--max-memory 64M``;
* ``torch W=3 load``: torch's online reshard: 3 gloo ranks build the model, ``dcp.load`` +
  ``set_state_dict`` (RSS: the sum over the 3 ranks' peaks, and the largest one).

Usage: ``python benchmarks/bench_reshard_stream.py --sizes 0.5 1 2 [--width 2048]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

TIMEOUT = datetime.timedelta(seconds=600)


def build(width: int, layers: int) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    return model


def _rank(rank: int, world: int, port: int, mode: str, ckpt: str, width: int, layers: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=TIMEOUT
    )
    try:
        start = time.perf_counter()
        model = build(width, layers)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if mode == "save":
            torch.manual_seed(rank)
            for p in model.parameters():
                with torch.no_grad():
                    p.normal_()
                p.grad = torch.randn_like(p)
            optim.step()
            msd, osd = get_state_dict(model, optim)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
        else:
            msd, osd = get_state_dict(model, optim)
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=ckpt)
            set_state_dict(
                model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
        dist.barrier()
        seconds = time.perf_counter() - start
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        with open(os.path.join(os.path.dirname(ckpt), f"{mode}{rank}.json"), "w") as f:
            json.dump({"rss": rss, "seconds": seconds}, f)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job(mode: str, world: int, ckpt: str, width: int, layers: int) -> dict[str, float]:
    start = time.perf_counter()
    args = (world, _free_port(), mode, ckpt, width, layers)
    mp.start_processes(_rank, args=args, nprocs=world, start_method="fork")
    wall = time.perf_counter() - start
    reports = [
        json.loads(pathlib.Path(os.path.dirname(ckpt), f"{mode}{r}.json").read_text())
        for r in range(world)
    ]
    return {
        "seconds": wall,
        "rss": sum(r["rss"] for r in reports),
        "rss_max_rank": max(r["rss"] for r in reports),
    }


CHILD = """
import json, resource, sys, time
import torch, torch.distributed.checkpoint
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from famp._fsdp.cli import main
what, ckpt, out = sys.argv[1:4]
start = time.perf_counter()
if what == "famp_full":
    assert main([ckpt, "--full", out, "--max-memory", "64M"]) == 0
elif what == "dcp_to_torch_save":
    dcp_to_torch_save(ckpt, out)
elif what == "famp_dcp3":
    assert main([ckpt, "-n", "3", "-o", out, "--format", "dcp", "--max-memory", "64M"]) == 0
seconds = time.perf_counter() - start
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"seconds": seconds, "rss": rss}))
"""


def child(what: str, ckpt: str, out: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, what, ckpt, out],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.5, 1.0, 2.0], help="GB")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs")
    header = "| checkpoint | what | peak RSS | time |"
    rows = [header, "|---|---|---|---|"]
    for size in args.sizes:
        layer_bytes = 3 * 4 * args.width * args.width  # param + exp_avg + exp_avg_sq, float32
        layers = max(1, round(size * 1e9 / layer_bytes))
        scratch = tempfile.mkdtemp(dir=args.dir)
        try:
            ckpt = os.path.join(scratch, "ckpt")
            job("save", 4, ckpt, args.width, layers)
            total = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt))
            largest = 4 * args.width * args.width
            label = (
                f"{total / 1e9:.2f} GB ({layers} x {args.width}², "
                f"largest tensor {largest / 2**20:.0f} MiB)"
            )
            results: dict[str, dict[str, float]] = {"baseline": child("baseline", ckpt, "")}
            for what in ("famp_full", "dcp_to_torch_save", "famp_dcp3"):
                out = os.path.join(scratch, what)
                results[what] = child(what, ckpt, out)
                if os.path.isdir(out):
                    shutil.rmtree(out)
                elif os.path.exists(out):
                    os.unlink(out)
            results["torch_load3"] = job("load", 3, ckpt, args.width, layers)
            for what, r in results.items():
                extra = (
                    f" (largest rank {r['rss_max_rank'] / 2**20:.0f} MiB)"
                    if "rss_max_rank" in r
                    else ""
                )
                rss = f"{r['rss'] / 2**20:.0f} MiB{extra}"
                rows.append(f"| {label} | {what} | {rss} | {r['seconds']:.2f} s |")
            print(json.dumps({"size": total, "layers": layers, **results}), flush=True)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
