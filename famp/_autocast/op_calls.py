"""Torch function calls as famp.autocast sees them: aten op names, writes, the call itself.

`famp.autocast`'s mode (`famp._autocast.mode`) receives one call of a torch function at a time. This
module names the aten op of a call (`op_name`), tells whether it writes into its first argument
(`writes_first_arg`, and through an `inplace` flag `inplace_target`) or renormalizes a weight
(`renorms`), and calls it (`call`). The copies of torch's Python functions that the mode enters
are in `entered`.
"""

from __future__ import annotations

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
    "__rpow__": "pow",  # only for a scalar base (a tensor's is `__pow__`): `pow.Scalar`
    "__ipow__": "pow_",
    "__mod__": "remainder",
    "__imod__": "remainder_",
    "__ifloordiv__": "floor_divide_",
    "__eq__": "eq",
    "__ne__": "ne",
    "__lt__": "lt",
    "__le__": "le",
    "__gt__": "gt",
    "__ge__": "ge",
    "__invert__": "bitwise_not",
    "__rand__": "bitwise_and",
    "__ror__": "bitwise_or",
    "__rxor__": "bitwise_xor",
}  # `Tensor`'s C methods named otherwise than the aten op they call (`__and__` is an aten op)
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
            return _unqualified(op_schema(func).name), overload_name(func)
        return _unqualified(packet_name(func)), None
    name: str = getattr(func, "__name__", "")
    return _DUNDERS.get(name, name), "Scalar" if name == "__rpow__" else None


def _unqualified(name: str) -> str:
    """An aten op's name without its namespace (`"aten::mm"` -> `"mm"`, as rules name it); any
    other op keeps it (`"my_lib::mm"`): a custom op is not the aten op of its name."""
    space, _, packet = name.partition("::")
    return packet if space == "aten" else name


def in_place(packet: str) -> bool:
    """Whether an op's name says it writes into its first argument: `add_`, not `__add__`."""
    return packet[-1:] == "_" and packet[-2:] != "__"


def read_args(func: Callable[..., Any], packet: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The arguments an op call may read a weight's cast from: not the target of torch's own
    in-place op or write (`U.mul_(0.9)`, `U[0] = x`), of which torch's autocast casts nothing
    (watching it made a write into a weight no op had read empty the whole cache). A Python
    function may compute with its target too: all of them."""
    if type(func) is not types.FunctionType and (in_place(packet) or packet in _WRITES):
        return args[1:]
    return args


def writes_first_arg(packet: str, kwargs: dict[str, Any]) -> bool:
    """Whether a call writes into its first argument (in-place op, `out=`, setitem, `.data =`)."""
    if in_place(packet):
        return True
    return packet in _WRITES or (bool(kwargs) and kwargs.get("out") is not None)


def _write_flags() -> dict[Callable[..., Any], tuple[str, int | None, int | None]]:
    """torch's Python functions whose arguments can make a call write in place -> (the first
    parameter's name, the position of an `inplace` flag, of a `max_norm`): `F.relu`, `F.dropout`,
    `F.hardtanh`, ...; `F.embedding` and `F.embedding_bag` renormalize their weight."""
    flags: dict[Callable[..., Any], tuple[str, int | None, int | None]] = {}
    for module in (torch.nn.functional, torch.functional):
        for value in vars(module).values():
            if isinstance(value, types.FunctionType):
                code = value.__code__
                names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
                inplace, max_norm = (
                    names.index(n) if n in names[1:] else None for n in _WRITE_FLAGS
                )
                if inplace is not None or max_norm is not None:
                    flags[value] = (names[0], inplace, max_norm)
    return flags


_WRITE_FLAGS = ("inplace", "max_norm")
_FLAGS: dict[Callable[..., Any], tuple[str, int | None, int | None]] = {}


@assume_constant_result  # a constant of the function: Dynamo calls it instead of tracing it
def _flags(func: Callable[..., Any]) -> tuple[str, int | None, int | None] | None:
    if not _FLAGS:
        _FLAGS.update(_write_flags())
    return recall(_FLAGS, func)


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], name: str, index: int) -> Any:
    if kwargs and name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else None


def inplace_target(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What a call writes into through an `inplace` flag it sets (`F.relu(x, inplace=True)`, and so
    `nn.ReLU(inplace=True)`): its first argument; None for any other call.

    Such a call is an in-place op under another name: torch's autocast casts none (the function
    calls `torch.relu_` and the like), and it writes into a tensor a weight may share.
    """
    flags = _flags(func)
    if flags is None or flags[1] is None or not _argument(args, kwargs, "inplace", flags[1]):
        return None
    return args[0] if args else kwargs.get(flags[0])


def renorms(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call renormalizes its weight in place before the op (`F.embedding(i, w,
    max_norm=1.0)`, and so `nn.Embedding(max_norm=1.0)`): torch runs `embedding_renorm_` on the
    weight itself, then the op."""
    flags = _flags(func)
    return (
        flags is not None
        and flags[2] is not None
        and (_argument(args, kwargs, "max_norm", flags[2]) is not None)
    )


def written(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What a call that `writes_first_arg` writes into: its `out=` tensor(s), else its first arg."""
    out = kwargs.get("out") if kwargs else None
    return out if out is not None else (args[0] if args else None)


def call(
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    memo: bool = False,
    method: bool | None = None,
) -> Any:
    """Call a torch function; torch's Python `Tensor` methods are called as methods.

    Dynamo traces `t.unflatten(...)` but not `Tensor.unflatten(t, ...)`, whose super() call it
    cannot follow into TensorBase. `memo`: eagerly, whether `func` is such a method is
    remembered (`getattr(torch.Tensor, name, None)` costs about a microsecond where there is no
    such method, as for `F.dropout`); not while Dynamo traces (see `op_name`). `method`: the
    answer, where the caller knows it.
    """
    if method is None:
        method = recall(_METHODS, func) if memo else None
    if method is None:
        method = is_method(func)
        if memo:
            remember(_METHODS, func, method)
    if method and args and isinstance(args[0], torch.Tensor):
        name = _name(func) if torch.compiler.is_compiling() else func.__name__
        return getattr(args[0], name)(*args[1:], **kwargs)
    return func(*args, **kwargs)


_METHODS: dict[Any, bool] = {}


@assume_constant_result  # Dynamo (2.15) reads a wrapper's name off its code: `Tensor.__rsub__`'s
def _name(func: Callable[..., Any]) -> str:  # `wrapped`, which no tensor has
    return func.__name__


def is_method(func: Callable[..., Any]) -> bool:
    """Whether `func` is one of torch's Python `Tensor` methods (`Tensor.unflatten`)."""
    return (
        isinstance(func, types.FunctionType) and getattr(torch.Tensor, func.__name__, None) is func
    )
