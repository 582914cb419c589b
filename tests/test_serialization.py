"""to_state_dict / from_state_dict: GradScaler's format, validated, atomic, both-way interop."""

from __future__ import annotations

import io
import json
import math
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given

import famp
from tests.helpers import assert_bitwise_equal

KEYS = ["scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"]


def gradscaler_step(scaler: torch.amp.GradScaler, found_inf: float) -> None:
    """One real GradScaler update with a given found_inf (what unscale_ would have recorded)."""
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler.scale(torch.ones(()))  # lazy init of _scale on the CPU
    param.grad = torch.tensor([found_inf, 1.0]) * scaler._scale
    scaler.unscale_(opt)
    scaler.update()


def assert_same_state(state: famp.ScalerState, scaler: torch.amp.GradScaler) -> None:
    assert_bitwise_equal(state.scale, scaler._scale)
    assert_bitwise_equal(state.growth_tracker, scaler._growth_tracker)
    assert famp.to_state_dict(state) == scaler.state_dict()


def test_to_state_dict_has_gradscalers_keys_and_types() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=3.0, growth_factor=1.5, growth_interval=7)
    scaler.scale(torch.ones(()))
    expected = scaler.state_dict()
    d = famp.to_state_dict(famp.init_scaler(3.0, 1.5, growth_interval=7))
    assert list(d) == list(expected) == KEYS
    assert d == expected
    assert [type(v) for v in d.values()] == [type(v) for v in expected.values()]
    assert [type(v) for v in d.values()] == [float, float, float, int, int]


def test_disabled_state_serializes_as_empty_dict_like_torch() -> None:
    assert famp.to_state_dict(famp.init_scaler(enabled=False)) == {}
    assert torch.amp.GradScaler("cpu", enabled=False).state_dict() == {}
    restored = famp.from_state_dict({})
    assert restored.enabled is False


found_infs = st.lists(st.sampled_from([0.0, 0.0, 0.0, math.inf, math.nan]), max_size=12)
hyper = st.tuples(
    st.sampled_from([2.0**16, 3.0, 1.0e-3, 7.5]),
    st.sampled_from([2.0, 1.37, 4.0]),
    st.sampled_from([0.5, 0.77, 0.25]),
    st.integers(1, 4),
)


@given(hyper=hyper, before=found_infs, after=found_infs)
def test_gradscaler_to_famp_continues_identically(
    hyper: tuple[float, float, float, int], before: list[float], after: list[float]
) -> None:
    init, gf, bf, gi = hyper
    scaler = torch.amp.GradScaler("cpu", init, gf, bf, gi)
    for f in before:
        gradscaler_step(scaler, f)
    state = famp.from_state_dict(scaler.state_dict())
    for f in after:
        gradscaler_step(scaler, f)
        state = famp.update_scale(state, torch.tensor(float(not math.isfinite(f))))
        assert_same_state(state, scaler)


@given(hyper=hyper, before=found_infs, after=found_infs)
def test_famp_to_gradscaler_continues_identically(
    hyper: tuple[float, float, float, int], before: list[float], after: list[float]
) -> None:
    init, gf, bf, gi = hyper
    state = famp.init_scaler(init, gf, bf, gi)
    for f in before:
        state = famp.update_scale(state, torch.tensor(float(not math.isfinite(f))))
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict(famp.to_state_dict(state))
    for f in after:
        gradscaler_step(scaler, f)
        state = famp.update_scale(state, torch.tensor(float(not math.isfinite(f))))
        assert_same_state(state, scaler)


def _roundtrip_json(d: dict[str, Any]) -> Any:
    return json.loads(json.dumps(d))


def _roundtrip_weights_only(d: dict[str, Any]) -> Any:
    buffer = io.BytesIO()
    torch.save(d, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("roundtrip", [_roundtrip_json, _roundtrip_weights_only])
@given(
    scale_value=st.floats(2.0**-126, 2.0**127, width=32),
    tracker=st.integers(0, 2**31 - 1),
    growth_interval=st.integers(1, 2**31 - 1),
    gf=st.floats(1.0, 1e6, exclude_min=True),
    bf=st.floats(0.0, 1.0, exclude_min=True, exclude_max=True),
)
def test_state_dict_round_trips_exactly(
    roundtrip: Any, scale_value: float, tracker: int, growth_interval: int, gf: float, bf: float
) -> None:
    state = famp.ScalerState(
        scale=torch.tensor(scale_value),
        growth_tracker=torch.tensor(tracker, dtype=torch.int32),
        growth_factor=gf,
        backoff_factor=bf,
        growth_interval=growth_interval,
    )
    d = roundtrip(famp.to_state_dict(state))
    assert d == famp.to_state_dict(state)
    restored = famp.from_state_dict(d)
    assert_bitwise_equal(restored.scale, state.scale)
    assert_bitwise_equal(restored.growth_tracker, state.growth_tracker)
    assert (restored.growth_factor, restored.backoff_factor, restored.growth_interval) == (
        gf,
        bf,
        growth_interval,
    )


def test_from_state_dict_takes_famp_only_settings() -> None:
    d = famp.to_state_dict(famp.init_scaler(8.0))
    state = famp.from_state_dict(d, dynamic=False, min_scale=1.0, max_scale=16.0, hysteresis=3)
    assert (state.dynamic, state.min_scale, state.max_scale, state.hysteresis) == (
        False,
        1.0,
        16.0,
        3,
    )
    assert state.overflow_count is not None
    assert state.overflow_count.dtype == torch.int32


GOOD = {
    "scale": 1024.0,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 10,
    "_growth_tracker": 3,
}

BAD = [  # (the dict, the error type, a fragment the message must contain)
    ([("scale", 1.0)], TypeError, "must be a dict"),
    ({k: v for k, v in GOOD.items() if k != "_growth_tracker"}, KeyError, "_growth_tracker"),
    ({**GOOD, "extra": 1}, KeyError, "extra"),
    ({**GOOD, 3: 1}, KeyError, "3"),
    ({**GOOD, "scale": "1024"}, TypeError, "'scale'"),
    ({**GOOD, "scale": True}, TypeError, "'scale'"),
    ({**GOOD, "scale": torch.tensor(1024.0)}, TypeError, "'scale'"),
    ({**GOOD, "scale": math.inf}, ValueError, "'scale'"),
    ({**GOOD, "scale": math.nan}, ValueError, "'scale'"),
    ({**GOOD, "scale": 0.0}, ValueError, "'scale'"),
    ({**GOOD, "scale": -1.0}, ValueError, "'scale'"),
    ({**GOOD, "scale": 1e39}, ValueError, "'scale'"),
    ({**GOOD, "growth_factor": 1.0}, ValueError, "'growth_factor'"),
    ({**GOOD, "growth_factor": math.nan}, ValueError, "'growth_factor'"),
    ({**GOOD, "backoff_factor": 1.0}, ValueError, "'backoff_factor'"),
    ({**GOOD, "backoff_factor": 0.0}, ValueError, "'backoff_factor'"),
    ({**GOOD, "backoff_factor": math.nan}, ValueError, "'backoff_factor'"),
    ({**GOOD, "growth_interval": 0}, ValueError, "'growth_interval'"),
    ({**GOOD, "growth_interval": 10.0}, TypeError, "'growth_interval'"),
    ({**GOOD, "growth_interval": True}, TypeError, "'growth_interval'"),
    ({**GOOD, "growth_interval": 2**31}, ValueError, "'growth_interval'"),
    ({**GOOD, "_growth_tracker": -1}, ValueError, "'_growth_tracker'"),
    ({**GOOD, "_growth_tracker": False}, TypeError, "'_growth_tracker'"),
    ({**GOOD, "_growth_tracker": 2**31}, ValueError, "'_growth_tracker'"),
]


@pytest.mark.parametrize(("d", "error", "fragment"), BAD)
def test_from_state_dict_refuses_bad_dicts_whole(d: Any, error: type, fragment: str) -> None:
    with pytest.raises(error, match=None) as info:
        famp.from_state_dict(d)
    assert fragment in str(info.value)
    assert famp.from_state_dict(GOOD).growth_interval == 10  # the good dict still loads


def test_gradscaler_half_loads_what_famp_refuses() -> None:
    # The footgun famp's atomic loading removes: torch applies 'scale' before the KeyError.
    partial = {"scale": 8.0, "growth_factor": 2.0}
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with pytest.raises(KeyError):
        scaler.load_state_dict(partial)
    assert scaler.get_scale() == 8.0
    with pytest.raises(KeyError, match="backoff_factor"):
        famp.from_state_dict(partial)


def test_to_state_dict_rejects_non_state() -> None:
    with pytest.raises(TypeError, match=r"famp\.ScalerState"):
        famp.to_state_dict({"scale": 1.0})  # type: ignore[arg-type]
