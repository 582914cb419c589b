"""famp's DCP reader against real FSDP2 + torch.distributed.checkpoint, and its bad-input checks.

The oracle: ``tests/fsdp/dcp_worker.py`` saves a DCP checkpoint from real FSDP2 at W=4 (gloo, forked
ranks), then DCP itself loads it at W=3 (``dcp.load`` + ``set_state_dict``) and every rank records
``get_optimizer_state_dict`` with DTensors as local tensors. famp reads the same checkpoint
offline, in this process, and must give the same tensors bit for bit. The same job (one launch
of 4 ranks, sub-meshes for W < 4) saves sources at W = 1..4 and loads famp's DCP output of them
at other world sizes next to DCP's own load of the source (``MATRIX``).
"""

from __future__ import annotations

import os
import pathlib
import pickle
import re
import subprocess
import sys
import tempfile
import warnings
from typing import Any

import hypothesis
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import strategies as st
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import famp
from famp._fsdp.cli import main
from tests.fsdp.dcp_worker import LOAD_W, MATRIX
from tests.fsdp.fsdp_helpers import (
    assert_osd_bitwise_equal,
    assert_same_tree,
    load_dict,
    two_group_osd,
)
from tests.helpers import assert_bitwise_equal

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "fsdp" / "dcp_worker.py"
SAVE_W = 4
PARAMS = {  # named_parameters() of tests/fsdp/dcp_worker.py's build_model(), in order
    "0.weight": (5, 6),
    "0.bias": (5,),
    "2.weight": (1, 5),
    "2.bias": (1,),
    "3.weight": (6, 1),
    "4.kernel": (3, 2, 2),
    "4.proj.weight": (4, 4),
    "4.proj.bias": (4,),
}


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """One 4-rank job (tests/fsdp/dcp_worker.py): real FSDP2 saves, famp-reshard, DCP loads.

    ``ckpt`` saved at W=4, what torch gives at W=4 and W=3, famp's rank files and DCP output for
    W=3 loaded by 3 ranks, and every MATRIX case.
    """
    out = tmp_path_factory.mktemp("fsdp2_dcp")
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    # Judged by what the ranks report: gloo teardown sometimes aborts a finished process.
    done = all((out / f"done{rank}").exists() for rank in range(SAVE_W))
    assert done, f"DCP job failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_load_dcp_optim_state_equals_full_state_dict_of_real_fsdp2(real: pathlib.Path) -> None:
    full = famp.load_dcp_optim_state(real / "ckpt")
    expected = load_dict(real / "full.pt")
    assert_osd_bitwise_equal(full, expected)
    assert full["state"]["0.weight"]["exp_avg"].dtype == torch.float32
    assert full["state"]["0.weight"]["step"].dtype == torch.float32
    assert full["state"]["0.weight"]["step"].shape == ()
    assert [g["lr"] for g in full["param_groups"]] == [0.01, 0.005]  # two groups kept apart


@pytest.mark.slow
@pytest.mark.distributed
def test_read_dcp_param_shapes_reads_the_model_entries(real: pathlib.Path) -> None:
    shapes = famp.read_dcp_param_shapes(real / "ckpt")
    full = load_dict(real / "full.pt")
    order = [fqn for group in full["param_groups"] for fqn in group["params"]]
    assert list(shapes) == order
    assert {f: tuple(s) for f, s in shapes.items()} == PARAMS
    # Without the model entry the shapes come from the optimizer state, and agree.
    assert famp.read_dcp_param_shapes(real / "ckpt", key="no_such_key") == shapes


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [LOAD_W, SAVE_W])
def test_reshard_offline_equals_what_real_fsdp2_holds(real: pathlib.Path, world_size: int) -> None:
    # W=3: what DCP's own load + set_state_dict gave each of 3 real ranks (DCP resharded);
    # W=4: what the 4 saving ranks held.
    full = famp.load_dcp_optim_state(real / "ckpt")
    layout = famp.fsdp2_layout(famp.read_dcp_param_shapes(real / "ckpt"), world_size)
    for rank in range(world_size):
        expected = load_dict(real / f"local{world_size}_{rank}.pt")
        assert_osd_bitwise_equal(famp.shard_optim_state(full, layout, rank), expected)
    if world_size == LOAD_W:  # empty shards on the trailing rank, with their trailing dims
        last = load_dict(real / f"local{LOAD_W}_{LOAD_W - 1}.pt")["state"]
        assert last["2.weight"]["exp_avg"].shape == (0, 5)
        assert last["4.proj.weight"]["exp_avg_sq"].shape == (0, 4)


@pytest.mark.slow
@pytest.mark.distributed
def test_famp_reshard_cli_writes_what_dcp_loads_on_each_rank(
    real: pathlib.Path, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out3, full_file = tmp_path / "w3", tmp_path / "full.pt"
    assert main([str(real / "ckpt"), "-n", "3", "-o", str(out3), "--full", str(full_file)]) == 0
    summary = capsys.readouterr().out
    assert "8 in 2 param groups" in summary
    assert "2: 2.weight, 2.bias" in summary  # rank 1 of 3 holds no row of the 1-row params
    for rank in range(LOAD_W):
        expected = load_dict(real / f"local{LOAD_W}_{rank}.pt")
        assert_osd_bitwise_equal(load_dict(out3 / f"rank{rank:05d}.pt"), expected)
    # --full of a DCP checkpoint: the whole checkpoint, as torch's dcp_to_torch_save writes it.
    dcp_to_torch_save(real / "ckpt", tmp_path / "torch.pt")
    assert_same_tree(load_dict(full_file), load_dict(tmp_path / "torch.pt"))
    # The rank files themselves reshard back to what the 4 saving ranks held.
    out4 = tmp_path / "w4"
    files = [str(out3 / f"rank{r:05d}.pt") for r in range(LOAD_W)]
    assert main([*files, "-n", "4", "-o", str(out4)]) == 0
    for rank in range(SAVE_W):
        expected = load_dict(real / f"local{SAVE_W}_{rank}.pt")
        assert_osd_bitwise_equal(load_dict(out4 / f"rank{rank:05d}.pt"), expected)


@pytest.mark.slow
@pytest.mark.distributed
def test_famp_rank_files_load_into_real_fsdp2_as_dcp_would(real: pathlib.Path) -> None:
    # Each of 3 real ranks loaded its famp-reshard file (resharded from 4 ranks) with
    # docs/fsdp-dcp.md's load_shard, run from the page; the optimizer then holds what DCP's own
    # load gave it.
    for rank in range(LOAD_W):
        expected = load_dict(real / f"local{LOAD_W}_{rank}.pt")
        assert_osd_bitwise_equal(load_dict(real / f"fromfamp{LOAD_W}_{rank}.pt"), expected)


@pytest.mark.slow
@pytest.mark.distributed
def test_famp_dcp_output_loads_into_real_fsdp2_as_the_source_does(real: pathlib.Path) -> None:
    world_size = LOAD_W
    # W real ranks dcp.load-ed famp-reshard --format dcp output into a fresh FSDP2 model and
    # AdamW: model and optimizer state equal, bit for bit, what loading the W=4 source gave.
    for rank in range(world_size):
        got = load_dict(real / f"fromdcp{world_size}_{rank}.pt")
        assert_osd_bitwise_equal(got["optim"], load_dict(real / f"local{world_size}_{rank}.pt"))
        expected_model = load_dict(real / f"model{world_size}_{rank}.pt")
        assert list(got["model"]) == list(expected_model)
        for fqn, value in expected_model.items():
            assert_bitwise_equal(got["model"][fqn], value)


def test_matrix_covers_every_world_size_as_source_and_target() -> None:
    assert {s for _, s, _ in MATRIX} == {1, 2, 3, 4} == {t for _, _, t in MATRIX}
    assert {d for d, _, _ in MATRIX} == {"float32", "bfloat16"}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(("dtype", "source_w", "target_w"), MATRIX)
def test_famp_dcp_output_loads_at_any_world_size_as_the_source_does(
    real: pathlib.Path, dtype: str, source_w: int, target_w: int
) -> None:
    # Real FSDP2 + AdamW (two param groups) saved at source_w ranks; famp-reshard --format dcp
    # -n target_w; target_w real ranks dcp.load famp's output and, separately, the source itself
    # (DCP reshards): model and optimizer state bit-equal on every rank, empty shards included.
    empty = 0
    for rank in range(target_w):
        got = load_dict(real / f"case_{dtype}_{source_w}_{target_w}_{rank}.pt")
        direct, fromfamp = got["direct"], got["famp"]
        assert_osd_bitwise_equal(fromfamp["optim"], direct["optim"])
        assert list(fromfamp["model"]) == list(direct["model"]) == list(PARAMS)
        for fqn, value in direct["model"].items():
            assert value.dtype == getattr(torch, dtype)
            assert_bitwise_equal(fromfamp["model"][fqn], value)
        state = direct["optim"]["state"]
        assert sorted(state) == sorted(PARAMS)
        assert state["0.weight"]["exp_avg"].dtype == getattr(torch, dtype)
        assert state["0.weight"]["step"].dtype == torch.float32
        assert [g["lr"] for g in direct["optim"]["param_groups"]] == [0.01, 0.005]
        empty += sum(s["exp_avg"].shape[0] == 0 for s in state.values())
        for fqn, shape in PARAMS.items():  # each rank holds its dim-0 torch.chunk
            rows = torch.empty(shape[0]).chunk(target_w)
            local = rows[rank].shape[0] if rank < len(rows) else 0
            assert tuple(state[fqn]["exp_avg_sq"].shape) == (local, *shape[1:])
    assert (empty > 0) == (target_w > 1)  # 2.weight has one row: a rank is empty


@pytest.mark.slow
@pytest.mark.distributed
def test_dcp_and_full_output_are_the_same_files_for_any_number_of_workers(
    real: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    outs = []
    for workers in (1, 3):
        out = tmp_path / f"w{workers}"
        argv = [str(real / "ckpt"), "-n", "3", "-o", str(out), "--format", "dcp"]
        assert main([*argv, "--workers", str(workers)]) == 0
        outs.append(out)
    names = sorted(os.listdir(outs[0]))
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]
    assert names == sorted(os.listdir(outs[1]))
    for name in names:
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
    # --full: the tensors' records written by 1 or 3 processes, the same file byte for byte.
    for out, workers in zip(outs, (1, 3), strict=True):
        argv = [str(real / "ckpt"), "--full", str(out / "full.pt"), "--workers", str(workers)]
        assert main(argv) == 0
    assert (outs[0] / "full.pt").read_bytes() == (outs[1] / "full.pt").read_bytes()
    dcp_to_torch_save(real / "ckpt", tmp_path / "torch.pt")
    assert_same_tree(load_dict(outs[1] / "full.pt"), load_dict(tmp_path / "torch.pt"))


@pytest.mark.slow
@pytest.mark.distributed
def test_flattened_optimizer_checkpoint_reads_as_the_nested_one(real: pathlib.Path) -> None:
    # StateDictOptions(flatten_optimizer_state_dict=True), torchtitan's layout, of the same job.
    flat = famp.load_dcp_optim_state(real / "ckpt_flat")
    assert_osd_bitwise_equal(flat, load_dict(real / "full.pt"))
    assert famp.read_dcp_param_shapes(real / "ckpt_flat") == famp.read_dcp_param_shapes(
        real / "ckpt"
    )


@pytest.mark.slow
@pytest.mark.distributed
def test_checkpoint_of_params_sharded_on_dim_1_reads_whole(real: pathlib.Path) -> None:
    # fully_shard(..., shard_placement_fn=Shard(1)): the saved chunks are column blocks.
    full = famp.load_dcp_optim_state(real / "ckpt_dim1")
    assert_osd_bitwise_equal(full, load_dict(real / "full_dim1.pt"))
    metadata = pickle.loads((real / "ckpt_dim1" / ".metadata").read_bytes())
    chunks = metadata.state_dict_metadata["optim.state.4.proj.weight.exp_avg"].chunks
    assert any(c.offsets[1] > 0 for c in chunks)  # really sharded on dim 1


# --- one process: round trips through dcp.save and bad input ---------------------------------


def _save(state_dict: dict[str, Any], path: pathlib.Path) -> None:
    with warnings.catch_warnings():  # no process group: DCP warns that it saves in one process
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state_dict, checkpoint_id=path, no_dist=True)


_DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64])


@st.composite
def _osds(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(1, 4))
    groups: list[dict[str, Any]] = [{"lr": 0.1, "params": []}, {"lr": 0.2, "params": []}]
    state = {}
    for i in range(n):
        fqn = f"layers.{i}.weight"
        groups[draw(st.integers(0, 1))]["params"].append(fqn)
        if draw(st.booleans()):  # a parameter without state
            continue
        shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
        dtype = draw(_DTYPES)
        bits = torch.randint(-(2**15), 2**15, shape, dtype=torch.int16)
        raw = bits.view(torch.float16).to(dtype) if dtype.itemsize != 2 else bits.view(dtype)
        state[fqn] = {"step": torch.tensor(float(i)), "exp_avg": raw, "count": i}
    order = [f for g in groups for f in g["params"]]
    return {"state": {f: state[f] for f in order if f in state}, "param_groups": groups}


@hypothesis.settings(max_examples=15)
@hypothesis.given(osd=_osds())
def test_load_dcp_optim_state_round_trips_dcp_save(
    osd: dict[str, Any], tmp_path_factory: Any
) -> None:
    # NaN payloads, signed zeros, bf16/fp16/fp64, non-tensor state and stateless parameters.
    path = tmp_path_factory.mktemp("roundtrip")
    _save({"optim": osd}, path)
    loaded = famp.load_dcp_optim_state(path)
    assert list(loaded["state"]) == list(osd["state"])
    for fqn, entry in osd["state"].items():
        assert loaded["state"][fqn]["count"] == entry["count"]
        for name in ("step", "exp_avg"):
            assert loaded["state"][fqn][name].dtype == entry[name].dtype
            assert_bitwise_equal(loaded["state"][fqn][name], entry[name])
    assert loaded["param_groups"] == osd["param_groups"]


def test_load_dcp_optim_state_names_a_missing_key(tmp_path: pathlib.Path) -> None:
    _save({"optimizer": two_group_osd()}, tmp_path)
    with pytest.raises(KeyError, match=r"key 'optim' is not in DCP checkpoint .*\['optimizer'\]"):
        famp.load_dcp_optim_state(tmp_path)
    assert famp.load_dcp_optim_state(tmp_path, key="optimizer")["param_groups"][1]["lr"] == 0.2


def test_load_dcp_optim_state_rejects_a_path_that_is_no_checkpoint(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        famp.load_dcp_optim_state(tmp_path / "nope")
    with pytest.raises(ValueError, match="is not a DCP checkpoint"):
        famp.load_dcp_optim_state(tmp_path)
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ValueError, match="is not a DCP checkpoint directory"):
        famp.load_dcp_optim_state(tmp_path / "file")
    for bad in (None, b"ckpt", 3):  # os.fspath's own errors before, not naming checkpoint_id
        with pytest.raises(TypeError, match=r"checkpoint_id must be a str or os\.PathLike path"):
            famp.load_dcp_optim_state(bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"checkpoint_id must be a str or os\.PathLike path"):
            famp.read_dcp_param_shapes(bad)  # type: ignore[arg-type]


def test_load_dcp_optim_state_rejects_entries_that_are_no_optimizer_state(
    tmp_path: pathlib.Path,
) -> None:
    osd = two_group_osd()
    _save({"optim": {**osd, "extra": torch.zeros(2)}}, tmp_path / "a")
    with pytest.raises(
        ValueError, match=r"'optim\.extra' \(path .*\) is not an optimizer state dict entry"
    ):
        famp.load_dcp_optim_state(tmp_path / "a")
    twice = {**osd, "param_groups": [{"lr": 0.1, "params": ["w", "b"]}, {"params": ["b"]}]}
    _save({"optim": twice}, tmp_path / "b")
    with pytest.raises(ValueError, match=r"parameter 'b' is in groups 0 and 1"):
        famp.load_dcp_optim_state(tmp_path / "b")
    same = {**osd, "param_groups": [{"lr": 0.1, "params": ["w", "b", "b"]}]}
    _save({"optim": same}, tmp_path / "d")
    with pytest.raises(ValueError, match=r"parameter 'b' is twice in group 0"):  # "0 and 0"
        famp.load_dcp_optim_state(tmp_path / "d")
    for groups in (same["param_groups"], twice["param_groups"]):
        full = {"state": osd["state"], "param_groups": groups}
        where = (
            "twice in param_groups\\[0\\]"
            if groups is same["param_groups"]
            else "in param_groups 0 and 1"
        )
        with pytest.raises(ValueError, match=rf"parameter 'b' is {where}"):
            famp.shard_optim_state(full, famp.fsdp2_layout({"w": (4, 3), "b": (4,)}, 2), 0)
    orphan = {**osd, "param_groups": [{"lr": 0.1, "params": ["w"]}]}
    _save({"optim": orphan}, tmp_path / "c")
    with pytest.raises(ValueError, match=r"optim\.state\.b: parameter 'b' is in no param group"):
        famp.load_dcp_optim_state(tmp_path / "c")


def _tamper(path: pathlib.Path, edit: Any) -> None:
    metadata_file = path / ".metadata"
    metadata = pickle.loads(metadata_file.read_bytes())  # the test's own trusted file
    edit(metadata)
    metadata_file.write_bytes(pickle.dumps(metadata))


def test_metadata_naming_other_classes_is_never_unpickled(tmp_path: pathlib.Path) -> None:
    _save({"optim": two_group_osd()}, tmp_path)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(ValueError, match=r"refers to (posix|nt)\.system, which famp does not"):
        famp.load_dcp_optim_state(tmp_path)
    assert not marker.exists()


def test_unreadable_metadata_is_a_value_error(tmp_path: pathlib.Path) -> None:
    _save({"optim": two_group_osd()}, tmp_path)
    (tmp_path / ".metadata").write_bytes(b"garbage")
    with pytest.raises(ValueError, match=r"\.metadata' is not readable"):
        famp.load_dcp_optim_state(tmp_path)


def test_non_tensor_items_are_read_with_weights_only(tmp_path: pathlib.Path) -> None:
    import fractions

    osd = two_group_osd()
    osd["param_groups"][0]["lr"] = fractions.Fraction(1, 10)  # pickled as a global
    _save({"optim": osd}, tmp_path)
    with pytest.raises(ValueError, match=r"'optim\.param_groups\.0\.lr' is not plain data"):
        famp.load_dcp_optim_state(tmp_path)


def test_chunks_that_do_not_tile_a_tensor_are_rejected(tmp_path: pathlib.Path) -> None:
    _save({"optim": two_group_osd()}, tmp_path)

    def drop_rows(metadata: Any) -> None:
        chunk = metadata.state_dict_metadata["optim.state.w.exp_avg"].chunks[0]
        chunk.sizes = torch.Size([3, 3])

    _tamper(tmp_path, drop_rows)
    with pytest.raises(ValueError, match=r"'optim\.state\.w\.exp_avg' .* cover 9 of 12 elements"):
        famp.load_dcp_optim_state(tmp_path)


def test_storage_paths_outside_the_checkpoint_are_rejected(tmp_path: pathlib.Path) -> None:
    _save({"optim": two_group_osd()}, tmp_path)

    def escape(metadata: Any) -> None:
        for info in metadata.storage_data.values():
            info.relative_path = "../" + info.relative_path

    _tamper(tmp_path, escape)
    with pytest.raises(ValueError, match="points outside the checkpoint"):
        famp.load_dcp_optim_state(tmp_path)


def test_read_dcp_param_shapes_needs_a_shape_for_every_parameter(tmp_path: pathlib.Path) -> None:
    osd = two_group_osd()
    osd["param_groups"][1]["params"].append("frozen")  # in a group, no state, no model entry
    _save({"model": {"w": torch.zeros(4, 3)}, "optim": osd}, tmp_path / "a")
    # a KeyError before 2026-12-01; such a frozen parameter is no error for famp-reshard
    # (test_cli.py::test_a_checkpoint_saved_without_frozen_parameters_reads_as_torch_reads_it)
    with pytest.raises(ValueError, match=r"parameter 'frozen' has no entry model\.frozen and no"):
        famp.read_dcp_param_shapes(tmp_path / "a")
    model = {"w": torch.zeros(4, 3), "frozen": torch.zeros(2, 2)}
    _save({"model": model, "optim": osd}, tmp_path / "b")
    shapes = famp.read_dcp_param_shapes(tmp_path / "b")
    assert shapes == {"w": (4, 3), "b": (4,), "frozen": (2, 2)}  # b: from its exp_avg


def test_guide_examples_run(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the guide's mkdtemp() lands here
    guide = (ROOT / "docs" / "fsdp-dcp.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", guide, flags=re.DOTALL)
    assert len(blocks) == 2
    namespace: dict[str, object] = {"__name__": "__guide__"}
    for block in blocks:
        exec(compile(block, "docs/fsdp-dcp.md", "exec"), namespace)
    assert callable(namespace["load_shard"])
