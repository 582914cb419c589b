"""torch's weight-cast cache across switches between two lower dtypes (a float16 module rule or
nested call in a bfloat16 call, the function's own `torch.autocast`), eagerly.

torch's cache is keyed without the dtype: `torch.autocast` nested by hand keeps the cast of a
weight read on one side of a switch for its next read on that side (its gradients then sum in
the lower dtype), and reads a cast of the wrong dtype for a weight read on both. famp keeps the
first (it empties the cache only before an op reads a weight last read in the other dtype) and
fixes the second; where ops famp does not watch may have cached casts, it empties the cache at
the switch itself. Each case against `torch.autocast` by hand, with `torch.clear_autocast_cache()`
written where famp empties it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

import famp
from tests.helpers import assert_bitwise_equal

BF16, F16 = torch.bfloat16, torch.float16


class _Inner(nn.Module):
    def __init__(self, b: nn.Linear, shared: nn.Linear | None) -> None:
        super().__init__()
        self.b = b
        self.shared = shared  # a weight read in both dtypes, or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(x)
        if self.shared is not None:
            h = self.shared(h)
        return self.b(h)  # type: ignore[no-any-return]


class _Around(nn.Module):
    """`a` (bfloat16) read before and after two calls of `inner` (float16 by a rule or a nested
    call), which reads `b` twice and, with `cross`, `a` too; with `reentrant` set, checkpointed
    (the recomputation reads `a` before the first switch and after the last)."""

    def __init__(self, cross: bool = False, reentrant: bool | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.inner = _Inner(nn.Linear(8, 8), self.a if cross else None)
        self.nested: Callable[[torch.Tensor], torch.Tensor] | None = None  # set by a case
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reentrant is None:
            return self.body(x)
        return checkpoint(self.body, x, use_reentrant=self.reentrant)  # type: ignore[no-any-return]

    def body(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        inner = self.inner if self.nested is None else self.nested
        return self.a(inner(h).to(h.dtype) + inner(h.tanh()).to(h.dtype))  # type: ignore[no-any-return]


# Where famp empties torch's cache at each switch (as before 2026-11-30, and still where ops it
# does not watch ran): entering and leaving each float16 stretch.
AT_SWITCHES = ("enter 1", "exit 1", "enter 2", "exit 2")


def _by_hand(
    model: _Around, x: torch.Tensor, clears: tuple[str, ...] = (), first: bool = False
) -> torch.Tensor:
    """torch.autocast nested by hand, its cache emptied at the points `clears` names: entering
    or leaving float16 stretch 1 or 2, before the read of `a` in stretch 1 ("cross 1") or the
    last read of `a` ("last"). `first`: `a` is read once before, its result unused."""

    def inner(h: torch.Tensor, n: int) -> torch.Tensor:
        with torch.autocast("cpu", dtype=F16):
            if f"enter {n}" in clears:
                torch.clear_autocast_cache()
            g = model.inner.b(h.half())
            if model.inner.shared is not None:
                if f"cross {n}" in clears:
                    torch.clear_autocast_cache()
                g = model.inner.shared(g)
            g = model.inner.b(g).float()
        if f"exit {n}" in clears:
            torch.clear_autocast_cache()
        return g

    def body(x: torch.Tensor) -> torch.Tensor:
        h = model.a(x)
        g = inner(h, 1).to(BF16) + inner(h.tanh(), 2).to(BF16)
        if "last" in clears:
            torch.clear_autocast_cache()
        return model.a(g)  # type: ignore[no-any-return]

    with torch.autocast("cpu", dtype=BF16):
        if first:
            model.a(x)
        if model.reentrant is None:
            return body(x).float()
        return checkpoint(body, x, use_reentrant=model.reentrant).float()  # type: ignore[no-any-return]


def _grads(out: torch.Tensor, model: nn.Module) -> list[torch.Tensor]:
    """`out` and the gradients of its squares' sum (by `backward`: a reentrant checkpoint
    refuses `torch.autograd.grad`)."""
    model.zero_grad(set_to_none=True)
    out.pow(2).sum().backward()
    return [out, *(p.grad for p in model.parameters() if p.grad is not None)]


def _rule(model: _Around) -> Callable[[torch.Tensor], torch.Tensor]:
    return famp.autocast(model, "c=bf16,o=f32", module_rules={"inner": "c=f16,o=f32"})


def _nested_call(model: _Around) -> Callable[[torch.Tensor], torch.Tensor]:
    # A nested call without a mode of its own; the outer call watches its ops.
    model.nested = famp.autocast(model.inner, "c=f16,o=f32")
    return famp.autocast(model, "c=bf16,o=f32", track_casts=True)


def _nested_call_with_a_mode(model: _Around) -> Callable[[torch.Tensor], torch.Tensor]:
    model.nested = famp.autocast(model.inner, "c=f16,o=f32", track_casts=True)
    return famp.autocast(model, "c=bf16,o=f32", module_rules={"a": "c=bf16,o=bf16"})


def _own_autocast(model: _Around) -> Callable[[torch.Tensor], torch.Tensor]:
    def inner(h: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=F16):
            return model.inner(h.half()).float()  # type: ignore[no-any-return]

    model.nested = inner
    return famp.autocast(model, "c=bf16,o=f32", track_casts=True)


SWITCHES = {
    "module rule": _rule,
    "nested call without a mode": _nested_call,
    "nested call with a mode": _nested_call_with_a_mode,
    "the function's own torch.autocast": _own_autocast,
}


@pytest.mark.parametrize("reentrant", [None, False, True], ids=["", "checkpoint", "reentrant"])
@pytest.mark.parametrize("case", SWITCHES)
def test_casts_of_weights_read_on_one_side_of_a_switch_stay_cached_as_torch(
    case: str, reentrant: bool | None
) -> None:
    # `a`'s bfloat16 cast serves both its reads, around two float16 stretches; `b`'s float16
    # cast serves its four reads. famp had emptied the cache at each switch: the gradients of
    # `a` and `b` rounded as with one cast per stretch (0.002-0.016 off torch's). Checkpointed,
    # the recomputation casts as the forward did.
    model = _Around(reentrant=reentrant)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    f = SWITCHES[case](model)
    with torch.autocast("cpu", dtype=BF16):  # a call inside torch.autocast first: no trace left
        famp.autocast(model.a, "c=bf16,o=f32", track_casts=True)(x)
    expected = _grads(_by_hand(model, x), model)
    for a, e in zip(_grads(f(x), model), expected, strict=True):
        assert_bitwise_equal(a, e)
    if case == "module rule" and reentrant is None:  # the cache's share: without it, a change
        uncached = _grads(_by_hand(model, x, AT_SWITCHES), model)
        assert not torch.equal(uncached[1], expected[1])
        assert not torch.equal(uncached[3], expected[3])


@pytest.mark.parametrize("reentrant", [None, False], ids=["", "checkpoint"])
@pytest.mark.parametrize("case", SWITCHES)
def test_a_weight_read_in_both_dtypes_gets_a_cast_in_each_emptied_before_the_read(
    case: str, reentrant: bool | None
) -> None:
    # `a` is read in float16 inside the float16 stretches too: torch by hand reads its bfloat16
    # cast there (a dtype error). famp empties the cache just before a read of `a` in the other
    # dtype than its last, no sooner: `b`'s first float16 cast goes with it, its second stays.
    model = _Around(cross=True, reentrant=reentrant)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    f = SWITCHES[case](model)
    expected = _grads(_by_hand(model, x, ("cross 1", "last")), model)
    for a, e in zip(_grads(f(x), model), expected, strict=True):
        assert_bitwise_equal(a, e)
    with pytest.raises(RuntimeError, match="dtype"):  # what torch by hand does without a clear
        _by_hand(model, x)


def _outer_autocast(model: _Around) -> Callable[[torch.Tensor], torch.Tensor]:
    # `a` cast by torch.autocast before famp's call starts, inside it.
    f = _rule(model)

    def run(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16):
            model.a(x)
            return f(x)

    return run


def _outer_call_without_a_mode(model: _Around) -> Callable[[torch.Tensor], torch.Tensor]:
    model.nested = famp.autocast(model.inner, "c=f16,o=f32", track_casts=True)
    return famp.autocast(model, "c=bf16,o=f32")


def test_casts_made_before_the_call_in_its_torch_autocast_are_emptied_at_the_first_switch() -> None:
    # `a` is cast by torch.autocast before famp's call starts inside it, and read in float16
    # inside the call: famp cannot know which weights such ops cast, and empties the cache at
    # its first switch; from there on it watches every read.
    model = _Around(cross=True)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    expected = _grads(_by_hand(model, x, ("enter 1", "last"), first=True), model)
    for a, e in zip(_grads(_outer_autocast(model)(x), model), expected, strict=True):
        assert_bitwise_equal(a, e)


@pytest.mark.parametrize("cross", [False, True])
def test_a_call_without_a_mode_around_a_switch_empties_the_cache_at_each_switch(
    cross: bool,
) -> None:
    # An outermost call without overrides, module rules or `track_casts` has no mode: famp does
    # not see the weights its ops read, and empties the cache entering and leaving each nested
    # call in another lower dtype (a known limit: docs/autocast.md).
    model = _Around(cross=cross)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    expected = _grads(_by_hand(model, x, AT_SWITCHES), model)
    for a, e in zip(_grads(_outer_call_without_a_mode(model)(x), model), expected, strict=True):
        assert_bitwise_equal(a, e)


def test_a_read_with_autocast_off_leaves_no_dtype_to_switch_from() -> None:
    # A weight read with autocast off (its dtype in effect stays float16 there) has no cast in
    # torch's cache: its next read in bfloat16 empties nothing, and `b`'s cast serves both reads.
    torch.manual_seed(0)
    a, b = nn.Linear(8, 8), nn.Linear(8, 8)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))

    def f(x: torch.Tensor) -> torch.Tensor:
        h = b(x)
        with torch.autocast("cpu", dtype=F16), torch.autocast("cpu", enabled=False):
            g = a(x)
        return b(a(h) + g.to(h.dtype)).float()  # type: ignore[no-any-return]

    params = [*a.parameters(), *b.parameters()]
    out = famp.autocast(f, "c=bf16,o=f32", track_casts=True)(x)
    got = [out, *torch.autograd.grad(out.pow(2).sum(), params)]
    with torch.autocast("cpu", dtype=BF16):
        out = f(x)
    expected = [out, *torch.autograd.grad(out.pow(2).sum(), params)]
    for g, e in zip(got, expected, strict=True):
        assert_bitwise_equal(g, e)


def test_calls_inside_a_torch_autocast_let_go_of_the_weights_they_read() -> None:
    # A functional loop makes new weights each step; run inside the user's torch.autocast, whose
    # cast cache lives on, famp's record of the dtype each weight was read in must not keep the
    # old ones alive.
    x = torch.randn(4, 8)
    f = famp.autocast(lambda w: x @ w, "c=bf16,o=f32", track_casts=True)
    with torch.autocast("cpu", dtype=BF16):
        w = torch.randn(8, 8, requires_grad=True)
        assert f(w).dtype == torch.float32
        gone = weakref.ref(w)
        del w
        torch.clear_autocast_cache()  # torch's own reference to its cast
        assert gone() is None
    w = torch.randn(8, 8, requires_grad=True)  # and outside one
    f(w)
    gone = weakref.ref(w)
    del w
    assert gone() is None


_NAMES = {BF16: "bf16", F16: "f16", torch.float32: "f32"}


class _Stretches(nn.Module):
    """Linear layers called in `order` (with repeats), each in its own dtype."""

    def __init__(self, n: int, order: list[int]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))
        self.order = order
        self.calls: list[Callable[[torch.Tensor], torch.Tensor]] | None = None  # nested calls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        calls = self.layers if self.calls is None else self.calls
        for i in self.order:
            x = torch.tanh(calls[i](x))
        return x


@settings(max_examples=30, deadline=None)
@given(
    dtypes=st.lists(st.sampled_from([BF16, F16, torch.float32]), min_size=2, max_size=4),
    picks=st.lists(st.integers(0, 3), min_size=2, max_size=8),
    call=st.sampled_from([BF16, F16]),
    nested=st.booleans(),
)
def test_random_stretches_of_dtypes_keep_torchs_casts(
    dtypes: list[torch.dtype], picks: list[int], call: torch.dtype, nested: bool
) -> None:
    # Each weight is read in one dtype only, in stretches of module rules (or nested calls)
    # in any order: famp's outputs and gradients equal torch.autocast nested by hand, bit for
    # bit, its cache keeping every cast for the whole call.
    order = [i % len(dtypes) for i in picks]
    model, x = _Stretches(len(dtypes), order), torch.randn(4, 8)
    if nested:
        model.calls = [
            famp.autocast(layer, f"c={_NAMES[d]},o=f32")
            for layer, d in zip(model.layers, dtypes, strict=True)
        ]
        f = famp.autocast(model, f"c={_NAMES[call]},o=f32", track_casts=True)
    else:
        rules = {f"layers.{i}": f"c={_NAMES[d]},o=f32" for i, d in enumerate(dtypes)}
        f = famp.autocast(model, f"c={_NAMES[call]},o=f32", module_rules=rules)

    def by_hand(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=call):
            for i in order:
                d = dtypes[i]
                with torch.autocast("cpu", dtype=d, enabled=d is not torch.float32):
                    x = torch.tanh(model.layers[i](x.to(d)).float())
        return x

    got = [f(x)]
    got += torch.autograd.grad(got[0].pow(2).sum(), list(model.parameters()), allow_unused=True)
    expected = [by_hand(x)]
    expected += torch.autograd.grad(
        expected[0].pow(2).sum(), list(model.parameters()), allow_unused=True
    )
    for a, e in zip(got, expected, strict=True):
        assert (a is None) == (e is None)
        if a is not None:
            assert_bitwise_equal(a, e)


def _custom_backward(inner: Callable[[torch.Tensor], torch.Tensor], w: torch.Tensor) -> Any:
    class Twice(torch.autograd.Function):
        @staticmethod
        @torch.amp.custom_fwd(device_type="cpu")
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        @torch.amp.custom_bwd(device_type="cpu")
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            b = inner(g.float())  # reads `w` in float16
            a = (g @ w).float()  # in the forward's bfloat16: torch caches `w`'s bfloat16 cast
            return g * 2 + (a + b) / 64

    return Twice.apply


@pytest.mark.parametrize("inside", [False, True], ids=["backward after", "backward inside"])
@pytest.mark.parametrize("reentrant", [True, False])
def test_a_custom_backward_run_without_famps_modes_gets_its_cache_emptied_at_the_switch(
    reentrant: bool, inside: bool
) -> None:
    # torch's autograd engine runs a custom backward inside a checkpointed block without famp's
    # modes, though famp's replay of the call is entered: its ops go unwatched. A nested float16
    # call there empties the cache as it starts and ends, as by hand; famp had read the bfloat16
    # cast of `w` there (a dtype error) once switches stopped emptying it. The backward runs
    # after the call, or inside it, and then the call's next switch empties the cache too.
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)

    def forward(inner: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        twice = _custom_backward(inner, w)
        return checkpoint(lambda x: twice(x).tanh(), x, use_reentrant=reentrant).sum()  # type: ignore[no-any-return]

    def run(inner: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        out = forward(inner)
        if not inside:
            return [out]
        # Back in the call after the backward: `w`'s bfloat16 cast, made without famp's modes,
        # is still in torch's cache; a float16 read of `w` must not get it.
        return [*_backward(out, x), inner(x.detach())]

    def by_hand(g: torch.Tensor) -> torch.Tensor:
        torch.clear_autocast_cache()
        with torch.autocast("cpu", dtype=F16):
            h = (g.half() @ w).float()
        torch.clear_autocast_cache()
        return h

    inner = famp.autocast(lambda g: g @ w, "c=f16,o=f32", track_casts=True)
    got = famp.autocast(lambda x: run(inner), "c=bf16,o=f32", track_casts=True)(x)
    got = got if inside else _backward(got[0], x)
    with torch.autocast("cpu", dtype=BF16):
        expected = run(by_hand)
    expected = expected if inside else _backward(expected[0], x)
    for a, e in zip(got, expected, strict=True):
        assert_bitwise_equal(a, e)


def _backward(out: torch.Tensor, x: torch.Tensor) -> list[torch.Tensor]:
    x.grad = None
    out.backward()  # a reentrant checkpoint refuses `torch.autograd.grad`
    assert x.grad is not None
    return [out, x.grad]


# A call inside the user's own `torch.autocast`, and calls in two threads: torch's cache outlives
# the call there, and other threads share it. Found by a differential hunt on 2026-11-30 (famp
# raised "mat1 and mat2 must have the same dtype" where each computation alone by hand runs).


@pytest.mark.parametrize("then", ["a famp call", "the user's op"])
@pytest.mark.parametrize("user", [BF16, F16])
def test_a_call_ending_in_the_users_autocast_leaves_no_cast_of_another_dtype(
    user: torch.dtype, then: str
) -> None:
    # The user's region goes on after the call, so torch does not empty its cache there: famp
    # empties it as the call ends if a weight's cast in it is of another dtype than the user's.
    torch.manual_seed(0)
    w, x = nn.Linear(8, 8), torch.randn(2, 8)
    other, pre = F16 if user == BF16 else BF16, nn.Linear(8, 8)
    # W under a float16 rule in a bfloat16 call (its cast stays past the rule), or a bfloat16
    # call with a mode (it watches W) in the user's float16 region.
    ruled = famp.autocast(nn.Sequential(pre, w), "c=bf16,o=f32", module_rules={"1": "c=f16"})
    call = ruled if other == F16 else famp.autocast(w, "c=bf16,o=f32", track_casts=True)
    second = famp.autocast(w, f"c={'bf16' if user == BF16 else 'f16'},o=f32")
    with torch.autocast("cpu", dtype=user):
        first = call(x)
        out = second(x) if then == "a famp call" else w(x).float()
    with torch.autocast("cpu", dtype=user):
        if other == F16:
            with torch.autocast("cpu", dtype=BF16):
                h = pre(x)
                with torch.autocast("cpu", dtype=F16):
                    ref_first = w(h.half()).float()
        else:
            with torch.autocast("cpu", dtype=BF16):
                ref_first = w(x).float()
        torch.clear_autocast_cache()  # W's cast: of `other`, read next in `user`
        ref_out = w(x).float()
    assert_bitwise_equal(first, ref_first)
    assert_bitwise_equal(out, ref_out)


def _two_threads(first: Callable[[Any], Any], second: Callable[[], Any]) -> dict[str, Any]:
    """Run `first(pause)` and `second()` in two threads: `first` calls `pause()` where `second`
    runs, whole, before `first` goes on. What each returned or raised."""
    results: dict[str, Any] = {}
    inside, finished = threading.Event(), threading.Event()

    def pause() -> None:
        inside.set()
        finished.wait(timeout=30)

    def run(name: str, fn: Callable[[], Any], before: Any, after: Any) -> None:
        try:
            if before is not None:
                before.wait(timeout=30)
            results[name] = fn()
        except Exception as error:  # reported by the test
            results[name] = error
        finally:
            if after is not None:
                after.set()
            inside.set()

    threads = [
        threading.Thread(target=run, args=("first", lambda: first(pause), None, None)),
        threading.Thread(target=run, args=("second", second, inside, finished)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def test_a_nested_calls_casts_kept_in_one_thread_meet_no_other_threads_call() -> None:
    # Thread one: a bfloat16 call with a mode, whose nested float16 call reads W; its float16
    # cast stays cached past the nested call. Thread two's bfloat16 call then read it: famp
    # counted only thread one's own dtype. A thread's nested calls' dtypes now count till its
    # outermost call ends, and thread two runs with the cache off.
    torch.manual_seed(0)
    w, xa, xb = nn.Linear(8, 8), torch.randn(2, 8), torch.randn(2, 8)
    nested = famp.autocast(w, "c=f16,o=f32")

    def first(pause: Callable[[], None]) -> torch.Tensor:
        def fn(x: torch.Tensor) -> torch.Tensor:
            h = nested(x)
            pause()
            return h

        return famp.autocast(fn, "c=bf16,o=f32", track_casts=True)(xb)

    results = _two_threads(first, lambda: famp.autocast(w, "c=bf16,o=f32")(xa))
    with torch.autocast("cpu", dtype=F16):
        ref_first = w(xb.half()).float()
    with torch.autocast("cpu", dtype=BF16):
        ref_second = w(xa).float()
    assert_bitwise_equal(results["first"], ref_first)
    assert_bitwise_equal(results["second"], ref_second)


@pytest.mark.parametrize("own_first", [True, False])
def test_the_functions_own_autocast_in_one_thread_meets_no_other_threads_casts(
    own_first: bool,
) -> None:
    # A call with a mode whose function enters its own torch.autocast(float16) and reads W, and
    # a plain bfloat16 call in another thread reading W, either first: the later reader took the
    # other's cast. famp's mode sees the switch and counts float16 for its thread.
    torch.manual_seed(0)
    w, xa, xb = nn.Linear(8, 8), torch.randn(2, 8), torch.randn(2, 8)

    def own(pause: Callable[[], None] | None) -> torch.Tensor:
        def fn(x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=F16):
                h = w(x)
            if pause is not None:
                pause()
            return h

        return famp.autocast(fn, "c=bf16,o=f32", track_casts=True)(xb)

    def plain(pause: Callable[[], None] | None) -> torch.Tensor:
        def fn(x: torch.Tensor) -> torch.Tensor:
            h = w(x)
            if pause is not None:
                pause()
            return h

        return famp.autocast(fn, "c=bf16,o=f32")(xa)

    if own_first:
        results = _two_threads(own, lambda: plain(None))
        got = {"own": results["first"], "plain": results["second"]}
    else:
        results = _two_threads(plain, lambda: own(None))
        got = {"own": results["second"], "plain": results["first"]}
    with torch.autocast("cpu", dtype=F16):
        ref_own = w(xb).float()
    with torch.autocast("cpu", dtype=BF16):
        ref_plain = w(xa).float()
    assert_bitwise_equal(got["own"], ref_own)
    assert_bitwise_equal(got["plain"], ref_plain)


class _CheckpointedRule(nn.Module):
    def __init__(self, w: nn.Linear, reentrant: bool) -> None:
        super().__init__()
        self.pre, self.sub, self.reentrant = nn.Linear(8, 8), nn.Sequential(w), reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.sub, self.pre(x), use_reentrant=self.reentrant)  # type: ignore[no-any-return]


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_recomputation_in_one_thread_meets_no_other_threads_casts(reentrant: bool) -> None:
    # Thread one is inside a bfloat16 call that read W; thread two's backward recomputes a
    # checkpointed block whose float16 rule reads W: it read thread one's bfloat16 cast (torch's
    # checkpoint turns the cache back on as its forward ran). A recomputation now counts its
    # dtypes, and empties the cache at its switches while another thread computes in another.
    torch.manual_seed(0)
    w = nn.Linear(8, 8)
    model, xa, xb = _CheckpointedRule(w, reentrant), torch.randn(2, 8), torch.randn(2, 8)
    loss = famp.autocast(model, "c=bf16,o=f32", module_rules={"sub": "c=f16,o=f32"})(xb).sum()

    def first(pause: Callable[[], None]) -> torch.Tensor:
        def fn(x: torch.Tensor) -> torch.Tensor:
            h = w(x)
            pause()
            return h

        return famp.autocast(fn, "c=bf16,o=f32")(xa)

    params = [*model.parameters()]

    def grads(loss: torch.Tensor) -> list[torch.Tensor]:  # reentrant: .backward(), not .grad()
        for p in params:
            p.grad = None
        loss.backward()
        return [p.grad for p in params if p.grad is not None]

    results = _two_threads(first, lambda: grads(loss))
    with torch.autocast("cpu", dtype=BF16):
        h = model.pre(xb)
        with torch.autocast("cpu", dtype=F16):
            ref_loss = w(h.half()).float().sum()
        torch.clear_autocast_cache()  # W: read next in bfloat16 (the other thread's call)
        ref_first = w(xa).float()
    assert_bitwise_equal(results["first"], ref_first)
    assert not isinstance(results["second"], Exception), results["second"]
    for a, e in zip(results["second"], grads(ref_loss), strict=True):
        assert_bitwise_equal(a, e)


class _UsesTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.sub = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sub(self.a(self.a(x)))  # type: ignore[no-any-return]


def test_a_float32_call_in_another_thread_leaves_the_cache_on() -> None:
    # A float32 call reads no cast: a call in two lower dtypes (a float16 rule in a bfloat16
    # call) beside it keeps torch's cache on, and `a`, used twice, keeps one cast, its gradient
    # summed in bfloat16 as by hand (with the cache off it would round as two casts).
    model, x = _UsesTwice(), torch.randn(2, 8)
    ruled = famp.autocast(model, "c=bf16,o=f32", module_rules={"sub": "c=f16,o=f32"})

    def float32(pause: Callable[[], None]) -> torch.Tensor:
        return famp.autocast(lambda x: (pause(), x * 2)[1], "f32")(x)

    def twice() -> list[torch.Tensor]:
        return list(torch.autograd.grad(ruled(x).sum(), [model.a.weight]))

    results = _two_threads(float32, twice)
    with torch.autocast("cpu", dtype=BF16):
        h = model.a(model.a(x))
        with torch.autocast("cpu", dtype=F16):
            ref = model.sub(h.half()).float()
    (expected,) = torch.autograd.grad(ref.sum(), [model.a.weight])
    with torch.autocast("cpu", dtype=BF16, cache_enabled=False):
        h = model.a(model.a(x))
        with torch.autocast("cpu", dtype=F16, cache_enabled=False):
            uncached = model.sub(h.half()).float()
    assert not torch.equal(torch.autograd.grad(uncached.sum(), [model.a.weight])[0], expected)
    assert_bitwise_equal(results["second"][0], expected)
    assert_bitwise_equal(results["first"], x * 2)
