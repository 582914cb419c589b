"""The test suite's own setup (tests/conftest.py): parallel with pytest-xdist, serial without it."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
ONE_TEST = "tests/test_compat.py::test_the_scan_finds_what_it_looks_for"


def _pytest(*flags: str) -> str:
    # Not as an xdist worker: a worker's variables (PYTEST_XDIST_WORKER) would reach the child.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *flags, ONE_TEST],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout, proc.stdout
    return proc.stdout


@pytest.mark.slow
def test_runs_in_workers_by_default_and_in_one_process_with_n0_or_without_xdist() -> None:
    assert "created: " in _pytest()  # one worker per CPU, four at most
    for flags in (["-n", "0"], ["-p", "no:xdist"]):  # without pytest-xdist: its hook is optional
        assert "worker" not in _pytest(*flags)
