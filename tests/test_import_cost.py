"""What `import famp` costs: which modules it loads, and that using a feature loads what it needs.

Each test runs Python afresh (`import famp` in the pytest process has long been done), so what it
pins is what a user's `import famp` does. Timings are in docs/benchmarks.md ("Import cost"), not
asserted here (the machine's load decides them).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap
import warnings
from typing import Any

import torch

import famp
from famp import _compat

ROOT = pathlib.Path(famp.__file__).resolve().parent.parent

# Modules that `import torch` does not load and that cost most of a second together: Dynamo and
# Inductor (with sympy), DTensor, FSDP and distributed checkpointing.
HEAVY = (
    "sympy",
    "torch._dynamo",
    "torch._inductor",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.onnx",
)

_PRELUDE = f"""
import json, sys, warnings
warnings.simplefilter("error")
warnings.filterwarnings(
    "ignore", "`torch.jit.script_method` is deprecated", DeprecationWarning
)
# Dynamo's warning about Python 3.13.0 itself (pyproject.toml ignores it too)
warnings.filterwarnings("ignore", "Guards may run slower on Python 3.13.0", RuntimeWarning)
HEAVY = {HEAVY!r}

def heavy():
    return sorted(m for m in HEAVY if m in sys.modules)

out = {{}}
"""


def _run(code: str) -> dict[str, Any]:
    """Run `code` in a fresh interpreter (this checkout's famp first); return its `out` dict."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    script = _PRELUDE + textwrap.dedent(code) + "\nprint(json.dumps(out))\n"
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_plain_import_loads_only_famp_and_optree_beyond_torch_and_every_public_name() -> None:
    out = _run(
        """
        import torch
        before = set(sys.modules)
        import famp
        out["file"] = famp.__file__
        out["new"] = sorted(set(sys.modules) - before)
        out["heavy"] = heavy()
        out["stdlib"] = sorted(sys.stdlib_module_names)
        out["all"] = list(famp.__all__)
        out["missing"] = [n for n in famp.__all__ if n not in dir(famp)]
        from famp import fsdp2_layout, layout_of, load_dcp_optim_state, optim_state_dict_to_load
        out["heavy_after_names"] = heavy()
        """
    )
    assert pathlib.Path(out["file"]).resolve().parent == ROOT / "famp"
    assert out["heavy"] == []
    stdlib = set(out["stdlib"])
    others = [
        m
        for m in out["new"]
        if m.partition(".")[0] not in ("famp", "optree") and m.partition(".")[0] not in stdlib
    ]
    assert others == []  # no torch submodule, no third-party package other than optree
    assert "famp._autocast.transform" in out["new"]
    assert "famp._scaling.state" in out["new"]
    assert out["all"] == famp.__all__
    assert out["missing"] == []
    assert out["heavy_after_names"] == []


def test_loss_scaling_and_autocast_run_without_loading_heavy_modules() -> None:
    # Loss scaling, autocast (with an op override, so famp enters its copies of torch's Python
    # functions) and nonfinite_report load none of HEAVY; their results equal torch's own
    # (GradScaler, torch.autocast) bit for bit. (Not pinned: famp.optimizer_step and famp.explain,
    # since torch's own Optimizer.step and its dispatch to a Python TorchDispatchMode import Dynamo
    # on first use.)
    out = _run(
        """
        import torch
        import famp

        torch.manual_seed(0)
        lin = torch.nn.Linear(8, 8)
        x = torch.randn(4, 8)
        grads = [torch.randn(8, 8), torch.randn(8), torch.tensor([float("inf")])]

        state = famp.init_scaler(2.0**10)
        scaled = famp.scale(state, (lin(x) ** 2).sum())
        unscaled, found_inf = famp.unscale_and_check(state, grads)
        state = famp.update_scale(state, found_inf)
        famp_scale = state.scale.clone()
        sd = famp.to_state_dict(state)

        rules = famp.default_rules("cpu").override({"linear": "float32"})
        f = lambda x: torch.nn.functional.gelu(lin(x)).softmax(-1)
        y_default = famp.autocast(f, "c=bf16")(x)
        y_override = famp.autocast(f, "c=bf16", rules=rules)(x)
        override_dtype = famp.autocast(lambda x: lin(x).dtype, "c=bf16", rules=rules)(x)
        report = famp.nonfinite_report(grads)

        out["heavy_after_use"] = heavy()

        # torch's own versions of the same computations
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        torch_grads = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for p, g in zip(torch_grads, grads):
            p.grad = g.clone()
        torch_opt = torch.optim.SGD(torch_grads, lr=0.0)
        scaler.scale(torch.ones(()))
        scaler.unscale_(torch_opt)
        scaler.update()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y_torch = f(x)
        out["unscaled_equal"] = all(
            torch.equal(a, p.grad) and a.dtype == p.grad.dtype
            for a, p in zip(unscaled, torch_grads)
        )
        out["found_inf"] = found_inf.item()
        out["scale"] = [famp_scale.item(), scaler.get_scale()]
        out["scaled"] = scaled.dtype == torch.float32
        out["state_dict_scale"] = sd["scale"]
        out["autocast_equal"] = torch.equal(y_default, y_torch)
        out["autocast_dtypes"] = [str(y_default.dtype), str(y_torch.dtype), str(override_dtype)]
        out["override_differs"] = not torch.equal(y_override, y_torch)
        out["report_found_inf"] = report.found_inf.item()
        """
    )
    assert out["heavy_after_use"] == []
    assert out["unscaled_equal"] is True
    assert out["found_inf"] == 1.0
    assert out["scale"][0] == out["scale"][1] == 2.0**9  # both backed off
    assert out["scaled"] is True
    assert out["state_dict_scale"] == 2.0**9
    assert out["autocast_dtypes"] == ["torch.bfloat16", "torch.bfloat16", "torch.float32"]
    assert out["override_differs"] is True
    assert out["autocast_equal"] is True
    assert out["report_found_inf"] == 1.0


def test_fsdp_and_dcp_names_load_what_they_need_when_used(tmp_path: pathlib.Path) -> None:
    import torch.distributed.checkpoint as dcp

    msd = {"w": torch.zeros(2, 3), "b": torch.zeros(2)}
    osd = {
        "state": {"w": {"step": torch.tensor(1.0), "exp_avg": torch.ones(2, 3)}},
        "param_groups": [{"lr": 0.1, "params": ["w", "b"]}],
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dcp.save without a process group warns
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path), no_dist=True)
    out = _run(
        f"""
        import torch
        import famp

        layout = famp.fsdp2_layout({{"w": (2, 3), "b": (2,)}}, 2)
        full = {{"state": {{"w": {{"exp_avg": torch.arange(6.0).reshape(2, 3)}}}},
                 "param_groups": [{{"lr": 0.1, "params": ["w", "b"]}}]}}
        shards = [famp.shard_optim_state(full, layout, rank) for rank in range(2)]
        back = famp.unshard_optim_state(shards, layout)
        out["roundtrip"] = torch.equal(
            back["state"]["w"]["exp_avg"], full["state"]["w"]["exp_avg"]
        )
        out["heavy_pure"] = heavy()

        try:
            famp.layout_of(torch.nn.Linear(2, 2))
        except ValueError as e:
            out["layout_of_error"] = str(e)
        out["heavy_layout_of"] = heavy()

        shapes = famp.read_dcp_param_shapes({str(tmp_path)!r})
        out["shapes"] = {{k: list(v) for k, v in shapes.items()}}
        out["heavy_dcp"] = heavy()
        """
    )
    assert out["roundtrip"] is True
    assert out["heavy_pure"] == []
    assert out["layout_of_error"] == "the model has no FSDP1 or FSDP2 sharded parameters"
    assert {"torch.distributed.fsdp", "torch.distributed.tensor"} <= set(out["heavy_layout_of"])
    assert out["shapes"] == {"w": [2, 3], "b": [2]}
    assert "torch.distributed.checkpoint" in out["heavy_dcp"]


def test_first_compiled_calls_in_a_fresh_process_trace_fullgraph() -> None:
    # What famp now builds or looks up lazily (the copies of torch's Python functions that an
    # override enters, the DTensor check of unscale_and_check) is first needed here inside a
    # torch.compile(fullgraph=True) trace; the results equal the eager ones bit for bit.
    out = _run(
        """
        import torch
        import famp

        torch.manual_seed(0)
        lin = torch.nn.Linear(8, 8)
        x = torch.randn(4, 8)
        rules = famp.default_rules("cpu").override({"linear": "float32"})

        def step(x, grads, state):
            f = lambda x: torch.nn.functional.gelu(lin(x)).softmax(-1)
            y = famp.autocast(f, "c=bf16", rules=rules)(x)
            unscaled, found_inf = famp.unscale_and_check(state, grads)
            return y, unscaled, found_inf, famp.update_scale(state, found_inf).scale

        grads = [torch.randn(8, 8), torch.tensor([float("nan")])]
        state = famp.init_scaler(1024.0)
        compiled = torch.compile(step, fullgraph=True, backend="eager")(x, grads, state)
        eager = step(x, grads, state)
        bits = lambda t: t.reshape(-1).view(torch.uint8)
        out["equal"] = [
            a.dtype == b.dtype and torch.equal(bits(a), bits(b))
            for a, b in zip(
                [compiled[0], *compiled[1], compiled[2], compiled[3]],
                [eager[0], *eager[1], eager[2], eager[3]],
            )
        ]
        out["dtype"] = str(famp.autocast(lambda x: lin(x).dtype, "c=bf16", rules=rules)(x))
        """
    )
    assert out["equal"] == [True] * 5
    assert out["dtype"] == "torch.float32"


def test_famp_marks_constant_functions_exactly_as_torch_compiler_does() -> None:
    # famp sets torch.compiler.assume_constant_result's mark itself, so as not to import Dynamo
    # at its own import; torch's function must set exactly that mark (and nothing else).
    def by_torch() -> int:
        return 1

    def by_famp() -> int:
        return 1

    assert vars(by_torch) == {}
    assert torch.compiler.assume_constant_result(by_torch) is by_torch  # type: ignore[no-untyped-call]
    assert _compat.assume_constant_result(by_famp) is by_famp
    assert vars(by_famp) == vars(by_torch) == {"_dynamo_marked_constant": True}
    from famp._autocast import overrides, patterns

    for fn in (patterns.match, overrides._constant_key):
        assert vars(fn) == vars(by_torch)
