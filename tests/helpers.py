"""Helpers shared by famp's tests."""

from __future__ import annotations

import importlib.util
import pathlib
import queue
import signal
import socket
import subprocess
import sys
import types
from typing import Any

import torch


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal dtype, shape, device, and bit pattern (NaN payloads and signed zeros included)."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.device == expected.device, (actual.device, expected.device)
    a, e = actual.detach(), expected.detach()
    if a.is_sparse:
        a, e = a.coalesce(), e.coalesce()
        assert torch.equal(a.indices(), e.indices())
        a, e = a.values(), e.values()
    if a.is_floating_point():
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        assert torch.equal(a.contiguous().view(bits), e.contiguous().view(bits)), (a, e)
    else:
        assert torch.equal(a, e), (a, e)


def torchrun(
    worker: pathlib.Path, out: pathlib.Path, nproc: int = 2
) -> subprocess.CompletedProcess[str]:
    """Run `worker OUT` on `nproc` gloo ranks with torchrun on 127.0.0.1 (a free port, 240 s).

    Judge the job by the files the ranks write into `out`, not by the exit code alone: gloo's
    teardown sometimes aborts a process that has finished its work (torch's, not famp's).
    """
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        str(worker),
        str(out),
    ]
    root = pathlib.Path(__file__).resolve().parents[1]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False, cwd=root)


def rank_files(
    out: pathlib.Path, proc: subprocess.CompletedProcess[str], nproc: int = 2
) -> list[pathlib.Path]:
    """The `rank{r}.pt` files a torchrun job wrote, asserting every rank wrote its own."""
    files = [out / f"rank{r}.pt" for r in range(nproc)]
    assert all(f.exists() for f in files), proc.stdout[-3000:] + proc.stderr[-6000:]
    return files


EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str) -> types.ModuleType:
    """Import `examples/<name>.py` as a module (the examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"famp_example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def init_gloo(rank: int, world_size: int, port: int) -> None:
    """Join a gloo process group on 127.0.0.1:`port` as `rank` (a 60 s timeout: never hang)."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )


# Ranks in `torch.multiprocessing` processes report rows on a queue. gloo's teardown sometimes
# aborts a process that has finished its work (SIGABRT, torch's, not famp's): a rank's last row is
# its marker, flushed before the teardown, and the ranks are judged by what they reported.
FINISHED = "finished"


def report_finished(rank: int, results: Any) -> None:
    """A rank's last report, before `destroy_process_group`: every row it put is flushed to the
    queue, followed by its marker, so that an abort in the teardown loses nothing."""
    results.put((FINISHED, rank))
    results.close()
    results.join_thread()


def collect_ranks(procs: list[Any], results: Any, count: int, timeout: float) -> list[Any]:
    """The `count` rows the rank processes put on `results`, once every rank has finished.

    Each rank must send its marker (`report_finished`) after its rows, and exit with 0 or be
    aborted by gloo's teardown after that marker (-SIGABRT); a rank that failed in its work
    sends no marker, and the test fails here after `timeout` seconds without a row, naming it.
    """
    rows: list[Any] = []
    finished: set[int] = set()
    while len(finished) < len(procs):
        try:
            row = results.get(timeout=timeout)
        except queue.Empty:
            codes = [p.exitcode for p in procs]
            missing = sorted(set(range(len(procs))) - finished)
            raise AssertionError(
                f"ranks {missing} did not finish in {timeout} s (exit codes {codes})"
            ) from None
        if isinstance(row, tuple) and len(row) == 2 and row[0] == FINISHED:
            finished.add(row[1])
        else:
            rows.append(row)
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    assert finished == set(range(len(procs)))
    codes = [p.exitcode for p in procs]
    assert all(code in (0, -signal.SIGABRT) for code in codes), codes
    assert len(rows) == count, rows
    return rows


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago, for a rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_ranks(target: Any, world_size: int, args: Any, count: int, timeout: float) -> list[Any]:
    """Run `target(*args(rank, port, results))` in `world_size` new processes and collect
    their `count` rows (`collect_ranks`): `args` places the rank, a free port and the queue.

    The ranks are forked from a server process started once per test process with torch,
    torch.distributed and famp imported (multiprocessing's "forkserver"): each rank starts
    with nothing of the test process (no threads, no compiled code) and without importing
    torch again, which cost each spawned rank seconds."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "famp", "tests.helpers"])
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=args(r, port, results)) for r in range(world_size)]
    for p in procs:
        p.start()
    return collect_ranks(procs, results, count, timeout)


def assert_trees_bitwise_equal(actual: object, expected: object, *, autograd: bool = False) -> None:
    """Equal structure (optree), tensor leaves bitwise equal, other leaves `==`.

    With `autograd`, tensors must also agree on `requires_grad`.
    """
    import optree

    leaves, spec = optree.tree_flatten(actual, none_is_leaf=True)  # type: ignore[arg-type]
    expected_leaves, expected_spec = optree.tree_flatten(expected, none_is_leaf=True)  # type: ignore[arg-type]
    assert spec == expected_spec
    for a, e in zip(leaves, expected_leaves, strict=True):
        if isinstance(e, torch.Tensor):
            assert_bitwise_equal(a, e)
            assert not autograd or a.requires_grad == e.requires_grad
        else:
            assert a == e


def famp_and_uncached_autocast(
    f: Any, module: torch.nn.Module, *args: Any, **options: Any
) -> tuple[Any, Any]:
    """`f(*args)` under `famp.autocast(f, "c=bf16,o=bf16", **options)`, then again from
    `module`'s state before it under `torch.autocast` (bfloat16) with torch's cast cache off:
    the reference for functions that write weights between uses (one cast per use)."""
    import copy

    import famp

    state = copy.deepcopy(module.state_dict())
    got = famp.autocast(f, "c=bf16,o=bf16", **options)(*args)
    module.load_state_dict(state)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        expected = f(*args)
    return got, expected
