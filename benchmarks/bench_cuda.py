"""On a CUDA GPU: unscale_and_check's bandwidth against a device-to-device copy of the grads.

Times (CUDA events, median of ``--rounds``) a clone of every gradient (one read and one write of
each byte, the floor for an out-of-place pass), ``GradScaler("cuda").unscale_``, the out-of-place
form of its kernel and ``famp.unscale_and_check`` (eager, donated and compiled with inductor), and
prints each as GB/s of gradient bytes read and written. Part of ``bash .ci/cuda``;
docs/benchmarks.md has the figures of its runs (an H100, torch 2.11).

Run from the repository root: ``python benchmarks/bench_cuda.py [--elements N] [--tensors T]``.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
from collections.abc import Callable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch

import famp


def cuda_median_ms(fn: Callable[[], object], rounds: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--elements", type=int, default=256 * 2**20, help="total grad elements")
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_cuda.py needs a CUDA GPU")
    per = args.elements // args.tensors
    grads = [torch.randn(per, device="cuda") for _ in range(args.tensors)]
    nbytes = 2 * sum(g.numel() * g.element_size() for g in grads)  # read + write
    params = [torch.nn.Parameter(torch.empty_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = torch.amp.GradScaler("cuda", init_scale=1024.0)
    scaler.scale(torch.ones((), device="cuda"))
    state = famp.init_scaler(1024.0, device="cuda")
    compiled = torch.compile(famp.unscale_and_check, fullgraph=True)
    # torch's out-of-place form of GradScaler's kernel (a clone of each gradient, then the kernel
    # on the copies), which famp ran here before it cloned them all in one launch
    functional = torch.ops.aten._amp_foreach_non_finite_check_and_unscale
    inv = state.scale.double().reciprocal().float()
    found = torch.zeros((), device="cuda")  # the functional form leaves it as it is

    def gradscaler() -> None:
        scaler._per_optimizer_states.clear()  # lets unscale_ run again without an update()
        scaler.unscale_(opt)

    candidates: dict[str, Callable[[], object]] = {
        "clone (device copy)": lambda: [g.clone() for g in grads],
        "GradScaler.unscale_ (in place)": gradscaler,
        "torch's out-of-place kernel": lambda: functional(grads, found, inv),
        "famp.unscale_and_check": lambda: famp.unscale_and_check(state, grads),
        "famp.unscale_and_check(donate=True)": lambda: famp.unscale_and_check(
            state, grads, donate=True
        ),
        "famp.unscale_and_check, compiled": lambda: compiled(state, grads),
    }
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {args.tensors} float32 grads"
    )
    print(f"{args.elements / 2**20:.0f} Mi elements")
    clone_ms = None
    for name, fn in candidates.items():
        ms = cuda_median_ms(fn, args.rounds)
        clone_ms = clone_ms or ms
        print(f"  {name:<40} {ms:8.3f} ms  {nbytes / ms / 1e6:8.1f} GB/s  {ms / clone_ms:5.2f}x")


if __name__ == "__main__":
    main()
