"""famp.autocast's overrides reach every op a call dispatches: the ops of Python's operators,
reflected ones included (`3 / x` is `reciprocal` then `mul`), and the input of a call that passes
it by keyword (`torch.softmax(dim=-1, input=x)`). Against hand-written casts under torch.autocast,
eagerly and compiled."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

import famp
from famp._autocast.compiled import own_code
from tests.helpers import assert_bitwise_equal

BF16, F32 = torch.bfloat16, torch.float32
RUNS = ("compiled", "torch.compile, dynamic")


def _sample() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return (torch.rand(8, 8, generator=g) * 4 + 0.25).to(BF16)


M = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)).to(BF16)


def _run(
    fn: Callable[[torch.Tensor], torch.Tensor],
    hand: Callable[[torch.Tensor], torch.Tensor],
    changes: dict[str, str],
    run: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(famp's result of `fn` with `changes` as overrides, the hand-written casts' result under
    torch.autocast), both as float32: eagerly, with famp's own compile (the reference compiled
    by inductor too), or both under torch.compile(dynamic=True)."""
    rules = famp.default_rules("cpu").override(changes)
    transformed = famp.autocast(fn, "c=bf16,o=f32", rules=rules, compile=run == "compiled")

    def reference(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16):
            return hand(x).float()

    if run == "torch.compile, dynamic":
        transformed = torch.compile(transformed, fullgraph=True, dynamic=True)
    if run != "eager":  # a code object of its own per case: Dynamo compiles one at most 8 times
        reference = torch.compile(own_code(reference), fullgraph=True, dynamic=run != "compiled")
    x = _sample()
    return transformed(x), reference(x)


# --- Python's operators, read off the installed torch ---------------------------------------------


def _operator_methods() -> list[str]:
    """`Tensor`'s binary-operator methods (each with its reflected twin, `__sub__`/`__rsub__`)
    that take a floating tensor: the bitwise and shift operators take integers only."""
    reflected = {n for n in dir(torch.Tensor) if n.startswith("__r") and n.endswith("__")}
    names = {m for n in reflected if hasattr(torch.Tensor, f"__{n[3:]}") for m in (n, f"__{n[3:]}")}
    floating = []
    for name in sorted(names):
        try:
            out = getattr(_sample(), name)(M if "matmul" in name else 2.0)
        except (RuntimeError, TypeError):
            continue
        if out is not NotImplemented:
            floating.append(name)
    return floating


OPERATOR_METHODS = _operator_methods()


def _in_python(name: str) -> bool:
    """Whether torch defines the method in Python (its own code calls the ops: `__rsub__`)."""
    return isinstance(getattr(torch.Tensor, name), types.FunctionType)


def _off(op: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    """An op torch's autocast would cast (`matmul`), run as an override runs it: autocast off."""
    with torch.autocast("cpu", enabled=False):
        return op(*args)


def _cases(op: str, other: Any, hand: Callable[..., Any]) -> list[tuple[dict[str, str], Any, Any]]:
    return [({op: "float32"}, other, hand)]


# name -> [(overrides, the other operand, what the overrides mean: torch's ops, inputs cast)]
OPERATOR_CASES: dict[str, list[tuple[dict[str, str], Any, Callable[..., Any]]]] = {
    "__add__": _cases("add", 2.5, lambda t: torch.add(t.float(), 2.5)),
    "__radd__": _cases("add", 2.5, lambda t: torch.add(t.float(), 2.5)),
    "__sub__": _cases("sub", 2.5, lambda t: torch.sub(t.float(), 2.5)),
    "__rsub__": _cases("rsub", 2.5, lambda t: torch.rsub(t.float(), 2.5)),  # 2.5 - x
    "__mul__": _cases("mul", 3.3, lambda t: torch.mul(t.float(), 3.3)),
    "__rmul__": _cases("mul", 3.3, lambda t: torch.mul(t.float(), 3.3)),
    "__div__": _cases("div", 3.0, lambda t: torch.div(t.float(), 3.0)),
    "__truediv__": _cases("div", 3.0, lambda t: torch.div(t.float(), 3.0)),
    # 3 / x: torch computes x.reciprocal() * 3, and its autocast sees those two ops.
    "__rdiv__": [
        ({"reciprocal": "float32"}, 3, lambda t: torch.reciprocal(t.float()) * 3),
        ({"mul": "float32"}, 3, lambda t: t.reciprocal().float() * 3),
    ],
    "__rtruediv__": [
        ({"reciprocal": "float32"}, 3, lambda t: torch.reciprocal(t.float()) * 3),
        ({"mul": "float32"}, 3, lambda t: t.reciprocal().float() * 3),
    ],
    "__floordiv__": _cases("floor_divide", 0.003, lambda t: torch.floor_divide(t.float(), 0.003)),
    "__rfloordiv__": _cases("floor_divide", 300.0, lambda t: torch.floor_divide(300.0, t.float())),
    "__mod__": _cases("remainder", 0.3, lambda t: torch.remainder(t.float(), 0.3)),
    "__rmod__": _cases("remainder", 0.3, lambda t: torch.remainder(0.3, t.float())),
    "__pow__": _cases("pow", 1.7, lambda t: torch.pow(t.float(), 1.7)),
    "__rpow__": _cases("pow", 1.7, lambda t: torch.pow(1.7, t.float())),
    "__matmul__": _cases("matmul", M, lambda t: _off(torch.matmul, t.float(), M.float())),
    "__rmatmul__": _cases("matmul", M, lambda t: _off(torch.matmul, M.float(), t.float())),
}


# Packets whose key leaves some overloads at the default (`mul.int`, `pow.int`, ...): compiled,
# famp cannot trace the choice of overload yet (`overrides.resolve_overload`), so eagerly only.
PER_OVERLOAD = ("mul", "pow", "remainder", "sum", "norm.Scalar", "norm.ScalarOpt_dim")

# Eagerly every operator; compiled those torch defines in Python (famp enters their code).
OPERATOR_RUNS = [
    (name, i, run)
    for name in OPERATOR_METHODS
    for i, (changes, _, _) in enumerate(OPERATOR_CASES.get(name, ()))
    for run in ("eager", *(RUNS if _in_python(name) and not set(changes) & {*PER_OVERLOAD} else ()))
]


# Inductor's lowering of `floor_divide` and `remainder` calls helpers torch 2.13 deprecates.
@pytest.mark.filterwarnings("ignore:.*_prims_common.check. is deprecated:FutureWarning")
@pytest.mark.parametrize(("name", "case", "run"), OPERATOR_RUNS)
def test_override_reaches_the_ops_of_an_operator(name: str, case: int, run: str) -> None:
    # `2.5 - x` calls Tensor.__rsub__, whose Python code calls `rsub`: an override of `rsub`
    # casts as it does for `torch.rsub(x, 2.5)`, and so for every operator and its ops.
    changes, other, hand = OPERATOR_CASES[name][case]

    def fn(t: torch.Tensor) -> torch.Tensor:
        return getattr(t, name)(other)  # `other - t` for __rsub__

    out, expected = _run(fn, hand, changes, run)
    assert out.dtype == F32
    assert_bitwise_equal(out, expected)
    if run == "eager":  # the override changes the numbers
        x = _sample()
        with torch.autocast("cpu", dtype=BF16):
            assert not torch.equal(out, fn(x).float())


def test_override_reaches_the_ops_of_operators_written_as_operators() -> None:
    # The same through Python's syntax, which calls the reflected methods itself; and every
    # floating operator of the installed torch has its case above.
    assert set(OPERATOR_METHODS) == set(OPERATOR_CASES)
    assert {"__rsub__", "__rtruediv__", "__rmod__", "__rfloordiv__"} <= set(OPERATOR_METHODS)
    x = _sample()
    rules = famp.default_rules("cpu").override({"rsub": "float32", "reciprocal": "float32"})
    rules = rules.override({"remainder": "float32", "floor_divide": "float32"})
    out = famp.autocast(
        lambda t: (2.5 - t, 3 / t, 0.3 % t, 300.0 // t), "c=bf16,o=f32", rules=rules
    )(x)
    with torch.autocast("cpu", dtype=BF16):
        xf = x.float()
        expected = (2.5 - xf, torch.reciprocal(xf) * 3, 0.3 % xf, 300.0 // xf)
    for actual, e in zip(out, expected, strict=True):
        assert_bitwise_equal(actual, e)


# --- the input of a dtype-argument rule, passed by keyword ----------------------------------------

SET_OPT = "float32_set_opt_dtype"
APPEND = "float32_append_dtype"
aten = torch.ops.aten

# name -> (overrides, the call with its input by keyword, what the rule means: dtype=float32)
KEYWORD_CALLS: dict[str, tuple[dict[str, str], Callable[..., Any], Callable[..., Any]]] = {
    "torch.softmax": (
        {"softmax": SET_OPT},
        lambda t: torch.softmax(dim=-1, input=t),
        lambda t: torch.softmax(t, -1, dtype=F32),
    ),
    "torch.log_softmax": (
        {"log_softmax": SET_OPT},
        lambda t: torch.log_softmax(dim=-1, input=t),
        lambda t: torch.log_softmax(t, -1, dtype=F32),
    ),
    "torch.sum": (
        {"sum": SET_OPT},
        lambda t: torch.sum(dim=1, input=t),
        lambda t: torch.sum(t, 1, dtype=F32),
    ),
    "torch.cumsum": (
        {"cumsum": SET_OPT},
        lambda t: torch.cumsum(dim=1, input=t),
        lambda t: torch.cumsum(t, 1, dtype=F32),
    ),
    "torch.linalg.vector_norm": (  # its Python binding calls the input `x`
        {"linalg_vector_norm": SET_OPT},
        lambda t: torch.linalg.vector_norm(ord=3, x=t),
        lambda t: torch.linalg.vector_norm(t, 3, dtype=F32),
    ),
    "aten.softmax.int": (
        {"softmax": SET_OPT},
        lambda t: aten.softmax.int(dim=-1, self=t),
        lambda t: aten.softmax.int(t, -1, dtype=F32),
    ),
    "aten.norm.ScalarOpt_dim": (
        {"norm.ScalarOpt_dim": APPEND},
        lambda t: aten.norm.ScalarOpt_dim(p=3, dim=[1], self=t),
        lambda t: aten.norm.ScalarOpt_dim_dtype(t, 3, [1], False, dtype=F32),
    ),
    "aten.norm.Scalar": (
        {"norm.Scalar": APPEND},
        lambda t: aten.norm.Scalar(p=3, self=t),
        lambda t: aten.norm.ScalarOpt_dtype(t, 3, dtype=F32),
    ),
}


@pytest.mark.parametrize(
    ("name", "run"),
    [
        (name, run)
        for name, (changes, _, _) in sorted(KEYWORD_CALLS.items())
        for run in ("eager", *(RUNS if not set(changes) & {*PER_OVERLOAD} else ()))
    ],
)
def test_dtype_rules_find_an_input_passed_by_keyword(name: str, run: str) -> None:
    # The rule adds dtype=float32 when the op's input is eligible: the input, wherever the call
    # passes it, not the first keyword argument (`dim=-1`).
    changes, fn, hand = KEYWORD_CALLS[name]
    out, expected = _run(fn, hand, changes, run)
    assert out.dtype == F32
    assert_bitwise_equal(out, expected)
    if run == "eager":  # the rule changes the numbers
        with torch.autocast("cpu", dtype=BF16):
            assert not torch.equal(out, fn(_sample()).float())
