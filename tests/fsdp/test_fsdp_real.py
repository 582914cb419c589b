"""famp against real FSDP2 (``fully_shard``) and FSDP1 on 2 and 3 gloo ranks, bit for bit.

One job per world size (tests/fsdp/fsdp_worker.py) records what torch produced on every rank; these
tests recompute the same things with famp in this process and compare.
"""

from __future__ import annotations

import pathlib
import re
import socket
import subprocess
import sys
from typing import Any

import pytest
import torch

import famp
from tests.fsdp.fsdp_helpers import assert_same_osd
from tests.helpers import assert_bitwise_equal

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

WORKER = pathlib.Path(__file__).with_name("fsdp_worker.py")
FSDP2_CONFIGS = ["adam", "adamw2", "adam-dim1", "adamw2-dim1"]
FSDP1_CONFIGS = ["orig0-fp32", "orig1-fp32", "orig1-torch.bfloat16"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module", params=[2, 3], ids=["W2", "W3"])
def records(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, list[dict[str, Any]]]:
    world = request.param
    out = tmp_path_factory.mktemp(f"fsdp_w{world}")
    cmd = [sys.executable, str(WORKER), str(world), str(out), str(_free_port())]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return world, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _fsdp2_layout(record: dict[str, Any], world: int, name: str) -> famp.FSDP2Layout:
    dims = {"4.weight": 1} if name.endswith("dim1") else None
    return famp.fsdp2_layout(record["params"], world, shard_dims=dims)


@pytest.mark.parametrize("name", FSDP2_CONFIGS)
def test_fsdp2_shards_equal_get_optimizer_state_dict_on_every_rank(records, name) -> None:
    world, ranks = records
    full = ranks[0]["fsdp2"][name]["full"]
    layout = _fsdp2_layout(ranks[0]["fsdp2"][name], world, name)
    empty = 0
    for rank, record in enumerate(ranks):
        expected = record["fsdp2"][name]["sharded"]
        assert_same_osd(famp.shard_optim_state(full, layout, rank), expected)
        assert_same_osd(famp.shard_optim_state(full, layout, rank, copy=True), expected)
        empty += sum(v["exp_avg"].numel() == 0 for v in expected["state"].values())
    assert empty > 0  # the (1,) bias and (1, 6) weight leave trailing ranks empty
    if name.startswith("adamw2"):
        assert [g["weight_decay"] for g in full["param_groups"]] == [0.1, 0.0]


@pytest.mark.parametrize("name", FSDP2_CONFIGS)
def test_fsdp2_unshard_equals_full_state_dict(records, name) -> None:
    world, ranks = records
    layout = _fsdp2_layout(ranks[0]["fsdp2"][name], world, name)
    shards = [record["fsdp2"][name]["sharded"] for record in ranks]
    for record in ranks:  # every rank got the full dict; all equal
        assert_same_osd(famp.unshard_optim_state(shards, layout), record["fsdp2"][name]["full"])


@pytest.mark.parametrize("name", FSDP2_CONFIGS)
def test_fsdp2_reshard_to_other_world_sizes_equals_resharding_the_full_dict(records, name) -> None:
    world, ranks = records
    record = ranks[0]["fsdp2"][name]
    shards = [r["fsdp2"][name]["sharded"] for r in ranks]
    for new_world in (1, 2, 3, 6):
        new = _fsdp2_layout(record, new_world, name)
        expected = [famp.shard_optim_state(record["full"], new, r) for r in range(new_world)]
        resharded = famp.reshard_optim_state(shards, _fsdp2_layout(record, world, name), new)
        assert_same_osd(resharded, expected)


@pytest.mark.parametrize("name", FSDP2_CONFIGS)
def test_fsdp2_layout_of_equals_pure_layout(records, name) -> None:
    world, ranks = records
    for record in ranks:
        assert record["fsdp2"][name]["layout_of"] == _fsdp2_layout(
            record["fsdp2"][name], world, name
        )


@pytest.mark.parametrize("name", FSDP2_CONFIGS)
def test_fsdp2_to_load_restores_the_optimizer(records, name) -> None:
    """famp's to-load dict in a fresh FSDP2 optimizer: torch's state, and the same next step."""
    _, ranks = records
    for record in ranks:
        rec = record["fsdp2"][name]
        assert_same_osd(rec["loaded"], rec["raw"])
        assert_same_osd(rec["after_step_loaded"], rec["after_step"])


@pytest.mark.parametrize("name", FSDP2_CONFIGS)
def test_fsdp2_to_load_refuses_a_layout_that_does_not_match_the_optimizer(records, name) -> None:
    """Issue 12 item 9: shard dim, world size and rank are checked against the live DTensors.

    Before, a dim-0 layout on a model sharded on dim 1 passed, famp built DTensors that claimed
    Shard(1) but held dim-0 chunks, and the error came at ``optim.step()``.
    """
    world, ranks = records
    for rank, record in enumerate(ranks):
        refusals = record["fsdp2"][name]["refusals"]
        if name.endswith("dim1"):
            kind, message = refusals["dim0_layout"]
            assert kind == "ValueError"
            assert "'4.weight'" in message
            assert "(Shard(dim=0),)" in message
            assert "pass shard_dims" in message
        else:  # on a model sharded on dim 0 the dim-0 layout is the right one
            assert refusals["dim0_layout"] is None
        kind, message = refusals["world_plus_one"]
        assert kind == "ValueError"
        assert f"world size {world + 1}" in message
        assert f"on rank {rank}" in message
        kind, message = refusals["other_rank"]
        assert kind == "ValueError"
        assert f"belongs to rank {rank} of its mesh" in message
        before, after = refusals["untouched"]  # nothing was loaded
        assert_same_osd(after, before)
        assert before["state"] == {}


@pytest.mark.parametrize("name", FSDP2_CONFIGS)
def test_fsdp2_dtensor_values_are_refused_before_any_collective(records, name) -> None:
    """get_optimizer_state_dict's DTensors passed where famp maps plain tensors: one TypeError
    naming the entry. Before, famp cut each rank's chunk out of the DTensors, which ran
    collectives of a different size on every rank: gloo aborted the job."""
    _, ranks = records
    for record in ranks:
        refusals = record["fsdp2"][name]["refusals"]
        for call in ("dtensor_shard", "dtensor_to_load", "dtensor_to_load_optim"):
            kind, message = refusals[call]
            assert kind == "TypeError", (call, message)
            assert re.search(r"\['state'\]\['[\w.]+'\]\['exp_avg(_sq)?'\] is a DTensor", message)
            assert "to_local()" in message
        before, after = refusals["untouched"]  # nothing was loaded
        assert_same_osd(after, before)


@pytest.mark.parametrize("name", FSDP2_CONFIGS)
def test_fsdp2_shard_on_the_mesh_is_get_optimizer_state_dict_itself(records, name) -> None:
    """``mesh=``: DTensors placed like torch's, and DCP's set_optimizer_state_dict loads them."""
    _, ranks = records
    dtensors = 0
    for record in ranks:
        rec = record["fsdp2"][name]
        assert rec["on_mesh_placed"] == rec["sharded_placed"]  # type, mesh, placements, shape
        assert_same_osd(rec["on_mesh"], rec["sharded"])  # local values, bit for bit
        assert_same_osd(rec["set_from_mesh_shard"], rec["raw"])
        assert_same_osd(rec["after_step_set_from_mesh_shard"], rec["after_step"])
        placed = rec["on_mesh_placed"].values()
        dtensors += sum(kind == "DTensor" for entry in placed for kind, *_ in entry.values())
    assert dtensors > 0


@pytest.mark.parametrize("name", FSDP2_CONFIGS)
def test_fsdp2_rekeying_matches_get_optimizer_state_dict(records, name) -> None:
    _, ranks = records
    for record in ranks:
        rec = record["fsdp2"][name]
        assert_same_osd(rec["by_fqn"], rec["sharded"])
        assert_same_osd(rec["by_id"], rec["raw"])


def _fsdp1_layout(record: dict[str, Any], world: int) -> famp.FSDP1Layout:
    return famp.fsdp1_layout(
        record["units"],
        world,
        use_orig_params=record["use_orig_params"],
        param_dtype=record["param_dtype"],
    )


@pytest.mark.parametrize("name", FSDP1_CONFIGS)
def test_fsdp1_to_load_equals_fsdp_optim_state_dict_to_load(records, name) -> None:
    world, ranks = records
    layout = _fsdp1_layout(ranks[0]["fsdp1"][name], world)
    for rank, record in enumerate(ranks):
        rec = record["fsdp1"][name]
        assert_same_osd(famp.optim_state_dict_to_load(rec["full"], layout, rank), rec["to_load"])
        assert_same_osd(
            famp.optim_state_dict_to_load(rec["full"], layout, rank, copy=False), rec["to_load"]
        )
        assert_same_osd(rec["famp_to_load"], rec["to_load"])  # with the live optimizer
        # what the optimizer held after training
        assert_same_osd(rec["to_load"]["state"], rec["raw"]["state"])


@pytest.mark.parametrize("name", FSDP1_CONFIGS)
def test_fsdp1_layout_of_equals_pure_layout(records, name) -> None:
    world, ranks = records
    for record in ranks:
        rec = record["fsdp1"][name]
        assert rec["layout_of"] == _fsdp1_layout(rec, world)


@pytest.mark.parametrize("name", FSDP1_CONFIGS)
def test_fsdp1_sharded_state_dict_is_the_per_parameter_chunking(records, name) -> None:
    """FSDP1's SHARDED optim state dict: per-parameter dim-0 chunks, like FSDP2."""
    world, ranks = records
    layout = _fsdp1_layout(ranks[0]["fsdp1"][name], world)
    for rank, record in enumerate(ranks):
        rec = record["fsdp1"][name]
        mine = famp.shard_optim_state(rec["full"], layout, rank)
        for fqn, entry in rec["sharded"]["state"].items():
            for key, value in entry.items():
                if isinstance(value, tuple):  # (local shard, offsets) of a ShardedTensor
                    assert_bitwise_equal(mine["state"][fqn][key], value[0])
                    assert value[1][0] == sum(layout.local_shape(fqn, r)[0] for r in range(rank))
                elif value is None:  # a ShardedTensor without a local shard: an empty chunk
                    assert mine["state"][fqn][key].shape[0] == 0
                else:
                    assert_same_osd(mine["state"][fqn][key], value)


def test_fsdp2_to_load_matches_names_as_set_optimizer_state_dict_does(records) -> None:
    """The loading optimizer lists same-shaped parameters in another order than the state."""
    world, ranks = records
    for rank, record in enumerate(ranks):
        cell = record["fsdp2"]["order"]
        assert isinstance(cell["famp"], dict), cell["famp"]
        assert_same_osd(cell["famp"]["state"], cell["dcp"]["state"])
        assert [g["params"] for g in cell["famp"]["param_groups"]] == [[0, 1], [2, 3]]
        # DCP put each name's saved state on the parameter of that name: ids 0, 1 are 1., 0.
        for pid, name in enumerate(["1.weight", "0.weight"]):
            saved = famp.shard_optim_state(cell["full"], _twins_layout(world), rank)
            assert_bitwise_equal(
                cell["dcp"]["state"][pid]["exp_avg"], saved["state"][name]["exp_avg"]
            )
        kind, message = cell["famp_no_model"]
        assert kind == "ValueError"
        assert "lists '0.weight' and '1.weight'" in message
        assert "pass model=" in message


def _twins_layout(world: int) -> famp.FSDP2Layout:
    shapes = {"0.weight": (4, 4), "0.bias": (4,), "1.weight": (4, 4), "1.bias": (4,)}
    return famp.fsdp2_layout(shapes, world)


@pytest.mark.parametrize("name", FSDP1_CONFIGS)
def test_fsdp1_to_load_matches_names_as_fsdp_optim_state_dict_to_load_does(records, name) -> None:
    """The loading optimizer lists same-shaped parameters (or equal units) in another order."""
    _, ranks = records
    for record in ranks:
        cell = record["fsdp1"][f"order-{name}"]
        assert isinstance(cell["famp"], dict), cell["famp"]
        assert_same_osd(cell["famp"], cell["to_load"])
        kind, message = cell["famp_no_model"]
        assert kind == "ValueError"
        assert "pass model=" in message


def _reshard_to_full(files: list[str], out: pathlib.Path, *options: str) -> dict[str, Any]:
    from famp._fsdp.cli import main

    assert main([*files, "--full", str(out), *options]) == 0
    return torch.load(out, weights_only=True)


@pytest.mark.parametrize("name", FSDP2_CONFIGS)
def test_famp_reshard_reads_the_recipes_rank_files_as_get_optimizer_state_dict_full(
    records, name, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/fsdp.md's per-rank files of real FSDP2 (one parameter on Shard(1) in the -dim1
    configs): famp-reshard --full equals torch's full_state_dict; without the recorded
    sharding it refuses (exit 2, naming the parameters) unless told --assume-dim0."""
    from famp._fsdp.cli import main

    _, ranks = records
    full = ranks[0]["fsdp2"][name]["full"]
    files, old = [], []
    for rank, record in enumerate(ranks):
        saved = record["fsdp2"][name]["recipe"]
        assert_same_osd(saved["state"], record["fsdp2"][name]["sharded"]["state"])
        files.append(str(tmp_path / f"optim.rank{rank}.pt"))
        torch.save(saved, files[-1])
        old.append(str(tmp_path / f"old.rank{rank}.pt"))
        torch.save({k: v for k, v in saved.items() if k != "sharding"}, old[-1])
    assert_same_osd(_reshard_to_full(files, tmp_path / "full.pt"), full)
    with pytest.raises(SystemExit) as exit_info:
        main([*old, "--full", str(tmp_path / "old.pt")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "record no shard dims" in err, err
    assert "--assume-dim0" in err
    if name.endswith("dim1"):
        assert "'4.weight'" in err, err
    else:  # dim 0 proven where the shards differ; assumed on request where they do not
        assert_same_osd(_reshard_to_full(old, tmp_path / "old.pt", "--assume-dim0"), full)


def test_famp_reshard_reads_the_recipes_rank_files_of_a_parameter_without_state(
    records, tmp_path: pathlib.Path
) -> None:
    """An optimizer that holds a frozen parameter (no state, listed in param_groups): the
    recipe records every parameter's sharding, so famp-reshard --full gives torch's
    full_state_dict. Before, the recipe recorded the parameters with state only and
    famp-reshard refused the files (exit 1: no 'sharding' entry for '2.weight')."""
    _, ranks = records
    full = ranks[0]["fsdp2"]["frozen"]["full"]
    assert "2.weight" in full["param_groups"][0]["params"]
    assert "2.weight" not in full["state"]
    files = []
    for rank, record in enumerate(ranks):
        files.append(str(tmp_path / f"optim.rank{rank}.pt"))
        torch.save(record["fsdp2"]["frozen"]["recipe"], files[-1])
    assert_same_osd(_reshard_to_full(files, tmp_path / "full.pt"), full)


def test_the_docs_load_shard_restores_the_optimizer_and_refuses_mismatched_files(
    records,
) -> None:
    """docs/fsdp-dcp.md's ``load_shard``, run from the page on every rank: famp-reshard's files
    of docs/fsdp.md's recipe files (same world size) load into a fresh FSDP2 AdamW as the
    trained optimizer's state and as torch's full-state-dict load, bit for bit, and the next
    step agrees. Files for one rank more, and a model with '4.weight' on Shard(1), raise its
    ValueError before loading anything. Before, ``DTensor.from_local(..., shape=, stride=)``
    took them silently: wrong slices, or dim-0 rows placed as Shard(1)."""
    _, ranks = records
    for record in ranks:
        rec = record["fsdp2"]["docs_load_shard"]
        assert rec["trained"]["state"], "AdamW holds state after two steps"
        assert_same_osd(rec["loaded"], rec["trained"])
        # torch's full-state load gives betas back as a list; famp's files keep the tuple
        assert_same_osd(rec["by_torch"]["state"], rec["trained"]["state"])
        assert rec["by_torch"]["param_groups"] == [
            {k: list(v) if isinstance(v, tuple) else v for k, v in group.items()}
            for group in rec["trained"]["param_groups"]
        ]
        assert_same_osd(rec["after_step"]["loaded"], rec["after_step"]["trained"])
        assert_same_osd(rec["after_step"]["by_torch"], rec["after_step"]["trained"])
        assert rec["more_ranks"] is not None, "the files for one rank more were loaded"
        kind, message = rec["more_ranks"]
        assert kind == "ValueError", message
        assert re.fullmatch(
            r"'[\w.]+': the file's 'exp_avg' has shape \[\d+(, \d+)?\], this rank's shard "
            r"\[\d+(, \d+)?\]: a file for another world size or rank\?",
            message,
        ), message
        assert rec["dim1"] is not None, "dim-0 files were loaded into a Shard(1) parameter"
        kind, message = rec["dim1"]
        assert kind == "ValueError", message
        assert message == (
            "'4.weight': the file holds shape [1, 6] sharded on dim 0, "
            "the model shape [1, 6] placed (Shard(dim=1),)"
        )
        assert rec["untouched"] == [{}, {}]  # nothing loaded where it raised


def test_famp_reshard_of_a_checkpoint_saved_without_frozen_parameters_loads_as_dcp_does(
    records,
) -> None:
    """A frozen parameter the optimizer holds, saved with ignore_frozen_params=True: no state
    and no model entry. famp-reshard refused the checkpoint (exit 1: no shape for '2.weight');
    now its rank files (through docs/fsdp-dcp.md's ``load_shard``) and its DCP output load on
    every rank as DCP's own load of the source does, bit for bit."""
    _, ranks = records
    for record in ranks:
        rec = record["fsdp2"]["frozen_dcp_adamw"]
        assert "2.weight" not in rec["model_keys"]
        assert 2 not in rec["trained"]["state"]  # the frozen parameter: no state
        assert_same_osd(rec["by_dcp"]["optim"], rec["trained"])
        for name in ("by_famp_files", "by_famp_dcp", "by_famp_to_load"):
            assert_same_osd(rec[name]["optim"], rec["by_dcp"]["optim"])
        assert_same_osd(rec["by_famp_dcp"]["model"], rec["by_dcp"]["model"])
        assert "2.weight" not in rec["file"]["sharding"]


def test_a_frozen_parameters_state_is_in_famps_shards_and_dropped_by_torchs_load(records) -> None:
    """Adagrad gives every parameter state when it is built, the frozen '2.weight' (id 2) too,
    and DCP saves it. torch's set_optimizer_state_dict drops the state of a parameter with
    requires_grad=False, which the checkpoint does not record (its tensors are detached): famp's
    rank file holds it, as the saving job's ranks did; loaded through load_shard, and famp's DCP
    output through dcp.load, it is dropped as from the source, bit for bit.
    famp.optim_state_dict_to_load keeps it: the saving job's state, unused by Adagrad's steps
    while the parameter gets no gradient."""
    _, ranks = records
    for record in ranks:
        rec = record["fsdp2"]["frozen_dcp_adagrad"]
        assert "2.weight" in rec["file"]["state"]
        assert "2.weight" not in rec["fqn_state_by_dcp"]["state"]
        assert 2 in rec["trained"]["state"]
        assert 2 not in rec["by_dcp"]["optim"]["state"]
        for name in ("by_famp_files", "by_famp_dcp"):
            assert_same_osd(rec[name]["optim"], rec["by_dcp"]["optim"])
        assert_same_osd(rec["by_famp_dcp"]["model"], rec["by_dcp"]["model"])
        to_load = rec["by_famp_to_load"]["optim"]
        assert_same_osd(to_load["state"].pop(2), rec["trained"]["state"][2])
        assert_same_osd(to_load, rec["by_dcp"]["optim"])
