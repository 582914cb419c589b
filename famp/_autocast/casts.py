"""Casting the arguments of one op call per its rule, as torch's autocast wrappers do.

For an overridden op (`overrides.py`) famp casts the inputs per the rule and runs the op with
autocast off for the device, so that nothing inside it is recast: what torch's C++ wrappers for
the cast policies do (`aten/src/ATen/autocast_mode.h`).
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch

from famp._autocast.op_calls import call
from famp._autocast.ops import (
    banned_message,
    functional_overloads,
    returns_input_given,
    spelled_out,
    value_arguments,
)
from famp._autocast.overloads import resolve_overload
from famp._autocast.views import views_a_cast
from famp._autocast.weights import CastCache
from famp._compat import OpOverload, OpOverloadPacket, assume_constant_result, op_schema


def eligible(value: object, device_type: str) -> bool:
    """torch's autocast eligibility: a floating, non-float64 tensor on the autocast device."""
    return (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and value.dtype != torch.float64
        and value.device.type == device_type
    )


def _tensors(args: Iterable[Any]) -> Iterable[torch.Tensor]:
    for arg in args:
        if isinstance(arg, torch.Tensor):
            yield arg
        elif isinstance(arg, (list, tuple)):
            yield from (a for a in arg if isinstance(a, torch.Tensor))


def promote_dtype(lower: torch.dtype, args: Iterable[Any], device_type: str) -> torch.dtype:
    # torch's at::autocast::prioritize, starting from the lower-precision dtype.
    current = lower
    for t in _tensors(args):
        if not eligible(t, device_type):
            continue
        if current == torch.float32 or t.dtype == torch.float32:
            current = torch.float32
        elif t.dtype != current:  # torch's message
            raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return current


def cast_args(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device_type: str,
    dtype: torch.dtype,
    lower: torch.dtype,
    cache: CastCache,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Cast the eligible tensors among the arguments (and in list arguments) to `dtype`."""

    def one(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if eligible(value, device_type) and value.dtype != dtype:
                return cache.cast(value, dtype, lower)
            return value
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            return type(value)(one(v) for v in value)
        return value

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


# Tensor arguments that torch's kernels update in place without their schemas saying so:
# `batch_norm`'s and `instance_norm`'s running statistics, while the op computes statistics of its
# input (the flag). torch's autocast lists neither op, so it never casts them.
_STATISTICS = ("running_mean", "running_var")
_UPDATING = ("training", "use_input_stats")


@functools.cache
def _statistics_overload(packet: str) -> str | None:
    """The functional overload of `aten::<packet>` that takes running statistics, if any."""
    ops = getattr(torch.ops.aten, packet, None)
    for overload in functional_overloads(packet):
        if any(a.name in _STATISTICS for a in op_schema(getattr(ops, overload)).arguments):
            return overload
    return None


@assume_constant_result  # a constant of the function: Dynamo calls it instead of tracing it
def _parameters(func: Callable[..., Any], packet: str) -> tuple[tuple[str, Any], ...] | None:
    """(name, default) of each parameter of a call of an op that takes running statistics (a
    torch Python function, an aten overload or builtin), or None for any other op."""
    overload = _statistics_overload(packet)
    return None if overload is None else _signature(func, packet, overload)


def _signature(func: Callable[..., Any], packet: str, overload: str) -> tuple[tuple[str, Any], ...]:
    """(name, default) of each parameter of `func`, a call of `aten::<packet>.<overload>`: a
    torch Python function's own, else the op's schema's."""
    if isinstance(func, types.FunctionType):
        return tuple((n, p.default) for n, p in inspect.signature(func).parameters.items())
    op = (
        func if isinstance(func, OpOverload) else getattr(getattr(torch.ops.aten, packet), overload)
    )
    return tuple(
        (a.name, a.default_value if a.has_default_value() else None)
        for a in op_schema(op).arguments
    )


def _bind(params: tuple[tuple[str, Any], ...], args: Any, kwargs: Any) -> dict[str, Any]:
    """A call's arguments by parameter name (`_signature`'s), defaults for those not given."""
    bound = dict(params)
    bound.update(zip((name for name, _ in params), args, strict=False))
    bound.update(kwargs)
    return bound


@assume_constant_result  # a constant of the function: Dynamo calls it instead of tracing it
def _lacks_dtype(func: OpOverload) -> bool:
    """Whether an aten overload has no `dtype` argument."""
    return not any(a.name == "dtype" for a in op_schema(func).arguments)


@assume_constant_result  # of the function, the op and the keywords' names
def _input_keyword(func: Callable[..., Any], packet: str, names: tuple[str, ...]) -> str | None:
    """Which keyword of a call without positional arguments passes the op's input, its first
    parameter: the name `_signature` gives it (`self` of `torch.ops.aten.softmax.int`), or,
    where a torch builtin's Python binding renames `self` (`torch.softmax(dim=-1, input=x)`,
    `torch.linalg.vector_norm(x=x)`), the one that no schema of the op names."""
    schemas = [_signature(func, packet, o) for o in functional_overloads(packet)]
    if schemas and schemas[0][0][0] in names:
        return schemas[0][0][0]
    known = {name for params in schemas for name, _ in params}
    return next((name for name in names if name not in known), None)


def refuse_statistics_cast(
    rule: str,
    func: Callable[..., Any],
    packet: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device_type: str,
    target: torch.dtype,
) -> None:
    """Raise if the rule would cast a running statistic the op is about to update in place: the
    update would go into the cast copy and the statistic would keep its values."""
    params = _parameters(func, packet)
    if params is None:
        return
    bound = _bind(params, args, kwargs)
    if not any(bound.get(flag) is True for flag in _UPDATING):
        return
    for name in _STATISTICS:
        stat = bound.get(name)
        if isinstance(stat, torch.Tensor) and eligible(stat, device_type) and stat.dtype != target:
            raise ValueError(
                f"famp.autocast: the {rule!r} override of {packet!r} would cast {name} "
                f"({stat.dtype}) to {target}, and {packet} updates its running statistics in "
                "place while it computes them: the update would go into the cast copy and "
                f"{name} would keep its values. Override {packet!r} with a rule that keeps the "
                "statistics' dtype (such as 'float32' with float32 statistics), or not at all."
            )


def _gives_dtype(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args)


def apply_rule(
    rule: str,
    func: Callable[..., Any],
    packet: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device_type: str,
    lower: torch.dtype,
    cache: CastCache,
    autocast_off: Callable[[], Any],
) -> Any:
    """Run one call under `rule` with `lower` as the compute dtype, autocast off inside it.

    Returns `AS_TORCH` instead where a casting rule's call returned a view of an input it cast
    (`torch.einsum("ij->ji", x)`), or would return the input itself with the call's bool and
    float arguments (`dropout(x, p, False)`, asked of torch before anything is cast): the caller
    then runs the call as torch does, uncast, so that the result is the caller's tensor or a view
    of it, as under `torch.autocast`, and a write through it reaches that tensor. Ops that
    return a view whatever their arguments take no casting rule at all (`ops.check_view`).
    """
    if rule == "banned":
        raise RuntimeError(banned_message(packet, device_type))
    if rule in ("lower", "float32", "promote"):
        if rule == "promote":
            target = promote_dtype(lower, (*args, *kwargs.values()), device_type)
        else:
            target = lower if rule == "lower" else torch.float32
        refuse_statistics_cast(rule, func, packet, args, kwargs, device_type, target)
        if _value_packet(packet) and _returns_input(
            func, packet, _constants(args), _constants(kwargs)
        ):
            return AS_TORCH  # `dropout` when not training: torch's result is the input itself
        cast, cast_kwargs = cast_args(args, kwargs, device_type, target, lower, cache)
        with autocast_off():
            out = call(func, cast, cast_kwargs)
        if views_a_cast(out, args, kwargs, cast, cast_kwargs):
            return AS_TORCH  # `torch.einsum("ij->ji", x)`: torch's result is a view of `x`
        return out
    if rule in ("float32_set_opt_dtype", "float32_append_dtype"):
        name = None if args else _input_keyword(func, packet, tuple(kwargs))
        first = args[0] if args else kwargs[name] if name is not None else None
        if eligible(first, device_type) and not _gives_dtype(args, kwargs):
            if isinstance(func, OpOverloadPacket):  # `aten.norm(t, 3, [1])`: the overload it picks
                func = getattr(func, resolve_overload(packet, args, kwargs, func))
            if isinstance(func, OpOverload) and _lacks_dtype(func):
                # An overload without dtype: redispatch with every positional argument spelled out
                # (norm.ScalarOpt_dim -> norm.ScalarOpt_dim_dtype, whose keepdim has no default).
                args, kwargs = spelled_out(func, args, kwargs)
                func = getattr(torch.ops.aten, packet)
            kwargs = {**kwargs, "dtype": torch.float32}
    elif rule != "keep":
        raise ValueError(f"unknown rule {rule!r} for op {packet!r}")
    with autocast_off():
        return call(func, args, kwargs)


AS_TORCH = object()
"""`apply_rule`'s answer for a call to run as torch runs it: cast, its result would be a cast
copy of its input, or a view of one."""


@assume_constant_result  # Dynamo calls it while tracing: a constant of the op's name
def _value_packet(packet: str) -> bool:
    return value_arguments(packet) is not None


@assume_constant_result  # of the function and the call's constants (tensors, lists: None)
def _returns_input(
    func: Callable[..., Any], packet: str, args: tuple[Any, ...], kwargs: tuple[Any, ...]
) -> bool:
    """Whether a call of an op of `ops.value_arguments` returns its input itself (or a view),
    its bool and float arguments read off `args` and `kwargs` (`_constants`). A torch Python
    function (`F.dropout(input, p, training)`) is bound by its own signature, defaults
    included, its parameters taken in the order of the op's (they agree for torch's)."""
    found = value_arguments(packet)
    if found is None:
        return False
    overload, kinds = found
    params = _signature(func, packet, overload)
    if len(params) < len(kinds):
        return False
    bound = _bind(params, args, kwargs)
    values = []
    for (name, _), kind in zip(params, kinds, strict=False):  # the op's required arguments
        if kind in ("bool", "float"):
            value = bound.get(name)
            if not isinstance(value, (bool, int, float)):  # not given, or not a plain number
                return False
            values.append(bool(value) if kind == "bool" else float(value))
    return returns_input_given(packet, overload, tuple(values))


def _constants(args: Any) -> tuple[Any, ...]:
    """The plain constants of a call's arguments (positional, or keyword as pairs); None for
    the others (tensors, lists), which Dynamo could not pass to `_returns_input`."""
    if isinstance(args, dict):
        return tuple((k, _constant(v)) for k, v in args.items())
    return tuple(_constant(a) for a in args)


def _constant(value: Any) -> Any:
    """A number is read as zero or not (`0.5` or `1` for any other value; Dynamo may hold it as a
    symbol, a module's `p` under `dynamic=True`, and then guards on that only): all that decides
    whether `dropout` returns its input."""
    kind = type(value)
    if kind is float:
        return 0.0 if value == 0 else 0.5
    if kind is int:
        return 0 if value == 0 else 1
    return value if kind is bool or kind is str else None
