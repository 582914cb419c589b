"""Train a small CNN on scikit-learn's digits with a functional famp step.

    pip install -e ".[examples]" && python examples/train_digits.py

Every piece of mixed precision here is a pure function. ``famp.autocast`` runs the forward pass in
float16, whose narrow range needs dynamic loss scaling (on CPU, where float16 convolutions are
far slower than bfloat16 ones, a module rule runs the two convolutions in bfloat16);
``famp.value_and_grad`` scales the loss, differentiates, unscales and checks the gradients and
updates the loss scale; ``famp.skip_on_overflow`` drops an update that overflowed, without a host
sync. Parameters, optimizer state and scaler state are plain dicts of tensors and numbers, saved
every ``--checkpoint-every`` steps (``torch.load(weights_only=True)`` reads them); ``--resume``
continues a run bit for bit. At the end the script prints the test accuracy and plots the loss and
the loss scale of every step: it grows, overflows and backs off. It trains in 20-30 seconds on
two CPU cores.
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.func import functional_call
from torch.nn import functional

import famp

Tree = dict[str, torch.Tensor]


def build_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 2 * 2, 10),
    )


def load_data(device: torch.device) -> tuple[torch.Tensor, ...]:
    """The 1797 8×8 digits shipped with scikit-learn (no download): 1500 to train, 297 to test."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    train, test = order[:1500], order[1500:]
    return tuple(t.to(device) for t in (images[train], labels[train], images[test], labels[test]))


def batch_indices(step: int, n: int, batch_size: int, seed: int) -> torch.Tensor:
    """The examples of ``step``, a function of the step alone: a resumed run sees the same data."""
    per_epoch = n // batch_size
    epoch, i = divmod(step, per_epoch)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 10_000 + epoch))
    return order[i * batch_size : (i + 1) * batch_size]


def adamw(
    params: Tree, grads: Tree, opt_state: dict[str, Any], lr: float, weight_decay: float = 1e-4
) -> tuple[Tree, dict[str, Any]]:
    """A pure AdamW: new parameters and a new state, nothing mutated."""
    b1, b2, eps = 0.9, 0.999, 1e-8
    count = opt_state["count"] + 1
    mu = {k: b1 * opt_state["mu"][k] + (1 - b1) * g for k, g in grads.items()}
    nu = {k: b2 * opt_state["nu"][k] + (1 - b2) * g * g for k, g in grads.items()}
    c1, c2 = 1 - b1**count, 1 - b2**count
    new = {
        k: p * (1 - lr * weight_decay) - lr * (mu[k] / c1) / ((nu[k] / c2).sqrt() + eps)
        for k, p in params.items()
    }
    return new, {"count": count, "mu": mu, "nu": nu}


def module_rules_for(precision: str, device: torch.device) -> dict[str, str] | None:
    """float16 on CPU: the convolutions (modules "0" and "3") in bfloat16, far faster there."""
    if precision == "fp16" and device.type == "cpu":
        bf16 = "params=float32,compute=bfloat16,output=bfloat16"
        return {"0": bf16, "3": bf16}
    return None


def make_train_step(
    model: torch.nn.Module,
    policy: famp.Policy,
    device: torch.device,
    lr: float,
    module_rules: dict[str, str] | None = None,
) -> tuple[Callable[..., tuple[Any, ...]], Callable[..., torch.Tensor]]:
    """The functional AMP step: (params, opt_state, scaler, x, y) -> new ones, loss, found_inf."""
    forward = famp.autocast(
        functools.partial(functional_call, model),
        policy,
        device_type=device.type,
        module_rules=module_rules,
    )

    def loss_fn(params: Tree, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = forward(params, (x,))
        return functional.cross_entropy(logits, y)

    grad_fn = famp.value_and_grad(loss_fn)

    def train_step(
        params: Tree,
        opt_state: dict[str, Any],
        scaler: famp.ScalerState,
        x: torch.Tensor,
        y: torch.Tensor,
    ) -> tuple[Any, ...]:
        loss, grads, found_inf, scaler = grad_fn(scaler, params, x, y)
        new_params, new_opt_state = adamw(params, grads, opt_state, lr)
        params, opt_state = famp.skip_on_overflow(
            found_inf, (new_params, new_opt_state), (params, opt_state)
        )
        return params, opt_state, scaler, loss, found_inf

    return train_step, forward


def save_checkpoint(path: pathlib.Path, checkpoint: dict[str, Any]) -> None:
    """Write atomically: a crash mid-save leaves the previous checkpoint intact."""
    tmp = path.with_suffix(".tmp")
    torch.save(checkpoint, tmp)
    os.replace(tmp, path)


def plot(path: pathlib.Path, history: dict[str, torch.Tensor], scaling: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = torch.arange(len(history["loss"]))
    skipped = history["found_inf"] != 0
    fig, (ax_loss, ax_scale) = plt.subplots(2, 1, sharex=True, figsize=(7, 5))
    ax_loss.plot(steps, history["loss"].float(), lw=0.8)
    ax_loss.set_yscale("log")
    ax_loss.set_ylabel("training loss")
    ax_scale.step(steps, history["scale"], where="post", lw=1.0)
    if skipped.any():
        ax_scale.plot(steps[skipped], history["scale"][skipped], "rx", label="skipped step")
        ax_scale.legend()
    ax_scale.set_yscale("log", base=2)
    ax_scale.set_ylabel("loss scale" if scaling else "loss scale (off)")
    ax_scale.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600, help="total training steps")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--precision",
        choices=["auto", "bf16", "fp16", "fp32"],
        default="auto",
        help="compute dtype; auto: fp16, with dynamic loss scaling (on CPU the convolutions run "
        "in bf16)",
    )
    parser.add_argument(
        "--loss-scaling",
        choices=["auto", "dynamic", "off"],
        default="auto",
        help="auto: dynamic for fp16 only (bf16 has float32's range and needs none)",
    )
    parser.add_argument("--init-scale", type=float, default=2.0**16, help="first loss scale")
    parser.add_argument(
        "--growth-interval", type=int, default=50, help="loss-scale growth interval"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/digits"))
    parser.add_argument("--checkpoint-every", type=int, default=200)
    parser.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="CPU threads; this model is too small to gain from more, and loses a lot when the "
        "cores are busy with anything else",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--explain",
        action="store_true",
        help="print famp.explain's table of the first block's ops (dtype, rule) before training",
    )
    parser.add_argument(
        "--report",
        action="store_true",
        help="after each overflow, print famp.nonfinite_report's summary of the gradients "
        "(reading found_inf is a host sync each step: debugging only)",
    )
    return parser.parse_args(argv)


# --- debugging mixed precision: --explain and --report ------------------------------------------


def explain_first_block(model: torch.nn.Module, policy: famp.Policy, x: torch.Tensor) -> None:
    """Print every aten op of one forward pass in the first block, with its rule and dtypes."""
    _, trace = famp.explain(model, policy, device_type=x.device.type)(x)
    print(trace.table(module="0"))
    print(trace.summary())


def report_overflow(model: torch.nn.Module, policy: famp.Policy, step: int, *args: Any) -> None:
    """Recompute one step's gradients and print which of them overflowed, and by how much."""
    params, scaler, x, y = args
    forward = famp.autocast(
        functools.partial(functional_call, model), policy, device_type=x.device.type
    )
    grad_fn = famp.value_and_grad(lambda p: functional.cross_entropy(forward(p, (x,)), y))
    _, grads, _, _ = grad_fn(scaler, params)
    print(f"step {step}: overflow at loss scale {scaler.scale.item():g}")
    print(famp.nonfinite_report(grads).summary(limit=4))


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return train(args)
    finally:
        torch.set_num_threads(threads)


def train(args: argparse.Namespace) -> float:
    device = torch.device(args.device)
    precision = args.precision
    if precision == "auto":
        precision = "fp16"
    compute = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[precision]
    policy = famp.get_policy(f"params=float32,compute={compute},output=float32")
    # float16 needs loss scaling (its range is narrow); bfloat16 has float32's range and does not.
    scaling = args.loss_scaling == "dynamic" or (
        args.loss_scaling == "auto" and precision == "fp16"
    )
    config = {
        "batch_size": args.batch_size,
        "lr": args.lr,
        "seed": args.seed,
        "precision": precision,
        "loss_scaling": scaling,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    ckpt_path = args.out / "checkpoint.pt"

    x_train, y_train, x_test, y_test = load_data(device)
    torch.manual_seed(args.seed)
    model = build_model().to(device)
    module_rules = module_rules_for(precision, device)
    train_step, forward = make_train_step(model, policy, device, args.lr, module_rules)

    if args.resume:
        checkpoint = torch.load(ckpt_path, map_location=device, weights_only=True)
        if checkpoint["config"] != config:
            raise SystemExit(
                f"--resume: {ckpt_path} was trained with {checkpoint['config']}, not {config}"
            )
        start, params, opt_state = checkpoint["step"], checkpoint["params"], checkpoint["opt_state"]
        scaler = famp.from_state_dict(checkpoint["scaler"], device=device)
        history = {k: list(v.unbind()) for k, v in checkpoint["history"].items()}
    else:
        start = 0
        params = {k: v.detach() for k, v in model.named_parameters()}
        opt_state = {
            "count": torch.zeros((), device=device),
            "mu": {k: torch.zeros_like(v) for k, v in params.items()},
            "nu": {k: torch.zeros_like(v) for k, v in params.items()},
        }
        scaler = (
            famp.init_scaler(args.init_scale, growth_interval=args.growth_interval, device=device)
            if scaling
            else famp.init_scaler(1.0, enabled=False, device=device)  # an identity everywhere
        )
        history = {"loss": [], "scale": [], "found_inf": []}

    def checkpoint_at(step: int) -> dict[str, Any]:
        return {
            "step": step,
            "config": config,
            "params": params,
            "opt_state": opt_state,
            "scaler": famp.to_state_dict(scaler),
            "history": {k: torch.stack(v) if v else torch.zeros(0) for k, v in history.items()},
        }

    from tqdm import tqdm

    if args.explain:
        explain_first_block(model, policy, x_train[:2])
    began = time.perf_counter()
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, disable=args.no_progress)
    for step in bar:
        index = batch_indices(step, len(y_train), args.batch_size, args.seed).to(device)
        used_scale = scaler.scale
        prev_params, used_scaler = params, scaler  # for --report
        params, opt_state, scaler, loss, found_inf = train_step(
            params, opt_state, scaler, x_train[index], y_train[index]
        )
        history["loss"].append(loss.detach().float())
        history["scale"].append(used_scale)
        history["found_inf"].append(found_inf)
        if args.report and found_inf.item():  # a host sync, only with --report
            report_overflow(
                model, policy, step, prev_params, used_scaler, x_train[index], y_train[index]
            )
        if (step + 1) % 25 == 0:  # reading the loss is a host sync: only now and then
            bar.set_postfix(loss=f"{loss.item():.4f}", scale=f"{used_scale.item():g}")
        if (step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps:
            save_checkpoint(ckpt_path, checkpoint_at(step + 1))
    bar.close()

    with torch.no_grad():
        logits = forward(params, (x_test,))
    accuracy = (logits.argmax(-1) == y_test).float().mean().item()
    final = checkpoint_at(args.steps)
    plot(args.out / "digits.png", final["history"], scaling)
    skipped = int((final["history"]["found_inf"] != 0).sum())
    print(
        f"test accuracy {accuracy:.2%} after {args.steps} steps ({skipped} skipped), "
        f"{precision} on {device.type}, {time.perf_counter() - began:.1f} s; "
        f"checkpoint {ckpt_path}, plot {args.out / 'digits.png'}"
    )
    return accuracy


if __name__ == "__main__":
    main()
