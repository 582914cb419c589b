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
from torch.utils._python_dispatch import TorchDispatchMode

import famp
from famp._autocast.compiled import own_code
from tests.helpers import assert_bitwise_equal

BF16, F32 = torch.bfloat16, torch.float32
# Compiled runs trace famp's overrides with Dynamo and AOTAutograd (`aot_eager`: the overrides
# are graph nodes by then; inductor's C++ compiles cost seconds a case, minutes for the file).
# Inductor (famp's own compile, and torch.compile's default) runs the cases of `INDUCTOR`.
RUNS = ("aot_eager", "aot_eager, dynamic")
INDUCTOR = ("compiled", "torch.compile, dynamic")


def _sample(shape: tuple[int, int] = (8, 8)) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return (torch.rand(*shape, generator=g) * 4 + 0.25).to(BF16)


M = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)).to(BF16)


def _pair(
    fn: Callable[[torch.Tensor], torch.Tensor],
    hand: Callable[[torch.Tensor], torch.Tensor],
    changes: dict[str, str],
    run: str,
) -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
    """(famp's `fn` with `changes` as overrides, the hand-written casts under torch.autocast),
    both returning float32: eager, with famp's own compile (the reference compiled the same way,
    `torch.compile(fullgraph=True)`), or both under torch.compile(dynamic=True)."""
    rules = famp.default_rules("cpu").override(changes)
    transformed = _compiled(famp.autocast(fn, "c=bf16,o=f32", rules=rules), rules, fn, run)

    def reference(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16):
            return hand(x).float()

    if run != "eager":  # a code object of its own per case: Dynamo compiles one at most 8 times
        dynamic = True if run.endswith("dynamic") else None
        backend = "aot_eager" if run.startswith("aot_eager") else "inductor"
        reference = torch.compile(
            own_code(reference), fullgraph=True, dynamic=dynamic, backend=backend
        )
    return transformed, reference


def _compiled(
    transformed: Callable[..., Any], rules: famp.OpRules, fn: Callable[..., Any], run: str
) -> Callable[..., Any]:
    """`transformed` (`famp.autocast(fn, ..., rules=rules)`) run as `run` says."""
    if run == "compiled":  # famp's own compile
        return famp.autocast(fn, "c=bf16,o=f32", rules=rules, compile=True)
    if run == "eager":
        return transformed
    dynamic = True if run.endswith("dynamic") else None
    backend = "aot_eager" if run.startswith("aot_eager") else "inductor"
    return torch.compile(transformed, fullgraph=True, dynamic=dynamic, backend=backend)


def _run(
    fn: Callable[[torch.Tensor], torch.Tensor],
    hand: Callable[[torch.Tensor], torch.Tensor],
    changes: dict[str, str],
    run: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(famp's result, the hand-written casts' result) of `_pair`'s functions on `_sample()`."""
    transformed, reference = _pair(fn, hand, changes, run)
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


# Eagerly every operator; compiled those torch defines in Python (famp enters their code).
OPERATOR_RUNS = [
    (name, i, run)
    for name in OPERATOR_METHODS
    for i in range(len(OPERATOR_CASES.get(name, ())))
    for run in ("eager", *(RUNS if _in_python(name) else ()))
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
    [(name, run) for name in sorted(KEYWORD_CALLS) for run in ("eager", *RUNS)],
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


# --- keys that leave some of the op's overloads at the default, compiled --------------------------
# `{"mul": "float32"}` covers mul.Tensor and mul.Scalar but not mul.int, ...: famp picks the
# overload of each call as torch dispatches it, compiled as eagerly (a SymInt, as `t.shape[0] + 1`
# is under dynamic shapes, as the int it is eagerly).

# name -> (overrides, the calls, what the overrides mean: torch's ops, inputs cast)
PARTIAL_OVERRIDES: dict[str, tuple[dict[str, str], Callable[..., Any], Callable[..., Any]]] = {
    "mul": (
        {"mul": "float32"},
        lambda t: t * 3.3 + 3 * t + torch.mul(t, t.flip(0)) + (t.shape[0] + 1) * t,
        lambda t: (
            t.float() * 3.3
            + 3 * t.float()
            + torch.mul(t.float(), t.flip(0).float())
            + (t.shape[0] + 1) * t.float()
        ),
    ),
    "mul.Tensor": (  # Python wraps a float, an int or a size: mul.Tensor, as torch dispatches
        {"mul.Tensor": "float32"},  # it; only the aten overload called by name is mul.Scalar
        lambda t: t * t.flip(0) + t * 3.3 + (t.shape[0] + 1) * t + aten.mul.Scalar(t, 3.3),
        lambda t: (
            t.float() * t.flip(0).float()
            + t.float() * 3.3
            + (t.shape[0] + 1) * t.float()
            + aten.mul.Scalar(t, 3.3)
        ),
    ),
    "where.ScalarOther": (  # torch.where(c, t, 0.5): Python has a Number overload for it
        {"where.ScalarOther": "float32"},
        lambda t: torch.where(t > 1, t, 0.5) + torch.where(t > 2, t, t.flip(0)),
        lambda t: torch.where(t > 1, t.float(), 0.5) + torch.where(t > 2, t, t.flip(0)),
    ),
    "pow": (
        {"pow": "float32"},
        lambda t: t**1.7 + 1.7**t + torch.pow(t, t.flip(0)) + t ** (t.shape[0] // 4),
        lambda t: (
            t.float() ** 1.7
            + 1.7 ** t.float()
            + torch.pow(t.float(), t.flip(0).float())
            + t.float() ** (t.shape[0] // 4)
        ),
    ),
    "pow.Tensor_Scalar": (  # pow.Scalar and pow.Tensor_Tensor: left to torch (bfloat16)
        {"pow.Tensor_Scalar": "float32"},
        lambda t: t**1.7 + torch.pow(1.7, t) + t ** t.flip(0),
        lambda t: t.float() ** 1.7 + torch.pow(1.7, t) + t ** t.flip(0),
    ),
    "sum": (
        {"sum": SET_OPT},
        lambda t: t.sum(0) + t.sum() + torch.sum(t, dim=(0,), keepdim=True).flatten(),
        lambda t: (
            t.sum(0, dtype=F32)
            + t.sum(dtype=F32)
            + torch.sum(t, dim=(0,), keepdim=True, dtype=F32).flatten()
        ),
    ),
    "norm": (  # as torch's CUDA autocast: the overloads that take no dtype get dtype=float32
        {"norm.Scalar": APPEND, "norm.ScalarOpt_dim": APPEND},
        lambda t: aten.norm(t, 3) + aten.norm(t, 3, [1], False) + aten.norm.Scalar(t),
        lambda t: (
            aten.norm.ScalarOpt_dtype(t, 3, dtype=F32)
            + aten.norm.ScalarOpt_dim_dtype(t, 3, [1], False, dtype=F32)
            + aten.norm.ScalarOpt_dtype(t, 2, dtype=F32)
        ),
    ),
}


@pytest.mark.parametrize(
    ("name", "run"),
    [(name, run) for name in sorted(PARTIAL_OVERRIDES) for run in RUNS]
    + [("mul", INDUCTOR[0]), ("pow.Tensor_Scalar", INDUCTOR[1])],
)
def test_override_of_some_overloads_compiles_as_hand_written_casts(name: str, run: str) -> None:
    # Compiled with fullgraph=True, static and dynamic shapes; a second shape recompiles famp's
    # own compile with dynamic sizes (as it does the reference's). Bitwise equal to the same
    # casts written by hand, compiled the same way; eagerly, the override changes the numbers.
    changes, fn, hand = PARTIAL_OVERRIDES[name]
    transformed, reference = _pair(fn, hand, changes, run)
    eager, eager_reference = _pair(fn, hand, changes, "eager")
    for shape in ((8, 8), (12, 6)):
        x = _sample(shape)
        out = transformed(x)
        assert out.dtype == F32
        assert_bitwise_equal(out, reference(x))
        assert_bitwise_equal(eager(x), eager_reference(x))
        with torch.autocast("cpu", dtype=BF16):
            assert not torch.equal(eager(x), fn(x).float())


# overrides -> calls whose arguments are of each kind. The override casts the calls that reach
# its overload as torch's dispatcher receives them (`dispatched`): Python bindings wrap a number
# into a tensor where the op has a Tensor overload (`t * 3.3` is mul.Tensor), and keep
# pow.Tensor_Scalar and pow.Scalar. (Ops with no composite overload: a composite decomposes
# before a dispatch mode sees it.)
BY_KIND: dict[str, tuple[dict[str, str], list[Callable[..., Any]]]] = {
    "mul.Scalar": (
        {"mul.Scalar": "float32"},
        [
            lambda t: t * t.flip(0),  # mul.Tensor
            lambda t: t * 3.3,  # a float: mul.Tensor too (wrapped)
            lambda t: t * 3,  # an int
            lambda t: t * (t.shape[0] + 1),  # a SymInt under dynamic shapes
            lambda t: t * (t.shape[0] / 3),  # a SymFloat
            lambda t: aten.mul.Scalar(t, 3.3),  # the overload by name
            lambda t: aten.mul(t, 3.3),  # the packet: its own resolution (mul.Tensor)
        ],
    ),
    "mul.Tensor": (
        {"mul.Tensor": "float32"},
        [
            lambda t: t * t.flip(0),
            lambda t: t * 3.3,
            lambda t: torch.mul(t, 3),
            lambda t: t * (t.shape[0] + 1),
            lambda t: aten.mul.Scalar(t, 3.3),
        ],
    ),
    "pow.Tensor_Scalar": (
        {"pow.Tensor_Scalar": "float32"},
        [
            lambda t: t ** t.flip(0),  # pow.Tensor_Tensor
            lambda t: t**1.5,
            lambda t: t**2,
            lambda t: t ** (t.shape[0] // 4),
            lambda t: t ** (t.shape[0] / 4),
            lambda t: torch.pow(2, t),  # pow.Scalar
            lambda t: 1.7**t,  # Tensor.__rpow__: torch.pow(1.7, t), pow.Scalar
        ],
    ),
    "pow.Scalar": (
        {"pow.Scalar": "float32"},
        [
            lambda t: t**1.5,  # pow.Tensor_Scalar
            lambda t: torch.pow(2, t),
            lambda t: 1.7**t,  # the reflected operator: its base is the scalar
            lambda t: (t.shape[0] / 4) ** t,  # a SymFloat base under dynamic shapes
        ],
    ),
}


class _Dispatched(TorchDispatchMode):
    """The aten overloads that reach torch's dispatcher, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func).removeprefix("aten."))
        return func(*args, **(kwargs or {}))


def dispatched(call: Callable[[torch.Tensor], torch.Tensor], key: str, x: torch.Tensor) -> bool:
    """Whether torch's dispatcher receives `call(x)` as the overload `key` (`"mul.Scalar"`), no
    autocast on: the first op of the key's packet it receives."""
    log = _Dispatched()
    with log:
        call(x)
    packet = key.partition(".")[0]
    first = next(o for o in log.ops if o.partition(".")[0] == packet)
    return first == key


@pytest.mark.parametrize("run", [*RUNS, INDUCTOR[1]])
@pytest.mark.parametrize("name", sorted(BY_KIND))
def test_override_of_one_overload_reaches_the_same_calls_compiled_as_eagerly(
    name: str, run: str
) -> None:
    # The override casts the calls torch dispatches as its overload, compiled (where a size is a
    # SymInt or a SymFloat) as eagerly.
    changes, calls = BY_KIND[name]
    casts = [dispatched(call, name, _sample()) for call in calls]
    assert any(casts)
    assert not all(casts)

    def dtypes(t: torch.Tensor) -> torch.Tensor:
        return torch.tensor([call(t).dtype == F32 for call in calls])

    rules = famp.default_rules("cpu").override(changes)
    eager = famp.autocast(dtypes, "c=bf16,o=f32", rules=rules)
    transformed = _compiled(famp.autocast(dtypes, "c=bf16,o=f32", rules=rules), rules, dtypes, run)
    for shape in ((8, 8), (12, 6)):
        x = _sample(shape)
        assert transformed(x).tolist() == eager(x).tolist() == casts
