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
import itertools
import linecache
import os
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


# Dynamo refuses to trace torch/functional.py's code (its skip list: `einsum`, `stft`, `norm`...)
# and torch/_jit_internal.py's (the dispatch of `torch.unique`, `F.max_pool2d`), so that a compiled
# call entering one raised "marked as skipped". The copies famp enters compiled (`traced_copies`)
# run that code under a file name of their own, which Dynamo traces (linecache holds torch's lines
# under it, for tracebacks); so do copies of torch.functional's plain helpers, which they call,
# else Dynamo would put them in its graph whole, past the mode, overrides unapplied. Their globals
# have no `__name__` (Dynamo guards the dict, not torch.functional), and `_VF`'s bindings are the
# aten ops (`torch.ops.aten.stft`), which Dynamo knows: its graph's code would name the binding
# `torch.stft`, torch's Python function. Not torch/_lowrank.py's (`pca_lowrank`): they still raise.
_RENAMED = ("torch.functional", "torch._jit_internal")


def _never(*args: object) -> bool:
    return False


def _asks(func: types.FunctionType) -> bool:
    """Whether `func` begins as torch's functions do: a torch function hands its call on."""
    return bool(set(_CHECKS) & set(func.__code__.co_names))


def _traced_functional_globals() -> dict[str, Any]:
    """torch.functional's globals for the copies famp enters compiled (see above)."""
    module = vars(torch.functional)
    names = {n for f in module.values() if isinstance(f, types.FunctionType) for n in _vf_calls(f)}
    aten = types.ModuleType("famp's torch._VF")
    for name in names:  # a binding of no aten op's name (none on torch 2.13-2.15) stays itself
        ops = torch.ops.aten if hasattr(torch.ops.aten, name) else module["_VF"]
        setattr(aten, name, getattr(ops, name))
    patched = {**module, **dict.fromkeys(_CHECKS, _never), "_VF": aten}
    del patched["__name__"]
    for name, value in module.items():  # a torch function stays: the mode receives it
        if (
            isinstance(value, types.FunctionType)
            and value.__globals__ is module
            and not _asks(value)
        ):
            patched[name] = _copy(value, patched, traced=True)
    return patched


def _vf_calls(func: types.FunctionType) -> Iterator[str]:
    """The names `func`'s code looks up on `_VF`."""
    for first, then in itertools.pairwise(dis.get_instructions(func.__code__)):
        if first.argval == "_VF" and then.opname in ("LOAD_ATTR", "LOAD_METHOD"):
            yield then.argval


@functools.cache
def _file_name(path: str) -> str:
    """The file name of famp's traced copies of code from `path`, holding its lines."""
    name = f"<famp's copy of {os.path.relpath(path, os.path.dirname(torch.__path__[0]))}>"
    lines = linecache.getlines(path)
    linecache.cache[name] = (sum(map(len, lines)), None, lines, name)  # kept: no modification time
    return name


def _copy(
    func: types.FunctionType,
    globals_: dict[str, Any],
    closure: tuple[Any, ...] | None = None,
    *,
    traced: bool,
) -> Callable[..., Any]:
    code = func.__code__
    if traced and func.__globals__.get("__name__") in _RENAMED:
        code = code.replace(co_filename=_file_name(code.co_filename))
    closure = func.__closure__ if closure is None else closure
    copy = types.FunctionType(code, globals_, func.__name__, func.__defaults__, closure)
    copy.__kwdefaults__ = func.__kwdefaults__
    return copy


def _wrapper_copy(func: object, copies: dict[Any, Any], traced: bool) -> Callable[..., Any] | None:
    """A copy of a wrapper whose closure holds torch functions (`torch.unique`, `F.max_pool2d`:
    `boolean_dispatch`'s, which they hand on: `_return_output` hands `unique` to the modes),
    holding their copies; None for any other."""
    if not isinstance(func, types.FunctionType) or not func.__closure__:
        return None
    if func in copies:
        return copies[func]  # type: ignore[no-any-return]
    held = [_content(cell) for cell in func.__closure__]
    for v in held:  # `torch.unique`'s holds wrappers of the same kind
        copy = _wrapper_copy(v, copies, traced) if v is not func else None
        if copy is not None:
            copies[v] = copy
    if not any(v in copies for v in held if isinstance(v, types.FunctionType)):
        return None
    cells = tuple(
        types.CellType(copies.get(v, v)) if isinstance(v, types.FunctionType) else cell
        for v, cell in zip(held, func.__closure__, strict=True)
    )
    return _copy(func, func.__globals__, cells, traced=traced)


def _content(cell: Any) -> object:
    try:
        return cell.cell_contents
    except ValueError:  # "Cell is empty"
        return None


def _copies(traced: bool) -> dict[Callable[..., Any], Callable[..., Any]]:
    copies: dict[Callable[..., Any], Callable[..., Any]] = {}
    patched: dict[int, dict[str, Any]] = {}
    if traced:
        patched[id(vars(torch.functional))] = _traced_functional_globals()

    def add(func: object) -> None:
        if not isinstance(func, types.FunctionType) or func in copies:
            return
        if not _asks(func):
            return  # not a torch function: the mode never receives it
        if "__class__" in func.__code__.co_freevars:
            return  # calls super(): Dynamo cannot trace super() into TensorBase; call it whole
        key = id(func.__globals__)
        if key not in patched:
            patched[key] = {**func.__globals__, **dict.fromkeys(_CHECKS, _never)}
        copies[func] = _copy(func, patched[key], traced=traced)

    modules = (torch.nn.functional, torch.functional)
    for module in modules:
        for value in list(vars(module).values()):
            add(value)
    for value in list(vars(torch.Tensor).values()):
        add(value)
    for value in [v for module in modules for v in vars(module).values()]:
        copy = _wrapper_copy(value, copies, traced)
        if copy is not None:
            copies[value] = copy
    return copies


@functools.cache
def copies() -> dict[Callable[..., Any], Callable[..., Any]]:
    """torch's Python function -> its copy whose `has_torch_function*` answer False."""
    return _copies(traced=False)


@functools.cache
def traced_copies() -> dict[Callable[..., Any], Callable[..., Any]]:
    """`copies()`, as famp enters them while Dynamo traces (see above)."""
    return _copies(traced=True)


def _names(func: types.FunctionType) -> frozenset[str]:
    """Every name a function's code (and the functions of its module it calls) refers to.

    A superset of the ops it may call from Python, by their aten names: `torch.linalg.vector_norm`
    adds `linalg_vector_norm`, as the Python bindings of namespaced ops are named. The functions a
    closure holds are followed (torch's reflected operators wrap one: `Tensor.__rsub__` calls
    `rsub`), and so are the `Tensor` methods its operators call (`a * b`: `__mul__`, `__rmul__`).
    """
    names: set[str] = set()
    seen: set[types.CodeType] = set()
    followed: set[types.FunctionType] = set()  # closures of one code hold different functions
    todo = [func]
    while todo:
        f = todo.pop()
        if f in followed:
            continue
        followed.add(f)
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
                    elif isinstance(g, types.BuiltinFunctionType):  # `F.logsigmoid`: `log_sigmoid`
                        names.add(op_name(g, memo=False)[0])
            for method in _operators(code):  # `a * b`: Tensor.__mul__, __rmul__, __imul__
                names.add(op_name(method, memo=False)[0])
                if isinstance(method, types.FunctionType):  # `__rtruediv__`: reciprocal, `*`
                    todo.append(method)
        todo.extend(_held(f))  # `Tensor.__rsub__`'s `rsub`, `torch.unique`'s dispatch
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


# Unary operators and `in` (by opcode; Python 3.12 on: `+x` by intrinsic), comparisons (by symbol,
# with the method the reflected comparison calls: `2 < x` calls `x.__gt__`).
_UNARY = {
    "UNARY_NEGATIVE": "__neg__",
    "UNARY_INVERT": "__invert__",
    "UNARY_POSITIVE": "__pos__",
    "INTRINSIC_UNARY_POSITIVE": "__pos__",
    "CONTAINS_OP": "__contains__",
}
_COMPARE = {"==": "eq eq", "!=": "ne ne", "<": "lt gt", "<=": "le ge", ">": "gt lt", ">=": "ge le"}


def _operators(code: types.CodeType) -> Iterator[Any]:
    """The `Tensor` methods that the operators in `code` may call."""
    for ins in dis.get_instructions(code):
        op = ins.opname
        key = ins.argrepr.rstrip("=") if op == "BINARY_OP" else op.partition("_")[2]
        stem = _STEMS.get(key) if op.startswith(("BINARY_", "INPLACE_")) else None
        methods = (getattr(torch.Tensor, f"__{r}{stem}__", None) for r in ("", "r", "i") if stem)
        yield from (m for m in methods if m is not None)
        unary = _UNARY.get(op) or _UNARY.get(ins.argrepr)
        if unary is not None:
            yield getattr(torch.Tensor, unary)
        if op == "COMPARE_OP":  # Python 3.13 shows `bool(==)` where the result is a condition
            symbol = ins.argrepr.removeprefix("bool(").removesuffix(")")
            yield from (getattr(torch.Tensor, f"__{n}__") for n in _COMPARE[symbol].split())


@functools.cache
def calls() -> dict[Callable[..., Any], frozenset[str]]:
    """torch's Python function (those of `copies()`) -> the op names it may call."""
    return {f: _names(f) for f in copies()}  # type: ignore[arg-type]
