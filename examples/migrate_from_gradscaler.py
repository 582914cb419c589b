"""Move a ``torch.amp.GradScaler`` training loop to famp, and carry its checkpoint over.

    python examples/migrate_from_gradscaler.py

The two loops below do the same thing. The torch one keeps AMP in mutable objects
(``torch.autocast`` as a context, a ``GradScaler`` that ``step``s and ``update``s itself); the famp
one passes an immutable ``famp.ScalerState`` along and hands ``found_inf`` to the fused optimizer,
so a skipped step needs no ``.item()`` and the loop *knows* which steps were skipped
(``GradScaler.step`` cannot say, pytorch/pytorch#55585). The script trains with the torch loop,
saves a checkpoint, resumes it with both loops and checks that they stay equal bit for bit: the
GradScaler's ``state_dict()`` loads into famp with ``famp.from_state_dict``, and
``famp.to_state_dict`` loads back into a ``GradScaler``.
"""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Callable, Iterator

import torch
from torch.nn import functional

import famp

Batch = tuple[torch.Tensor, torch.Tensor]


def torch_loop(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    batches: Iterator[Batch],
) -> None:
    """The GradScaler recipe from PyTorch's AMP docs."""
    for x, y in batches:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # was the step skipped? only the scale, read later, can tell
        scaler.update()


def famp_loop(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: famp.ScalerState,
    batches: Iterator[Batch],
) -> tuple[famp.ScalerState, list[torch.Tensor]]:
    """The same loop with famp: the scaler state is a value passed along, nothing is mutated."""
    forward = famp.autocast(
        model, famp.get_policy("params=float32,compute=bfloat16,output=float32")
    )
    skipped = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = functional.cross_entropy(forward(x), y)
        famp.scale(state, loss).backward()
        found_inf = famp.optimizer_step(optimizer, state)  # the fused kernel unscales and skips
        state = famp.update_scale(state, found_inf)
        skipped.append(found_inf)  # a tensor: no host sync until someone reads it
    return state, skipped


def make_batches(start: int, stop: int, overflow_at: frozenset[int]) -> Iterator[Batch]:
    """Synthetic classification batches; the steps in ``overflow_at`` get a non-finite input."""
    for step in range(start, stop):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(32, 20, generator=gen)
        y = (x[:, :4].argmax(dim=1) + (x[:, 4] > 0)) % 4
        if step in overflow_at:
            x[0, 0] = float("inf")
        yield x, y


def build(
    make_optimizer: Callable[..., torch.optim.Optimizer],
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    return model, make_optimizer(model.parameters())


def main(argv: list[str] | None = None) -> bool:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=60, help="steps before and after the checkpoint"
    )
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/migrate"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    n = args.steps
    overflow_at = frozenset({3, n + 2, n + n // 2})

    def adamw(params: Iterator[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=1e-2, fused=True)  # fused: it unscales and skips

    # 1. An existing torch run, checkpointed the usual way.
    model, optimizer = build(adamw)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=10)
    torch_loop(model, optimizer, scaler, make_batches(0, n, overflow_at))
    path = args.out / "torch_checkpoint.pt"
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(),
        },
        path,
    )

    # 2. Resume it with both loops, each from its own load of the file (optimizers loaded from one
    # dict would share their state tensors: load_state_dict does not copy them).
    checkpoint = torch.load(path, weights_only=True)
    torch_model, torch_optimizer = build(adamw)
    torch_model.load_state_dict(checkpoint["model"])
    torch_optimizer.load_state_dict(checkpoint["optimizer"])
    torch_scaler = torch.amp.GradScaler("cpu")
    torch_scaler.load_state_dict(checkpoint["scaler"])
    torch_loop(torch_model, torch_optimizer, torch_scaler, make_batches(n, 2 * n, overflow_at))

    checkpoint = torch.load(path, weights_only=True)
    famp_model, famp_optimizer = build(adamw)
    famp_model.load_state_dict(checkpoint["model"])
    famp_optimizer.load_state_dict(checkpoint["optimizer"])
    state = famp.from_state_dict(checkpoint["scaler"])  # GradScaler's dict, as saved
    state, skipped = famp_loop(
        famp_model, famp_optimizer, state, make_batches(n, 2 * n, overflow_at)
    )

    # 3. Compare, and hand the famp state back to a GradScaler.
    same_params = all(
        torch.equal(a, b)
        for a, b in zip(torch_model.parameters(), famp_model.parameters(), strict=True)
    )
    same_scaler = famp.to_state_dict(state) == torch_scaler.state_dict()
    back = torch.amp.GradScaler("cpu")
    back.load_state_dict(famp.to_state_dict(state))
    skipped_steps = [n + i for i, f in enumerate(torch.stack(skipped).tolist()) if f]
    print(f"famp skipped steps {skipped_steps} (overflows injected at {sorted(overflow_at)})")
    print(f"parameters equal bit for bit: {same_params}; scaler state equal: {same_scaler}")
    print(
        f"GradScaler from famp.to_state_dict: scale {back.get_scale():g}, state {back.state_dict()}"
    )
    return same_params and same_scaler and skipped_steps == sorted(overflow_at - {3})


if __name__ == "__main__":
    raise SystemExit(0 if main() else 1)
