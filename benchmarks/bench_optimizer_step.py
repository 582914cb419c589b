"""optimizer_step benchmark: famp.optimizer_step ÷ GradScaler.step, side by side in one run.

For each optimizer (for-loop, foreach and fused forms) one timed call is what a training loop pays
after ``backward()``: torch's ``scaler.step(opt); scaler.update()`` against famp's
``state = famp.update_scale(state, famp.optimizer_step(opt, state))``, on the same scaled
gradients (refilled before each call, outside the timing). Model: 8 × ``Linear(512, 512)``
(2.1M float32 parameters, 8 MB). Calls alternate torch/famp; each figure is the median of its
calls, and the table prints famp ÷ torch. Steps are applied (no overflow), the common case; the
non-fused path's cost is the copy of parameters and state it takes before each step (to undo a
skip without a host sync).

Run: python benchmarks/bench_optimizer_step.py [--rounds 40] [--threads 1]  (about 1 minute)
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import torch

import famp

OPTIMIZERS: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
    "SGD momentum, for-loop": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=False),
    "SGD momentum, foreach": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True),
    "SGD momentum, fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    "Adam, for-loop": lambda p: torch.optim.Adam(p, lr=1e-3, foreach=False),
    "Adam, foreach": lambda p: torch.optim.Adam(p, lr=1e-3, foreach=True),
    "AdamW, fused": lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
    "RMSprop, foreach": lambda p: torch.optim.RMSprop(p, lr=1e-3, foreach=True),
    "Adagrad, foreach": lambda p: torch.optim.Adagrad(p, lr=1e-3, foreach=True),
}


def params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
    return list(model.parameters())


Factory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def measure(make: Factory, rounds: int) -> float:
    """Median famp time ÷ median torch time."""
    torch_params, famp_params = params(), params()
    grads = [torch.randn_like(p) * 1024.0 for p in torch_params]
    torch_opt, famp_opt = make(torch_params), make(famp_params)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=10**6)
    state = famp.init_scaler(1024.0, growth_interval=10**6)
    times: dict[str, list[float]] = {"torch": [], "famp": []}
    for i in range(rounds + 3):  # 3 warm-up rounds create the optimizers' state
        for p, g in zip(torch_params, grads, strict=True):
            p.grad = g.clone()
        scaler.scale(torch.zeros(()))  # GradScaler's per-iteration bookkeeping, untimed
        start = time.perf_counter()
        scaler.step(torch_opt)
        scaler.update()
        torch_time = time.perf_counter() - start

        for p, g in zip(famp_params, grads, strict=True):
            p.grad = g.clone()
        start = time.perf_counter()
        state = famp.update_scale(state, famp.optimizer_step(famp_opt, state))
        famp_time = time.perf_counter() - start
        if i >= 3:
            times["torch"].append(torch_time)
            times["famp"].append(famp_time)
    for p, q in zip(torch_params, famp_params, strict=True):  # the same numbers, bit for bit
        assert torch.equal(p, q)
    t, f = statistics.median(times["torch"]), statistics.median(times["famp"])
    print(f"  {'':28s} torch {t * 1e3:7.2f} ms   famp {f * 1e3:7.2f} ms")
    return f / t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{args.threads} thread(s), {args.rounds} rounds, 8 x Linear(512, 512)"
    )
    rows = []
    for name, make in OPTIMIZERS.items():
        print(name)
        rows.append((name, measure(make, args.rounds)))
    print("\n| optimizer | famp.optimizer_step + update_scale ÷ GradScaler.step + update |")
    print("|---|---|")
    for name, ratio in rows:
        print(f"| {name} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
