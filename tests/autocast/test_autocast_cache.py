"""torch's weight-cast cache across dtype switches that pass through autocast off, and its
off switch: each op reads casts of the dtype in effect for it, as casts written by hand give.

torch's cache is keyed without the dtype. famp clears it where the compute dtype changes: these
are the switches that go through a state with autocast off (a float32 module rule or call, a
`torch.autocast(enabled=False)` gap), and a nested call inside a module rule's scope.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import famp
from tests.helpers import assert_bitwise_equal, famp_and_uncached_autocast

BF16, F16 = torch.bfloat16, torch.float16


def _weights() -> tuple[nn.Parameter, nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return (
        nn.Parameter(torch.randn(8, 8, generator=g)),
        nn.Parameter(torch.randn(8, 8, generator=g)),
    )


def _mm(w1: torch.Tensor, w2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The product in `dtype`, its casts written by hand (one cast per use)."""
    return torch.mm(w1.to(dtype), w2.to(dtype))


def _nested_module_rules(w1: nn.Parameter, w2: nn.Parameter) -> list[torch.Tensor]:
    # A bfloat16 call; module "a" computes in float32 (autocast off), "a.b" inside it in float16.
    class B(nn.Module):
        def forward(self) -> torch.Tensor:
            return torch.mm(w1, w2)

    class A(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.b = B()

        def forward(self) -> torch.Tensor:
            return self.b()

    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = A()

        def forward(self) -> list[torch.Tensor]:
            return [torch.mm(w1, w2), self.a(), torch.mm(w1, w2)]

    rules = {"a": "c=f32,o=f32", "a.b": "c=f16,o=f16"}
    return famp.autocast(Root(), "c=bf16,o=f32", module_rules=rules, device_type="cpu")()


def _nested_calls(w1: nn.Parameter, w2: nn.Parameter) -> list[torch.Tensor]:
    # bfloat16, then a float32 call (autocast off), inside it a float16 call.
    f16 = famp.autocast(lambda: torch.mm(w1, w2), "c=f16,o=f16", device_type="cpu")
    f32 = famp.autocast(lambda: f16(), "c=f32,o=f16", device_type="cpu")
    both = famp.autocast(
        lambda: [torch.mm(w1, w2), f32(), torch.mm(w1, w2)], "c=bf16,o=f32", device_type="cpu"
    )
    return both()


def _call_in_a_disabled_gap(w1: nn.Parameter, w2: nn.Parameter) -> list[torch.Tensor]:
    # torch.autocast(float16), a gap with autocast off (its dtype stays float16), a bfloat16 call.
    bf16 = famp.autocast(lambda: torch.mm(w1, w2), "c=bf16,o=bf16", device_type="cpu")
    with torch.autocast("cpu", dtype=F16):
        first = torch.mm(w1, w2)
        with torch.autocast("cpu", enabled=False):
            inner = bf16()
        return [first, inner, torch.mm(w1, w2)]


def _call_in_a_module_scope(w1: nn.Parameter, w2: nn.Parameter) -> list[torch.Tensor]:
    # A bfloat16 call nested in a module whose rule computes in float16, in a bfloat16 call.
    bf16 = famp.autocast(lambda: torch.mm(w1, w2), "c=bf16,o=bf16", device_type="cpu")

    class M(nn.Module):
        def forward(self) -> list[torch.Tensor]:
            return [torch.mm(w1, w2), bf16(), torch.mm(w1, w2)]

    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = M()

        def forward(self) -> list[torch.Tensor]:
            return self.m()

    rules = {"m": "c=f16,o=f16"}
    return famp.autocast(Root(), "c=bf16,o=f32", module_rules=rules, device_type="cpu")()


def _users_autocast_in_an_override_call(w1: nn.Parameter, w2: nn.Parameter) -> list[torch.Tensor]:
    # A bfloat16 call with an override; inside it the function's own torch.autocast(float16),
    # where a view of a weight (no cast read: famp does not test the dtype there) comes first.
    def f() -> list[torch.Tensor]:
        first = torch.mm(w1, w2)
        with torch.autocast("cpu", dtype=F16):
            w1.t()
            inner = torch.mm(w1, w2)
        return [first, inner, torch.mm(w1, w2)]

    rules = famp.default_rules("cpu").override({"rms_norm": "lower"})
    return famp.autocast(f, "c=bf16,o=f32", rules=rules, device_type="cpu")()


# Each case: the function and the dtype of each product it returns, in order.
CASES: dict[str, tuple[Callable[..., list[torch.Tensor]], tuple[torch.dtype, ...]]] = {
    "nested module rules": (_nested_module_rules, (BF16, F16, BF16)),
    "nested calls": (_nested_calls, (BF16, F16, BF16)),
    "a call in a disabled gap": (_call_in_a_disabled_gap, (F16, BF16, F16)),
    "a call in a module rule's scope": (_call_in_a_module_scope, (F16, BF16, F16)),
    "a torch.autocast of the function's own": (
        _users_autocast_in_an_override_call,
        (BF16, F16, BF16),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_weight_casts_follow_dtype_switches_through_autocast_off(case: str) -> None:
    # Each product reads casts of its own dtype, and each stretch of one dtype its own casts:
    # outputs and the weights' gradients equal casts written by hand, bit for bit.
    fn, dtypes = CASES[case]
    w1, w2 = _weights()
    outs = fn(w1, w2)
    outs = [o.float() for o in outs]  # output casts of products of 16 bits: exact
    got = [*outs, *torch.autograd.grad(sum(o.sum() for o in outs), [w1, w2])]
    r1, r2 = _weights()
    ref_outs = [_mm(r1, r2, d).float() for d in dtypes]
    expected = [*ref_outs, *torch.autograd.grad(sum(o.sum() for o in ref_outs), [r1, r2])]
    for a, e in zip(got, expected, strict=True):
        assert_bitwise_equal(a, e)


@pytest.mark.parametrize("cache", [True, False])
def test_override_casts_follow_torchs_cache_switch(cache: bool) -> None:
    # An override that casts a weight used four times: with torch's cache on, one cast shared by
    # the four uses (as torch caches it); with it off, one cast per use, as torch casts then.
    w = nn.Parameter(torch.randn(64, 64, generator=torch.Generator().manual_seed(1)))
    xs = [torch.randn(64, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    rules = famp.default_rules("cpu").override({"mv": "lower"})
    f = famp.autocast(
        lambda: sum(torch.mv(w, x) for x in xs), "c=bf16,o=f32", rules=rules, device_type="cpu"
    )
    previous = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(cache)
    try:
        out = f()
    finally:
        torch.set_autocast_cache_enabled(previous)
    (grad,) = torch.autograd.grad(out.sum(), w)
    once = w.to(BF16)
    expected_out = sum(torch.mv(once if cache else w.to(BF16), x.to(BF16)) for x in xs)
    assert isinstance(expected_out, torch.Tensor)
    (expected_grad,) = torch.autograd.grad(expected_out.float().sum(), w)
    assert_bitwise_equal(out, expected_out.float())
    assert_bitwise_equal(grad, expected_grad)


# --- ops the weight watch skips: they read no cast from torch's cache ---------------------------

# Calls of a weight famp's eager path does not watch (`overrides.reads_no_cast`): attribute reads,
# views, calls that return no tensor, pointwise ops; and, as controls, calls torch's autocast casts
# the weight in (directly or inside), which famp must watch.
NO_CAST_CALLS: dict[str, Callable[[torch.Tensor], object]] = {
    "shape": lambda w: w.shape,
    "T": lambda w: w.T,
    "t": lambda w: w.t(),
    "view": lambda w: w.view(-1),
    "transpose": lambda w: w.transpose(0, 1),
    "reshape": lambda w: w.reshape(4, 16),
    "contiguous": lambda w: w.contiguous(),
    "chunk": lambda w: w.chunk(2),
    "split": lambda w: w.split(4),
    "unflatten": lambda w: w.unflatten(0, (2, 4)),
    "expand": lambda w: w.expand(2, 8, 8),
    "to": lambda w: w.to(BF16),
    "size": lambda w: w.size(),
    "dim": lambda w: w.dim(),
    "numel": lambda w: w.numel(),
    "add": lambda w: w + 1.0,
    "mul": lambda w: w * w,
    "relu": torch.relu,
    "gelu": torch.nn.functional.gelu,
    "tanh": torch.tanh,
    "pow": lambda w: w.pow(2),
    "sum": lambda w: w.sum(),  # reductions, indexing: since 2026-11-30
    "mean": lambda w: w.mean(0),
    "amax": lambda w: w.amax(),
    "getitem": lambda w: w[0],
    "getitem_index": lambda w: w[_INDEX],
}
_ONES, _INDEX = torch.ones(2, 8), torch.tensor([0, 2])
CAST_CALLS: dict[str, Callable[[torch.Tensor], object]] = {
    "linear": lambda w: torch.nn.functional.linear(_ONES, w),
    "mm": lambda w: torch.mm(w, w),
    "matmul": lambda w: _ONES @ w,
    "multi_dot": lambda w: torch.linalg.multi_dot([w, w]),  # no autocast rule: its mm casts
}


def _functions_called(call: Callable[[torch.Tensor], object], w: torch.Tensor) -> list[Any]:
    """The torch functions a torch function mode receives for `call(w)`: what famp's mode sees."""
    seen: list[Any] = []

    class Record(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Record():
        call(w)
    return seen


def _torch_caches_a_cast(call: Callable[[torch.Tensor], object]) -> bool:
    """Whether `call(w)` under torch's autocast leaves a cast of the weight `w` in torch's cache:
    a linear of `w` after an in-place write that torch's cache does not see then reads it."""
    w = nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)))
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=BF16):
        call(w)
        with torch.no_grad():
            w.mul_(3.0)
        after = torch.nn.functional.linear(x, w)
    fresh = torch.nn.functional.linear(x.to(BF16), w.detach().to(BF16))
    return not torch.equal(after, fresh)


@pytest.mark.parametrize("name", [*NO_CAST_CALLS, *CAST_CALLS])
def test_the_ops_the_weight_watch_skips_leave_no_cast_in_torchs_cache(name: str) -> None:
    # Read off torch: each call famp does not watch leaves torch's cache without a cast of the
    # weight (a later linear casts it afresh); each control leaves one, and famp watches it.
    from famp._autocast.op_calls import op_name
    from famp._autocast.overrides import reads_no_cast

    call = NO_CAST_CALLS.get(name) or CAST_CALLS[name]
    functions = _functions_called(call, torch.randn(8, 8, requires_grad=True))
    skipped = [reads_no_cast(op_name(f)[0], "cpu") for f in functions]
    assert skipped == [name in NO_CAST_CALLS] * len(functions), [op_name(f) for f in functions]
    assert functions
    assert _torch_caches_a_cast(call) == (name in CAST_CALLS)


WRITES_OF_AN_UNCAST_WEIGHT: dict[str, Callable[[torch.Tensor], object]] = {
    "mul_": lambda u: u.mul_(0.9),
    "lerp_": lambda u: u.lerp_(u.detach() * 2, 0.5),
    "a view's mul_": lambda u: u[0].mul_(0.5),
    "setitem": lambda u: u.__setitem__(0, 1.0),
    "after a sum": lambda u: (u.sum(), u.mul_(0.9)),
}


@pytest.mark.parametrize("kind", ["track_casts", "override"])
@pytest.mark.parametrize("write", list(WRITES_OF_AN_UNCAST_WEIGHT))
def test_a_write_into_a_weight_torch_holds_no_cast_of_keeps_the_cache(
    write: str, kind: str
) -> None:
    # An EMA-style write into a weight `u` that no op read in the lower dtype (torch caches no
    # cast of it) emptied torch's whole cache: the in-place op counted as a read of its own
    # target (and indexing, reductions as reads). `v`, used before and after, was cast twice:
    # its gradient 0.03 off torch.autocast's.
    g = torch.Generator().manual_seed(0)
    v = nn.Parameter(torch.randn(8, 8, generator=g) * 0.4)
    u = nn.Parameter(torch.randn(8, 8, generator=g) * 0.4)
    x, c = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)

    def f(x: torch.Tensor) -> torch.Tensor:
        y1 = torch.nn.functional.linear(x, v)
        with torch.no_grad():
            WRITES_OF_AN_UNCAST_WEIGHT[write](u)
        return y1 + torch.nn.functional.linear(x * 2, v)

    def v_grad(y: torch.Tensor) -> torch.Tensor:
        v.grad = None
        (y.float() * c).sum().backward()
        assert v.grad is not None
        return v.grad

    with torch.autocast("cpu", dtype=BF16):
        expected = f(x)
    expected_grad = v_grad(expected).clone()
    rules = (
        {"track_casts": True}
        if kind == "track_casts"
        else {
            "rules": famp.default_rules("cpu").override({"kron": "float32"})  # no op of the call
        }
    )
    actual = famp.autocast(f, "c=bf16", **rules)(x)
    assert_bitwise_equal(actual, expected)
    assert_bitwise_equal(v_grad(actual), expected_grad)


@pytest.mark.parametrize("first", ["shape", "t", "view", "relu", "size"])
def test_a_weight_first_read_by_skipped_ops_is_watched_where_its_cast_is_read(first: str) -> None:
    # The weight's first reads go unwatched; the linear that casts it is watched: a write that
    # famp's mode does not see (torch functions off) before the second linear gives a fresh cast.
    torch.manual_seed(0)
    lin, x = nn.Linear(8, 8), torch.randn(4, 8)

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        NO_CAST_CALLS[first](lin.weight)
        out = lin(x)
        with torch.no_grad(), torch._C.DisableTorchFunction():
            lin.weight.mul_(3.0)
        return out, lin(x)

    rules = famp.default_rules("cpu").override({"rms_norm": "lower"})
    (first_out, second), (ref_first, ref_second) = famp_and_uncached_autocast(
        f, lin, x, rules=rules
    )
    assert_bitwise_equal(first_out, ref_first)
    assert_bitwise_equal(second, ref_second)
    assert not torch.equal(first_out, second)


@pytest.mark.parametrize("kind", ["override", "track_casts"])
def test_a_write_through_data_after_a_write_the_version_showed_reads_a_fresh_cast(
    kind: str,
) -> None:
    # A write famp's mode does not see (torch functions off) shows at the next read by the
    # weight's version: the casts are dropped and the weight watched afresh, its storage too, so
    # that a later write through `.data` (which has its own version counter) drops them again.
    torch.manual_seed(0)
    lin, x = nn.Linear(8, 8), torch.randn(4, 8)

    def f(x: torch.Tensor) -> list[torch.Tensor]:
        outs = [lin(x)]
        with torch.no_grad(), torch._C.DisableTorchFunction():
            lin.weight.mul_(2.0)
        outs.append(lin(x))
        with torch.no_grad():
            lin.weight.data.add_(1.0)
        outs.append(lin(x))
        return outs

    options: dict[str, Any] = (
        {"rules": famp.default_rules("cpu").override({"rms_norm": "lower"})}
        if kind == "override"
        else {"track_casts": True}
    )
    outs, expected = famp_and_uncached_autocast(f, lin, x, **options)
    for out, ref in zip(outs, expected, strict=True):
        assert_bitwise_equal(out, ref)
    assert not torch.equal(outs[1], outs[2])


class _Pausing(nn.Module):
    """A linear layer that, in the thread named `pauses`, signals `cast_made` after its product
    (its weight's cast in torch's cache) and waits for `done` before it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.pauses: int | None = None
        self.cast_made, self.done = threading.Event(), threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        if threading.get_ident() == self.pauses:
            self.cast_made.set()
            self.done.wait(timeout=30)
        return out


@pytest.mark.parametrize("ruled_first", [True, False])
def test_a_module_rules_dtype_in_one_thread_keeps_its_casts_from_another_threads_call(
    ruled_first: bool,
) -> None:
    # torch's cast cache is one map for all threads. One thread's bfloat16 call runs a layer
    # under a float16 rule, another thread's bfloat16 call uses the same layer while the first
    # is inside it, its cast held: the calls differ in dtype, so the later one runs with the
    # cache off. famp had registered only the calls' own dtypes: with the ruled call first, the
    # plain call read its float16 cast ("mat1 and mat2 must have the same dtype").
    torch.manual_seed(0)
    pausing, x = _Pausing(), torch.randn(4, 8)
    model = nn.Sequential(pausing)
    kwargs: dict[str, Any] = {"ruled": {"module_rules": {"0": "c=f16,o=f16"}}, "plain": {}}
    alone = {name: famp.autocast(model, "c=bf16,o=f32", **kw)(x) for name, kw in kwargs.items()}
    results: dict[str, Any] = {}

    def worker(name: str, first: bool) -> None:
        try:
            if first:
                pausing.pauses = threading.get_ident()
            else:
                pausing.cast_made.wait(timeout=30)  # the first call is inside the layer
            results[name] = famp.autocast(model, "c=bf16,o=f32", **kwargs[name])(x)
        except Exception as error:  # reported below
            results[name] = error
        finally:
            if not first:
                pausing.done.set()

    first = "ruled" if ruled_first else "plain"
    threads = [threading.Thread(target=worker, args=(name, name == first)) for name in kwargs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for name in kwargs:
        assert isinstance(results[name], torch.Tensor), results[name]
        assert_bitwise_equal(results[name], alone[name])


class _Child(nn.Module):
    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.lin = lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class _Float32Gap(nn.Module):
    """A weight used before and after a module that a float32 rule matches (a shared block
    around a float32 norm), and inside a lower-dtype child of that module."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(8, 8)
        self.mid = nn.Sequential(nn.Linear(8, 8), _Child(self.shared))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.shared(x)
        return self.shared(self.mid(h).to(h.dtype))


@pytest.mark.parametrize("lower", [BF16, F16])
def test_a_float32_rule_between_two_uses_of_a_weight_keeps_its_cast_as_torch(
    lower: torch.dtype,
) -> None:
    # torch.autocast(enabled=False) between two uses keeps the cast of the first for the second
    # (the gradients of both uses then sum in the lower dtype). famp had cleared torch's cache on
    # leaving the float32 scope, and a nested famp call on entering a lower one inside it: the
    # weight's gradient rounded as with two casts. Rule, nested calls and torch by hand agree.
    model, x = _Float32Gap(), torch.randn(4, 8)
    name = {BF16: "bf16", F16: "f16"}[lower]
    rules = {"mid": "f32", "mid.1": f"c={name},o=f32"}
    ruled = famp.autocast(model, f"c={name},o=f32", module_rules=rules)

    def nested(x: torch.Tensor) -> torch.Tensor:
        inner = famp.autocast(model.mid[1], f"c={name},o=f32")
        mid = famp.autocast(lambda h: inner(model.mid[0](h)), "f32")
        h = model.shared(x)
        return model.shared(mid(h).to(h.dtype))

    def by_hand(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=lower):
            h = model.shared(x)
            with torch.autocast("cpu", enabled=False):
                g = model.mid[0](h.float())
                with torch.autocast("cpu", dtype=lower):
                    g = model.mid[1](g.to(lower)).float()
            return model.shared(g.to(h.dtype)).float()

    results = []
    for f in (ruled, famp.autocast(nested, f"c={name},o=f32"), by_hand):
        out = f(x)
        results.append([out, *torch.autograd.grad(out.sum(), list(model.parameters()))])
    for ruled_bits, nested_bits, torch_bits in zip(*results, strict=True):
        assert_bitwise_equal(ruled_bits, torch_bits)
        assert_bitwise_equal(nested_bits, torch_bits)


INFERENCE_OPTIONS: dict[str, dict[str, Any]] = {
    "override": {"rules": famp.default_rules("cpu").override({"gelu": "float32"})},
    "track_casts": {"track_casts": True},
    "module rules": {"module_rules": {"1": "f32"}},
}


@pytest.mark.parametrize("grad_mode", ["inference_mode", "no_grad"])
@pytest.mark.parametrize("option", list(INFERENCE_OPTIONS))
def test_weights_made_in_inference_mode_are_read_as_torch_reads_them(
    option: str, grad_mode: str
) -> None:
    """Parameters created under `torch.inference_mode()` (serving code) are inference tensors
    that still require grad, and have no version counter: famp's weight watch raised "Inference
    tensors do not track version counter" where `torch.autocast` runs. Equal to torch by hand."""
    with torch.inference_mode():
        model = nn.Sequential(nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 3))
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    assert model[0].weight.is_inference()
    assert model[0].weight.requires_grad
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    context = torch.inference_mode if grad_mode == "inference_mode" else torch.no_grad
    with context(), torch.autocast("cpu", dtype=torch.bfloat16):
        h = model[0](x)
        with torch.autocast("cpu", enabled=False):
            h = model[1](h.float())  # the override / the module rule: float32
        expected = model[2](h)
    f = famp.autocast(model, "c=bf16,o=bf16", **INFERENCE_OPTIONS[option])
    for _ in range(2):  # the second call meets the weights watched by the first
        with context():
            assert_bitwise_equal(f(x), expected)


# --- inside torch.func transforms -------------------------------------------------------------

_X = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
_I1, _I2 = torch.tensor([0, 1, 2, 3, 1]), torch.tensor([1, 1, 4, 5, 0])


def _two_linears(w: torch.Tensor) -> torch.Tensor:
    """A weight read twice by `linear`, which torch's own autocast casts (lower on the CPU)."""
    return F.linear(_X, w).float().pow(2).sum() + F.linear(3 * _X, w).float().pow(2).sum()


def _two_embeddings(w: torch.Tensor) -> torch.Tensor:
    """A weight read twice by `embedding`, which the override below makes famp cast."""
    return 1.5 * F.embedding(_I1, w).float().pow(2).sum() + F.embedding(_I2, w).float().pow(2).sum()


TRANSFORMS: dict[str, Callable[[Callable[[torch.Tensor], torch.Tensor]], torch.Tensor]] = {
    "grad": lambda f: torch.func.grad(f)(torch.randn(6, 6, generator=_gen())),
    "vmap(grad)": lambda f: torch.func.vmap(torch.func.grad(f))(
        torch.randn(3, 6, 6, generator=_gen())
    ),
    "jacrev": lambda f: torch.func.jacrev(f)(torch.randn(6, 6, generator=_gen())),
    "vjp": lambda f: torch.func.vjp(f, torch.randn(6, 6, generator=_gen()))[1](torch.tensor(1.0))[
        0
    ],
}


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
def test_inside_torch_func_transforms_a_weight_is_cast_per_use_as_torch_casts_it(
    transform: str,
) -> None:
    # torch's autocast runs beneath `torch.func`'s transforms, on the tensor they wrap, and
    # caches no cast there: each use of a weight gets its own cast, and their gradients are
    # summed in float32. famp cached its own casts (an override's) of the transform's wrapper:
    # the gradient was up to 0.0625 off (0.03125 under vmap(grad)).
    run = TRANSFORMS[transform]

    def torch_linears(w: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16):
            return _two_linears(w)

    def by_hand(w: torch.Tensor, shared: bool) -> torch.Tensor:
        first = w.to(BF16)
        second = first if shared else w.to(BF16)
        with torch.autocast("cpu", enabled=False):
            return _two_linears_of(first, second)

    # The oracle: torch's own linear, read twice here, equals a cast per use, not one cast.
    per_use = run(lambda w: by_hand(w, shared=False))
    assert_bitwise_equal(run(torch_linears), per_use)
    assert not torch.equal(run(lambda w: by_hand(w, shared=True)), per_use)

    rules = famp.default_rules("cpu").override({"embedding": "lower"})
    both = famp.autocast(
        lambda w: _two_embeddings(w) + _two_linears(w), "c=bf16,o=f32", rules=rules
    )

    def reference(w: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16):
            with torch.autocast("cpu", enabled=False):  # the override, a cast per use
                embedded = _two_embeddings_of(w.to(BF16), w.to(BF16))
            return embedded + _two_linears(w)

    assert_bitwise_equal(run(both), run(reference))


def _two_linears_of(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    x = _X.to(BF16)
    return (
        F.linear(x, first).float().pow(2).sum()
        + F.linear((3 * _X).to(BF16), second).float().pow(2).sum()
    )


def _two_embeddings_of(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    return (
        1.5 * F.embedding(_I1, first).float().pow(2).sum()
        + F.embedding(_I2, second).float().pow(2).sum()
    )


# --- famp's own casts after a dtype switch, and casts made in nested calls -----------------------


def _nested_float16_read(x: torch.Tensor, w2: torch.Tensor) -> None:
    x @ w2  # read in bfloat16, then in float16 by a nested call: a dtype switch
    famp.autocast(lambda x: x @ w2, "c=f16,o=f32")(x)


def _own_autocast_float16_read(x: torch.Tensor, w2: torch.Tensor) -> None:
    x @ w2
    with torch.autocast("cpu", dtype=F16):  # the same switch, through the function's autocast
        x @ w2


def _nested_write(x: torch.Tensor, w2: torch.Tensor) -> None:
    def g(x: torch.Tensor) -> torch.Tensor:
        x @ w2
        with torch.no_grad():
            w2.mul_(0.5)  # seen by the nested call, which empties both caches
        return x @ w2

    famp.autocast(g, "c=bf16,o=f32", track_casts=True)(x)


@pytest.mark.parametrize(
    "trigger",
    [_nested_float16_read, _own_autocast_float16_read, _nested_write],
    ids=lambda f: f.__name__,
)
def test_a_write_through_data_after_the_cache_was_emptied_reaches_an_overrides_cast(
    trigger: Callable[[torch.Tensor, torch.Tensor], None],
) -> None:
    # When famp emptied torch's cache, it also let go of the weights of its own casts (an
    # override's), so a later write through `.data` (no version change; seen by storage) was
    # missed: the second mv read the stale cast, v's gradient up to 2.375 off.
    rules = famp.default_rules("cpu").override({"mv": "lower"})
    g = torch.Generator().manual_seed(0)
    w, w2 = (nn.Parameter(torch.randn(8, 8, generator=g)) for _ in range(2))
    x, v0 = torch.randn(4, 8, generator=g), torch.randn(8, generator=g)

    def f(x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        torch.mv(w, v)  # famp's own bfloat16 cast of w, cached
        trigger(x, w2)
        w.data.mul_(0.5)
        return torch.mv(w, v)

    v = v0.clone().requires_grad_()
    out = famp.autocast(f, "c=bf16,o=f32", rules=rules)(x, v)
    out.sum().backward()
    ref_v = v0.clone().requires_grad_()
    expected = torch.mv(w.detach().to(BF16), ref_v.to(BF16)).float()  # cast after the write
    expected.sum().backward()
    assert_bitwise_equal(out, expected)
    assert_bitwise_equal(v.grad, ref_v.grad)


INNER_MODES: dict[str, dict[str, Any]] = {
    "track_casts": {"track_casts": True},
    "override": {"rules": famp.default_rules("cpu").override({"mv": "lower"})},
}


@pytest.mark.parametrize("first", ["inner", "outer"])
@pytest.mark.parametrize("inner_mode", sorted(INNER_MODES))
def test_a_weight_written_between_a_nested_calls_read_and_the_outer_calls_is_cast_afresh(
    inner_mode: str, first: str
) -> None:
    # A nested call with a mode of its own watched the weights it read in a watch of its own,
    # let go at its end while torch's cache kept its casts: a write in the outer call, then a
    # read there, took the stale cast (the output 0.535 off, the weight's gradient 7.125).
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))

    def run(use_famp: bool) -> tuple[torch.Tensor, ...]:
        torch.manual_seed(0)
        lin = nn.Linear(8, 8)
        nested = famp.autocast(lin, "c=bf16,o=f32", **INNER_MODES[inner_mode])

        def inner(x: torch.Tensor) -> torch.Tensor:  # by hand: the call's casts, under torch's
            return nested(x) if use_famp else lin(x.to(BF16)).float()

        def f(x: torch.Tensor) -> torch.Tensor:
            a = inner(x) if first == "inner" else lin(x).float()
            with torch.no_grad():
                lin.weight.mul_(0.5)  # EMA-style, in the outer call: the version moves
            if not use_famp:
                torch.clear_autocast_cache()  # the write seen
            return a + (lin(x).float() if first == "inner" else inner(x))

        xr = x.clone().requires_grad_()
        if use_famp:
            out = famp.autocast(f, "c=bf16,o=f32", track_casts=True)(xr)
        else:
            with torch.autocast("cpu", dtype=BF16):
                out = f(xr)
        out.square().sum().backward()
        return out, xr.grad, lin.weight.grad  # type: ignore[return-value]

    for got, expected in zip(run(True), run(False), strict=True):
        assert_bitwise_equal(got, expected)
