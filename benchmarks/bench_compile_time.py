"""Compile time of a fullgraph step: famp.value_and_grad + skip_on_overflow ÷ torch.func.grad.

Each candidate compiles, in a fresh process with an empty inductor cache directory of its own
(so it builds every C++ kernel it needs, as on a user's first run), a step over N square
float32 parameters (a tanh chain, batch 8) and reports its first call, which is almost all
compilation:

- `plain`: `torch.func.grad` and an SGD update (no loss scaling).
- `famp`: `famp.value_and_grad`, the SGD update, `famp.skip_on_overflow`.
- `famp, no skip`: the same without `skip_on_overflow`.
- `famp, torch.where skip`: the skip written by hand as one `torch.where` per parameter (only
  with `--where`).

A first, discarded child (a one-parameter plain step) takes what the first process of a run
pays alone (shared libraries and Python modules read from disk), so that it does not fall on
the first candidate.

`--device cuda` builds the same steps on a GPU (inductor's Triton kernels instead of C++; the first
call is synchronized before it is timed).

Run: python benchmarks/bench_compile_time.py [--configs 60x64,40x1024] [--where] [--device cuda]
(under 3 minutes)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

VARIANTS = ("plain", "famp", "famp, no skip", "famp, torch.where skip")


def child(variant: str, n: int, size: int, device: str) -> None:
    """Compile and call the step once; print the seconds the first call took."""
    import torch

    import famp

    torch.set_num_threads(1)
    params = {f"w{i}": torch.randn(size, size, device=device) * 0.01 for i in range(n)}
    x = torch.randn(8, size, device=device)

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        h = x
        for i in range(n):
            h = torch.tanh(h @ p[f"w{i}"])
        return h.square().mean()

    def step(p: dict[str, torch.Tensor], state: famp.ScalerState, x: torch.Tensor) -> object:
        if variant == "plain":
            g = torch.func.grad(loss_fn)(p, x)
            return {k: p[k] - 0.1 * g[k] for k in p}, state
        _, g, found_inf, state = famp.value_and_grad(loss_fn)(state, p, x)
        new = {k: p[k] - 0.1 * g[k] for k in p}
        if variant == "famp":
            new = famp.skip_on_overflow(found_inf, new, p)
        elif variant == "famp, torch.where skip":
            keep = found_inf == 0
            new = {k: torch.where(keep, new[k], p[k]) for k in p}
        return new, state

    compiled = torch.compile(step, fullgraph=True)
    start = time.perf_counter()
    compiled(params, famp.init_scaler(2.0**10, device=device), x)
    if device == "cuda":
        torch.cuda.synchronize()
    print(time.perf_counter() - start)


def first_call(variant: str, n: int, size: int, device: str) -> float:
    """Seconds of the first call of `variant`'s step, in a fresh process with empty caches."""
    env = dict(
        os.environ,
        TORCHINDUCTOR_FX_GRAPH_CACHE="0",
        TORCHINDUCTOR_AUTOGRAD_CACHE="0",
        TORCHINDUCTOR_COMPILE_THREADS="1",
    )
    with tempfile.TemporaryDirectory() as cache:  # no kernel built by another candidate
        out = subprocess.run(
            [sys.executable, __file__, "--child", variant, str(n), str(size), device],
            env={**env, "TORCHINDUCTOR_CACHE_DIR": cache},
            capture_output=True,
            text=True,
            check=True,
            timeout=600,
        )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="60x64,40x1024", help="NxSIZE, comma-separated")
    parser.add_argument("--where", action="store_true", help="also the hand-written where skip")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), int(args.child[2]), args.child[3])
        return
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda needs a CUDA GPU: torch.cuda.is_available() is False")
    variants = VARIANTS if args.where else VARIANTS[:3]
    device = args.device
    first_call("plain", 1, 8, device)  # discarded: what the first process of a run pays alone
    print(
        f"first call of a fresh process (s) on {device}; 1 thread, inductor caches empty and off\n"
    )
    print("| parameters | " + " | ".join(variants) + " | famp ÷ plain |")
    print("|---" * (len(variants) + 2) + "|")
    for config in args.configs.split(","):
        n, size = (int(v) for v in config.split("x"))
        seconds = {variant: first_call(variant, n, size, device) for variant in variants}
        cells = " | ".join(f"{seconds[v]:.1f}" for v in variants)
        ratio = seconds["famp"] / seconds["plain"]
        print(f"| {n} × {size}×{size} | {cells} | {ratio:.2f} |", flush=True)


if __name__ == "__main__":
    main()
