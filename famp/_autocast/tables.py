"""The shipped op tables: reading them per release and device, and the form they are stored in.

A table is rule → keys (`"lower": ("linear", "mm.default", ...)`), keys as `famp.OpRules` takes
them. `rules_data.py` stores one base release's tables and, for every other release, only the
keys whose rule changed (a device type may also start from another's base table: xpu from cuda);
`shipped_tables` assembles every release's full tables from them, `store` writes that form back
(for `python -m famp._autocast.rules_derive`). Also here: the installed torch's release and the
ops it registers for a device's autocast key.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping

import torch

from famp._autocast.ops import covered, overloads
from famp._autocast.rules import RULE_NAMES
from famp._compat import kernel_registrations

Table = dict[str, tuple[str, ...]]
"""rule → keys, in `famp.RULE_NAMES` order, keys in `key_order`."""

Changes = dict[str, "str | None"]
"""key → its new rule, or None where the key is no longer listed."""

DISPATCH_KEYS: dict[str, str] = {
    "cpu": "AutocastCPU",
    "cuda": "AutocastCUDA",
    "xpu": "AutocastXPU",
    "mps": "AutocastMPS",
}
"""The device types that have default rules, and torch's autocast dispatch key for each."""

DEVICE_TYPES: tuple[str, ...] = tuple(DISPATCH_KEYS)


def torch_release() -> str:
    """The installed torch's release, without the build suffix: `"2.15.0"`."""
    return torch.__version__.split("+")[0]


@functools.cache
def registered_ops(device_type: str) -> frozenset[tuple[str, str]]:
    """(packet, overload) of every aten overload with a kernel for the device's autocast key."""
    out = set()
    for name in kernel_registrations(DISPATCH_KEYS[device_type]):
        if name.startswith("aten::"):
            packet, _, overload = name[len("aten::") :].partition(".")
            out.add((packet, overload or "default"))
    return frozenset(out)


def expand(table: Mapping[str, Iterable[str]]) -> dict[tuple[str, str], str]:
    """A shipped table (rule → keys) as (packet, overload) → rule, for the ops this torch has.

    Keys naming an op or overload that this torch does not have are skipped (a table for another
    release may name ops that were removed since); overload keys win over packet keys.
    """
    out: dict[tuple[str, str], str] = {}
    named: list[tuple[str, str, str]] = []
    for rule, ops in table.items():
        for key in ops:
            packet, dot, overload = key.partition(".")
            if overloads(packet) is None:
                continue
            if dot:
                named.append((packet, overload, rule))
            else:
                out.update(((packet, o), rule) for o in covered(packet))
    for packet, overload, rule in named:
        if overload in (overloads(packet) or ()):
            out[(packet, overload)] = rule
    return out


def rule_keys(per_op: Mapping[tuple[str, str], str]) -> dict[str, str]:
    """(packet, overload) → rule as table keys: a packet key where every functional overload of
    the packet that takes a tensor is listed with one rule, else one key per overload."""
    by_packet: dict[str, dict[str, str]] = {}
    for (packet, overload), rule in per_op.items():
        by_packet.setdefault(packet, {})[overload] = rule
    out: dict[str, str] = {}
    for packet, ops in sorted(by_packet.items()):
        functional = covered(packet)
        shared = {ops.get(o) for o in functional}
        if functional and len(shared) == 1 and None not in shared:
            out[packet] = ops[next(iter(functional))]
            out.update((f"{packet}.{o}", r) for o, r in sorted(ops.items()) if o not in functional)
        else:
            out.update((f"{packet}.{o}", r) for o, r in sorted(ops.items()))
    return out


def release_key(release: str) -> tuple[int, ...]:
    """A release as numbers, for sorting: `"2.15.0"` → `(2, 15, 0)`."""
    return tuple(int(part) for part in release.split(".") if part.isdigit())


def key_order(key: str) -> tuple[str, str]:
    """The order of keys in a table: by packet, the packet key before its overload keys."""
    packet, _, overload = key.partition(".")
    return packet, overload


def by_key(table: Mapping[str, Iterable[str]]) -> dict[str, str]:
    """A table (rule → keys) as key → rule."""
    return {key: rule for rule, keys in table.items() for key in keys}


def by_rule(rules: Mapping[str, str]) -> Table:
    """key → rule as a table (rule → keys); `"keep"` keys are left out."""
    grouped: dict[str, list[str]] = {}
    for key in sorted(rules, key=key_order):
        grouped.setdefault(rules[key], []).append(key)
    return {rule: tuple(grouped[rule]) for rule in RULE_NAMES if rule != "keep" and rule in grouped}


def changed(rules: Mapping[str, str], changes: Mapping[str, str | None]) -> dict[str, str]:
    """key → rule with `changes` applied (None removes a key)."""
    out = dict(rules)
    for key, rule in changes.items():
        if rule is None:
            out.pop(key, None)
        else:
            out[key] = rule
    return out


def changes_between(old: Mapping[str, str], new: Mapping[str, str]) -> Changes:
    """The changes that turn key → rule `old` into `new`, in key order."""
    diff: Changes = {key: None for key in old if key not in new}
    diff.update((key, rule) for key, rule in new.items() if old.get(key) != rule)
    return {key: diff[key] for key in sorted(diff, key=key_order)}


def shipped_tables() -> dict[str, dict[str, Table]]:
    """release → device type → rule → keys: the tables famp ships, assembled from
    `rules_data.py` (read on first use, not at `import famp`)."""
    from famp._autocast import rules_data as data

    base = {device: by_key(table) for device, table in data.BASE.items()}
    for device, (origin, changes) in data.DERIVED.items():
        base[device] = changed(base[origin], changes)
    releases = sorted({data.BASE_RELEASE, *data.CHANGES}, key=release_key)
    return {
        release: {
            device: by_rule(changed(base[device], data.CHANGES.get(release, {}).get(device, {})))
            for device in DEVICE_TYPES
            if device in base
        }
        for release in releases
    }


def store(tables: Mapping[str, Mapping[str, Table]]) -> str:
    """The Python source of `rules_data.py`'s tables for full tables (release → device → table):
    the oldest release's in full (a device type's as changes to an earlier device type's, where
    those are fewer than half its keys), every other release's changes to it."""
    releases = sorted(tables, key=release_key)
    rules = {r: {d: by_key(t) for d, t in tables[r].items()} for r in releases}
    base = rules[releases[0]]
    derived: dict[str, tuple[str, Changes]] = {}
    full: list[str] = []  # the device types stored in full, in order
    for device in base:
        diffs = [(changes_between(base[origin], base[device]), origin) for origin in full]
        diff, origin = min(diffs, key=lambda d: len(d[0]), default=({}, ""))
        if origin and 2 * len(diff) < len(base[device]):
            derived[device] = (origin, diff)
        else:
            full.append(device)
    changes = {
        release: {
            device: diff
            for device in rules[release]
            if (diff := changes_between(base[device], rules[release][device]))
        }
        for release in releases[1:]
    }
    lines = [f'BASE_RELEASE = "{releases[0]}"', ""]
    lines.append("BASE: dict[str, dict[str, tuple[str, ...]]] = {")
    for device, table in tables[releases[0]].items():
        if device in derived:
            continue
        lines.append(f'    "{device}": {{')
        for rule, keys in table.items():
            if len(keys) == 1:  # as ruff format writes it
                lines.append(f'        "{rule}": ("{keys[0]}",),')
                continue
            lines.append(f'        "{rule}": (')
            lines.extend(f'            "{key}",' for key in keys)
            lines.append("        ),")
        lines.append("    },")
    lines += ["}", "", "DERIVED: dict[str, tuple[str, dict[str, str | None]]] = {"]
    for device, (origin, diff) in derived.items():
        lines += [f'    "{device}": (', f'        "{origin}",', "        {"]
        lines.extend(f'            "{key}": {_rule_text(rule)},' for key, rule in diff.items())
        lines += ["        },", "    ),"]
    lines += ["}", "", "CHANGES: dict[str, dict[str, dict[str, str | None]]] = {"]
    for release, by_device in changes.items():
        if not by_device:
            lines.append(f'    "{release}": {{}},')
            continue
        lines.append(f'    "{release}": {{')
        for device, diff in by_device.items():
            lines.append(f'        "{device}": {{')
            lines.extend(f'            "{key}": {_rule_text(rule)},' for key, rule in diff.items())
            lines.append("        },")
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _rule_text(rule: str | None) -> str:
    return "None" if rule is None else f'"{rule}"'
