"""Compile time of autocast: the first call of a compiled step, famp.autocast ÷ torch.autocast.

`torch.compile(step, fullgraph=True)` of one forward + backward step of a model of
`bench_autocast.py`'s zoo (tiny size; not the GRU, which Dynamo does not trace with
fullgraph=True), called once, which is almost all compilation. The backend is `aot_eager` by
default: Dynamo's trace and AOTAutograd's, where famp's interception is traced, without
inductor's C++ (`--backend inductor` adds it, `--backend eager` leaves only Dynamo's).

- `torch`: `torch.autocast` around the model, by hand.
- `famp`: `famp.autocast` with the default rules.
- `override`: `softmax` and `rms_norm` overridden to "lower" (no dtype changes): every op call
  reaches famp's torch function mode while Dynamo traces.
- `module rules`: each model's linear and convolution layers under a rule of the call's own
  policy (no dtype changes): the model's paths, and famp's hooks and scopes on the matched
  layers, are traced too (a call of the model itself: no global hook, `tree_hooks.py`).

One process per model and round compiles every variant, in an order rotated each round, after
`torch.compiler.reset()` and on a fresh model; it first compiles a small function and runs each
variant eagerly, so that what a process pays once (importing Dynamo, reading famp's rule tables)
falls on no variant. The figure is the median over the rounds, and famp's ÷ torch's.

Run: python benchmarks/bench_autocast_compile.py [--rounds 4] [--backend aot_eager]
(under 3 minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

MODELS = (
    "CNN + BatchNorm + pooling",
    "TransformerEncoderLayer",
    "embedding + layer norm + einsum attention",
)
VARIANTS = ("torch", "famp", "override", "module rules")


def child(model_name: str, backend: str, rotate: int) -> None:
    """Compile and call each variant's step once; print the seconds each first call took."""
    import torch

    import famp

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from bench_autocast import famp_step, module_rules, torch_step, zoo

    torch.set_num_threads(1)

    def step(variant: str) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
        model, x = zoo("tiny", torch.device("cpu"))[model_name]
        if variant == "torch":
            return torch_step(model), x
        if variant == "famp":
            return famp_step(model, compile=False), x
        if variant == "override":
            rules = famp.default_rules("cpu").override({"softmax": "lower", "rms_norm": "lower"})
            return famp_step(model, rules=rules, compile=False), x
        return famp_step(model, module_rules=module_rules(model), compile=False), x

    warm = torch.compile(lambda t: torch.sin(t).sum(), fullgraph=True, backend=backend)
    warm(torch.ones(3, requires_grad=True)).backward()  # the forward's and backward's compilers
    for variant in VARIANTS:  # eagerly: famp's rule tables, torch's first kernels
        fn, x = step(variant)
        fn(x).backward()
    seconds = {}
    for variant in VARIANTS[rotate:] + VARIANTS[:rotate]:
        torch.compiler.reset()
        fn, x = step(variant)
        compiled = torch.compile(fn, fullgraph=True, backend=backend)
        start = time.perf_counter()
        compiled(x).backward()
        seconds[variant] = time.perf_counter() - start
    print(json.dumps(seconds))


def first_calls(model: str, backend: str, rotate: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
        out = subprocess.run(
            [sys.executable, __file__, "--child", model, backend, str(rotate)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=4)  # each variant first once
    parser.add_argument(
        "--backend", choices=["eager", "aot_eager", "inductor"], default="aot_eager"
    )
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return
    print(f"first call of a compiled step (backend {args.backend}), median of {args.rounds}")
    print(f"| model | torch s | {' | '.join(f'{v} ÷ torch' for v in VARIANTS[1:])} |")
    print("|---|---|" + "---|" * (len(VARIANTS) - 1))
    for model in MODELS:
        seconds: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for round_ in range(args.rounds):
            for variant, took in first_calls(model, args.backend, round_ % len(VARIANTS)).items():
                seconds[variant].append(took)
        base = statistics.median(seconds["torch"])
        ratios = " | ".join(f"{statistics.median(seconds[v]) / base:.2f}" for v in VARIANTS[1:])
        print(f"| {model} | {base:.2f} | {ratios} |", flush=True)


if __name__ == "__main__":
    main()
