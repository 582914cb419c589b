"""Damaged and crafted DCP checkpoints: every fact in the metadata is checked against the bytes.

Each case is an attack or an accident found by adversarial runs (issue 12): the reader must stop
with one ``ValueError`` naming the file and the key, ``famp-reshard`` with one
``famp-reshard: error:`` line and exit 1, writing nothing, and no message may advise
``weights_only=False``.
"""

from __future__ import annotations

import copy
import io
import os
import pathlib
import pickle
import re
import shutil
import stat
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any

import hypothesis
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import strategies as st

import famp
from famp._fsdp.cli import main
from famp._fsdp.dcp_metadata import read_metadata
from tests.fsdp.fsdp_helpers import two_group_osd
from tests.helpers import assert_trees_bitwise_equal

KEY = "optim.state.w.exp_avg"


def _save(path: pathlib.Path) -> pathlib.Path:
    with warnings.catch_warnings():  # no process group: DCP warns that it saves in one process
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"optim": two_group_osd()}, checkpoint_id=path, no_dist=True)
    return path


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return _save(tmp_path_factory.mktemp("pristine") / "ckpt")


@pytest.fixture
def ckpt(tmp_path: pathlib.Path, pristine: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(shutil.copytree(pristine, tmp_path / "ckpt"))


def _tamper(path: pathlib.Path, edit: Callable[[Any], None]) -> None:
    metadata_file = path / ".metadata"
    metadata = pickle.loads(metadata_file.read_bytes())  # the test's own trusted file
    edit(metadata)
    metadata_file.write_bytes(pickle.dumps(metadata))


def _record(metadata: Any, key: str = KEY) -> Any:
    return next(info for index, info in metadata.storage_data.items() if index.fqn == key)


def _cli_refuses(ckpt: pathlib.Path, capsys: pytest.CaptureFixture[str], message: str) -> None:
    """famp-reshard exits 1 with one error line holding ``message``, writing nothing."""
    parent = ckpt.parent
    before = sorted(os.listdir(parent))
    status = main([str(ckpt), "-n", "2", "-o", str(parent / "out"), "--full", str(parent / "f")])
    err = capsys.readouterr().err
    assert status == 1, err
    assert err.count("\n") == 1, err
    assert err.startswith("famp-reshard: error: "), err
    assert message in err, err
    assert "weights_only=False" not in err
    assert sorted(os.listdir(parent)) == before


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64, torch.bfloat16])
def test_metadata_dtype_that_disagrees_with_the_bytes_is_refused(
    ckpt: pathlib.Path, capsys: pytest.CaptureFixture[str], dtype: torch.dtype
) -> None:
    # DCP itself copies the float32 bytes into a tensor of the stated dtype: silent truncation.
    def retype(metadata: Any) -> None:
        metadata.state_dict_metadata[KEY].properties.dtype = dtype

    _tamper(ckpt, retype)
    message = f"'__0_0.distcp': the record of tensor '{KEY}' (chunk at offsets [0, 0]) holds "
    with pytest.raises(
        ValueError, match=rf"holds torch\.float32 data where the metadata says {dtype}"
    ):
        famp.load_dcp_optim_state(ckpt)
    _cli_refuses(ckpt, capsys, message)


def test_metadata_shape_that_disagrees_with_the_bytes_is_refused(
    ckpt: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def reshape(metadata: Any) -> None:
        md = metadata.state_dict_metadata[KEY]
        md.size = torch.Size([3, 4])
        md.chunks[0].sizes = torch.Size([3, 4])

    _tamper(ckpt, reshape)
    with pytest.raises(ValueError, match=r"holds shape \[4, 3\] where the metadata says \[3, 4\]"):
        famp.load_dcp_optim_state(ckpt)
    _cli_refuses(ckpt, capsys, f"tensor '{KEY}'")


def _storage_as_list(m: Any) -> None:
    m.storage_data = list(m.storage_data.values())


def _planner_as_list(m: Any) -> None:
    m.planner_data = list(m.planner_data.values())


def _empty_path(m: Any) -> None:
    m.planner_data[KEY] = ()


def _no_properties(m: Any) -> None:
    m.state_dict_metadata[KEY].properties = None


def _string_offset(m: Any) -> None:
    _record(m).offset = "0"


def _chunks_as_dict(m: Any) -> None:
    m.state_dict_metadata[KEY].chunks = {}


def _size_past_int64(m: Any) -> None:  # no element, so no chunk: it "tiles"
    m.state_dict_metadata[KEY].size, m.state_dict_metadata[KEY].chunks = (0, 2**70), []


def _strides_past_int64(m: Any) -> None:  # every dim fits, torch.empty's strides do not
    m.state_dict_metadata[KEY].size, m.state_dict_metadata[KEY].chunks = (0, 2**62, 4), []


def _empty_chunk_past_int64(m: Any) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    far = ChunkStorageMetadata(offsets=torch.Size([2**64, 0]), sizes=torch.Size([0, 3]))
    m.state_dict_metadata[KEY].chunks.append(far)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_storage_as_list, "storage_data is a list, not a dict"),
        (_planner_as_list, "planner_data is a list"),
        (_empty_path, f"the path of '{KEY}' is malformed: ()"),
        (_no_properties, f"tensor '{KEY}' has no dtype (None)"),
        (_string_offset, f"the record of '{KEY}' has offset '0'"),
        (_chunks_as_dict, f"tensor '{KEY}' has malformed chunks"),
        (_size_past_int64, f"tensor '{KEY}' has size (0, {2**70}); its dims must be ints"),
        (_strides_past_int64, f"tensor '{KEY}' has size [0, {2**62}, 4], whose dims multiply"),
        (_empty_chunk_past_int64, f"tensor '{KEY}' has malformed chunks (offsets and sizes"),
    ],
)
def test_malformed_metadata_of_allowed_classes_is_one_clear_error(
    ckpt: pathlib.Path,
    capsys: pytest.CaptureFixture[str],
    edit: Callable[[Any], None],
    message: str,
) -> None:
    _tamper(ckpt, edit)
    with pytest.raises(ValueError, match=re.escape(message)):
        famp.load_dcp_optim_state(ckpt)
    with pytest.raises(ValueError, match=re.escape(message)):
        famp.read_dcp_param_shapes(ckpt, key="optim")  # the metadata alone
    _cli_refuses(ckpt, capsys, message)


def _distcp_bytes(ckpt: pathlib.Path) -> tuple[pathlib.Path, Any]:
    metadata = pickle.loads((ckpt / ".metadata").read_bytes())
    record = _record(metadata)
    return ckpt / record.relative_path, record


class _PathOf313:
    """Pickles as Python 3.13 pickles a `pathlib.PosixPath`: `pathlib._local.PosixPath`."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_PathOf313, (self.text,))


_PathOf313.__module__ = "pathlib._local"
_PathOf313.__name__ = _PathOf313.__qualname__ = "PosixPath"


def test_a_checkpoint_saved_under_python_3_13_reads_on_every_python(
    ckpt: pathlib.Path, pristine: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Python 3.13 pickles the checkpoint's path (StorageMeta.checkpoint_id) as
    # pathlib._local.PosixPath; famp refused it as a foreign class, on 3.13 itself too.
    metadata_file = ckpt / ".metadata"
    metadata = pickle.loads(metadata_file.read_bytes())  # the test's own trusted file
    metadata.storage_meta.checkpoint_id = _PathOf313(str(ckpt))
    with monkeypatch.context() as patch:  # pickle finds the class by its module and name
        patch.setitem(sys.modules, "pathlib._local", types.SimpleNamespace(PosixPath=_PathOf313))
        metadata_file.write_bytes(pickle.dumps(metadata))
    assert b"pathlib._local" in (ckpt / ".metadata").read_bytes()
    metadata = read_metadata(str(ckpt))
    assert type(metadata.storage_meta.checkpoint_id) is type(pathlib.Path(ckpt))
    assert metadata.storage_meta.checkpoint_id == pathlib.Path(ckpt)
    assert_trees_bitwise_equal(famp.load_dcp_optim_state(ckpt), famp.load_dcp_optim_state(pristine))


def test_garbage_in_a_tensor_record_never_advises_weights_only_false(
    ckpt: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, record = _distcp_bytes(ckpt)
    data = bytearray(path.read_bytes())
    # the pickle sits right after the zip's first local header: make it name a global
    start = data.index(b"data.pkl", record.offset) + len(b"data.pkl")
    evil = pickle.dumps(os.system, protocol=2)
    data[start : start + len(evil)] = evil
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"tensor '{KEY}'") as info:
        famp.load_dcp_optim_state(ckpt)
    assert "weights_only" not in str(info.value)
    _cli_refuses(ckpt, capsys, "__0_0.distcp")


def test_a_truncated_distcp_file_names_the_file_and_the_key(
    ckpt: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, record = _distcp_bytes(ckpt)
    path.write_bytes(path.read_bytes()[: record.offset + record.length // 2])
    message = f"DCP file '__0_0.distcp': the record of '{KEY}' spans bytes"
    with pytest.raises(ValueError, match=r"past the file's end .*: the file is truncated") as info:
        famp.load_dcp_optim_state(ckpt)
    assert message in str(info.value)
    _cli_refuses(ckpt, capsys, message)


def test_a_record_holding_a_meta_tensor_is_refused_naming_the_file_and_key(
    ckpt: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """DCP's writer stores a state dict's meta tensor as torch.save of it: dtype and shape, no
    data. torch's dcp.load refuses it; famp returned it (exp_avg on 'meta') and famp-reshard
    wrote meta tensors into rank files, exit 0."""
    path, _ = _distcp_bytes(ckpt)
    buffer = io.BytesIO()
    torch.save(torch.empty(4, 3, device="meta"), buffer)
    padded = buffer.getvalue() + b"\0" * 48  # the bytes the chunk's (4, 3) float32 claims
    offset = path.stat().st_size
    path.write_bytes(path.read_bytes() + padded)

    def point_at_it(metadata: Any) -> None:
        _record(metadata).offset, _record(metadata).length = offset, len(padded)

    _tamper(ckpt, point_at_it)
    message = (
        f"DCP file '__0_0.distcp': the record of tensor '{KEY}' (chunk at offsets [0, 0]) holds "
        "a tensor on device 'meta', which has no data to read"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        famp.load_dcp_optim_state(ckpt)
    _cli_refuses(ckpt, capsys, message)
    out = ckpt.parent / "out"
    assert main([str(ckpt), "-n", "2", "-o", str(out), "--format", "dcp"]) == 1
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_a_negative_offset_names_the_file_and_the_key(
    ckpt: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def negative(metadata: Any) -> None:
        _record(metadata).offset = -5

    _tamper(ckpt, negative)
    message = f"DCP file '__0_0.distcp': the record of '{KEY}' has offset -5"
    with pytest.raises(ValueError, match="both must be ints >= 0"):
        famp.load_dcp_optim_state(ckpt)
    _cli_refuses(ckpt, capsys, message)


def test_a_distcp_symlink_out_of_the_checkpoint_is_not_followed(
    ckpt: pathlib.Path, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    outside = tmp_path / "elsewhere.distcp"
    (ckpt / "__0_0.distcp").rename(outside)
    (ckpt / "__0_0.distcp").symlink_to(outside)
    message = "DCP file '__0_0.distcp' resolves to"
    with pytest.raises(ValueError, match=r"outside the checkpoint directory \(through a symlink"):
        famp.load_dcp_optim_state(ckpt)
    _cli_refuses(ckpt, capsys, message)


def test_a_folder_symlink_out_of_the_checkpoint_is_not_followed(
    ckpt: pathlib.Path, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A record's path through a symlinked folder ("sub/__0_0.distcp", sub -> elsewhere) read a
    # file outside the checkpoint: only the file's own name was checked for a symlink.
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (ckpt / "__0_0.distcp").rename(outside / "__0_0.distcp")
    (ckpt / "sub").symlink_to(outside)

    def through_sub(metadata: Any) -> None:
        for record in metadata.storage_data.values():
            record.relative_path = "sub/__0_0.distcp"

    _tamper(ckpt, through_sub)
    message = "DCP file 'sub/__0_0.distcp' resolves to"
    with pytest.raises(ValueError, match=r"outside the checkpoint directory \(through a symlink"):
        famp.load_dcp_optim_state(ckpt)
    _cli_refuses(ckpt, capsys, message)


def test_a_chunk_claiming_more_bytes_than_its_record_holds_is_refused_before_allocation(
    ckpt: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Chunks tiling a (2e11, 3) tensor, the second's record the first's few bytes: famp allocated
    # the claimed 2.4 TB (torch's allocator error, no file or key named; a claim of a few GB
    # would be allocated for real). A record must hold its chunk's bytes.
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    rows = 2 * 10**11

    def huge(metadata: Any) -> None:
        md = metadata.state_dict_metadata[KEY]
        height, width = md.size
        md.size = torch.Size([rows, width])
        md.chunks = [
            md.chunks[0],
            ChunkStorageMetadata(torch.Size([height, 0]), torch.Size([rows - height, width])),
        ]
        first = metadata.storage_data[MetadataIndex(KEY, torch.Size([0, 0]))]
        metadata.storage_data[MetadataIndex(KEY, torch.Size([height, 0]))] = first

    _tamper(ckpt, huge)
    message = f"DCP file '__0_0.distcp': the record of '{KEY}' at "
    with pytest.raises(ValueError, match=r"fewer than the \d+ its chunk's metadata claims") as info:
        famp.load_dcp_optim_state(ckpt)
    assert message in str(info.value)
    _cli_refuses(ckpt, capsys, message)


def test_metadata_paths_that_are_not_their_keys_are_refused(
    ckpt: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Two entries' paths swapped in planner_data: famp returned one tensor as the other (torch's
    # dcp.load reads by key and returned the real one). DCP stores each entry under its path
    # joined with dots.
    def swapped(metadata: Any) -> None:
        planner = metadata.planner_data
        other = "optim.state.b.exp_avg"
        planner[KEY], planner[other] = planner[other], planner[KEY]

    _tamper(ckpt, swapped)
    message = f"entry '{KEY}' has the path ('optim', 'state', 'b', 'exp_avg')"
    with pytest.raises(ValueError, match="the metadata's paths do not match its keys") as info:
        famp.load_dcp_optim_state(ckpt)
    assert message in str(info.value)
    _cli_refuses(ckpt, capsys, message)


@pytest.mark.parametrize("damaged", ["state_dict_metadata", "planner_data"])
def test_an_entry_without_a_path_in_planner_data_is_refused(
    ckpt: pathlib.Path, capsys: pytest.CaptureFixture[str], damaged: str
) -> None:
    # One flipped byte in a key of .metadata: famp read the entry as a top-level one, outside
    # the optimizer state, and returned (famp-reshard wrote, exit 0) 'w' without its exp_avg;
    # AdamW's step then failed. torch's dcp.load refuses the first damage and reads the second.
    flipped = KEY.replace("state", "s/ate")

    def rename(metadata: Any) -> None:
        table = getattr(metadata, damaged)
        table[flipped] = table.pop(KEY)

    _tamper(ckpt, rename)
    name = flipped if damaged == "state_dict_metadata" else KEY
    message = f"entry {name!r} has no path in planner_data"
    with pytest.raises(ValueError, match=re.escape(message)):
        famp.load_dcp_optim_state(ckpt)
    _cli_refuses(ckpt, capsys, message)


@pytest.mark.parametrize("saved", ["requires_grad", "parameter"])
def test_a_record_of_a_tensor_that_requires_grad_reads_as_plain_data(
    ckpt: pathlib.Path, tmp_path: pathlib.Path, saved: str
) -> None:
    # One bit of a record's pickle says requires_grad: famp returned exp_avg requiring grad
    # (grad_fn CopySlices, so copy.deepcopy of the state failed) and famp-reshard saved it so;
    # a record of an nn.Parameter came back a Parameter. torch's dcp.load gives plain tensors.
    expected = famp.load_dcp_optim_state(ckpt)
    path, _ = _distcp_bytes(ckpt)
    value = expected["state"]["w"]["exp_avg"].clone()
    value = torch.nn.Parameter(value) if saved == "parameter" else value.requires_grad_()
    buffer = io.BytesIO()
    torch.save(value, buffer)
    offset = path.stat().st_size
    path.write_bytes(path.read_bytes() + buffer.getvalue())

    def point_at_it(metadata: Any) -> None:
        _record(metadata).offset, _record(metadata).length = offset, len(buffer.getvalue())

    _tamper(ckpt, point_at_it)
    got = famp.load_dcp_optim_state(ckpt)
    assert_trees_bitwise_equal(got, expected)
    exp_avg = got["state"]["w"]["exp_avg"]
    assert type(exp_avg) is torch.Tensor
    assert not exp_avg.requires_grad
    copy.deepcopy(got)
    assert main([str(ckpt), "-n", "2", "-o", str(tmp_path / "out")]) == 0
    for rank in range(2):
        shard = torch.load(tmp_path / "out" / f"rank{rank:05d}.pt", weights_only=True)
        assert type(shard["state"]["w"]["exp_avg"]) is torch.Tensor
        assert not shard["state"]["w"]["exp_avg"].requires_grad


def test_an_optimizer_state_keyed_by_position_is_refused_by_name(tmp_path: pathlib.Path) -> None:
    # `state` saved as a list (its paths' keys ints): famp failed with "'list' object has no
    # attribute 'items'", naming nothing.
    osd = two_group_osd()
    listed = {"state": list(osd["state"].values()), "param_groups": osd["param_groups"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"optim": listed}, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    with pytest.raises(ValueError, match=r"optim\.state must be a dict keyed by FQN, got list"):
        famp.load_dcp_optim_state(tmp_path / "ckpt")


def test_a_distcp_symlink_inside_the_checkpoint_is_read(ckpt: pathlib.Path) -> None:
    (ckpt / "__0_0.distcp").rename(ckpt / "data.bin")
    (ckpt / "__0_0.distcp").symlink_to("data.bin")
    assert famp.load_dcp_optim_state(ckpt)["param_groups"][1]["lr"] == 0.2


def test_a_missing_distcp_file_is_named(
    ckpt: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (ckpt / "__0_0.distcp").unlink()
    message = "DCP file '__0_0.distcp' named by the metadata is missing"
    with pytest.raises(ValueError, match=message):
        famp.load_dcp_optim_state(ckpt)
    _cli_refuses(ckpt, capsys, message)


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_outputs_get_the_modes_torch_save_gives_under_the_umask(
    pristine: pathlib.Path, tmp_path: pathlib.Path, umask: int
) -> None:
    old = os.umask(umask)
    try:
        torch.save({}, tmp_path / "reference.pt")
        os.mkdir(tmp_path / "reference_dir")
        assert (
            main(
                [
                    str(pristine),
                    "-n",
                    "2",
                    "-o",
                    str(tmp_path / "w2"),
                    "--full",
                    str(tmp_path / "f.pt"),
                ]
            )
            == 0
        )
    finally:
        os.umask(old)

    def mode(p: pathlib.Path) -> int:
        return stat.S_IMODE(p.stat().st_mode)

    assert mode(tmp_path / "f.pt") == mode(tmp_path / "reference.pt") == 0o666 & ~umask
    assert mode(tmp_path / "w2") == mode(tmp_path / "reference_dir") == 0o777 & ~umask
    for rank_file in (tmp_path / "w2").iterdir():
        assert mode(rank_file) == 0o666 & ~umask


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(
    target=st.sampled_from([".metadata", "__0_0.distcp"]),
    cut=st.one_of(st.none(), st.floats(0.0, 1.0)),
    flips=st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(1, 255)), max_size=8),
)
def test_damaged_checkpoints_read_or_fail_with_one_clear_line(
    pristine: pathlib.Path,
    tmp_path_factory: pytest.TempPathFactory,
    target: str,
    cut: float | None,
    flips: list[tuple[float, int]],
) -> None:
    ckpt = pathlib.Path(shutil.copytree(pristine, tmp_path_factory.mktemp("fuzz") / "ckpt"))
    data = bytearray((ckpt / target).read_bytes())
    for where, xor in flips:
        data[int(where * (len(data) - 1))] ^= xor
    if cut is not None:
        data = data[: int(cut * len(data))]
    (ckpt / target).write_bytes(bytes(data))
    message = ""
    try:
        got = famp.load_dcp_optim_state(ckpt)
    except (ValueError, KeyError) as err:  # flipped payload bytes may also read as other values
        message = str(err)
    else:  # the values may differ, but no entry drops out and every tensor is plain data
        expected = famp.load_dcp_optim_state(pristine)
        assert {f: sorted(e) for f, e in got["state"].items()} == {
            f: sorted(e) for f, e in expected["state"].items()
        }
        assert not any(
            t.requires_grad or type(t) is not torch.Tensor
            for e in got["state"].values()
            for t in e.values()
            if isinstance(t, torch.Tensor)
        )
    assert "weights_only=False" not in message
    out = ckpt.parent / "out"
    status = main([str(ckpt), "-n", "2", "-o", str(out)])
    assert status in (0, 1)
    assert out.exists() == (status == 0)
