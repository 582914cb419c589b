"""Op overrides: the ops whose rule in a call's `OpRules` differs from the device's defaults.

`famp.autocast` leaves every op whose rule is the default to torch's own autocast kernels; only
the overridden ops go through famp (`casts.apply_rule`). For a packet whose overloads have
different overrides, the overload a call reaches is resolved from the kinds of its arguments
against the op schemas (`resolve_overload`), the same eagerly and while Dynamo traces.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeAlias

import torch

from famp._autocast.defaults import default_rules
from famp._autocast.entered import calls, copies
from famp._autocast.op_calls import op_name, recall, remember, writes_first_arg
from famp._autocast.ops import functional_overloads
from famp._autocast.rules import OpRules
from famp._compat import assume_constant_result, op_schema


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
        # Except when it renormalizes a weight in place first (`op_calls.renorms`): then it is
        # entered, so that the write reaches the weight and the op inside gets the rule.
        self.renorming = {f: copy for f, copy in copies().items() if op_name(f)[0] in self.packets}

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
# The overload is read off the kinds of the call's arguments (`_kind`), not their values, by a
# function that Dynamo calls while tracing instead of tracing it (it cannot trace op schemas): so
# a call reaches the same overload eagerly and compiled, where a SymInt stands for an int.

Kind: TypeAlias = "str | tuple[Kind, ...]"

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


def resolve_overload(packet: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The first functional overload of `aten::<packet>` whose schema the kinds of the call's
    arguments fit (`"default"` if none does)."""
    keywords = tuple((name, _kind(value)) for name, value in kwargs.items())
    return _resolved(packet, tuple(_kind(a) for a in args), keywords)


@assume_constant_result  # a constant of the op and the arguments' kinds: Dynamo calls it
def _resolved(packet: str, kinds: tuple[Kind, ...], keywords: tuple[tuple[str, Kind], ...]) -> str:
    return _first_fit(packet, kinds, keywords)


@functools.cache
def _first_fit(packet: str, kinds: tuple[Kind, ...], keywords: tuple[tuple[str, Kind], ...]) -> str:
    ops = getattr(torch.ops.aten, packet)
    given = dict(keywords)
    for overload in functional_overloads(packet):
        params = list(op_schema(getattr(ops, overload)).arguments)
        positional = [p for p in params if not p.kwarg_only]
        if len(kinds) > len(positional):
            continue
        bound = dict(zip((p.name for p in positional), kinds, strict=False))
        if set(given) - {p.name for p in params} or set(bound) & set(given):
            continue
        bound.update(given)
        if all(
            _fits(str(p.real_type), bound[p.name]) if p.name in bound else p.has_default_value()
            for p in params
        ):
            return overload
    return "default"


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


def plain(func: Callable[..., Any], overrides: Overrides | None, memo: dict[Any, bool]) -> bool:
    """Whether an eager op call of `func` needs nothing of famp but the weight-cast watch.

    True when `func` is not overridden, may not call an overridden op (famp does not enter it)
    and its name writes into no argument (a write through `out=` is checked per call). `memo`
    is the transform's: the answer depends only on `func` and `overrides`.
    """
    known = recall(memo, func)
    if known is None:
        packet = op_name(func)[0]
        known = not writes_first_arg(packet, {}) and (
            overrides is None or (packet not in overrides.packets and func not in overrides.enter)
        )
        remember(memo, func, known)
    return known


def overrides_for(rules: OpRules | None) -> Overrides | None:
    """The overrides `rules` makes against its device's defaults, or None if there are none."""
    if rules is None:
        return None
    if torch.compiler.is_compiling():
        return _TRACED[_constant_key(rules)][1]
    return _find_overrides(rules)
