"""Deriving torch's autocast rule of each op by running it: the one rule that agrees with torch.

`famp.default_rules` uses `derive_rules` for the ops of a torch release its shipped tables do not
know (fake tensors: no computation). `python -m famp._autocast.rules_derive` derives the running
torch's tables and writes them into `famp/_autocast/rules_data.py` under its release.
"""

from __future__ import annotations

import torch

from famp._autocast.compare import check_op
from famp._autocast.rules import RULE_NAMES
from famp._autocast.samples import SAMPLES

DTYPES = (torch.bfloat16, torch.float16)


def _display(packet: str, overload: str) -> str:
    return packet if overload == "default" else f"{packet}.{overload}"


def derive_rules(
    device_type: str,
    ops: list[tuple[str, str]],
    prior: dict[tuple[str, str], str],
    *,
    exhaustive: bool = False,
) -> tuple[dict[tuple[str, str], str], dict[str, str]]:
    """Each op's rule: the one rule whose reference agrees with torch's autocast in every run.

    Every op runs on fake tensors of `device_type` (which reach torch's `Autocast<Device>`
    kernel without computing) in bfloat16 and float16, in every input variant, under torch's
    autocast and under the reference for the `prior` rule (the newest shipped table's), which is
    taken if it agrees in every run; otherwise, or if `exhaustive`, under the reference for
    every rule, and the one that agrees is taken (the prior one if several agree). `exhaustive`
    also runs CPU ops on real tensors, comparing bits.

    Returns:
        (packet, overload) → rule for the classified ops, and op name → why for the others.
    """
    derived: dict[tuple[str, str], str] = {}
    unclassified: dict[str, str] = {}
    real = [False] if exhaustive and device_type == "cpu" else []
    for packet, overload in ops:
        name = _display(packet, overload)
        if name not in SAMPLES:
            unclassified[name] = "famp has no sample inputs for it"
            continue
        runs = [(dtype, fake) for dtype in DTYPES for fake in [True, *real]]
        guess = prior.get((packet, overload))
        # The newest shipped table's rule, checked in every run, is enough when it agrees.
        if (
            not exhaustive
            and guess is not None
            and all(check_op(device_type, name, d, (guess,), fake=f)[0] for d, f in runs)
        ):
            derived[(packet, overload)] = guess
            continue
        agree = set(RULE_NAMES)
        for dtype, fake in runs:
            agree &= check_op(device_type, name, dtype, RULE_NAMES, fake=fake)[0]
        if len(agree) == 1:
            derived[(packet, overload)] = agree.pop()
        elif prior.get((packet, overload)) in agree:
            derived[(packet, overload)] = prior[(packet, overload)]
        elif agree:
            unclassified[name] = f"rules {', '.join(sorted(agree))} all agree with torch"
        else:
            unclassified[name] = "no rule agrees with torch"
    return derived, unclassified


def main() -> int:
    """Derive the running torch's tables (fake tensors everywhere, real ones on CPU) and write
    them into `famp/_autocast/rules_data.py` under its release; the other releases are kept."""
    import logging
    import pathlib
    import time

    from famp._autocast import rules_data, tables
    from famp._autocast.defaults import WRAPPER_RULES

    logging.disable(logging.CRITICAL)  # fake tensors log the errors they re-raise
    release = tables.torch_release()
    shipped = {r: t for r, t in tables.shipped_tables().items() if r != release}
    prior_release = max(shipped, key=tables.release_key) if shipped else None
    new: dict[str, tables.Table] = {}
    failed = False
    for device in tables.DEVICE_TYPES:
        start = time.perf_counter()
        prior = tables.expand(shipped[prior_release][device]) if prior_release else {}
        wrappers = WRAPPER_RULES.get(device, {})
        registered = tables.registered_ops(device)
        ops = sorted(registered - wrappers.keys())
        derived, unclassified = derive_rules(device, ops, prior, exhaustive=True)
        derived.update((op, r) for op, r in wrappers.items() if op in registered)
        for name, why in sorted(unclassified.items()):
            print(f"    {device}: cannot classify {name}: {why}")
            failed = True
        keys = tables.rule_keys(derived)
        new[device] = tables.by_rule(keys)
        print(f"{device}: {len(ops)} ops, {len(keys)} keys, {time.perf_counter() - start:.1f} s")
    if failed:
        return 1
    shipped[release] = new
    path = pathlib.Path(rules_data.__file__)
    text = path.read_text()
    head = text[: text.index("BASE_RELEASE = ")]
    path.write_text(head + tables.store(shipped))
    print(f"wrote torch {release}'s tables into {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
