"""Which overload of an aten op a call reaches, as torch's dispatcher receives it.

An override keyed by overload (`"mul.Tensor"`, `"where.self"`) applies to the calls torch runs
as that overload. Python bindings do not always pick the overload whose schema the arguments'
types match best: they wrap a Python number into a tensor where the op has a `Tensor` overload
(`t * 2.0`, `torch.where(c, t, 0.0)` reach `mul.Tensor` and `where.self`, as compiled graphs show
them), and keep `pow.Tensor_Scalar` or `eq.Scalar`. So famp asks torch (`_ask`): it calls the
function once per kinds of arguments on meta tensors (dtype and rank kept), stops it at the first
op of the packet that reaches dispatch, before its kernel runs, and remembers its overload.
Where torch cannot answer so (an op with no meta kernel, a value the probe cannot stand in for),
the overload is the first whose schema the kinds fit (`_first_fit`). Both are functions of the
kinds, not the values, that Dynamo calls while tracing instead of tracing them: a call reaches
the same overload eagerly and compiled, where a SymInt stands for an int.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeAlias

import torch

from famp._autocast.ops import functional_overloads, is_composite
from famp._compat import (
    TorchDispatchMode,
    assume_constant_result,
    no_dispatch_modes,
    no_torch_function,
    op_schema,
    overload_name,
)

Kind: TypeAlias = "str | tuple[Kind, ...]"
Keywords: TypeAlias = tuple[tuple[str, Kind], ...]

# schema type (`real_type`) -> the kinds it takes; types not listed (Layout, Device, Generator,
# the generic `t`) do not tell overloads apart and take any kind but None
_TAKES: dict[str, tuple[str, ...]] = {
    "Tensor": ("Tensor",),
    "int": ("int",),
    "SymInt": ("int",),
    "float": ("int", "float"),
    "complex": ("int", "float", "complex"),
    "number": ("bool", "int", "float", "complex"),
    "bool": ("bool",),
    "str": ("str",),
    "ScalarType": ("dtype",),
}


def _kind(value: object) -> Kind:
    """What a call's argument is, as far as overloads tell arguments apart: `"Tensor"`, `"bool"`,
    `"int"` (a SymInt too), `"float"` (a SymFloat too), `"complex"`, `"str"`, `"dtype"`,
    `"None"`, the kinds of its items for a list or tuple, else `"other"`."""
    if isinstance(value, torch.Tensor):
        return "Tensor"
    if isinstance(value, (bool, torch.SymBool)):
        return "bool"
    if isinstance(value, (int, torch.SymInt)):
        return "int"
    if isinstance(value, (float, torch.SymFloat)):
        return "float"
    if isinstance(value, complex):
        return "complex"
    if isinstance(value, str):
        return "str"
    if isinstance(value, torch.dtype):
        return "dtype"
    if value is None:
        return "None"
    if isinstance(value, (list, tuple)):
        return tuple(_kind(v) for v in value)
    return "other"


def _fits(type_name: str, kind: Kind) -> bool:
    """Whether an argument of `kind` fits a parameter of the schema type `type_name`."""
    if type_name.startswith("Optional["):
        return kind == "None" or _fits(type_name[len("Optional[") : -1], kind)
    if kind == "None":
        return False
    if type_name.startswith("List["):
        inner = type_name[len("List[") : -1]
        if isinstance(kind, tuple):
            return all(_fits(inner, k) for k in kind)
        return inner in ("int", "SymInt") and kind == "int"  # int[2] accepts one int
    takes = _TAKES.get(type_name)
    return takes is None or kind in takes


def resolve_overload(
    packet: str, args: tuple[Any, ...], kwargs: dict[str, Any], func: Callable[..., Any]
) -> str:
    """The overload of `aten::<packet>` that this call of `func` reaches: as torch's dispatcher
    receives it where torch answers for the arguments' kinds, else the first functional
    overload whose schema the kinds fit (`"default"` if none does)."""
    kinds = tuple(_kind(a) for a in args)
    keywords = tuple((name, _kind(value)) for name, value in kwargs.items())
    if not _composite_fits(packet, kinds, keywords):  # else a probe may see its decomposition
        probe = tuple(_probe_kind(a) for a in args)
        reached = _asked(func, packet, probe, tuple((n, _probe_kind(v)) for n, v in kwargs.items()))
        if reached is not None:
            return reached
    return _resolved(packet, kinds, keywords)


@assume_constant_result  # a constant of the op and the arguments' kinds: Dynamo calls it
def _composite_fits(packet: str, kinds: tuple[Kind, ...], keywords: Keywords) -> bool:
    """Whether a composite overload of the packet fits the kinds (`where.ScalarOther` for
    `where(c, t, 0.5)`): it would reach a Python mode decomposed, as another overload."""
    return _composite_fit(packet, kinds, keywords)


@functools.cache
def _composite_fit(packet: str, kinds: tuple[Kind, ...], keywords: Keywords) -> bool:
    overloads = functional_overloads(packet)
    return any(is_composite(packet, o) and _fit(packet, o, kinds, keywords) for o in overloads)


@assume_constant_result  # a constant of the op and the arguments' kinds: Dynamo calls it
def _resolved(packet: str, kinds: tuple[Kind, ...], keywords: Keywords) -> str:
    return _first_fit(packet, kinds, keywords)


@functools.cache
def _first_fit(packet: str, kinds: tuple[Kind, ...], keywords: Keywords) -> str:
    fitting = (o for o in functional_overloads(packet) if _fit(packet, o, kinds, keywords))
    return next(fitting, "default")


def _fit(packet: str, overload: str, kinds: tuple[Kind, ...], keywords: Keywords) -> bool:
    """Whether arguments of these kinds fit the overload's schema."""
    params = list(op_schema(getattr(getattr(torch.ops.aten, packet), overload)).arguments)
    positional = [p for p in params if not p.kwarg_only]
    given = dict(keywords)
    if len(kinds) > len(positional):
        return False
    bound = dict(zip((p.name for p in positional), kinds, strict=False))
    if set(given) - {p.name for p in params} or set(bound) & set(given):
        return False
    bound.update(given)
    return all(
        _fits(str(p.real_type), bound[p.name]) if p.name in bound else p.has_default_value()
        for p in params
    )


# --- asking torch ---------------------------------------------------------------------------------
# A probe kind keeps what the probe needs to stand in for an argument: a tensor's dtype and rank
# (a bool condition, a 4-d convolution input), a string's value (`rounding_mode="floor"`), a dtype.


def _probe_kind(value: object) -> Any:
    if isinstance(value, torch.Tensor):
        return ("Tensor", value.dtype, value.dim())
    if isinstance(value, (str, torch.dtype)):
        return ("value", value)
    if isinstance(value, (list, tuple)):
        return tuple(_probe_kind(v) for v in value)
    return _kind(value)


_STAND_INS: dict[str, Any] = {"bool": False, "int": 1, "float": 0.5, "complex": 0.5j, "None": None}


def _stand_in(kind: Any) -> Any:
    if isinstance(kind, tuple) and kind[:1] == ("Tensor",):
        return torch.ones((2,) * kind[2], dtype=kind[1], device="meta")
    if isinstance(kind, tuple) and kind[:1] == ("value",):
        return kind[1]
    if isinstance(kind, tuple):
        return [_stand_in(k) for k in kind]
    return _STAND_INS[kind]


class _ReachedError(Exception):  # not an error: the probe's stop
    pass


class _FirstOf(TorchDispatchMode):
    """Stops a call at the first op of `aten::<packet>` that reaches dispatch, before its kernel
    runs; the ops before it (a number wrapped into a tensor) run, on the meta stand-ins."""

    def __init__(self, packet: str) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.name, self.overload = f"aten::{packet}", ""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if op_schema(func).name == self.name:
            self.overload = overload_name(func)
            raise _ReachedError
        return func(*args, **(kwargs or {}))


@assume_constant_result  # a constant of the function and the arguments' kinds: Dynamo calls it
def _asked(func: Callable[..., Any], packet: str, kinds: Any, keywords: Any) -> str | None:
    try:
        return _ask(func, packet, kinds, keywords)
    except TypeError:  # an unhashable function: not asked
        return None


@functools.cache
def _ask(func: Callable[..., Any], packet: str, kinds: Any, keywords: Any) -> str | None:
    """The overload of `packet` that torch's dispatcher receives first when `func` is called with
    stand-ins of `kinds`; None where none does (a composite that decomposes first) or the call
    fails before. No kernel of the op runs, and the stand-ins are made and called with every
    other mode off (explain's recorder, a compile's fake mode)."""
    first = _FirstOf(packet)
    try:
        with no_dispatch_modes(), no_torch_function(), torch.no_grad():
            args = [_stand_in(k) for k in kinds]
            kw = {name: _stand_in(k) for name, k in keywords}
            with torch.random.fork_rng(devices=[]), first:
                func(*args, **kw)
    except _ReachedError:
        return first.overload
    except Exception:  # torch refuses the stand-ins: it tells nothing
        pass
    return None
