"""Autocast op rules as data: `famp.Rule` and `famp.OpRules`, which aten op runs in which dtype.

`famp.default_rules(device_type)` (`defaults.py`) is the installed torch's `Autocast<Device>`
table as an `OpRules`. `OpRules.override` derives new tables and never mutates. The rules are
only data: `famp.autocast` applies them. Keys are aten op names without the `aten::` prefix
(`ops.py` says which overloads a packet key covers).
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal, get_args

import torch

from famp._autocast.ops import check_applies, check_names, check_op, check_view, covered, rule_pairs

Rule = Literal[
    "lower",
    "float32",
    "promote",
    "float32_set_opt_dtype",
    "float32_append_dtype",
    "keep",
    "banned",
]
"""An op rule's name.

- `"lower"`: cast floating inputs to the policy's compute dtype (torch's `lower_precision_fp`).
- `"float32"`: cast floating inputs to float32 (torch's `fp32`).
- `"promote"`: cast floating inputs to float32 if any is float32, else to the compute dtype
  (torch's `promote`; a float16 input under a bfloat16 compute dtype is an error, as in torch).
- `"float32_set_opt_dtype"`: if the first input is floating and no `dtype=` was given, pass
  `dtype=torch.float32`; inputs are not cast (`sum`, `softmax`, `cumsum` on CUDA).
- `"float32_append_dtype"`: redispatch to the overload with a trailing dtype argument, float32
  for a floating first input (`norm.Scalar` → `norm.ScalarOpt_dtype` on CUDA).
- `"keep"`: run in the input dtypes (every op that is not listed).
- `"banned"`: raise, as torch does for `binary_cross_entropy` on CUDA.

"Floating" means a floating-point tensor on the autocast device that is not float64: float64,
integer, bool and complex tensors and Python scalars are never cast.
"""

RULE_NAMES: tuple[Rule, ...] = get_args(Rule)
"""Every accepted rule name, in the order of `famp.Rule`."""


def check_rule(op: str, rule: object) -> Rule:
    """A rule name checked against `RULE_NAMES`."""
    if rule not in RULE_NAMES:
        raise ValueError(
            f"unknown rule {rule!r} for op {op!r}; accepted rules: {', '.join(RULE_NAMES)}"
        )
    return rule


def check_device_type(device_type: object) -> str:
    """A device type checked against torch's device types."""
    if not isinstance(device_type, str):
        raise TypeError(f"device_type must be a str such as 'cuda', got {device_type!r}")
    try:
        ok = torch.device(device_type).type == device_type
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"device_type must be a torch device type such as 'cuda', got {device_type!r}"
        )
    return device_type


def _canonical(rules: dict[str, Rule]) -> dict[str, Rule]:
    """Drop the entries that change no lookup, so that equal tables compare equal."""
    out: dict[str, Rule] = {}
    for key, rule in rules.items():
        packet, dot, overload = key.partition(".")
        if dot:
            inherited = rules.get(packet, "keep") if overload in covered(packet) else "keep"
            if rule == inherited:
                continue
        elif rule == "keep":
            continue
        out[key] = rule
    return dict(sorted(out.items()))


class OpRules(Mapping[str, str]):
    """An immutable table from aten op name to autocast rule, for one device type.

    A `Mapping[str, Rule]`: keys are aten packet names (`"linear"`, covering every functional
    overload that takes a tensor) or `"packet.overload"` names (`"conv2d.padding"`, which win
    over the packet key); ops not listed are `"keep"`. Equal tables (device type included) compare
    equal and hash alike; entries that change no lookup (a `"keep"` packet key, an overload key
    equal to what its packet key gives) are dropped on construction.

    Args:
        rules: op name → rule name, as a mapping or (op, rule) pairs.
        device_type: the device type the table is for, such as `"cpu"` or `"cuda"`.

    Raises:
        ValueError: an op is named twice or is no aten op or overload, a rule name is unknown
            or does not apply to the op (only `"keep"` to in-place and `out=` ones; dtype rules
            need a dtype argument; no casting rule to a view-returning op unless torch's
            autocast casts it on the device), or torch knows no such device type.
        TypeError: an op name or the device type is not a str.

    Examples:
        >>> import famp
        >>> rules = famp.OpRules(
        ...     {"linear": "lower", "conv2d.padding": "float32"}, device_type="cpu"
        ... )
        >>> rules["linear"], rules.lookup("conv2d", "padding"), rules.lookup("conv2d")
        ('lower', 'float32', 'keep')
        >>> famp.OpRules.from_dict(rules.to_dict()) == rules
        True
    """

    __slots__ = ("_covered", "_device_type", "_hash", "_rules")

    def __init__(
        self, rules: Mapping[str, str] | Iterable[tuple[str, str]] = (), *, device_type: str
    ) -> None:
        checked: dict[str, Rule] = {}
        for op, rule in rule_pairs(rules):
            checked[check_op(op)] = check_rule(op, rule)
            check_applies(op, checked[op])
        self._device_type = check_device_type(device_type)
        for op, rule in checked.items():
            check_view(op, rule, self._device_type)
        self._rules = _canonical(checked)
        self._covered = {k: covered(k) for k in self._rules if "." not in k}
        self._hash = hash((self._device_type, frozenset(self._rules.items())))

    @property
    def device_type(self) -> str:
        """The device type this table is for, such as `"cpu"` or `"cuda"`."""
        return self._device_type

    def __getitem__(self, op: str) -> Rule:
        return self._rules[op]

    def __iter__(self) -> Iterator[str]:
        return iter(self._rules)

    def __len__(self) -> int:
        return len(self._rules)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, OpRules):
            return NotImplemented
        return self._device_type == other._device_type and self._rules == other._rules

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"OpRules({self._rules!r}, device_type={self._device_type!r})"

    def __str__(self) -> str:
        return self.table()

    def __reduce__(self) -> tuple[Any, ...]:
        # Through the public names only (`famp.OpRules.from_dict`), so pickles outlive any
        # reorganization of famp's private modules.
        return (OpRules.from_dict, (self.to_dict(),))

    def lookup(self, packet: str, overload: str = "default") -> Rule:
        """The rule for one overload: its own key first, then the packet key, else `"keep"`.

        The packet key applies only to the packet's functional overloads that take a tensor:
        `out=` and in-place overloads are always `"keep"` (run as given), as in torch.

        Args:
            packet: the aten packet name, such as `"conv2d"` (no `aten::` prefix).
            overload: the overload name; `"default"` (or `""`) is the unnamed overload.

        Returns:
            The rule name.

        Raises:
            TypeError: a name is not a str.
            ValueError: `packet` names an overload (`"conv2d.padding"`).

        Examples:
            >>> import famp
            >>> rules = famp.default_rules("cpu")
            >>> rules.lookup("linear"), rules.lookup("linear", "out"), rules.lookup("relu")
            ('lower', 'keep', 'keep')
        """
        check_names(packet, overload)
        overload = overload or "default"
        rule = self._rules.get(f"{packet}.{overload}")
        if rule is not None:
            return rule
        overloads = self._covered.get(packet)
        if overloads is not None and overload in overloads:
            return self._rules[packet]
        return "keep"

    def override(self, changes: Mapping[str, str]) -> OpRules:
        """A new table with some ops' rules replaced; `self` is never changed.

        A packet key replaces every entry of that packet (its overload keys included); an
        overload key then sets that overload alone. `"keep"` removes an op from the table.

        Args:
            changes: op name → rule name.

        Returns:
            A new `OpRules` for the same device type.

        Raises:
            ValueError: an op is not an aten op or overload, or a rule name is unknown or does
                not apply to the op (as for `OpRules`); nothing is applied.

        Examples:
            >>> import famp
            >>> rules = famp.default_rules("cuda")
            >>> mine = rules.override({"rms_norm": "lower", "linear": "float32"})
            >>> mine["rms_norm"], mine["linear"], rules["rms_norm"]
            ('lower', 'float32', 'float32')
        """
        if not isinstance(changes, Mapping):
            raise TypeError(f"changes must be a mapping of op name to rule, got {changes!r}")
        checked = {check_op(op): check_rule(op, rule) for op, rule in changes.items()}
        for op, rule in checked.items():
            check_applies(op, rule)
        packets = {op for op in checked if "." not in op}
        merged = {k: v for k, v in self._rules.items() if k.partition(".")[0] not in packets}
        merged.update((op, rule) for op, rule in checked.items() if op in packets)
        merged.update((op, rule) for op, rule in checked.items() if op not in packets)
        return OpRules(merged, device_type=self._device_type)

    def to_dict(self) -> dict[str, Any]:
        """A plain, JSON-serializable dict; `OpRules.from_dict` inverts it.

        Returns:
            `{"device_type": str, "rules": {op: rule}}`, with the ops sorted.

        Examples:
            >>> import famp
            >>> famp.OpRules({"mm": "float32"}, device_type="cpu").to_dict()
            {'device_type': 'cpu', 'rules': {'mm': 'float32'}}
        """
        return {"device_type": self._device_type, "rules": dict(self._rules)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OpRules:
        """The table that `to_dict` wrote.

        Args:
            d: `{"device_type": str, "rules": {op: rule}}`.

        Returns:
            The `OpRules`.

        Raises:
            KeyError: `"device_type"` or `"rules"` is missing.
            ValueError: another key is present, or an op, rule or device type is invalid.

        Examples:
            >>> import famp
            >>> famp.OpRules.from_dict({"device_type": "cuda", "rules": {"mm": "lower"}})
            OpRules({'mm': 'lower'}, device_type='cuda')
        """
        if not isinstance(d, Mapping):
            raise TypeError(f"OpRules.from_dict expects a mapping, got {type(d).__name__}")
        for key in ("device_type", "rules"):
            if key not in d:
                raise KeyError(f"OpRules dict is missing {key!r}; it has {sorted(d)}")
        extra = sorted(set(d) - {"device_type", "rules"})
        if extra:
            raise ValueError(f"OpRules dict has unknown keys {extra}; expected device_type, rules")
        rules = d["rules"]
        if not isinstance(rules, Mapping):
            raise TypeError(f"OpRules dict 'rules' must be a mapping, got {type(rules).__name__}")
        return cls(rules, device_type=d["device_type"])

    def table(self, width: int = 100) -> str:
        """A readable table: one row per rule, listing its ops.

        Args:
            width: the line width to wrap op lists at.

        Returns:
            The table as text.

        Examples:
            >>> import famp
            >>> print(famp.OpRules({"mm": "lower", "exp": "float32"}, device_type="cuda").table())
            OpRules for device_type 'cuda' (2 entries; unlisted ops: keep)
            rule                   ops
            lower                  mm
            float32                exp
        """
        by_rule: dict[str, list[str]] = {}
        for op, rule in self._rules.items():
            by_rule.setdefault(rule, []).append(op)
        lines = [
            f"OpRules for device_type {self._device_type!r} "
            f"({len(self)} entries; unlisted ops: keep)",
            f"{'rule':<22} ops",
        ]
        for rule in RULE_NAMES:
            if rule in by_rule:
                body = textwrap.wrap(", ".join(by_rule[rule]), max(width - 23, 20))
                lines.append(f"{rule:<22} {body[0]}")
                lines.extend(" " * 23 + line for line in body[1:])
        return "\n".join(lines)
