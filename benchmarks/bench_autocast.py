"""famp.autocast ÷ torch.autocast: forward + backward step time on a model zoo, side by side.

Each step is `loss = model(x)` under the autocast, then `loss.backward()`. torch and famp steps
alternate, and the ratio of the median step times is reported, eagerly (tiny and small sizes) and
compiled with inductor (small size; not the GRU, which Dynamo does not trace with fullgraph=True).
The override columns use op overrides that change no dtype in these models (`softmax` and
`rms_norm` to "lower"; on CUDA `softmax` to "float32"): they measure famp's op interception
itself, eagerly and once compiled.
The module-rule column puts each model's linear and convolution layers under a rule of the call's
own policy ("bf16"): their inputs are cast to bfloat16, as autocast casts them inside those ops,
and no dtype changes; it measures famp's module scopes (global module hooks, scoped ops, casts).

Run: `python benchmarks/bench_autocast.py` (2–3 minutes on 2 CPU cores). `--quick` runs fewer
steps and skips compilation. `--device cuda` runs the same on a GPU (steps synchronized; the eager
columns pass `compile=False`, since on CUDA `famp.autocast` compiles by default).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import famp

DTYPE = torch.bfloat16


class CNN(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, width, 3, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(width, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        target = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
        return F.cross_entropy(self.body(x), target)


class Encoder(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(width, 4, 2 * width, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).float().pow(2).mean()


class Recurrent(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.gru = nn.GRU(width, width, batch_first=True)
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.head(self.gru(x)[0]).float(), x)


class EmbeddingLM(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(1000, width)
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(self.emb(tokens))).chunk(3, -1)
        attn = torch.einsum("bid,bjd->bij", q, k).softmax(-1)
        logits = torch.bmm(attn, v) @ self.emb.weight.T
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())


def zoo(size: str, device: torch.device) -> dict[str, tuple[nn.Module, torch.Tensor]]:
    torch.manual_seed(0)
    w, batch, seq, image = {"tiny": (16, 4, 8, 8), "small": (128, 16, 32, 16)}[size]
    models = {
        "CNN + BatchNorm + pooling": (CNN(w // 2), torch.randn(batch, 3, image, image)),
        "TransformerEncoderLayer": (Encoder(w), torch.randn(batch, seq, w)),
        "GRU + linear": (Recurrent(w), torch.randn(batch, seq, w)),
        "embedding + layer norm + einsum attention": (
            EmbeddingLM(w),
            torch.randint(0, 1000, (batch, seq)),
        ),
    }
    return {name: (model.to(device), x.to(device)) for name, (model, x) in models.items()}


# Per model: the paths of its linear and convolution layers, for the module-rule column.
MATMUL_LAYERS = {
    CNN: ("body.0", "body.4", "body.9"),
    Encoder: ("layer.linear*",),
    Recurrent: ("head",),
    EmbeddingLM: ("qkv",),
}


def module_rules(model: nn.Module) -> dict[str, str]:
    return dict.fromkeys(MATMUL_LAYERS[type(model)], "bf16")


def torch_step(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    def loss(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=DTYPE):
            return model(x).float()

    return loss


def famp_step(model: nn.Module, **kwargs: object) -> Callable[[torch.Tensor], torch.Tensor]:
    return famp.autocast(model, famp.Policy(torch.float32, DTYPE, torch.float32), **kwargs)  # type: ignore[arg-type]


def ratio(
    baseline: Callable[[torch.Tensor], torch.Tensor],
    candidate: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    steps: int,
) -> tuple[float, float]:
    """(median candidate step ÷ median baseline step, baseline median in ms), alternating."""
    times: dict[int, list[float]] = {0: [], 1: []}
    sync = torch.cuda.synchronize if x.is_cuda else lambda: None
    for i in range(steps + 3):
        for which, fn in enumerate((baseline, candidate)):
            sync()
            start = time.perf_counter()
            fn(x).backward()
            sync()
            if i >= 3:  # warm-up
                times[which].append(time.perf_counter() - start)
    base, cand = statistics.median(times[0]), statistics.median(times[1])
    return cand / base, base * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer steps, no compilation")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU: torch.cuda.is_available() is False")
    device = torch.device(args.device)
    torch.set_num_threads(1)
    # Compiled steps differ by a few percent at most: 15 steps each gave ratios from 1.00 to 1.06
    # for one model in successive runs, 100 steps 0.99-1.01 (an Intel Xeon, one thread), 60 steps
    # 0.99-1.02 (an AMD EPYC). 50 kept the script under 3 minutes with empty inductor caches
    # (100 took 3 min 38 s there). Later, on an AMD EPYC with empty caches, the script took
    # 3 min 34 s with 50 (before the module-rule column), compiling for about 110 s of it: 25
    # compiled steps and 10 small ones keep it near 3 minutes there.
    steps = {"tiny": 30, "small": 5} if args.quick else {"tiny": 300, "small": 10, "compiled": 25}
    machine = platform.processor() or platform.machine()
    if device.type == "cuda":
        machine += f", {torch.cuda.get_device_name()}"
    print(f"torch {torch.__version__}, {machine}, 1 thread")
    print(
        f"bf16 on {device.type}; ratio = median famp step / median torch step; "
        f"steps each: {steps}\n"
    )
    # An override that changes no dtype in these models: it measures the interception alone.
    # On CUDA, where torch runs softmax in float32, "float32" (torch's own rule there sets the
    # op's dtype argument instead: the same dtype).
    softmax = {"cpu": "lower", "cuda": "float32"}[device.type]
    override = famp.default_rules(device.type).override({"rms_norm": "lower", "softmax": softmax})
    eager = {"compile": False}  # on CUDA, famp.autocast compiles by default
    print(
        "| model | size | torch step | eager famp ÷ torch | eager famp + override ÷ torch "
        "| eager famp + module rules ÷ torch |"
    )
    print("|---|---|---|---|---|---|")
    for size in ("tiny", "small"):
        for name, (model, x) in zoo(size, device).items():
            r, ms = ratio(torch_step(model), famp_step(model, **eager), x, steps[size])
            r_override, _ = ratio(
                torch_step(model), famp_step(model, rules=override, **eager), x, steps[size]
            )
            rules = module_rules(model)
            r_rules, _ = ratio(
                torch_step(model), famp_step(model, module_rules=rules, **eager), x, steps[size]
            )
            print(f"| {name} | {size} | {ms:.2f} ms | {r:.3f} | {r_override:.3f} | {r_rules:.3f} |")
    if args.quick:
        return
    print("\n| model (small) | compiled torch step | compiled famp ÷ torch | + override ÷ famp |")
    print("|---|---|---|---|")
    for name, (model, x) in zoo("small", device).items():
        if isinstance(model, Recurrent):
            continue  # Dynamo does not trace nn.GRU with fullgraph=True (torch and famp alike)
        compiled_torch = torch.compile(torch_step(model), fullgraph=True)
        compiled_famp = famp_step(model, compile=True)
        compiled_override = famp_step(model, compile=True, rules=override)
        r, ms = ratio(compiled_torch, compiled_famp, x, steps["compiled"])
        r_override, _ = ratio(compiled_famp, compiled_override, x, steps["compiled"])
        print(f"| {name} | {ms:.2f} ms | {r:.3f} | {r_override:.3f} |")


if __name__ == "__main__":
    main()
