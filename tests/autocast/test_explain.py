"""famp.explain: the ops and dtypes torch.autocast runs, famp.autocast's outputs, rules' sources."""

from __future__ import annotations

import copy
import re
import sys
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import famp
from tests.autocast.test_autocast_zoo import DTYPES, ZOO, _build
from tests.helpers import assert_bitwise_equal


class OpLog(TorchDispatchMode):
    """The ground truth: (aten op, tensor argument dtypes, tensor result dtypes) per op."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[torch.dtype, ...], tuple[torch.dtype, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        leaves = torch.utils._pytree.tree_leaves

        def dtypes(tree: Any) -> tuple[torch.dtype, ...]:
            return tuple(t.dtype for t in leaves(tree) if isinstance(t, torch.Tensor))

        self.ops.append((str(func), dtypes((args, kwargs)), dtypes(out)))
        return out


def _torch_run(loss: Any, model: torch.nn.Module, inputs: Any, policy: famp.Policy) -> Any:
    with OpLog() as log:
        with torch.autocast("cpu", dtype=policy.compute_dtype):
            out = loss(model, *inputs)
        out = policy.cast_to_output(out)
    return out, log.ops


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
@pytest.mark.parametrize("name", list(ZOO))
def test_trace_equals_torch_autocast_ops_and_dtypes_on_the_zoo(
    name: str, dtype: torch.dtype
) -> None:
    model, loss, inputs = _build(name)
    policy = famp.Policy(torch.float32, dtype, torch.float32)
    try:
        expected, expected_ops = _torch_run(loss, copy.deepcopy(model), inputs, policy)
    except RuntimeError as e:  # torch's own kernels may refuse a dtype on this CPU (oneDNN LSTM)
        message = str(e)
        with pytest.raises(RuntimeError, match=re.escape(message)):
            famp.explain(loss, policy)(copy.deepcopy(model), *inputs)
        return
    out, trace = famp.explain(loss, policy)(copy.deepcopy(model), *inputs)
    assert [(r.op, r.in_dtypes, r.out_dtypes) for r in trace] == expected_ops
    assert_bitwise_equal(out, expected)
    assert out.dtype == torch.float32
    reference = famp.autocast(loss, policy)(copy.deepcopy(model), *inputs)
    assert_bitwise_equal(out, reference)
    # The rules say what the dtypes show: an op under "lower" computes in the compute dtype, one
    # under "float32" in float32 (its first floating result: statistics such as an attention's
    # logsumexp may be float32); every rule is the default table's.
    ruled = [r for r in trace if r.rule in ("lower", "float32")]
    for r in ruled:
        floating = [d for d in r.out_dtypes if d.is_floating_point]
        want = dtype if r.rule == "lower" else torch.float32
        assert floating[:1] in ([], [want]), r
        assert r.source == "default"
        assert r.rule == famp.default_rules("cpu").lookup(r.call or r.op.split(".")[1], "default")
    # Every cast to the compute dtype is made for a "lower" or "promote" op, or inside the C++
    # implementation of an op that Python calls (an RNN's linears; see famp._autocast.explain).
    cpp = {"gru", "rnn_tanh", "lstm", "lstm_cell", "gru_cell"}
    for r in trace:
        if r.op == "aten._to_copy.default" and r.out_dtypes == (dtype,) and r.call:
            assert r.rule in ("lower", "promote") or r.call in cpp, r


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(x).softmax(-1)
        return h + self.mlp(self.norm(h))


def _block() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Block(), torch.randn(4, 8)


def test_overrides_and_module_rules_show_up_with_their_source() -> None:
    model, x = _block()
    rules = famp.default_rules("cpu").override({"layer_norm": "float32", "softmax": "lower"})
    kwargs: dict[str, Any] = {"rules": rules, "module_rules": {"mlp.2": "c=f16"}}
    out, trace = famp.explain(model, "p=f32,c=bf16,o=f32", **kwargs)(x)
    assert_bitwise_equal(out, famp.autocast(model, "p=f32,c=bf16,o=f32", **kwargs)(x))
    assert out.dtype == torch.float32
    by_call: dict[tuple[str, str], set[tuple[str | None, str]]] = {}
    for r in trace:
        by_call.setdefault((r.module, r.call), set()).add((r.rule, r.source))
    assert by_call[("attn", "linear")] == {("lower", "default")}
    assert by_call[("", "softmax")] == {("lower", "override")}
    assert by_call[("norm", "layer_norm")] == {("float32", "override")}
    assert by_call[("mlp.0", "linear")] == {("lower", "default")}
    assert by_call[("mlp.2", "linear")] == {("lower", "module")}
    norm = [r for r in trace if r.op == "aten.native_layer_norm.default"]
    assert [r.out_dtypes[0] for r in norm] == [torch.float32]
    mlp2 = [r for r in trace if r.module == "mlp.2" and r.op == "aten.addmm.default"]
    assert [r.out_dtypes for r in mlp2] == [(torch.float16,)]
    first = [r for r in trace if r.module == "mlp.0" and r.op == "aten.addmm.default"]
    assert [r.out_dtypes for r in first] == [(torch.bfloat16,)]


def test_a_call_ends_on_an_equal_callable_not_only_the_same_one() -> None:
    # From Python 3.12 the profile events of `Tensor._is_view(t)` bring two bound methods, equal
    # but not the same object. A call that never ended made every later op's rule and call name
    # that of the first call still open (layer_norm reported as linear's "lower"). This runs the
    # events as 3.12 sends them, on any Python.
    from famp._autocast.recorder import Recorder

    recorder = Recorder("cpu", (True, torch.bfloat16), [])
    t = torch.ones(2)
    frame = sys._getframe()
    call, end = t._is_view, t._is_view
    assert call is not end
    assert call == end
    recorder.profile(frame, "c_call", call)
    assert [c.name for c in recorder.calls] == ["_is_view"]
    recorder.profile(frame, "c_return", end)
    assert recorder.calls == []
    recorder.profile(frame, "c_call", t.dim)
    recorder.profile(frame, "c_exception", t.dim)
    assert recorder.calls == []
    recorder.profile(frame, "c_call", torch.relu)
    recorder.profile(frame, "c_return", torch.sigmoid)  # another callable: the call goes on
    assert [c.name for c in recorder.calls] == ["relu"]


def test_float32_compute_has_no_rule_anywhere() -> None:
    model, x = _block()
    out, trace = famp.explain(model, "c=f32")(x)
    assert_bitwise_equal(out, model(x))
    assert len(trace) > 0
    assert {r.rule for r in trace} == {None}
    assert all(d == torch.float32 for r in trace for d in r.out_dtypes if d.is_floating_point)


def test_module_paths_and_outside_ops() -> None:
    model, x = _block()
    _, trace = famp.explain(lambda x: model(x).sum() * 2, "c=bf16,o=f32")(x)
    modules = {r.module for r in trace}
    assert modules == {"", "attn", "norm", "mlp.0", "mlp.1", "mlp.2"}
    # the residual adds promote to float32 (x is float32): no output cast is needed
    assert [(r.op, r.module, r.call) for r in trace[-3:]] == [
        ("aten.add.Tensor", "", ""),
        ("aten.sum.default", "", "sum"),
        ("aten.mul.Tensor", "", ""),
    ]


def test_table_and_summary_name_every_op() -> None:
    model, x = _block()
    _, trace = famp.explain(model, "c=bf16")(x)
    table = trace.table()
    assert table.splitlines()[0].split() == [
        "#", "op", "module", "call", "rule", "source", "in", "out"
    ]  # fmt: skip
    assert len(table.splitlines()) == len(trace) + 1
    only_mlp = trace.table(module="mlp")
    assert len(only_mlp.splitlines()) == 1 + sum(r.module.startswith("mlp.") for r in trace)
    counts = trace.counts()
    assert sum(counts.values()) == len(trace)
    assert counts[("lower", torch.bfloat16)] == sum(
        r.rule == "lower" and r.out_dtypes[:1] == (torch.bfloat16,) for r in trace
    )
    assert "lower  bf16" in trace.summary()


def test_compile_true_is_refused_and_errors_leave_nothing_behind() -> None:
    with pytest.raises(ValueError, match="compile must be False or None"):
        famp.explain(torch.nn.Linear(2, 2), "c=bf16", compile=True)
    with pytest.raises(ValueError, match=r"compute must be a dtype name"):
        famp.explain(torch.nn.Linear(2, 2), "c=int8")
    previous = sys.getprofile()

    def boom(x: torch.Tensor) -> torch.Tensor:
        raise KeyError("inside")

    with pytest.raises(KeyError, match="inside"):
        famp.explain(boom, "c=bf16")(torch.ones(2))
    assert sys.getprofile() is previous
    assert not torch.is_autocast_enabled("cpu")
    lin = torch.nn.Linear(2, 2)
    _, trace = famp.explain(lin, "c=bf16")(torch.ones(2))
    assert {r.module for r in trace} == {""}  # no stale module stack from the failed call


@pytest.mark.slow
def test_digits_demo_explain_and_report_options(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.helpers import load_example

    digits = load_example("train_digits")
    argv = ["--steps", "2", "--batch-size", "8", "--out", str(tmp_path), "--no-progress"]
    scaled = ["--precision", "fp16", "--init-scale", str(2.0**18)]  # the first step overflows
    digits.main([*argv, *scaled, "--explain", "--report"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["#", "op", "module", "call", "rule", "source", "in", "out"]
    conv = [line.split() for line in lines[1:5]]
    assert [row[1:5] for row in conv] == [
        ["aten._to_copy.default", "0", "conv2d", "lower"],
        ["aten._to_copy.default", "0", "conv2d", "lower"],
        ["aten._to_copy.default", "0", "conv2d", "lower"],
        ["aten.convolution.default", "0", "conv2d", "lower"],
    ]
    assert conv[3][-1] == "f16"
    assert "step 0: overflow at loss scale 262144" in out
    report = lines[lines.index("step 0: overflow at loss scale 262144") + 1 :]
    assert report[0].startswith("found_inf = 1: ")
    assert report[1].split(":")[0].strip() in {
        n for n, _ in digits.build_model().named_parameters()
    }
