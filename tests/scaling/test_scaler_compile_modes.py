"""Every public loss-scaling function under torch.compile(fullgraph=True), in every shape mode.

Static shapes, ``dynamic=True``, ``torch._dynamo.mark_dynamic`` and the dynamic graph a shape
change compiles under the default ``dynamic=None`` must all give eager's bits, and where a function
mirrors torch, torch's (``GradScaler`` and its kernels). Under dynamic shapes sizes are symbols
while tracing: a path choice that reads one as a Python bool once skipped the unscale entirely
(issue 9). The functions run in two shared compiled functions, one graph per mode each; a
recording backend checks that each mode really compiled the graph it names.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import types
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
from torch._inductor.compile_fx import compile_fx

import famp
from tests.helpers import assert_bitwise_equal, assert_trees_bitwise_equal
from tests.scaling.test_scaler import torch_unscale, torch_unscale_anywhere, torch_update
from tests.scaling.test_scaler_unscale import _INT_OF, random_bits

MODES = ["static", "dynamic", "mark_dynamic", "recompile"]
# float16 takes bfloat16's paths (the kernel, compiled or not); each leaf adds compile time.
DTYPES = {"w": torch.float32, "b": torch.bfloat16, "d": torch.float64}
SCALES = [3.0, 1.0, 2.0**-20, 65536.0]
# On CUDA, inductor writes Triton kernels and torch's oracles are its CUDA kernels.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


class _Recorder:
    """Inductor, recording for every graph it compiles whether the graph has symbolic sizes."""

    def __init__(self) -> None:
        self.dynamic: list[bool] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        def symbolic(x: object) -> bool:
            if isinstance(x, torch.SymInt):
                return True
            return isinstance(x, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in x.shape)

        self.dynamic.append(any(symbolic(x) for x in example_inputs))
        return compile_fx(gm, example_inputs)


_COMPILED: dict[tuple[Callable[..., Any], str, str], tuple[Callable[..., Any], _Recorder]] = {}


def compiled_in(
    mode: str, fn: Callable[..., Any], device: str = "cpu"
) -> tuple[Callable[..., Any], _Recorder]:
    """One compiled function per (fn, mode, device), shared by the tests.

    Each mode compiles its own copy of fn's code: dynamo keeps caches and the sizes it has seen
    per code object, so modes sharing one would reuse each other's graphs.
    """
    key = (fn, mode, device)
    if key not in _COMPILED:
        code = fn.__code__.replace(co_name=f"{fn.__name__}_{mode}_{device}")
        copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__)
        recorder = _Recorder()
        dynamic = True if mode == "dynamic" else None
        _COMPILED[key] = (
            torch.compile(copy, fullgraph=True, dynamic=dynamic, backend=recorder),
            recorder,
        )
    return _COMPILED[key]


_EXPONENT = {torch.bfloat16: 0x7F80, torch.float32: 0x7F800000, torch.float64: 0x7FF << 52}


def grads_of(
    n: int, gen: torch.Generator, *, finite: bool, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """Grads of every dtype, shaped by n: finite values, or random bit patterns of which every
    other element has its exponent set (an infinity or a NaN with a random payload and sign)."""
    out = {}
    for name, dtype in DTYPES.items():
        shape = (2, n) if name == "w" else (n,)
        if finite:
            out[name] = (torch.randn(shape, generator=gen) * 1e3).to(dtype)
        else:
            bits = random_bits(shape, dtype, gen)
            ints = bits.view(_INT_OF[dtype])
            ints[..., ::2] |= _EXPONENT[dtype]
            out[name] = bits
    return {name: g.to(device) for name, g in out.items()}


def mark(tree: Any) -> Any:
    for t in optree.tree_leaves(tree):
        for d, size in enumerate(t.shape):
            if size > 1:
                torch._dynamo.mark_dynamic(t, d)
    return tree


def run_in(
    mode: str,
    fn: Callable[..., Any],
    make_args: Callable[[int], tuple[Any, ...]],
    device: str = "cpu",
) -> list[tuple[tuple[Any, ...], Any]]:
    """Call fn compiled in ``mode``; returns (args, compiled output) of every call made.

    ``make_args(n)`` builds fresh arguments (on ``device``) whose tensor sizes depend on n.
    """
    compiled, recorder = compiled_in(mode, fn, device)
    sizes = [5, 7] if mode == "recompile" else [5]
    calls = []
    for n in sizes:
        args = make_args(n)
        if mode == "mark_dynamic":
            mark(args[1:])
        calls.append((args, compiled(*args)))
    # The graph that ran was compiled in this mode: static, or with symbolic sizes. (Under
    # dynamic=True, dynamo may restart a compile once, which the backend sees as two graphs.)
    assert recorder.dynamic, "nothing was compiled"
    assert recorder.dynamic[-1] == (mode != "static"), (mode, recorder.dynamic)
    if mode in ("static", "recompile"):
        assert recorder.dynamic[0] is False, (mode, recorder.dynamic)
    return calls


# --- scale, unscale_and_check (with and without donate), update_scale, all_finite, select_tree,
# skip_on_overflow: one function, fed finite grads and random bit patterns -----------------------


def loss_scaling(
    state: famp.ScalerState,
    grads: dict[str, torch.Tensor],
    donated: dict[str, torch.Tensor],
    params: dict[str, torch.Tensor],
    loss: torch.Tensor,
    donated_state: famp.ScalerState,
) -> tuple[Any, ...]:
    scaled = famp.scale(state, {"loss": loss, "grads": grads})
    unscaled, found_inf = famp.unscale_and_check(state, grads)
    in_place, donated_found = famp.unscale_and_check(state, donated, donate=True)
    finite = famp.all_finite(grads)
    new_state = famp.update_scale(state, found_inf)
    donated_new = famp.update_scale(donated_state, found_inf, donate=True)
    selected = famp.select_tree(finite, unscaled, params)
    kept = famp.skip_on_overflow(found_inf, unscaled, params)
    return (
        scaled,
        unscaled,
        found_inf,
        in_place,
        donated_found,
        finite,
        new_state,
        donated_new,
        selected,
        kept,
    )


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("finite", [True, False], ids=["finite", "random-bits"])
def test_loss_scaling_functions_compiled_in_every_shape_mode_equal_eager_and_torch(
    mode: str, finite: bool, device: str
) -> None:
    gen = torch.Generator().manual_seed(0)
    for scale_value in SCALES:

        def make_args(n: int, scale_value: float = scale_value) -> tuple[Any, ...]:
            grads = grads_of(n, gen, finite=finite, device=device)
            donated = {k: v.clone() for k, v in grads.items()}
            params = {k: torch.full_like(v, 0.5) for k, v in grads.items()}
            loss = torch.tensor(0.75, dtype=torch.bfloat16, device=device)
            state = famp.init_scaler(scale_value, device=device)
            donated_state = famp.init_scaler(scale_value, device=device)
            return state, grads, donated, params, loss, donated_state

        for args, out in run_in(mode, loss_scaling, make_args, device):
            state, grads, donated, params, loss, _ = args
            originals = {k: v.clone() for k, v in grads.items()}
            # the donated tree and state were consumed: eager runs on copies of what they held
            eager = loss_scaling(
                state,
                grads,
                {k: v.clone() for k, v in grads.items()},
                params,
                loss,
                famp.init_scaler(scale_value, device=device),
            )
            # famp.scale is a multiply, which inductor compiles with its own NaN bit pattern for
            # bfloat16 (all ones, where eager writes 0x7FC0): NaN where eager has NaN, every
            # other element bitwise. Everything else: eager's bits, NaN payloads included.
            assert_trees_bitwise_equal(out[1:], eager[1:])
            for a, e in zip(optree.tree_leaves(out[0]), optree.tree_leaves(eager[0]), strict=True):
                assert_bitwise_equal(torch.isnan(a), torch.isnan(e))
                keep = ~torch.isnan(e)
                assert_bitwise_equal(a[keep], e[keep])
            (
                scaled,
                unscaled,
                found_inf,
                in_place,
                donated_found,
                finite_,
                new_state,
                donated_new,
                selected,
                kept,
            ) = out
            # torch as the oracle
            scaler = torch.amp.GradScaler(device, init_scale=scale_value)
            assert_bitwise_equal(scaled["loss"], scaler.scale(loss))
            assert scaled["loss"].dtype == torch.float32
            for k, g in originals.items():
                assert_bitwise_equal(eager[0]["grads"][k], scaler.scale(g))
            expected, expected_found = torch_unscale_anywhere(
                scale_value, list(originals.values()), allow_fp16=True
            )
            for k, e in zip(originals, expected, strict=True):
                assert unscaled[k].dtype == DTYPES[k]
                assert_bitwise_equal(unscaled[k], e)
                assert_bitwise_equal(in_place[k], e)
                assert_bitwise_equal(donated[k], e)  # unscaled in place, the buffers given
            assert_bitwise_equal(found_inf, expected_found)
            assert_bitwise_equal(donated_found, expected_found)
            assert found_inf.item() == float(not finite)
            expected_scale, expected_tracker = torch_update(
                state.scale, state.growth_tracker, found_inf.item(), state
            )
            for updated in (new_state, donated_new):
                assert_bitwise_equal(updated.scale, expected_scale)
                assert_bitwise_equal(updated.growth_tracker, expected_tracker)
            all_finite = all(
                math.isfinite(x) for g in originals.values() for x in g.double().flatten().tolist()
            )
            assert finite_.item() == all_finite
            chosen = unscaled if all_finite else params
            assert_trees_bitwise_equal(selected, chosen)
            assert_trees_bitwise_equal(kept, chosen)


# --- value_and_grad through famp.autocast: GradScaler's grads and scale -------------------------

POLICY = famp.get_policy("params=float32,compute=bfloat16,output=float32")
DOT = famp.autocast(lambda w, x: x @ w, POLICY)


def dot_loss(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return DOT(w, x)


def value_and_grad_step(
    state: famp.ScalerState, w: torch.Tensor, x: torch.Tensor
) -> tuple[Any, ...]:
    return famp.value_and_grad(dot_loss)(state, w, x)


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", MODES)
def test_value_and_grad_compiled_in_every_shape_mode_equals_gradscaler(
    mode: str, device: str
) -> None:
    # Small integers: exact in bfloat16 whatever order a reduction takes, so eager, inductor and
    # torch.autocast agree bit for bit; an inf in x overflows the grad.
    for bad in (False, True):

        def make_args(n: int, bad: bool = bad) -> tuple[Any, ...]:
            x = torch.arange(1.0, n + 1.0, device=device)
            if bad:
                x[1] = math.inf
            state = famp.init_scaler(2.0**10, growth_interval=1, device=device)
            return state, torch.full((n,), 2.0, device=device), x

        for (state, w, x), out in run_in(mode, value_and_grad_step, make_args, device):
            assert_trees_bitwise_equal(out, value_and_grad_step(state, w, x))
            loss, grad, found_inf, new_state = out
            # the same step with torch.autocast and GradScaler
            param = torch.nn.Parameter(w.clone())
            scaler = torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=1)
            opt = torch.optim.SGD([param], lr=0.0)
            with torch.autocast(device, dtype=torch.bfloat16):
                expected_loss = x @ param
            scaler.scale(expected_loss.float()).backward()
            scaler.unscale_(opt)
            assert_bitwise_equal(loss, expected_loss.float())
            assert grad.dtype == torch.float32
            assert param.grad is not None
            assert_bitwise_equal(grad, param.grad)
            assert found_inf.item() == float(bad)
            scaler.step(opt)
            scaler.update()
            assert_bitwise_equal(new_state.scale, scaler._scale)


# --- containers: compiled, leaves are gathered and put back by tree_map --------------------------


def _rich_grads() -> dict[str, Any]:
    """Grads in every container kind: dict keys out of order, None, a namedtuple, nested lists
    and tuples, three dtypes, a leaf over 1 MiB (traced as plain ops) and an infinity."""
    pair = collections.namedtuple("pair", "x y")
    gen = torch.Generator().manual_seed(5)
    big = torch.randn(300_000, generator=gen) * 1024
    return {
        "z": torch.randn(3, 2, generator=gen) * 1024,
        "n": None,
        "p": pair(torch.randn(4, generator=gen).to(torch.float64), big),
        "l": [torch.randn(5, generator=gen).to(torch.bfloat16), (torch.tensor([1.0, math.inf]),)],
        "a": [],
    }


@pytest.mark.parametrize("fn", ["unscale_and_check", "scale", "all_finite"])
def test_tree_functions_compiled_over_every_container_equal_torch(fn: str) -> None:
    grads = _rich_grads()
    state = famp.init_scaler(1024.0)
    calls = {
        "unscale_and_check": lambda s, g: famp.unscale_and_check(s, g),
        "scale": lambda s, g: famp.scale(s, g),
        "all_finite": lambda s, g: famp.all_finite(g),
    }
    out = torch.compile(calls[fn], fullgraph=True)(state, grads)
    leaves = optree.tree_leaves(grads)
    if fn == "all_finite":
        assert_bitwise_equal(out, torch.tensor(False))
        return
    tree = out[0] if fn == "unscale_and_check" else out
    assert optree.tree_structure(tree) == optree.tree_structure(grads)
    assert list(tree) == list(grads)  # the key order of the tree given
    if fn == "unscale_and_check":
        expected, found_inf = torch_unscale(1024.0, leaves, allow_fp16=True)
        assert_bitwise_equal(out[1], found_inf)
        assert found_inf.item() == 1.0
    else:
        expected = [x * state.scale for x in leaves]
    for got, want in zip(optree.tree_leaves(tree), expected, strict=True):
        assert_bitwise_equal(got, want)


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        ("unscale_and_check", r"unscale_and_check: the leaf at tree\['b'\]\[1\]\[1\] must be"),
        ("scale", r"scale: the leaf at tree\['b'\]\[1\]\[1\] must be a Tensor or None, got int"),
        ("all_finite", r"all_finite: the leaf at tree\['b'\]\[1\]\[1\] must be a Tensor"),
    ],
)
def test_tree_functions_compiled_name_the_bad_leaf(fn: str, message: str) -> None:
    pair = collections.namedtuple("pair", "x y")
    bad = {"b": [None, pair(torch.ones(2), 3)], "a": torch.ones(1)}
    calls = {
        "unscale_and_check": lambda s, g: famp.unscale_and_check(s, g),
        "scale": lambda s, g: famp.scale(s, g),
        "all_finite": lambda s, g: famp.all_finite(g),
    }
    compiled = torch.compile(calls[fn], fullgraph=True, backend="eager")  # raises while tracing
    with pytest.raises(Exception) as info:  # noqa: PT011 - Dynamo wraps it; famp's is the cause
        compiled(famp.init_scaler(2.0), bad)
    chain, seen = "", info.value
    while seen is not None:
        chain += f"{type(seen).__name__}: {seen}\n"
        seen = seen.__cause__
    assert re.search(message, chain), chain
    assert "TypeError" in chain


@pytest.mark.parametrize(
    "grads", [[], {"n": None}, ([], {"a": None})], ids=["list", "none", "nested"]
)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_unscale_and_check_of_a_tree_without_tensors_equals_gradscaler(
    grads: Any, compiled: bool
) -> None:
    state = famp.init_scaler(1024.0)
    fn = famp.unscale_and_check
    if compiled:
        fn = torch.compile(lambda s, g: famp.unscale_and_check(s, g), fullgraph=True)
    out, found_inf = fn(state, grads)
    # GradScaler over a parameter without a gradient: it records no found_inf, which reads as 0.
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scaler.scale(torch.ones(()))
    scaler.unscale_(opt)
    per_device = scaler._found_inf_per_device(opt)
    assert per_device == {}
    expected = torch.zeros(())
    assert optree.tree_structure(out) == optree.tree_structure(grads)
    assert_bitwise_equal(found_inf, expected)
    assert found_inf.device == state.scale.device
    again = fn(state, grads)[1]
    assert again is not found_inf  # a new tensor each call, never one the caller may hold


# --- guards and defaults that Dynamo makes symbolic -------------------------------------------


def _compiled_own(fn: Callable[..., Any], mode: str) -> Callable[..., Any]:
    """`fn` compiled with `dynamic` False, True or None, on a code object of its own per mode."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{mode}")
    copy = types.FunctionType(code, fn.__globals__, code.co_name)
    dynamic = {"static": False, "dynamic": True, "recompile": None}[mode]
    return torch.compile(copy, fullgraph=True, dynamic=dynamic)


_GUARD_STEPS = [1.0] * 3 + [0.0] * 3  # back off to min_scale, then grow to max_scale


def _guarded_run(state: famp.ScalerState, found: torch.Tensor) -> famp.ScalerState:
    for i in range(len(_GUARD_STEPS)):
        state = famp.update_scale(state, found[i])
    return state


# min_scale/max_scale pairs whose float32 values need rounding: 0.1 and 1e10 once from a double,
# 2**60 + 2**36 + 1 straight from the int (2**60 + 2**37; through a double it would be 2**60).
GUARDS = [(1.0, None), (0.1, 1e10), (3, 2**60 + 2**36 + 1), (None, 2.0**40)]


@pytest.mark.parametrize("mode", ["static", "dynamic", "recompile"])
def test_update_scale_with_guards_compiled_in_every_mode_equals_eager(mode: str) -> None:
    """Every (min_scale, max_scale) pair through one compiled function: eager's bits.

    Before 2026-12-01 a guard that Dynamo made symbolic (every one under `dynamic=True`; under
    the default, the second state with another value) raised Dynamo's `Unsupported`
    ("assume_constant_result argument conversion failed"). Eager famp's guarded update is
    checked against a model of the documented rule (`test_scaler_guards.py`), unguarded
    against torch's kernel.
    """
    run = _compiled_own(_guarded_run, mode)
    found = torch.tensor(_GUARD_STEPS)
    for low, high in GUARDS:
        init = 2.0**5 if high != 2**60 + 2**36 + 1 else 2.0**59
        state = famp.init_scaler(
            init, growth_factor=16.0, backoff_factor=0.125, growth_interval=1,
            min_scale=low, max_scale=high,
        )  # fmt: skip
        got, want = run(state, found), _guarded_run(state, found)
        assert_trees_bitwise_equal(optree.tree_leaves(got), optree.tree_leaves(want))
        if isinstance(high, int):  # capped at max_scale's float32 value, rounded from the int
            assert got.scale.item() == 2.0**60 + 2.0**37
    plain = famp.init_scaler(2.0**5, growth_interval=1)
    scale, tracker = plain.scale, plain.growth_tracker
    for f in _GUARD_STEPS:
        scale, tracker = torch_update(scale, tracker, f, plain)
    assert_bitwise_equal(run(plain, found).scale, scale)


def _fresh_state(x: torch.Tensor) -> tuple[torch.Tensor, famp.ScalerState]:
    state = famp.init_scaler(4.0)  # every default: Dynamo reads them off init_scaler
    state = famp.update_scale(state, torch.isinf(x).any().float())
    return famp.scale(state, x), state


@pytest.mark.parametrize("mode", ["static", "dynamic", "recompile"])
def test_init_scaler_with_its_defaults_compiles_in_every_mode(mode: str) -> None:
    """Built inside the compiled function, with its default factors: torch's kernel's numbers.

    Before 2026-12-01, under `dynamic=True`, Dynamo made the default `growth_factor` a symbolic
    float and its `math.isfinite` check raised `Unsupported`.
    """
    run = _compiled_own(_fresh_state, mode)
    for n, bad in ((3, False), (5, True)):  # another size: a recompile, or the same graph
        x = torch.arange(float(n))
        x[-1] = math.inf if bad else x[-1]
        scaled, state = run(x)
        start = famp.init_scaler(4.0)
        scale, tracker = torch_update(start.scale, start.growth_tracker, float(bad), start)
        assert_bitwise_equal(state.scale, scale)
        assert_bitwise_equal(state.growth_tracker, tracker)
        assert_bitwise_equal(scaled, x * scale)
        statics = (state.growth_factor, state.backoff_factor, state.growth_interval)
        assert statics == (2.0, 0.5, 2000)


def _replaced(state: famp.ScalerState, found: torch.Tensor, change: dict[str, Any]) -> Any:
    return famp.update_scale(dataclasses.replace(state, **change), found).scale


_BAD_REPLACEMENTS = [
    ({"backoff_factor": 2.0}, ValueError, "backoff_factor must be a number in \\(0, 1\\), got 2.0"),
    ({"growth_factor": 0.5}, ValueError, "growth_factor must be a finite number > 1.0, got 0.5"),
    ({"scale": torch.tensor(8)}, TypeError, "ScalerState.scale must be a torch.float32 tensor"),
    ({"hysteresis": 2}, ValueError, "overflow_count must be a 0-d int32 tensor"),
]


@pytest.mark.parametrize(("change", "error", "message"), _BAD_REPLACEMENTS)
@pytest.mark.parametrize("fullgraph", [True, False])
def test_a_state_rebuilt_inside_a_compiled_step_is_checked_as_eagerly(
    change: dict[str, Any], error: type[Exception], message: str, fullgraph: bool
) -> None:
    """`dataclasses.replace` (loss-scaling.md's stand-in for `GradScaler.update(new_scale=...)`)
    inside a compiled step refuses what it refuses eagerly.

    Before 2026-12-01 `ScalerState` skipped its checks while Dynamo traced: the compiled step
    took `backoff_factor=2.0` and doubled the scale on an overflow, `growth_factor=0.5` halved it
    where it should grow. With `fullgraph=True` Dynamo wraps the error in its own `Unsupported`
    ("Observed exception"), which names famp's message.
    """
    state = famp.init_scaler(8.0, growth_interval=1)
    with pytest.raises(error, match=message):
        _replaced(state, torch.tensor(1.0), change)
    torch._dynamo.reset()
    step = torch.compile(_replaced, fullgraph=fullgraph)
    expected = torch._dynamo.exc.Unsupported if fullgraph else error
    with pytest.raises(expected, match=message):
        step(state, torch.tensor(1.0), change)
    doubled = {"scale": state.scale * 2}
    good = torch.compile(_replaced, fullgraph=True)(state, torch.tensor(1.0), doubled)
    want, _ = torch_update(state.scale * 2, state.growth_tracker, 1.0, state)
    assert_bitwise_equal(good, want)  # a valid replacement passes, torch's kernel's numbers


_EDGE_BOUNDS = [
    2.0**-128 + 2.0**-150,  # rounds to 2**-128 in float32: its reciprocal is inf
    math.nextafter(2.0**-128 + 2.0**-150, 1.0),
    2.0**-128,
    float(torch.finfo(torch.float32).max),
    math.nextafter(float(torch.finfo(torch.float32).max), math.inf),
    2**128,
    1,
]


def _with_min_scale(state: famp.ScalerState, low: float) -> torch.Tensor:
    return dataclasses.replace(state, min_scale=low).scale * 1


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_compiled_checks_of_a_bound_refuse_what_eager_refuses(mode: str) -> None:
    """Compiled, `min_scale` is checked by comparisons (Dynamo may hold it as a symbolic
    float): the same values as eagerly, at both ends of the usable range."""
    state = famp.init_scaler(8.0)
    for low in _EDGE_BOUNDS:
        try:
            _with_min_scale(state, low)
            eager_ok = True
        except ValueError:
            eager_ok = False
        torch._dynamo.reset()
        step = torch.compile(_with_min_scale, fullgraph=False, dynamic=mode == "dynamic")
        try:
            step(state, low)
            compiled_ok = True
        except ValueError:
            compiled_ok = False
        assert compiled_ok == eager_ok, (low, eager_ok)
    assert not _ok(_EDGE_BOUNDS[0])  # both sides of the lower end
    assert _ok(_EDGE_BOUNDS[1])


def _ok(low: float) -> bool:
    try:
        famp.init_scaler(8.0, min_scale=low)
    except ValueError:
        return False
    return True
