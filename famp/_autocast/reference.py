"""The reference of torch's autocast wrapper for each rule: what running an op under it does.

`apply_rule` runs one aten overload the way torch's wrapper for a cast policy would
(`aten/src/ATen/autocast_mode.h`: `cached_cast`, `prioritize`, `set_opt_dtype`,
`type_from_firstarg`), with autocast itself off; `compare.py` runs it next to torch's autocast.
C++ argument types decide what is cast:

- `Tensor`, `Tensor?` and `Tensor[]` arguments are cast; `Tensor?[]` (`index_put`'s
  indices) never are;
- `promote` picks float32 if any `Tensor` or `Tensor[]` argument is an eligible float32
  tensor, else the autocast dtype; `Tensor?` arguments are cast but do not vote;
- eligible means: on the autocast device, floating point and not float64.
"""

from __future__ import annotations

from typing import Any

import torch

from famp._autocast.ops import APPEND_DTYPE_OVERLOADS, banned_message
from famp._compat import OpOverload
from famp._compat import op_schema as schema

Args = tuple[tuple[Any, ...], dict[str, Any]]
"""An op call's positional and keyword arguments."""

Bound = list[tuple[str, "int | str", Any]]


def names(op: OpOverload) -> tuple[str, str]:
    """(packet, overload) of an aten overload: `("norm", "Scalar")`, `("mm", "default")`."""
    s = schema(op)
    return s.name.partition("::")[2], s.overload_name or "default"


def eligible(x: object, device_type: str) -> bool:
    return (
        isinstance(x, torch.Tensor)
        and x.device.type == device_type
        and x.is_floating_point()
        and x.dtype != torch.float64
    )


def _cast(x: Any, kind: str, dtype: torch.dtype, device_type: str) -> Any:
    if kind in ("Tensor", "Optional[Tensor]"):
        return x.to(dtype) if eligible(x, device_type) and x.dtype != dtype else x
    if kind == "List[Tensor]":
        return [_cast(t, "Tensor", dtype, device_type) for t in x]
    return x


def _bound(op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Bound:
    """(kind, where, value) of every argument given, in schema order."""
    out: Bound = []
    for i, a in enumerate(schema(op).arguments):
        if i < len(args):
            out.append((str(a.type), i, args[i]))
        elif a.name in kwargs:
            out.append((str(a.type), a.name, kwargs[a.name]))
    return out


def _rebuild(args: tuple[Any, ...], kwargs: dict[str, Any], changes: dict[Any, Any]) -> Args:
    new_args = list(args)
    new_kwargs = dict(kwargs)
    for where, value in changes.items():
        if isinstance(where, int):
            new_args[where] = value
        else:
            new_kwargs[where] = value
    return tuple(new_args), new_kwargs


def _promote_type(bound: Bound, lower: torch.dtype, device_type: str) -> torch.dtype:
    current = lower
    for kind, _, value in bound:
        tensors = [value] if kind == "Tensor" else value if kind == "List[Tensor]" else []
        for t in tensors:
            if not (
                isinstance(t, torch.Tensor)
                and t.device.type == device_type
                and t.is_floating_point()
            ):
                continue
            if t.dtype == torch.float64:
                continue
            if torch.float32 in (current, t.dtype):
                current = torch.float32
            elif not (current == lower and t.dtype == lower):
                raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return current


def apply_rule(
    rule: str,
    op: OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device_type: str,
    lower: torch.dtype,
) -> Any:
    """Run `op` as torch's autocast wrapper for `rule` would; autocast must be off."""
    bound = _bound(op, args, kwargs)
    if rule == "keep":
        return op(*args, **kwargs)
    if rule in ("lower", "float32", "promote"):
        if rule == "lower":
            dtype = lower
        elif rule == "float32":
            dtype = torch.float32
        else:
            dtype = _promote_type(bound, lower, device_type)
        changes = {where: _cast(v, kind, dtype, device_type) for kind, where, v in bound}
        new_args, new_kwargs = _rebuild(args, kwargs, changes)
        return op(*new_args, **new_kwargs)
    if rule == "float32_set_opt_dtype":
        if not eligible(args[0], device_type):
            return op(*args, **kwargs)
        given = {where: v for kind, where, v in bound if kind == "Optional[int]" and v is not None}
        slot = next(i for i, a in enumerate(schema(op).arguments) if a.name == "dtype")
        if given.get(slot) is not None or given.get("dtype") is not None:
            return op(*args, **kwargs)
        if slot < len(args):
            return op(*_rebuild(args, kwargs, {slot: torch.float32})[0], **kwargs)
        return op(*args, **{**kwargs, "dtype": torch.float32})
    if rule == "float32_append_dtype":
        packet, overload = APPEND_DTYPE_OVERLOADS[names(op)]
        target = getattr(getattr(torch.ops.aten, packet), overload)
        out_type = torch.float32 if eligible(args[0], device_type) else args[0].dtype
        # C++ passes every argument, defaults included, before the appended dtype.
        full = list(args)
        for a in schema(op).arguments[len(args) :]:
            full.append(kwargs.get(a.name, a.default_value))
        return target(*full, dtype=out_type)
    if rule == "banned":
        raise RuntimeError(banned_message(names(op)[0], device_type))
    raise ValueError(f"unknown rule {rule!r}")
