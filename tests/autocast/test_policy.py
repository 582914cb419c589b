"""famp.Policy, famp.get_policy and the cast_to_* functions."""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import hypothesis
import hypothesis.strategies as st
import pytest
import torch
from torch.utils import _pytree as pytree

import famp
from tests.helpers import assert_bitwise_equal

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
NAMES = {
    torch.float32: ["float32", "f32", "full", "FULL", " Float32 ", "torch.float32"],
    torch.bfloat16: ["bfloat16", "bf16", "BF16"],
    torch.float16: ["float16", "f16", "half"],
    torch.float64: ["float64", "f64"],
}
KEYS = {"params": ["p", "params"], "compute": ["c", "compute"], "output": ["o", "output"]}
CASTABLE = {torch.float16, torch.bfloat16, torch.float32}

policies = st.builds(famp.Policy, *(st.sampled_from(DTYPES) for _ in range(3)))


def test_policy_fields_and_str() -> None:
    policy = famp.Policy(torch.float32, torch.bfloat16, torch.float16)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (
        torch.float32,
        torch.bfloat16,
        torch.float16,
    )
    assert str(policy) == "params=float32,compute=bfloat16,output=float16"
    assert famp.Policy("f32", "bf16", "half") == policy
    assert hash(famp.Policy("f32", "bf16", "half")) == hash(policy)


def test_policy_is_frozen() -> None:
    policy = famp.get_policy("c=bf16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.compute_dtype = torch.float16  # type: ignore[misc]
    assert policy.compute_dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("kwargs", "exc", "needle"),
    [
        ({"param_dtype": torch.int32}, ValueError, "param_dtype must be one of"),
        ({"compute_dtype": torch.complex64}, ValueError, "compute_dtype must be one of"),
        ({"output_dtype": torch.float8_e4m3fn}, ValueError, "torch.float8_e4m3fn"),
        ({"compute_dtype": "fp8"}, ValueError, "compute_dtype must be a dtype name"),
        ({"output_dtype": 3}, TypeError, "output_dtype must be a torch.dtype or a dtype name"),
        ({"param_dtype": 3.5}, TypeError, "param_dtype must be .* dtype name; got float 3.5$"),
    ],
)
def test_policy_rejects_bad_dtypes(kwargs: dict[str, Any], exc: type, needle: str) -> None:
    fields = {"param_dtype": "f32", "compute_dtype": "bf16", "output_dtype": "f32", **kwargs}
    with pytest.raises(exc, match=needle if needle.endswith("$") else needle.replace(".", r"\.")):
        famp.Policy(**fields)


@hypothesis.given(policies, st.sampled_from(DTYPES))
def test_with_variants_replace_one_field(policy: famp.Policy, dtype: torch.dtype) -> None:
    assert policy.with_param_dtype(dtype) == famp.Policy(
        dtype, policy.compute_dtype, policy.output_dtype
    )
    assert policy.with_compute_dtype(dtype) == famp.Policy(
        policy.param_dtype, dtype, policy.output_dtype
    )
    assert policy.with_output_dtype(dtype) == famp.Policy(
        policy.param_dtype, policy.compute_dtype, dtype
    )
    name = NAMES[dtype][1]
    assert policy.with_compute_dtype(name) == policy.with_compute_dtype(dtype)
    with pytest.raises(ValueError, match="output_dtype"):
        policy.with_output_dtype(torch.int8)


@hypothesis.given(policies)
def test_str_round_trips_through_get_policy(policy: famp.Policy) -> None:
    assert famp.get_policy(str(policy)) == policy
    assert famp.get_policy(policy) is policy


@pytest.mark.parametrize("dtype", DTYPES)
def test_bare_dtype_sets_all_three(dtype: torch.dtype) -> None:
    for name in NAMES[dtype]:
        assert famp.get_policy(name) == famp.Policy(dtype, dtype, dtype)


def test_every_key_alias_and_dtype_name() -> None:
    for (field, aliases), dtype in itertools.product(KEYS.items(), DTYPES):
        for alias, name in itertools.product(aliases, NAMES[dtype]):
            policy = famp.get_policy(f"{alias}={name}")
            assert getattr(policy, f"{field.removesuffix('s')}_dtype") == dtype, (alias, name)


def test_defaults_chain_params_to_compute_to_output() -> None:
    # jmp's grammar: params defaults to float32, compute to params, output to compute.
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    assert famp.get_policy("c=bf16") == famp.Policy(f32, bf16, bf16)
    assert famp.get_policy("p=f16") == famp.Policy(f16, f16, f16)
    assert famp.get_policy("o=bf16") == famp.Policy(f32, f32, bf16)
    assert famp.get_policy("p=bf16,o=f32") == famp.Policy(bf16, bf16, f32)
    assert famp.get_policy(" o = f16 , c = bf16 ") == famp.Policy(f32, bf16, f16)
    assert famp.get_policy("params=float32,compute=bfloat16,output=float32") == famp.Policy(
        f32, bf16, f32
    )


@pytest.mark.parametrize(
    ("spec", "exc", "needle"),
    [
        ("x=bf16", ValueError, "policy key must be one of p|params|c|compute|o|output"),
        ("c=bf16,", ValueError, "policy key must be one of"),
        ("c:bf16,p=f32", ValueError, "policy key must be one of"),
        ("c=fp8", ValueError, "compute must be a dtype name (float32|f32|full|bfloat16"),
        ("int8", ValueError, "policy must be a dtype name"),
        ("", ValueError, "policy must be a dtype name"),
        ("c=bf16,compute=f16", ValueError, "policy key 'compute' is given twice"),
        (None, TypeError, "policy must be a string or a famp.Policy; got NoneType"),
        # before 2026-12-01 "got dtype", without the value
        (torch.bfloat16, TypeError, "a famp.Policy; got dtype torch.bfloat16"),
    ],
)
def test_get_policy_errors_list_what_is_accepted(spec: Any, exc: type, needle: str) -> None:
    with pytest.raises(exc) as info:
        famp.get_policy(spec)
    assert needle in str(info.value)


# --- casts ----------------------------------------------------------------------------------------

LEAF_DTYPES = [*DTYPES, torch.complex64, torch.int64, torch.int8, torch.bool, torch.float8_e5m2]


def _tensor(dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(3, generator=g) * 100
    return base.to(dtype) if not dtype.is_complex else torch.complex(base, base).to(dtype)


leaves = st.one_of(
    st.builds(_tensor, st.sampled_from(LEAF_DTYPES), st.integers(0, 2**16)),
    st.floats(allow_nan=False),
    st.integers(),
    st.booleans(),
    st.none(),
    st.text(max_size=3),
)
Point = collections.namedtuple("Point", ["x", "y"])
trees = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.tuples(children, children),
        st.dictionaries(st.text(max_size=2), children, max_size=3),
        st.builds(Point, children, children),
    ),
    max_leaves=8,
)


def _assert_cast_tree(actual: Any, source: Any, dtype: torch.dtype) -> None:
    """`actual` is `source` with exactly its float16/bfloat16/float32 tensors cast to `dtype`."""
    a_leaves, a_spec = pytree.tree_flatten(actual)
    s_leaves, s_spec = pytree.tree_flatten(source)
    assert a_spec == s_spec
    for a, s in zip(a_leaves, s_leaves, strict=True):
        if isinstance(s, torch.Tensor) and s.dtype in CASTABLE:
            assert_bitwise_equal(a, s.to(dtype))
        else:
            assert a is s  # passed through, not copied


@hypothesis.given(trees, policies)
def test_casts_touch_only_half_bfloat_and_float32_tensors(tree: Any, policy: famp.Policy) -> None:
    for method, function, dtype in [
        (policy.cast_to_param, famp.cast_to_param, policy.param_dtype),
        (policy.cast_to_compute, famp.cast_to_compute, policy.compute_dtype),
        (policy.cast_to_output, famp.cast_to_output, policy.output_dtype),
    ]:
        _assert_cast_tree(method(tree), tree, dtype)
        _assert_cast_tree(function(policy, tree), tree, dtype)
        _assert_cast_tree(function(str(policy), tree), tree, dtype)


def test_float64_is_never_narrowed_but_others_widen_to_it() -> None:
    tree = {"f64": torch.ones(2, dtype=torch.float64), "f32": torch.ones(2)}
    out = famp.get_policy("p=f64,c=bf16").cast_to_compute(tree)
    assert out["f64"].dtype == torch.float64
    assert out["f32"].dtype == torch.bfloat16
    up = famp.get_policy("f64").cast_to_param({"bf16": torch.ones(2, dtype=torch.bfloat16)})
    assert up["bf16"].dtype == torch.float64


def test_cast_is_differentiable_and_grads_come_back_in_the_source_dtype() -> None:
    w = torch.randn(4, requires_grad=True)
    out = famp.get_policy("c=bf16").cast_to_compute({"w": w})["w"]
    assert out.dtype == torch.bfloat16
    (out.float() * 3).sum().backward()
    assert w.grad is not None
    assert w.grad.dtype == torch.float32
    assert_bitwise_equal(w.grad, torch.full((4,), 3.0))


POLICY = famp.get_policy("p=f32,c=f16,o=bf16")


def _cast_all(tree: dict[str, torch.Tensor]) -> tuple[Any, Any, Any]:
    return POLICY.cast_to_param(tree), POLICY.cast_to_compute(tree), POLICY.cast_to_output(tree)


def test_casts_under_compile_and_vmap(transform: Callable[[Any], Any]) -> None:
    tree = {"a": torch.randn(3, 2), "b": torch.arange(6).reshape(3, 2), "c": torch.randn(3, 2)}
    tree["c"] = tree["c"].double()
    for param, compute, output in (transform(_cast_all)(tree), torch.func.vmap(_cast_all)(tree)):
        for actual, dtype in [
            (param, torch.float32),
            (compute, torch.float16),
            (output, torch.bfloat16),
        ]:
            assert actual["a"].dtype == dtype
            assert_bitwise_equal(actual["a"], tree["a"].to(dtype))
            assert_bitwise_equal(actual["b"], tree["b"])
            assert_bitwise_equal(actual["c"], tree["c"])
