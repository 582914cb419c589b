"""famp.explain: the ops and dtypes torch.autocast runs, famp.autocast's outputs, rules' sources."""

from __future__ import annotations

import copy
import re
import sys
import threading
import warnings
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

    recorder = Recorder("cpu")
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


def test_a_compiled_submodule_is_named_by_the_paths_module_rules_use() -> None:
    # `torch.compile(block)` inside a model: `mlp`, `mlp.0`, as a rule names them, not
    # `mlp._orig_mod.0`; the rule on `mlp` applies there.
    model, x = _block()
    model.mlp = torch.compile(model.mlp, backend="aot_eager")  # type: ignore[assignment]
    with warnings.catch_warnings():  # torch's: famp's global hooks also fire for the wrapper
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)`")
        _, trace = famp.explain(model, "c=bf16,o=f32", module_rules={"mlp": "c=f32"})(x)
    assert {r.module for r in trace} == {"", "attn", "norm", "mlp.0", "mlp.1", "mlp.2"}
    mlp = [r for r in trace if r.module.startswith("mlp.") and r.op == "aten.addmm.default"]
    assert len(mlp) == 2
    assert all(r.source == "module" and r.out_dtypes == (torch.float32,) for r in mlp)


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


# What explain reports, against what ran: the ground truth runs the same computation under
# torch.autocast with famp's casts written by hand, logging each aten op with its dtypes and the
# (module, rule, source) that docs/debugging.md gives the code running it.

Label = tuple[str, Any, str]  # (module path, rule or a function of the op giving it, source)
# `a @ b`: torch's C++ wrapper casts (the `_to_copy`s show their own rule, "keep": the documented
# blind spot) and runs `mm` with autocast off, under `mm`'s rule.
OPERATOR = {"aten._to_copy.default": "keep", "aten.mm.default": "lower"}


class LabelledLog(OpLog):
    """OpLog whose rows also carry the label set for the code running."""

    def __init__(self) -> None:
        super().__init__()
        self.label: Label = ("", None, "default")
        self.rows: list[tuple[Any, ...]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        module, rule, source = self.label
        rule = rule.get(str(func)) if isinstance(rule, dict) else rule
        self.rows.append((*self.ops[-1], module, rule, source))
        return out


def _rows(trace: famp.Trace) -> list[tuple[Any, ...]]:
    return [(r.op, r.in_dtypes, r.out_dtypes, r.module, r.rule, r.source) for r in trace]


def _assert_same_outputs(out: Any, expected: Any) -> None:
    assert len(out) == len(expected)
    for a, e in zip(out, expected, strict=True):
        assert_bitwise_equal(a, e)


@pytest.mark.parametrize("order", ["sub_then_model", "model_then_sub"])
def test_a_module_called_on_its_own_and_in_its_parent_gets_each_calls_path_and_rule(
    order: str,
) -> None:
    # famp.autocast makes a module entered outside any other a root for that call of it:
    # `model[1](x)` gives it the path "" and `model(x)` the path "1", in either order, and the
    # module rule for "1" applies inside `model(x)` only. Explain fixed each module's path the
    # first time it saw it, so one of the two calls was reported with the other's path and rule.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    x = torch.randn(2, 4)
    bf16, f32 = torch.bfloat16, torch.float32
    policy = famp.get_policy("c=bf16,o=f32")
    module_rules = {"1": "c=f32,o=f32"}

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if order == "sub_then_model":
            alone = model[1](x)
            whole = model(x)
        else:
            whole = model(x)
            alone = model[1](x)
        return alone, whole

    with LabelledLog() as log, torch.no_grad():
        with torch.autocast("cpu", dtype=bf16):
            for step in ("sub", "model") if order == "sub_then_model" else ("model", "sub"):
                if step == "sub":
                    log.label = ("", "lower", "default")
                    alone = model[1](x)
                    continue
                log.label = ("0", "lower", "default")
                h = model[0](x)
                log.label = ("1", None, "module")  # the rule's input cast, then autocast off
                h = policy.cast_to_compute(h).float()
                with torch.autocast("cpu", enabled=False):
                    whole = model[1](h)
        log.label = ("", None, "default")
        expected = policy.cast_to_output((alone, whole))
    with torch.no_grad():
        out, trace = famp.explain(fn, policy, module_rules=module_rules)(x)
    _assert_same_outputs(out, expected)
    assert _rows(trace) == log.rows
    assert [d for r in trace if r.module == "1" for d in r.out_dtypes] == [f32] * 3


class _Outer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        self.head = torch.nn.Linear(4, 4)
        self.nested = famp.autocast(self.inner, "c=bf16,o=f32", module_rules={"1": "c=f16,o=bf16"})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.nested(x))


def test_a_nested_call_is_reported_under_its_own_rules_policy_and_module_rules() -> None:
    # Inside a nested famp.autocast call its own rules, policy and module rules apply, not the
    # outer call's overrides and module rules (docs/autocast.md, "Nested transforms"). Explain
    # labelled the nested call's ops with the outer call's: linear's float32 override, and the
    # outer module rule for "inner.0".
    torch.manual_seed(0)
    model, x = _Outer(), torch.randn(2, 4)
    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    rules = famp.default_rules("cpu").override({"linear": "float32"})
    kwargs: dict[str, Any] = {"rules": rules, "module_rules": {"inner.0": "c=f32,o=f32"}}
    with LabelledLog() as log, torch.no_grad(), torch.autocast("cpu", dtype=bf16):
        log.label = ("", "keep", "default")  # the nested call's input cast, by the outer
        h = x.to(bf16)
        with torch.autocast("cpu", dtype=bf16):  # the nested call's region
            log.label = ("inner.0", "lower", "default")
            h = model.inner[0](h)
            log.label = ("inner.1", "keep", "module")  # its own module rule's input cast
            h = h.to(f16)
            log.label = ("inner.1", "lower", "module")
            with torch.autocast("cpu", dtype=f16):
                h = model.inner[1](h)
            log.label = ("inner", "keep", "default")  # the module rule's output cast
            h = h.to(bf16)
        log.label = ("", "keep", "default")  # the nested call's output cast
        h = h.to(f32)
        log.label = ("head", "float32", "override")  # the outer override: autocast off
        with torch.autocast("cpu", enabled=False):
            expected = model.head(h)
    with torch.no_grad():
        out, trace = famp.explain(model, "c=bf16,o=f32", **kwargs)(x)
    assert_bitwise_equal(out, expected)
    assert _rows(trace) == log.rows
    inner = [r for r in trace if r.op == "aten.addmm.default"]
    assert [r.out_dtypes for r in inner] == [(bf16,), (f16,), (f32,)]


def test_an_op_where_autocast_is_off_has_no_rule_also_from_an_operator() -> None:
    # docs/debugging.md: the rule is `-` under the function's own torch.autocast(enabled=False)
    # and where a nested call computes in float32. `x @ w` there was labelled "lower": explain
    # took autocast off without an enclosing call for the inside of torch's C++ wrapper.
    torch.manual_seed(0)
    x, w = torch.randn(3, 4), torch.randn(4, 5)
    bf16 = torch.bfloat16
    nested = famp.autocast(lambda x, w: x @ w, "c=f32,o=f32", device_type="cpu")

    def fn(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with torch.autocast("cpu", enabled=False):
            off = (x @ w, torch.mm(x, w))
        return (*off, nested(x, w), x @ w)

    with LabelledLog() as log:
        with torch.autocast("cpu", dtype=bf16):
            with torch.autocast("cpu", enabled=False):
                off = (x @ w, torch.mm(x, w))
                in_f32 = x @ w  # the nested call: float32 inputs, autocast off, float32 output
            log.label = ("", OPERATOR, "default")  # inside torch's wrapper: autocast on
            on = x @ w
        log.label = ("", None, "default")  # the output cast, after the region
        expected = famp.get_policy("c=bf16,o=bf16").cast_to_output((*off, in_f32, on))
    out, trace = famp.explain(fn, "c=bf16,o=bf16")(x, w)
    _assert_same_outputs(out, expected)
    assert _rows(trace) == log.rows
    assert [r.rule for r in trace if r.op == "aten.mm.default"] == [None, None, None, "lower"]


@pytest.mark.parametrize("stack", [False, True], ids=["layer", "encoder"])
def test_the_transformer_fast_path_runs_as_unobserved(stack: bool) -> None:
    # Eval mode under no_grad takes torch's fused `_transformer_encoder_layer_fwd`, whose kernel
    # calls linear through the dispatcher: autocast casts those calls. A dispatch mode runs an op
    # with autocast's key excluded, so explain ran them in float32 (max diff 0.0071 against
    # famp.autocast and torch.autocast unobserved; the trace said f32 out).
    torch.manual_seed(1)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False) if stack else layer
    model.eval()
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = model(x)
        out, trace = famp.explain(model, "c=bf16,o=bf16")(x)
        plain = famp.autocast(model, "c=bf16,o=bf16")(x)
    assert expected.dtype == torch.bfloat16
    assert_bitwise_equal(out, expected)
    assert_bitwise_equal(out, plain)
    fused = [r for r in trace if r.op == "aten._transformer_encoder_layer_fwd.default"]
    assert len(fused) == (2 if stack else 1)
    assert all(r.out_dtypes == (torch.bfloat16,) for r in fused)


@pytest.mark.parametrize(
    ("override", "op", "fn"),
    [
        ({"add": "lower"}, "aten.add.Tensor", lambda x, w: x + x),
        ({"matmul": "float32"}, "aten.mm.default", lambda x, w: x @ w),
        ({"mul": "lower"}, "aten.mul.Tensor", lambda x, w: x * 2.0),
        ({"mm": "float32"}, "aten.mm.default", lambda x, w: torch.ops.aten.mm.default(x, w)),
    ],
    ids=["add", "matmul", "mul", "aten_mm"],
)
def test_an_operator_with_an_override_has_the_overrides_rule(
    override: dict[str, str], op: str, fn: Any
) -> None:
    # famp applies an override to a Python operator (`x + x` has no profiled call): its ops
    # were reported with rule None ("autocast off") although the override ran them.
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    rules = famp.default_rules("cpu").override(override)
    with OpLog() as log:
        expected = famp.autocast(fn, "c=bf16,o=bf16", rules=rules)(x, w)
    out, trace = famp.explain(fn, "c=bf16,o=bf16", rules=rules)(x, w)
    assert_bitwise_equal(out, expected)
    ran = [dtypes for name, _, dtypes in log.ops if name == op]
    (record,) = [r for r in trace if r.op == op]
    assert [record.out_dtypes] == ran
    rule = next(iter(override.values()))
    assert (record.rule, record.source) == (rule, "override")
    assert ran[0][0] == (torch.bfloat16 if rule == "lower" else torch.float32)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x, w: torch.matmul(x, w, out=torch.empty(4, 8)),
        lambda x, w: torch.linalg.vecdot(x, x, out=torch.empty(4)),
    ],
    ids=["matmul", "vecdot"],
)
def test_an_out_call_of_a_composite_has_the_out_overloads_rule(fn: Any) -> None:
    # torch.matmul(x, w, out=o) runs in float32 under autocast (out= overloads have no autocast
    # kernel); explain gave its aten.mm.out matmul.default's rule, "lower".
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with OpLog() as log, torch.autocast("cpu", dtype=torch.bfloat16):
        expected = fn(x, w)
    out, trace = famp.explain(fn, "c=bf16,o=f32")(x, w)
    assert_bitwise_equal(out, expected)
    assert [(r.op, r.in_dtypes, r.out_dtypes) for r in trace] == log.ops
    assert all(d == torch.float32 for _, i, o in log.ops for d in i + o)
    ruled = [r for r in trace if r.call in ("matmul", "linalg_vecdot")]
    assert ruled
    assert {r.rule for r in ruled} == {"keep"}


def _backward_through_linear(x: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(0)
    y = torch.nn.Linear(8, 8)(x)
    y.float().sum().backward()
    return y.detach()


def _scripted_linear(x: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scripted = torch.jit.script(torch.nn.Linear(8, 8))
    with torch.no_grad():
        return scripted(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("fn", "op", "override"),
    [
        (_backward_through_linear, "aten.mm.default", "mm"),
        (_scripted_linear, "aten.addmm.default", "addmm"),
    ],
    ids=["backward", "torchscript"],
)
def test_an_override_famp_never_applied_is_not_reported(fn: Any, op: str, override: str) -> None:
    # famp's overrides reach the ops its mode runs: not the backward pass (the autograd engine
    # runs it) nor a TorchScript module's ops. explain reported them "float32"/"override"
    # although they ran in bfloat16 under torch's default rule.
    rules = famp.default_rules("cpu").override({override: "float32"})
    x = torch.randn(4, 8)
    with warnings.catch_warnings(), OpLog() as log:
        warnings.simplefilter("ignore")  # famp warns that TorchScript escapes its overrides
        expected = famp.autocast(fn, "c=bf16,o=f32", rules=rules)(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, trace = famp.explain(fn, "c=bf16,o=f32", rules=rules)(x)
    assert_bitwise_equal(out, expected)
    ran = [dtypes for name, _, dtypes in log.ops if name == op]
    records = [r for r in trace if r.op == op]
    assert [r.out_dtypes for r in records] == ran == [(torch.bfloat16,)] * len(ran)
    assert ran
    assert {(r.rule, r.source) for r in records} == {("lower", "default")}


def test_ops_of_a_modules_own_forward_hooks_are_in_that_module() -> None:
    # torch runs global forward hooks (explain's) before a module's own: the ops of `0`'s own
    # forward hook were reported in "" (the parent), though `0`'s module rule ran them (f32).
    torch.manual_seed(0)
    w = torch.randn(8, 8)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    model[0].register_forward_pre_hook(lambda mod, args: (torch.mm(args[0], w),))
    model[0].register_forward_hook(lambda mod, args, out: torch.mm(out, w))
    x = torch.randn(4, 8)
    kwargs: dict[str, Any] = {"module_rules": {"0": "c=f32"}}
    with OpLog() as log:
        expected = famp.autocast(model, "c=bf16,o=f32", **kwargs)(x)
    out, trace = famp.explain(model, "c=bf16,o=f32", **kwargs)(x)
    assert_bitwise_equal(out, expected)
    assert [(r.op, r.in_dtypes, r.out_dtypes) for r in trace] == log.ops
    mms = [(r.module, r.source, r.out_dtypes) for r in trace if r.op == "aten.mm.default"]
    assert mms == [("0", "module", (torch.float32,))] * 2
    assert [r.module for r in trace if r.op == "aten.relu.default"] == ["1"]
    assert len(model[0]._forward_hooks) == 1  # explain's own hook is gone


def test_modules_run_by_another_thread_leave_the_module_column_alone() -> None:
    # explain's module hooks are global: another thread's modules pushed and popped the calling
    # thread's stack of module paths (a differential hunt: traces differing from a lone run).
    torch.manual_seed(0)
    background = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8)
    _, alone = famp.explain(model, "c=bf16,o=f32")(x)
    stop, started = threading.Event(), threading.Event()

    def run() -> None:
        z = torch.randn(2, 4)
        with torch.no_grad():
            while not stop.is_set():
                background(z)
                started.set()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        started.wait()
        rows = [
            [(r.op, r.module) for r in famp.explain(model, "c=bf16,o=f32")(x)[1]] for _ in range(40)
        ]
    finally:
        stop.set()
        thread.join()
    assert all(row == [(r.op, r.module) for r in alone] for row in rows)


def test_an_explain_inside_an_explain_keeps_the_outer_trace() -> None:
    # The inner explain replaced the outer's profile function: the outer trace lost the calls
    # inside it (linear's casts reported "keep" with no call instead of linear's "lower").
    torch.manual_seed(0)
    lin, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    inner: list[famp.Trace] = []

    def with_explain(x: torch.Tensor) -> Any:
        out, trace = famp.explain(lin, "c=f16,o=f32")(x)
        inner.append(trace)
        return out

    def with_autocast(x: torch.Tensor) -> Any:
        return famp.autocast(lin, "c=f16,o=f32")(x)

    with OpLog() as log:
        expected = famp.autocast(with_autocast, "c=bf16,o=f32")(x)
    out, outer = famp.explain(with_explain, "c=bf16,o=f32")(x)
    _, plain = famp.explain(with_autocast, "c=bf16,o=f32")(x)
    assert_bitwise_equal(out, expected)
    assert [(r.op, r.in_dtypes, r.out_dtypes) for r in outer] == log.ops
    assert _rows(outer) == _rows(plain)
    assert [r.rule for r in outer if r.call == "linear"] == ["lower"] * 4
    famp.autocast(with_explain, "c=bf16,o=f32")(x)  # the inner explain, unobserved
    assert _rows(inner[0]) == _rows(inner[1])


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_a_backward_inside_the_call_governs_no_recomputed_op(reentrant: bool) -> None:
    # famp runs `loss.backward()` through its mode (module rules) like an op named "backward":
    # taken as a call, it governed every op of the backward pass, a checkpoint's recomputed
    # linear included ("backward"/"keep" where the forward said "linear"/"lower").
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))

    def fn(x: torch.Tensor) -> torch.Tensor:
        block.zero_grad(set_to_none=True)  # each run makes its grads afresh (no add_)
        x.grad = None
        y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=reentrant)
        y.float().sum().backward()
        return y.detach()

    kwargs: dict[str, Any] = {"module_rules": {"1": "c=f32"}}
    x = torch.randn(4, 8, requires_grad=reentrant)  # a reentrant checkpoint needs one
    with OpLog() as log:
        expected = famp.autocast(fn, "c=bf16,o=f32", **kwargs)(x)
    out, trace = famp.explain(fn, "c=bf16,o=f32", **kwargs)(x)
    assert_bitwise_equal(out, expected)
    assert [(r.op, r.in_dtypes, r.out_dtypes) for r in trace] == log.ops
    addmms = [r for r in trace if r.op == "aten.addmm.default"]
    assert len(addmms) == (4 if reentrant else 3)  # non-reentrant recomputation stops early
    assert {(r.call, r.rule, r.out_dtypes) for r in addmms} == {
        ("linear", "lower", (torch.bfloat16,))
    }
