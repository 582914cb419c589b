"""Training-step benchmark: a full AMP step, famp ÷ torch, side by side in one run (not a test).

Two models on CPU with bfloat16 autocast and dynamic loss scaling: the digits CNN of
examples/train_digits.py (batch 64 of 8×8 images) and a small transformer block
(``nn.TransformerEncoderLayer(64, 4, 256)`` and a 128-way head, batch 4 × 16 tokens). With
``--device cuda``, float16 autocast on the GPU, and the transformer block twice: that small one
(launch-bound: it measures the host's work per step) and a wide one
(``nn.TransformerEncoderLayer(1024, 16, 4096)``, a 4096-way head, batch 8 × 256 tokens). Each
candidate does everything a training step does: forward under autocast, scaled backward, unscale
and check, scale update, AdamW update that is skipped on overflow.

- torch eager: ``torch.autocast`` + ``GradScaler`` (scale, step, update) + ``AdamW(fused=True)``.
- famp eager: ``famp.autocast`` (uncompiled) + ``famp.scale`` + ``backward`` +
  ``famp.optimizer_step`` (the same fused AdamW) + ``famp.update_scale``; and the same with
  ``torch.autocast``, which isolates the scaler and the optimizer bridge from the autocast
  transform.
- famp functional eager: ``famp.value_and_grad`` + a pure AdamW + ``famp.skip_on_overflow``; the
  AdamW op by op per parameter, again as one out-of-place ``torch._foreach_*`` op per line, and
  again as one call of torch's fused AdamW kernel in its out-of-place form
  (``torch.ops.aten._fused_adamw``, the kernel of the eager step's ``AdamW(fused=True)``).
- torch functional eager (the floor of the functional rows): the same step written with torch
  alone, ``torch.autocast`` + ``functional_call`` (its logits cast to float32, as the famp
  policy's output is) + ``torch.autograd.grad`` of the scaled loss, GradScaler's two kernels by
  hand (unscale in place, update in place), the same pure AdamW (foreach, then fused), and
  GradScaler's host-read skip; what a functional step costs before famp does anything.
- torch compiled: the model under ``torch.compile`` (inductor), the GradScaler loop around it
  eagerly (torch.amp cannot be traced: Dynamo skips it).
- famp compiled: the whole functional step under ``torch.compile(fullgraph=True)`` (inductor).

Candidates run interleaved, round after round; each figure is the best round (the machine is
shared, and other jobs only ever add time). On CUDA each round ends with a synchronize.

Run: python benchmarks/bench_step.py [--rounds 30] [--steps 5] [--threads 1] [--device cuda]
(about 2 minutes)
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable
from typing import Any

import optree
import torch
from torch.func import functional_call
from torch.nn import functional

import famp

# The autocast dtype of each device: bfloat16 on CPU (what CPU autocast is for), float16 on CUDA
# (where dynamic loss scaling is for).
COMPUTE = {"cpu": torch.bfloat16, "cuda": torch.float16}


def digits_cnn() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 2 * 2, 10),
    )
    return model, torch.rand(64, 1, 8, 8), torch.randint(0, 10, (64,))


class Block(torch.nn.Module):
    def __init__(self, width: int = 64, heads: int = 4, vocab: int = 128) -> None:
        super().__init__()
        self.layer = torch.nn.TransformerEncoderLayer(
            width, heads, 4 * width, dropout=0.0, batch_first=True
        )
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x)).flatten(0, 1)


def transformer_block() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    return Block(), torch.randn(4, 16, 64), torch.randint(0, 128, (4 * 16,))


def wide_transformer_block() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    return Block(1024, 16, 4096), torch.randn(8, 256, 1024), torch.randint(0, 4096, (8 * 256,))


def adamw(
    params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], opt: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    lr, b1, b2, eps, wd = 1e-3, 0.9, 0.999, 1e-8, 1e-2
    count = opt["count"] + 1
    mu = optree.tree_map(lambda m, g: b1 * m + (1 - b1) * g, opt["mu"], grads)
    nu = optree.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, opt["nu"], grads)
    c1, c2 = 1 - b1**count, 1 - b2**count
    new = optree.tree_map(
        lambda p, m, v: p * (1 - lr * wd) - lr * (m / c1) / ((v / c2).sqrt() + eps),
        params,
        mu,
        nu,
    )
    return new, {"count": count, "mu": mu, "nu": nu}


def adamw_foreach(
    params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], opt: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The same pure AdamW as `adamw`, each line one multi-tensor op over all parameters.

    torch's out-of-place `_foreach_*` ops (what `torch.optim`'s `foreach=True` path uses, in
    place): a functional step written for eager speed, as optax's updates are one op per tree.
    """
    lr, b1, b2, eps, wd = 1e-3, 0.9, 0.999, 1e-8, 1e-2
    keys = list(params)
    p, g = [params[k] for k in keys], [grads[k] for k in keys]
    count = opt["count"] + 1
    mu = torch._foreach_add(torch._foreach_mul(opt["mu"], b1), torch._foreach_mul(g, 1 - b1))
    nu = torch._foreach_add(
        torch._foreach_mul(opt["nu"], b2), torch._foreach_mul(torch._foreach_mul(g, g), 1 - b2)
    )
    c1, c2 = 1 - b1**count, 1 - b2**count
    denom = torch._foreach_add(torch._foreach_sqrt(torch._foreach_div(nu, c2)), eps)
    step = torch._foreach_mul(torch._foreach_div(torch._foreach_div(mu, c1), denom), lr)
    new = torch._foreach_sub(torch._foreach_mul(p, 1 - lr * wd), step)
    return dict(zip(keys, new, strict=True)), {"count": count, "mu": list(mu), "nu": list(nu)}


def adamw_fused(
    params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], opt: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """AdamW as one call of torch's fused kernel, out of place: a pure function of its inputs.

    ``torch.ops.aten._fused_adamw`` is the functional form of the kernel that
    ``AdamW(fused=True)`` runs in place (the eager step's): it returns new parameters and
    moments and leaves its inputs alone. The fastest pure AdamW update torch offers eagerly.
    """
    keys = list(params)
    count = opt["count"] + 1
    new, _, mu, nu, _ = torch.ops.aten._fused_adamw.default(
        [params[k] for k in keys],
        [grads[k] for k in keys],
        opt["mu"],
        opt["nu"],
        [],
        [count] * len(keys),
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        weight_decay=1e-2,
        eps=1e-8,
        amsgrad=False,
        maximize=False,
    )
    return dict(zip(keys, new, strict=True)), {"count": count, "mu": list(mu), "nu": list(nu)}


UPDATES = {"op by op": adamw, "foreach": adamw_foreach, "fused": adamw_fused}
# The candidate of each pure update (`candidates`); the op-by-op one has no torch floor.
FAMP_FUNCTIONAL = {
    "op by op": "famp functional eager",
    "foreach": "famp functional eager, foreach",
    "fused": "famp functional eager, fused",
}


def candidates(
    build: Callable[[], tuple[torch.nn.Module, torch.Tensor, torch.Tensor]],
    steps: int,
    device: str = "cpu",
) -> dict[str, Callable[[], object]]:
    """Each candidate runs ``steps`` training steps on its own copy of the model."""
    out: dict[str, Callable[[], object]] = {}
    compute = COMPUTE[device]
    policy = famp.Policy(torch.float32, compute, torch.float32)

    def built() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        model, x, y = build()
        return model.to(device), x.to(device), y.to(device)

    def torch_loop(compiled: bool) -> Callable[[], object]:
        model, x, y = built()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        scaler = torch.amp.GradScaler(device)
        run = torch.compile(model) if compiled else model

        def loop() -> object:
            for _ in range(steps):
                opt.zero_grad(set_to_none=True)
                with torch.autocast(device, dtype=compute):
                    loss = functional.cross_entropy(run(x), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            return loss

        return loop

    def famp_loop(torch_autocast: bool = False) -> Callable[[], object]:
        model, x, y = built()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        forward = famp.autocast(model, policy, compile=False)
        box = [famp.init_scaler(device=device)]

        def loop() -> object:
            state = box[0]
            for _ in range(steps):
                opt.zero_grad(set_to_none=True)
                if torch_autocast:  # isolates the scaler and the optimizer bridge
                    with torch.autocast(device, dtype=compute):
                        loss = functional.cross_entropy(model(x), y)
                else:
                    loss = functional.cross_entropy(forward(x), y)
                famp.scale(state, loss).backward()
                state = famp.update_scale(state, famp.optimizer_step(opt, state))
            box[0] = state
            return loss

        return loop

    def functional_loop(compiled: bool, update: str = "op by op") -> Callable[[], object]:
        model, x, y = built()
        forward = famp.autocast(lambda p, x: functional_call(model, p, (x,)), policy, compile=False)

        def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return functional.cross_entropy(forward(p, x), y)

        grad_fn = famp.value_and_grad(loss_fn)

        def step(params: Any, opt: Any, state: famp.ScalerState, x: Any, y: Any) -> Any:
            loss, grads, found_inf, state = grad_fn(state, params, x, y)
            new = UPDATES[update](params, grads, opt)
            params, opt = famp.skip_on_overflow(found_inf, new, (params, opt))
            return params, opt, state, loss

        run = torch.compile(step, fullgraph=True) if compiled else step
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
        zeros = optree.tree_map(torch.zeros_like, params)
        if update != "op by op":  # the moments as lists, in the parameters' order
            zeros = list(zeros.values())
        count = torch.zeros((), device=device)
        box = [
            (params, {"count": count, "mu": zeros, "nu": zeros}, famp.init_scaler(device=device))
        ]

        def loop() -> object:
            params, opt, state = box[0]
            for _ in range(steps):
                params, opt, state, loss = run(params, opt, state, x, y)
            box[0] = (params, opt, state)
            return loss

        return loop

    def torch_functional_loop(update: str = "foreach") -> Callable[[], object]:
        model, x, y = built()
        keys = [k for k, _ in model.named_parameters()]
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
        zeros = [torch.zeros_like(p) for p in params.values()]
        scale = torch.full((), 2.0**16, device=device)
        tracker = torch.zeros((), dtype=torch.int32, device=device)
        box = [(params, {"count": torch.zeros((), device=device), "mu": zeros, "nu": zeros})]

        def loop() -> object:
            params, opt = box[0]
            for _ in range(steps):
                leaves = [params[k].detach().requires_grad_() for k in keys]
                with torch.autocast(device, dtype=compute):
                    out = functional_call(model, dict(zip(keys, leaves, strict=True)), (x,))
                loss = functional.cross_entropy(out.float(), y)  # the policy's float32 output
                grads = list(torch.autograd.grad(loss * scale, leaves))
                found = torch.zeros((), device=device)
                inv = scale.double().reciprocal().float()
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
                if found.item() == 0:  # GradScaler.step's host read
                    params, opt = UPDATES[update](params, dict(zip(keys, grads, strict=True)), opt)
                torch._amp_update_scale_(scale, tracker, found, 2.0, 0.5, 2000)
            box[0] = (params, opt)
            return loss

        return loop

    out["torch eager"] = torch_loop(compiled=False)
    out["torch functional eager, foreach"] = torch_functional_loop()
    out["torch functional eager, fused"] = torch_functional_loop("fused")
    out["famp eager (optimizer_step)"] = famp_loop()
    out["famp scaler, torch.autocast"] = famp_loop(torch_autocast=True)
    out["famp functional eager"] = functional_loop(compiled=False)
    out["famp functional eager, foreach"] = functional_loop(compiled=False, update="foreach")
    out["famp functional eager, fused"] = functional_loop(compiled=False, update="fused")
    out["torch compiled + GradScaler"] = torch_loop(compiled=True)
    out["famp compiled fullgraph"] = functional_loop(compiled=True)
    return out


def best_times(
    fns: dict[str, Callable[[], object]], rounds: int, device: str = "cpu"
) -> dict[str, float]:
    """Run every candidate once per round, interleaved; the best round of each.

    The machine is shared: other jobs only ever add time, so the minimum is the stable figure.
    On CUDA a round is timed up to a synchronize: the GPU's work, not only its launch.
    """
    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    return {name: min(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=5, help="training steps per timed round")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU: torch.cuda.is_available() is False")
    torch.set_num_threads(args.threads)
    where = platform.processor() or platform.machine()
    if args.device == "cuda":
        where = f"{where}, {torch.cuda.get_device_name()}"
    print(
        f"torch {torch.__version__}, {where}, {args.threads} thread(s), "
        f"{args.rounds} rounds of {args.steps} steps, {COMPUTE[args.device]} autocast"
    )
    models = [("digits CNN", digits_cnn), ("transformer block", transformer_block)]
    if args.device == "cuda":
        models = [("transformer block", transformer_block), ("wide block", wide_transformer_block)]
    rows = []
    for name, build in models:
        # Each model compiles its own static graphs: the candidates' step functions share code
        # objects across models, and a second model of the same ranks would otherwise recompile
        # them with dynamic shapes (Dynamo's automatic dynamic).
        torch.compiler.reset()
        fns = candidates(build, args.steps, args.device)
        began = time.perf_counter()
        for fn in fns.values():  # warm up and compile (twice: the scaler state becomes a tensor)
            fn()
            fn()
        warm = time.perf_counter() - began
        t = best_times(fns, args.rounds, args.device)
        per_step = {k: v / args.steps * 1e3 for k, v in t.items()}
        print(f"\n{name} (warm-up and compilation {warm:.0f} s), ms per step:")
        for k, v in per_step.items():
            print(f"  {k:32s} {v:8.2f}")
        eager = [
            per_step["famp eager (optimizer_step)"] / per_step["torch eager"],
            per_step["famp scaler, torch.autocast"] / per_step["torch eager"],
            per_step["famp compiled fullgraph"] / per_step["torch compiled + GradScaler"],
        ]
        functional = []
        for update in UPDATES:
            famp_row = per_step[FAMP_FUNCTIONAL[update]]
            floor = per_step.get(f"torch functional eager, {update}")
            functional.append((update, famp_row / per_step["torch eager"], floor, famp_row))
        rows.append((name, eager, functional, per_step["torch eager"]))
    print(
        "\n| model | famp eager ÷ torch eager | famp scaler with torch.autocast ÷ torch eager "
        "| famp compiled fullgraph ÷ torch compiled + GradScaler |"
    )
    print("|---|---|---|---|")
    for name, eager, _, _ in rows:
        print(f"| {name} | " + " | ".join(f"{r:.2f}" for r in eager) + " |")
    print(
        "\nFunctional eager steps (famp.value_and_grad + a pure AdamW + famp.skip_on_overflow); "
        "the floor is the same step with torch alone:"
    )
    print(
        "\n| model | pure AdamW | famp functional ÷ torch eager "
        "| floor: torch functional ÷ torch eager | famp functional ÷ floor |"
    )
    print("|---|---|---|---|---|")
    for name, _, functional, torch_eager in rows:
        for update, ratio, floor, famp_row in functional:
            floor_cells = (
                f"{floor / torch_eager:.2f} | {famp_row / floor:.2f}" if floor else "– | –"
            )
            print(f"| {name} | {update} | {ratio:.2f} | {floor_cells} |")


if __name__ == "__main__":
    main()
