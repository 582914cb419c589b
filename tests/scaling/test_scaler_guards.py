"""Opt-in guards (min_scale, max_scale, hysteresis), static scale, disabled state, bad input."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import hypothesis.strategies as st
import numpy as np
import optree
import pytest
import torch
from hypothesis import given

import famp
from tests.helpers import assert_bitwise_equal

F32, F64 = np.float32, np.float64


def guarded_model(
    scale: float, tracker: int, count: int, found: float, state: famp.ScalerState
) -> tuple[float, int, int]:
    """A scalar NumPy model of the documented guarded update (float32 state, float64 products)."""
    scale = F32(scale)
    if found != 0 or math.isnan(found):
        count, tracker = min(count + 1, state.hysteresis), 0
        if count >= state.hysteresis:
            backed = F32(F64(scale) * state.backoff_factor)
            if state.min_scale is not None:
                backed = max(backed, min(scale, F32(state.min_scale)))
            scale = backed
        return float(scale), tracker, count
    count, tracker = 0, tracker + 1
    if tracker == state.growth_interval:
        grown = F32(F64(scale) * state.growth_factor)
        if state.max_scale is not None:
            grown = min(grown, max(scale, F32(state.max_scale)))
        if np.isfinite(grown):
            scale = grown
        tracker = 0
    return float(scale), tracker, count


found_values = st.sampled_from([0.0, 0.0, 1.0, math.nan, -1.0])


@given(
    init_exp=st.integers(-10, 10),
    min_exp=st.one_of(st.none(), st.integers(-14, -10)),
    max_exp=st.one_of(st.none(), st.integers(10, 14)),
    hysteresis=st.integers(1, 4),
    gi=st.integers(1, 3),
    factors=st.sampled_from([(2.0, 0.5), (1.37, 0.77), (4.0, 0.125)]),
    found=st.lists(found_values, max_size=25),
)
def test_guarded_update_follows_the_documented_rule(
    init_exp: int,
    min_exp: int | None,
    max_exp: int | None,
    hysteresis: int,
    gi: int,
    factors: tuple[float, float],
    found: list[float],
) -> None:
    state = famp.init_scaler(
        2.0**init_exp,
        *factors,
        gi,
        min_scale=None if min_exp is None else 2.0**min_exp,
        max_scale=None if max_exp is None else 2.0**max_exp,
        hysteresis=hysteresis,
    )
    scale, tracker, count = 2.0**init_exp, 0, 0
    for f in found:
        state = famp.update_scale(state, torch.tensor(f))
        scale, tracker, count = guarded_model(scale, tracker, count, f, state)
        assert_bitwise_equal(state.scale, torch.tensor(scale, dtype=torch.float32))
        assert state.growth_tracker.item() == tracker
        if hysteresis > 1:
            assert state.overflow_count is not None
            assert state.overflow_count.dtype == torch.int32
            assert state.overflow_count.item() == count
        if min_exp is not None:
            assert state.scale.item() >= 2.0**min_exp  # finite, positive, floored
        if max_exp is not None:
            assert state.scale.item() <= 2.0**max_exp


def test_min_scale_stops_torchs_backoff_to_zero() -> None:
    found = torch.tensor(1.0)
    plain, floored = famp.init_scaler(1.0), famp.init_scaler(1.0, min_scale=2.0**-10)
    for _ in range(200):
        plain, floored = famp.update_scale(plain, found), famp.update_scale(floored, found)
    assert plain.scale.item() == 0.0  # torch's numbers: 150 backoffs reach 0.0
    assert floored.scale.item() == 2.0**-10


def test_max_scale_caps_growth() -> None:
    state = famp.init_scaler(8.0, growth_interval=1, max_scale=12.0)
    state = famp.update_scale(state, torch.tensor(0.0))
    assert state.scale.item() == 12.0
    state = famp.update_scale(state, torch.tensor(0.0))
    assert state.scale.item() == 12.0


def test_hysteresis_backs_off_from_the_nth_consecutive_overflow() -> None:
    state = famp.init_scaler(64.0, hysteresis=3)
    scales = []
    for f in [1, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1]:
        state = famp.update_scale(state, torch.tensor(float(f)))
        scales.append(state.scale.item())
    assert scales == [64, 64, 32, 16, 16, 16, 16, 16, 16, 16, 8]


def test_static_scale_never_changes() -> None:
    state = famp.init_scaler(128.0, dynamic=False)
    for f in [0.0, 1.0, math.nan]:
        assert famp.update_scale(state, torch.tensor(f)) is state
    grads, found = famp.unscale_and_check(state, [torch.tensor([256.0, math.inf])])
    assert grads[0][0].item() == 2.0
    assert found.item() == 1.0
    assert famp.scale(state, torch.tensor(1.0)).item() == 128.0


def test_disabled_state_makes_every_function_an_identity() -> None:
    state = famp.init_scaler(enabled=False)
    loss = torch.tensor(3.0, dtype=torch.float16)
    tree = {"w": torch.tensor([math.inf])}
    assert famp.scale(state, loss) is loss
    grads, found = famp.unscale_and_check(state, tree)
    assert grads is tree
    assert found.dtype == torch.float32
    assert found.shape == ()
    assert found.item() == 0.0
    assert famp.update_scale(state, torch.tensor(1.0)) is state
    assert famp.to_state_dict(state) == {}


BAD_INIT: list[tuple[dict[str, Any], type, str]] = [
    ({"init_scale": 0.0}, ValueError, "init_scale"),
    ({"init_scale": math.inf}, ValueError, "init_scale"),
    ({"init_scale": math.nan}, ValueError, "init_scale"),
    ({"init_scale": True}, TypeError, "init_scale must be an int or float, got bool True"),
    ({"init_scale": "2"}, TypeError, "init_scale"),
    ({"init_scale": 1e-46}, ValueError, "init_scale"),  # 0.0 in float32
    ({"init_scale": 1e-40}, ValueError, "init_scale"),  # its float32 reciprocal is inf
    ({"init_scale": 1e300}, ValueError, "init_scale"),  # torch.full raises RuntimeError
    ({"init_scale": 10**400}, ValueError, "init_scale must be finite"),  # float() overflows
    ({"growth_factor": 10**400}, ValueError, "growth_factor must be finite"),
    ({"growth_factor": None}, TypeError, "growth_factor"),
    ({"growth_factor": 1.0}, ValueError, "growth_factor must be a finite number > 1.0, got 1.0"),
    ({"growth_factor": math.inf}, ValueError, "growth_factor"),
    ({"backoff_factor": 1.0}, ValueError, "backoff_factor must be a number in (0, 1), got 1.0"),
    ({"backoff_factor": 0.0}, ValueError, "backoff_factor"),
    ({"growth_interval": 0}, ValueError, "growth_interval must be an int in [1, 2**31 - 1], got 0"),
    ({"growth_interval": 2.0}, TypeError, "growth_interval"),
    ({"growth_interval": True}, TypeError, "growth_interval"),
    ({"growth_interval": 2**31}, ValueError, "growth_interval"),
    ({"enabled": 1}, TypeError, "enabled must be a bool, got int 1"),
    ({"dynamic": None}, TypeError, "dynamic"),
    ({"min_scale": 0.0}, ValueError, "min_scale"),
    ({"min_scale": 1e-46, "init_scale": 1.0}, ValueError, "min_scale"),
    ({"max_scale": 10**400}, ValueError, "max_scale"),
    ({"max_scale": math.inf}, ValueError, "max_scale"),
    ({"min_scale": 4.0, "max_scale": 2.0, "init_scale": 3.0}, ValueError, "min_scale must be <="),
    ({"min_scale": 4.0, "init_scale": 2.0}, ValueError, "init_scale must be >= min_scale"),
    ({"max_scale": 4.0, "init_scale": 8.0}, ValueError, "init_scale must be <= max_scale"),
    ({"hysteresis": 0}, ValueError, "hysteresis must be an int in [1, 2**31 - 1], got 0"),
    ({"hysteresis": 2.0}, TypeError, "hysteresis"),
    ({"device": "bogus"}, ValueError, "device must name a torch device, got 'bogus'"),
    ({"device": 1.5}, TypeError, "device"),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), BAD_INIT)
def test_init_scaler_names_the_bad_argument(
    kwargs: dict[str, Any], error: type, message: str
) -> None:
    with pytest.raises(error) as info:
        famp.init_scaler(**kwargs)
    assert message in str(info.value)


def test_non_tensor_leaf_errors_name_the_path() -> None:
    state = famp.init_scaler()
    tree = {"a": [torch.ones(1), 2.0]}
    for fn in (
        lambda t: famp.scale(state, t),
        lambda t: famp.unscale_and_check(state, t),
        famp.all_finite,
        lambda t: famp.select_tree(torch.tensor(True), t, t),
    ):
        with pytest.raises(TypeError, match=r"tree\['a'\]\[1\]"):
            fn(tree)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta:UserWarning")
def test_unscale_and_check_rejects_integer_and_csr_grads() -> None:
    state = famp.init_scaler()
    with pytest.raises(TypeError, match=r"tree\['i'\].*torch.int32"):
        famp.unscale_and_check(state, {"i": torch.ones(2, dtype=torch.int32)})
    csr = torch.eye(2).to_sparse_csr()
    with pytest.raises(TypeError, match=r"tree\[0\] has layout torch.sparse_csr"):
        famp.unscale_and_check(state, [csr])


def test_update_scale_checks_found_inf() -> None:
    state = famp.init_scaler()
    with pytest.raises(TypeError, match=r"found_inf must be a Tensor, got float 1\.0"):
        famp.update_scale(state, 1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"exactly one element, got shape \(2,\)"):
        famp.update_scale(state, torch.zeros(2))
    for found in (torch.tensor([True]), torch.tensor(1, dtype=torch.int64), torch.tensor(1e-40)):
        assert famp.update_scale(state, found).scale.item() == 2.0**15


@pytest.mark.parametrize("guard", [{}, {"min_scale": 1.0}, {"hysteresis": 2}])
def test_update_scale_refuses_a_meta_found_inf_for_a_real_scale(guard: dict[str, Any]) -> None:
    state = famp.init_scaler(8.0, **guard)
    with pytest.raises(ValueError, match=r"found_inf is on the meta device .* scale is on cpu"):
        famp.update_scale(state, torch.zeros((), device="meta"))
    # A meta state (shapes only, as GradScaler makes one from a meta loss) takes any found_inf.
    meta = famp.init_scaler(8.0, device="meta", **guard)
    for found in (torch.zeros(()), torch.zeros(1, device="meta")):
        new = famp.update_scale(meta, found)
        for leaf, old in zip(optree.tree_leaves(new), optree.tree_leaves(meta), strict=True):
            assert (leaf.device.type, leaf.dtype, leaf.shape) == ("meta", old.dtype, old.shape)


def test_select_tree_checks_its_arguments() -> None:
    a = {"w": torch.ones(2)}
    with pytest.raises(TypeError, match=r"pred must be a torch\.bool tensor, got torch\.float32"):
        famp.select_tree(torch.tensor(1.0), a, a)
    with pytest.raises(ValueError, match="exactly one element"):
        famp.select_tree(torch.tensor([True, False]), a, a)
    with pytest.raises(ValueError, match="same structure"):
        famp.select_tree(torch.tensor(True), a, {"v": torch.ones(2)})
    with pytest.raises(TypeError, match=r"tree\['w'\] differ in dtype"):
        famp.select_tree(torch.tensor(True), a, {"w": torch.ones(2, dtype=torch.float64)})
    with pytest.raises(ValueError, match=r"tree\['w'\] differ in shape"):
        famp.select_tree(torch.tensor(True), a, {"w": torch.ones(3)})


def test_all_finite_of_an_empty_tree_is_true() -> None:
    ok = famp.all_finite({"a": [], "b": None})
    assert ok.dtype == torch.bool
    assert bool(ok)


def test_hysteresis_and_overflow_count_must_agree() -> None:
    scale, tracker = torch.tensor(1.0), torch.tensor(0, dtype=torch.int32)
    with pytest.raises(ValueError, match="overflow_count must be"):
        famp.ScalerState(scale=scale, growth_tracker=tracker, hysteresis=2)
    with pytest.raises(ValueError, match="overflow_count must be"):
        famp.ScalerState(scale=scale, growth_tracker=tracker, overflow_count=tracker)


def test_update_scale_refuses_a_non_state() -> None:
    with pytest.raises(TypeError, match=r"state must be a famp\.ScalerState, got NoneType"):
        famp.update_scale(None, torch.tensor(0.0))  # type: ignore[arg-type]


def test_scaler_state_checks_its_hyperparameters_as_init_scaler_does() -> None:
    """One validation path: the dataclass, init_scaler and from_state_dict share the checks."""
    scale, tracker = torch.tensor(1.0), torch.tensor(0, dtype=torch.int32)
    for kwargs in ({"growth_factor": 10**400}, {"min_scale": 1e-46}, {"growth_interval": 2.0}):
        with pytest.raises((TypeError, ValueError)) as info:
            famp.ScalerState(scale=scale, growth_tracker=tracker, **kwargs)
        with pytest.raises(info.type) as init_info:
            famp.init_scaler(**kwargs)
        assert str(info.value) == str(init_info.value)


@pytest.mark.parametrize(
    ("field", "leaf"),
    [
        ("scale", torch.tensor(1024)),  # int64: torch.tensor of an int
        ("scale", torch.tensor(1024.0, dtype=torch.float64)),
        ("scale", torch.tensor(1024.0, dtype=torch.float16)),
        ("growth_tracker", torch.tensor(0)),
        ("growth_tracker", torch.tensor(0.0)),
        ("overflow_count", torch.tensor(0)),
    ],
)
def test_a_state_leaf_of_another_dtype_is_refused_when_the_state_is_built(
    field: str, leaf: torch.Tensor
) -> None:
    """`dataclasses.replace(state, scale=torch.tensor(...))`, famp's `update(new_scale=...)`:
    GradScaler copies any new scale into its float32 one; famp's leaves must already have the
    dtypes torch's update kernel takes. Before, such a state scaled and unscaled (a float64 scale
    even promoted the loss) and only the first update_scale failed, with torch's message."""
    state = famp.init_scaler(2.0**10, growth_interval=1, hysteresis=2)
    with pytest.raises(TypeError, match=rf"ScalerState\.{field} must be a torch\.(float|int)32"):
        dataclasses.replace(state, **{field: leaf})
    # GradScaler takes a scale of any dtype as float32; so does famp, given in float32.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    scaler.scale(torch.ones(()))
    scaler.update(new_scale=torch.tensor(512))
    state = dataclasses.replace(state, scale=torch.tensor(512, dtype=torch.float32))
    assert_bitwise_equal(state.scale, scaler._scale)
    assert_bitwise_equal(famp.update_scale(state, torch.tensor(0.0)).scale, torch.tensor(1024.0))


def test_sharded_grad_scaler_updates_otherwise_on_the_cpu_famp_keeps_gradscalers_numbers() -> None:
    """On the CPU, ShardedGradScaler.update runs float32 Python ops instead of torch's kernel:
    it multiplies by float32(factor), not f32(f64(scale) * factor), and grows a scale past
    float32's maximum to inf (then every step is skipped and the scale stays inf). famp is
    GradScaler's kernel there as everywhere (docs/loss-scaling.md, Sharded gradients)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    for init, factor, expected_sharded in (
        (0.1, 1.1, 0.11000000685453415),
        (2.0**127, 2.0, math.inf),
    ):
        sharded = ShardedGradScaler("cpu", init_scale=init, growth_factor=factor, growth_interval=1)
        sharded._lazy_init_scale_growth_tracker(torch.device("cpu"))
        sharded._amp_update_scale_cpu_(torch.zeros(1))  # what update() runs on the CPU
        scale, tracker = torch.tensor(init), torch.tensor(0, dtype=torch.int32)
        torch._amp_update_scale_(scale, tracker, torch.zeros(()), factor, 0.5, 1)  # GradScaler's
        state = famp.update_scale(
            famp.init_scaler(init, factor, growth_interval=1), torch.zeros(())
        )
        assert_bitwise_equal(state.scale, scale)
        assert sharded._scale.item() == expected_sharded != scale.item()
    with pytest.raises(ValueError, match="'scale'"):  # and famp does not resume from it
        famp.from_state_dict({**famp.to_state_dict(famp.init_scaler()), "scale": math.inf})


def test_scaler_state_takes_the_leaves_pytree_utilities_and_vmap_rebuild_it_with() -> None:
    """Why ScalerState checks no leaf types or shapes (its docstring's contract): a tree_map to
    None, vmap's in_dims prefix of ints, and a batch of states out of vmap all rebuild one; the
    batch equals torch's update kernel applied per sample."""
    state = famp.init_scaler(1024.0, growth_interval=1)
    assert optree.tree_map(lambda t: None, state, none_is_leaf=True).scale is None
    in_dims = famp.ScalerState(scale=0, growth_tracker=0, growth_interval=1)  # type: ignore[arg-type]
    scales = torch.tensor([8.0, 16.0])
    batch = famp.ScalerState(
        scale=scales, growth_tracker=torch.zeros(2, dtype=torch.int32), growth_interval=1
    )
    found = torch.tensor([0.0, 1.0])
    out = torch.func.vmap(famp.update_scale, in_dims=(in_dims, 0))(batch, found)
    for i in range(2):
        scale, tracker = scales[i].clone(), torch.zeros((), dtype=torch.int32)
        torch._amp_update_scale_(scale, tracker, found[i], 2.0, 0.5, 1)
        assert_bitwise_equal(out.scale[i], scale)
        assert_bitwise_equal(out.growth_tracker[i], tracker)
