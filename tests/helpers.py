"""Helpers shared by famp's tests."""

from __future__ import annotations

import importlib.util
import pathlib
import socket
import subprocess
import sys
import types

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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
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
