"""Distributed steps on 2 real gloo ranks: overflow on one rank, FSDP1 and FSDP2, DCP resume.

One torchrun job (tests/scaling/step_worker.py) records both ranks; the tests compare the
records, and resume the job's DCP checkpoint at world size 1 in this process.
"""

from __future__ import annotations

import itertools
import pathlib
import re
from typing import Any

import pytest
import torch

import famp
from tests.helpers import assert_bitwise_equal, load_example, rank_files, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = pathlib.Path(__file__).with_name("step_worker.py")


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, list[dict[str, Any]], str]:
    out = tmp_path_factory.mktemp("step_job")
    proc = torchrun(WORKER, out)
    ranks = [torch.load(f, weights_only=False) for f in rank_files(out, proc)]
    return out, ranks, proc.stdout


def test_value_and_grad_group_gives_every_rank_the_same_found_inf_and_scale(job: Any) -> None:
    _, ranks, _ = job
    for rank, record in enumerate(ranks):
        local_found, local_scale = record["value_and_grad"]["local"]
        found, scale = record["value_and_grad"]["group"]
        assert local_found.item() == float(rank == 1)  # without group=, only rank 1 sees it
        assert local_scale.item() == (2.0**9 if rank == 1 else 2.0**10)
        assert found.dtype == torch.float32
        assert found.item() == 1.0
        assert scale.item() == 2.0**9


def test_zero_redundancy_optimizer_skips_as_under_gradscaler_its_local_state_too(job: Any) -> None:
    # ZeroRedundancyOptimizer keeps each rank's state in a local optimizer (`opt.optim`): a
    # skipped step must leave it as it was (before, famp undid only `opt.state`, which is empty).
    from tests.scaling.step_worker import ZERO_STEPS

    _, ranks, _ = job
    for record in ranks:
        famp_run, oracle = record["zero"]["famp"], record["zero"]["torch"]
        assert len(famp_run) == len(oracle) == ZERO_STEPS
        for actual, expected in zip(famp_run, oracle, strict=True):
            for p, q in zip(actual["params"], expected["params"], strict=True):
                assert_bitwise_equal(p, q)
            assert len(actual["optim"]) == len(expected["optim"])
            for s, t in zip(actual["optim"], expected["optim"], strict=True):
                assert s.keys() == t.keys()
                for k in s:
                    assert_bitwise_equal(s[k], t[k])
    assert len(ranks[0]["zero"]["famp"][-1]["optim"]) > 0  # each rank holds a shard
    assert len(ranks[1]["zero"]["famp"][-1]["optim"]) > 0


def test_fsdp1_local_shards_every_rank_skips_and_backs_off_with_group(job: Any) -> None:
    from tests.scaling.step_worker import FSDP1_BAD_STEP, FSDP1_STEPS

    _, ranks, _ = job
    expected_found = torch.tensor([float(s == FSDP1_BAD_STEP) for s in range(FSDP1_STEPS)])
    for record, name in itertools.product(ranks, ["famp", "famp_bridge"]):
        famp_run, oracle = record["fsdp1"][name], record["fsdp1"]["sharded"]
        assert famp_run["found_infs"].dtype == torch.float32
        assert_bitwise_equal(famp_run["found_infs"], expected_found)  # rank 0 too: reduced
        assert_bitwise_equal(famp_run["scales"], oracle["scales"].reshape(-1))
        for p, q in zip(famp_run["params"], oracle["params"], strict=True):
            assert_bitwise_equal(p, q)
    assert_bitwise_equal(ranks[0]["fsdp1"]["famp"]["scales"], ranks[1]["fsdp1"]["famp"]["scales"])
    assert ranks[0]["fsdp1"]["famp"]["scales"][FSDP1_BAD_STEP].item() == 2.0**10  # backed off


def test_fsdp1_torch_scalers_that_let_the_ranks_diverge(job: Any) -> None:
    """Plain GradScaler under FSDP1 checks only the local shard, and so does ShardedGradScaler
    with a fused optimizer (its fused path skips the all-reduce): rank 0 never backs off."""
    from tests.scaling.step_worker import FSDP1_BAD_STEP

    _, ranks, _ = job
    for name in ["gradscaler", "sharded_fused"]:
        rank0, rank1 = (r["fsdp1"][name]["scales"] for r in ranks)
        assert rank1[FSDP1_BAD_STEP].item() < rank0[FSDP1_BAD_STEP].item(), name  # 1 backed off
        assert not torch.equal(rank0, rank1), name


def test_fsdp2_dtensor_grads_equal_gradscaler_with_fused_adamw(job: Any) -> None:
    from tests.scaling.step_worker import FSDP2_BAD_STEPS, FSDP2_STEPS

    _, ranks, _ = job
    expected_found = torch.tensor([float(s in FSDP2_BAD_STEPS) for s in range(FSDP2_STEPS)])
    for record in ranks:
        famp_run, oracle = record["fsdp2"]["famp"], record["fsdp2"]["oracle"]
        assert_bitwise_equal(famp_run["found_infs"], expected_found)
        assert_bitwise_equal(oracle["found_infs"], expected_found)
        for direct, expected in zip(oracle["direct"], expected_found, strict=True):
            # famp.unscale_and_check on DTensor grads, no group=: GradScaler.unscale_'s numbers
            assert direct["type"] == "DTensor"
            assert direct["equal"]
            assert_bitwise_equal(direct["found_inf"], expected)
        assert famp_run["scaler"] == oracle["scaler"]
        for p, q in zip(famp_run["local"]["params"], oracle["local"]["params"], strict=True):
            assert p.dtype == torch.float32
            assert_bitwise_equal(p, q)
        for i, entry in oracle["local"]["optim"].items():
            for key, value in entry.items():
                assert_bitwise_equal(famp_run["local"]["optim"][i][key], value)
        steps = famp_run["local"]["optim"][0]["step"].item()
        assert steps == FSDP2_STEPS - len(FSDP2_BAD_STEPS)  # skipped steps do not count
    assert ranks[0]["fsdp2"]["famp"]["scaler"] == ranks[1]["fsdp2"]["famp"]["scaler"]


def test_dcp_resume_at_the_same_world_size_is_bitwise_exact(job: Any) -> None:
    from tests.scaling.step_worker import CHECKPOINT_STEP

    _, ranks, _ = job
    for record in ranks:
        famp_run, resumed = record["fsdp2"]["famp"], record["fsdp2"]["resumed"]
        assert resumed["step"] == CHECKPOINT_STEP
        assert resumed["scaler"] == famp_run["scaler"]
        for p, q in zip(resumed["local"]["params"], famp_run["local"]["params"], strict=True):
            assert_bitwise_equal(p, q)
        for i, entry in famp_run["local"]["optim"].items():
            for key, value in entry.items():
                assert_bitwise_equal(resumed["local"]["optim"][i][key], value)


def test_dcp_checkpoint_resumes_at_world_size_one(job: Any) -> None:
    """famp reads the W=2 optimizer state offline; W=1 continues with the same scale trajectory."""
    from tests.scaling.step_worker import CHECKPOINT_STEP, FSDP2_BAD_STEPS, FSDP2_STEPS

    out, ranks, _ = job
    ex = load_example("fsdp_train")
    model = ex.build_model()
    optimizer = ex.make_optimizer(model)
    state, step = ex.load_checkpoint(
        out / "ckpt" / f"step-{CHECKPOINT_STEP}", model, optimizer, 0, 1
    )
    saved = ranks[0]["fsdp2"]["at_checkpoint"]
    assert step == CHECKPOINT_STEP
    assert famp.to_state_dict(state) == saved["scaler"]
    for name, value in model.state_dict().items():
        assert_bitwise_equal(value, saved["model"][name])
    loaded = famp.optim_state_by_fqn(optimizer.state_dict(), model, optimizer)
    assert set(loaded["state"]) == set(saved["optim"]["state"])
    for fqn, entry in saved["optim"]["state"].items():
        for key, value in entry.items():
            assert_bitwise_equal(loaded["state"][fqn][key], value)

    state, found_infs = ex.train(
        model,
        optimizer,
        state,
        range(step, FSDP2_STEPS),
        rank=0,
        world=1,
        overflow_at=FSDP2_BAD_STEPS,
    )
    w2 = ranks[0]["fsdp2"]["famp"]
    assert famp.to_state_dict(state) == w2["scaler"]  # same skips and scale as at W=2
    assert_bitwise_equal(torch.stack(found_infs), w2["found_infs"][step:])
    for name, value in model.state_dict().items():
        # W=1 sums the batch in another order than W=2's two halves: close, not bitwise
        torch.testing.assert_close(value, w2["full"]["model"][name], rtol=1e-3, atol=1e-3)


def test_fsdp_train_example_runs_at_two_ranks_and_resumes_at_one(
    job: Any, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, _, stdout = job
    assert "rank 0/2: steps 0..4" in stdout
    assert "rank 1/2: steps 0..4" in stdout
    # The two ranks share one pipe: match each summary wherever it landed in the output.
    lines = re.findall(
        r"rank \d/2: (steps \d+\.\.\d+, skipped \[[^\]]*\], scale \S+, tracker -?\d+)", stdout
    )
    assert len(lines) == 2, stdout
    assert lines[0] == lines[1]  # both ranks skipped the same steps and hold the same scale
    ex = load_example("fsdp_train")
    state = ex.main(
        ["--steps", "4", "--resume", str(out / "cli" / "step-2"), "--out", str(tmp_path)]
    )
    printed = capsys.readouterr().out
    assert "rank 0/1: steps 2..4" in printed
    assert famp.to_state_dict(state)["scale"] == float(lines[0].split("scale ")[1].split(",")[0])
    assert (tmp_path / "step-4" / ".metadata").exists()


@pytest.mark.parametrize(
    "case",
    [
        "fsdp2_adam_foreach",
        "fsdp2_sgd_nesterov_foreach_mp_accumulate",
        "fsdp2_adamw_loop_offload_unscale",
        "fsdp1_adam_foreach_orig_params",
        "fsdp1_group_counter_unscale",
    ],
)
def test_nonfused_optimizer_step_under_fsdp_equals_torch_scalers_on_every_rank(
    job: Any, case: str
) -> None:
    """Non-fused optimizers on FSDP1 (``group=``) and FSDP2 (DTensor grads), one rank's shard
    overflowing at some steps: every step's local parameters, unscaled gradients (famp's
    ``unscale_and_check`` on DTensor and flat-parameter shards, donated on rank 0 only),
    optimizer state, param groups, scale and found_inf equal ``ShardedGradScaler``'s (FSDP1) or
    ``GradScaler``'s (FSDP2), and a skipped step leaves every rank as it was. Before, foreach
    optimizers on FSDP2 kept a skipped step's moments: foreach ops on DTensors leave their
    version counter as it was, and the undo selected back only tensors whose version had moved."""
    from tests.helpers import assert_trees_bitwise_equal
    from tests.scaling.step_worker import NONFUSED_BAD, NONFUSED_CASES, NONFUSED_STEPS

    _, ranks, _ = job
    assert case in NONFUSED_CASES
    expected_found = [float(s in NONFUSED_BAD) for s in range(NONFUSED_STEPS)]
    for record in ranks:
        famp_run, oracle = record["nonfused"][case]["famp"], record["nonfused"][case]["oracle"]
        assert [s["found_inf"].item() for s in oracle] == expected_found  # both ranks: reduced
        assert_trees_bitwise_equal(famp_run, oracle)
        for before, after, found in zip(famp_run, famp_run[1:], expected_found[1:], strict=False):
            if found:  # skipped on this rank too: parameters and optimizer as they were
                for key in ("params", "optim", "groups"):
                    assert_trees_bitwise_equal(after[key], before[key])
        assert famp_run[-1]["params"][0].dtype == torch.float32
    if NONFUSED_CASES[case]["opt"] != "counter":  # not FSDP1's flat parameters: uneven shards,
        # some parameter empty on some rank
        sizes = [[p.numel() for p in r["nonfused"][case]["famp"][-1]["params"]] for r in ranks]
        assert any(0 in s for s in sizes), sizes
