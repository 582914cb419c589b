"""shard / unshard / reshard: round trips and resharding over random layouts, views, bad input.

Real FSDP is the oracle for the layouts themselves (test_fsdp_real.py, test_fsdp_layout.py); these
properties pin the maps to each other over shapes and world sizes those runs do not reach.
"""

from __future__ import annotations

import copy
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given

import famp
from tests.fsdp.fsdp_helpers import assert_same_osd, full_states, layouts, shapes
from tests.helpers import assert_trees_bitwise_equal


@given(st.data())
def test_unshard_inverts_shard(data: st.DataObject) -> None:
    params = data.draw(shapes())
    layout = data.draw(layouts(params))
    full = data.draw(full_states(params))
    shards = [famp.shard_optim_state(full, layout, r) for r in range(layout.world_size)]
    for shard in shards:
        for fqn, entry in shard["state"].items():
            assert entry["step"] is full["state"][fqn]["step"]  # replicated, not copied
    assert_same_osd(famp.unshard_optim_state(shards, layout), full)
    copies = [famp.shard_optim_state(full, layout, r, copy=True) for r in range(layout.world_size)]
    assert_same_osd(copies, shards)


@given(st.data())
def test_reshard_equals_shard_of_unshard(data: st.DataObject) -> None:
    params = data.draw(shapes())
    old, new = data.draw(layouts(params)), data.draw(layouts(params))
    full = data.draw(full_states(params))
    shards = [famp.shard_optim_state(full, old, r) for r in range(old.world_size)]
    expected = [famp.shard_optim_state(full, new, r) for r in range(new.world_size)]
    assert_same_osd(famp.reshard_optim_state(shards, old, new), expected)
    assert_same_osd(famp.reshard_optim_state(shards, old, new, copy=True), expected)


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_shards_on_dim_0_are_views_and_copies_own_compact_storage() -> None:
    full_m = torch.randn(7, 10)
    full = {
        "state": {"w": {"step": torch.tensor(1.0), "m": full_m}},
        "param_groups": [{"params": ["w"]}],
    }
    layout = famp.fsdp2_layout({"w": (7, 10)}, 3)
    for rank in range(3):
        view = famp.shard_optim_state(full, layout, rank)["state"]["w"]
        assert _shares_storage(view["m"], full_m)
        assert view["m"].is_contiguous()
        owned = famp.shard_optim_state(full, layout, rank, copy=True)["state"]["w"]
        assert not _shares_storage(owned["m"], full_m)
        assert owned["m"].untyped_storage().nbytes() == owned["m"].numel() * 4
        assert not _shares_storage(owned["step"], full["state"]["w"]["step"])
    # a shard on dim 1 cannot be a contiguous view: it is a compact copy
    dim1 = famp.fsdp2_layout({"w": (7, 10)}, 2, shard_dims={"w": 1})
    piece = famp.shard_optim_state(full, dim1, 1)["state"]["w"]["m"]
    assert piece.is_contiguous()
    assert not _shares_storage(piece, full_m)
    assert torch.equal(piece, full_m[:, 5:])


def test_reshard_cuts_views_from_old_shards_where_a_new_chunk_fits_in_one() -> None:
    full = {"state": {"w": {"m": torch.arange(12.0)}}, "param_groups": [{"params": ["w"]}]}
    old = famp.fsdp2_layout({"w": (12,)}, 2)  # [0, 6), [6, 12)
    new = famp.fsdp2_layout({"w": (12,)}, 4)  # [0, 3), [3, 6), [6, 9), [9, 12)
    shards = [famp.shard_optim_state(full, old, r, copy=True) for r in range(2)]
    for r, out in enumerate(famp.reshard_optim_state(shards, old, new)):
        assert _shares_storage(out["state"]["w"]["m"], shards[r // 2]["state"]["w"]["m"])
    for r, out in enumerate(famp.reshard_optim_state(shards, old, new, copy=True)):
        assert not _shares_storage(out["state"]["w"]["m"], shards[r // 2]["state"]["w"]["m"])
    back = famp.reshard_optim_state(famp.reshard_optim_state(shards, old, new), new, old)
    assert torch.equal(back[1]["state"]["w"]["m"], torch.arange(6.0, 12.0))  # spans two: a cat


def test_unshard_always_copies() -> None:
    full = {
        "state": {"w": {"step": torch.tensor(2.0), "m": torch.randn(5)}},
        "param_groups": [{"params": ["w"]}],
    }
    layout = famp.fsdp2_layout({"w": (5,)}, 1)
    shard = famp.shard_optim_state(full, layout, 0)
    back = famp.unshard_optim_state([shard], layout)
    for key in ("step", "m"):
        assert not _shares_storage(back["state"]["w"][key], full["state"]["w"][key])


# --- bad input: an error naming the parameter and key, nothing returned, input untouched --------

LAYOUT = famp.fsdp2_layout({"a": (5, 4), "b": (3,)}, 2)


def _full() -> dict[str, Any]:
    return {
        "state": {
            "a": {"step": torch.tensor(2.0), "exp_avg": torch.ones(5, 4)},
            "b": {"step": torch.tensor(2.0), "exp_avg": torch.ones(3)},
        },
        "param_groups": [{"lr": 0.1, "params": ["a"]}, {"lr": 0.2, "params": ["b"]}],
    }


def _shards() -> list[dict[str, Any]]:
    return [famp.shard_optim_state(_full(), LAYOUT, r, copy=True) for r in range(2)]


def _edit(tree: Any, path: tuple[Any, ...], value: Any) -> Any:
    tree = copy.deepcopy(tree)
    node = tree
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return tree


SHARD_CASES = [
    ("unknown parameter", ("state", "c"), {"exp_avg": torch.ones(1)}, KeyError, "'c'"),
    (
        "shape disagrees",
        ("state", "a", "exp_avg"),
        torch.ones(4, 5),
        ValueError,
        r"'a'.*'exp_avg'.*\(4, 5\)",
    ),
    ("not a dict", ("state", "a"), [1, 2], ValueError, r"\['a'\]"),
    (
        "non-tensor where others are tensors",
        ("state", "b", "exp_avg"),
        [1.0, 2.0, 3.0],
        ValueError,
        r"'b'.*'exp_avg'",
    ),
    (
        "0-d where others are shards",
        ("state", "b", "exp_avg"),
        torch.tensor(1.0),
        ValueError,
        r"'b'.*'exp_avg'",
    ),
    ("unknown name in a group", ("param_groups", 1, "params"), ["b", "z"], KeyError, "'z'"),
    (  # it was read as its letters, ["a", "b"]
        "params a str",
        ("param_groups", 1, "params"),
        "ab",
        ValueError,
        r"\['param_groups'\]\[1\] must be a dict with a 'params' list, got params='ab'",
    ),
    (
        "parameter in two groups",
        ("param_groups", 1, "params"),
        ["b", "a"],
        ValueError,
        "'a'.*groups 0 and 1",
    ),
    (
        "state outside every group",
        ("param_groups", 1, "params"),
        [],
        ValueError,
        r"'b'.*no param group",
    ),
    ("no param_groups", ("param_groups",), KeyError, KeyError, "param_groups"),
]


@pytest.mark.parametrize(
    ("path", "value", "error", "match"),
    [c[1:] for c in SHARD_CASES],
    ids=[c[0] for c in SHARD_CASES],
)
def test_shard_rejects_bad_full_state(
    path: Any, value: Any, error: type[Exception], match: str
) -> None:
    full = _edit(_full(), path, value)
    before = copy.deepcopy(full)
    with pytest.raises(error, match=match):
        famp.shard_optim_state(full, LAYOUT, 0)
    with pytest.raises(error, match=match):
        famp.optim_state_dict_to_load(full, LAYOUT, 0)
    assert_same_osd(full, before)


@pytest.mark.parametrize("where", ["a 0-d state", "a hyperparameter"])
def test_replicated_nans_of_a_diverged_run_round_trip(where: str) -> None:
    # A NaN on every rank (a diverged run's rank files) was refused as "differs from rank 0's":
    # replicated values are compared bit for bit, NaN equal to itself.
    full = _full()
    if where == "a 0-d state":
        full["state"]["a"]["mu"] = torch.tensor(float("nan"))
    else:
        full["param_groups"][0]["lr"] = float("nan")
    shards = [famp.shard_optim_state(full, LAYOUT, r, copy=True) for r in range(2)]
    assert_same_osd(famp.unshard_optim_state(shards, LAYOUT), full)
    wider = famp.fsdp2_layout({"a": (5, 4), "b": (3,)}, 3)
    expected = [famp.shard_optim_state(full, wider, r) for r in range(3)]
    for got, want in zip(famp.reshard_optim_state(shards, LAYOUT, wider), expected, strict=True):
        assert_same_osd(got, want)
    shards[1] = copy.deepcopy(shards[1])
    if where == "a 0-d state":  # a real difference is still one
        shards[1]["state"]["a"]["mu"] = torch.tensor(0.0)
    else:
        shards[1]["param_groups"][0]["lr"] = 0.1
    with pytest.raises(ValueError, match="differ"):
        famp.unshard_optim_state(shards, LAYOUT)


@pytest.mark.parametrize("rank", [-1, 2, 1.0, True])
def test_shard_rejects_a_rank_outside_the_world(rank: Any) -> None:
    error = ValueError if type(rank) is int else TypeError
    with pytest.raises(error, match=r"rank must be an int in \[0, 2\)"):
        famp.shard_optim_state(_full(), LAYOUT, rank)


UNSHARD_CASES = [
    ("missing shard", lambda s: s[:1], ValueError, "1 state dicts but the layout has world_size 2"),
    ("extra shard", lambda s: [*s, s[0]], ValueError, "3 state dicts"),
    ("not a list", lambda s: s[0], TypeError, "list of per-rank"),
    (
        "parameter missing on a rank",
        lambda s: [s[0], _edit(s[1], ("state", "b"), KeyError)],
        ValueError,
        "'b' has state on rank 0 but not on rank 1",
    ),
    ("unknown parameter", lambda s: [_edit(x, ("state", "z"), {}) for x in s], KeyError, "'z'"),
    (
        "wrong chunk shape",
        lambda s: [s[0], _edit(s[1], ("state", "a", "exp_avg"), torch.ones(3, 4))],
        ValueError,
        r"shards\[1\]\['state'\]\['a'\]\['exp_avg'\] has shape \(3, 4\).*\(2, 4\)",
    ),
    (
        "wrong chunk dtype",
        lambda s: [
            s[0],
            _edit(s[1], ("state", "a", "exp_avg"), torch.ones(2, 4, dtype=torch.float64)),
        ],
        ValueError,
        r"'a'.*'exp_avg'.*float64",
    ),
    (
        "non-tensor where rank 0 has a shard",
        lambda s: [s[0], _edit(s[1], ("state", "a", "exp_avg"), 1.0)],
        ValueError,
        r"'a'.*'exp_avg'.*float",
    ),
    (
        "step differs",
        lambda s: [s[0], _edit(s[1], ("state", "a", "step"), torch.tensor(3.0))],
        ValueError,
        r"'a'.*'step'.*replicated",
    ),
    (
        "state names differ",
        lambda s: [s[0], _edit(s[1], ("state", "a", "extra"), 1)],
        ValueError,
        r"state\['a'\] has keys",
    ),
    (
        "param_groups differ",
        lambda s: [s[0], _edit(s[1], ("param_groups", 0, "lr"), 0.5)],
        ValueError,
        r"shards\[1\]\['param_groups'\]",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "error", "match"), [c[1:] for c in UNSHARD_CASES], ids=[c[0] for c in UNSHARD_CASES]
)
def test_unshard_and_reshard_reject_bad_shards(
    mutate: Any, error: type[Exception], match: str
) -> None:
    shards = mutate(_shards())
    before = copy.deepcopy(shards)
    with pytest.raises(error, match=match):
        famp.unshard_optim_state(shards, LAYOUT)
    with pytest.raises(error, match=match):
        famp.reshard_optim_state(shards, LAYOUT, famp.fsdp2_layout({"a": (5, 4), "b": (3,)}, 3))
    assert_same_osd(shards, before)


def test_reshard_rejects_layouts_of_different_parameters() -> None:
    other = famp.fsdp2_layout({"a": (5, 4), "b": (4,)}, 3)
    with pytest.raises(ValueError, match=r"disagree on 'b': \(3,\) vs \(4,\)"):
        famp.reshard_optim_state(_shards(), LAYOUT, other)
    with pytest.raises(
        TypeError, match=r"new_layout must be a famp\.FSDP1Layout or famp\.FSDP2Layout"
    ):
        famp.reshard_optim_state(_shards(), LAYOUT, {"a": (5, 4)})  # type: ignore[arg-type]


def test_sparse_state_is_refused_naming_the_entry() -> None:
    """Issue 12: a sparse state tensor gave torch's NotImplementedError from deep inside."""
    full = _full()
    fqn = next(iter(full["state"]))
    key = next(k for k, v in full["state"][fqn].items() if isinstance(v, torch.Tensor) and v.dim())
    full["state"][fqn][key] = full["state"][fqn][key].to_sparse()
    match = rf"\['state'\]\['{fqn}'\]\['{key}'\] is a torch.sparse_coo tensor"
    with pytest.raises(TypeError, match=match):
        famp.shard_optim_state(full, LAYOUT, 0)
    with pytest.raises(TypeError, match=match):
        famp.optim_state_dict_to_load(full, LAYOUT, 0)
    with pytest.raises(TypeError, match=match):
        famp.unshard_optim_state([full, full], LAYOUT)
    with pytest.raises(TypeError, match=match):
        famp.reshard_optim_state([full, full], LAYOUT, LAYOUT)


def test_replicated_state_with_a_negative_bit_is_compared_by_value() -> None:
    # A negative view (one flipped byte of a saved file sets its bit) raised torch's "view is not
    # supported for tensors with negative bit set", naming nothing.
    shards = _shards()
    step = shards[1]["state"]["a"]["step"]
    shards[1]["state"]["a"]["step"] = (-step)._neg_view()  # the same value, its bit set
    assert shards[1]["state"]["a"]["step"].is_neg()
    assert_trees_bitwise_equal(
        famp.unshard_optim_state(shards, LAYOUT), famp.unshard_optim_state(_shards(), LAYOUT)
    )
    shards[1]["state"]["a"]["step"] = step.clone()._neg_view()  # another value
    match = r"shards\[1\]\['state'\]\['a'\]\['step'\] = tensor\(-.*differs from rank 0's"
    with pytest.raises(ValueError, match=match):
        famp.unshard_optim_state(shards, LAYOUT)


def test_replicated_state_on_the_meta_device_on_every_rank_is_refused_naming_it() -> None:
    # torch.equal has no meta kernel: aten::equal's NotImplementedError, naming nothing.
    shards = _shards()
    for shard in shards:
        shard["state"]["a"]["step"] = shard["state"]["a"]["step"].to("meta")
    match = r"shards\[0\]\['state'\]\['a'\]\['step'\] is on the meta device: it holds no values"
    with pytest.raises(ValueError, match=match):
        famp.unshard_optim_state(shards, LAYOUT)
    with pytest.raises(ValueError, match=match):
        famp.reshard_optim_state(shards, LAYOUT, LAYOUT)


@pytest.mark.parametrize("key", ["exp_avg", "step"])
def test_a_rank_state_on_another_device_is_refused_naming_the_entry(key: str) -> None:
    # Before 2026-12-01: unshard gave torch's unnamed device error (torch.cat) or aten::equal's
    # NotImplementedError, and reshard passed a chunk on the meta device into the new shards.
    shards = _shards()
    shards[1]["state"]["a"][key] = shards[1]["state"]["a"][key].to("meta")
    with pytest.raises(RuntimeError):  # torch itself, unnamed
        torch.cat([s["state"]["a"][key].reshape(-1) for s in shards])
    match = rf"shards\[1\]\['state'\]\['a'\]\['{key}'\] is on meta but rank 0's is on cpu"
    with pytest.raises(ValueError, match=match):
        famp.unshard_optim_state(shards, LAYOUT)
    with pytest.raises(ValueError, match=match):
        famp.reshard_optim_state(shards, LAYOUT, famp.fsdp2_layout({"a": (5, 4), "b": (3,)}, 3))
