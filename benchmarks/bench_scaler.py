"""Loss-scaling benchmark: famp ÷ torch, measured side by side in one run (not a test).

On ~75M float32 gradient elements in 50 tensors:
- famp.unscale_and_check (out of place) vs a plain clone of the grads (the out-of-place memory
  limit) vs GradScaler.unscale_ (in place);
- famp.unscale_and_check(donate=True) vs GradScaler.unscale_;
- famp.unscale_and_check under torch.compile(fullgraph=True) (inductor fuses it) vs the clone;
- famp.unscale_and_check, out of place and donated, vs GradScaler.unscale_ on the 14 small
  gradients of a transformer block (58K elements), where Python, not memory, sets the time;
- famp.all_finite vs torch.isfinite(g).all() of each gradient, on the same 75M elements;
- famp.update_scale, eager (new tensors, and donated: in place) and compiled, vs GradScaler.update;
- famp.value_and_grad eagerly (scaled loss, gradients, unscale, update) vs backward() of the loss
  scaled by GradScaler, then its unscale_ and update, on a chain of matrices of the same size.
Candidates run interleaved in a shuffled order, round after round, and each ratio is of medians.

An out-of-place result needs fresh memory, and on CPU what that costs depends on glibc: memory
it maps anew is zeroed by the kernel page by page on first touch, memory it reuses is not. The
unscale comparison runs twice: with every new tensor mapped afresh (glibc's mmap threshold at
1 MiB), and with freed memory kept and reused (no mmap, no trimming), which is what a caching
allocator such as CUDA's gives.

Run: python benchmarks/bench_scaler.py [--elements 75_000_000] [--tensors 50] [--rounds 21]
"""

from __future__ import annotations

import argparse
import ctypes
import platform
import random
import statistics
import time
from collections.abc import Callable

import torch

import famp


def median_times(
    candidates: dict[str, Callable[[], object]],
    rounds: int,
    before: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Run every candidate once per round, in a shuffled order; return each one's median seconds."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    order = list(candidates)
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)  # no candidate always runs right after the same neighbour
        for name in order:
            fn = candidates[name]
            if before is not None:
                before()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def make_grads(elements: int, tensors: int) -> list[torch.Tensor]:
    sizes = [elements // tensors + (i < elements % tensors) for i in range(tensors)]
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=gen) * 1024 for n in sizes]


_LIBC = ctypes.CDLL("libc.so.6")
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4


def fresh_pages() -> None:
    """Blocks of 1 MiB and more are mapped anew by each allocation and unmapped on free."""
    _LIBC.mallopt(_M_MMAP_THRESHOLD, 1 << 20)


def reused_memory() -> None:
    """Freed memory stays in glibc's heap and the next allocation reuses it, already touched."""
    _LIBC.mallopt(_M_MMAP_MAX, 0)
    _LIBC.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)


def bench_unscale(elements: int, tensors: int, rounds: int) -> list[tuple[str, float]]:
    grads = make_grads(elements, tensors)
    originals = [g.clone() for g in grads]
    state = famp.init_scaler(1024.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    params = [torch.nn.Parameter(torch.empty_like(g)) for g in grads]
    opt = torch.optim.SGD(params, lr=0.1)
    scaler.scale(torch.ones(()))

    def restore() -> None:  # untimed: in-place candidates must not shrink the values forever
        torch._foreach_copy_(grads, originals)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        scaler._per_optimizer_states.clear()  # lets unscale_ run again without an update()

    def gradscaler_unscale() -> None:
        scaler.unscale_(opt)
        scaler._found_inf_per_device(opt)[torch.device("cpu")].item()

    def famp_unscale() -> None:
        famp.unscale_and_check(state, grads)[1].item()

    famp_unscale()  # eagerly, famp compiles its one-pass program on a first big call: untimed

    compiled = torch.compile(famp.unscale_and_check, fullgraph=True)
    compiled(state, grads)  # compile outside the timing

    def famp_compiled() -> None:
        compiled(state, grads)[1].item()

    def famp_donate() -> None:
        famp.unscale_and_check(state, grads, donate=True)[1].item()

    t = median_times(
        {
            "clone": lambda: [g.clone() for g in grads],
            "gradscaler": gradscaler_unscale,
            "famp": famp_unscale,
            "famp_donate": famp_donate,
            "famp_compiled": famp_compiled,
        },
        rounds,
        before=restore,
    )
    print("  medians (ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in t.items()))
    return [
        ("unscale_and_check ÷ clone of the grads", t["famp"] / t["clone"]),
        ("unscale_and_check ÷ GradScaler.unscale_", t["famp"] / t["gradscaler"]),
        ("unscale_and_check, compiled ÷ clone of the grads", t["famp_compiled"] / t["clone"]),
        (
            "unscale_and_check(donate=True) ÷ GradScaler.unscale_",
            t["famp_donate"] / t["gradscaler"],
        ),
    ]


def bench_value_and_grad(elements: int, tensors: int, rounds: int) -> list[tuple[str, float]]:
    """A training step's gradients, scaled and unscaled: `famp.value_and_grad` eagerly against
    `GradScaler` around `backward()`. The model is a chain of `tensors` square float32 matrices
    of about `elements` in all (each followed by a tanh; a batch of 8 rows)."""
    side = round((elements / tensors) ** 0.5)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(side, side, generator=gen) / side**0.5 for _ in range(tensors)]
    x = torch.randn(8, side, generator=gen)

    def loss_fn(ws: list[torch.Tensor]) -> torch.Tensor:
        h = x
        for w in ws:
            h = torch.tanh(h @ w)
        return h.square().mean()

    params = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    value_and_grad = famp.value_and_grad(loss_fn)
    box = [famp.init_scaler(1024.0)]

    def gradscaler_step() -> None:  # backward, unscale_ and update; the grads freed at the end
        scaler.scale(loss_fn(params)).backward()
        scaler.unscale_(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    def famp_step() -> None:  # the same: scaled loss, unscaled grads, next state
        _, _, _, box[0] = value_and_grad(box[0], weights)

    def autograd_step() -> None:  # no loss scaling at all
        torch.autograd.grad(loss_fn(params), params)

    famp_step()  # untimed: the first call of a step
    t = median_times(
        {"gradscaler": gradscaler_step, "famp": famp_step, "autograd": autograd_step}, rounds
    )
    print("  medians (ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in t.items()))
    return [
        (
            "value_and_grad ÷ backward + GradScaler.unscale_ + update",
            t["famp"] / t["gradscaler"],
        ),
        ("value_and_grad ÷ torch.autograd.grad without loss scaling", t["famp"] / t["autograd"]),
    ]


def bench_small(rounds: int) -> list[tuple[str, float]]:
    """Unscaling the 14 small grads of `nn.TransformerEncoderLayer(64, 4, 256)` and a head."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.TransformerEncoderLayer(64, 4, 256, batch_first=True), torch.nn.Linear(64, 128)
    )
    names = [name for name, _ in model.named_parameters()]
    originals = [torch.randn_like(p) * 1024 for p in model.parameters()]
    for p, g in zip(model.parameters(), originals, strict=True):
        p.grad = g.clone()
    grads = {name: p.grad for name, p in zip(names, model.parameters(), strict=True)}
    state = famp.init_scaler(1024.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(torch.ones(()))

    def restore() -> None:  # untimed: in-place candidates must not shrink the values forever
        torch._foreach_copy_(list(grads.values()), originals)
        scaler._per_optimizer_states.clear()  # lets unscale_ run again without an update()

    t = median_times(
        {
            "gradscaler": lambda: scaler.unscale_(opt),
            "famp": lambda: famp.unscale_and_check(state, grads),
            "famp_donate": lambda: famp.unscale_and_check(state, grads, donate=True),
        },
        rounds * 20,  # one call is tens of microseconds: more rounds for a stable median
        before=restore,
    )
    print("  medians (µs per call): " + ", ".join(f"{k} {v * 1e6:.1f}" for k, v in t.items()))
    return [
        (
            "unscale_and_check(donate=True) ÷ GradScaler.unscale_, 14 small grads",
            t["famp_donate"] / t["gradscaler"],
        ),
        (
            "unscale_and_check ÷ GradScaler.unscale_ (in place), 14 small grads",
            t["famp"] / t["gradscaler"],
        ),
    ]


def bench_all_finite(elements: int, tensors: int, rounds: int) -> list[tuple[str, float]]:
    grads = make_grads(elements, tensors)
    t = median_times(
        {
            "torch": lambda: torch.stack([torch.isfinite(g).all() for g in grads]).all().item(),
            "famp": lambda: famp.all_finite(grads).item(),
        },
        rounds,
    )
    print("  medians (ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in t.items()))
    return [("all_finite ÷ torch.isfinite(g).all() of each grad", t["famp"] / t["torch"])]


def bench_update(rounds: int) -> list[tuple[str, float]]:
    found = torch.zeros(())
    state = famp.init_scaler(1024.0, growth_interval=10**9)
    donated = famp.init_scaler(1024.0, growth_interval=10**9)  # updated in place, as GradScaler's
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=10**9)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.empty(0))], lr=0.1)
    scaler.scale(torch.ones(()))
    compiled = torch.compile(famp.update_scale, fullgraph=True)
    compiled(state, found)  # compile outside the timing
    # torch.compile's own cost per call, for reference: a compiled function of one tiny op.
    one_op = torch.compile(lambda x: x + 1, fullgraph=True)
    one_op(found)

    def gradscaler_update() -> None:
        # What unscale_ records for one optimizer; update() consumes and resets it.
        scaler._per_optimizer_states[id(opt)]["found_inf_per_device"] = {found.device: found}
        scaler.update()

    calls = 200

    def repeat(fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(calls):
                fn()

        return run

    t = median_times(
        {
            "gradscaler": repeat(gradscaler_update),
            "famp_eager": repeat(lambda: famp.update_scale(state, found)),
            "famp_donated": repeat(lambda: famp.update_scale(donated, found, donate=True)),
            "famp_compiled": repeat(lambda: compiled(state, found)),
            "compiled_one_op": repeat(lambda: one_op(found)),
        },
        rounds,
    )
    print(
        "  medians (µs per update): "
        + ", ".join(f"{k} {v / calls * 1e6:.1f}" for k, v in t.items())
    )
    return [
        ("update_scale (eager) ÷ GradScaler.update", t["famp_eager"] / t["gradscaler"]),
        (
            "update_scale(donate=True) (eager) ÷ GradScaler.update",
            t["famp_donated"] / t["gradscaler"],
        ),
        ("update_scale (compiled) ÷ GradScaler.update", t["famp_compiled"] / t["gradscaler"]),
        (
            "update_scale (compiled) ÷ a compiled one-op function",
            t["famp_compiled"] / t["compiled_one_op"],
        ),
    ]


def gradient_args(description: str) -> argparse.Namespace:
    """The command line of the gradient benchmarks (sizes, rounds), printed with the machine."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--elements", type=int, default=75_000_000)
    parser.add_argument("--tensors", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.processor() or platform.machine()}, {args.elements:,} float32 elements in "
        f"{args.tensors} tensors, {args.rounds} interleaved rounds"
    )
    return args


def main() -> None:
    args = gradient_args(__doc__.splitlines()[0])
    rows = []
    for mode, setup in (("fresh pages", fresh_pages), ("reused memory", reused_memory)):
        print(f"unscale, {mode}:")
        setup()
        rows += [
            (f"{name}, {mode}", ratio)
            for name, ratio in bench_unscale(args.elements, args.tensors, args.rounds)
        ]
        print(f"value_and_grad, {mode}:")
        rows += [
            (f"{name}, {mode}", ratio)
            for name, ratio in bench_value_and_grad(args.elements, args.tensors, args.rounds)
        ]
    print("all_finite:")
    rows += bench_all_finite(args.elements, args.tensors, args.rounds)
    print("unscale, small grads:")
    rows += bench_small(args.rounds)
    print("update:")
    rows += bench_update(args.rounds)
    print()
    print("| famp ÷ torch | ratio |")
    print("|---|---|")
    for name, ratio in rows:
        print(f"| {name} | {ratio:.2f}× |")


if __name__ == "__main__":
    main()
