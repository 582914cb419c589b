"""The TorchFunctionMode behind `famp.autocast`: op overrides, module scopes, fresh weight casts.

`famp.autocast` runs the user's function inside torch's own autocast state, so that every op the
default rules cover is cast by torch's C++ kernels exactly as `torch.autocast` casts it. This mode
adds what torch cannot express, one Python-level op call at a time:

- an op whose rule differs from the default table gets its inputs cast per the rule and runs with
  autocast off for the device (what torch's C++ wrappers do), so nothing inside it is recast;
- inside a module that a module rule matches, each op runs under that policy's autocast state;
- eagerly, an in-place update of a cacheable weight clears the weight-cast cache, so that no op
  reads a cast made before the update (torch's cache is keyed without the tensor version).

"Op call" means a call of a C++-bound torch function (`torch.*`, `torch.nn.functional.*` builtins,
`Tensor` methods, `torch.ops.aten.*`). torch's own Python functions (`torch.nn.functional`,
`torch.functional`, Python `Tensor` methods) are entered, so the ops they call are seen too; calls
made from inside an op's C++ implementation are not (the `bmm` inside `einsum`, the `linear` inside
`lstm`): override the outer op instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from famp._autocast.defaults import default_rules
from famp._autocast.op_calls import call, calls, copies, op_name
from famp._autocast.ops import banned_message, functional_overloads
from famp._autocast.recompute import bracket_outputs, observe
from famp._autocast.rules import OpRules
from famp._compat import (
    OpOverload,
    assume_constant_result,
    is_view,
    op_schema,
    saved_tensors_hooks_top,
    tensor_version,
)

# --- overrides: the ops whose rule differs from the device's default table -----------------------


class Overrides:
    """The ops whose rule in `rules` differs from `default_rules(rules.device_type)`."""

    def __init__(self, rules: OpRules) -> None:
        defaults = default_rules(rules.device_type)
        packets = {key.partition(".")[0] for key in (*rules, *defaults)}
        # packet -> the rule if it is the same for every functional overload, else overload -> rule
        self.uniform: dict[str, str] = {}
        self.per_overload: dict[str, dict[str, str | None]] = {}
        for packet in sorted(packets):
            overloads = functional_overloads(packet)
            pairs = {o: (rules.lookup(packet, o), defaults.lookup(packet, o)) for o in overloads}
            changed: dict[str, str | None] = {
                o: (r if r != d else None) for o, (r, d) in pairs.items()
            }
            if not any(changed.values()):
                continue
            if len(set(changed.values())) == 1:
                rule = next(iter(changed.values()))
                assert rule is not None
                self.uniform[packet] = rule
            else:
                self.per_overload[packet] = changed
        self.packets = frozenset(self.uniform) | frozenset(self.per_overload)
        # torch's Python functions worth entering: they may call an overridden op under another
        # name. One named like an overridden op is that op: its rule applies to the whole call.
        names = calls()
        self.enter = {
            f: copy
            for f, copy in copies().items()
            if names[f] & self.packets and op_name(f)[0] not in self.packets
        }

    def __bool__(self) -> bool:
        return bool(self.packets)

    def rule(
        self, packet: str, overload: str | None, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> str | None:
        """The overriding rule for this call, or None where the default rule applies."""
        if packet not in self.packets or kwargs.get("out") is not None:
            return None
        uniform = self.uniform.get(packet)
        if uniform is not None:
            return uniform
        if overload is None:
            overload = resolve_overload(packet, args, kwargs)
        return self.per_overload[packet].get(overload)


# --- overload resolution (only for packets whose overloads have different overrides) ------------


def _fits(type_name: str, value: object) -> bool:
    optional = type_name.endswith("?")
    base = type_name.rstrip("?")
    if value is None:
        return optional
    if base == "Tensor":
        return isinstance(value, torch.Tensor)
    if base.endswith("]"):
        inner = base[: base.index("[")]
        if isinstance(value, (list, tuple)):
            return all(_fits(inner, v) for v in value)
        return inner in ("int", "SymInt") and isinstance(value, int)  # int[2] accepts one int
    if base in ("int", "SymInt"):
        return isinstance(value, int) and not isinstance(value, bool)
    if base == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if base == "bool":
        return isinstance(value, bool)
    if base in ("str", "Dimname"):
        return isinstance(value, str)
    if base == "Scalar":
        return isinstance(value, (bool, int, float, complex))
    if base == "ScalarType":
        return isinstance(value, torch.dtype)
    return True  # Layout, Device, MemoryFormat, Generator, ...: not used to tell overloads apart


def resolve_overload(packet: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The first functional overload of `aten::<packet>` whose schema the call's arguments fit."""
    ops = getattr(torch.ops.aten, packet)
    for overload in functional_overloads(packet):
        schema = op_schema(getattr(ops, overload))
        params = list(schema.arguments)
        positional = [p for p in params if not p.kwarg_only]
        if len(args) > len(positional):
            continue
        bound = dict(zip((p.name for p in positional), args, strict=False))
        if set(kwargs) - {p.name for p in params} or set(bound) & set(kwargs):
            continue
        bound.update(kwargs)
        if all(
            _fits(str(p.type), bound[p.name]) if p.name in bound else p.has_default_value()
            for p in params
        ):
            return overload
    return "default"


# --- casting per rule -----------------------------------------------------------------------------


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


class CastCache:
    """famp's own weight-cast cache: reused only for the same tensor, dtype and version."""

    def __init__(self) -> None:
        self.entries: dict[tuple[int, torch.dtype], tuple[torch.Tensor, int, torch.Tensor]] = {}

    def cast(self, t: torch.Tensor, dtype: torch.dtype, lower: torch.dtype) -> torch.Tensor:
        cacheable = (
            not torch.compiler.is_compiling()
            and dtype == lower
            and t.dtype == torch.float32
            and t.requires_grad
            and t.is_leaf
            and not is_view(t)
            and torch.is_grad_enabled()
        )
        if not cacheable:
            return t.to(dtype)
        key = (id(t), dtype)
        hit = self.entries.get(key)
        if hit is not None and hit[0] is t and hit[1] == tensor_version(t):
            return hit[2]
        out = t.to(dtype)
        self.entries[key] = (t, tensor_version(t), out)
        return out


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
        if rule == "lower":
            target = lower
        elif rule == "float32":
            target = torch.float32
        else:
            target = promote_dtype(lower, (*args, *kwargs.values()), device_type)
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


@functools.cache
def _overrides_for(rules: OpRules) -> Overrides:
    return Overrides(rules)


def _find_overrides(rules: OpRules) -> Overrides | None:
    found = _overrides_for(rules)
    return found if found else None


# Dynamo cannot trace the op schemas the overrides are read from. Inside a compiled function that
# builds a transform, they are computed at trace time and looked up here by a constant key.
_TRACED: dict[int, tuple[OpRules, Overrides | None]] = {}


def _traced_key(rules: OpRules) -> int:
    key = id(rules)
    if key not in _TRACED or _TRACED[key][0] is not rules:
        _TRACED[key] = (rules, _find_overrides(rules))
    return key


_constant_key: Callable[[OpRules], int] = assume_constant_result(_traced_key)


def overrides_for(rules: OpRules | None) -> Overrides | None:
    """The overrides `rules` makes against its device's defaults, or None if there are none."""
    if rules is None:
        return None
    if torch.compiler.is_compiling():
        return _TRACED[_constant_key(rules)][1]
    return _find_overrides(rules)


def _under(mode: TorchFunctionMode, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with mode:
        return fn(*args, **kwargs)


class FampMode(TorchFunctionMode):
    """Applies one `famp.autocast` call's overrides and module scopes; see the module docstring."""

    def __init__(self, owner: Any) -> None:
        super().__init__()
        self.owner = owner  # the _Call record of the famp.autocast call this mode serves
        self.inside: set[Callable[..., Any]] = set()

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        owner = self.owner
        if not owner.track or torch.compiler.is_compiling():  # traced: no eager bookkeeping
            return self._op(owner, func, args, kwargs)
        if owner.recompute_only and saved_tensors_hooks_top() is None:
            return call(func, args, kwargs)  # a custom backward, not the recomputation
        block = observe(owner, args)  # eagerly: is this op inside a checkpointed block?
        out = self._op(owner, func, args, kwargs)
        if block is not None:
            bracket_outputs(out, block)
        return out

    def _op(
        self, owner: Any, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if owner.suspended:
            return call(func, args, kwargs)  # a nested famp.autocast call governs this op
        if owner.track and not torch.compiler.is_compiling():
            # Code inside may enter its own torch.autocast with another dtype: torch's weight-cast
            # cache ignores the dtype, so it is dropped whenever the dtype in effect changes.
            dtype = torch.get_autocast_dtype(owner.device_type)
            if dtype is not owner.seen_dtype:
                torch.clear_autocast_cache()
                owner.seen_dtype = dtype
        if func is checkpoint and func not in self.inside:
            # Dynamo hands the checkpoint of a block to the mode (eagerly it is no torch function)
            # and traces the block with the mode popped: trace it with the mode pushed again.
            self.inside.add(func)
            try:
                block, *rest = args
                return func(functools.partial(_under, self, block), *rest, **kwargs)
            finally:
                self.inside.discard(func)
        if owner.overrides is not None and func not in self.inside:
            body = owner.overrides.enter.get(func)
            if body is not None:
                self.inside.add(func)
                try:
                    with self:
                        return body(*args, **kwargs)
                finally:
                    self.inside.discard(func)
        return owner.run_op(func, args, kwargs)
