"""Casting the arguments of one op call per its rule, as torch's autocast wrappers do.

For an overridden op (`overrides.py`) famp casts the inputs per the rule and runs the op with
autocast off for the device, so that nothing inside it is recast: what torch's C++ wrappers for
the cast policies do (`aten/src/ATen/autocast_mode.h`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from famp._autocast.op_calls import call
from famp._autocast.ops import banned_message
from famp._autocast.weights import CastCache
from famp._compat import OpOverload, op_schema


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
