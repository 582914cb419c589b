"""optim_state_dict_to_load over random layouts: what each rank's optimizer holds, and loading it.

FSDP1's own ``optim_state_dict_to_load`` is the oracle in test_fsdp_real.py (2 and 3 ranks) and
test_fsdp_layout.py (real flat parameters up to 8 ranks); here the rank pieces must tile the full
state for any shapes, world sizes and dtypes, and a torch optimizer must accept them.
"""

from __future__ import annotations

import copy
import operator
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given

import famp
from tests.fsdp.fsdp_helpers import assert_same_osd, full_states, layouts, shapes


def _is_shard(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _model(params: dict[str, torch.nn.Parameter]) -> torch.nn.Module:
    """A module whose ``named_parameters()`` are exactly ``params`` (the same tensors)."""
    root = torch.nn.Module()
    for fqn, param in params.items():
        *path, leaf = fqn.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, param)
    return root


def _load(
    to_load: dict[str, Any],
    shapes_by_id: dict[int, tuple[int, ...]],
    osd: Any,
    layout: Any,
    rank: int,
) -> None:
    """A torch optimizer over tensors of these shapes accepts ``to_load`` and holds it exactly."""
    dtypes = {v.dtype for e in to_load["state"].values() for v in e.values() if _is_shard(v)}
    dtype = dtypes.pop() if dtypes else torch.float32  # loading casts state to the params dtype
    tensors = {i: torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for i, s in shapes_by_id.items()}
    groups = [
        {"params": [tensors[i] for i in g["params"]]}
        | {k: v for k, v in g.items() if k != "params"}
        for g in to_load["param_groups"]
    ]
    optim = torch.optim.SGD(groups, lr=0.1)  # keeps any state; Adam insists on "step"
    flat = isinstance(layout, famp.FSDP1Layout) and not layout.use_orig_params
    if not flat:  # the optimizer's parameters, named as in osd (ids in osd's order)
        names = [f for g in osd["param_groups"] for f in g["params"]]
        model = _model({names[i]: p for i, p in tensors.items()})
        # famp checks the optimizer's shapes and matches its parameters by name
        assert_same_osd(
            famp.optim_state_dict_to_load(osd, layout, rank, optim, model=model), to_load
        )
        # and reversed within every group, the same parameters get the same state by name
        rev = torch.optim.SGD([{**g, "params": g["params"][::-1]} for g in groups], lr=0.1)
        rev_load = famp.optim_state_dict_to_load(osd, layout, rank, rev, model=model)
        rev_ids = {id(p): i for i, p in enumerate(p for g in rev.param_groups for p in g["params"])}
        by_param = {id(tensors[i]): e for i, e in to_load["state"].items()}
        assert_same_osd(rev_load["state"], {rev_ids[k]: e for k, e in by_param.items()})
    try:  # without the model, ids follow osd's order, unless two parameters look alike
        positional = famp.optim_state_dict_to_load(osd, layout, rank, optim)
    except ValueError as err:
        message = str(err)
    else:
        message = ""
        assert_same_osd(positional, to_load)
    assert not message or "pass model= to match them by name" in message
    optim.load_state_dict(to_load)
    loaded = optim.state_dict()
    assert_same_osd(loaded["state"], to_load["state"])
    for got, want in zip(loaded["param_groups"], to_load["param_groups"], strict=True):
        assert got == got | want  # the loaded hyperparameters and ids, plus SGD defaults


@given(st.data())
def test_per_parameter_to_load_tiles_the_full_state(data: st.DataObject) -> None:
    """FSDP2 chunks and FSDP1 use_orig_params=True slices, ids in param-group order."""
    params = data.draw(shapes())
    layout = data.draw(layouts(params).filter(lambda lay: getattr(lay, "use_orig_params", True)))
    full = data.draw(full_states(params))
    ids = {f: i for i, f in enumerate(f for g in full["param_groups"] for f in g["params"])}
    slices: dict[str, list[dict[str, Any]]] = {f: [] for f in full["state"]}
    for rank in range(layout.world_size):
        to_load = famp.optim_state_dict_to_load(full, layout, rank)
        assert [g["params"] for g in to_load["param_groups"]] == [
            [ids[f] for f in g["params"]] for g in full["param_groups"]
        ]
        assert [g["lr"] for g in to_load["param_groups"]] == [0.1, 0.01]
        assert set(to_load["state"]) <= {ids[f] for f in full["state"]}
        for fqn in full["state"]:
            if ids[fqn] in to_load["state"]:
                slices[fqn].append(to_load["state"][ids[fqn]])
        if isinstance(layout, famp.FSDP2Layout):  # every parameter's chunk, even empty ones
            shard = famp.shard_optim_state(full, layout, rank, copy=True)
            assert_same_osd(to_load["state"], {ids[f]: e for f, e in shard["state"].items()})
            # a rank can load from its own shard, without the full state
            assert_same_osd(famp.optim_state_dict_to_load(shard, layout, rank), to_load)
            local = {ids[f]: layout.local_shape(f, rank) for f in ids}
        elif layout.world_size == 1:  # FSDP1 runs NO_SHARD: original shapes
            local = {ids[f]: layout.shapes[layout.fqns.index(f)] for f in ids}
        else:  # 1-D slices; a parameter outside the shard is empty and has no state
            local = {ids[f]: (-operator.sub(*layout.param_slice(f, rank)),) for f in ids}
        _load(to_load, local, full, layout, rank)
    if isinstance(layout, famp.FSDP1Layout):
        for fqn, entry in full["state"].items():
            assert slices[fqn], fqn  # every element lies on some rank
            for key, value in entry.items():
                if _is_shard(value):
                    joined = torch.cat([s[key].reshape(-1) for s in slices[fqn]])
                    assert_same_osd(joined, value.reshape(-1))
                else:
                    assert all(s[key] == value for s in slices[fqn])


@given(st.data())
def test_flat_to_load_tiles_each_unit_with_zero_padding(data: st.DataObject) -> None:
    """FSDP1 use_orig_params=False: one flat state per unit, parameters without state as zeros."""
    params = data.draw(shapes())
    layout = data.draw(
        layouts(params).filter(lambda lay: not getattr(lay, "use_orig_params", True))
    )
    full = data.draw(full_states(params))
    # a unit's parameters share one param group (FSDP1 requires it); units in layout order
    full["param_groups"] = [{"lr": 0.1, "params": list(layout.fqns)}]
    for entry in full["state"].values():  # one "step" per unit, as FSDP1 requires
        entry["step"] = torch.tensor(4.0)
        if any(f not in full["state"] for f in layout.fqns):  # and none when one lacks state
            del entry["step"], entry["count"]
    pieces = [famp.optim_state_dict_to_load(full, layout, r) for r in range(layout.world_size)]
    for u, unit in enumerate(layout.units):
        names = [f for f, _ in unit]
        with_state = [f for f in names if f in full["state"]]
        for rank, piece in enumerate(pieces):
            assert piece["param_groups"][0]["params"] == list(range(len(layout.units)))
            assert (u in piece["state"]) == bool(with_state)
            _load(
                piece,
                {i: (layout.flat_numel(i),) for i in range(len(layout.units))},
                full,
                layout,
                rank,
            )
        if not with_state:
            continue
        for key in ("exp_avg", "exp_avg_sq"):
            dtype = full["state"][with_state[0]][key].dtype
            expected = torch.cat(
                [
                    full["state"][f][key].reshape(-1)
                    if f in full["state"]
                    else torch.zeros(shape, dtype=dtype).reshape(-1)
                    for f, shape in unit
                ]
            )
            flat = torch.cat([piece["state"][u][key] for piece in pieces])
            assert flat.numel() == layout.flat_numel(u) * layout.world_size
            assert_same_osd(flat[: expected.numel()], expected)
            assert not flat[expected.numel() :].any()  # zero padding at the end


def test_to_load_copies_by_default_and_views_on_request() -> None:
    full_m = torch.randn(7, 3)
    full = {
        "state": {"w": {"step": torch.tensor(1.0), "m": full_m}},
        "param_groups": [{"params": ["w"]}],
    }
    for layout in (famp.fsdp2_layout({"w": (7, 3)}, 2), famp.fsdp1_layout([{"w": (7, 3)}], 2)):
        owned = famp.optim_state_dict_to_load(full, layout, 1)["state"][0]
        view = famp.optim_state_dict_to_load(full, layout, 1, copy=False)["state"][0]
        assert owned["m"].untyped_storage().data_ptr() != full_m.untyped_storage().data_ptr()
        assert owned["step"] is not full["state"]["w"]["step"]
        assert view["m"].untyped_storage().data_ptr() == full_m.untyped_storage().data_ptr()
        assert_same_osd(owned, view)


LAYOUT = famp.fsdp1_layout([{"a": (5, 4), "b": (3,)}, {"c": (2,)}], 2, use_orig_params=False)


def _full() -> dict[str, Any]:
    return {
        "state": {
            n: {"step": torch.tensor(2.0), "exp_avg": torch.ones(s)}
            for n, s in [("a", (5, 4)), ("b", (3,)), ("c", (2,))]
        },
        "param_groups": [{"lr": 0.1, "params": ["a", "b"]}, {"lr": 0.2, "params": ["c"]}],
    }


def _optim(*numels: int) -> torch.optim.Optimizer:
    return torch.optim.Adam([{"params": [torch.zeros(n)]} for n in numels])


BAD = [
    (
        "optimizer has another group count",
        lambda f: (f, _optim(12)),
        ValueError,
        "1 param groups but osd.*2",
    ),
    (
        "optimizer param of the wrong size",
        lambda f: (f, _optim(12, 2)),
        ValueError,
        r"FSDP unit 1 on rank 0 has shape \(2,\), expected \(1,\)",
    ),
    (
        "unit split over two groups",
        lambda f: ({**f, "param_groups": [{"params": ["a"]}, {"params": ["b", "c"]}]}, None),
        ValueError,
        "FSDP unit 0 has parameters in two param groups",
    ),
    (
        "differing state names in a unit",
        lambda f: ({**f, "state": {**f["state"], "b": {"exp_avg": torch.ones(3)}}}, None),
        ValueError,
        r"state\['b'\] has keys",
    ),
    (
        "differing step in a unit",
        lambda f: (
            {
                **f,
                "state": {**f["state"], "b": {"step": torch.tensor(3.0), "exp_avg": torch.ones(3)}},
            },
            None,
        ),
        ValueError,
        r"'b'.*'step'.*FSDP unit 0",
    ),
    (
        "step missing for a parameter",
        lambda f: ({**f, "state": {k: v for k, v in f["state"].items() if k != "b"}}, None),
        ValueError,
        r"'step'.*missing for \['b'\]",
    ),
    (
        "differing dtypes in a unit",
        lambda f: (
            {
                **f,
                "state": {
                    **f["state"],
                    "b": {"step": torch.tensor(2.0), "exp_avg": torch.ones(3, dtype=torch.float64)},
                },
            },
            None,
        ),
        ValueError,
        r"'b'.*'exp_avg'.*float64",
    ),
    ("not an optimizer", lambda f: (f, object()), TypeError, "optimizer must be"),
]


@pytest.mark.parametrize(("make", "error", "match"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_to_load_rejects_bad_input(make: Any, error: type[Exception], match: str) -> None:
    osd, optim = make(_full())
    before = copy.deepcopy(osd)
    with pytest.raises(error, match=match):
        famp.optim_state_dict_to_load(osd, LAYOUT, 0, optim)
    assert_same_osd(osd, before)


def test_to_load_rejects_a_rank_outside_the_world() -> None:
    with pytest.raises(ValueError, match="rank"):
        famp.optim_state_dict_to_load(_full(), LAYOUT, 2)


def test_to_load_refuses_a_non_layout_a_non_optimizer_and_a_non_int_rank() -> None:
    layout = famp.fsdp2_layout({"w": (3, 2)}, 2)
    osd = {"state": {"w": {"m": torch.ones(3, 2)}}, "param_groups": [{"params": ["w"]}]}
    with pytest.raises(TypeError, match=r"layout must be a famp\.FSDP1Layout or famp\.FSDP2Layout"):
        famp.optim_state_dict_to_load(osd, {"w": (3, 2)}, 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"optimizer must be a torch\.optim\.Optimizer, got dict"):
        famp.optim_state_dict_to_load(osd, layout, 0, {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"rank must be an int in \[0, 2\), got str '0'"):
        famp.optim_state_dict_to_load(osd, layout, "0")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"rank must be an int in \[0, 2\), got 2"):
        famp.optim_state_dict_to_load(osd, layout, 2)
    plain = torch.optim.SGD([torch.zeros(3, 2)], lr=0.1)  # the global shape, not rank 0's (2, 2)
    with pytest.raises(ValueError, match=r"parameter for 'w' on rank 0 has shape \(3, 2\)"):
        famp.optim_state_dict_to_load(osd, layout, 0, plain)


def _two_layers() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))


def _weights_then_biases(model: torch.nn.Module, reverse: bool) -> torch.optim.Optimizer:
    step = -1 if reverse else 1
    return torch.optim.AdamW(
        [
            {"params": [model[0].weight, model[1].weight][::step], "weight_decay": 0.1},
            {"params": [model[0].bias, model[1].bias][::step], "weight_decay": 0.0},
        ],
        lr=1e-2,
    )


def test_to_load_matches_names_as_dcp_does_when_the_optimizer_lists_them_in_another_order() -> None:
    """DCP's set_optimizer_state_dict maps by name; famp with model= too, and without refuses."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    model = _two_layers()
    optim = _weights_then_biases(model, reverse=False)
    model(torch.randn(4, 3)).square().sum().backward()
    optim.step()
    full = get_optimizer_state_dict(model, optim, options=options)
    by_dcp = _two_layers()
    dcp_optim = _weights_then_biases(by_dcp, reverse=True)
    set_optimizer_state_dict(by_dcp, dcp_optim, full, options=options)
    by_famp = _two_layers()
    famp_optim = _weights_then_biases(by_famp, reverse=True)
    layout = famp.fsdp2_layout({n: p.shape for n, p in by_famp.named_parameters()}, 1)
    before = copy.deepcopy(full)
    with pytest.raises(ValueError, match=r"lists '0\.weight' and '1\.weight'.*pass model="):
        famp.optim_state_dict_to_load(full, layout, 0, famp_optim)
    famp_optim.load_state_dict(
        famp.optim_state_dict_to_load(full, layout, 0, famp_optim, model=by_famp)
    )
    ours, theirs = famp_optim.state_dict(), dcp_optim.state_dict()
    assert_same_osd(ours["state"], theirs["state"])  # (DCP turns betas into a list)
    assert [g["params"] for g in ours["param_groups"]] == [[0, 1], [2, 3]]
    assert [g["params"] for g in theirs["param_groups"]] == [[0, 1], [2, 3]]
    for name, param in by_famp.named_parameters():  # each parameter got its own saved state
        assert_same_osd(famp_optim.state[param]["exp_avg"], full["state"][name]["exp_avg"])
    assert_same_osd(full, before)
    # groups in another order: DCP moves hyperparameters with the names; famp refuses, naming one
    swapped = torch.optim.AdamW([famp_optim.param_groups[1], famp_optim.param_groups[0]])
    with pytest.raises(ValueError, match=r"lists '0\.weight', but the optimizer has it in group 1"):
        famp.optim_state_dict_to_load(full, layout, 0, swapped, model=by_famp)
    with pytest.raises(ValueError, match="pass optimizer too"):
        famp.optim_state_dict_to_load(full, layout, 0, model=by_famp)
