"""The examples run, and a resumed training run equals an uninterrupted one bit for bit."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
from typing import Any

import optree
import pytest
import torch

from tests.helpers import assert_bitwise_equal, load_example

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_script(*args: str | pathlib.Path, timeout: float = 240) -> str:
    """Run a command in a fresh Python process with famp importable; return its stdout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, *map(str, args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def assert_trees_bitwise_equal(actual: Any, expected: Any) -> None:
    leaves, spec = optree.tree_flatten(actual)  # famp.ScalerState nodes too
    expected_leaves, expected_spec = optree.tree_flatten(expected)
    assert spec == expected_spec
    for a, b in zip(leaves, expected_leaves, strict=True):
        if isinstance(a, torch.Tensor):
            assert_bitwise_equal(a, b)
        else:
            assert type(a) is type(b), (a, b)
            assert a == b, (a, b)


# float16 (slow on CPU: small batches, few steps) from a scale so large that the first steps
# overflow, and a growth every second step: the scaler backs off, grows and overflows again.
SCALED = ["--precision", "fp16", "--init-scale", str(2.0**18), "--growth-interval", "2"]
SMALL = ["--batch-size", "8", "--checkpoint-every", "2"]


@pytest.mark.slow
def test_train_digits_resume_in_a_fresh_process_is_bitwise_exact(tmp_path: pathlib.Path) -> None:
    digits = load_example("train_digits")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    digits.main(["--steps", "8", "--out", str(straight), "--no-progress", *SCALED, *SMALL])
    digits.main(["--steps", "3", "--out", str(resumed), "--no-progress", *SCALED, *SMALL])
    assert torch.load(resumed / "checkpoint.pt", weights_only=True)["step"] == 3
    stdout = run_script(
        EXAMPLES / "train_digits.py", "--steps", "8", "--resume", "--out", resumed, *SCALED, *SMALL
    )
    assert "test accuracy" in stdout

    expected = torch.load(straight / "checkpoint.pt", weights_only=True)
    actual = torch.load(resumed / "checkpoint.pt", weights_only=True)
    assert actual["step"] == expected["step"] == 8
    assert_trees_bitwise_equal(actual, expected)
    # the run exercised the scaler: overflows skipped steps, the scale backed off and grew
    history = expected["history"]
    assert history["found_inf"].dtype == torch.float32
    assert (history["found_inf"] != 0).any()
    assert (history["found_inf"] == 0).any()
    change = history["scale"].diff()
    assert (change < 0).any()
    assert (change > 0).any()
    for tensor in optree.tree_leaves(expected["params"]):
        assert tensor.dtype == torch.float32
    assert (resumed / "digits.png").read_bytes()[:8] == PNG_MAGIC


def test_train_digits_default_shows_loss_scaling_at_work(tmp_path: pathlib.Path) -> None:
    """The quick-start demo: float16 with dynamic loss scaling; the scale grows, overflows and
    backs off within its first 120 steps (the default run has 600)."""
    digits = load_example("train_digits")
    accuracy = digits.main(["--steps", "120", "--out", str(tmp_path), "--no-progress"])
    assert accuracy > 0.5  # chance is 0.1
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert checkpoint["config"]["precision"] == "fp16"
    history = checkpoint["history"]
    assert history["scale"].dtype == torch.float32
    assert history["scale"][0].item() == 2.0**16
    change = history["scale"].diff()
    assert (change > 0).any()  # growth
    assert (history["found_inf"] != 0).any()  # an overflow, skipped
    assert (change < 0).any()  # a backoff
    assert (tmp_path / "digits.png").read_bytes()[:8] == PNG_MAGIC


def test_train_digits_bf16_learns_without_loss_scaling(tmp_path: pathlib.Path) -> None:
    digits = load_example("train_digits")
    accuracy = digits.main(
        ["--steps", "40", "--precision", "bf16", "--out", str(tmp_path), "--no-progress"]
    )
    assert accuracy > 0.5  # chance is 0.1
    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert checkpoint["config"]["precision"] == "bf16"
    assert checkpoint["scaler"] == {}  # bfloat16 needs no loss scaling: a disabled scaler saves {}
    assert (checkpoint["history"]["scale"] == 1.0).all()
    assert (tmp_path / "digits.png").read_bytes()[:8] == PNG_MAGIC


def test_migrate_from_gradscaler_resumes_a_torch_checkpoint_bitwise(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    migrate = load_example("migrate_from_gradscaler")
    assert migrate.main(["--steps", "20", "--out", str(tmp_path)]) is True
    out = capsys.readouterr().out
    assert "famp skipped steps [22, 30] (overflows injected at [3, 22, 30])" in out
    assert "parameters equal bit for bit: True; scaler state equal: True" in out
    saved = torch.load(tmp_path / "torch_checkpoint.pt", weights_only=True)
    assert set(saved["scaler"]) == {
        "scale",
        "growth_factor",
        "backoff_factor",
        "growth_interval",
        "_growth_tracker",
    }


def python_blocks(page: str) -> list[str]:
    """The ```python blocks of a docs page, in order, but those marked ``<!-- no-test``."""
    text = (ROOT / "docs" / page).read_text()
    blocks = re.findall(r"(<!-- no-test[^>]*-->\n)?```python\n(.*?)```", text, re.S)
    return [code for marker, code in blocks if not marker]


def test_tutorial_code_blocks_run_in_order() -> None:
    blocks = python_blocks("tutorial.md")
    assert len(blocks) >= 5
    namespace: dict[str, Any] = {"__name__": "tutorial"}
    for code in blocks:
        exec(compile(code, "docs/tutorial.md", "exec"), namespace)
    assert namespace["loss"].dtype == torch.float32
    assert namespace["found_inf"].item() == 0.0
    assert namespace["state"].scale.dtype == torch.float32
    assert namespace["checkpoint"]["step"] == 2


def test_front_page_example_runs_and_prints_what_it_says(
    capsys: pytest.CaptureFixture[str],
) -> None:
    (code,) = python_blocks("index.md")
    claimed = re.search(r"print\(.*\)  # (.*)\n", code)
    assert claimed is not None
    exec(compile(code, "docs/index.md", "exec"), {"__name__": "index"})
    assert capsys.readouterr().out.strip() == claimed.group(1)
