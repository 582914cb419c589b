"""nonfinite_report benchmark: nonfinite_report ÷ unscale_and_check, side by side (not a test).

On ~75M float32 gradient elements in 50 tensors (bench_scaler.py's gradients), eagerly and under
torch.compile(fullgraph=True): the report of all-finite gradients (the every-step case), and the
report when one tensor holds an inf (eagerly on the CPU, that tensor then takes the masked
passes). Candidates run interleaved in a shuffled order, round after round; each ratio is of
medians. Every candidate ends with a `.item()` of found_inf, as a training loop that reads it.

Run: python benchmarks/bench_report.py [--elements 75_000_000] [--tensors 50] [--rounds 21]
"""

from __future__ import annotations

import math

import torch
from bench_scaler import gradient_args, make_grads, median_times

import famp


def main() -> None:
    args = gradient_args(__doc__.splitlines()[0])
    grads = make_grads(args.elements, args.tensors)
    bad = [g.clone() if i == 7 else g for i, g in enumerate(grads)]
    bad[7][12345] = math.inf
    state = famp.init_scaler(1024.0)
    unscale_c = torch.compile(famp.unscale_and_check, fullgraph=True)
    report_c = torch.compile(famp.nonfinite_report, fullgraph=True)
    for tree in (grads, bad):  # compile outside the timing
        unscale_c(state, tree)
        report_c(tree)
    assert famp.nonfinite_report(bad).found_inf.item() == 1.0
    t = median_times(
        {
            "unscale": lambda: famp.unscale_and_check(state, grads)[1].item(),
            "report": lambda: famp.nonfinite_report(grads).found_inf.item(),
            "unscale_inf": lambda: famp.unscale_and_check(state, bad)[1].item(),
            "report_inf": lambda: famp.nonfinite_report(bad).found_inf.item(),
            "unscale_compiled": lambda: unscale_c(state, grads)[1].item(),
            "report_compiled": lambda: report_c(grads).found_inf.item(),
        },
        args.rounds,
    )
    print("  medians (ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in t.items()))
    rows = [
        ("nonfinite_report ÷ unscale_and_check, eager, all finite", t["report"] / t["unscale"]),
        (
            "nonfinite_report ÷ unscale_and_check, eager, one inf",
            t["report_inf"] / t["unscale_inf"],
        ),
        (
            "nonfinite_report ÷ unscale_and_check, both compiled, all finite",
            t["report_compiled"] / t["unscale_compiled"],
        ),
    ]
    print()
    print("| famp ÷ famp | ratio |")
    print("|---|---|")
    for name, ratio in rows:
        print(f"| {name} | {ratio:.2f}× |")


if __name__ == "__main__":
    main()
