"""unscale_and_check beyond dense CPU grads: sparse, donation, device grouping, round trips."""

from __future__ import annotations

import dataclasses
import math
from typing import Any
from unittest import mock

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import famp
from famp._scaling.program import where_program
from tests.helpers import assert_bitwise_equal
from tests.scaling.test_scaler import torch_unscale


def sparse(
    indices: list[list[int]],
    values: list[float],
    size: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    return torch.sparse_coo_tensor(
        torch.tensor(indices), torch.tensor(values, dtype=dtype), size, check_invariants=True
    )


def assert_same_sparse(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same raw (possibly uncoalesced) indices and values, not only the same coalesced tensor."""
    assert actual.is_sparse
    assert expected.is_sparse
    assert actual.is_coalesced() == expected.is_coalesced()
    assert_bitwise_equal(actual._indices(), expected._indices())
    assert_bitwise_equal(actual._values(), expected._values())
    assert actual.shape == expected.shape


def test_sparse_grads_equal_gradscaler() -> None:
    uncoalesced = sparse([[0, 1, 0], [2, 0, 2]], [3.0, -5.0, 1e30], (2, 3))
    coalesced = sparse([[1, 3]], [7.0, math.inf], (4,)).coalesce()
    dense = torch.tensor([6.0, 12.0], dtype=torch.bfloat16)
    grads = [uncoalesced, coalesced, dense]
    before = [g.clone() for g in grads]
    expected, expected_found = torch_unscale(3.0, grads)
    out, found = famp.unscale_and_check(famp.init_scaler(3.0), grads)
    assert not out[0].is_coalesced()  # torch leaves non-fp16 sparse grads uncoalesced
    assert_same_sparse(out[0], expected[0])
    assert_same_sparse(out[1], expected[1])
    assert_bitwise_equal(out[2], expected[2])
    assert_bitwise_equal(found, expected_found)
    assert found.item() == 1.0
    for g, b in zip(grads, before, strict=True):
        assert_same_sparse(g, b) if g.is_sparse else assert_bitwise_equal(g, b)


def test_fp16_sparse_grads_are_coalesced_like_torch() -> None:
    # Two finite fp16 duplicates sum to inf: torch coalesces fp16 sparse grads before checking.
    grad = sparse([[0, 0, 1]], [60000.0, 60000.0, 2.0], (3,), dtype=torch.float16)
    expected, expected_found = torch_unscale(4.0, [grad], allow_fp16=True)
    out, found = famp.unscale_and_check(famp.init_scaler(4.0), [grad])
    assert out[0].dtype == torch.float16
    assert out[0].is_coalesced()
    assert_same_sparse(out[0], expected[0])
    assert_bitwise_equal(found, expected_found)
    assert found.item() == 1.0
    assert not grad.is_coalesced()  # the input is not replaced or modified


def test_donate_reuses_the_buffers_and_equals_gradscaler_unscale() -> None:
    grads = {
        "w": torch.tensor([3.0, -6.0, math.nan]),
        "b": torch.tensor([9.0], dtype=torch.float64),
        "s": sparse([[0, 0]], [3.0, 6.0], (2,)),
    }
    expected, expected_found = torch_unscale(3.0, list(grads.values()))
    pointers = {k: (g._values() if g.is_sparse else g).data_ptr() for k, g in grads.items()}
    out, found = famp.unscale_and_check(famp.init_scaler(3.0), grads, donate=True)
    for k, e in zip(("w", "b", "s"), expected, strict=True):
        got = out[k]
        assert (got._values() if got.is_sparse else got).data_ptr() == pointers[k]
        assert_same_sparse(got, e) if got.is_sparse else assert_bitwise_equal(got, e)
    assert_bitwise_equal(found, expected_found)


finite_f32 = st.floats(2.0**-60, 2.0**60, width=32) | st.floats(-(2.0**60), -(2.0**-60), width=32)


@given(
    values=st.lists(finite_f32, min_size=1, max_size=8),
    exponent=st.integers(-60, 60),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
)
def test_unscale_inverts_scale_for_power_of_two_scales(
    values: list[float], exponent: int, dtype: torch.dtype
) -> None:
    state = famp.init_scaler(2.0**exponent)
    grads = {"g": torch.tensor(values).to(dtype), "loss": torch.tensor(values[0])}
    scaled = famp.scale(state, grads)
    assert scaled["g"].dtype == dtype
    out, found = famp.unscale_and_check(state, scaled)
    assert found.item() == 0.0
    assert_bitwise_equal(out["g"], grads["g"])
    assert_bitwise_equal(out["loss"], grads["loss"])


def test_scale_keeps_container_types() -> None:
    from collections import OrderedDict, namedtuple

    pair = namedtuple("pair", ["a", "b"])
    state = famp.init_scaler(2.0)
    one = torch.tensor(1.0)
    tree: Any = [pair(one, (one, None)), OrderedDict(x=one), {"y": [one]}]
    out = famp.scale(state, tree)
    assert type(out) is list
    assert type(out[0]) is pair
    assert type(out[0].b) is tuple
    assert out[0].b[1] is None
    assert type(out[1]) is OrderedDict
    assert out[2]["y"][0].item() == 2.0


@pytest.mark.parametrize("donate", [False, True])
def test_flat_dict_of_grads_keeps_its_keys_in_order(donate: bool) -> None:
    # Eagerly a flat dict of tensors is flattened by hand, not by optree (which sorts keys it
    # can sort): the result is a plain dict with the input's keys in the input's order, and the
    # values are GradScaler's. Keys of mixed types cannot even be sorted.
    state = famp.init_scaler(4.0)
    values = [torch.tensor([8.0, math.inf]), torch.tensor([4.0]), torch.tensor([2.0, -6.0])]
    keys: list[Any] = ["b", 3, "a"]
    grads = {key: v.clone() for key, v in zip(keys, values, strict=True)}
    out, found = famp.unscale_and_check(state, grads, donate=donate)
    assert type(out) is dict
    assert list(out) == ["b", 3, "a"]
    expected, expected_found = torch_unscale(4.0, values)
    for got, want in zip(out.values(), expected, strict=True):
        assert_bitwise_equal(got, want)
    assert_bitwise_equal(found, expected_found)
    scaled = famp.scale(state, {"z": torch.tensor(1.0), "y": torch.tensor(2.0)})
    assert type(scaled) is dict
    assert list(scaled) == ["z", "y"]
    assert_bitwise_equal(scaled["z"], torch.tensor(4.0))
    assert_bitwise_equal(scaled["y"], torch.tensor(8.0))
    # Not flat, or not all tensors: optree's flatten, with None passing through.
    mixed = famp.unscale_and_check(state, {"n": None, "t": torch.tensor([4.0])})[0]
    assert mixed["n"] is None
    assert mixed["t"].item() == 1.0


class _KernelCalls(TorchDispatchMode):
    """Records the (device, dtype) of every tensor each unscale kernel call receives."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[tuple[str, str]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if "_amp_foreach_non_finite_check_and_unscale" in str(func):
            self.calls.append([(str(t.device), str(t.dtype)) for t in args[0]])
        return func(*args, **(kwargs or {}))


def test_grads_on_several_devices_are_grouped_like_gradscaler() -> None:
    # No GPU on CI: fake CUDA tensors check the grouping and placement, not the values.
    with FakeTensorMode(allow_non_fake_inputs=True):
        grads = [
            torch.ones(3, device="cuda:0"),
            torch.ones(2),
            torch.ones(1, device="cuda:1"),
            torch.ones(2, device="cuda:0", dtype=torch.float16),
            torch.ones(4, device="cuda:0"),
            torch.ones(2, dtype=torch.bfloat16),
        ]
        with _KernelCalls() as famp_calls:
            out, found = famp.unscale_and_check(famp.init_scaler(4.0), grads)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        scaler.scale(torch.ones(()))
        with _KernelCalls() as torch_calls:
            per_device = scaler._unscale_grads_(
                torch.optim.SGD(params, lr=0.1), torch.ones(()), torch.zeros(()), True
            )
    assert sorted(famp_calls.calls) == sorted(torch_calls.calls)
    assert len(famp_calls.calls) == 5
    assert sorted(str(d) for d in per_device) == ["cpu", "cuda:0", "cuda:1"]
    assert [(str(o.device), o.dtype) for o in out] == [(str(g.device), g.dtype) for g in grads]
    assert (str(found.device), found.dtype, found.shape) == ("cpu", torch.float32, ())


special_or_any = st.one_of(
    st.sampled_from([math.inf, -math.inf, math.nan, -math.nan, 0.0, -0.0, 65504.0, 1e30]),
    st.floats(-1e6, 1e6),
)


@given(
    rows=st.lists(st.lists(special_or_any, min_size=3, max_size=3), min_size=1, max_size=4),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]),
    scale_value=st.sampled_from([3.0, 65536.0, 2.0**-149, 1.0, 0.1]),
)
def test_unscale_and_check_under_vmap_equals_the_kernel_per_sample(
    rows: list[list[float]], dtype: torch.dtype, scale_value: float
) -> None:
    # 2**-149 is refused by init_scaler (its reciprocal is inf) but reachable by backoffs
    state = dataclasses.replace(famp.init_scaler(), scale=torch.tensor(scale_value))
    batch = torch.tensor(rows, dtype=torch.float64).to(dtype)
    out, found = torch.func.vmap(lambda g: famp.unscale_and_check(state, {"g": g}))(batch)
    assert out["g"].dtype == dtype
    assert found.dtype == torch.float32
    for i in range(len(rows)):
        expected, expected_found = famp.unscale_and_check(state, {"g": batch[i]})  # the kernel
        assert_bitwise_equal(out["g"][i], expected["g"])
        assert_bitwise_equal(found[i], expected_found)


@pytest.mark.parametrize("chunk_bytes", [1, 16, 1 << 22])
@pytest.mark.parametrize("bad_at", [None, 0, 3, 5, 6])
def test_chunked_check_sees_every_tensor(
    monkeypatch: pytest.MonkeyPatch, chunk_bytes: int, bad_at: int | None
) -> None:
    # Out of place, small grads are unscaled in runs of about CHUNK_BYTES, and each bigger one
    # on its own (famp._scaling.eager_cpu.out_of_place_cpu).
    monkeypatch.setattr("famp._scaling.eager_cpu.CHUNK_BYTES", chunk_bytes)
    grads = [torch.full((n,), 6.0) for n in (3, 0, 5, 1, 0, 4)]
    grads.append(torch.full((2, 3), 6.0).t())  # not contiguous: never sliced
    if bad_at is not None:
        grads[bad_at][-1] = math.nan
    expected, expected_found = torch_unscale(3.0, grads)
    out, found = famp.unscale_and_check(famp.init_scaler(3.0), grads)
    for o, e in zip(out, expected, strict=True):
        assert_bitwise_equal(o, e)
    assert_bitwise_equal(found, expected_found)
    assert found.item() == float(bad_at is not None)


@pytest.mark.parametrize("chunk_bytes", [64, 1 << 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(
    "layout",
    ["contiguous", "channels_last", "transposed", "offset view", "gapped slice", "expanded"],
)
def test_big_grads_in_any_layout_equal_gradscaler_and_keep_their_strides(
    monkeypatch: pytest.MonkeyPatch, chunk_bytes: int, dtype: torch.dtype, layout: str
) -> None:
    # Eagerly, big dense float32/float64 grads are copied and unscaled chunk by chunk (the chunks
    # are views of the storage, so the layout must be one empty_like keeps); others take another
    # path. Every one must give GradScaler's bits and strides and leave the input as it was.
    monkeypatch.setattr("famp._scaling.eager_cpu.CHUNK_BYTES", chunk_bytes)
    gen = torch.Generator().manual_seed(0)
    base = (torch.randn(2, 6, 5, 7, generator=gen) * 1e3).to(dtype)
    base.view(-1)[[3, 100, 400]] = torch.tensor([math.inf, math.nan, -math.inf]).to(dtype)
    grad = {
        "contiguous": base,
        "channels_last": base.to(memory_format=torch.channels_last),
        "transposed": base.transpose(1, 3),
        "offset view": base.view(-1)[5:].view(415, 1),
        "gapped slice": base[:, 1:, :, ::2],
        "expanded": base[0, 0, 0].expand(60, 7),
    }[layout]
    before = grad.clone()
    expected, expected_found = torch_unscale(1024.0, [grad.clone()])
    (out,), found = famp.unscale_and_check(famp.init_scaler(1024.0), [grad])
    assert out.dtype == dtype
    assert_bitwise_equal(out, expected[0])
    assert out.stride() == torch.empty_like(grad).stride()
    assert_bitwise_equal(found, expected_found)
    assert found.item() == 1.0
    assert_bitwise_equal(grad, before)


def _unscale_and_flip(state: famp.ScalerState, grads: list[torch.Tensor]) -> Any:
    out, found = famp.unscale_and_check(state, grads)
    # Read by inductor's own loops, which index the unscaled grads with the strides famp::unscale
    # declared while tracing: a wrong declaration would read the wrong elements here.
    flipped = [o.view(_INT_OF[o.dtype]) ^ 1 for o in out]
    return out, found, flipped


_COMPILED_UNSCALE_AND_FLIP = torch.compile(_unscale_and_flip, fullgraph=True)


@pytest.mark.parametrize("fused_bytes", [0, 1 << 62], ids=["fused", "chunks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_compiled_unscale_of_grads_in_any_layout_declares_their_strides(
    monkeypatch: pytest.MonkeyPatch, fused_bytes: int, dtype: torch.dtype
) -> None:
    # Compiled on the CPU, grads are unscaled by famp::unscale, which runs out_of_place at run time
    # (here with every grad "big": chunks, the min/max path, or famp's fused program); its
    # outputs' strides must be the ones its fake declared to inductor (empty_like's).
    monkeypatch.setattr("famp._scaling.eager_cpu.CHUNK_BYTES", 64)
    monkeypatch.setattr("famp._scaling.fused.MIN_BYTES", fused_bytes)
    gen = torch.Generator().manual_seed(0)
    base = (torch.randn(2, 6, 5, 7, generator=gen) * 1e3).to(dtype)
    base.view(-1)[[3, 100, 400]] = torch.tensor([math.inf, math.nan, -math.inf]).to(dtype)
    grads = [
        base,
        base.to(memory_format=torch.channels_last),
        base.transpose(1, 3),
        base.view(-1)[5:].view(415, 1),
        base[:, 1:, :, ::2],
        base[0, 0, 0].expand(60, 7),
    ]
    expected, expected_found = torch_unscale(1024.0, [g.clone() for g in grads])
    out, found, flipped = _COMPILED_UNSCALE_AND_FLIP(famp.init_scaler(1024.0), grads)
    for g, o, f, e in zip(grads, out, flipped, expected, strict=True):
        assert_bitwise_equal(o, e)
        assert o.stride() == torch.empty_like(g).stride()
        assert torch.equal(f, e.view(_INT_OF[dtype]) ^ 1)
    assert_bitwise_equal(found, expected_found)


# Random bit patterns, so every NaN payload and sign, infinity, subnormal and signed zero can turn
# up, in tensors long enough for vectorized loops and their tails. Eagerly famp has two CPU paths
# (the kernel on runs of small tensors; a min/max and a multiply for big ones); compiled, big
# float32/float64 grads take the kernel's arithmetic as plain ops, which inductor fuses. Fixed
# shapes: one compile, shared by every example.
BIT_SHAPES = [
    ((1031,), torch.float32),
    ((7, 5), torch.float32),
    ((67,), torch.float64),
    ((259,), torch.float16),
    ((130,), torch.bfloat16),
]
_INT_OF = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def _unscale_list(state: famp.ScalerState, grads: list[torch.Tensor]) -> Any:
    return famp.unscale_and_check(state, grads)


_COMPILED_UNSCALE_LIST = torch.compile(_unscale_list, fullgraph=True)


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    info = torch.iinfo(_INT_OF[dtype])
    return torch.randint(info.min, info.max, shape, dtype=_INT_OF[dtype], generator=gen).view(dtype)


_GRAPHS: list[torch.fx.GraphModule] = []


def _recording(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    from torch._inductor.compile_fx import compile_fx  # imports inductor: only when compiling

    _GRAPHS.append(gm)
    return compile_fx(gm, example_inputs)


def _unscale_many(state: famp.ScalerState, grads: list[torch.Tensor]) -> Any:
    return famp.unscale_and_check(state, grads)


_COMPILED_UNSCALE_MANY = {
    dynamic: torch.compile(_unscale_many, fullgraph=True, dynamic=dynamic, backend=_recording)
    for dynamic in (False, True)
}


def _many_grads(gen: torch.Generator, sizes: list[int]) -> list[torch.Tensor]:
    """Grads of the given sizes, every fourth float64, half their values random bit patterns."""
    grads = []
    for i, size in enumerate(sizes):
        dtype = torch.float64 if i % 4 == 3 else torch.float32
        plain = (torch.randn(size, generator=gen) * 1e3).to(dtype)
        keep_plain = torch.rand(plain.shape, generator=gen) < 0.5
        grads.append(torch.where(keep_plain, plain, random_bits(plain.shape, dtype, gen)))
    return grads


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@given(
    seed=st.integers(0, 2**32 - 1),
    scale_value=st.sampled_from([3.0, 65536.0, 2.0**-20, 1.0, 0.1]),
)
def test_compiled_cpu_unscale_is_one_famp_op_per_dtype_and_equals_gradscaler(
    dynamic: bool, seed: int, scale_value: float
) -> None:
    # 19 grads, 3 of them over 1 MiB: compiled on the CPU, each dtype's are one famp::unscale node
    # (famp._scaling.kernels.unscale_op), none traced as plain ops or torch's kernel, whatever
    # their number, size or shape symbols; the bits are GradScaler's.
    gen = torch.Generator().manual_seed(seed)
    sizes = [(i % 5 + 3) * (70_001 if i in (1, 6, 11) else 1) for i in range(19)]
    grads = _many_grads(gen, sizes)
    _GRAPHS.clear()
    out, found_inf = _COMPILED_UNSCALE_MANY[dynamic](famp.init_scaler(scale_value), grads)
    expected, expected_found = torch_unscale(scale_value, grads)
    for o, e in zip(out, expected, strict=True):
        assert_bitwise_equal(o, e)
    assert_bitwise_equal(found_inf, expected_found)
    for graph in _GRAPHS:  # empty after the first example: the graph was compiled then
        targets = [n.target for n in graph.graph.nodes if n.op == "call_function"]
        ops = [t for t in targets if t is torch.ops.famp.unscale.default]
        assert len(ops) == 2, graph.code
        assert not [t for t in targets if "non_finite" in str(t) or t is torch.where], graph.code


_COMPILED_WHERE_PROGRAM = torch.compile(where_program, fullgraph=True, backend=_recording)


@given(
    seed=st.integers(0, 2**32 - 1),
    scale_value=st.sampled_from([3.0, 65536.0, 2.0**-20, 1.0, 0.1]),
)
def test_compiled_where_program_reads_the_scale_through_copies_and_equals_gradscaler(
    seed: int, scale_value: float
) -> None:
    # Off the CPU, compiled unscale traces big float32/float64 grads as where_program's plain ops.
    # Compiled over 15 float32 grads, 8 read the inverse scale itself and 7 a copy
    # (famp._scaling.program.reader_operand), and the flags of the first 8 are folded into a copy
    # of found_inf before the next 7: two amax copies in the graph; GradScaler's bits.
    gen = torch.Generator().manual_seed(seed)
    grads = _many_grads(gen, [i % 5 + 3 for i in range(19)])
    grads = [g for g in grads if g.dtype == torch.float32]
    inv = torch.tensor(scale_value, dtype=torch.float64).reciprocal().float()
    _GRAPHS.clear()
    out, found_inf = _COMPILED_WHERE_PROGRAM(grads, torch.zeros(()), inv)
    expected, expected_found = torch_unscale(scale_value, grads)
    for o, e in zip(out, expected, strict=True):
        assert_bitwise_equal(o, e)
    assert_bitwise_equal(found_inf, expected_found)
    for graph in _GRAPHS:
        copies = [n for n in graph.graph.nodes if n.target in ("amax", torch.amax)]
        assert len(copies) == 2, graph.code


@pytest.mark.parametrize("path", ["eager-small", "eager-big", "eager-fused", "compiled"])
@given(
    seed=st.integers(0, 2**32 - 1),
    finite_share=st.sampled_from([0.0, 0.5, 0.999, 1.0]),
    scale_value=st.sampled_from([3.0, 65536.0, 2.0**-20, 1.0, 0.1]),
)
def test_unscale_of_random_bit_patterns_equals_gradscaler(
    path: str, seed: int, finite_share: float, scale_value: float
) -> None:
    gen = torch.Generator().manual_seed(seed)
    grads = []
    for shape, dtype in BIT_SHAPES:
        plain = (torch.randn(shape, generator=gen) * 1e3).to(dtype)
        keep_plain = torch.rand(shape, generator=gen) < finite_share
        grads.append(torch.where(keep_plain, plain, random_bits(shape, dtype, gen)))
    state = famp.init_scaler(scale_value)
    # Every tensor is "big" at CHUNK_BYTES = 0: eagerly, float32/float64 take the kernel one
    # element at a time (its scalar loop), or famp's compiled program at fused.MIN_BYTES = 0, and
    # halves the min/max path; compiled, the fused plain ops (for float32/float64).
    with (
        mock.patch("famp._scaling.eager_cpu.CHUNK_BYTES", 1 << 20 if path == "eager-small" else 0),
        mock.patch("famp._scaling.fused.MIN_BYTES", 0 if path == "eager-fused" else 1 << 62),
    ):
        if path == "compiled":
            out, found_inf = _COMPILED_UNSCALE_LIST(state, grads)
        else:
            out, found_inf = famp.unscale_and_check(state, grads)
    expected, expected_found = torch_unscale(scale_value, grads, allow_fp16=True)
    for o, e in zip(out, expected, strict=True):
        assert o.dtype == e.dtype
        assert_bitwise_equal(o, e)
    assert_bitwise_equal(found_inf, expected_found)
    assert found_inf.dtype == torch.float32
