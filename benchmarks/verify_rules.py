"""Derive torch's autocast rule of every op by running it, and compare with famp.default_rules.

Not a benchmark: the full version of the check in tests/autocast/test_rules.py. For each device
type and each overload with an ``Autocast<Device>`` kernel in the installed torch it runs the op
under torch's autocast (real and fake CPU tensors; fake CUDA/XPU/MPS tensors) in bfloat16 and
float16, next to the reference for *every* rule (famp/_autocast/reference.py), and reports which
rules agree with torch in every run. A rule is derived when exactly one agrees.

Run from the repository root: ``python benchmarks/verify_rules.py [cpu,cuda,xpu,mps]``.
"""

from __future__ import annotations

import logging
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch

import famp
from famp._autocast.compare import check_op
from famp._autocast.defaults import WRAPPER_RULES
from famp._autocast.tables import DEVICE_TYPES, registered_ops


def registered(device: str) -> list[tuple[str, str]]:
    return sorted(registered_ops(device))


def main(devices: list[str]) -> int:
    logging.disable(logging.CRITICAL)  # fake tensors log the errors they re-raise
    print(f"torch {torch.__version__}")
    failures = 0
    for device in devices:
        start = time.perf_counter()
        rules = famp.default_rules(device)
        by_output, by_casts, by_error, derived, ambiguous, wrong = 0, 0, 0, 0, {}, []
        wrappers = WRAPPER_RULES.get(device, {})
        for packet, overload in registered(device):
            name = packet if overload == "default" else f"{packet}.{overload}"
            if (packet, overload) in wrappers:
                continue  # torch's hand-written wrapper needs the device: tests/test_cuda.py
            rule = rules.lookup(packet, overload)
            agree, ran, casts = set(famp.RULE_NAMES), 0, 0
            for dtype in (torch.bfloat16, torch.float16):
                for fake in [device != "cpu"] + ([True] if device == "cpu" else []):
                    ok, r, c = check_op(device, name, dtype, famp.RULE_NAMES, fake=fake)
                    agree &= ok
                    ran, casts = ran + r, casts + c
            if rule not in agree:
                wrong.append((name, rule, sorted(agree)))
                continue
            if ran:
                by_output += 1
            elif casts:
                by_casts += 1
            else:
                by_error += 1
            if len(agree) == 1:
                derived += 1
            else:
                ambiguous[name] = sorted(agree)
        skipped = sorted(f"{p}.{o}" for p, o in wrappers if (p, o) in registered_ops(device))
        total = len(registered(device)) - len(skipped)
        print(
            f"{device}: {total} ops; table rule agrees with torch on {total - len(wrong)} "
            f"(outputs compared: {by_output}, casts only: {by_casts}, error only: {by_error}); "
            f"uniquely derived: {derived}; {time.perf_counter() - start:.1f} s"
        )
        for name in skipped:
            print(f"    not run: {name}, torch's own wrapper, which needs the device")
        for name, agree in ambiguous.items():
            print(f"    several rules agree with torch on {name}: {', '.join(agree)}")
        for name, rule, agree in wrong:
            print(f"    WRONG {name}: table says {rule}, torch agrees with {agree}")
        failures += len(wrong)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1].split(",") if len(sys.argv) > 1 else list(DEVICE_TYPES)))
