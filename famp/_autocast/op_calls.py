"""Torch function calls as famp.autocast sees them: aten op names, torch's Python functions.

`famp.autocast`'s mode (`famp._autocast.mode`) receives one call of a torch function at a time. This
module names the aten op of a call (`op_name`), tells whether it writes into its first argument
(`writes_first_arg`), calls it (`call`), and holds copies of torch's own Python functions
(`torch.nn.functional`, `torch.functional`, Python `Tensor` methods) that the mode can enter so
that the ops they call are seen too (`copies()`, with the op names each may call in `calls()`).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from famp._compat import (
    OpOverload,
    OpOverloadPacket,
    assume_constant_result,
    op_schema,
    overload_name,
    packet_name,
)

# --- entering torch's own Python functions with the mode still active ----------------------------
# torch's Python functions begin `if has_torch_function(...): return handle_torch_function(...)`,
# which hands the call to the mode with the mode popped, hiding the ops inside. The mode runs a copy
# of such a function whose `has_torch_function*` globals answer False, with the mode pushed again.
# The copies are made once, on first use (the first `famp.autocast` whose rules override an op, in
# Python: overrides are read outside Dynamo's tracing), not at famp's import (~50 ms): Dynamo can
# call a prebuilt copy but cannot build one.

_CHECKS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")


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
    adds `linalg_vector_norm`, as the Python bindings of namespaced ops are named.
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
            for name in code.co_names:  # functions it may call: globals, torch.*, F.*
                for g in (
                    f.__globals__.get(name),
                    vars(torch).get(name),  # not getattr: that imports torch._dynamo & co.
                    getattr(torch.nn.functional, name, None),
                ):
                    if isinstance(g, types.FunctionType) and g.__code__ not in seen:
                        todo.append(g)
    for space in ("linalg", "fft", "special", "nested"):
        if space in names:
            names.update(f"{space}_{n}" for n in list(names))
    return frozenset(names)


@functools.cache
def calls() -> dict[Callable[..., Any], frozenset[str]]:
    """torch's Python function (those of `copies()`) -> the op names it may call."""
    return {f: _names(f) for f in copies()}  # type: ignore[arg-type]


# --- naming the op of a call ----------------------------------------------------------------------

_DUNDERS = {
    "__matmul__": "matmul",
    "__rmatmul__": "matmul",
    "__add__": "add",
    "__radd__": "add",
    "__iadd__": "add_",
    "__sub__": "sub",
    "__isub__": "sub_",
    "__mul__": "mul",
    "__rmul__": "mul",
    "__imul__": "mul_",
    "__truediv__": "div",
    "__div__": "div",
    "__itruediv__": "div_",
    "__idiv__": "div_",
    "__pow__": "pow",
    "__rpow__": "pow",
    "__ipow__": "pow_",
}
# Calls that write into their first argument without a trailing-underscore name.
_WRITES = frozenset({"__setitem__", "__set__", "set_"})


_OP_TYPES = (OpOverload, OpOverloadPacket)
T = TypeVar("T")


def op_name(func: Callable[..., Any], memo: bool = True) -> tuple[str, str | None]:
    """(aten packet, overload or None if the call does not name one) of a torch function.

    Memoized: the mode asks for every op call, and torch's functions are a finite set. Not
    while Dynamo traces (`memo=False`): a write there is a side effect Dynamo must replay, which
    fails for a function made during tracing, and a read is a guard on the memo, which every
    eager call that adds a name would break (a recompile).
    """
    if not memo:
        return _op_name(func)
    name = recall(_NAMES, func)
    if name is None:
        name = _op_name(func)
        remember(_NAMES, func, name)
    return name


_NAMES: dict[Any, tuple[str, str | None]] = {}


def recall(memo: dict[Any, T], func: object) -> T | None:
    """What `memo` holds for a torch function, or None (not seen yet, or unhashable)."""
    try:
        return memo.get(func)
    except TypeError:
        return None


def remember(memo: dict[Any, T], func: object, value: T) -> None:
    """Keep `value` for a torch function; the memo stays bounded (functions made on the fly)."""
    try:
        if len(memo) > 4096:
            memo.clear()
        memo[func] = value
    except TypeError:  # unhashable: computed each time
        pass


# While Dynamo traces, the name is computed by calling this function, not by tracing it: its
# result depends only on `func`, and some releases cannot trace its string handling (torch 2.15
# fails on `str.partition` of a packet's name, as for `Tensor.T`, which it hands over as
# `aten.numpy_T`).
@assume_constant_result
def _op_name(func: Callable[..., Any]) -> tuple[str, str | None]:
    if isinstance(func, _OP_TYPES):
        if isinstance(func, OpOverload):
            return op_schema(func).name.partition("::")[2], overload_name(func)
        return packet_name(func).partition("::")[2], None
    name: str = getattr(func, "__name__", "")
    return _DUNDERS.get(name, name), None


def writes_first_arg(packet: str, kwargs: dict[str, Any]) -> bool:
    """Whether a call writes into its first argument (in-place op, `out=`, setitem, `.data =`)."""
    if packet[-1:] == "_" and packet[-2:] != "__":
        return True
    return packet in _WRITES or (bool(kwargs) and kwargs.get("out") is not None)


def _inplace_flags() -> dict[Callable[..., Any], tuple[int, str]]:
    """torch's Python functions with an `inplace` flag (`F.relu`, `F.dropout`, `F.hardtanh`, ...)
    -> (the flag's position, the first parameter's name)."""
    flags: dict[Callable[..., Any], tuple[int, str]] = {}
    for module in (torch.nn.functional, torch.functional):
        for value in vars(module).values():
            if isinstance(value, types.FunctionType):
                code = value.__code__
                names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
                if "inplace" in names and names[0] != "inplace":
                    flags[value] = (names.index("inplace"), names[0])
    return flags


_INPLACE: dict[Callable[..., Any], tuple[int, str]] = {}


@assume_constant_result  # a constant of the function: Dynamo calls it instead of tracing it
def _inplace_flag(func: Callable[..., Any]) -> tuple[int, str] | None:
    if not _INPLACE:
        _INPLACE.update(_inplace_flags())
    return recall(_INPLACE, func)


def inplace_target(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What a call writes into through an `inplace` flag it sets (`F.relu(x, inplace=True)`, and so
    `nn.ReLU(inplace=True)`): its first argument; None for any other call.

    Such a call is an in-place op under another name: torch's autocast casts none (the function
    calls `torch.relu_` and the like), and it writes into a tensor a weight may share.
    """
    flag = _inplace_flag(func)
    if flag is None:
        return None
    index, first = flag
    on = kwargs["inplace"] if kwargs and "inplace" in kwargs else len(args) > index and args[index]
    if not on:
        return None
    return args[0] if args else kwargs.get(first)


def written(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What a call that `writes_first_arg` writes into: its `out=` tensor(s), else its first arg."""
    out = kwargs.get("out") if kwargs else None
    return out if out is not None else (args[0] if args else None)


def call(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Call a torch function; torch's Python `Tensor` methods are called as methods.

    Dynamo traces `t.unflatten(...)` but not `Tensor.unflatten(t, ...)`, whose super() call it
    cannot follow into TensorBase.
    """
    if isinstance(func, types.FunctionType) and args and isinstance(args[0], torch.Tensor):
        name = func.__name__
        if getattr(torch.Tensor, name, None) is func:
            return getattr(args[0], name)(*args[1:], **kwargs)
    return func(*args, **kwargs)
