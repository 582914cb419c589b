"""aten op names as op rules use them: packets, their overloads, the overloads a packet key covers.

A packet key (`"linear"`) covers the packet's *functional* overloads that take a tensor (torch
never autocasts `out=` or in-place overloads, nor scalar-only ones such as `pow.int`); a
`"packet.overload"` key names one overload. Also here: which overloads the dtype-argument rules
apply to, that no casting rule applies to an op returning a view of its input or, as a probe on
the installed torch shows, the input itself (`check_view`), and the error message of a
`"banned"` op.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from famp._compat import OpOverload, assume_constant_result, kernel_registrations, real_tensors
from famp._compat import op_schema as schema

APPEND_DTYPE_OVERLOADS: dict[tuple[str, str], tuple[str, str]] = {
    ("norm", "Scalar"): ("norm", "ScalarOpt_dtype"),
    ("norm", "ScalarOpt_dim"): ("norm", "ScalarOpt_dim_dtype"),
}
"""For `"float32_append_dtype"`: (packet, overload) → the overload that takes the trailing
dtype (torch's `AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE`). Every argument, defaults included,
is passed before the dtype."""


def spelled_out(
    func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A call of an aten overload with every positional argument of its schema passed by
    position, defaults included (as `APPEND_DTYPE_OVERLOADS`' redispatch needs them)."""
    full, rest = list(args), dict(kwargs)
    for name, has_default, default in _positional(func)[len(args) :]:
        if name in rest:
            full.append(rest.pop(name))
        elif has_default:
            full.append(default)
    return tuple(full), rest


@assume_constant_result  # a constant of the overload: Dynamo calls it (it cannot read schemas)
def _positional(func: OpOverload) -> tuple[tuple[str, bool, Any], ...]:
    """(name, whether it has a default, the default) of each positional parameter of `func`."""
    params = []
    for arg in schema(func).arguments:
        if arg.kwarg_only:
            break
        default = arg.has_default_value()
        params.append((arg.name, default, arg.default_value if default else None))
    return tuple(params)


_BCE_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using "
    "torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast."
)


def banned_message(op: str, device_type: str) -> str:
    """The error message for calling an op whose rule is `"banned"` (torch's text for BCE)."""
    if op.partition(".")[0] == "binary_cross_entropy":
        return _BCE_MESSAGE
    return f"aten::{op} is banned under famp's autocast rules for device_type {device_type!r}."


@functools.cache
def overloads(packet: str) -> tuple[str, ...] | None:
    """The overload names of `torch.ops.aten.<packet>`, or None if there is no such op."""
    if not packet.isidentifier():
        return None
    try:
        return tuple(getattr(torch.ops.aten, packet).overloads())
    except (AttributeError, RuntimeError):
        return None


@functools.cache
def functional_overloads(packet: str) -> tuple[str, ...]:
    """The overloads of `aten::<packet>` that mutate nothing, in torch's order (none if no op)."""
    ops = getattr(torch.ops.aten, packet) if overloads(packet) is not None else None
    return tuple(o for o in overloads(packet) or () if not schema(getattr(ops, o)).is_mutable)


@functools.cache
def covered(packet: str) -> frozenset[str]:
    """The overloads a packet key covers: functional ones that take at least one tensor."""
    ops = getattr(torch.ops.aten, packet)
    return frozenset(
        name
        for name in functional_overloads(packet)
        if any("Tensor" in str(a.type) for a in schema(getattr(ops, name)).arguments)
    )


def rule_pairs(rules: object) -> list[tuple[Any, Any]]:
    """`OpRules`' first argument as `(op, rule)` pairs: a mapping's items, or an iterable of
    pairs, each op once; anything else raises `TypeError` (`ValueError`: an op twice)."""
    if isinstance(rules, Mapping):
        return list(rules.items())
    pairs = list(rules) if isinstance(rules, Iterable) and not isinstance(rules, str) else None
    bad = [p for p in pairs or () if not (isinstance(p, tuple | list) and len(p) == 2)]
    if pairs is None or bad:
        what = f"{bad[0]!r} among them" if bad else f"{type(rules).__name__} {rules!r}"
        raise TypeError(f"rules must be a mapping or (op, rule) pairs, got {what}")
    ops = [p[0] for p in pairs]
    twice = [op for i, op in enumerate(ops) if op in ops[:i]]
    if twice:  # a dict would keep the last silently
        raise ValueError(f"rules name op {twice[0]!r} twice; give each op one rule")
    return [(p[0], p[1]) for p in pairs]


def check_op(name: object) -> str:
    """An op key (`"linear"`, `"conv2d.padding"`) checked against torch's aten ops."""
    if not isinstance(name, str):
        raise TypeError(f"op names must be str, got {name!r} of type {type(name).__name__}")
    packet, dot, overload = name.partition(".")
    names = overloads(packet)
    if names is None:
        raise ValueError(
            f"unknown op {name!r}: not an aten op (torch.ops.aten.{packet} does not exist); "
            "name a packet such as 'linear' or an overload such as 'conv2d.padding'"
        )
    if dot and overload not in names:
        raise ValueError(
            f"unknown op {name!r}: aten::{packet} has no overload {overload!r}; "
            f"its overloads are {', '.join(names)}"
        )
    return name


def check_names(packet: object, overload: object) -> None:
    """`OpRules.lookup`'s arguments: str names, the packet's without an overload."""
    if not isinstance(packet, str) or not isinstance(overload, str):
        raise TypeError(f"lookup takes str names, got packet {packet!r}, overload {overload!r}")
    if "." in packet:
        head, _, tail = packet.partition(".")
        raise ValueError(f"packet {packet!r} names an overload: lookup({head!r}, {tail!r})")


@functools.cache
def returns_view(packet: str, overload: str) -> bool:
    """Whether `aten::<packet>.<overload>`'s schema says its result aliases an input it does not
    write: a view (`view`, `transpose`, `split`'s pieces), or the input itself (`contiguous`,
    `to`). In-place and `out=` overloads, which return what they wrote, are not views."""
    ops = getattr(torch.ops.aten, packet)
    returns = schema(getattr(ops, overload)).returns
    return any(r.alias_info is not None and not r.alias_info.is_write for r in returns)


@functools.cache
def returns_input(packet: str, overload: str) -> bool:
    """Whether a composite overload whose schema marks no alias (`type_as`, `atleast_1d`,
    `broadcast_tensors`, `meshgrid`) returned its tensor input itself, or a view of it, when run
    here on a small tensor: read off the installed torch. Only overloads made of other ops
    (CompositeImplicitAutograd kernels) whose required arguments are all tensors are run."""
    kinds = _probed_kinds(packet, overload)
    return (
        kinds is not None and not any(k in _VALUES for k in kinds) and _probe(packet, overload, ())
    )


@functools.cache
def value_arguments(packet: str) -> tuple[str, tuple[str, ...]] | None:
    """For a packet whose one covered overload is a composite with bool or float arguments
    among its required tensor ones (`dropout(input, p, train)`): that overload and the kinds of
    its required arguments, in order, so that `returns_input_given` can be asked of each call."""
    names = covered(packet) if overloads(packet) is not None else ()
    if len(names) != 1:
        return None
    (overload,) = names
    kinds = _probed_kinds(packet, overload)
    if kinds is None or not any(k in _VALUES for k in kinds):
        return None
    return overload, kinds


@functools.cache
def returns_input_given(packet: str, overload: str, values: tuple[bool | float, ...]) -> bool:
    """Whether a composite of `value_arguments` returns its input itself, or a view of it, with
    `values` as its bool and float arguments, in order (`dropout` when not training or with
    `p=0`): run here once per `values` on a small tensor, as `returns_input` runs."""
    return _probe(packet, overload, values)


def _probed_kinds(packet: str, overload: str) -> tuple[str, ...] | None:
    """The kinds of a composite overload's required arguments where famp may run it on a small
    tensor: tensors, lists of tensors, bools and floats. Ints and sizes are not made up: such a
    value can reach a kernel that does not check it (one crashed the process in a trial)."""
    if not is_composite(packet, overload):
        return None
    kinds = []
    for a in schema(getattr(getattr(torch.ops.aten, packet), overload)).arguments:
        if a.kwarg_only or a.has_default_value():
            break
        kinds.append(str(a.type))
    return tuple(kinds) if all(k in ("Tensor", "List[Tensor]", *_VALUES) for k in kinds) else None


_VALUES = ("bool", "float")


def _probe(packet: str, overload: str, values: tuple[bool | float, ...]) -> bool:
    """Run a composite on a small tensor (`values` for its bool and float arguments, in order);
    whether a tensor of its result shares that tensor's memory."""
    op = getattr(getattr(torch.ops.aten, packet), overload)
    kinds = _probed_kinds(packet, overload) or ()
    with real_tensors(), warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
        warnings.simplefilter("ignore")  # a deprecation notice of the probed op, say
        t = torch.ones(2)
        given = iter(values)
        try:
            args = [
                t if k == "Tensor" else [t] if k == "List[Tensor]" else next(given) for k in kinds
            ]
            with torch.no_grad():
                out = op(*args)
        except Exception:  # a probe the op refuses tells nothing
            return False
    ptr = t.untyped_storage().data_ptr()
    return any(
        isinstance(o, torch.Tensor)
        and o.layout == torch.strided
        and o.untyped_storage().data_ptr() == ptr
        for o in (out if isinstance(out, (list, tuple)) else (out,))
    )


@functools.cache
def _composites() -> frozenset[str]:
    return frozenset(kernel_registrations("CompositeImplicitAutograd"))


def is_composite(packet: str, overload: str) -> bool:
    """Whether an aten overload is a composite that decomposes before it reaches a Python mode."""
    return f"aten::{packet}" + ("" if overload == "default" else f".{overload}") in _composites()


def check_view(op: str, rule: str, device_type: str) -> None:
    """A rule that casts may not name an op whose result aliases its input, unless torch's own
    autocast casts that overload on the device (`view_as_complex` on the CPU): the result would
    alias a copy, so a write through it would not reach the input, nor one into the input it."""
    if rule in ("keep", "banned"):
        return
    from famp._autocast import tables  # tables reads rule names: imported here, not at the top

    packet, dot, overload = op.partition(".")
    torch_casts = tables.registered_ops(device_type) if device_type in tables.DISPATCH_KEYS else ()
    names = [
        o
        for o in ([overload] if dot else sorted(covered(packet)))
        if (packet, o) not in torch_casts
    ]
    views = [o for o in names if returns_view(packet, o) or returns_input(packet, o)]
    if views:
        raise ValueError(
            f"rule {rule!r} does not apply to op {op!r}: aten::{packet} returns a view of its "
            f"input or the input itself (overloads {', '.join(views)}), and a cast input would "
            f"make it a view of a copy, so writes through the result would not reach the input "
            f"(torch's autocast casts no such op on {device_type!r}); cast the op's input or "
            f"result instead"
        )


def _has_opt_dtype(packet: str, overload: str) -> bool:
    s = schema(getattr(getattr(torch.ops.aten, packet), overload))
    return any(a.name == "dtype" and str(a.type) == "Optional[int]" for a in s.arguments)


def check_applies(op: str, rule: str) -> None:
    """Only `"keep"` applies to an overload that writes into its inputs (in-place, `out=`) or
    to a packet of such overloads alone (`relu_`): famp runs them as given, as torch's autocast
    does, so another rule would never apply. The dtype-argument rules only apply to overloads
    that have the argument they set."""
    packet, dot, overload = op.partition(".")
    if rule != "keep" and (
        overload not in functional_overloads(packet) if dot else not functional_overloads(packet)
    ):
        raise ValueError(
            f"rule {rule!r} does not apply to op {op!r}: "
            + (f"overload {op!r} is" if dot else f"every overload of {packet!r} is")
            + " in-place or out=, and famp runs in-place and out= overloads as given, as "
            "torch.autocast does, so the rule would never apply; give it to the functional op "
            "(such as 'mm' for 'mm.out', 'add.Tensor' for 'add_.Tensor', 'relu' for 'relu_')"
        )
    if rule not in ("float32_set_opt_dtype", "float32_append_dtype"):
        return
    names = [overload] if dot else sorted(covered(packet))
    if rule == "float32_append_dtype":
        bad = [o for o in names if (packet, o) not in APPEND_DTYPE_OVERLOADS]
        need = "an overload with a dtype twin: " + ", ".join(
            f"{p}.{o}" for p, o in APPEND_DTYPE_OVERLOADS
        )
    else:
        bad = [o for o in names if not _has_opt_dtype(packet, o)]
        need = "a 'ScalarType? dtype' argument"
    if bad or not names:
        raise ValueError(
            f"rule {rule!r} does not apply to op {op!r}: it needs {need}; "
            f"{packet} lacks it in overloads {', '.join(bad) or '(none)'}"
        )
