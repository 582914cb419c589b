"""Shared pytest configuration: hypothesis profiles, CUDA skips and the eager/compiled fixture."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import hypothesis
import pytest
import torch

hypothesis.settings.register_profile(
    "default",
    deadline=None,  # the first call of a torch op or a compiled graph is slow
    max_examples=60,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
hypothesis.settings.register_profile(
    "thorough",
    deadline=None,
    max_examples=2000,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
hypothesis.settings.load_profile(os.environ.get("FAMP_HYPOTHESIS_PROFILE", "default"))


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """With pytest-xdist installed (the `test` extra), the suite runs in parallel unless `-n` says
    otherwise: one worker per CPU, at most four, each taking whole files (`--dist loadfile`), so
    the functions a file compiles once are compiled by one worker. `-n 0` runs it serially.
    Without pytest-xdist the suite runs serially, as before."""
    if not config.pluginmanager.hasplugin("xdist") or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if config.option.usepdb or config.option.collectonly:
        return  # one process: a debugger needs the terminal, a collection runs nothing
    if config.option.numprocesses is None:
        config.option.numprocesses = "auto"
    if config.option.numprocesses and config.option.dist == "no":  # not `-n 0`
        config.option.dist = "loadfile"


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown to pytest without it
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: the CPUs this process may use, at most four (each worker's torch also runs its
    own intra-op threads, and the multi-process tests start two or three ranks each)."""
    return max(1, min(_usable_cpus(), 4))


def pytest_configure(config: pytest.Config) -> None:
    """In an xdist worker, torch's intra-op threads are the worker's share of the CPUs (at
    least one), unless OMP_NUM_THREADS says otherwise; the processes a test starts inherit it.

    Two workers on two CPUs running two threads each fought for the cores: two compile-heavy
    files took 0.91-0.98x the CPU time and 0.92-0.98x the wall time with one thread each (three
    alternating pairs, torch 2.13, 2 AMD EPYC cores, 2026-12-02); the whole suite, one pair with
    the forked ranks below, 0.98x the CPU time and 1.08x the wall time, inside the 511-630 s its
    runs spread over that day. Tests of thread-dependent paths set their own counts
    (`test_fused.py`, `test_all_finite.py`)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers is None or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, _usable_cpus() // int(workers))
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def _usable_cpus() -> int:
    usable = (
        os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    )
    return len(usable)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` skip without a CUDA GPU, unless FAMP_REQUIRE_CUDA=1 (``.ci/cuda``),
    under which they run and fail; no other test may skip for want of a device."""
    if torch.cuda.is_available() or os.environ.get("FAMP_REQUIRE_CUDA") == "1":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run bash .ci/cuda on one)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


_COMPILED: dict[tuple[Callable[..., Any], str], Callable[..., Any]] = {}


def compiled(fn: Callable[..., Any], backend: str = "inductor") -> Callable[..., Any]:
    """``torch.compile(fn, fullgraph=True)``, built once per function and shared across tests."""
    key = (fn, backend)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, fullgraph=True, backend=backend)
    return _COMPILED[key]


@pytest.fixture(params=["eager", "compiled"])
def transform(request: pytest.FixtureRequest) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Run a test once eagerly and once under ``torch.compile(fullgraph=True)`` (inductor, CPU).

    Pass module-level functions so that the compiled version is shared between tests.
    """
    if request.param == "eager":
        return lambda fn: fn
    return compiled
