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
    ({**GOOD, "_overflow_count": None}, TypeError, "'_overflow_count' must be an int, got None"),
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
    ({**GOOD, "_growth_tracker": -(2**31) - 1}, ValueError, "'_growth_tracker'"),
    ({**GOOD, "_growth_tracker": False}, TypeError, "'_growth_tracker'"),
    ({**GOOD, "_growth_tracker": 2**31}, ValueError, "'_growth_tracker'"),
    # item 1 of issue 12: scales that float32 turns into 0.0, or whose reciprocal is inf
    ({**GOOD, "scale": 1e-46}, ValueError, "'scale'"),
    ({**GOOD, "scale": 1e-40}, ValueError, "'scale'"),
    ({**GOOD, "scale": 3.4028235e38}, ValueError, "'scale'"),  # above float32's max: torch refuses
    # item 4: ints beyond the float range are ValueErrors, not OverflowErrors
    ({**GOOD, "scale": 10**400}, ValueError, "'scale' must be finite"),
    ({**GOOD, "growth_factor": 10**400}, ValueError, "'growth_factor' must be finite"),
    ({**GOOD, "backoff_factor": -(10**400)}, ValueError, "'backoff_factor'"),
    ({**GOOD, "growth_factor": "2"}, TypeError, "'growth_factor'"),
    ({**GOOD, "_overflow_count": 0}, ValueError, "'_overflow_count' is only kept with hysteresis"),
    ({**GOOD, "_overflows": 0}, KeyError, "_overflows"),
]


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"hysteresis": 0}, ValueError, "hysteresis must be an int in [1, 2**31 - 1], got 0"),
        ({"min_scale": "x"}, TypeError, "min_scale must be an int or float"),
        ({"max_scale": -1.0}, ValueError, "max_scale must be None or a number"),
        ({"min_scale": 4.0, "max_scale": 2.0}, ValueError, "min_scale must be <= max_scale"),
        ({"dynamic": "no"}, TypeError, "dynamic must be a bool"),
    ],
)
def test_the_empty_dict_checks_the_famp_only_settings_as_init_scaler_does(
    kwargs: dict[str, Any], error: type, fragment: str
) -> None:
    """`{}` (a disabled GradScaler's or famp state's dict) with bad keyword arguments is refused
    as `init_scaler(enabled=False, ...)` refuses them; before, they were dropped unchecked."""
    for build in (
        lambda: famp.from_state_dict({}, **kwargs),
        lambda: famp.from_state_dict(
            torch.amp.GradScaler("cpu", enabled=False).state_dict(), **kwargs
        ),
        lambda: famp.init_scaler(enabled=False, **kwargs),
    ):
        with pytest.raises(error) as info:
            build()
        assert fragment in str(info.value)
    assert famp.from_state_dict({}, min_scale=4.0, hysteresis=2).enabled is False  # valid: kept out


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


# --- issue 12: scales that break training, huge numbers, wrapped trackers, hysteresis resume ------

any_number = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(0.0, 1e-36),  # the float32 subnormal range and below, densely
    st.floats(1e37, 1e39),  # around float32's maximum
    st.integers(-(10**400), 10**400),
    st.sampled_from([1e-46, 1e-40, 2.0**-128, 2.0**-128 + 2.0**-149, 3.4028235e38, 10**400]),
)


def _torch_float32(value: float | int) -> torch.Tensor | None:
    """The float32 scale torch makes of `value` (`torch.full`, as `GradScaler` builds and loads
    its scale); None where it is refused: a double above float32's maximum, which torch refuses,
    and an int above it, which famp refuses alike.

    torch's bindings read no int beyond int64, and famp reads those too. Such an int is first
    shortened to its top 62 bits with every lower bit folded into the last one (rounding to
    nearest, ties to even, sees the same digits), torch rounds that to float32, and `ldexp`
    scales it back by the power of two that was cut off.
    """
    if isinstance(value, int) and not -(2**63) <= value < 2**63:
        if value > torch.finfo(torch.float32).max:
            return None
        magnitude = abs(value)
        shift = magnitude.bit_length() - 62
        short = (magnitude >> shift) | (1 if magnitude & ((1 << shift) - 1) else 0)
        rounded = torch.full((), short if value > 0 else -short, dtype=torch.float32)
        return torch.ldexp(rounded, torch.tensor(shift))
    try:
        return torch.full((), value, dtype=torch.float32)
    except (RuntimeError, OverflowError):  # torch refuses doubles above float32's max
        return None


def _torch_says_scale_is_usable(value: float | int) -> bool:
    """torch's own arithmetic: the float32 scale and its reciprocal (f32(1/f64(s))) finite, > 0."""
    scale32 = _torch_float32(value)
    if scale32 is None:
        return False
    inverse = scale32.double().reciprocal().float()
    return bool(scale32 > 0) and bool(torch.isfinite(scale32)) and bool(torch.isfinite(inverse))


@pytest.mark.parametrize("entry", ["from_state_dict", "init_scaler"])
@given(value=any_number)
def test_accepted_scales_never_unscale_finite_grads_to_non_finite(entry: str, value: Any) -> None:
    """Whatever scale famp accepts, finite scaled grads unscale to finite grads (or are flagged).

    Refused scales are exactly those torch's own float32 arithmetic shows unusable: 0.0, an
    infinite reciprocal (so ``unscale_and_check`` would return inf with ``found_inf == 0``),
    or above float32's maximum.
    """
    make = (
        famp.init_scaler
        if entry == "init_scaler"
        else lambda v: famp.from_state_dict({**GOOD, "scale": v})
    )
    if not _torch_says_scale_is_usable(value):
        with pytest.raises(ValueError, match="scale"):
            make(value)
        return
    state = make(value)
    assert state.scale.dtype == torch.float32
    for true_grad in ([0.0, 1.0, -0.5, 2.0**-149], [1.0e4, -3.0]):
        scaled = famp.scale(state, torch.tensor(true_grad))
        grads, found_inf = famp.unscale_and_check(state, [scaled])
        if found_inf.item() == 0.0:  # a step famp lets through has finite grads
            assert bool(torch.isfinite(grads[0]).all())
        else:  # a flagged step: the scaled loss itself overflowed
            assert not bool(torch.isfinite(scaled).all())
        assert true_grad[0] != 0.0 or found_inf.item() == 0.0  # |g| <= 1 never overflows


@given(
    value=st.one_of(
        st.integers(1, 2**63 - 1),
        # from 2**53 on, with bits below float32's 24 that make ties through a double
        st.tuples(st.integers(53, 62), st.integers(0, 2**29 - 1)).map(
            lambda p: 2 ** p[0] + (p[1] << (p[0] - 29)) + 1
        ),
        st.sampled_from([2**60 + 2**36 + 1, 2**63 - 1, 2**24 + 1, 2**53 + 1]),
    )
)
def test_int_scales_are_gradscalers_float32_values(value: int) -> None:
    # GradScaler rounds an int scale straight to float32 (`torch.full`, `fill_`); through a
    # double first, 2**60 + 2**36 + 1 would become 2**60 rather than 2**60 + 2**37.
    scaler = torch.amp.GradScaler("cpu", init_scale=value)
    scaler.scale(torch.ones(()))  # lazy init of _scale on the CPU
    assert_bitwise_equal(famp.init_scaler(value).scale, scaler._scale)
    loaded = torch.amp.GradScaler("cpu")
    loaded.scale(torch.ones(()))
    loaded.load_state_dict({**scaler.state_dict(), "scale": value})
    assert_bitwise_equal(famp.from_state_dict({**GOOD, "scale": value}).scale, loaded._scale)


def test_int_scales_beyond_int64_are_their_float32_values() -> None:
    # torch reads no int beyond int64; famp reads it as the float32 it rounds to, and refuses
    # one above float32's maximum as torch refuses such a double.
    assert famp.init_scaler(2**64).scale.item() == 2.0**64
    assert famp.init_scaler(2**100 + 2**76 + 1).scale.item() == 2.0**100 + 2.0**77
    assert famp.init_scaler(2**128 - 2**104).scale.item() == torch.finfo(torch.float32).max
    with pytest.raises(ValueError, match="init_scale must be a number whose float32 value"):
        famp.init_scaler(2**128 - 2**104 + 1)


def test_int_guards_compare_with_the_scale_in_the_scales_float32() -> None:
    # 2**60 + 2**36 + 1 is 2**60 + 2**37 in float32 (as the state's scale would be): a scale of
    # 2**60 is below it, though the two are equal through a double.
    with pytest.raises(ValueError, match="init_scale must be >= min_scale in float32"):
        famp.init_scaler(2**60, min_scale=2**60 + 2**36 + 1)
    state = famp.init_scaler(2**60 + 2**37, min_scale=2**60 + 2**36 + 1, backoff_factor=0.5)
    compiled = torch.compile(famp.update_scale, fullgraph=True)  # the guard a traced constant
    for update in (famp.update_scale, compiled):
        backed = update(state, torch.tensor(1.0))  # the floor holds at min_scale
        assert backed.scale.item() == 2.0**60 + 2.0**37
    capped = famp.init_scaler(2**60, max_scale=2**60 + 2**36 + 1, growth_interval=1)
    for update in (famp.update_scale, compiled):
        grown = update(capped, torch.tensor(0.0))  # the cap holds at max_scale
        assert grown.scale.item() == 2.0**60 + 2.0**37


@given(value=st.floats(allow_nan=False, allow_infinity=False, width=64))
def test_float32_rounding_equals_torchs(value: float) -> None:
    from famp._scaling.checks import to_float32

    expected = torch.tensor(value, dtype=torch.float64).float().double().item()
    assert to_float32(value) == expected or (math.isinf(to_float32(value)) and math.isinf(expected))


def test_from_state_dict_checks_the_guards_as_init_scaler_does() -> None:
    d = {**GOOD, "scale": 0.5}
    for kwargs in ({"min_scale": 1.0}, {"max_scale": 0.25}):
        with pytest.raises(ValueError, match=r"'scale' must be [<>]= (min|max)_scale") as info:
            famp.from_state_dict(d, **kwargs)
        with pytest.raises(ValueError, match="init_scale") as init_info:
            famp.init_scaler(0.5, **kwargs)
        # the same check, naming the dict key instead of the argument
        assert str(info.value).replace("state dict key 'scale'", "init_scale") == str(
            init_info.value
        )
    for kwargs in ({"hysteresis": 0}, {"min_scale": 10**400}, {"dynamic": 1}, {"device": "x"}):
        with pytest.raises((TypeError, ValueError)) as info:
            famp.from_state_dict(d, **kwargs)
        with pytest.raises(info.type) as init_info:
            famp.init_scaler(0.5, **kwargs)
        assert str(info.value) == str(init_info.value)


def _drive(scaler: torch.amp.GradScaler, found: float) -> None:
    gradscaler_step(scaler, found)


@pytest.mark.parametrize("start", [2**31 - 3, -(2**31)])
def test_a_wrapped_tracker_round_trips_and_continues_like_gradscaler(start: int) -> None:
    """The int32 tracker wraps negative in torch's kernel; famp saves and loads that state."""
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=5)
    scaler.load_state_dict({**GOOD, "scale": 8.0, "growth_interval": 5, "_growth_tracker": start})
    state = famp.from_state_dict(scaler.state_dict())
    for found in [0.0, 0.0, 0.0, 0.0, math.inf, 0.0]:
        _drive(scaler, found)
        state = famp.update_scale(state, torch.tensor(found))
        assert_same_state(state, scaler)
        state = famp.from_state_dict(json.loads(json.dumps(famp.to_state_dict(state))))
        scaler.load_state_dict(famp.to_state_dict(state))
        assert_same_state(state, scaler)
    if start > 0:
        wrapped = famp.from_state_dict({**GOOD, "growth_interval": 5, "_growth_tracker": 2**31 - 1})
        wrapped = famp.update_scale(wrapped, torch.tensor(0.0))
        assert wrapped.growth_tracker.item() == -(2**31)  # torch's int32 wrap, kept
        assert famp.to_state_dict(wrapped)["_growth_tracker"] == -(2**31)


@given(
    hysteresis=st.integers(2, 4),
    gi=st.integers(1, 3),
    min_exp=st.one_of(st.none(), st.integers(-3, 0)),
    found=st.lists(st.sampled_from([0.0, 1.0, 1.0, math.nan]), max_size=16),
)
def test_every_state_resumes_bit_exact_with_a_save_and_load_at_every_step(
    hysteresis: int, gi: int, min_exp: int | None, found: list[float]
) -> None:
    """Uninterrupted vs saved and restored (through JSON) after every step, hysteresis included."""
    settings: dict[str, Any] = {
        "hysteresis": hysteresis,
        "min_scale": None if min_exp is None else 2.0**min_exp,
    }
    straight = famp.init_scaler(4.0, growth_interval=gi, **settings)
    resumed = straight
    for f in found:
        straight = famp.update_scale(straight, torch.tensor(f))
        resumed = famp.update_scale(resumed, torch.tensor(f))
        d = json.loads(json.dumps(famp.to_state_dict(resumed)))
        resumed = famp.from_state_dict(d, **settings)
        for name in ("scale", "growth_tracker", "overflow_count"):
            assert_bitwise_equal(getattr(resumed, name), getattr(straight, name))


def test_the_hysteresis_dict_loads_into_gradscaler() -> None:
    state = famp.init_scaler(64.0, growth_interval=3, hysteresis=3)
    state = famp.update_scale(state, torch.tensor(1.0))  # mid-streak: count 1, scale unchanged
    d = famp.to_state_dict(state)
    assert d["_overflow_count"] == 1
    assert list(d) == [*KEYS, "_overflow_count"]
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    scaler.load_state_dict(d)  # torch reads its five keys and ignores the sixth
    assert scaler.state_dict() == {k: d[k] for k in KEYS}
    assert famp.from_state_dict(d, hysteresis=3).overflow_count.item() == 1  # type: ignore[union-attr]
    assert famp.from_state_dict(scaler.state_dict(), hysteresis=3).overflow_count.item() == 0  # type: ignore[union-attr]
    with pytest.raises(
        ValueError, match=r"'_overflow_count' must be an int in \[0, hysteresis=2\]"
    ):
        famp.from_state_dict({**d, "_overflow_count": 3}, hysteresis=2)
    with pytest.raises(TypeError, match="'_overflow_count'"):
        famp.from_state_dict({**d, "_overflow_count": 1.0}, hysteresis=3)


def test_a_scale_backed_off_past_usefulness_is_refused_on_purpose() -> None:
    """GradScaler (and famp without min_scale) back off until the reciprocal is infinite."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    state = famp.init_scaler(1.0)
    for _ in range(129):
        gradscaler_step(scaler, math.inf)
        state = famp.update_scale(state, torch.tensor(1.0))
    assert_same_state(state, scaler)
    assert state.scale.double().reciprocal().float().isinf()
    for d in (scaler.state_dict(), famp.to_state_dict(state)):
        with pytest.raises(ValueError, match="state dict key 'scale' must be a number whose"):
            famp.from_state_dict(d)
