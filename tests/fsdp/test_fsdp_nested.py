"""Optimizer state that keeps its tensors inside dicts and lists, against real torch.

torch's FSDP2 state dict functions go into dicts and lists: `get_optimizer_state_dict` gives each
rank its chunk of a nested parameter-shaped tensor and `set_optimizer_state_dict` loads the full
one. famp shards, unshards, reshards and loads such leaves alike, and `famp-reshard` writes them
sharded. torch's FSDP1 has no such state (its optim_state_dict and optim_state_dict_to_load fail
on it), so famp's FSDP1 layouts refuse it. Before 2026-12-01 famp copied nested values unchanged:
every rank got the full tensor, and the loaded optimizer's next step failed.
"""

from __future__ import annotations

import copy
import pathlib
import re
import socket
import subprocess
import sys
from typing import Any

import optree
import pytest
import torch

import famp
from tests.fsdp.fsdp_helpers import assert_same_osd

WORKER = pathlib.Path(__file__).with_name("nested_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("nested")
    cmd = [sys.executable, str(WORKER), str(out), str(_free_port())]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _layout(record: dict[str, Any], world: int = 2) -> famp.FSDP2Layout:
    return famp.fsdp2_layout(record["fsdp2"]["params"], world)


def _nested() -> dict[str, Any]:
    return {
        "state": {
            "w": {"step": torch.tensor(2.0), "aux": {"m": torch.randn(5, 3), "n": [1, 2.0]}},
            "b": {"step": torch.tensor(2.0), "aux": {"m": torch.randn(5), "n": [1, 2.0]}},
        },
        "param_groups": [{"lr": 0.1, "params": ["w", "b"]}],
    }


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_nested_state_shards_unshards_and_reshards_as_torch(records) -> None:
    _, ranks = records
    full = ranks[0]["fsdp2"]["full"]
    layout = _layout(ranks[0])
    shards = [famp.shard_optim_state(full, layout, r) for r in range(2)]
    for rank, record in enumerate(ranks):
        assert record["fsdp2"]["sharded"]["state"]["0.weight"]["aux"]["m"].shape[0] < 5
        assert_same_osd(shards[rank], record["fsdp2"]["sharded"])
    torch_shards = [record["fsdp2"]["sharded"] for record in ranks]
    assert_same_osd(famp.unshard_optim_state(torch_shards, layout), full)
    new = _layout(ranks[0], 3)
    expected = [famp.shard_optim_state(full, new, r) for r in range(3)]
    assert_same_osd(famp.reshard_optim_state(torch_shards, layout, new), expected)
    assert expected[2]["state"]["1.weight"]["aux"]["hist"][0].shape == (1, 5)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("source", ["full", "shard"])
def test_fsdp2_nested_state_loads_and_steps_as_set_optimizer_state_dict(records, source) -> None:
    """famp.optim_state_dict_to_load from the full state or the rank's shard: the optimizer
    holds what torch's own load gives it, and one step after gives the same bits."""
    _, ranks = records
    for record in ranks:
        run = record["fsdp2"]
        assert_same_osd(run["after"][f"famp_{source}_loaded"], run["torch_loaded"])
        assert run["after"][f"famp_{source}"][0] == "ok", run["after"][f"famp_{source}"]
        assert_same_osd(run["after"][f"famp_{source}"][1], run["after"]["torch"])


@pytest.mark.slow
@pytest.mark.distributed
def test_famp_reshard_writes_nested_state_sharded(
    records, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from famp._fsdp.cli import main
    from famp._fsdp.cli_report import human

    out_dir, ranks = records
    full = ranks[0]["fsdp2"]["full"]
    for world in (2, 3):
        out = tmp_path / f"w{world}"
        capsys.readouterr()
        assert main([str(out_dir / "ckpt"), "-n", str(world), "-o", str(out)]) == 0
        # Its summary counts the nested tensors too (before, only the top-level ones): optree's
        # leaves of torch's full state dict, and of each rank file as written.
        report = capsys.readouterr().out
        tensors = _leaves(full["state"])
        nbytes = human(sum(t.numel() * t.element_size() for t in tensors))
        assert f"tensors     {len(tensors)}, {nbytes}\n" in report, report
        layout = _layout(ranks[0], world)
        for rank in range(world):
            written = torch.load(out / f"rank{rank:05d}.pt", weights_only=True)
            assert re.search(rf"\n\s+{rank}\s+{len(_leaves(written['state']))}\s", report), report
            expected = famp.shard_optim_state(full, layout, rank)
            assert_same_osd(written["state"], expected["state"])
            if world == 2:
                assert_same_osd(written["state"], ranks[rank]["fsdp2"]["sharded"]["state"])


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp1_fails_on_nested_state_and_famps_fsdp1_layouts_refuse_it(records) -> None:
    _, ranks = records
    full = ranks[0]["fsdp2"]["full"]
    for rank, record in enumerate(ranks):
        flat, orig = record["fsdp1"]["orig0"], record["fsdp1"]["orig1"]
        assert flat["optim_state_dict_to_load"][:2] == ("raised", "TypeError")
        assert orig["optim_state_dict"][:2] == ("raised", "RuntimeError")
        # FSDP1's full state gives every parameter the nested value of the whole flat shard
        nested = flat["optim_state_dict"][1]["state"]["1.bias"]["aux"]["m"]
        assert nested.shape != (3,)
        for layout in (flat["layout"], orig["layout"]):
            with pytest.raises(ValueError, match=r"\['0.weight'\]\['aux'\]\['m'\] is a tensor of"):
                famp.optim_state_dict_to_load(full, layout, rank)
            with pytest.raises(ValueError, match=r"shape \(5, 4\) inside a dict or list: FSDP1"):
                famp.shard_optim_state(full, layout, rank)


def test_nested_tensors_of_other_shapes_are_refused_naming_the_path() -> None:
    full = _nested()
    full["state"]["w"]["aux"]["n"] = [1, torch.ones(2, 2)]
    layout = famp.fsdp2_layout({"w": (5, 3), "b": (5,)}, 2)
    before = copy.deepcopy(full)
    with pytest.raises(ValueError, match=r"\['w'\]\['aux'\]\['n'\]\[1\] has shape \(2, 2\)"):
        famp.shard_optim_state(full, layout, 0)
    with pytest.raises(ValueError, match=r"\['w'\]\['aux'\]\['n'\]\[1\] has shape \(2, 2\)"):
        famp.optim_state_dict_to_load(full, layout, 0)
    assert_same_osd(full, before)


def test_a_nested_path_sharded_for_one_parameter_only_is_refused() -> None:
    full = _nested()
    full["state"]["b"]["aux"]["m"] = torch.tensor(1.0)
    layout = famp.fsdp2_layout({"w": (5, 3), "b": (5,)}, 2)
    with pytest.raises(ValueError, match=r"state\['b'\]\['aux'\]\['m'\] is not a tensor"):
        famp.shard_optim_state(full, layout, 0)
    full["state"]["b"]["aux"]["m"] = {"x": torch.randn(5)}  # a dict where the others hold a tensor
    with pytest.raises(ValueError, match=r"state\['b'\]\['aux'\]\['m'\] is not a tensor"):
        famp.shard_optim_state(full, layout, 0)


def test_nested_shards_are_checked_leaf_by_leaf() -> None:
    layout = famp.fsdp2_layout({"w": (5, 3), "b": (5,)}, 2)
    shards = [famp.shard_optim_state(_nested(), layout, r, copy=True) for r in range(2)]
    assert shards[1]["state"]["w"]["aux"]["m"].shape == (2, 3)
    bad = copy.deepcopy(shards)
    bad[1]["state"]["w"]["aux"]["n"][1] = 3.0
    with pytest.raises(ValueError, match=r"shards\[1\]\['state'\]\['w'\]\['aux'\]\['n'\]\[1\] = 3"):
        famp.unshard_optim_state(bad, layout)
    bad = copy.deepcopy(shards)
    bad[1]["state"]["b"]["aux"]["m"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"\['b'\]\['aux'\]\['m'\] has shape \(3,\), but"):
        famp.reshard_optim_state(bad, layout, famp.fsdp2_layout({"w": (5, 3), "b": (5,)}, 3))
    fsdp1 = famp.fsdp1_layout([{"w": (5, 3), "b": (5,)}], 2, use_orig_params=True)
    for call in (
        lambda: famp.unshard_optim_state(shards, fsdp1),
        lambda: famp.reshard_optim_state(shards, layout, fsdp1),
    ):
        with pytest.raises(ValueError, match=r"\['w'\]\['aux'\]\['m'\] is a tensor of shape"):
            call()


def test_nested_tuples_shard_and_unshard_as_lists() -> None:
    full = _nested()
    full["state"]["w"]["aux"]["t"] = (torch.randn(5, 3), 1)
    layout = famp.fsdp2_layout({"w": (5, 3), "b": (5,)}, 3)
    shards = [famp.shard_optim_state(full, layout, r) for r in range(3)]
    assert [s["state"]["w"]["aux"]["t"][0].shape for s in shards] == [(2, 3), (2, 3), (1, 3)]
    assert type(shards[0]["state"]["w"]["aux"]["t"]) is tuple
    assert_same_osd(famp.unshard_optim_state(shards, layout), full)


def _leaves(tree: object) -> list[torch.Tensor]:
    return [v for v in optree.tree_leaves(tree) if isinstance(v, torch.Tensor)]
