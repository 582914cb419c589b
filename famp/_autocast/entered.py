"""torch's own Python functions, entered with famp.autocast's mode still active.

torch's Python functions (`torch.nn.functional`, `torch.functional`, Python `Tensor` methods)
begin `if has_torch_function(...): return handle_torch_function(...)`, which hands the call to the
mode with the mode popped, hiding the ops inside. The mode runs a copy of such a function whose
`has_torch_function*` globals answer False, with the mode pushed again (`copies()`), and knows the
op names each may call (`calls()`), so that an override reaches the ops inside.
"""

from __future__ import annotations

import dis
import functools
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from famp._autocast.op_calls import op_name

# The copies are made once, on first use (the first `famp.autocast` whose rules override an op, in
# Python: overrides are read outside Dynamo's tracing), not at famp's import (~50 ms): Dynamo can
# call a prebuilt copy but cannot build one.

_CHECKS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")
_UNCALLED = frozenset({*_CHECKS, "handle_torch_function"})  # what the copies never call


def _never(*args: object) -> bool:
    return False


def _copies() -> dict[Callable[..., Any], Callable[..., Any]]:
    copies: dict[Callable[..., Any], Callable[..., Any]] = {}
    patched: dict[int, dict[str, Any]] = {}

    def add(func: object) -> None:
        if not isinstance(func, types.FunctionType) or func in copies:
            return
        if not set(_CHECKS) & set(func.__code__.co_names):
            return  # not a torch function: the mode never receives it
        if "__class__" in func.__code__.co_freevars:
            return  # calls super(): Dynamo cannot trace super() into TensorBase; call it whole
        key = id(func.__globals__)
        if key not in patched:
            patched[key] = {**func.__globals__, **dict.fromkeys(_CHECKS, _never)}
        copy = types.FunctionType(
            func.__code__, patched[key], func.__name__, func.__defaults__, func.__closure__
        )
        copy.__kwdefaults__ = func.__kwdefaults__
        copies[func] = copy

    for module in (torch.nn.functional, torch.functional):
        for value in list(vars(module).values()):
            add(value)
    for value in list(vars(torch.Tensor).values()):
        add(value)
    return copies


@functools.cache
def copies() -> dict[Callable[..., Any], Callable[..., Any]]:
    """torch's Python function -> its copy whose `has_torch_function*` answer False."""
    return _copies()


def _names(func: types.FunctionType) -> frozenset[str]:
    """Every name a function's code (and the functions of its module it calls) refers to.

    A superset of the ops it may call from Python, by their aten names: `torch.linalg.vector_norm`
    adds `linalg_vector_norm`, as the Python bindings of namespaced ops are named. The functions a
    closure holds are followed (torch's reflected operators wrap one: `Tensor.__rsub__` calls
    `rsub`), and so are the `Tensor` methods its operators call (`a * b`: `__mul__`, `__rmul__`).
    """
    names: set[str] = set()
    seen: set[types.CodeType] = set()
    todo = [func]
    while todo:
        f = todo.pop()
        codes = [f.__code__]
        while codes:
            code = codes.pop()
            if code in seen:
                continue
            seen.add(code)
            names.update(code.co_names)
            codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
            for name in set(code.co_names) - _UNCALLED:  # functions it may call: globals, ...
                for g in (
                    f.__globals__.get(name),
                    vars(torch).get(name),  # not getattr: that imports torch._dynamo & co.
                    getattr(torch.nn.functional, name, None),
                ):
                    if isinstance(g, types.FunctionType) and g.__code__ not in seen:
                        todo.append(g)
            for method in _operators(code):  # `a * b`: Tensor.__mul__, __rmul__, __imul__
                names.add(op_name(method, memo=False)[0])
                if isinstance(method, types.FunctionType):  # `__rtruediv__`: reciprocal, `*`
                    todo.append(method)
        todo.extend(c for c in _held(f) if c.__code__ not in seen)  # `Tensor.__rsub__`'s `rsub`
    for space in ("linalg", "fft", "special", "nested"):
        if space in names:
            names.update(f"{space}_{n}" for n in list(names))
    return frozenset(names)


def _held(func: types.FunctionType) -> Iterator[types.FunctionType]:
    """The functions a closure holds (a wrapper's); an empty cell (bound later) holds none."""
    for cell in func.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # "Cell is empty"
            continue
        if isinstance(value, types.FunctionType):
            yield value


# Binary operators: the symbol `dis` shows (Python 3.11 on), the opcode (3.10), the methods' stem.
_OPERATORS = (
    "+ ADD add, - SUBTRACT sub, * MULTIPLY mul, / TRUE_DIVIDE truediv, // FLOOR_DIVIDE floordiv, "
    "% MODULO mod, ** POWER pow, @ MATRIX_MULTIPLY matmul, << LSHIFT lshift, >> RSHIFT rshift, "
    "& AND and, | OR or, ^ XOR xor"
)
_STEMS = {key: e.split()[2] for e in _OPERATORS.split(", ") for key in e.split()[:2]}


def _operators(code: types.CodeType) -> Iterator[Any]:
    """The `Tensor` methods that the binary operators in `code` may call."""
    for ins in dis.get_instructions(code):
        op = ins.opname
        key = ins.argrepr.rstrip("=") if op == "BINARY_OP" else op.partition("_")[2]
        stem = _STEMS.get(key) if op.startswith(("BINARY_", "INPLACE_")) else None
        methods = (getattr(torch.Tensor, f"__{r}{stem}__", None) for r in ("", "r", "i") if stem)
        yield from (m for m in methods if m is not None)


@functools.cache
def calls() -> dict[Callable[..., Any], frozenset[str]]:
    """torch's Python function (those of `copies()`) -> the op names it may call."""
    return {f: _names(f) for f in copies()}  # type: ignore[arg-type]
