"""famp.autocast: state hygiene, nesting, the weight-cast cache, overrides, composition, compile."""

from __future__ import annotations

import collections
import functools
import linecache
import logging
import re
import threading
import traceback
from collections.abc import Callable
from typing import Any

import hypothesis
import hypothesis.strategies as st
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
import torch.nn.modules.module as torch_module
from torch import nn

import famp
from famp._autocast import hooks, recompute
from famp._autocast.compiled import own_code
from famp._autocast.region import region as autocast_region
from tests.helpers import assert_bitwise_equal

BF16, F16, F32, F64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


def _autocast_state() -> tuple[Any, ...]:
    nesting = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return (
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
        torch.is_autocast_cache_enabled(),
        nesting,
        torch._C._len_torch_function_stack(),
        hooks.pre_hook in torch_module._global_forward_pre_hooks.values(),
        hooks.post_hook in torch_module._global_forward_hooks.values(),
        len(recompute.calls()),
    )


CLEAN = (False, BF16, True, 1, 0, False, False, 0)


# --- arguments ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "exc", "needle"),
    [
        ({"fn": 3}, TypeError, "fn must be callable; got int"),
        ({"policy": "c=fp8"}, ValueError, "compute must be a dtype name"),
        ({"policy": 1.0}, TypeError, "policy must be a string or a famp.Policy"),
        ({"device_type": 0}, TypeError, "device_type must be a str or None; got int"),
        ({"device_type": "gpu"}, ValueError, "device_type 'gpu' is no device type with autocast"),
        # torch.autocast takes "cpu:0"; famp's track_casts then raised on the first call
        ({"device_type": "cpu:0"}, ValueError, "device_type 'cpu:0' is no device type with"),
        ({"rules": {"linear": "lower"}}, TypeError, "rules must be a famp.OpRules or None"),
        (
            {"rules": famp.default_rules("cuda"), "device_type": "cpu"},
            ValueError,
            "rules are for device_type 'cuda', not 'cpu'",
        ),
        ({"module_rules": ["head"]}, TypeError, "module_rules must be a mapping"),
        ({"module_rules": {1: "f32"}}, TypeError, "module_rules keys must be str patterns"),
        ({"module_rules": {"head": "f8"}}, ValueError, "policy must be a dtype name"),
        # before 2026-12-01 the message named neither module_rules nor the pattern
        (
            {"module_rules": {"encoder.*": "bf17"}},
            ValueError,
            "module_rules['encoder.*']: policy must be a dtype name",
        ),
        ({"module_rules": {"head": 2}}, TypeError, "module_rules['head']: policy must be a string"),
        ({"compile": "yes"}, TypeError, "compile must be True, False or None; got 'yes'"),
    ],
)
def test_bad_arguments_name_the_field_and_value(
    kwargs: dict[str, Any], exc: type, needle: str
) -> None:
    args = {"fn": lambda x: x, "policy": "c=bf16", **kwargs}
    fn, policy = args.pop("fn"), args.pop("policy")
    with pytest.raises(exc) as info:
        famp.autocast(fn, policy, **args)
    assert needle in str(info.value)


def test_device_inference() -> None:
    def dev(x: Any) -> str:
        return "cuda" if torch.is_autocast_enabled("cuda") else "cpu"

    f = famp.autocast(dev, "c=bf16")
    assert f({"a": [torch.ones(1)], "b": 2}) == "cpu"
    assert f((nn.Parameter(torch.ones(1)), "s", None)) == "cpu"
    pair = collections.namedtuple("pair", "a b")
    assert f([{"k": pair(3, (torch.ones(1, device="meta"), torch.ones(1)))}]) == "cpu"
    with pytest.raises(ValueError, match="needs a tensor not on meta among the args"):
        f(3)
    with pytest.raises(
        ValueError, match="needs a tensor not on meta among the args"
    ):  # meta is no device
        f({"w": torch.ones(2, device="meta"), "p": nn.Parameter(torch.ones(1, device="meta"))})
    rules = famp.default_rules("cuda").override({"mm": "float32"})
    g = famp.autocast(dev, "c=bf16", rules=rules)
    with pytest.raises(ValueError, match="rules are for device_type 'cuda' but the call runs on"):
        g(torch.ones(1))


# --- nothing leaks ------------------------------------------------------------------------------

LIN = nn.Linear(4, 4)


def test_no_state_leaks_after_a_call_or_an_exception() -> None:
    assert _autocast_state() == CLEAN
    rules = famp.default_rules("cpu").override({"linear": "float32"})
    for kwargs in ({}, {"rules": rules}, {"module_rules": {"": "f32"}}):
        f = famp.autocast(lambda x: LIN(x), "c=bf16", **kwargs)
        assert f(torch.randn(2, 4)).dtype == BF16 if not kwargs else True
        assert _autocast_state() == CLEAN

        def boom(x: torch.Tensor) -> None:
            LIN(x)
            raise KeyError("boom")

        with pytest.raises(KeyError, match="boom"):
            famp.autocast(boom, "c=f16", **kwargs)(torch.randn(2, 4))
        assert _autocast_state() == CLEAN


def test_ambient_autocast_is_restored_and_does_not_leak_in() -> None:
    f = famp.autocast(lambda x: (LIN(x).dtype, torch.get_autocast_dtype("cpu")), "c=bf16")
    with torch.autocast("cpu", dtype=F16):
        assert f(torch.randn(2, 4)) == (BF16, BF16)
        assert torch.get_autocast_dtype("cpu") == F16
        assert LIN(torch.randn(2, 4)).dtype == F16
    full = famp.autocast(lambda x: LIN(x).dtype, "f32")
    with torch.autocast("cpu", dtype=F16):
        assert full(torch.randn(2, 4)) == F32  # a float32 policy turns autocast off
    assert _autocast_state() == CLEAN


def test_float32_policy_equals_no_autocast() -> None:
    x = torch.randn(2, 4).to(BF16)
    expected = LIN.to(F32)(x.float()), F.layer_norm(x, (4,))
    f = famp.autocast(lambda x: (LIN(x.float()), F.layer_norm(x, (4,))), "p=f32,c=f32,o=f32")
    actual = f(x)
    assert_bitwise_equal(actual[0], expected[0])
    assert actual[1].dtype == F32  # the bf16 output is cast to the policy's float32 output
    assert_bitwise_equal(actual[1], expected[1].float())


def test_float64_outputs_and_inputs_are_never_cast() -> None:
    x = torch.randn(2, 4, dtype=F64)
    w = torch.randn(4, 4, dtype=F64)
    out = famp.autocast(lambda x: (x @ w, (x @ w).float(), torch.arange(3)), "c=bf16,o=f16")(x)
    assert [t.dtype for t in out] == [F64, F16, torch.int64]
    assert_bitwise_equal(out[0], x @ w)


def test_calls_in_two_threads_do_not_interfere() -> None:
    results: dict[str, Any] = {}
    barrier = threading.Barrier(2)

    def worker(name: str, policy: str) -> None:
        def fn(x: torch.Tensor) -> torch.dtype:
            barrier.wait(timeout=10)
            dtype = LIN(x).dtype
            barrier.wait(timeout=10)
            return dtype

        results[name] = famp.autocast(fn, policy)(torch.randn(2, 4))

    threads = [
        threading.Thread(target=worker, args=("bf16", "c=bf16")),
        threading.Thread(target=worker, args=("f16", "c=f16")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == {"bf16": BF16, "f16": F16}


# --- nesting and the weight-cast cache ----------------------------------------------------------


def test_nested_transforms_with_other_dtypes_work_where_torch_fails() -> None:
    lin, x = nn.Linear(4, 4), torch.randn(2, 4)

    def torch_nested() -> None:
        with torch.autocast("cpu", dtype=F16):
            lin(x)
            with torch.autocast("cpu", dtype=BF16):
                lin(x)

    with pytest.raises(RuntimeError, match="must have the same dtype"):  # torch's cache bug
        torch_nested()
    inner = famp.autocast(lambda x: lin(x), "c=bf16,o=bf16")
    outer = famp.autocast(lambda x: (lin(x), inner(x), lin(x)), "c=f16,o=f16")
    before, nested, after = outer(x)
    assert (before.dtype, nested.dtype, after.dtype) == (F16, F16, F16)
    assert_bitwise_equal(nested, inner(x).to(F16))
    assert_bitwise_equal(before, famp.autocast(lambda x: lin(x), "c=f16")(x))
    assert_bitwise_equal(after, before)
    assert _autocast_state() == CLEAN


POLICIES = [f"c={c},o={o}" for c in ("f32", "bf16", "f16") for o in ("f32", "bf16", "f16")]


class _Three(nn.Module):
    def __init__(self, inner: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.block, self.head = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = self.block(h) if self.inner is None else self.inner(h)
        return self.head(h.float() if h.dtype != self.head.weight.dtype else h)


def _outputs_and_grads(net: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> list[Any]:
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(2)).requires_grad_()
    out = fn(x)
    return [out, *torch.autograd.grad(out.float().pow(2).sum(), [x, *net.parameters()])]


@pytest.mark.parametrize("inner", POLICIES)
@pytest.mark.parametrize("outer", POLICIES)
def test_nested_transform_equals_module_rule_and_torch_nesting(outer: str, inner: str) -> None:
    # A famp.autocast call nested in another is the module rule with the same policy, spelled as
    # a function: same outputs, dtypes and gradients, for every pair of policies; both equal
    # torch.autocast nested by hand (inputs cast to the inner compute dtype, outputs to its
    # output dtype, as the rule says).
    ruled = _Three()
    by_rule = _outputs_and_grads(ruled, famp.autocast(ruled, outer, module_rules={"block": inner}))
    nested = _Three()
    nested.inner = famp.autocast(nested.block, inner)
    by_call = _outputs_and_grads(nested, famp.autocast(nested, outer))
    ref, p_out, p_in = _Three(), famp.get_policy(outer), famp.get_policy(inner)

    def torch_nesting(x: torch.Tensor) -> torch.Tensor:
        def state(p: famp.Policy) -> dict[str, Any]:
            lower = p.compute_dtype in (BF16, F16)
            return {"dtype": p.compute_dtype if lower else BF16, "enabled": lower}

        with torch.autocast("cpu", **state(p_out)):
            h = ref.inp(x)
            with torch.autocast("cpu", **state(p_in)):
                h = p_in.cast_to_output(ref.block(p_in.cast_to_compute(h)))
            out = ref.head(h.float() if h.dtype != ref.head.weight.dtype else h)
        return p_out.cast_to_output(out)

    expected = _outputs_and_grads(ref, torch_nesting)
    assert by_call[0].dtype == p_out.output_dtype
    for a, b, e in zip(by_call, by_rule, expected, strict=True):
        assert_bitwise_equal(a, b)
        assert_bitwise_equal(a, e)


def test_inner_transform_governs_its_ops_not_the_outer_rules() -> None:
    lin, x = nn.Linear(4, 4), torch.randn(2, 4)
    outer_rules = famp.default_rules("cpu").override({"linear": "float32"})
    inner = famp.autocast(lambda x: lin(x).dtype, "c=f16")
    outer = famp.autocast(lambda x: (lin(x).dtype, inner(x)), "c=bf16", rules=outer_rules)
    assert outer(x) == (F32, F16)


def test_which_ops_need_famp_is_known_per_transform_not_per_process() -> None:
    # Eagerly famp remembers, per transform, the op functions that need nothing of it: linear is
    # such an op under the first transform and overridden under the second, whichever runs first.
    lin, x = nn.Linear(4, 4), torch.randn(2, 4)
    plain = famp.autocast(lambda x: lin(x).dtype, "c=bf16", rules=_cpu_rules({"rms_norm": "lower"}))
    overriding = famp.autocast(
        lambda x: lin(x).dtype, "c=bf16", rules=_cpu_rules({"linear": "float32"})
    )
    assert [plain(x), overriding(x), plain(x), overriding(x)] == [BF16, F32, BF16, F32]


def test_a_weight_cast_is_not_reused_after_an_in_place_update() -> None:
    w, x = nn.Parameter(torch.randn(4, 4)), torch.randn(2, 4)

    def two_uses(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        first = F.linear(x, w)
        with torch.no_grad():
            w.add_(1.0)
        return first, F.linear(x, w)

    with torch.autocast("cpu", dtype=BF16):
        stale_first, stale = two_uses(x)
    assert_bitwise_equal(stale, stale_first)  # torch reads the cast made before the update
    # The default rules add no per-op work, and keep torch's cache as it is within one call.
    assert_bitwise_equal(*famp.autocast(two_uses, "c=bf16,o=bf16")(x))
    # With op interception on (track_casts=True, or any override or module rule), in-place
    # writes are watched.
    rules = _cpu_rules({"rms_norm": "lower"})
    for transformed in (
        famp.autocast(two_uses, "c=bf16,o=bf16", rules=rules),
        famp.autocast(two_uses, "c=bf16,o=bf16", track_casts=True),
    ):
        first, second = transformed(x)
        with torch.autocast("cpu", dtype=BF16):
            fresh = F.linear(x, w)
        assert_bitwise_equal(second, fresh)
        assert not torch.equal(second, first)
        assert second.dtype == BF16
    # famp's own casts (of ops it overrides) are keyed by tensor, dtype and version.
    own = famp.default_rules("cpu").override({"linear": "lower", "mm": "lower"})
    first, second = famp.autocast(two_uses, "c=f16,o=f16", rules=own)(x)
    assert_bitwise_equal(second, F.linear(x.half(), w.half()))


def test_track_casts_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="track_casts must be True or False; got 1"):
        famp.autocast(lambda x: x, "c=bf16", track_casts=1)  # type: ignore[arg-type]


def test_a_weight_used_several_times_is_cast_once_per_call_as_in_torch() -> None:
    torch.manual_seed(0)
    w, x = nn.Parameter(torch.randn(16, 16)), torch.randn(8, 16)

    def recurrent(x: torch.Tensor) -> torch.Tensor:
        h = x
        for _ in range(4):
            h = torch.tanh(F.linear(h, w))
        return h.float().sum()

    with torch.autocast("cpu", dtype=BF16):
        expected = torch.autograd.grad(recurrent(x), w)[0]
    actual = torch.autograd.grad(famp.autocast(recurrent, "c=bf16,o=f32")(x), w)[0]
    assert_bitwise_equal(actual, expected)
    tracked = famp.autocast(recurrent, "c=bf16,o=f32", track_casts=True)
    assert_bitwise_equal(torch.autograd.grad(tracked(x), w)[0], expected)
    with torch.autocast("cpu", dtype=BF16, cache_enabled=False):
        separate = torch.autograd.grad(recurrent(x), w)[0]
    assert not torch.equal(separate, expected)  # one cast per use rounds the gradient differently


# --- op overrides against hand-written references -----------------------------------------------

D = 6


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"w": (D, D), "b": (D,), "g": (D,), "w2": (4, D)}
    return {k: torch.randn(*s, generator=g).requires_grad_() for k, s in shapes.items()}


def _cpu_rules(changes: dict[str, str]) -> famp.OpRules:
    return famp.default_rules("cpu").override(changes)


def test_override_linear_to_float32_equals_a_float32_linear() -> None:
    p, x = _params(), torch.randn(4, D)
    f = famp.autocast(
        lambda x: F.linear(x, p["w"], p["b"]),
        "c=bf16,o=bf16",
        rules=_cpu_rules({"linear": "float32"}),
    )
    out = f(x)
    expected = F.linear(x, p["w"], p["b"])
    assert_bitwise_equal(out, expected.to(BF16))
    grads = torch.autograd.grad(out.float().sum(), [p["w"], p["b"]])
    e_grads = torch.autograd.grad(expected.to(BF16).float().sum(), [p["w"], p["b"]])
    for a, e in zip(grads, e_grads, strict=True):
        assert a.dtype == F32
        assert_bitwise_equal(a, e)


# Calls that write into their first argument through an `inplace` flag (torch calls `relu_` and
# the like): torch's autocast casts none of them.
INPLACE_FLAG_CALLS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": lambda y: F.relu(y, inplace=True),
    "hardtanh_flag_by_position": lambda y: F.hardtanh(y, -0.5, 0.5, True),
    "leaky_relu": lambda y: F.leaky_relu(y, 0.1, inplace=True),
    "relu_module": lambda y: nn.ReLU(inplace=True)(y),
}


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name", sorted(INPLACE_FLAG_CALLS))
def test_override_leaves_a_write_through_an_inplace_flag_to_torch(name: str, compile: bool) -> None:
    # An override of the op would cast the bfloat16 input to a float32 copy and write into that:
    # the caller's tensor would keep its old values. As torch's autocast, famp casts nothing.
    rules = _cpu_rules({"relu": "float32", "hardtanh": "float32", "leaky_relu": "float32"})
    call = INPLACE_FLAG_CALLS[name]

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x.to(BF16) * 2  # a bfloat16 tensor the call writes into
        out = call(y)
        return y, out

    def reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast("cpu", dtype=BF16):
            return f(x)

    x = torch.randn(64)
    y, out = famp.autocast(f, "c=bf16,o=bf16", rules=rules, compile=compile)(x)
    # Compiled, against torch's autocast compiled: inductor rounds leaky_relu's product once.
    ref_y, ref_out = (torch.compile(reference, fullgraph=True) if compile else reference)(x)
    assert ref_y.dtype == BF16
    assert not torch.equal(ref_y, x.to(BF16) * 2)  # the call wrote into y
    assert_bitwise_equal(y, ref_y)
    assert_bitwise_equal(out, ref_out)


# `torch.einsum` returns a view of its input for an equation that only rearranges it, and a new
# tensor for a contraction: what a call returns depends on its arguments, not its schema.
EINSUM_CALLS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "permutation": lambda y: torch.einsum("bij->bji", y),
    "diagonal": lambda y: torch.einsum("bii->bi", y),
}


# Inductor's lowering of `diagonal` calls a helper torch 2.13 deprecates (torch's own warning).
@pytest.mark.filterwarnings("ignore:.*_prims_common.check. is deprecated:FutureWarning")
@pytest.mark.parametrize("run", ["eager", "compiled", "torch.compile, dynamic"])
@pytest.mark.parametrize("name", sorted(EINSUM_CALLS))
def test_override_leaves_a_call_that_returns_a_view_of_its_input_to_torch(
    name: str, run: str
) -> None:
    # With an einsum override, a cast input would make such a result a view of a float32 copy:
    # a write through it would not reach the caller's tensor. famp runs that call as torch's
    # autocast does (uncast, a view of the caller's tensor); the contraction keeps the override.
    rules = _cpu_rules({"einsum": "float32"})
    call = EINSUM_CALLS[name]

    def f(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        call(y).mul_(2)  # torch: writes into y
        return torch.einsum("bij,bjk->bik", y, y), call(y)

    def reference(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast("cpu", dtype=BF16):
            call(y).mul_(2)
            with torch.autocast("cpu", enabled=False):  # the override: float32 inputs
                product = torch.einsum("bij,bjk->bik", y.float(), y.float())
            return product, call(y)

    y = torch.randn(2, 5, 5).to(BF16)
    transformed = famp.autocast(f, "c=bf16,o=bf16", rules=rules, compile=run == "compiled")
    if run == "torch.compile, dynamic":
        transformed = torch.compile(transformed, fullgraph=True, dynamic=True)
    ours, theirs = y.clone(), y.clone()
    product, view = transformed(ours)
    ref_product, ref_view = reference(theirs)
    assert not torch.equal(theirs, y)  # torch's write reached the input
    assert_bitwise_equal(ours, theirs)
    assert ref_view.dtype == BF16
    assert_bitwise_equal(view, ref_view)
    assert_bitwise_equal(product, ref_product.to(BF16))  # the override's float32 einsum


@pytest.mark.parametrize("transform", ["vmap", "vmap, chunk_size=1", "grad of vmap"])
@pytest.mark.parametrize("name", sorted(EINSUM_CALLS))
def test_override_leaves_a_view_of_its_input_to_torch_under_vmap(name: str, transform: str) -> None:
    # Under vmap a view has no `_base` of its own (the tensor vmap wraps has): famp ran the
    # override, and the result was a view of a bfloat16 copy (every element up to 0.0058 off).
    rules = _cpu_rules({"einsum": "lower"})
    call = EINSUM_CALLS[name]
    weights = torch.arange(5.0)

    def f(y: torch.Tensor) -> torch.Tensor:
        view = call(y)
        view.mul_(2)  # torch: writes into y
        return (view * weights).sum() + y.sum()

    def reference(y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16):
            return f(y).float()

    def under(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        if transform == "vmap":
            return torch.func.vmap(fn)
        if transform == "vmap, chunk_size=1":
            return torch.func.vmap(fn, chunk_size=1)
        return torch.func.grad(lambda y: torch.func.vmap(fn)(y * 1.0).sum())

    y = torch.randn(3, 2, 5, 5)  # vmap's dimension first
    ours, theirs = y.clone(), y.clone()
    out = under(famp.autocast(f, "c=bf16,o=f32", rules=rules))(ours)
    expected = under(reference)(theirs)
    assert_bitwise_equal(out, expected)
    assert_bitwise_equal(ours, theirs)
    if transform != "grad of vmap":
        assert not torch.equal(theirs, y)  # torch's write reached the input


def test_override_leaves_a_view_to_torch_inside_a_module_rule() -> None:
    # The same inside a module a module rule matches: the uncast call runs in that module's scope.
    class Inner(nn.Module):
        def forward(self, y: torch.Tensor) -> torch.Tensor:
            torch.einsum("bij->bji", y).mul_(2)  # torch: writes into y
            return torch.einsum("bij,bjk->bik", y, y)

    model = nn.Sequential(Inner())
    rules = _cpu_rules({"einsum": "float32"})
    y = torch.randn(2, 4, 4).to(BF16)
    ours, theirs = y.clone(), y.clone()
    out = famp.autocast(model, "c=bf16,o=bf16", rules=rules, module_rules={"0": "c=bf16,o=f32"})(
        ours
    )
    with torch.autocast("cpu", dtype=BF16):
        torch.einsum("bij->bji", theirs).mul_(2)
    assert not torch.equal(theirs, y)
    assert_bitwise_equal(ours, theirs)
    assert_bitwise_equal(out, torch.einsum("bij,bjk->bik", theirs.float(), theirs.float()).to(BF16))


# Calls of dropout that torch answers with their input itself (not training, or p = 0).
IDENTITY_DROPOUTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "eval": lambda y: F.dropout(y, 0.5, training=False),
    "p_zero": lambda y: F.dropout(y, 0.0),
    "p_zero_int_by_keyword": lambda y: F.dropout(y, p=0),
    "module_eval": nn.Dropout(0.5).eval(),
    "alpha_by_position": lambda y: F.alpha_dropout(y, 0.5, False),
    "feature": lambda y: F.dropout1d(y, 0.5, training=False),
    "aten": lambda y: torch.ops.aten.dropout.default(y, 0.5, False),
}


@pytest.mark.parametrize("run", ["eager", "compiled", "torch.compile, dynamic"])
@pytest.mark.parametrize("name", sorted(IDENTITY_DROPOUTS))
def test_override_leaves_a_call_that_returns_its_input_to_torch(name: str, run: str) -> None:
    # A cast would make the result a float32 copy, not the caller's tensor: a write through it
    # would be lost. famp asks torch, for the call's p and training flag, whether the op returns
    # its input, and runs such a call as torch's autocast does.
    rules = _cpu_rules({"dropout": "float32", "alpha_dropout": "float32"})
    rules = rules.override({"feature_dropout": "float32"})
    call = IDENTITY_DROPOUTS[name]

    def f(y: torch.Tensor) -> torch.Tensor:
        out = call(y)
        out.mul_(2)  # torch: writes into y
        return out

    def reference(y: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16):
            return f(y)

    y = torch.randn(2, 3, 4).to(BF16)
    transformed = famp.autocast(f, "c=bf16,o=bf16", rules=rules, compile=run == "compiled")
    if run == "torch.compile, dynamic":
        transformed = torch.compile(transformed, fullgraph=True, dynamic=True)
    if run != "eager":  # compiled, torch loses some such writes that its eager keeps
        # A code object of its own per case: Dynamo compiles one at most 8 times.
        reference = torch.compile(own_code(reference), fullgraph=True, dynamic=run != "compiled")
    ours, theirs = y.clone(), y.clone()
    out, ref_out = transformed(ours), reference(theirs)
    if run == "eager":
        assert torch.equal(theirs, y * 2)  # torch's write reached the input
    assert_bitwise_equal(ours, theirs)
    assert_bitwise_equal(out, ref_out)


def test_override_of_dropout_still_casts_a_call_that_drops() -> None:
    # Training with p > 0, dropout computes a new tensor: the override applies (float32 here).
    rules = _cpu_rules({"dropout": "float32"})
    y = torch.randn(4, 8).to(BF16)
    torch.manual_seed(7)
    out = famp.autocast(lambda y: F.dropout(y, 0.5), "c=bf16,o=f32", rules=rules)(y)
    torch.manual_seed(7)
    expected = F.dropout(y.float(), 0.5)
    assert out.dtype == F32
    assert_bitwise_equal(out, expected)
    assert not torch.equal(out, y.float())  # it dropped


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("form", ["module", "function_by_keyword", "checkpointed"])
def test_override_of_embedding_keeps_max_norms_renorm_of_the_weight(
    form: str, compile: bool
) -> None:
    # F.embedding(..., max_norm=...) renormalizes the weight in place, then looks rows up. A rule
    # applied to the whole call would renormalize a cast copy: the weight would keep its norms.
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, max_norm=1.0)
    with torch.no_grad():
        emb.weight.mul_(3.0)  # rows longer than max_norm
    start = emb.weight.detach().clone()
    idx = torch.tensor([[1, 2, 3], [3, 4, 1]])
    calls: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "module": emb,
        "function_by_keyword": lambda i: F.embedding(i, emb.weight, max_norm=1.0),
        # recomputed in backward: the renorm runs again there, on rows it already shortened
        "checkpointed": lambda i: torch.utils.checkpoint.checkpoint(emb, i, use_reentrant=False),
    }
    call = calls[form]
    rules = _cpu_rules({"embedding": "lower"})
    out = famp.autocast(call, "c=bf16,o=bf16", rules=rules, compile=compile)(idx)
    (grad,) = torch.autograd.grad(out.float().sum(), [emb.weight])
    # torch's order: embedding_renorm_ on the weight itself, then the op on its cast.
    weight = start.clone().requires_grad_()
    with torch.no_grad():
        torch.embedding_renorm_(weight, idx, 1.0, 2.0)
    expected = F.embedding(idx, weight.to(BF16))
    (expected_grad,) = torch.autograd.grad(expected.float().sum(), [weight])
    assert not torch.equal(weight.detach(), start)  # the renorm changed rows
    assert_bitwise_equal(emb.weight.detach(), weight.detach())
    assert_bitwise_equal(out, expected)
    assert_bitwise_equal(grad, expected_grad)


def _normalization(op: str) -> nn.Module:
    torch.manual_seed(0)
    if op == "batch_norm":
        return nn.BatchNorm1d(4)
    return nn.InstanceNorm1d(4, affine=True, track_running_stats=True)


@pytest.mark.parametrize("call", ["module", "builtin"])
@pytest.mark.parametrize("op", ["batch_norm", "instance_norm"])
def test_override_refuses_a_cast_of_running_statistics_the_op_updates(op: str, call: str) -> None:
    # batch_norm and instance_norm update their running statistics in place while training,
    # which their schemas do not say: a rule's cast would send the update into a copy.
    x = torch.randn(8, 4, 5) * 2 + 1
    m = _normalization(op)
    if call == "module":
        fn: Callable[[torch.Tensor], torch.Tensor] = m
    elif op == "batch_norm":
        fn = lambda x: torch.batch_norm(  # noqa: E731
            x, m.weight, m.bias, m.running_mean, m.running_var, True, 0.1, 1e-5, False
        )
    else:
        fn = lambda x: torch.instance_norm(  # noqa: E731
            x, m.weight, m.bias, m.running_mean, m.running_var, True, 0.1, 1e-5, False
        )
    start = m.running_mean.clone()
    with pytest.raises(ValueError, match=f"'lower' override of '{op}' would cast running_mean"):
        famp.autocast(fn, "c=bf16,o=bf16", rules=_cpu_rules({op: "lower"}))(x)
    assert torch.equal(m.running_mean, start)  # refused before the op ran
    m.to(BF16)
    with pytest.raises(ValueError, match=f"'float32' override of '{op}' would cast running_mean"):
        famp.autocast(fn, "c=bf16,o=bf16", rules=_cpu_rules({op: "float32"}))(x.to(BF16))


def test_override_refuses_the_statistics_cast_in_a_compiled_call_too() -> None:
    # Dynamo raises the refusal as its own error, with famp's message in it.
    m = _normalization("batch_norm")
    f = famp.autocast(m, "c=bf16,o=bf16", rules=_cpu_rules({"batch_norm": "lower"}), compile=True)
    with pytest.raises(Exception, match="'lower' override of 'batch_norm' would cast running_mean"):
        f(torch.randn(8, 4, 5))
    assert torch.equal(m.running_mean, torch.zeros(4))


@pytest.mark.parametrize("op", ["batch_norm", "instance_norm"])
def test_override_of_a_normalization_updates_its_statistics_or_reads_them(op: str) -> None:
    # Where the rule keeps the statistics' dtype, training updates them as torch does; in eval
    # they are only read, and a rule may cast them.
    x = torch.randn(8, 4, 5) * 2 + 1
    m, ref = _normalization(op), _normalization(op)
    f = famp.autocast(m, "c=bf16,o=f32", rules=_cpu_rules({op: "float32"}))
    assert_bitwise_equal(f(x), ref(x))  # float32 statistics, float32 input: torch's float32 op
    assert not torch.equal(ref.running_mean, torch.zeros(4))
    assert_bitwise_equal(m.running_mean, ref.running_mean)
    assert_bitwise_equal(m.running_var, ref.running_var)
    m.eval()
    ref.eval()
    out = famp.autocast(m, "c=bf16,o=bf16", rules=_cpu_rules({op: "lower"}))(x)
    lowered = ref.to(BF16)  # the same statistics and parameters, cast
    assert_bitwise_equal(out, lowered(x.to(BF16)))  # every argument cast: read-only statistics


def test_override_layer_norm_to_lower_runs_it_in_the_compute_dtype() -> None:
    p, x = _params(), torch.randn(4, D)
    rules = _cpu_rules({"layer_norm": "lower", "rms_norm": "lower"})

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.layer_norm(x, (D,), p["g"], p["b"]), torch.rms_norm(x, (D,), p["g"])

    ln, rms = famp.autocast(fn, "c=f16,o=f16", rules=rules)(x)
    assert (ln.dtype, rms.dtype) == (F16, F16)
    assert_bitwise_equal(ln, F.layer_norm(x.half(), (D,), p["g"].half(), p["b"].half()))
    assert_bitwise_equal(rms, F.rms_norm(x.half(), (D,), p["g"].half()))
    default_ln, _ = famp.autocast(fn, "c=f16,o=f32")(x)  # on CPU layer_norm keeps float32
    assert_bitwise_equal(default_ln, F.layer_norm(x, (D,), p["g"], p["b"]))


def test_override_to_promote_lower_and_float32_set_opt_dtype() -> None:
    a, b = torch.randn(4, D).to(BF16), torch.randn(D, D)
    rules = _cpu_rules(
        {
            "mm": "promote",
            "cat": "lower",
            "softmax": "float32_set_opt_dtype",
            "sum": "float32_set_opt_dtype",
        }
    )
    inside: list[torch.Tensor] = []

    def fn(a: torch.Tensor) -> None:
        inside.extend(
            [
                torch.mm(a, b),
                torch.cat([b, b]),
                a.softmax(-1),
                torch.softmax(a, -1, dtype=BF16),
                a.sum(0),
                torch.ops.aten.sum.dim_IntList(a, [0]),
            ]
        )

    famp.autocast(fn, "c=bf16", rules=rules)(a)
    expected = [
        torch.mm(a.float(), b),  # promote: float32 wins
        torch.cat([b, b]).to(BF16),  # lower: run in bfloat16
        a.softmax(-1, dtype=F32),
        a.softmax(-1, dtype=BF16),  # an explicit dtype= wins
        a.sum(0, dtype=F32),
        a.sum(0, dtype=F32),
    ]
    for actual, e in zip(inside, expected, strict=True):
        assert_bitwise_equal(actual, e)


def test_override_float32_append_dtype_redispatches_norm() -> None:
    x = torch.randn(4, D).to(BF16)
    rules = _cpu_rules(
        {"norm.Scalar": "float32_append_dtype", "norm.ScalarOpt_dim": "float32_append_dtype"}
    )

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.aten.norm.Scalar(x, 2), torch.ops.aten.norm.ScalarOpt_dim(x, 2, [1])

    whole, rows = famp.autocast(fn, "c=bf16,o=f32", rules=rules)(x)
    assert_bitwise_equal(whole, torch.ops.aten.norm.ScalarOpt_dtype(x, 2, dtype=F32))
    assert_bitwise_equal(rows, torch.ops.aten.norm.ScalarOpt_dim_dtype(x, 2, [1], False, dtype=F32))


@pytest.mark.parametrize("compiled", [False, True])
def test_override_float32_append_dtype_on_the_op_packet_redispatches_the_overload_it_picks(
    compiled: bool,
) -> None:
    # `aten.norm(x, p, [1])` names no overload: torch's dispatcher picks norm.ScalarOpt_dim,
    # whose float32_append_dtype rule redispatches to norm.ScalarOpt_dim_dtype (before, famp
    # passed dtype= to the packet, which matches no overload: a RuntimeError).
    x = torch.randn(4, D).to(BF16)
    rules = _cpu_rules(
        {"norm.Scalar": "float32_append_dtype", "norm.ScalarOpt_dim": "float32_append_dtype"}
    )

    def fn(x: torch.Tensor, p: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.aten.norm(x, p, [1]), torch.ops.aten.norm(x, p, [0], True)

    f = famp.autocast(fn, "c=bf16,o=f32", rules=rules)
    if compiled:
        f = torch.compile(f, fullgraph=True, backend="aot_eager")
    for p in (2, 3.0, None):
        rows, cols = f(x, p)
        assert_bitwise_equal(
            rows, torch.ops.aten.norm.ScalarOpt_dim_dtype(x, p, [1], False, dtype=F32)
        )
        assert_bitwise_equal(
            cols, torch.ops.aten.norm.ScalarOpt_dim_dtype(x, p, [0], True, dtype=F32)
        )


def test_banned_rule_raises_like_torch() -> None:
    rules = _cpu_rules({"binary_cross_entropy": "banned"})
    y = torch.rand(3)
    f = famp.autocast(lambda y: F.binary_cross_entropy(y, y), "c=f16", rules=rules)
    with pytest.raises(RuntimeError, match="unsafe to autocast"):
        f(y)
    assert _autocast_state() == CLEAN


def _mha_by_hand(mha: nn.MultiheadAttention, x: torch.Tensor) -> torch.Tensor:
    # F.multi_head_attention_forward's steps, written out: projections in float32, attention in
    # bfloat16 (scaled_dot_product_attention is "lower" on CPU).
    length, batch, embed = x.shape
    with torch.autocast("cpu", dtype=BF16):
        with torch.autocast("cpu", enabled=False):
            proj = F.linear(x, mha.in_proj_weight, mha.in_proj_bias)
        proj = proj.unflatten(-1, (3, embed)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(length, batch * 2, 4).transpose(0, 1).view(batch, 2, length, 4)

        attn = F.scaled_dot_product_attention(heads(proj[0]), heads(proj[1]), heads(proj[2]))
        assert attn.dtype == BF16
        attn = attn.permute(2, 0, 1, 3).contiguous().view(batch * length, embed)
        with torch.autocast("cpu", enabled=False):
            out = F.linear(attn.float(), mha.out_proj.weight, mha.out_proj.bias)
    return out.view(length, batch, embed)


@pytest.mark.parametrize("compiled", [False, True])
def test_override_reaches_the_linears_inside_multihead_attention(compiled: bool) -> None:
    # famp enters its copy of F.multi_head_attention_forward, which calls F.linear; compiled, the
    # reference is the hand-written steps compiled alike (aot_eager).
    torch.manual_seed(0)
    mha, x = nn.MultiheadAttention(8, 2), torch.randn(5, 3, 8)
    rules = _cpu_rules({"linear": "float32"})
    f = famp.autocast(lambda x: mha(x, x, x, need_weights=False)[0], "c=bf16,o=f32", rules=rules)
    by_hand = functools.partial(_mha_by_hand, mha)
    if compiled:
        f, by_hand = (torch.compile(g, fullgraph=True, backend="aot_eager") for g in (f, by_hand))
    assert_bitwise_equal(f(x), by_hand(x))


# --- property: random op sequences under random overrides ---------------------------------------
# Reference: torch.autocast around the whole sequence; an overridden op gets its inputs cast by
# hand (famp's own casts of a weight are reused within the call, as famp documents) and runs with
# autocast off. famp must give the same outputs, op dtypes and gradients, bit for bit.

PLAIN = ("lower", "float32", "promote", "keep")
WITH_DTYPE = (*PLAIN, "float32_set_opt_dtype")
SEQ_OPS: dict[str, tuple[str, Callable[..., torch.Tensor], tuple[str, ...], str]] = {
    # name: (aten packet, op, rules it accepts, its tensor inputs in order: h, then params)
    "linear": ("linear", lambda h, p: F.linear(h, p["w"], p["b"]), PLAIN, "hwb"),
    "matmul": ("matmul", lambda h, p: torch.matmul(h, p["w"]), PLAIN, "hw"),
    "addmm": ("addmm", lambda h, p: torch.addmm(p["b"], h, p["w"]), PLAIN, "bhw"),
    "layer_norm": ("layer_norm", lambda h, p: F.layer_norm(h, (D,), p["g"], p["b"]), PLAIN, "hgb"),
    "rms_norm": ("rms_norm", lambda h, p: F.rms_norm(h, (D,), p["g"]), PLAIN, "hg"),
    "softmax": ("softmax", lambda h, p: F.softmax(h, -1), WITH_DTYPE, "h"),
    "log_softmax": ("log_softmax", lambda h, p: h.log_softmax(-1), WITH_DTYPE, "h"),
    "sum": ("sum", lambda h, p: torch.sum(h, 0, keepdim=True), WITH_DTYPE, "h"),
    "tanh": ("tanh", lambda h, p: torch.tanh(h), PLAIN, "h"),
    "mul": ("mul", lambda h, p: h * p["g"], PLAIN, "hg"),
    "cat": ("cat", lambda h, p: torch.cat([h, p["w2"]], 0), PLAIN, "h2"),
}
SHAPE = {"sum": lambda t: t.expand(4, D), "cat": lambda t: t[:4]}  # dtype-preserving views


def _run_sequence(seq: list[str], x: torch.Tensor, p: dict[str, torch.Tensor]) -> torch.Tensor:
    h = x
    for name in seq:
        h = SHAPE.get(name, lambda t: t)(SEQ_OPS[name][1](h, p))
    return h


def _reference(
    seq: list[str],
    overrides: dict[str, str],
    compute: torch.dtype,
    x: torch.Tensor,
    p: dict[str, torch.Tensor],
) -> tuple[torch.Tensor, list[torch.dtype]]:
    cache: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if t.dtype == dtype or not t.is_floating_point():
            return t
        if dtype == compute and t.dtype == F32 and t.requires_grad and t.is_leaf:
            return cache.setdefault((id(t), dtype), t.to(dtype))
        return t.to(dtype)

    dtypes = []
    h = x
    with torch.autocast("cpu", dtype=compute):
        for name in seq:
            packet, fn, _, uses = SEQ_OPS[name]
            rule = overrides.get(packet)
            if rule is None:
                out = fn(h, p)
            else:
                inputs = [h if c == "h" else p["w2" if c == "2" else c] for c in uses]
                target = {"lower": compute, "float32": F32}.get(rule)
                if rule == "promote":  # torch's at::autocast::prioritize, in argument order
                    target = compute
                    for t in inputs:
                        if target == F32 or t.dtype == F32:
                            target = F32
                        elif t.dtype != target:
                            raise RuntimeError(
                                "Unexpected floating ScalarType in at::autocast::prioritize"
                            )
                # Only the parameters this op reads are cast, when it runs, as famp and
                # torch.autocast cast them: a cast made earlier would run later in the backward
                # and change the order in which a parameter's gradients are summed.
                used = {"w2" if c == "2" else c for c in uses}
                q = {k: cast(v, target) if k in used else v for k, v in p.items()} if target else p
                hin = cast(h, target) if target else h
                with torch.autocast("cpu", enabled=False):
                    if rule == "float32_set_opt_dtype" and name == "softmax":
                        out = F.softmax(hin, -1, dtype=F32)
                    elif rule == "float32_set_opt_dtype" and name == "log_softmax":
                        out = hin.log_softmax(-1, dtype=F32)
                    elif rule == "float32_set_opt_dtype":
                        out = torch.sum(hin, 0, keepdim=True, dtype=F32)
                    else:
                        out = fn(hin, q)
            dtypes.append(out.dtype)
            h = SHAPE.get(name, lambda t: t)(out)
    return h, dtypes


def _outcome(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except RuntimeError as e:  # mixed-dtype kernels refuse under "keep": both sides must refuse
        return e


# torch's rms_norm warns (on both sides) when a bfloat16 input meets a float32 weight.
@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight:UserWarning")
@hypothesis.given(
    seq=st.lists(st.sampled_from(sorted(SEQ_OPS)), min_size=1, max_size=5),
    data=st.data(),
    compute=st.sampled_from([BF16, F16]),
    output=st.sampled_from([BF16, F16, F32]),
    x_dtype=st.sampled_from([F32, BF16]),
)
def test_random_sequences_under_random_overrides_match_the_reference(
    seq: list[str],
    data: st.DataObject,
    compute: torch.dtype,
    output: torch.dtype,
    x_dtype: torch.dtype,
) -> None:
    overrides = {}
    for name in sorted(set(seq)):
        packet, _, allowed, _ = SEQ_OPS[name]
        rule = data.draw(st.sampled_from([None, *allowed]), label=packet)
        if rule is not None and rule != famp.default_rules("cpu").lookup(packet):
            overrides[packet] = rule
    policy = famp.Policy(F32, compute, output)
    p, x = _params(), torch.randn(4, D).to(x_dtype).requires_grad_()
    leaves = [x, *p.values()]

    dtypes: list[torch.dtype] = []

    def traced(x: torch.Tensor) -> torch.Tensor:
        h = x
        for name in seq:
            out = SEQ_OPS[name][1](h, p)
            dtypes.append(out.dtype)
            h = SHAPE.get(name, lambda t: t)(out)
        return h

    f = famp.autocast(traced, policy, rules=_cpu_rules(overrides))
    actual = _outcome(lambda: f(x))
    expected = _outcome(lambda: _reference(seq, overrides, compute, x, p))
    if isinstance(expected, RuntimeError):
        assert isinstance(actual, RuntimeError)
        assert str(actual) == str(expected)
        return
    assert not isinstance(actual, RuntimeError), actual
    e_out, e_dtypes = expected
    assert dtypes == e_dtypes
    e_out = policy.cast_to_output(e_out)
    assert_bitwise_equal(actual, e_out)
    grads = torch.autograd.grad(actual.float().sum(), leaves, allow_unused=True)
    e_grads = torch.autograd.grad(e_out.float().sum(), leaves, allow_unused=True)
    for a, e, leaf in zip(grads, e_grads, leaves, strict=True):
        assert (a is None) == (e is None)
        if a is not None:
            assert a.dtype == leaf.dtype
            assert_bitwise_equal(a, e)


# --- module rules -------------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.GELU())
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.norm(self.inp(x))))


NET_RULES = {"norm": "f32", "block.*": "c=f16,o=f16", "head": "p=f32,c=bf16,o=f32"}


def _net_reference(net: Net, x: torch.Tensor) -> torch.Tensor:
    """NET_RULES under policy c=bf16,o=bf16, written out with nested torch.autocast."""
    with torch.autocast("cpu", dtype=BF16):
        h = net.inp(x)
        with torch.autocast("cpu", enabled=False):  # "norm": float32, autocast off
            h = net.norm(h.float())
        torch.clear_autocast_cache()  # torch's cache ignores the dtype; famp clears it too
        with torch.autocast("cpu", dtype=F16):  # "block.*": block.0 and block.1, not block
            h = net.block[0](h.half()).half()
            h = net.block[1](h.half()).half()
        torch.clear_autocast_cache()
        h = net.head(h.to(BF16)).float()  # "head": compute bf16, output f32
    return h.to(BF16)  # the transform's output dtype


def test_module_rules_equal_hand_written_nested_autocast() -> None:
    torch.manual_seed(0)
    net, x = Net(), torch.randn(5, 6)
    expected = _net_reference(net, x)
    e_grads = torch.autograd.grad(expected.float().sum(), list(net.parameters()))
    for fn in (net, lambda x: net(x)):
        actual = famp.autocast(fn, "c=bf16,o=bf16", module_rules=NET_RULES)(x)
        assert_bitwise_equal(actual, expected)
        grads = torch.autograd.grad(actual.float().sum(), list(net.parameters()))
        for a, e in zip(grads, e_grads, strict=True):
            assert a.dtype == F32
            assert_bitwise_equal(a, e)
    assert _autocast_state() == CLEAN


def test_module_rules_follow_the_module_through_functional_call() -> None:
    torch.manual_seed(0)
    net, x = Net(), torch.randn(5, 6)
    params = {k: v.detach() * 0.5 for k, v in net.named_parameters()}

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(net, p, (x,)).float().pow(2).sum()

    grads, value = torch.func.grad_and_value(
        famp.autocast(loss, "c=bf16,o=bf16", module_rules=NET_RULES)
    )(params, x)
    clone = Net()
    clone.load_state_dict(params)
    expected = _net_reference(clone, x).float().pow(2).sum().to(BF16)
    assert_bitwise_equal(value, expected)
    e_grads = torch.autograd.grad(expected.float(), list(clone.parameters()))
    for (name, g), e in zip(grads.items(), e_grads, strict=True):
        assert g.dtype == params[name].dtype
        assert_bitwise_equal(g, e)


def test_module_rule_order_and_nesting() -> None:
    net, x = Net(), torch.randn(5, 6)
    seen: dict[str, torch.dtype] = {}
    hooks = [
        m.register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, out.dtype))
        for name, m in net.named_modules()
        if name
    ]
    try:
        # The first matching pattern wins; an inner matched module wins over its matched parent.
        famp.autocast(net, "c=bf16", module_rules={"block.0": "c=f16,o=f16", "block*": "f32"})(x)
    finally:
        for h in hooks:
            h.remove()
    assert seen == {
        "inp": BF16,
        "norm": BF16,  # layer_norm keeps its input's dtype on CPU
        "block.0": F16,
        "block.1": F32,
        "block": F32,
        "head": BF16,
    }


def test_module_rules_leave_the_root_and_unmatched_paths_alone() -> None:
    net, x = Net(), torch.randn(5, 6)
    plain = famp.autocast(net, "c=bf16")(x)
    with pytest.warns(famp.AutocastWarning, match=r"'nothing\.\*' \(nearest module paths"):
        unmatched = famp.autocast(net, "c=bf16", module_rules={"nothing.*": "f32"})(x)
    assert_bitwise_equal(unmatched, plain)
    whole = famp.autocast(net, "c=bf16,o=f32", module_rules={"": "f32"})(x)
    assert_bitwise_equal(whole, net(x))


# --- composition with torch.func ----------------------------------------------------------------


@pytest.mark.parametrize("model", ["mlp", "net"])
def test_vmap_of_grad_matches_torch_autocast_in_the_same_composition(model: str) -> None:
    torch.manual_seed(0)
    net = Net() if model == "net" else nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    xs = torch.randn(4, 6)
    params = {k: v.detach() for k, v in net.named_parameters()}

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(net, p, (x[None],)).float().pow(2).sum()

    def torch_loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16):
            return loss(p, x)

    def per_sample(f: Callable[..., torch.Tensor]) -> Any:
        return _outcome(lambda: torch.func.vmap(torch.func.grad(f), in_dims=(None, 0))(params, xs))

    expected = per_sample(torch_loss)
    actual = per_sample(famp.autocast(loss, "c=bf16,o=f32"))
    if isinstance(expected, RuntimeError):  # torch's layer_norm batching rule fails here
        assert isinstance(actual, RuntimeError)
        assert str(actual) == str(expected)
        return
    for name in params:
        assert actual[name].dtype == F32
        assert_bitwise_equal(actual[name], expected[name])


def test_grads_come_back_in_the_parameters_dtype() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(BF16)
    x = torch.randn(5, 6)
    params = {k: v.detach() for k, v in net.named_parameters()}

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(net, p, (x,)).float().sum()

    def torch_loss(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=F16):
            return loss(p, x)

    grads = torch.func.grad(famp.autocast(loss, "p=bf16,c=f16,o=f32"))(params, x)
    expected = torch.func.grad(torch_loss)(params, x)
    for name, g in grads.items():
        assert g.dtype == BF16
        assert_bitwise_equal(g, expected[name])


# --- torch.autocast inside the transform --------------------------------------------------------


def test_torch_autocast_inside_the_transform_behaves_as_nested_torch_autocast() -> None:
    lin, x = nn.Linear(4, 4), torch.randn(2, 4)

    def fn(x: torch.Tensor) -> list[torch.dtype]:
        dtypes = [lin(x).dtype]
        with torch.autocast("cpu", dtype=F16):  # an explicit dtype wins inside its region
            dtypes += [lin(x).dtype, F.layer_norm(x, (4,)).dtype]  # overrides follow it
        with torch.autocast("cpu"):  # no dtype: the policy's compute dtype
            dtypes.append(lin(x).dtype)
        with torch.autocast("cpu", enabled=False):  # off: no casts, no overrides
            dtypes += [lin(x).dtype, F.layer_norm(x, (4,)).dtype]
        return [*dtypes, lin(x).dtype]

    # The same weight is cast for bf16, then f16. torch's cache ignores the dtype: torch fails,
    # and so does famp with the default rules, which leave torch's cache as it is.
    with pytest.raises(RuntimeError, match="must have the same dtype"):
        famp.autocast(fn, "c=bf16")(x)
    # With op interception on, famp drops the cache whenever the dtype in effect changes.
    rules = _cpu_rules({"layer_norm": "lower"})
    assert famp.autocast(fn, "c=bf16", rules=rules)(x) == [BF16, F16, F16, BF16, F32, F32, BF16]
    assert _autocast_state() == CLEAN


# --- CUDA rules on fake CUDA tensors ------------------------------------------------------------
# FakeTensorMode reaches torch's CUDA autocast kernels on this CPU-only machine. Tensors must not
# require grad: torch's weight-cast cache aborts the process for fake CUDA tensors.


def _cuda_ops(x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> list[torch.dtype]:
    h = F.linear(x, w)
    return [
        out.dtype
        for out in (
            h,
            torch.mm(x, w),
            F.layer_norm(h, (8,), g, g),
            F.rms_norm(h, (8,), g),
            h.softmax(-1),
            h.log_softmax(-1, dtype=torch.float16),
            h.sum(),
            h.exp(),
            h.cumsum(0),
            torch.addcmul(h, h, x),
            F.gelu(h),
            F.mse_loss(h, x),
            torch.cat([h, x]),
        )
    ]


def test_default_cuda_rules_match_torch_cuda_autocast_on_fake_tensors() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, w, g = (
            torch.randn(4, 8, device="cuda"),
            torch.randn(8, 8, device="cuda"),
            torch.ones(8, device="cuda"),
        )
        famp_dtypes = famp.autocast(_cuda_ops, "c=f16", compile=False)(x, w, g)
        region = autocast_region("cuda", True, F16)
        with region:
            torch_dtypes = _cuda_ops(x, w, g)
        overridden = famp.autocast(
            _cuda_ops,
            "c=f16",
            rules=famp.default_rules("cuda").override(
                {"rms_norm": "lower", "layer_norm": "lower", "softmax": "keep", "mm": "float32"}
            ),
            compile=False,
        )(x, w, g)
    assert famp_dtypes == torch_dtypes
    assert torch_dtypes[:6] == [F16, F16, F32, F32, F32, F16]
    expected = list(torch_dtypes)
    expected[1:5] = [F32, F16, F16, F16]
    assert overridden == expected
    assert _autocast_state() == CLEAN


# --- custom_fwd / custom_bwd --------------------------------------------------------------------

STATES: list[tuple[str, bool, torch.dtype, tuple[torch.dtype, ...]]] = []


def _record(stage: str, *tensors: torch.Tensor) -> None:
    STATES.append(
        (
            stage,
            torch.is_autocast_enabled("cpu"),
            torch.get_autocast_dtype("cpu"),
            tuple(t.dtype for t in tensors),
        )
    )


def _function(fwd_decorator: Any, bwd_decorator: Any) -> type[torch.autograd.Function]:
    class ScaledMatmul(torch.autograd.Function):
        @staticmethod
        @fwd_decorator
        def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            _record("forward", a, b)
            ctx.save_for_backward(a, b)
            return torch.mm(a, b) * 2

        @staticmethod
        @bwd_decorator
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            a, b = ctx.saved_tensors
            _record("backward", grad)
            return torch.mm(grad, b.T) * 2, torch.mm(a.T, grad) * 2

    return ScaledMatmul


TORCH_BWD = torch.amp.custom_bwd(device_type="cpu")


@pytest.mark.parametrize(
    ("rule", "cast_inputs"), [("float32", F32), ("lower", BF16), ("keep", None)]
)
def test_custom_fwd_equals_torch_custom_fwd(rule: str, cast_inputs: torch.dtype | None) -> None:
    ours = _function(famp.custom_fwd(rule=rule), famp.custom_bwd)
    theirs = _function(torch.amp.custom_fwd(device_type="cpu", cast_inputs=cast_inputs), TORCH_BWD)
    a, b = torch.randn(3, 4, requires_grad=True), torch.randn(4, 2).to(BF16).requires_grad_()
    results = []
    for fn in (theirs, ours):
        STATES.clear()
        with torch.autocast("cpu", dtype=BF16):
            out = fn.apply(a, b)
        grads = torch.autograd.grad(out.float().sum(), [a, b])
        results.append((out, grads, list(STATES)))
    (e_out, e_grads, e_states), (out, grads, states) = results
    assert states == e_states
    assert_bitwise_equal(out, e_out)
    for g, e in zip(grads, e_grads, strict=True):
        assert_bitwise_equal(g, e)
    in_famp = famp.autocast(lambda a, b: ours.apply(a, b), "c=bf16,o=bf16")(a, b)
    assert_bitwise_equal(in_famp, e_out.to(BF16))


def test_custom_fwd_follows_module_rules_and_promotes() -> None:
    class Block(nn.Module):
        def __init__(self, fn: type[torch.autograd.Function]) -> None:
            super().__init__()
            self.fn = fn

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return self.fn.apply(a, b)

    lower = Block(_function(famp.custom_fwd(rule="lower"), famp.custom_bwd))
    promote = Block(_function(famp.custom_fwd(rule="promote"), famp.custom_bwd))
    a, b = torch.randn(3, 4, requires_grad=True), torch.randn(4, 2).to(BF16).requires_grad_()
    STATES.clear()
    out = famp.autocast(lower, "c=bf16", module_rules={"": "c=f16,o=f16"})(a, b.float())
    assert out.dtype == BF16  # the transform's output dtype
    assert STATES[0] == ("forward", False, F16, (F16, F16))  # the module's compute dtype
    STATES.clear()
    famp.autocast(promote, "c=bf16")(a, b)
    assert STATES[0] == ("forward", False, BF16, (F32, F32))  # float32 among the inputs wins
    STATES.clear()
    promote(a, b.float())  # outside autocast: a no-op
    assert STATES[0] == ("forward", False, BF16, (F32, F32))
    with pytest.raises(ValueError, match="rule must be one of keep, lower, float32, promote"):
        famp.custom_fwd(rule="float16")


# --- torch.compile ------------------------------------------------------------------------------

torch.manual_seed(0)
COMPILE_NET = Net()
COMPILE_X = torch.randn(5, 6)
COMPILE_CASES = {
    "default": {},
    "overrides": {
        "rules": _cpu_rules({"linear": "float32", "layer_norm": "lower", "gelu": "lower"})
    },
    "module_rules": {"module_rules": {"norm": "f32", "head": "c=f16,o=f16"}},
}


def _compile_loss(**kwargs: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    f = famp.autocast(COMPILE_NET, "c=bf16,o=f32", **kwargs)
    return lambda x: f(x).pow(2).sum()


@pytest.mark.parametrize("case", list(COMPILE_CASES))
def test_traces_with_fullgraph_and_no_graph_breaks(case: str) -> None:
    explanation = torch._dynamo.explain(_compile_loss(**COMPILE_CASES[case]))(COMPILE_X)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    assert _autocast_state() == CLEAN


@pytest.mark.parametrize("case", list(COMPILE_CASES))
def test_compiled_equals_eager_bitwise_with_aot_eager(case: str) -> None:
    # aot_eager runs the traced aten graph as is: its values are eager's, cast for cast.
    loss = _compile_loss(**COMPILE_CASES[case])
    params = list(COMPILE_NET.parameters())
    expected = loss(COMPILE_X)
    e_grads = torch.autograd.grad(expected, params)
    actual = torch.compile(loss, fullgraph=True, backend="aot_eager")(COMPILE_X)
    grads = torch.autograd.grad(actual, params)
    assert_bitwise_equal(actual, expected)
    for g, e in zip(grads, e_grads, strict=True):
        assert_bitwise_equal(g, e)
    assert _autocast_state() == CLEAN


def _torch_mlp_loss(x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=BF16):
        out = COMPILE_NET(x)
    return out.float().pow(2).sum()


FAMP_MLP = famp.autocast(COMPILE_NET, "c=bf16,o=f32")


def _famp_mlp_loss(x: torch.Tensor) -> torch.Tensor:
    return FAMP_MLP(x).pow(2).sum()


@pytest.mark.slow
def test_inductor_compiled_transform_equals_compiled_torch_autocast(
    transform: Callable[[Any], Any],
) -> None:
    # Inductor fuses and may round differently from eager, for torch.autocast as for famp: the
    # oracle for a compiled famp function is the compiled torch.autocast function.
    params = list(COMPILE_NET.parameters())
    expected = transform(_torch_mlp_loss)(COMPILE_X)
    e_grads = torch.autograd.grad(expected, params)
    actual = transform(_famp_mlp_loss)(COMPILE_X)
    grads = torch.autograd.grad(actual, params)
    assert_bitwise_equal(actual, expected)
    for g, e in zip(grads, e_grads, strict=True):
        assert_bitwise_equal(g, e)


def test_compile_argument_decides_when_to_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    compiled: list[Any] = []

    def fake_compile(fn: Any, **kwargs: Any) -> Any:
        compiled.append(kwargs)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    x = torch.randn(2, 4)
    famp.autocast(LIN, "c=bf16")(x)
    famp.autocast(LIN, "c=bf16", compile=False)(x)
    assert compiled == []
    famp.autocast(LIN, "c=bf16", compile=True)(x)
    assert compiled == [{"fullgraph": True}]
    # Inside torch.func transforms famp does not compile itself (torch.compile cannot run there).
    torch.func.grad(lambda x: famp.autocast(LIN, "c=bf16", compile=True)(x).float().sum())(x)
    assert len(compiled) == 1
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        on_cuda = torch.randn(2, 4, device="cuda")
        famp.autocast(lambda x: x * 2, "c=f16")(on_cuda)  # compile=None: CUDA inputs compile
        famp.autocast(lambda x: x * 2, "c=f16", compile=False)(on_cuda)
    assert len(compiled) == 2


def test_own_compile_specializes_an_input_the_caller_marked_dynamic(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # famp.autocast's own compile (compile=True; on CUDA by default) is famp's: an input that
    # the caller marked with mark_dynamic for a compile of theirs, and that this graph
    # specializes (x @ w with a w of fixed size), runs as under torch.autocast, which does not
    # compile. Before, it raised Dynamo's ConstraintViolationError (found on an H100). Marked
    # arguments are found before the call: torch logs no refused guard for them.
    from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

    refused: list[logging.LogRecord] = []
    guards_log = logging.getLogger("torch._guards")  # where Dynamo logs a refused guard
    handler = logging.Handler()
    handler.emit = refused.append  # type: ignore[method-assign]
    monkeypatch.setattr(guards_log, "handlers", [*guards_log.handlers, handler])  # restored after
    w = torch.randn(5, 3)
    policy = "params=float32,compute=bfloat16,output=float32"
    dot = famp.autocast(lambda x: x @ w, policy, compile=True)

    def marked(n: int, dims: tuple[int, ...]) -> torch.Tensor:
        x = torch.randn(n, 5)
        for d in dims:
            torch._dynamo.mark_dynamic(x, d)
        return x

    for x in (marked(4, (1,)), marked(4, (0, 1)), marked(6, (0, 1)), marked(7, (0,))):
        with torch.autocast("cpu", dtype=BF16):
            expected = (x @ w).float()
        assert_bitwise_equal(dot(x), expected)
    # famp.value_and_grad eagerly: w a fresh leaf (no mark), x marked (the case the H100 found)
    dot_w = famp.autocast(lambda w, x: x @ w, policy, compile=True)
    w1, x1 = torch.full((5,), 2.0), torch.arange(1.0, 6.0)
    torch._dynamo.mark_dynamic(x1, 0)
    loss, grad, found_inf, _ = famp.value_and_grad(dot_w)(famp.init_scaler(2.0**10), w1, x1)
    param = nn.Parameter(w1.clone())
    with torch.autocast("cpu", dtype=BF16):
        expected = x1 @ param
    expected.float().backward()
    assert_bitwise_equal(loss, expected.float())
    assert param.grad is not None
    assert_bitwise_equal(grad, param.grad)
    assert found_inf.item() == 0.0
    assert refused == []
    # A marked tensor the arguments do not reach (a closure's): one refused trace, then a retry.
    y = marked(4, (1,))
    closure = famp.autocast(lambda: y @ w, policy, device_type="cpu", compile=True)
    with torch.autocast("cpu", dtype=BF16):
        expected = (y @ w).float()
    assert_bitwise_equal(closure(), expected)
    assert refused, "the closure's marks were not refused: the retry went untested"
    # The caller's own compile keeps its marks: famp's call inside it refuses what
    # torch.autocast inside it refuses.
    for inner in (dot, lambda x: torch.autocast("cpu", dtype=BF16)(lambda: x @ w)()):
        with pytest.raises(ConstraintViolationError):
            torch.compile(inner, fullgraph=True)(marked(4, (1,)))
        torch.compiler.reset()


def test_overload_keys_apply_to_python_calls_of_that_overload() -> None:
    x, w = torch.randn(1, 2, 5, 5), torch.randn(3, 2, 3, 3)
    rules = _cpu_rules({"conv2d.padding": "float32"})

    def fn(x: torch.Tensor) -> list[torch.dtype]:
        return [
            F.conv2d(x, w, padding="same").dtype,  # aten::conv2d.padding
            F.conv2d(x, w, padding=1).dtype,  # aten::conv2d (default): still "lower"
            torch.ops.aten.conv2d.padding(x, w, None, [1, 1], "valid").dtype,
        ]

    assert famp.autocast(fn, "c=bf16", rules=rules)(x) == [F32, BF16, F32]


def test_overrides_compile_through_torch_python_functions_they_do_not_touch() -> None:
    # F.adaptive_avg_pool2d calls helpers Dynamo keeps out of graphs: famp enters torch's Python
    # functions only when they may call an overridden op, and so leaves this one whole.
    torch.manual_seed(0)
    cnn = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(16, 3)
    )
    rules = _cpu_rules({"conv2d": "float32", "softmax": "lower"})
    f = famp.autocast(lambda x: cnn(x).softmax(-1), "c=bf16,o=f32", rules=rules)
    x = torch.randn(2, 3, 8, 8)
    explanation = torch._dynamo.explain(f)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert_bitwise_equal(torch.compile(f, fullgraph=True, backend="aot_eager")(x), f(x))


# Ops Dynamo did not hand to famp's mode (torch's C bindings outside `torch.overrides`' list, and
# Python functions such as F.hardswish): compiled, their overrides did nothing before 2026-11-30.
# Each: (the overridden op, what runs before it under autocast, the call).
REACHED_TARGET = torch.randint(0, 6, (4,), generator=torch.Generator().manual_seed(0))
# Built outside: Dynamo turns `nn.CrossEntropyLoss(...)` built inside a compiled function into
# F.cross_entropy in the graph, past every torch function mode (docs/autocast.md, Compilation).
REACHED_LOSS = nn.CrossEntropyLoss(label_smoothing=0.1)
_ONE = lambda h: (h,)  # noqa: E731
_POOLED = lambda h: (h.mean((2, 3)),)  # noqa: E731
REACHED: dict[str, tuple[str, Callable[..., Any], Callable[..., torch.Tensor]]] = {
    "F.hardswish": ("hardswish", _ONE, F.hardswish),
    "F.hardsigmoid": ("hardsigmoid", _ONE, F.hardsigmoid),
    "torch._C._nn.silu": ("silu", _ONE, torch._C._nn.silu),
    "F.cross_entropy": (
        "cross_entropy_loss",
        _POOLED,
        lambda z: F.cross_entropy(z, REACHED_TARGET),
    ),
    "nn.CrossEntropyLoss": (
        "cross_entropy_loss",
        _POOLED,
        lambda z: REACHED_LOSS(z, REACHED_TARGET),
    ),
    "F.nll_loss": ("nll_loss", _POOLED, lambda z: F.nll_loss(z, REACHED_TARGET)),
    "torch._C._nn.mse_loss": ("mse_loss", lambda h: (h, h * 0.5), torch._C._nn.mse_loss),
    "F.interpolate nearest": (
        "upsample_nearest2d",
        _ONE,
        lambda z: F.interpolate(z, scale_factor=2),
    ),
    "F.interpolate bilinear": (
        "upsample_bilinear2d",
        _ONE,
        lambda z: F.interpolate(z, scale_factor=2, mode="bilinear"),
    ),
    "F.leaky_relu": ("leaky_relu", _ONE, lambda z: F.leaky_relu(z, 0.1)),
    "torch.einsum": (
        "einsum",
        lambda h: (h, h * 2),
        lambda a, b: torch.einsum("bchw,bdhw->bcd", a, b),
    ),
    # A private binding that torch's modules call (nn.utils.parametrizations.weight_norm), not
    # torch's functions: missed compiled before 2026-12-01 (0.0039 off with nn.Linear).
    "torch._weight_norm": (
        "_weight_norm",
        lambda h: (h, h.mean((1, 2, 3), keepdim=True)),
        lambda v, g: torch._weight_norm(v, g, 0),
    ),
}


@pytest.mark.parametrize("rule", ["lower", "float32"])
@pytest.mark.parametrize("case", list(REACHED))
def test_an_override_reaches_the_op_compiled_as_eagerly(case: str, rule: str) -> None:
    """Compiled (aot_eager: eager's values, cast for cast), each override equals torch by hand:
    `torch.autocast` around the function, the overridden call run with autocast off on inputs
    cast to the rule's dtype. Before, compiled, several ran as if not overridden."""
    packet, before, op = REACHED[case]
    x = torch.randn(4, 6, 8, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    w = torch.eye(8).requires_grad_()

    def function(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return op(*before(x @ w)).float().sum()

    def by_hand(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16):
            inputs = before(x @ w)
            with torch.autocast("cpu", enabled=False):
                out = op(*(t.to(BF16 if rule == "lower" else F32) for t in inputs))
        return out.float().sum()

    f = famp.autocast(function, "c=bf16,o=f32", rules=_cpu_rules({packet: rule}), compile=False)
    expected = by_hand(x, w)
    e_grads = torch.autograd.grad(expected, (x, w))
    torch._dynamo.reset()
    for actual in (f(x, w), torch.compile(f, fullgraph=True, backend="aot_eager")(x, w)):
        assert_bitwise_equal(actual, expected)
        for g, e in zip(torch.autograd.grad(actual, (x, w)), e_grads, strict=True):
            assert_bitwise_equal(g, e)


@pytest.mark.parametrize("rule", ["lower", "float32"])
def test_an_override_of_a_private_op_called_directly_applies_compiled(rule: str) -> None:
    # torch._addmm_activation (CPU table: lower; no derivative) outside every torch function:
    # compiled, it ran as if not overridden before 2026-12-01.
    bias, m1, m2 = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(2)).unbind()

    def function(bias: torch.Tensor, m1: torch.Tensor, m2: torch.Tensor) -> torch.Tensor:
        return torch._addmm_activation(bias[0], m1, m2).float()

    with torch.autocast("cpu", enabled=False):
        dtype = BF16 if rule == "lower" else F32
        expected = function(*(t.to(dtype) for t in (bias, m1, m2)))
    rules = _cpu_rules({"_addmm_activation": rule})
    f = famp.autocast(function, "c=bf16,o=f32", rules=rules, compile=False)
    torch._dynamo.reset()
    for actual in (
        f(bias, m1, m2),
        torch.compile(f, fullgraph=True, backend="aot_eager")(bias, m1, m2),
    ):
        assert_bitwise_equal(actual, expected)
    if rule == "float32":  # the case that would show the default rule
        assert not torch.equal(expected, function(*(t.to(BF16) for t in (bias, m1, m2))))


REFLECTED = {  # torch's reflected operators, and an op each calls: Tensor.__rsub__ calls rsub
    "rsub": lambda x: 2.5 - x,
    "remainder": lambda x: 0.3 % x,
    "reciprocal": lambda x: 3 / x,
    "floor_divide": lambda x: 300 // x,
    "mul": lambda x: 3 / x,  # __rtruediv__: x.reciprocal() * 3
    "pow": lambda x: 2.0**x,
}


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("packet", list(REFLECTED))
def test_an_override_of_a_reflected_operators_op_compiles(packet: str, backend: str) -> None:
    """Compiled, Dynamo raised "Guard failed on the same frame it was created" on famp's lookup
    of `Tensor.__rsub__` among the functions it enters. Against `torch.autocast` by hand,
    compiled alike (inductor rounds its fused arithmetic otherwise than eager), and eagerly."""
    op = REFLECTED[packet]
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(0)) + 4.0

    def function(x: torch.Tensor) -> torch.Tensor:
        return op(x @ torch.eye(8)).float().sum()

    def by_hand(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16):
            h = x @ torch.eye(8)
            with torch.autocast("cpu", enabled=False):
                return op(h.to(BF16)).float().sum()

    rules = _cpu_rules({packet: "lower"})
    f = famp.autocast(function, "c=bf16,o=f32", rules=rules, compile=False)
    assert_bitwise_equal(f(x), by_hand(x))
    torch._dynamo.reset()
    expected = torch.compile(by_hand, fullgraph=True, backend=backend)(x)
    torch._dynamo.reset()
    assert_bitwise_equal(torch.compile(f, fullgraph=True, backend=backend)(x), expected)


# torch/functional.py's functions, which Dynamo refuses to trace (its skip list): famp enters
# them where an override names an op their code may reach, and compiled that raised "marked as
# skipped" before 2026-12-01. And `boolean_dispatch`'s wrappers (`torch.unique`, `F.max_pool2d`),
# which torch's functions hand to the modes: famp called them whole, eagerly too, so that an
# override of the op inside did nothing. Each: (the overrides, the call on a bf16 `h`, by hand).
_WINDOW = torch.hann_window(4)
SKIPPED: dict[str, tuple[tuple[str, ...], Callable[..., Any], Callable[..., Any]]] = {
    "einsum": (
        ("sub", "rsub", "add", "remainder"),
        lambda h: torch.einsum("bi,bj->bij", h, h * 2),
        lambda h: torch.einsum("bi,bj->bij", h, h * 2),  # none of them reaches a tensor
    ),
    "tensordot": (
        ("add",),
        lambda h: torch.tensordot(h, h, dims=([1], [1])),
        lambda h: torch.tensordot(h, h, dims=([1], [1])),
    ),
    "stft": (
        ("mul", "add", "floor_divide"),
        lambda h: torch.stft(h.float(), 4, window=_WINDOW, return_complex=True).abs(),
        lambda h: torch.stft(h.float(), 4, window=_WINDOW, return_complex=True).abs(),
    ),
    "norm": (
        ("linalg_vector_norm",),
        lambda h: torch.norm(h),
        lambda h: _unautocast(torch.linalg.vector_norm, h.float(), 2),  # the override: float32
    ),
    "norm, dim": (
        ("linalg_vector_norm",),
        lambda h: torch.norm(h, dim=1),
        lambda h: _unautocast(torch.linalg.vector_norm, h.float(), 2, [1]),
    ),
    "unique, dim": (  # `unique_dim`, called by its helper `_unique_impl`
        ("unique_dim",),
        lambda h: torch.unique(h.detach().round(), dim=0),
        lambda h: _unautocast(torch.unique, h.detach().round().float(), dim=0),
    ),
    "unique": (
        ("_unique2",),
        lambda h: torch.unique(h.detach().round()),
        lambda h: _unautocast(torch.unique, h.detach().round().float()),
    ),
    "F.max_pool2d, indices": (
        ("max_pool2d_with_indices",),
        lambda h: F.max_pool2d(h[None, None], 2, return_indices=True)[0],
        lambda h: _unautocast(F.max_pool2d, h[None, None].float(), 2, return_indices=True)[0],
    ),
}


def _unautocast(op: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with torch.autocast("cpu", enabled=False):
        return op(*args, **kwargs)


@pytest.mark.parametrize(
    ("backend", "dynamic"), [("eager", False), ("aot_eager", True)], ids=["eager", "aot_eager"]
)
@pytest.mark.parametrize("case", list(SKIPPED))
def test_an_override_inside_a_function_dynamo_skips_compiles(
    case: str, backend: str, dynamic: bool
) -> None:
    """Eagerly, and compiled with fullgraph (the `eager` backend runs Dynamo's graph as its code
    reads; `aot_eager` with dynamic shapes), on two shapes (a recompile, static): values and
    gradients equal torch by hand, `torch.autocast` around the call with the overridden op run as
    its rule says (the division after it rounds otherwise in bfloat16)."""
    packets, op, by_hand = SKIPPED[case]
    rules = _cpu_rules(dict.fromkeys(packets, "float32"))
    w = torch.eye(8).requires_grad_()

    def function(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return op(x @ w) / 3

    def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16):
            return (by_hand(x @ w) / 3).float()

    f = famp.autocast(function, "c=bf16,o=f32", rules=rules, compile=False)
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend=backend, dynamic=dynamic)
    for rows in (6, 5):
        x = torch.randn(rows, 8, generator=torch.Generator().manual_seed(rows)) + 1
        x.requires_grad_()
        expected = reference(x, w)
        grads = expected.requires_grad  # not `unique`'s
        e_grads = torch.autograd.grad(expected.sum(), (x, w)) if grads else ()
        for actual in (f(x, w), compiled(x, w)):
            assert_bitwise_equal(actual, expected)
            if grads:
                for g, e in zip(torch.autograd.grad(actual.sum(), (x, w)), e_grads, strict=True):
                    assert_bitwise_equal(g, e)


_TARGET = (torch.arange(10).reshape(2, 5) % 2).float()
_Y = torch.linspace(-2.0, 2.0, 10).reshape(2, 5)


def _mlsm_by_hand(z: torch.Tensor) -> torch.Tensor:  # F.multilabel_soft_margin_loss's own code
    logsigmoid = functools.partial(_unautocast, F.logsigmoid)
    t = _TARGET
    loss = -(t * logsigmoid(z.bfloat16()) + (1 - t) * logsigmoid((-z).bfloat16()))
    return (loss.sum(dim=1) / z.size(1)).mean()


# Overrides of ops called under other names: by an operator (`-x` in F.softmin's code, which
# famp did not read; `x == y`, which reaches the modes as `Tensor.__eq__`, named "__eq__") or by
# an alias (F.multilabel_soft_margin_loss calls `F.logsigmoid`, which is `log_sigmoid`). Before
# 2026-12-01 those overrides did nothing there, eagerly and compiled; the other operators reach
# the modes by their ops' names (`x % y` as `remainder`). Each: (the "lower" overrides, the call
# on float32 `x`, torch by hand).
INNER: dict[str, tuple[tuple[str, ...], Callable[..., Any], Callable[..., Any]]] = {
    "F.softmin: -x": (
        ("neg",),
        lambda x: F.softmin(x, -1),
        lambda x: _unautocast(torch.neg, x.bfloat16()).softmax(-1),
    ),
    "F.multilabel_soft_margin_loss: F.logsigmoid": (
        ("log_sigmoid",),
        lambda x: F.multilabel_soft_margin_loss(x, _TARGET),
        _mlsm_by_hand,
    ),
    "x == y": (("eq",), lambda x: x == _Y, lambda x: _unautocast(torch.eq, *_lower(x, _Y))),
    "x <= y": (("le",), lambda x: x <= _Y, lambda x: _unautocast(torch.le, *_lower(x, _Y))),
    "0.1 < x": (("gt",), lambda x: x > 0.1, lambda x: _unautocast(torch.gt, x.bfloat16(), 0.1)),
    "x % y": (
        ("remainder",),
        lambda x: x % _Y,
        lambda x: _unautocast(torch.remainder, *_lower(x, _Y)),
    ),
}


def _lower(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.bfloat16() for t in tensors]


@pytest.mark.parametrize(
    ("backend", "dynamic"), [("eager", False), ("aot_eager", True)], ids=["eager", "aot_eager"]
)
@pytest.mark.parametrize("case", list(INNER))
def test_an_override_reaches_an_op_called_by_operator_or_alias(
    case: str, backend: str, dynamic: bool
) -> None:
    """Eagerly and compiled (fullgraph), on two inputs: values and gradients equal torch by hand,
    `torch.autocast` around the call with the overridden op run in bfloat16 with autocast off."""
    packets, op, by_hand = INNER[case]
    rules = _cpu_rules(dict.fromkeys(packets, "lower"))

    def function(x: torch.Tensor) -> torch.Tensor:
        return op(x) / 3  # the division rounds otherwise in bfloat16

    def reference(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16):
            return (by_hand(x) / 3).float()

    f = famp.autocast(function, "c=bf16,o=f32", rules=rules, compile=False)
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend=backend, dynamic=dynamic)
    for seed in (0, 1):
        x = torch.linspace(-2.0, 2.0, 10).reshape(2, 5) * (1.001 + seed / 7)
        x.requires_grad_()
        expected = reference(x)
        grads = expected.requires_grad  # not comparisons'
        e_grad = torch.autograd.grad(expected.sum(), x) if grads else ()
        for actual in (f(x), compiled(x)):
            assert_bitwise_equal(actual, expected)
            if grads:
                assert_bitwise_equal(torch.autograd.grad(actual.sum(), x)[0], e_grad[0])


_L1_W = torch.rand(4, 5, generator=torch.Generator().manual_seed(2)) + 0.1


@pytest.mark.parametrize("options", ["override", "track_casts"])
def test_l1_loss_keeps_its_weight_under_famps_mode(options: str) -> None:
    """torch's `F.l1_loss` hands its call to the torch function modes without `weight`: under
    famp's mode (an override of any op, or `track_casts`) it gave the unweighted loss before
    2026-12-01. Eagerly and compiled, equal to `torch.autocast`."""
    kwargs: dict[str, Any] = (
        {"rules": _cpu_rules({"mul": "float32"})}
        if options == "override"
        else {"track_casts": True}
    )
    a, b = torch.randn(2, 4, 5, generator=torch.Generator().manual_seed(1)).unbind()
    a.requires_grad_()

    def function(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.l1_loss(a @ torch.eye(5), b, weight=_L1_W) / 3

    with torch.autocast("cpu", dtype=BF16):
        expected = function(a, b).float()
    e_grad = torch.autograd.grad(expected, a)[0]
    f = famp.autocast(function, "c=bf16,o=f32", compile=False, **kwargs)
    torch._dynamo.reset()
    for actual in (f(a, b), torch.compile(f, fullgraph=True, backend="eager")(a, b)):
        assert_bitwise_equal(actual, expected)
        assert_bitwise_equal(torch.autograd.grad(actual, a)[0], e_grad)


@pytest.mark.filterwarnings("ignore:torch.chain_matmul is deprecated")
@pytest.mark.filterwarnings("ignore:torch.chain_matmul is deprecated")  # warned once a process
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_chain_matmul_takes_its_out_under_famps_mode(dtype: torch.dtype) -> None:
    """`torch.chain_matmul` hands its call on without `out`: famp's mode ran it without it,
    returned a result and left `out` unwritten, where `torch.autocast` refuses either dtype of
    `out` (its matmuls compute in bfloat16, multi_dot checks for float32): the same error now."""
    m = torch.randn(3, 4, 4, generator=torch.Generator().manual_seed(0)).unbind()
    out = torch.zeros(4, 4, dtype=dtype)
    with pytest.raises(RuntimeError) as by_hand, torch.autocast("cpu", dtype=BF16):
        torch.chain_matmul(*m, out=out)
    f = famp.autocast(
        lambda: torch.chain_matmul(*m, out=out), "c=bf16", device_type="cpu", track_casts=True
    )
    with pytest.raises(RuntimeError, match=re.escape(str(by_hand.value))):
        f()


def _ast_dropped(func: Any) -> tuple[str, ...]:
    """What `func`'s `handle_torch_function(api, relevant_args, *args, **kwargs)` call leaves
    out, read off its source (slow: for the test only)."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(func.__code__)))
    code = func.__code__
    params = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and "handle_torch_function"
        in (getattr(node.func, "id", None), getattr(node.func, "attr", None))
    ]
    if not calls:
        return ()
    handed = [*calls[0].args[2:], *(k.value for k in calls[0].keywords)]
    passed = {n.id for arg in handed for n in ast.walk(arg) if isinstance(n, ast.Name)}
    return tuple(p for p in params if p not in passed)


def test_the_arguments_torch_functions_drop_are_read_as_their_source_says() -> None:
    """famp reads which parameters each torch Python function leaves out of the call it hands
    to the modes from its bytecode (`famp._autocast.handed.dropped`); its source says the same,
    for every function famp may receive, on the installed torch and Python."""
    from famp._autocast.entered import copies
    from famp._autocast.handed import dropped

    read = {f: dropped(f) for f in copies() if "handle_torch_function" in f.__code__.co_names}
    assert len(read) > 100
    assert read[F.l1_loss] == ("weight",)
    assert {f: d for f, d in read.items() if d} == {
        f: _ast_dropped(f) for f in read if _ast_dropped(f)
    }


def test_a_traceback_through_a_copy_of_torch_functional_shows_torchs_lines() -> None:
    """Compiled, famp enters copies of torch/functional.py's functions under a file name of their
    own (for Dynamo): an error raised in one still shows torch's line, as eagerly."""
    f = famp.autocast(
        lambda x: torch.tensordot(x, x, dims=-1), "c=bf16", rules=_cpu_rules({"add": "float32"})
    )
    line = 'raise RuntimeError(f"tensordot expects dims >= 0, but got dims={dims}")'
    with pytest.raises(RuntimeError, match="tensordot expects dims >= 0") as raised:
        f(torch.randn(3))
    assert traceback.extract_tb(raised.value.__traceback__)[-1].line == line
    torch._dynamo.reset()
    with pytest.raises(RuntimeError) as raised:
        torch.compile(f, fullgraph=True, backend="eager")(torch.randn(3))
    assert 'File "<famp\'s copy of torch/functional.py>", line ' in str(raised.value)
    assert f", in tensordot\n    {line}\n" in str(raised.value)


@pytest.mark.parametrize("packet", list(REFLECTED))
def test_a_reflected_operator_compiles_beside_an_unrelated_override(packet: str) -> None:
    """With an override of another op, Dynamo hands `2.5 - x` (`Tensor.__rsub__`, a Python
    wrapper) to famp's mode, which calls it as a method by name; torch 2.15's Dynamo names the
    wrapper by its code, `wrapped`, and the call raised "'Tensor' object has no attribute
    'wrapped'" before 2026-12-01. Against `torch.autocast` by hand, compiled alike."""
    op = REFLECTED[packet]
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(0)) + 4.0

    def function(x: torch.Tensor) -> torch.Tensor:
        return op(x @ torch.eye(8)).float().sum()

    def by_hand(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16):
            return function(x)

    f = famp.autocast(function, "c=bf16,o=f32", rules=_cpu_rules({"tanh": "float32"}))
    torch._dynamo.reset()
    expected = torch.compile(by_hand, fullgraph=True, backend="eager")(x)
    torch._dynamo.reset()
    assert_bitwise_equal(torch.compile(f, fullgraph=True, backend="eager")(x), expected)


SEEN: list[str] = []


class _Names(torch.overrides.TorchFunctionMode):  # at module level: Dynamo keeps its appends
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        SEEN.append(getattr(func, "__name__", ""))
        return func(*args, **(kwargs or {}))


def _named_calls(x: torch.Tensor) -> torch.Tensor:
    with _Names():
        return F.hardswish(x) + torch._C._nn.silu(x)


def test_a_torch_function_mode_sees_torchs_bindings_compiled_as_eagerly() -> None:
    """What famp changes for every compiled mode once a compiled call of famp's with an override
    ran: Dynamo hands a mode the calls it sees eagerly (F.hardswish, torch._C._nn.silu)."""
    x = torch.randn(3)
    _named_calls(x)
    assert SEEN == ["hardswish", "silu", "add"]
    SEEN.clear()
    torch._dynamo.reset()
    f = famp.autocast(lambda x: x.sum(), "c=bf16", rules=_cpu_rules({"silu": "float32"}))
    torch.compile(f, fullgraph=True, backend="eager")(x)
    torch.compile(_named_calls, fullgraph=True, backend="eager")(x)
    assert SEEN == ["hardswish", "silu", "add"]


BUILT_INSIDE_W = torch.randn(4, 4, generator=torch.Generator().manual_seed(3)).requires_grad_()


def _built_inside(x: torch.Tensor, rules: famp.OpRules) -> torch.Tensor:
    return famp.autocast(lambda x: F.linear(x, BUILT_INSIDE_W).softmax(-1), "c=bf16", rules=rules)(
        x
    )


def test_a_transform_with_rules_builds_inside_a_compiled_function() -> None:
    # Dynamo cannot trace the op schemas the overrides are read from: famp reads them at trace
    # time. The compiled function must apply the overrides as the eager one does.
    x = torch.randn(2, 4)
    rules = _cpu_rules({"linear": "float32", "softmax": "lower"})
    expected = _built_inside(x, rules)
    actual = torch.compile(_built_inside, fullgraph=True, backend="aot_eager")(x, rules)
    assert actual.dtype == BF16
    assert_bitwise_equal(actual, expected)
    assert not torch.equal(actual, _built_inside(x, _cpu_rules({})))


@pytest.mark.parametrize("dynamic", [False, True])
def test_module_rules_compile_fullgraph_with_static_and_dynamic_shapes(dynamic: bool) -> None:
    # Eagerly the module hooks are registered with torch's public functions; while Dynamo traces
    # (which cannot build their handles) they must still be seen, with shapes static or dynamic.
    loss = _compile_loss(**COMPILE_CASES["module_rules"])
    compiled_loss = torch.compile(loss, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for rows in (5, 7):
        x = torch.randn(rows, 6, generator=torch.Generator().manual_seed(rows))
        assert_bitwise_equal(compiled_loss(x), loss(x))
        assert _autocast_state() == CLEAN


# --- the copies of torch's Python functions (famp/_autocast/entered.py) --------------------------


def _code_names(code: Any) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _code_names(const)
    return names


def test_copies_of_torch_python_functions_differ_only_in_the_torch_function_checks() -> None:
    # The mode enters copies of torch's Python functions whose has_torch_function* globals answer
    # False. On the installed torch, each copy must be the original in everything else: the same
    # code, defaults, closure, and every global its code names bound to the same object as in the
    # original's module now (so a global torch sets or changes after famp's import is no risk).
    # A wrapper that hands its call to such functions (`torch.unique`) holds their copies instead.
    from famp._autocast.entered import _CHECKS, copies

    assert len(copies()) > 100  # F.*, torch.functional.*, Python Tensor methods
    wrappers = 0
    for original, copy in copies().items():
        assert copy.__code__ is original.__code__, original
        assert copy.__defaults__ is original.__defaults__, original
        assert copy.__kwdefaults__ is original.__kwdefaults__, original
        if not set(_CHECKS) & _code_names(original.__code__):
            wrappers += 1
            held = [cell.cell_contents for cell in original.__closure__]
            assert [c.cell_contents for c in copy.__closure__] == [copies().get(v, v) for v in held]
            assert copy.__globals__ is original.__globals__
            continue
        assert copy.__closure__ is original.__closure__, original
        for name in _code_names(original.__code__):
            if name in _CHECKS:
                assert copy.__globals__[name](torch.ones(1)) is False
            elif name in original.__globals__:
                assert copy.__globals__[name] is original.__globals__[name], (original, name)
            else:
                assert name not in copy.__globals__, (original, name)
    assert copies()[torch.unique] is not torch.unique
    assert wrappers >= 8  # torch.unique, torch.unique_consecutive, F.max_pool1d, ...


def test_traced_copies_differ_from_the_copies_only_where_dynamo_needs() -> None:
    # While Dynamo traces, famp enters copies of torch/functional.py's code and of the wrappers
    # in torch/_jit_internal.py under a file name of their own (Dynamo skips those files), with
    # `_VF`'s bindings as the aten ops of the same names, and torch.functional's plain helpers as
    # copies alike; all else as `copies()`.
    from famp._autocast.entered import _CHECKS, copies, traced_copies

    assert traced_copies().keys() == copies().keys()
    renamed = {
        "torch.functional": "torch/functional.py",
        "torch._jit_internal": "torch/_jit_internal.py",
    }
    for original, eager in copies().items():
        traced = traced_copies()[original]
        module = original.__globals__["__name__"]
        file = renamed.get(module)
        if file is None:
            assert traced.__code__ is eager.__code__, original
            # The names its code reads (each copy's globals are the module's at the time it was
            # made: torch imports more of itself later, e.g. torch._appdirs, by other tests).
            for name in _code_names(original.__code__):
                assert traced.__globals__.get(name) is eager.__globals__.get(name), (original, name)
            continue
        assert traced.__code__ == original.__code__  # code objects compare without file names
        assert traced.__code__.co_filename == f"<famp's copy of {file}>"
        assert linecache.getline(traced.__code__.co_filename, 1) == linecache.getline(
            original.__code__.co_filename, 1
        )
        if module == "torch._jit_internal":
            continue
        globals_ = traced.__globals__
        assert "__name__" not in globals_
        for name in _code_names(original.__code__) & original.__globals__.keys():
            value = original.__globals__[name]
            if name in _CHECKS:
                assert globals_[name](torch.ones(1)) is False
            elif name not in ("__name__", "_VF") and globals_[name] is not value:  # a helper
                assert value.__globals__ is original.__globals__, name
                assert not set(_CHECKS) & _code_names(value.__code__), name
                assert globals_[name].__code__ == value.__code__.replace(
                    co_filename=traced.__code__.co_filename
                )
                assert globals_[name].__globals__ is globals_, name
        for name, op in vars(globals_["_VF"]).items():
            if not name.startswith("__"):  # the aten op, where one has the binding's name
                binding = getattr(original.__globals__["_VF"], name)
                assert op is getattr(torch.ops.aten, name, binding), name
                assert op is not binding or not hasattr(torch.ops.aten, name), name


def test_the_ops_a_function_may_call_are_read_past_an_empty_closure_cell() -> None:
    # famp reads the ops a torch Python function may call through the functions its closure holds
    # (`Tensor.__rsub__` holds `rsub`). A cell bound only later (a name a function defines after an
    # inner function that uses it) holds nothing yet: it is skipped, and the rest is still read.
    from famp._autocast.entered import _names

    def wrapper(x: torch.Tensor) -> torch.Tensor:
        return later(torch.rsub(x, 1.0))  # `later`'s cell is empty until the line below runs

    names = _names(wrapper)  # type: ignore[arg-type]

    def later(x: torch.Tensor) -> torch.Tensor:
        return torch.special.expm1(x)

    assert "rsub" in names
    assert _names(wrapper) >= {"rsub", "expm1", "special_expm1"}  # type: ignore[arg-type]
