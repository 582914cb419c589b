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
from famp._autocast.ops import banned_message, functional_overloads
from famp._autocast.weights import CastCache
from famp._compat import OpOverload, assume_constant_result, op_schema


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
    if overload is None:
        return None
    if isinstance(func, types.FunctionType):
        return tuple((n, p.default) for n, p in inspect.signature(func).parameters.items())
    op = (
        func if isinstance(func, OpOverload) else getattr(getattr(torch.ops.aten, packet), overload)
    )
    return tuple(
        (a.name, a.default_value if a.has_default_value() else None)
        for a in op_schema(op).arguments
    )


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
    bound = dict(params)
    bound.update(zip((name for name, _ in params), args, strict=False))
    bound.update(kwargs)
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


def _spelled_out(
    func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    full, rest = list(args), dict(kwargs)
    for arg in op_schema(func).arguments[len(args) :]:
        if arg.kwarg_only:
            break
        if arg.name in rest:
            full.append(rest.pop(arg.name))
        elif arg.has_default_value():
            full.append(arg.default_value)
    return tuple(full), rest


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
    """Run one call under `rule` with `lower` as the compute dtype, autocast off inside it."""
    if rule == "banned":
        raise RuntimeError(banned_message(packet, device_type))
    if rule in ("lower", "float32", "promote"):
        if rule == "promote":
            target = promote_dtype(lower, (*args, *kwargs.values()), device_type)
        else:
            target = lower if rule == "lower" else torch.float32
        refuse_statistics_cast(rule, func, packet, args, kwargs, device_type, target)
        args, kwargs = cast_args(args, kwargs, device_type, target, lower, cache)
    elif rule in ("float32_set_opt_dtype", "float32_append_dtype"):
        first = args[0] if args else next(iter(kwargs.values()), None)
        if eligible(first, device_type) and not _gives_dtype(args, kwargs):
            if isinstance(func, OpOverload) and not any(
                a.name == "dtype" for a in op_schema(func).arguments
            ):
                # An overload without dtype: redispatch with every positional argument spelled out
                # (norm.ScalarOpt_dim -> norm.ScalarOpt_dim_dtype, whose keepdim has no default).
                args, kwargs = _spelled_out(func, args, kwargs)
                func = getattr(torch.ops.aten, packet)
            kwargs = {**kwargs, "dtype": torch.float32}
    elif rule != "keep":
        raise ValueError(f"unknown rule {rule!r} for op {packet!r}")
    with autocast_off():
        return call(func, args, kwargs)
