"""Op overrides: the ops whose rule in a call's `OpRules` differs from the device's defaults.

`famp.autocast` leaves every op whose rule is the default to torch's own autocast kernels; only
the overridden ops go through famp (`casts.apply_rule`). For a packet whose overloads have
different overrides, the overload a call reaches is resolved as torch resolves it
(`overloads.resolve_overload`), the same eagerly and while Dynamo traces.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from famp._autocast.defaults import default_rules
from famp._autocast.entered import calls, copies, traced_copies
from famp._autocast.handed import dropped
from famp._autocast.op_calls import (
    in_place,
    is_method,
    op_name,
    recall,
    remember,
    writes_first_arg,
)
from famp._autocast.ops import covered, functional_overloads, overloads
from famp._autocast.overloads import resolve_overload
from famp._autocast.rules import OpRules
from famp._compat import HigherOrderOperator, assume_constant_result
from famp._compat import op_schema as schema


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
        self.bodies = tuple(traced_copies()[f] for f in self.enter)  # `entered_at`'s
        self.positions = {f: i for i, f in enumerate(self.enter)}

    def __bool__(self) -> bool:
        return bool(self.packets)

    def rule(
        self,
        func: Callable[..., Any],
        packet: str,
        overload: str | None,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> str | None:
        """The overriding rule for this call, or None where the default rule applies."""
        if packet not in self.packets or kwargs.get("out") is not None:
            return None
        uniform = self.uniform.get(packet)
        if uniform is not None:
            return uniform
        if overload is None:
            overload = resolve_overload(packet, args, kwargs, func)
        return self.per_overload[packet].get(overload)


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


WATCHED, UNWATCHED, WRITES = 1, 2, 3
"""`plain`'s answers for a plain op call: the weight watch runs before it, or it need not; an
in-place op, watched, whose write into its first argument is checked after it."""


def plain(
    func: Callable[..., Any], overrides: Overrides | None, device_type: str, memo: dict[Any, int]
) -> int:
    """Whether an eager op call of `func` needs nothing of famp but the weight-cast watch and the
    check of its writes: 0 if it does, else `WRITES` for an in-place op (`add_`, `set_`),
    `UNWATCHED` where the op cannot read a weight's cast (`reads_no_cast`) and `WATCHED`
    otherwise.

    Plain: `func` is not overridden and may not call an overridden op (famp does not enter it).
    Of the calls whose name writes into an argument, only in-place ops (named `..._`, which no
    rule covers): `__setitem__` and `__set__` take famp's general path. A write through `out=`
    is checked per call. `memo` is the transform's: the answer depends only on `func`,
    `overrides` and the device type.
    """
    known = recall(memo, func)
    if known is None:
        packet = op_name(func)[0]
        known = (
            0
            if (overrides is not None and (packet in overrides.packets or func in overrides.enter))
            or dropped(func)  # its call reaches the mode without some arguments (`handed`)
            else WRITES
            if in_place(packet)
            else 0
            if writes_first_arg(packet, {})
            else UNWATCHED
            if reads_no_cast(packet, device_type)
            else WATCHED
        )
        remember(memo, func, known)
    return known


TRACED_CALL, TRACED_METHOD = 1, 2
"""`traced_plain`'s answers: call the function, or torch's Python `Tensor` method as a method."""


@assume_constant_result  # Dynamo calls it as it traces and takes the answer as a constant
def traced_plain(overrides: Overrides | None, func: Callable[..., Any]) -> int:
    """While Dynamo traces a call: whether an op call outside module rules' scopes needs nothing
    of famp, as `plain` says eagerly. 0 if it does (`func` may be overridden or call an
    overridden op, or is `checkpoint` or another higher-order operator), else how
    `op_calls.call` calls it (`TRACED_CALL`, `TRACED_METHOD`): all that famp's general path
    does with such a call there.

    Tracing that path costs Dynamo hundreds of bytecodes an op call; the answer depends only on
    `func` and `overrides` (guarded by identity), so Dynamo calls this function instead.
    """
    if func is checkpoint or isinstance(func, HigherOrderOperator):
        return 0  # traced, `checkpoint` arrives as a higher-order operator, and `is` it there
    if overrides is not None:
        try:
            entered = func in overrides.enter
        except TypeError:  # unhashable: take the general path
            return 0
        if entered or op_name(func, memo=False)[0] in overrides.packets:
            return 0
    return TRACED_METHOD if is_method(func) else TRACED_CALL


@assume_constant_result  # Dynamo calls it as it traces and takes the answer as a constant
def entered_at(overrides: Overrides, func: Callable[..., Any]) -> int:
    """While Dynamo traces: where `func`'s copy is in `overrides.bodies`, -1 if it is not entered.
    `overrides.enter.get(func)` traced puts a guard on the dict, which for torch's reflected
    operators (`Tensor.__rsub__`: `2.5 - x`) Dynamo got wrong and refused on the same frame."""
    try:
        return overrides.positions.get(func, -1)
    except TypeError:  # unhashable: not entered
        return -1


@functools.cache
def reads_no_cast(packet: str, device_type: str) -> bool:
    """Whether no call named `packet` can read a weight's cast from torch's autocast cache.

    torch caches only casts to the lower dtype, made by the ops its autocast casts so (the
    `"lower"` rules: `linear`, `conv2d`, `matmul`, ...) and by the ops that call them inside
    (`einsum`'s `bmm`). An op reads none when each of its functional overloads that takes a
    tensor has a rule other than `"lower"` and computes nothing such an op would: it returns
    views of its inputs (`view`, `transpose`, `split`, `to`) or no tensor (`size`, `dim`), or
    torch tags it pointwise (`add`, `relu`) or a reduction (`sum`, `amax`). Read off the
    installed torch's schemas and tags; of the names no aten op has (`__getitem__`, `float`),
    only `__get__`, a tensor attribute's read (`x.shape`, `x.T`), and `__getitem__`, an indexing
    (views, `index`, `select`). The weight watch, which runs before the ops that may read a cast,
    may skip these: a weight is still watched at the first op that may read its cast.
    """
    if packet[:2] == "__":  # a Python method no aten op is named after (`__getitem__`)...
        return packet in ("__get__", "__getitem__")  # ...but an attribute's read, an indexing
    names = covered(packet) if overloads(packet) is not None else frozenset()
    defaults = default_rules(device_type)
    ops = getattr(torch.ops.aten, packet) if names else None
    for name in names:
        op = getattr(ops, name)
        returns = schema(op).returns
        computes = not (
            torch.Tag.pointwise in op.tags
            or torch.Tag.reduction in op.tags  # `sum`, `mean`, `amax`: no matmul inside
            or not any("Tensor" in str(r.type) for r in returns)
            or all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
        )
        if computes or defaults.lookup(packet, name) == "lower":
            return False
    return bool(names)


def overrides_for(rules: OpRules | None) -> Overrides | None:
    """The overrides `rules` makes against its device's defaults, or None if there are none."""
    if rules is None:
        return None
    if torch.compiler.is_compiling():
        return _TRACED[_constant_key(rules)][1]
    return _find_overrides(rules)
