"""``famp-reshard`` through ``main(argv)`` and as a process: formats, summaries, errors, atomicity.

Its agreement with real FSDP2 + DCP on every rank is in tests/fsdp/test_dcp.py; here the inputs are
a real optimizer's state from torch (``get_optimizer_state_dict(full_state_dict=True)``), saved with
``torch.save`` and single-process ``dcp.save``.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import re
import runpy
import shutil
import struct
import subprocess
import sys
import warnings
import zipfile
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
)

import famp
from famp._fsdp.cli import main
from tests.fsdp.fsdp_helpers import assert_osd_bitwise_equal, assert_same_tree, load_dict

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _trained() -> tuple[dict[str, Any], dict[str, Any]]:
    """Model and full optimizer state of a real AdamW with two param groups after one step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 1), nn.Linear(1, 7))
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    optim = torch.optim.AdamW([{"params": decay}, {"params": rest, "lr": 0.5}])
    model(torch.randn(3, 6)).square().sum().backward()
    optim.step()
    options = StateDictOptions(full_state_dict=True)
    return get_model_state_dict(model), get_optimizer_state_dict(model, optim, options=options)


@pytest.fixture(scope="module")
def trained() -> tuple[dict[str, Any], dict[str, Any]]:
    return _trained()


@pytest.fixture
def full_file(tmp_path: pathlib.Path, trained: tuple[dict[str, Any], dict[str, Any]]) -> str:
    path = tmp_path / "optim.pt"
    torch.save(trained[1], path)
    return str(path)


@pytest.fixture
def dcp_dir(tmp_path: pathlib.Path, trained: tuple[dict[str, Any], dict[str, Any]]) -> str:
    path = tmp_path / "ckpt"
    with warnings.catch_warnings():  # one process, no process group: DCP warns
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": trained[0], "optim": trained[1]}, checkpoint_id=path, no_dist=True)
    return str(path)


def _shapes(osd: dict[str, Any]) -> dict[str, torch.Size]:
    return {f: e["exp_avg"].shape for f, e in osd["state"].items()}


def _leftovers(parent: pathlib.Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


def test_rank_files_are_compact_shards_and_round_trip(
    tmp_path: pathlib.Path,
    full_file: str,
    trained: tuple[dict[str, Any], dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    full = trained[1]
    out = tmp_path / "w3"
    assert main([full_file, "-n", "3", "-o", str(out)]) == 0
    summary = capsys.readouterr().out
    assert "parameters  6 in 2 param groups, 6 with state" in summary
    assert "2: 2.weight, 2.bias" in summary  # 1-row parameters: empty on ranks 1 and 2
    assert sorted(os.listdir(out)) == ["rank00000.pt", "rank00001.pt", "rank00002.pt"]
    layout = famp.fsdp2_layout(_shapes(full), 3)
    for rank in range(3):
        shard = load_dict(out / f"rank{rank:05d}.pt")
        assert_osd_bitwise_equal(shard, famp.shard_optim_state(full, layout, rank))
        for entry in shard["state"].values():  # saved compact, not the full storage of a view
            exp_avg = entry["exp_avg"]
            assert exp_avg.dtype == torch.float32
            assert exp_avg.untyped_storage().nbytes() == exp_avg.numel() * 4
    back = tmp_path / "back.pt"
    files = [str(out / f"rank{r:05d}.pt") for r in range(3)]
    assert main([*files, "--full", str(back)]) == 0
    assert_osd_bitwise_equal(load_dict(back), full)
    import zipfile

    with zipfile.ZipFile(back) as zf:  # named as torch.save names back.pt's records
        assert zf.namelist()[0] == "back/data.pkl"
    assert _leftovers(tmp_path) == []


def test_dcp_checkpoint_dry_run_writes_nothing(
    tmp_path: pathlib.Path, dcp_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before = sorted(os.listdir(tmp_path))
    assert main([dcp_dir, "-n", "8", "--dry-run"]) == 0
    summary = capsys.readouterr().out
    assert f"source      DCP checkpoint {dcp_dir} (key 'optim')" in summary
    assert "target      FSDP2, dim-0 chunks on 8 ranks" in summary
    assert "dry run: nothing written" in summary
    assert sorted(os.listdir(tmp_path)) == before


def test_dcp_to_torch_save_output_is_a_source_too(
    tmp_path: pathlib.Path, dcp_dir: str, trained: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    # torch's own converter nests {"model": ..., "optim": ...}; shapes come from "model".
    converted = tmp_path / "converted.pt"
    dcp_to_torch_save(dcp_dir, converted)
    out = tmp_path / "w2"
    assert main([str(converted), "-n", "2", "-o", str(out), "--key", "optim"]) == 0
    from_dcp = tmp_path / "from_dcp"
    assert main([dcp_dir, "-n", "2", "-o", str(from_dcp)]) == 0
    for rank in range(2):
        expected = famp.shard_optim_state(
            trained[1], famp.fsdp2_layout(_shapes(trained[1]), 2), rank
        )
        assert_osd_bitwise_equal(load_dict(out / f"rank{rank:05d}.pt"), expected)
        assert_osd_bitwise_equal(load_dict(from_dcp / f"rank{rank:05d}.pt"), expected)


def test_progress_bar_goes_to_stderr(
    tmp_path: pathlib.Path, dcp_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([dcp_dir, "-n", "2", "-o", str(tmp_path / "o"), "--progress"]) == 0
    captured = capsys.readouterr()
    assert "reading [#########################] 100%" in captured.err
    assert "writing ranks [#########################] 100% 2/2" in captured.err
    assert "%" not in captured.out
    assert main([dcp_dir, "-n", "2", "--dry-run"]) == 0  # small state, no terminal: no bar
    assert capsys.readouterr().err == ""


def test_existing_outputs_need_force(
    tmp_path: pathlib.Path, full_file: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "o"
    assert main([full_file, "-n", "3", "-o", str(out)]) == 0
    assert main([full_file, "-n", "2", "-o", str(out)]) == 1
    assert "exists; pass --force to replace it" in capsys.readouterr().err
    assert len(os.listdir(out)) == 3
    assert main([full_file, "-n", "2", "-o", str(out), "--force"]) == 0
    assert sorted(os.listdir(out)) == ["rank00000.pt", "rank00001.pt"]
    assert _leftovers(tmp_path) == []
    # --force never replaces a directory that holds anything but rank files.
    (out / "notes.txt").write_text("keep me")
    assert main([full_file, "-n", "2", "-o", str(out), "--force"]) == 1
    assert "holds files other than the rank*.pt files" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "keep me"


def _flipped_in_data_pkl(whole: bytes, at: int) -> bytes:
    """`whole`, a torch.save file, with one byte of its (stored, uncompressed) pickle flipped."""
    with zipfile.ZipFile(io.BytesIO(whole)) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data.pkl"))
    # The local header: 30 bytes, then the name and the extra field, whose lengths it holds.
    name_len, extra_len = struct.unpack_from("<HH", whole, info.header_offset + 26)
    start = info.header_offset + 30 + name_len + extra_len
    data = bytearray(whole)
    data[start + at] ^= 0x01
    return bytes(data)


class _Payload:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, ("exit 0",))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("flip 0", "flipped.pt' is not a torch.save file (torch.load: IndexError"),
        ("flip 40", "flipped.pt' is not a torch.save file (torch.load: IndexError"),
        ("payload", "refused it: Trying to load unsupported GLOBAL posix.system"),
    ],
)
def test_a_damaged_rank_file_is_named_in_one_line(
    tmp_path: pathlib.Path,
    full_file: str,
    capsys: pytest.CaptureFixture[str],
    damage: str,
    message: str,
) -> None:
    # Before 2026-12-02 the file was not named where torch.load raised other than the reader
    # expected (IndexError, AssertionError, OSError), and a file that needs unpickling got
    # torch's advice to load it with weights_only=False, its reason dropped.
    whole = pathlib.Path(full_file).read_bytes()
    path = tmp_path / "flipped.pt"
    if damage == "payload":
        torch.save({**torch.load(full_file, weights_only=True), "x": _Payload()}, path)
    else:
        path.write_bytes(_flipped_in_data_pkl(whole, int(damage.split()[1])))
        with pytest.raises(Exception) as raised:  # noqa: PT011 - torch's own, whatever it is
            torch.load(path, weights_only=True)
        assert not isinstance(raised.value, (RuntimeError, pickle.UnpicklingError, EOFError))
    before = sorted(os.listdir(tmp_path))
    assert main([str(path), "-n", "2", "-o", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("famp-reshard: error: SOURCE "), err
    assert err.count("\n") == 1, err
    assert message in err, err
    assert "weights_only=False" not in err, err
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["{missing}", "--dry-run"], "does not exist"),
        (["{full}", "{groups}", "-n", "2", "-o", "{out}"], "differs from shards[0]"),
        (["{pickle}", "-n", "2", "-o", "{out}"], "refused it"),
        (["{notosd}", "-n", "2", "-o", "{out}"], "keys are ['a', 'b']"),
        (["{full}", "-n", "2", "-o", "{nodir}/out"], "does not exist"),
        (["{dcp}", "--key", "opt", "-n", "2", "-o", "{out}"], "key 'opt' is not in DCP"),
        (["{short}", "-n", "2", "-o", "{out}"], "'2.weight'"),
        (["{garbage}", "-n", "2", "-o", "{out}"], "refused it: Unsupported operand"),
        (["{badfqn}", "-n", "2", "-o", "{out}"], "['params'] must hold FQN strings, got 3"),
        (["{badentry}", "-n", "2", "-o", "{out}"], "['state']['w'] must be a dict, got 5"),
        (["{truncated}", "-n", "2", "-o", "{out}"], "truncated.pt' cannot be read by torch.load"),
        (["{text}", "-n", "2", "-o", "{out}"], "text.txt' is not a torch.save file (torch.load:"),
        (["{empty}", "-n", "2", "-o", "{out}"], "empty.pt' is not a torch.save file (torch.load:"),
        (["{full}", "-n", "2", "-o", "/proc/famp-out"], "--out '/proc/famp-out': cannot write in"),
    ],
)
def test_bad_input_exits_1_naming_it_and_writes_nothing(
    tmp_path: pathlib.Path,
    full_file: str,
    dcp_dir: str,
    trained: tuple[dict[str, Any], dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    import fractions

    torch.save({"state": {}, "param_groups": [{"lr": fractions.Fraction(1, 3)}]}, tmp_path / "p")
    torch.save({"a": 1, "b": 2}, tmp_path / "n")
    short = {**trained[1], "state": dict(trained[1]["state"])}
    short["state"]["2.weight"] = {**short["state"]["2.weight"], "exp_avg_sq": torch.zeros(1, 4)}
    torch.save(short, tmp_path / "s")
    other_lr = [{**g, "lr": 1.0} for g in trained[1]["param_groups"]]
    torch.save({**trained[1], "param_groups": other_lr}, tmp_path / "g")
    (tmp_path / "garbage").write_bytes(b"garbage")
    torch.save({"state": {}, "param_groups": [{"params": [3]}]}, tmp_path / "f")
    torch.save({"state": {"w": 5}, "param_groups": [{"params": ["w"]}]}, tmp_path / "e")
    (tmp_path / "text.txt").write_text("hello world\n")
    (tmp_path / "empty.pt").write_bytes(b"")
    whole = pathlib.Path(full_file).read_bytes()
    (tmp_path / "truncated.pt").write_bytes(whole[: len(whole) // 2])  # a copy cut short
    paths = {
        "missing": tmp_path / "missing.pt",
        "full": full_file,
        "out": tmp_path / "out",
        "pickle": tmp_path / "p",
        "notosd": tmp_path / "n",
        "nodir": tmp_path / "nodir",
        "dcp": dcp_dir,
        "short": tmp_path / "s",
        "groups": tmp_path / "g",
        "garbage": tmp_path / "garbage",
        "badfqn": tmp_path / "f",
        "badentry": tmp_path / "e",
        "truncated": tmp_path / "truncated.pt",
        "text": tmp_path / "text.txt",
        "empty": tmp_path / "empty.pt",
    }
    before = sorted(os.listdir(tmp_path))
    assert main([a.format(**paths) for a in argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("famp-reshard: error: "), err
    assert message in err, err
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize(
    ("source", "extra"), [("dcp", []), ("dcp", ["--format", "dcp"]), ("file", [])]
)
def test_a_shape_hidden_in_nested_state_asks_for_the_model_state_dict(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], source: str, extra: list[str]
) -> None:
    """No model entry, and the parameter's shaped tensors only inside a list: famp cannot read
    its shape. Before, the 0-d step alone made it shape () and famp-reshard said 0-d parameters
    are not supported; now it says what it could not read and asks for the model's state dict.
    read_dcp_param_shapes keeps its documented torch.Size([]); with a model entry it runs."""
    state = {"w": {"step": torch.tensor(1.0), "hist": [torch.randn(3), torch.randn(3)]}}
    osd = {"state": state, "param_groups": [{"lr": 0.1, "params": ["w"]}]}
    src, with_model = tmp_path / "src", tmp_path / "with_model"
    if source == "dcp":
        with warnings.catch_warnings():  # one process, no process group: DCP warns
            warnings.simplefilter("ignore", UserWarning)
            dcp.save({"optim": osd}, checkpoint_id=src, no_dist=True)
            model = {"w": torch.zeros(3)}
            dcp.save({"model": model, "optim": osd}, checkpoint_id=with_model, no_dist=True)
        assert famp.read_dcp_param_shapes(src) == {"w": torch.Size([])}
    else:
        torch.save({"optim": osd}, src)
        torch.save({"model": {"w": torch.zeros(3)}, "optim": osd}, with_model)
    before = sorted(os.listdir(tmp_path))
    assert main([str(src), "-n", "3", "-o", str(tmp_path / "out"), *extra]) == 1
    err = capsys.readouterr().err
    assert err == (
        "famp-reshard: error: parameter 'w': its shape cannot be read off its optimizer state, "
        "which holds only 0-d tensors at its top level (tensors inside lists or dicts are not "
        "read): save the model's state dict beside it under 'model' (--model-key) to give "
        "the shapes\n"
    ), err
    assert sorted(os.listdir(tmp_path)) == before
    assert main([str(with_model), "-n", "3", "-o", str(tmp_path / "out"), *extra]) == 0


def test_a_model_key_given_must_be_in_the_source(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], dcp_dir: str, full_file: str
) -> None:
    """`--model-key nope` ran (exit 0) on a source without 'nope', the shapes silently read off
    the optimizer state. A key given is now required; left out, 'model' is read where present."""
    ranks = tmp_path / "ranks"
    assert main([full_file, "-n", "2", "-o", str(ranks)]) == 0
    rank_files = [str(ranks / f"rank{r:05d}.pt") for r in range(2)]
    out = str(tmp_path / "out")
    for argv in (
        [dcp_dir, "--dry-run"],
        [dcp_dir, "-n", "2", "-o", out, "--format", "dcp"],
        [dcp_dir, "--full", str(tmp_path / "full.pt")],  # the whole checkpoint: the key unread
        [full_file, "-n", "2", "-o", out],
        [*rank_files, "--full", str(tmp_path / "full.pt")],
    ):
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, "--model-key", "nope"])
        assert exit_info.value.code == 2, argv
        err = capsys.readouterr().err
        assert "famp-reshard: error: --model-key 'nope': " in err, (argv, err)
        assert "holds no model state under that key" in err, (argv, err)
        assert not os.path.exists(out)
        assert not os.path.exists(tmp_path / "full.pt")
    renamed = tmp_path / "renamed"
    trained = load_dict(full_file)
    with warnings.catch_warnings():  # one process, no process group: DCP warns
        warnings.simplefilter("ignore", UserWarning)
        model = {"x": torch.zeros(1)}
        dcp.save({"net": model, "optim": trained}, checkpoint_id=renamed, no_dist=True)
    assert main([str(renamed), "--dry-run", "--model-key", "net"]) == 0
    assert main([str(renamed), "--dry-run"]) == 0  # no 'model': the optimizer state's shapes


def test_a_failure_while_writing_leaves_nothing(
    tmp_path: pathlib.Path, full_file: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing_save = _fail_on_second(torch.save)
    monkeypatch.setattr(torch, "save", failing_save)
    assert main([full_file, "-n", "3", "-o", str(tmp_path / "o")]) == 1
    assert len(failing_save.calls) == 2
    assert sorted(os.listdir(tmp_path)) == ["optim.pt"]


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["x", "-n", "0"])
    assert exit_info.value.code == 2
    assert "must be an int >= 1, got '0'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # an OverflowError deep inside before
        main(["x", "-n", "99999999999999999999", "--dry-run"])
    assert exit_info.value.code == 2
    assert "must be at most 1048576, got '99999999999999999999'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main([])
    assert exit_info.value.code == 2
    for argv, message in [
        (["x.pt"], "nothing to do"),
        (["x.pt", "-n", "2"], "--world-size needs --out DIR"),
        (["x.pt", "-o", "out"], "--out needs --world-size"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert f"famp-reshard: error: {message}" in capsys.readouterr().err


def test_help_documents_sources_outputs_and_safety(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for needle in [
        "rank*.pt",
        "DCP checkpoint directory",
        "weights_only=True",
        "--world-size",
        "--full",
        "--dry-run",
        "--force",
        "--progress",
        "exit status",
    ]:
        assert needle in text
    # --force, as it behaves: per format, never a SOURCE (it said "an --out directory of
    # rank*.pt files" while it replaced DCP checkpoints, SOURCE included)
    force = " ".join(text[text.index("--force  ") :].split())
    assert force.startswith(
        "--force replace an existing --full file, or an --out directory that holds only what "
        "--format writes there (rank*.pt files; DCP's .metadata and __<r>_0.distcp files); "
        "never a SOURCE, a path inside one or a directory holding one"
    ), force


def test_python_m_famp_needs_the_reshard_subcommand(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["famp", "convert"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("famp", run_name="__main__")
    assert exit_info.value.code == 2
    assert "python -m famp reshard" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_python_m_famp_help_prints_the_usage_and_exits_0(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    monkeypatch.setattr(sys, "argv", ["famp", flag])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("famp", run_name="__main__")
    assert exit_info.value.code == 0
    out, err = capsys.readouterr()
    assert out.startswith("usage: python -m famp reshard")
    assert err == ""


def test_console_script_points_at_main() -> None:
    found = re.search(
        r'^famp-reshard = "([\w.]+):(\w+)"$', (ROOT / "pyproject.toml").read_text(), re.M
    )
    assert found is not None
    module, name = found.groups()
    assert getattr(__import__(module, fromlist=[name]), name) is main


@pytest.mark.slow
def test_python_m_famp_reshard_runs_as_a_process(tmp_path: pathlib.Path, dcp_dir: str) -> None:
    out = tmp_path / "o"
    ok = subprocess.run(
        [sys.executable, "-m", "famp", "reshard", dcp_dir, "-n", "2", "-o", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert "wrote 2 rank files" in ok.stdout
    assert sorted(os.listdir(out)) == ["rank00000.pt", "rank00001.pt"]
    bad = subprocess.run(
        [sys.executable, "-m", "famp", "reshard", str(tmp_path / "nope"), "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert bad.returncode == 1
    assert "famp-reshard: error: SOURCE" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.parametrize(
    ("max_memory", "workers"), [(None, None), ("1K", None), ("0.5M", None), (None, 3), ("1K", 2)]
)
def test_full_from_dcp_equals_dcp_to_torch_save(
    tmp_path: pathlib.Path,
    trained: tuple[dict[str, Any], dict[str, Any]],
    max_memory: str | None,
    workers: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if max_memory == "1K":  # the copy through famp's own buffer, as without numpy

        def no_numpy(self: torch.Tensor) -> None:
            raise RuntimeError("Numpy is not available")

        monkeypatch.setattr(torch.Tensor, "numpy", no_numpy)
    # bf16 and int state, a 0-d tensor, a tuple hyperparameter, an extra top-level key, and
    # tensors saved in column blocks (not dim-0 slabs), next to the real AdamW state. Tuples
    # are saved as pickled items, tensors inside them too (Adam's betas may be tensors); two
    # views of one storage are one record, and empty tensors each their own. Before, --full
    # refused such tuples (AssertionError: placeholders pickled in an unexpected order).
    model, osd = trained
    extra = {
        "bf16": torch.randn(7, 3).to(torch.bfloat16),
        "count": torch.tensor(5, dtype=torch.int64),
        "meta": {
            "epoch": 3,
            "betas": (0.9, 0.99),
            "tensor_betas": (torch.tensor(0.9), torch.tensor(0.999, dtype=torch.float64)),
            "views": tuple(torch.arange(6.0).split(3)),
            "empty": (torch.zeros(0), torch.zeros(0, 2, dtype=torch.bfloat16)),
        },
    }
    ckpt = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model, "optim": osd, "extra": extra}, checkpoint_id=ckpt, no_dist=True)
        (tmp_path / "torch").mkdir()  # the same name: torch.save names the records after it
        dcp_to_torch_save(ckpt, tmp_path / "torch" / "full.pt")
    argv = [str(ckpt), "--full", str(tmp_path / "full.pt")]
    argv += [] if max_memory is None else ["--max-memory", max_memory]
    assert main(argv + ([] if workers is None else ["--workers", str(workers)])) == 0
    expected = torch.load(tmp_path / "torch" / "full.pt", weights_only=True)
    assert_same_tree(torch.load(tmp_path / "full.pt", weights_only=True), expected)
    import zipfile

    with zipfile.ZipFile(tmp_path / "full.pt") as zf:
        assert zf.testzip() is None  # every record's CRC-32 is right
        assert zf.namelist()[0] == "full/data.pkl"  # was '.full.pt/...', the temporary name's
    # The same file, byte for byte, for any --workers and --max-memory. Before 2026-12-01 the
    # records were named after the temporary file, their CRC-32s were in the local headers
    # where torch's writer puts them after the bytes, and the serialization id was the one of
    # the file with its tensors' bytes skipped.
    assert (tmp_path / "full.pt").read_bytes() == (tmp_path / "torch" / "full.pt").read_bytes()
    assert _leftovers(tmp_path) == []


def test_full_from_dcp_with_tensors_in_sets_and_meta_tensors_writes_dcp_to_torch_saves_file(
    tmp_path: pathlib.Path, trained: tuple[dict[str, Any], dict[str, Any]]
) -> None:
    # Sets are plain data to famp's reader, and pickle writes their tensors in iteration order.
    # famp did not walk sets when it numbered torch.save's records: --full exited 1 with
    # "AssertionError: tensors pickled in an unexpected order".
    model, osd = trained
    # A meta tensor inside a tuple is plain data too (dcp_to_torch_save writes it), pickled
    # without a storage record: --full exited 1 on it with the same AssertionError.
    meta = (torch.empty(2, device="meta"), torch.ones(3), torch.empty(0, 4, device="meta"))
    extra = {
        "tags": {torch.ones(2), torch.arange(3.0)},
        "nested": [1, {torch.zeros(4)}],
        "meta": meta,
    }
    ckpt = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": model, "optim": osd, "extra": extra}, checkpoint_id=ckpt, no_dist=True)
        (tmp_path / "torch").mkdir()
        dcp_to_torch_save(ckpt, tmp_path / "torch" / "full.pt")
    assert main([str(ckpt), "--full", str(tmp_path / "full.pt")]) == 0
    assert (tmp_path / "full.pt").read_bytes() == (tmp_path / "torch" / "full.pt").read_bytes()


def test_full_from_dcp_with_rank_files_writes_both_or_nothing(
    tmp_path: pathlib.Path, dcp_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = sorted(os.listdir(tmp_path))
    monkeypatch.setattr(torch, "save", _fail_on_second(torch.save))
    argv = [dcp_dir, "-n", "2", "-o", str(tmp_path / "w2"), "--full", str(tmp_path / "f.pt")]
    assert main(argv) == 1  # the rank files fail after --full was streamed
    assert sorted(os.listdir(tmp_path)) == before
    monkeypatch.undo()
    assert main(argv) == 0
    assert sorted(os.listdir(tmp_path)) == sorted([*before, "w2", "f.pt"])


def _fail_on_second(real_save: Any) -> Any:
    """`real_save` that raises ENOSPC on its second call; `.calls` lists the paths it was given."""
    calls: list[Any] = []

    def failing_save(obj: object, path: Any) -> None:
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_save(obj, path)

    failing_save.calls = calls  # type: ignore[attr-defined]
    return failing_save


def test_interrupted_streaming_leaves_nothing(
    tmp_path: pathlib.Path, dcp_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from famp._fsdp import dcp_reader

    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(dcp_reader.Checkpoint, "read_chunk", interrupted)
    before = sorted(os.listdir(tmp_path))
    for argv in (
        [dcp_dir, "--full", str(tmp_path / "f.pt")],
        [dcp_dir, "-n", "2", "-o", str(tmp_path / "d"), "--format", "dcp"],
        [dcp_dir, "-n", "2", "-o", str(tmp_path / "d"), "--format", "dcp", "--workers", "2"],
        [dcp_dir, "--full", str(tmp_path / "f.pt"), "--workers", "2"],
    ):
        with pytest.raises((KeyboardInterrupt, BrokenProcessPool)):
            main(argv)
        assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize(
    ("text", "nbytes"), [("512M", 512 * 2**20), ("2G", 2 * 2**30), ("1.5k", 1536), ("4096", 4096)]
)
def test_max_memory_sizes(text: str, nbytes: int) -> None:
    from famp._fsdp.cli import parse_size

    assert parse_size(text) == nbytes


def test_max_memory_with_whole_state_outputs_is_a_usage_error(
    full_file: str, dcp_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv in (
        [dcp_dir, "-n", "2", "-o", "out", "--max-memory", "1G"],
        [full_file, "--full", "x.pt", "--max-memory", "1G"],
        [dcp_dir, "--full", "x.pt", "--max-memory", "lots"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert "--max-memory" in capsys.readouterr().err


def test_workers_with_outputs_written_in_one_process_is_a_usage_error(
    full_file: str, dcp_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv in (
        [dcp_dir, "-n", "2", "-o", "out", "--workers", "2"],  # rank files
        [dcp_dir, "-n", "2", "--dry-run", "--workers", "2"],
        [full_file, "--full", "x.pt", "--workers", "2"],  # a torch.save source
        [dcp_dir, "--full", "x.pt", "--workers", "0"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert "--workers" in capsys.readouterr().err


def test_rank_files_record_their_sharding_and_files_without_it_need_assume_dim0(
    tmp_path: pathlib.Path,
    full_file: str,
    trained: tuple[dict[str, Any], dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Shards of the same shape on every rank do not tell dim 0 from dim 1: the files say."""
    full = trained[1]
    out = tmp_path / "w7"  # 7 rows of 2.weight (7, 1) and 2.bias: one row on each of 7 ranks
    assert main([full_file, "-n", "7", "-o", str(out)]) == 0
    files = [str(out / f"rank{r:05d}.pt") for r in range(7)]
    shard = load_dict(files[0])
    assert shard["sharding"]["3.weight"] == {"shape": [7, 1], "dim": 0}
    assert shard["sharding"]["0.weight"] == {"shape": [5, 6], "dim": 0}
    assert main([*files, "--full", str(tmp_path / "back.pt")]) == 0
    assert_osd_bitwise_equal(load_dict(tmp_path / "back.pt"), full)
    old = []
    for rank, path in enumerate(files):
        old.append(str(tmp_path / f"old{rank}.pt"))
        torch.save({k: v for k, v in load_dict(path).items() if k != "sharding"}, old[-1])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main([*old, "--full", str(tmp_path / "old.pt")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "the shards of '3.weight' are the same shape on every rank" in err, err
    assert not (tmp_path / "old.pt").exists()
    assert main([*old, "--full", str(tmp_path / "old.pt"), "--assume-dim0"]) == 0
    assert_osd_bitwise_equal(load_dict(tmp_path / "old.pt"), full)
    # a recorded Shard(1) is read as such: 2 ranks of (5, 3) are one (5, 6), not (10, 3)
    layout = famp.fsdp2_layout(_shapes(full), 2, shard_dims={"0.weight": 1})
    dim1 = []
    for rank in range(2):
        dim1.append(str(tmp_path / f"dim1_{rank}.pt"))
        sharding = {
            f: {"shape": list(s), "dim": 1 if f == "0.weight" else 0}
            for f, s in _shapes(full).items()
        }
        torch.save({**famp.shard_optim_state(full, layout, rank), "sharding": sharding}, dim1[-1])
    assert main([*dim1, "--full", str(tmp_path / "dim1.pt")]) == 0
    assert_osd_bitwise_equal(load_dict(tmp_path / "dim1.pt"), full)
    # a sharding entry that is malformed, or differs between the files, is bad input (exit 1)
    bad = load_dict(dim1[1])
    for value, message in [
        ({**bad["sharding"], "0.weight": {"shape": [5, 6], "dim": 1, "x": 0}}, "differs from"),
        ({"0.weight": [5, 6]}, "must be {'shape'"),
    ]:
        torch.save({**bad, "sharding": value}, dim1[1])
        if message.startswith("must"):
            torch.save({**load_dict(dim1[0]), "sharding": value}, dim1[0])
        capsys.readouterr()
        assert main([*dim1, "--full", str(tmp_path / "bad.pt")]) == 1
        assert message in capsys.readouterr().err


def test_rank_files_in_a_shell_globs_order_are_refused(
    tmp_path: pathlib.Path,
    full_file: str,
    trained: tuple[dict[str, Any], dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    # 12 rank files named as the save recipe names them (optim.rank{rank}.pt): a glob sorts
    # optim.rank10.pt before optim.rank2.pt, and shards of one shape were read in that order.
    assert main([full_file, "-n", "12", "-o", str(tmp_path / "w12")]) == 0
    for rank in range(12):
        (tmp_path / "w12" / f"rank{rank:05d}.pt").rename(tmp_path / f"optim.rank{rank}.pt")
    globbed = sorted(str(p) for p in tmp_path.glob("optim.rank*.pt"))
    assert os.path.basename(globbed[2]) == "optim.rank10.pt"
    capsys.readouterr()
    assert main([*globbed, "--full", str(tmp_path / "back.pt")]) == 1
    err = capsys.readouterr().err
    assert "must be given in rank order" in err, err
    assert "optim.rank2.pt' comes after" in err, err
    assert not (tmp_path / "back.pt").exists()
    in_order = [str(tmp_path / f"optim.rank{rank}.pt") for rank in range(12)]
    assert main([*in_order, "--full", str(tmp_path / "back.pt")]) == 0
    assert_osd_bitwise_equal(load_dict(tmp_path / "back.pt"), trained[1])


def test_one_rank_file_alone_is_read_as_rank_files_not_as_the_full_state(
    tmp_path: pathlib.Path,
    full_file: str,
    trained: tuple[dict[str, Any], dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A rank file records its parameters' global shapes (`sharding`). Given alone, it was read
    as a full state: resharded, its 3 rows of 0.weight were written as the whole (3, 6) where
    the job's parameter is (5, 6), and the output's `sharding` said so, silently."""
    assert main([full_file, "-n", "2", "-o", str(tmp_path / "w2")]) == 0
    rank0 = str(tmp_path / "w2" / "rank00000.pt")
    capsys.readouterr()
    assert main([rank0, "-n", "3", "-o", str(tmp_path / "w3")]) == 1
    err = capsys.readouterr().err
    assert f"SOURCE {rank0!r} has a 'sharding' entry, so it is one rank's file" in err, err
    assert "has shape (3, 6), but the layout gives rank 0 the chunk (5, 6)" in err, err
    assert not (tmp_path / "w3").exists()
    # the file of a one-rank job is the whole state, and reads as such
    assert main([full_file, "-n", "1", "-o", str(tmp_path / "w1")]) == 0
    one = str(tmp_path / "w1" / "rank00000.pt")
    assert main([one, "-n", "3", "-o", str(tmp_path / "w3")]) == 0
    layout = famp.fsdp2_layout(_shapes(trained[1]), 3)
    for rank in range(3):
        shard = load_dict(tmp_path / "w3" / f"rank{rank:05d}.pt")
        assert_osd_bitwise_equal(shard, famp.shard_optim_state(trained[1], layout, rank))


@pytest.mark.parametrize("inside", ["", ".metadata", "__0_0.distcp", "sub.pt"])
def test_full_never_writes_over_or_into_its_source(
    tmp_path: pathlib.Path,
    dcp_dir: str,
    full_file: str,
    capsys: pytest.CaptureFixture[str],
    inside: str,
) -> None:
    """`--full ck/.metadata --force` streamed the checkpoint into a file that replaced its own
    metadata: the source could not be read again."""
    before = {p: pathlib.Path(dcp_dir, p).read_bytes() for p in os.listdir(dcp_dir)}
    target = os.path.join(dcp_dir, inside) if inside else dcp_dir
    assert main([dcp_dir, "--full", target, "--force"]) == 1
    err = capsys.readouterr().err
    assert f"--full {target!r} is SOURCE {dcp_dir!r} or inside it" in err, err
    assert {p: pathlib.Path(dcp_dir, p).read_bytes() for p in os.listdir(dcp_dir)} == before
    link = tmp_path / "link"
    link.symlink_to(full_file)  # the same file by another name
    assert main([full_file, "--full", str(link), "--force"]) == 1
    assert "famp-reshard never writes over the checkpoint it reads" in capsys.readouterr().err
    assert main([dcp_dir, "-n", "2", "--dry-run"]) == 0


def _contents(path: str) -> dict[str, bytes | None]:
    """Every file's bytes under `path` (None for a folder or a link), by relative path."""
    return {
        str(p.relative_to(path)): None if p.is_dir() or p.is_symlink() else p.read_bytes()
        for p in pathlib.Path(path).rglob("*")
    }


@pytest.mark.parametrize(
    ("out", "extra", "message"),
    [
        ("{ckpt}", [], "is SOURCE {ckpt!r} or inside it"),
        ("{ckpt}", ["--format", "dcp"], "is SOURCE {ckpt!r} or inside it"),
        ("{link}", [], "is SOURCE {ckpt!r} or inside it"),
        ("{ckpt}/sub", [], "is SOURCE {ckpt!r} or inside it"),
        ("{parent}", [], "holds SOURCE {ckpt!r}"),
        ("{parent}", ["--format", "dcp"], "holds SOURCE {ckpt!r}"),
    ],
)
def test_out_never_replaces_holds_or_lies_inside_its_source(
    tmp_path: pathlib.Path,
    dcp_dir: str,
    capsys: pytest.CaptureFixture[str],
    out: str,
    extra: list[str],
    message: str,
) -> None:
    """`famp-reshard ckpt -n 2 -o ckpt --force` deleted the DCP checkpoint it read, model weights
    included, for two optimizer-only rank files, and exited 0 (--full was protected, --out not)."""
    (tmp_path / "link").symlink_to(dcp_dir)
    paths = {"ckpt": dcp_dir, "link": str(tmp_path / "link"), "parent": str(tmp_path)}
    target = out.format(**paths)
    before = _contents(str(tmp_path))
    assert main([dcp_dir, "-n", "2", "-o", target, "--force", *extra]) == 1
    err = capsys.readouterr().err
    assert f"--out {target!r} {message.format(**paths)}" in err, err
    assert "famp-reshard never writes over the checkpoint it reads" in err, err
    assert _contents(str(tmp_path)) == before
    assert main([dcp_dir, "-n", "2", "--dry-run"]) == 0


def test_out_never_replaces_the_rank_files_it_reads(
    tmp_path: pathlib.Path, full_file: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([full_file, "-n", "3", "-o", str(tmp_path / "w3")]) == 0
    files = [str(tmp_path / "w3" / f"rank{r:05d}.pt") for r in range(3)]
    before = _contents(str(tmp_path / "w3"))
    capsys.readouterr()
    assert main([*files, "-n", "2", "-o", str(tmp_path / "w3"), "--force"]) == 1
    assert f"--out {str(tmp_path / 'w3')!r} holds SOURCE {files[0]!r}" in capsys.readouterr().err
    assert _contents(str(tmp_path / "w3")) == before


def test_force_replaces_only_a_directory_of_what_its_format_writes(
    tmp_path: pathlib.Path, dcp_dir: str, full_file: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--force replaced any directory of rank*.pt, .metadata and __<r>_0.distcp files: another
    DCP checkpoint (model weights included) for rank files, or rank files for a DCP output."""
    other = shutil.copytree(dcp_dir, tmp_path / "other_ckpt")  # not a SOURCE here
    before = _contents(str(other))
    assert main([full_file, "-n", "2", "-o", str(other), "--force"]) == 1
    err = capsys.readouterr().err
    assert "holds files other than the rank*.pt files that --format rank-files writes" in err, err
    assert "['.metadata', '__0_0.distcp']" in err, err
    assert _contents(str(other)) == before
    ranks = tmp_path / "ranks"
    assert main([full_file, "-n", "2", "-o", str(ranks)]) == 0
    capsys.readouterr()
    assert main([dcp_dir, "-n", "3", "-o", str(ranks), "--format", "dcp", "--force"]) == 1
    err = capsys.readouterr().err
    assert "other than the DCP files (.metadata, __<r>_0.distcp) that --format dcp" in err, err
    assert sorted(os.listdir(ranks)) == ["rank00000.pt", "rank00001.pt"]
    (tmp_path / "dirs" / "rank00000.pt").mkdir(parents=True)  # a folder of that name
    assert main([full_file, "-n", "2", "-o", str(tmp_path / "dirs"), "--force"]) == 1
    assert "(['rank00000.pt'])" in capsys.readouterr().err
    # a directory of its format's files is replaced: famp's own output, or another DCP checkpoint
    assert main([dcp_dir, "-n", "3", "-o", str(other), "--format", "dcp", "--force"]) == 0
    assert main([full_file, "-n", "3", "-o", str(ranks), "--force"]) == 0
    assert sorted(os.listdir(ranks)) == ["rank00000.pt", "rank00001.pt", "rank00002.pt"]
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("source", ["dcp", "file"])
@pytest.mark.parametrize("force", [[], ["--force"]])
@pytest.mark.parametrize(("out", "full"), [("X", "X"), ("X", "X/f.pt"), ("X", "D")])
def test_out_and_full_are_checked_against_each_other_before_anything_is_written(
    tmp_path: pathlib.Path,
    dcp_dir: str,
    full_file: str,
    capsys: pytest.CaptureFixture[str],
    source: str,
    force: list[str],
    out: str,
    full: str,
) -> None:
    """`-o X --full X` wrote the rank files to X, then failed on --full (exit 1, X left);
    `--full` naming a directory (D exists) failed only once the rank files were in place."""
    (tmp_path / "X").mkdir()  # an empty --out: replaceable with --force
    (tmp_path / "D").mkdir()
    src = dcp_dir if source == "dcp" else full_file
    out_path, full_path = str(tmp_path / out), str(tmp_path / full)
    before = _contents(str(tmp_path))
    assert main([src, "-n", "2", "-o", out_path, "--full", full_path, *force]) == 1
    err = capsys.readouterr().err
    if full == "D" and force:
        assert f"--full {full_path!r} is a directory" in err, err
    elif full != "D":
        assert f"--out {out_path!r} and --full {full_path!r} are the same path or one is" in err
    assert _contents(str(tmp_path)) == before
    assert _leftovers(tmp_path) == []


def test_full_from_files_with_rank_files_writes_both_or_nothing(
    tmp_path: pathlib.Path, full_file: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From torch.save files, --full was written after the rank files were in place: a failure
    on it (ENOSPC) left the rank files behind with exit 1."""
    real_save = torch.save
    argv = [full_file, "-n", "3", "-o", str(tmp_path / "w3"), "--full", str(tmp_path / "f.pt")]
    before = sorted(os.listdir(tmp_path))
    for failing in (".f.pt.tmp-", "rank00002.pt"):  # --full's temporary file, the last rank

        def save(obj: object, path: Any, failing: str = failing) -> None:
            if failing in str(path):
                raise OSError(28, "No space left on device")
            real_save(obj, path)

        monkeypatch.setattr(torch, "save", save)
        assert main(argv) == 1
        assert sorted(os.listdir(tmp_path)) == before, failing
    monkeypatch.undo()
    assert main(argv) == 0
    assert sorted(os.listdir(tmp_path)) == sorted([*before, "w3", "f.pt"])


def test_full_keeps_torch_saves_id_where_torch_computes_it_otherwise(
    tmp_path: pathlib.Path, dcp_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """famp sets the serialization id by torch's rule, checked once against the installed torch
    (the byte-for-byte tests show it holds on 2.13 to 2.15); where a torch computed it
    otherwise, the file would keep the id torch.save gave it and differ in that record only."""
    import zipfile

    from famp._fsdp import zip_records

    assert zip_records._rule_holds()
    monkeypatch.setattr(zip_records, "_rule_holds", lambda: False)
    (tmp_path / "torch").mkdir()
    dcp_to_torch_save(dcp_dir, tmp_path / "torch" / "full.pt")
    assert main([dcp_dir, "--full", str(tmp_path / "full.pt")]) == 0
    with (
        zipfile.ZipFile(tmp_path / "full.pt") as ours,
        zipfile.ZipFile(tmp_path / "torch" / "full.pt") as theirs,
    ):
        assert ours.testzip() is None
        assert ours.namelist() == theirs.namelist()
        differ = [n for n in ours.namelist() if ours.read(n) != theirs.read(n)]
    assert differ == ["full/.data/serialization_id"]


def test_a_checkpoint_saved_without_frozen_parameters_reads_as_torch_reads_it(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A frozen layer the optimizer holds (no state), saved with ignore_frozen_params=True: no
    model entry and no state gives famp no shape for it, and famp-reshard refused every output
    (KeyError, exit 1) where torch's dcp.load and dcp_to_torch_save read the checkpoint. Such a
    parameter has nothing to cut: rank files list it in param_groups and record no sharding."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 5))
    model[0].requires_grad_(False)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).square().sum().backward()
    optim.step()
    msd, osd = get_state_dict(model, optim, options=StateDictOptions(ignore_frozen_params=True))
    assert sorted(msd) == ["2.bias", "2.weight"]
    assert sorted(osd["state"]) == sorted(msd)
    full = get_optimizer_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    ckpt = tmp_path / "ckpt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt, no_dist=True)
        dcp_to_torch_save(ckpt, tmp_path / "converted.pt")
    assert_osd_bitwise_equal(famp.load_dcp_optim_state(ckpt), full)
    layout = famp.fsdp2_layout({n: p.shape for n, p in model.named_parameters()}, 2)
    torch.save(full, tmp_path / "full.pt")
    for source in (ckpt, tmp_path / "converted.pt", tmp_path / "full.pt"):
        out = tmp_path / f"w2_{source.name}"
        assert main([str(source), "-n", "2", "-o", str(out)]) == 0
        files = [str(out / f"rank{r:05d}.pt") for r in range(2)]
        for rank, path in enumerate(files):
            shard = load_dict(path)
            assert sorted(shard.pop("sharding")) == ["2.bias", "2.weight"]
            assert_osd_bitwise_equal(shard, famp.shard_optim_state(full, layout, rank))
        back = tmp_path / f"back_{source.name}.pt"
        assert main([*files, "--full", str(back)]) == 0  # famp's rank files read back
        assert_osd_bitwise_equal(load_dict(back), full)
    assert main([str(ckpt), "-n", "3", "--dry-run"]) == 0
    out = tmp_path / "d3"
    assert main([str(ckpt), "-n", "3", "-o", str(out), "--format", "dcp"]) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp_to_torch_save(out, tmp_path / "from_d3.pt")
    assert_same_tree(load_dict(tmp_path / "from_d3.pt"), load_dict(tmp_path / "converted.pt"))
    # where a shape is needed and missing: one clear error naming the parameter
    with pytest.raises(ValueError, match=r"parameter '0\.weight' \(and 1 more\) has no entry"):
        famp.read_dcp_param_shapes(ckpt)
