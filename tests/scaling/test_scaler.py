"""famp's loss-scaling core against torch's own kernels and GradScaler, bit for bit."""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given

import famp
from famp._scaling import eager_cpu, fused, kernels
from famp._scaling import update as update_module
from tests.helpers import assert_bitwise_equal

Transform = Callable[[Callable[..., Any]], Callable[..., Any]]

FOUND_INF_VALUES = [0.0, 1.0, 2.0, -1.0, 0.5, math.nan, math.inf]


def torch_update(
    scale: torch.Tensor, tracker: torch.Tensor, found_inf: float, state: famp.ScalerState
) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle: torch's in-place update kernel on copies."""
    s, t = scale.clone(), tracker.clone()
    torch._amp_update_scale_(
        s,
        t,
        torch.tensor(found_inf, device=s.device),
        state.growth_factor,
        state.backoff_factor,
        state.growth_interval,
    )
    return s, t


def torch_unscale(
    scale_value: float, grads: list[torch.Tensor], *, allow_fp16: bool = False
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The oracle: GradScaler.unscale_ on parameters holding copies of ``grads``, on the grads'
    device type (the CPU for a list without tensors)."""
    device = grads[0].device.type if grads else "cpu"
    scaler = torch.amp.GradScaler(device, init_scale=scale_value)
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros(g.shape, dtype=g.dtype, device=g.device))
        p.grad = g.clone()
        params.append(p)
    opt = torch.optim.SGD(params, lr=0.1)
    scaler.scale(torch.ones((), device=device))  # lazily creates _scale on the device
    if allow_fp16:  # the path GradScaler takes for fp16 (ShardedGradScaler's default)
        inv = scaler._scale.double().reciprocal().float()
        found = torch.zeros((), device=device)
        per_device = scaler._unscale_grads_(opt, inv, found, True)
    else:
        scaler.unscale_(opt)
        per_device = scaler._found_inf_per_device(opt)
    found_inf = (
        torch.stack(list(per_device.values())).amax()
        if per_device
        else torch.zeros((), device=device)
    )
    return [p.grad for p in params], found_inf


def torch_unscale_anywhere(
    scale_value: float, grads: list[torch.Tensor], *, allow_fp16: bool = False
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`torch_unscale` per dtype (as GradScaler groups them); for a dtype that torch's kernel does
    not run on the grads' device (bfloat16 on CUDA builds without it, pytorch/pytorch#127176),
    the CPU kernel's bits, moved back. found_inf: the groups' maximum."""
    out: list[torch.Tensor] = list(grads)
    founds = []
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, g in enumerate(grads):
        by_dtype.setdefault(g.dtype, []).append(i)
    for index in by_dtype.values():
        group = [grads[i] for i in index]
        try:
            results, found = torch_unscale(scale_value, group, allow_fp16=allow_fp16)
        except NotImplementedError:
            device = group[0].device
            results, found = torch_unscale(
                scale_value, [g.cpu() for g in group], allow_fp16=allow_fp16
            )
            results, found = [r.to(device) for r in results], found.to(device)
        founds.append(found)
        for i, r in zip(index, results, strict=True):
            out[i] = r
    if not founds:
        return out, torch.zeros(())
    return out, torch.stack(founds).amax()


# --- update_scale ------------------------------------------------------------------------------


def _update(state: famp.ScalerState, found_inf: torch.Tensor) -> famp.ScalerState:
    return famp.update_scale(state, found_inf)


def _update_where(state: famp.ScalerState, found_inf: torch.Tensor) -> famp.ScalerState:
    """The torch.where formulation famp uses with guards and under torch.func transforms."""
    return update_module._update_where(state, found_inf)


def _update_donated(state: famp.ScalerState, found_inf: torch.Tensor) -> famp.ScalerState:
    return famp.update_scale(state, found_inf, donate=True)


UPDATES = [
    pytest.param(_update, id="kernel"),
    pytest.param(_update_where, id="where"),
    pytest.param(_update_donated, id="donated"),
]


factors = st.floats(1.0, 64.0, exclude_min=True, allow_subnormal=False)
backoffs = st.floats(0.0, 1.0, exclude_min=True, exclude_max=True, allow_subnormal=False)
scales = st.one_of(
    st.floats(0.0, 3.3999999521443642e38, width=32),
    st.sampled_from([0.0, 1.5 * 2.0**127, 2.0**-149, 65536.0, math.inf]),
)


# torch's update kernel has a CPU and a CUDA implementation; famp's state lives on either.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("update", UPDATES)
@given(
    scale_value=scales,
    tracker=st.one_of(st.integers(0, 10), st.just(2**31 - 1), st.integers(-(2**31), 2**31 - 1)),
    growth_factor=factors,
    backoff_factor=backoffs,
    growth_interval=st.one_of(st.integers(1, 5), st.integers(1, 2**31 - 1)),
    found_infs=st.lists(st.sampled_from(FOUND_INF_VALUES), min_size=1, max_size=12),
)
def test_update_scale_equals_torch_kernel_on_sequences(
    device: str,
    update: Callable[..., famp.ScalerState],
    scale_value: float,
    tracker: int,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    found_infs: list[float],
) -> None:
    state = famp.ScalerState(
        scale=torch.tensor(scale_value, dtype=torch.float32, device=device),
        growth_tracker=torch.tensor(tracker, dtype=torch.int32, device=device),
        growth_factor=growth_factor,
        backoff_factor=backoff_factor,
        growth_interval=growth_interval,
    )
    s, t = state.scale, state.growth_tracker
    for f in found_infs:
        s, t = torch_update(s, t, f, state)
        state = update(state, torch.tensor(f, device=device))
        assert_bitwise_equal(state.scale, s)
        assert_bitwise_equal(state.growth_tracker, t)


EDGE_CASES = [  # (scale, tracker, growth_factor, backoff, interval, found_inf)
    (8.0, 2, 2.0, 0.5, 3, 0.0),  # grows
    (8.0, 1, 2.0, 0.5, 3, 0.0),  # counts
    (8.0, 2, 2.0, 0.5, 3, math.nan),  # NaN is an overflow
    (8.0, 2, 2.0, 0.5, 3, -1.0),
    (8.0, 2, 2.0, 0.5, 3, 2.0),
    (1.5 * 2.0**127, 0, 2.0, 0.5, 1, 0.0),  # growth to inf refused, tracker still resets
    (math.inf, 0, 2.0, 0.5, 1, 0.0),
    (2.0**-149, 0, 2.0, 0.5, 1, 1.0),  # backs off to 0.0, as torch does
    (3.0, 7, 2.0, 0.5, 5, 0.0),  # tracker above the interval never grows
    (3.0, 2**31 - 1, 2.0, 0.5, 5, 0.0),  # int32 wrap
    (1.1, 4, 1.37, 0.77, 5, 0.0),  # non-power-of-two factors: f32(f64 * f)
    (1.1, 4, 1.37, 0.77, 5, 1.0),
    (0.1, 0, 1.1, 0.5, 1, 0.0),  # here a float32 product would round differently
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("update", UPDATES)
def test_update_scale_edge_cases_equal_torch_kernel(
    transform: Transform, update: Callable[..., famp.ScalerState], device: str
) -> None:
    update = transform(update)
    for scale_value, tracker, gf, bf, gi, f in EDGE_CASES:
        state = famp.ScalerState(
            scale=torch.tensor(scale_value, device=device),
            growth_tracker=torch.tensor(tracker, dtype=torch.int32, device=device),
            growth_factor=gf,
            backoff_factor=bf,
            growth_interval=gi,
        )
        before = state.scale.clone(), state.growth_tracker.clone()
        s, t = torch_update(state.scale, state.growth_tracker, f, state)
        new = update(state, torch.tensor(f, device=device))
        assert_bitwise_equal(new.scale, s)
        assert_bitwise_equal(new.growth_tracker, t)
        if update is not _update_donated:
            assert_bitwise_equal(state.scale, before[0])  # inputs untouched
            assert_bitwise_equal(state.growth_tracker, before[1])
        assert new.growth_interval == gi
        assert new.growth_factor == gf
        assert new.backoff_factor == bf


def test_update_scale_matches_gradscaler_trajectory() -> None:
    # The reference trajectory of GradScaler("cpu", init_scale=8, gf=2, bf=0.5, gi=3).
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=3)
    scaler.scale(torch.ones(()))
    state = famp.init_scaler(8.0, growth_interval=3)
    for f in [0.0, 0.0, 0.0, 1.0, 0.0, math.nan, 0.0, 0.0, 0.0, 0.0]:
        found = torch.tensor(f)
        torch._amp_update_scale_(scaler._scale, scaler._growth_tracker, found, 2.0, 0.5, 3)
        state = famp.update_scale(state, found)
        assert_bitwise_equal(state.scale, scaler._scale)
        assert_bitwise_equal(state.growth_tracker, scaler._growth_tracker)


def test_donated_update_scale_is_gradscaler_update_on_the_same_tensors() -> None:
    # Eagerly and without guards, donation runs torch's kernel on the state's own tensors, as
    # GradScaler.update does: the returned state holds them, and follows GradScaler's trajectory.
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=2)
    scaler.scale(torch.ones(()))
    state = famp.init_scaler(8.0, growth_interval=2)
    for f in [0.0, 0.0, 1.0, 0.0, math.nan, 0.0, 0.0, 2.0, 0.0]:
        found = torch.tensor(f)
        torch._amp_update_scale_(scaler._scale, scaler._growth_tracker, found, 2.0, 0.5, 2)
        scale, tracker = state.scale, state.growth_tracker
        state = famp.update_scale(state, found, donate=True)
        assert state.scale is scale
        assert state.growth_tracker is tracker
        assert_bitwise_equal(state.scale, scaler._scale)
        assert_bitwise_equal(state.growth_tracker, scaler._growth_tracker)


@pytest.mark.parametrize(
    "guard", [{"min_scale": 4.0}, {"max_scale": 32.0}, {"hysteresis": 2}], ids=str
)
def test_donated_update_scale_with_guards_equals_the_undonated_one(guard: dict[str, Any]) -> None:
    state = famp.init_scaler(8.0, growth_interval=2, **guard)
    donated = famp.init_scaler(8.0, growth_interval=2, **guard)
    for f in [0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]:
        state = famp.update_scale(state, torch.tensor(f))
        donated = famp.update_scale(donated, torch.tensor(f), donate=True)
        assert_bitwise_equal(donated.scale, state.scale)
        assert_bitwise_equal(donated.growth_tracker, state.growth_tracker)
        if state.overflow_count is not None:
            assert donated.overflow_count is not None
            assert_bitwise_equal(donated.overflow_count, state.overflow_count)


def test_donated_update_scale_under_vmap_equals_the_kernel_per_row() -> None:
    # The kernel has no batching rule: under vmap, donation computes out of place, the same bits.
    state = famp.init_scaler(8.0, growth_interval=1)
    founds = torch.tensor([0.0, 1.0, math.nan, 0.0])

    def step(found: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        new = famp.update_scale(state, found, donate=True)
        return new.scale, new.growth_tracker

    scales, trackers = torch.func.vmap(step)(founds)
    for i, f in enumerate(founds.tolist()):
        s, t = torch_update(state.scale, state.growth_tracker, f, state)
        assert_bitwise_equal(scales[i], s)
        assert_bitwise_equal(trackers[i], t)
    assert_bitwise_equal(state.scale, torch.tensor(8.0))  # left as it was


def test_donated_update_scale_refuses_tensors_torch_cannot_write_before_writing() -> None:
    grad_state = famp.ScalerState(
        scale=torch.tensor(8.0, requires_grad=True),
        growth_tracker=torch.tensor(0, dtype=torch.int32),
    )
    with torch.inference_mode():
        inference_state = famp.init_scaler(8.0)
    for state, field, why in [
        (grad_state, "scale", "requires grad"),
        (inference_state, "scale", "is an inference tensor"),
    ]:
        with pytest.raises(ValueError, match=rf"state\.{field} \(tensor\(8\..*{why}"):
            famp.update_scale(state, torch.tensor(0.0), donate=True)
        assert state.scale.item() == 8.0
        assert state.growth_tracker.item() == 0
        famp.update_scale(state, torch.tensor(0.0))  # without donation, a new state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_donating_the_scale_before_the_scaled_loss_backward_raises(dtype: torch.dtype) -> None:
    # The scaled loss's graph holds the scale for its backward: updating the scale in place
    # before that backward is an error autograd names, never gradients of another scale.
    state = famp.init_scaler(8.0)
    w = torch.ones(2, requires_grad=True)
    scaled = famp.scale(state, (w * 2).sum().to(dtype))
    famp.update_scale(state, torch.tensor(0.0), donate=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        scaled.backward()


@pytest.mark.parametrize("guard", [{}, {"hysteresis": 2}])
def test_a_found_inf_that_requires_grad_leaves_the_scale_out_of_the_graph(
    guard: dict[str, Any],
) -> None:
    """A found_inf computed from values that require grad gave the new scale a grad_fn torch's
    kernel cannot differentiate, and the next scaled loss's backward raised."""
    w = torch.ones(2, requires_grad=True)
    for flag in (0.0, 1.0):
        found_inf = (w * 0 + flag).amax()
        assert found_inf.requires_grad
        state = famp.update_scale(famp.init_scaler(8.0, growth_interval=1, **guard), found_inf)
        expected = famp.update_scale(
            famp.init_scaler(8.0, growth_interval=1, **guard), torch.tensor(flag)
        )
        assert not state.scale.requires_grad
        assert not state.growth_tracker.requires_grad
        assert_bitwise_equal(state.scale, expected.scale)
        assert_bitwise_equal(state.growth_tracker, expected.growth_tracker)
        famp.scale(state, (w * 2).sum()).backward()  # raised: no derivative for the kernel
        assert_bitwise_equal(w.grad, torch.full((2,), 2.0) * expected.scale)
        w.grad = None


def test_update_scale_refuses_a_non_bool_donate() -> None:
    state = famp.init_scaler(8.0)
    with pytest.raises(TypeError, match=r"donate must be a bool, got 'yes'"):
        famp.update_scale(state, torch.tensor(0.0), donate="yes")  # type: ignore[arg-type]
    assert_bitwise_equal(state.scale, torch.tensor(8.0))


# --- unscale_and_check ---------------------------------------------------------------------------


def _unscale(state: famp.ScalerState, grads: Any) -> tuple[Any, torch.Tensor]:
    return famp.unscale_and_check(state, grads)


specials = st.sampled_from([math.inf, -math.inf, math.nan, 0.0, -0.0, 1e30, 65504.0, 3.0])


@st.composite
def grad_lists(draw: st.DrawFn, dtypes: tuple[torch.dtype, ...]) -> list[torch.Tensor]:
    n = draw(st.integers(1, 5))
    grads = []
    for _ in range(n):
        dtype = draw(st.sampled_from(dtypes))
        shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=2))
        seed = draw(st.integers(0, 2**16))
        g = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 1000
        g = g.to(dtype)
        if g.numel() and draw(st.booleans()):
            g.view(-1)[draw(st.integers(0, g.numel() - 1))] = draw(specials)
        grads.append(g)
    return grads


# Eagerly, famp unscales small tensors with the kernel itself; big ones (above CHUNK_BYTES) with
# the kernel a chunk at a time (float32/float64) or a min/max and a multiply (halves); and, where
# the big float32/float64 ones total fused.MIN_BYTES, with its compiled one-pass program. Run the
# differential tests through every path (fused.MIN_BYTES = 0: every big tensor takes it).
PATHS = [
    pytest.param((1 << 20, fused.MIN_BYTES), id="small-path"),
    pytest.param((0, fused.MIN_BYTES), id="big-path"),
    pytest.param((0, 0), id="fused-path"),
]


@contextlib.contextmanager
def paths(chunk_bytes: int, fused_bytes: int) -> Iterator[None]:
    """Where eager unscale's paths begin: `CHUNK_BYTES` and `fused.MIN_BYTES`."""
    with (
        mock.patch.object(eager_cpu, "CHUNK_BYTES", chunk_bytes),
        mock.patch.object(fused, "MIN_BYTES", fused_bytes),
    ):
        yield


@pytest.mark.parametrize("chunk_bytes", PATHS)
@given(
    grads=grad_lists((torch.bfloat16, torch.float32, torch.float64)),
    scale_value=st.one_of(
        st.sampled_from([65536.0, 1.0, 3.0, 2.0**-20]), st.floats(2.0**-100, 2.0**100, width=32)
    ),
)
def test_unscale_and_check_equals_gradscaler_unscale(
    chunk_bytes: tuple[int, int], grads: list[torch.Tensor], scale_value: float
) -> None:
    expected, expected_found = torch_unscale(scale_value, grads)
    before = [g.clone() for g in grads]
    state = famp.init_scaler(scale_value)
    with paths(*chunk_bytes):
        out, found_inf = famp.unscale_and_check(state, grads)
    assert isinstance(out, list)
    assert len(out) == len(grads)
    for o, e in zip(out, expected, strict=False):
        assert_bitwise_equal(o, e)
    assert_bitwise_equal(found_inf, expected_found)
    assert found_inf.dtype == torch.float32
    assert found_inf.shape == ()
    assert found_inf.item() == float(not all(torch.isfinite(g).all() for g in before))
    for g, b in zip(grads, before, strict=False):  # inputs never modified
        assert_bitwise_equal(g, b)


@pytest.mark.cuda
@pytest.mark.parametrize("donate", [False, True], ids=["out-of-place", "donated"])
@given(
    grads=grad_lists((torch.float16, torch.bfloat16, torch.float32, torch.float64)),
    scale_value=st.one_of(
        st.sampled_from([65536.0, 1.0, 3.0, 2.0**-20]), st.floats(2.0**-100, 2.0**100, width=32)
    ),
)
def test_unscale_and_check_on_cuda_equals_gradscaler_cuda(
    donate: bool, grads: list[torch.Tensor], scale_value: float
) -> None:
    """On CUDA, torch's multi-tensor CUDA kernel is the oracle (fp16 by its allow_fp16 path);
    for bfloat16, which that kernel does not run in every torch, the CPU kernel's bits."""
    grads = [g.to("cuda") for g in grads]
    fp16 = any(g.dtype == torch.float16 for g in grads)
    expected, expected_found = torch_unscale_anywhere(scale_value, grads, allow_fp16=fp16)
    given_ = [g.clone() for g in grads]
    out, found_inf = famp.unscale_and_check(
        famp.init_scaler(scale_value, device="cuda"), given_, donate=donate
    )
    for o, e in zip(out, expected, strict=True):
        assert o.dtype == e.dtype
        assert_bitwise_equal(o, e)
    assert_bitwise_equal(found_inf, expected_found)
    assert found_inf.device == torch.device("cuda", torch.cuda.current_device())
    assert found_inf.item() == float(not all(torch.isfinite(g).all() for g in grads))
    for g, donated, e in zip(grads, given_, expected, strict=True):
        # donated grads are unscaled where they lie; otherwise what was given is never modified
        assert_bitwise_equal(donated, e if donate else g)


def _layouts(dtype: torch.dtype, device: str) -> list[torch.Tensor]:
    """Gradients of every layout, with a NaN, an inf and a value that overflows at scale 0.5."""
    g = torch.Generator(device=device).manual_seed(0)

    def draw(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=g, device=device) * 1000).to(dtype)

    big = draw(3 * 65536 + 5)  # spans several of the multi-tensor kernels' chunks
    big[70000], big[140000] = math.nan, -math.inf
    return [
        big,
        draw(37, 11).t(),  # transposed
        draw(8, 20)[:, ::3],  # strided, with gaps
        draw(5, 1).expand(5, 7),  # expanded: its elements share memory
        draw(2, 3, 4, 5).to(memory_format=torch.channels_last),
        torch.tensor(6.0e4 if dtype == torch.float16 else 3.0e38, device=device).to(dtype),
        draw(0, 3),
        *(draw(50) for _ in range(100)),  # many small ones: the launches
    ]


def _functional_variant(
    grads: list[torch.Tensor], scale_value: float
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """torch's out-of-place form of GradScaler's kernel: a clone of each, then the kernel."""
    device = grads[0].device
    inv = torch.full((), scale_value, device=device).double().reciprocal().float()
    found = torch.zeros((), device=device)
    out, found = torch.ops.aten._amp_foreach_non_finite_check_and_unscale(grads, found, inv)
    return list(out), found, inv


def _check_against_functional_variant(
    out: list[torch.Tensor], found: torch.Tensor, want: list[torch.Tensor], want_found: torch.Tensor
) -> None:
    for o, e in zip(out, want, strict=True):
        assert_bitwise_equal(o, e)
        assert o.stride() == e.stride()
    assert_bitwise_equal(found, want_found)
    assert found.item() == 1.0  # the NaN and the inf


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("scale_value", [1024.0, 1.0, 0.5])
def test_one_clone_for_all_then_the_kernel_is_the_functional_variant(
    dtype: torch.dtype, scale_value: float
) -> None:
    """famp's eager CUDA path, run here on CPU tensors: a multi-tensor clone of the dense ones,
    a clone of each other one, then the kernel in place, gives the bits and the strides of
    torch's functional variant (a clone of each, then the kernel), whatever the layouts."""
    grads = _layouts(dtype, "cpu")
    expected, expected_found, inv = _functional_variant(grads, scale_value)
    for picked in (grads, grads[2:4], [grads[1], grads[4]]):  # mixed; none dense; all dense
        out, found = kernels._cloned(picked, torch.zeros(()), inv)
        picked_e, found_e = torch.ops.aten._amp_foreach_non_finite_check_and_unscale(
            picked, torch.zeros(()), inv
        )
        for o, e in zip(out, picked_e, strict=True):
            assert_bitwise_equal(o, e)
            assert o.stride() == e.stride()
        assert_bitwise_equal(found, found_e)
    out, found = kernels._cloned(grads, torch.zeros(()), inv)
    _check_against_functional_variant(out, found, expected, expected_found)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("fresh", [False, True], ids=["held", "fresh"])
def test_compiled_cuda_path_traced_on_cpu_tensors_is_the_functional_variant(
    dynamic: bool, fresh: bool
) -> None:
    """What `torch.compile` traces for CUDA gradients (a multi-tensor clone, or clones, then the
    kernel in place on the copies), compiled by inductor on CPU tensors of every layout, in
    static and dynamic shapes: the bits and strides of torch's functional variant, on every
    torch release famp supports (the CUDA run of the same path is the test below)."""
    grads = [g for dtype in (torch.float16, torch.float32) for g in _layouts(dtype, "cpu")[:8]]
    torch.compiler.reset()
    run = torch.compile(kernels.copied_then_unscaled, fullgraph=True, dynamic=dynamic)
    for picked in (grads[:8], grads[8:]):  # one dtype a call, as the kernel takes them
        before = [x.clone() for x in picked]
        inv = torch.tensor(0.5).double().reciprocal().float()
        out, found = run(picked, torch.zeros(()), inv, fresh)
        want, want_found = torch.ops.aten._amp_foreach_non_finite_check_and_unscale(
            before, torch.zeros(()), inv
        )
        _check_against_functional_variant(list(out), found, list(want), want_found)
        for g, b in zip(picked, before, strict=True):
            assert_bitwise_equal(g, b)


@functools.cache
def _compiled_unscale() -> Callable[..., Any]:
    return torch.compile(famp.unscale_and_check, fullgraph=True)


@pytest.mark.cuda
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("scale_value", [1024.0, 1.0, 0.5])
def test_unscale_and_check_on_cuda_keeps_layouts_and_launches_less_than_a_clone_each(
    compiled: bool, dtype: torch.dtype, scale_value: float
) -> None:
    """On CUDA famp clones the gradients in one multi-tensor clone and runs the kernel on the
    copies, eagerly and compiled: the bits, the dtypes and the strides of torch's functional
    variant (a clone of each gradient, then the kernel), with far fewer launches than
    gradients. Eagerly famp clones gradients that are not dense (strided, expanded) apart, so
    the multi-tensor clone keeps its one launch for the others; compiled, the clone is the
    compiler's, counted on dense gradients (gradients are; torch 2.11's shim, an opaque
    operator, copies each tensor of a list with one that is not)."""
    grads = _layouts(dtype, "cuda")
    before = [x.clone() for x in grads]
    expected, expected_found, _ = _functional_variant(grads, scale_value)
    state = famp.init_scaler(scale_value, device="cuda")
    unscale = _compiled_unscale() if compiled else famp.unscale_and_check
    out, found_inf = unscale(state, grads)
    _check_against_functional_variant(out, found_inf, expected, expected_found)
    for g, b in zip(grads, before, strict=True):
        assert_bitwise_equal(g, b)
    counted = [g for g in grads if g.is_contiguous()] if compiled else grads
    unscale(state, counted)  # compiles; the next call is counted
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the profiler's own notes on how it keeps events
        with torch.profiler.profile(activities=activities) as prof:
            unscale(state, counted)
            torch.cuda.synchronize()
        events = prof.events()
    kernels_run = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    assert 0 < len(kernels_run) < len(counted) // 5, [e.name for e in kernels_run]


@pytest.mark.parametrize("chunk_bytes", PATHS)
@given(grads=grad_lists((torch.float16, torch.float32)))
def test_unscale_and_check_fp16_equals_torch_allow_fp16_path(
    chunk_bytes: tuple[int, int], grads: list[torch.Tensor]
) -> None:
    expected, expected_found = torch_unscale(1024.0, grads, allow_fp16=True)
    with paths(*chunk_bytes):
        out, found_inf = famp.unscale_and_check(famp.init_scaler(1024.0), grads)
    for o, e in zip(out, expected, strict=False):
        assert o.dtype == e.dtype
        assert_bitwise_equal(o, e)
    assert_bitwise_equal(found_inf, expected_found)


def _compiled_case(bad: bool) -> dict[str, Any]:
    nan, inf = (math.nan, math.inf) if bad else (1.5, 2.5)
    return {
        "w": torch.tensor([3.0, nan, -inf]),
        "b": [torch.tensor([-nan, inf, 300.0], dtype=torch.bfloat16), None],
        "h": torch.tensor([[-nan, 6.0]], dtype=torch.float16),
        "s": torch.tensor(inf, dtype=torch.bfloat16),  # 0-d: would promote in a plain multiply
        "d": torch.tensor([[-nan]], dtype=torch.float64),
    }


@pytest.mark.parametrize("bad", [False, True])
def test_unscale_and_check_compiled_equals_eager(transform: Transform, bad: bool) -> None:
    grads = _compiled_case(bad)
    out, found_inf = transform(_unscale)(famp.init_scaler(3.0), grads)
    flat = [grads["w"], grads["b"][0], grads["h"], grads["s"], grads["d"]]
    expected, expected_found = torch_unscale(3.0, flat, allow_fp16=True)
    assert out["b"][1] is None
    for o, e in zip([out["w"], out["b"][0], out["h"], out["s"], out["d"]], expected, strict=True):
        assert_bitwise_equal(o, e)  # dtypes and NaN bit patterns included
    assert_bitwise_equal(found_inf, expected_found)
    assert found_inf.dtype == torch.float32
    assert found_inf.item() == float(bad)


# --- scale ---------------------------------------------------------------------------------------


def _scale(state: famp.ScalerState, tree: Any) -> Any:
    return famp.scale(state, tree)


@pytest.mark.parametrize(
    ("dtype", "shape"),
    [
        (torch.float16, ()),
        (torch.bfloat16, ()),
        (torch.float32, ()),
        (torch.float64, ()),
        (torch.float16, (3,)),
        (torch.bfloat16, (2, 2)),
        (torch.float32, (3,)),
    ],
)
def test_scale_dtype_and_value_equal_gradscaler(
    transform: Transform, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    loss = (torch.arange(math.prod(shape)).reshape(shape) + 0.5).to(dtype) * 3
    scaler = torch.amp.GradScaler("cpu", init_scale=3000.0)
    expected = scaler.scale(loss)
    out = transform(_scale)(famp.init_scaler(3000.0), loss)
    assert out.dtype == expected.dtype
    assert_bitwise_equal(out, expected)


@given(
    grads=grad_lists((torch.float16, torch.bfloat16, torch.float32, torch.float64)),
    scale_value=st.one_of(
        st.sampled_from([65536.0, 3.0]), st.floats(2.0**-100, 2.0**100, width=32)
    ),
)
def test_scale_equals_gradscaler_scale_on_random_trees(
    grads: list[torch.Tensor], scale_value: float
) -> None:
    expected = torch.amp.GradScaler("cpu", init_scale=scale_value).scale(grads)
    out = famp.scale(famp.init_scaler(scale_value), tuple(grads))
    assert type(out) is tuple
    for o, e in zip(out, expected, strict=True):
        assert o.dtype == e.dtype
        assert_bitwise_equal(o, e)


# --- all_finite, select_tree ---------------------------------------------------------------------


def _skip_if_not_finite(grads: Any, new: Any, old: Any) -> Any:
    return famp.select_tree(famp.all_finite(grads), new, old)


@pytest.mark.parametrize("bad", [None, math.inf, math.nan])
def test_all_finite_and_select_tree_skip_an_update(transform: Transform, bad: float | None) -> None:
    grads = {"w": torch.ones(3), "b": torch.tensor([1.0, 2.0], dtype=torch.bfloat16)}
    if bad is not None:
        grads["b"][1] = bad
    new = {"w": torch.full((3,), 2.0), "b": torch.full((2,), 5.0, dtype=torch.bfloat16)}
    old = {"w": torch.zeros(3), "b": torch.zeros(2, dtype=torch.bfloat16)}
    out = transform(_skip_if_not_finite)(grads, new, old)
    chosen = new if bad is None else old
    assert out.keys() == chosen.keys()
    for k in out:
        assert_bitwise_equal(out[k], chosen[k])
    ok = famp.all_finite(grads)
    assert ok.dtype == torch.bool
    assert ok.shape == ()
    assert bool(ok) == (bad is None)


def test_gradscaler_cannot_be_traced_with_fullgraph() -> None:
    """The claim in famp/README.md and the docs: Dynamo skips GradScaler, famp's step traces."""
    scaler = torch.amp.GradScaler("cpu")

    def torch_step(loss: torch.Tensor) -> torch.Tensor:
        return scaler.scale(loss)

    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"GradScaler\.scale"):
        torch.compile(torch_step, fullgraph=True, backend="eager")(torch.ones(()))
    torch._dynamo.reset()
    state = famp.init_scaler(8.0)
    scaled = torch.compile(famp.scale, fullgraph=True, backend="eager")(state, torch.ones(()))
    assert scaled.dtype == torch.float32
    assert scaled.item() == 8.0
