"""famp.OpRules and famp.default_rules: the data, its API, and its agreement with torch's tables."""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import re
import subprocess
import sys
import typing
from collections.abc import Callable, Iterator

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given

import famp
import famp._autocast.defaults as famp_defaults
import famp._autocast.tables as famp_tables
from famp._compat import torch_pytree
from tests.autocast.autocast_reference import SAMPLES, check_op
from tests.helpers import assert_bitwise_equal

TABLES = famp_tables.shipped_tables()  # release → device type → rule → keys

DEVICES = ("cpu", "cuda", "xpu", "mps")
DISPATCH_KEY = {d: f"Autocast{d.upper() if d != 'cpu' else 'CPU'}" for d in DEVICES}
ACTIVE_RULES = [r for r in famp.RULE_NAMES if r != "keep"]


def _registered(device: str) -> set[tuple[str, str]]:
    """(packet, overload) of every aten op with a kernel for the device's autocast key."""
    out = set()
    for name in torch._C._dispatch_get_all_op_names():
        if name.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(
            name, DISPATCH_KEY[device]
        ):
            packet, _, overload = name[len("aten::") :].partition(".")
            out.add((packet, overload or "default"))
    return out


def _all_overloads(packet: str) -> list[str]:
    return list(getattr(torch.ops.aten, packet).overloads())


def _functional_with_tensor(packet: str, overload: str) -> bool:
    """Whether torch could autocast this overload: no mutation, and at least one tensor input."""
    schema = getattr(getattr(torch.ops.aten, packet), overload)._schema
    return not schema.is_mutable and any("Tensor" in str(a.type) for a in schema.arguments)


# --- the tables equal torch's, key by key ---------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_default_rules_list_exactly_the_ops_torch_autocasts(device: str) -> None:
    rules = famp.default_rules(device)
    registered = _registered(device)
    assert len(registered) > 90
    # Every registered overload has a rule other than keep ...
    unlisted = sorted(f"{p}.{o}" for p, o in registered if rules.lookup(p, o) == "keep")
    assert unlisted == []
    # ... and every other overload of every op the table names is keep.
    extra = sorted(
        f"{p}.{o}"
        for p in {key.partition(".")[0] for key in rules}
        for o in _all_overloads(p)
        if (p, o) not in registered and rules.lookup(p, o) != "keep"
    )
    assert extra == []


@pytest.mark.parametrize("device", DEVICES)
def test_packet_keys_only_where_every_functional_overload_shares_the_rule(device: str) -> None:
    rules = famp.default_rules(device)
    registered = _registered(device)
    for key, rule in rules.items():
        packet, dot, _overload = key.partition(".")
        if dot:
            continue
        functional = [o for o in _all_overloads(packet) if _functional_with_tensor(packet, o)]
        assert functional, key
        assert all((packet, o) in registered for o in functional), key
        assert all(rules.lookup(packet, o) == rule for o in functional), key


RELEASE = torch.__version__.split("+")[0]
# Kernels only CUDA builds of torch register: cuDNN's RNN wrapper
# (aten/src/ATen/cudnn/AutocastRNN.cpp). The counts leave them out, so that a CPU build and a CUDA
# build of one release count the same.
CUDA_BUILD_ONLY = {("_cudnn_rnn", "default")}
KERNEL_COUNTS = {
    # shared/reference/torch-amp-semantics.md §3 (torch 2.13): CUDA 119, CPU 127, XPU 117, MPS 95.
    "2.13.0": {"cpu": 127, "cuda": 119, "xpu": 117, "mps": 95},
    # 2.14 dropped aten::cholesky and aten::qr and added linalg_matrix_sqrth (CPU, CUDA); 2.15 too.
    "2.14.0": {"cpu": 126, "cuda": 120, "xpu": 117, "mps": 95},
    "2.14.1": {"cpu": 126, "cuda": 120, "xpu": 117, "mps": 95},
    "2.15.0": {"cpu": 126, "cuda": 120, "xpu": 117, "mps": 95},
}


def test_the_installed_release_has_shipped_tables() -> None:
    # Every release CI runs has famp's tables. Without them, the first famp.autocast derives every
    # rule by running ops on fake tensors: seconds, and torch's compiler stack imported (sympy,
    # Dynamo, inductor), which tests/test_import_cost.py pins as never loaded.
    shipped = famp_tables.shipped_tables()
    assert RELEASE in shipped, (
        f"famp ships autocast tables for torch {sorted(shipped)}, not {RELEASE}: run "
        "`python -m famp._autocast.rules_derive` under it"
    )


def test_rule_counts_per_device_match_the_release() -> None:
    registered = {d: _registered(d) for d in DEVICES}
    counts = {d: len(ops - CUDA_BUILD_ONLY) for d, ops in registered.items()}
    assert counts == KERNEL_COUNTS.get(RELEASE, counts)
    assert {d: famp_tables.registered_ops(d) for d in DEVICES} == registered
    assert all(n > 90 for n in counts.values())


def test_well_known_rules_per_device() -> None:
    cpu, cuda = famp.default_rules("cpu"), famp.default_rules("cuda")
    assert (cpu["linear"], cuda["linear"]) == ("lower", "lower")
    assert (cpu.lookup("layer_norm"), cuda["layer_norm"]) == ("keep", "float32")
    assert (cpu.lookup("rms_norm"), cuda["rms_norm"]) == ("keep", "float32")
    assert (cpu["prod"], cuda["prod"]) == ("float32", "float32_set_opt_dtype")
    assert cuda.lookup("norm", "Scalar") == "float32_append_dtype"
    assert cuda.lookup("norm", "ScalarOpt_dtype") == "keep"  # the user gave a dtype
    assert (cpu["binary_cross_entropy"], cuda["binary_cross_entropy"]) == ("float32", "banned")
    assert (cpu["cat"], cuda.lookup("cat")) == ("promote", "keep")
    assert cpu.lookup("conv2d", "padding") == "lower"
    assert cuda.lookup("conv2d", "padding") == "keep"  # no AutocastCUDA kernel in torch 2.13
    assert cuda.lookup("pow", "Tensor_Scalar") == "float32"
    assert cuda.lookup("pow", "Tensor_Scalar_out") == "keep"


# --- each default rule casts exactly as torch's kernel does, op by op ---------------------------

# (device, autocast dtype, fake tensors). CPU runs real tensors and compares bits; the others run
# fake tensors, which still reach torch's Autocast<Device> kernels, and compare dtypes and shapes.
RUNS = [
    ("cpu", torch.bfloat16, False),
    ("cpu", torch.float16, False),
    ("cuda", torch.float16, True),
    ("cuda", torch.bfloat16, True),
    ("xpu", torch.bfloat16, True),
    ("mps", torch.float16, True),
]


def _name(packet: str, overload: str) -> str:
    return packet if overload == "default" else f"{packet}.{overload}"


def test_every_autocast_op_has_a_sample() -> None:
    registered = {_name(p, o) for d in DEVICES for p, o in _registered(d)}
    assert registered <= set(SAMPLES)
    # The other samples are for ops that another shipped release autocasts.
    shipped = {
        key.partition(".")[0]
        for tables in TABLES.values()
        for table in tables.values()
        for keys in table.values()
        for key in keys
    }
    assert {name.partition(".")[0] for name in set(SAMPLES) - registered} <= shipped


@pytest.mark.parametrize(
    ("device", "dtype", "fake"), RUNS, ids=[f"{d}-{str(t)[6:]}" for d, t, _ in RUNS]
)
def test_default_rules_cast_as_torch_autocast_does(
    device: str, dtype: torch.dtype, fake: bool
) -> None:
    """For every op: same casts below autocast, same output dtypes (and bits on CPU), same errors.

    Each op runs in five input variants (float32; autocast dtype; mixed; float64; dtype= given)
    under torch's autocast and under the reference for famp's rule
    (tests/autocast/autocast_reference.py).
    """
    rules = famp.default_rules(device)
    wrong, unverified = [], []
    wrappers = famp_defaults.WRAPPER_RULES.get(device, {})
    for packet, overload in sorted(_registered(device)):
        name, rule = _name(packet, overload), rules.lookup(packet, overload)
        if (packet, overload) in wrappers:
            # torch's hand-written wrapper needs the real device: test_cudnn_rnn_on_cuda_... runs it
            assert rule == wrappers[(packet, overload)]
            continue
        consistent, ran, casts = check_op(device, name, dtype, (rule,), fake=fake)
        if not fake and ran == 0:
            # Kernels this CPU cannot run in low precision (mkldnn_rnn_layer without AVX512-BF16)
            # are also run on fake CPU tensors, which reach the same AutocastCPU kernel.
            consistent_fake, ran, casts_fake = check_op(device, name, dtype, (rule,), fake=True)
            consistent &= consistent_fake
            casts += casts_fake
        if rule not in consistent:
            wrong.append((name, rule))
        elif ran == 0 and casts == 0 and rule != "banned":
            unverified.append(name)
    assert wrong == []
    # Every op either produced outputs or showed its casts; banned ones raised torch's message.
    assert unverified == []


# --- rules follow the installed torch --------------------------------------------------------


@pytest.fixture
def fresh_rules() -> Iterator[None]:
    """Drop the cached default tables before and after a test that patches what they are read
    from, so that no other test sees a patched table."""
    famp_defaults._default_rules.cache_clear()
    yield
    famp_defaults._default_rules.cache_clear()


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", "cuda"])  # the code path is one for all four
def test_a_release_famp_never_saw_gets_its_rules_by_running_every_op(
    device: str, fresh_rules: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    shipped = famp.default_rules(device)
    famp_defaults._default_rules.cache_clear()
    monkeypatch.setattr(famp_tables, "torch_release", lambda: "99.0.0")
    derived = famp.default_rules(device)
    assert derived == shipped
    assert derived is famp.default_rules(device)  # derived once, then cached


def test_ops_missing_from_the_shipped_table_are_derived(
    fresh_rules: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    shipped = famp.default_rules("cpu")
    assert shipped["linear"] == "lower"
    famp_defaults._default_rules.cache_clear()  # derived afresh below, not the cached table
    tables = {r: {d: dict(t) for d, t in ts.items()} for r, ts in TABLES.items()}
    for release in tables:  # no table, for this release or as the prior, knows linear
        tables[release]["cpu"]["lower"] = tuple(
            k for k in tables[release]["cpu"]["lower"] if k != "linear"
        )
    monkeypatch.setattr(famp_tables, "shipped_tables", lambda: tables)
    assert famp.default_rules("cpu") == shipped


@pytest.mark.parametrize("removed", [("linear", "prod", "cat", "mm.default", "addbmm")])
def test_ops_are_derived_alike_under_a_float64_default_dtype(
    removed: tuple[str, ...], fresh_rules: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before 2026-12-02 the sample inputs took torch's default dtype: under float64 torch's
    # autocast cast none of them, every rule agreed with it, and deriving raised.
    shipped = famp.default_rules("cpu")
    assert {shipped[op] for op in removed} == {"lower", "float32", "promote"}
    famp_defaults._default_rules.cache_clear()  # derived afresh below, not the cached table
    tables = {r: {d: dict(t) for d, t in ts.items()} for r, ts in TABLES.items()}
    for release in tables:  # no table knows them: each is derived, without a prior
        cpu = tables[release]["cpu"]
        cpu.update((rule, tuple(k for k in keys if k not in removed)) for rule, keys in cpu.items())
    monkeypatch.setattr(famp_tables, "shipped_tables", lambda: tables)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        derived = famp.default_rules("cpu")
    finally:
        torch.set_default_dtype(default)
    assert derived == shipped


def test_table_entries_for_ops_this_torch_lacks_are_ignored(
    fresh_rules: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What broke famp on torch 2.15: the table named aten::cholesky, which 2.15 removed.
    shipped = famp.default_rules("cpu")
    release = famp_tables.torch_release()
    tables = {r: {d: dict(t) for d, t in ts.items()} for r, ts in TABLES.items()}
    table = tables.setdefault(release, {d: {} for d in DEVICES})["cpu"]
    tables[release]["cpu"] = {
        **table,
        "float32": (*table.get("float32", ()), "no_such_op_famp", "mm.no_such_overload"),
    }
    monkeypatch.setattr(famp_tables, "shipped_tables", lambda: tables)
    rules = famp.default_rules("cpu")
    assert rules == shipped
    assert "no_such_op_famp" not in rules


def test_autocast_ops_are_read_off_the_dispatcher_as_a_full_scan_finds_them() -> None:
    for device in DEVICES:
        assert famp_tables.registered_ops(device) == _registered(device)


def test_ops_that_cannot_be_classified_are_named_in_one_error(
    fresh_rules: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    registered = famp_tables.registered_ops("cpu")
    # Two ops as a new torch might add them: one famp has no inputs for, one it cannot tell.
    monkeypatch.setattr(
        famp_tables,
        "registered_ops",
        lambda d: registered | {("relu", "default"), ("hardtanh", "default")},
    )
    with pytest.raises(RuntimeError) as info:
        famp.default_rules("cpu")
    message = str(info.value)
    assert f"torch {torch.__version__}" in message
    assert "device_type 'cpu'" in message
    assert "hardtanh (famp has no sample inputs for it)" in message
    assert "relu (famp has no sample inputs for it)" in message
    assert "2 op(s)" in message
    for release in TABLES:
        assert release in message


def test_banned_binary_cross_entropy_keeps_torch_message() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tests.autocast.autocast_reference import Autocast

    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(3, device="cuda")
        with Autocast("cuda", torch.float16), pytest.raises(RuntimeError) as info:
            torch.nn.functional.binary_cross_entropy(x, x)
    assert famp.default_rules("cuda")["binary_cross_entropy"] == "banned"
    assert str(info.value) == famp._autocast.ops.banned_message("binary_cross_entropy", "cuda")
    assert "binary_cross_entropy_with_logits" in str(info.value)


# --- API ----------------------------------------------------------------------------------------


def test_default_rules_rejects_unknown_device_naming_it() -> None:
    with pytest.raises(ValueError, match=r"'tpu'.*'cpu', 'cuda', 'xpu', 'mps'"):
        famp.default_rules("tpu")
    # A device_type that is not a str is a TypeError naming it, as OpRules(device_type=0) gives
    # (a ValueError "no default op rules for device_type 0" before 2026-12-01).
    for value in (0, torch.device("cpu")):
        with pytest.raises(
            TypeError, match=r"device_type must be a str, got \w+ " + re.escape(repr(value))
        ):
            famp.default_rules(value)  # type: ignore[arg-type]


def test_default_rules_is_an_immutable_mapping() -> None:
    rules = famp.default_rules("cuda")
    assert isinstance(rules, typing.Mapping)
    assert rules.device_type == "cuda"
    with pytest.raises(TypeError):
        rules["linear"] = "float32"  # type: ignore[index]
    with pytest.raises(AttributeError):
        rules.device_type = "cpu"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        rules.extra = 1  # type: ignore[attr-defined]


def test_override_returns_new_rules_and_never_mutates() -> None:
    rules = famp.default_rules("cuda")
    before = dict(rules)
    mine = rules.override({"rms_norm": "lower", "linear": "float32"})
    assert dict(rules) == before
    assert famp.default_rules("cuda") == rules
    assert (mine["rms_norm"], mine["linear"]) == ("lower", "float32")
    assert {k: v for k, v in mine.items() if k not in ("rms_norm", "linear")} == {
        k: v for k, v in before.items() if k not in ("rms_norm", "linear")
    }


def test_override_packet_replaces_its_overload_keys_and_keep_removes() -> None:
    cuda = famp.default_rules("cuda")
    assert "conv2d.default" in cuda
    assert "conv2d" not in cuda
    mine = cuda.override({"conv2d": "float32"})
    assert "conv2d.default" not in mine
    assert mine.lookup("conv2d") == mine.lookup("conv2d", "padding") == "float32"
    both = cuda.override({"conv2d": "float32", "conv2d.padding": "lower"})
    assert (both.lookup("conv2d"), both.lookup("conv2d", "padding")) == ("float32", "lower")
    gone = cuda.override({"linear": "keep", "norm": "keep"})
    assert "linear" not in gone
    assert "norm.Scalar" not in gone
    assert gone.lookup("linear") == gone.lookup("norm", "Scalar") == "keep"


def test_override_rejects_unknown_rule_listing_accepted_ones() -> None:
    with pytest.raises(ValueError, match=r"'fp16' for op 'linear'.*lower, float32, promote"):
        famp.default_rules("cpu").override({"linear": "fp16"})


@pytest.mark.parametrize(
    ("op", "message"),
    [
        ("lineer", r"unknown op 'lineer'.*torch.ops.aten.lineer"),
        ("conv2d.paddin", r"unknown op 'conv2d.paddin'.*no overload 'paddin'.*padding"),
        ("aten::linear", r"unknown op 'aten::linear'"),
        ("", r"unknown op ''"),
    ],
)
def test_override_rejects_ops_that_are_not_aten_ops(op: str, message: str) -> None:
    rules = famp.default_rules("cpu")
    with pytest.raises(ValueError, match=message):
        rules.override({"linear": "float32", op: "lower"})
    assert rules["linear"] == "lower"


def test_constructor_validates_types_and_device() -> None:
    with pytest.raises(TypeError, match="op names must be str"):
        famp.OpRules({1: "lower"}, device_type="cpu")  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="'gpu'"):
        famp.OpRules({}, device_type="gpu")
    with pytest.raises(ValueError, match="'cuda:0'"):
        famp.OpRules({}, device_type="cuda:0")
    with pytest.raises(TypeError, match="device_type must be a str"):
        famp.OpRules({}, device_type=torch.device("cpu"))  # type: ignore[arg-type]
    # not pairs: Python's unpacking errors before ("not enough values to unpack")
    for bad, shown in [
        ([("linear",)], r"\('linear',\) among them"),
        ("linear", "str 'linear'"),
        (None, "NoneType None"),
    ]:
        with pytest.raises(
            TypeError, match=rf"rules must be a mapping or \(op, rule\) pairs, got {shown}"
        ):
            famp.OpRules(bad, device_type="cpu")  # type: ignore[arg-type]
    pairs = famp.OpRules([("linear", "float32"), ["mm", "lower"]], device_type="cpu")
    assert pairs == famp.OpRules({"linear": "float32", "mm": "lower"}, device_type="cpu")


def test_lookup_prefers_overload_key_then_packet_key() -> None:
    rules = famp.OpRules(
        {"conv2d": "float32", "conv2d.padding": "lower", "mm.default": "promote"},
        device_type="cpu",
    )
    assert rules.lookup("conv2d") == rules.lookup("conv2d", "") == "float32"
    assert rules.lookup("conv2d", "padding") == "lower"
    assert rules.lookup("mm") == "promote"
    assert rules.lookup("mm", "out") == rules.lookup("conv2d", "out") == "keep"
    assert rules.lookup("linear") == "keep"
    assert rules.lookup("no_such_op") == "keep"


@pytest.mark.parametrize(
    ("args", "exc", "needle"),
    [
        ((1,), TypeError, "got packet 1, overload 'default'"),
        (("linear", None), TypeError, "got packet 'linear', overload None"),
        # before, each answered "keep"
        (("linear.out",), ValueError, "packet 'linear.out' names an overload: lookup('linear', "),
    ],
)
def test_lookup_refuses_what_is_no_packet_and_overload_name(
    args: tuple[typing.Any, ...], exc: type, needle: str
) -> None:
    rules = famp.OpRules({"linear": "promote"}, device_type="cpu")
    with pytest.raises(exc, match=re.escape(needle)):
        rules.lookup(*args)


def test_equal_tables_compare_and_hash_alike() -> None:
    a = famp.OpRules({"mm": "lower", "exp": "float32"}, device_type="cuda")
    b = famp.OpRules([("exp", "float32"), ("mm", "lower"), ("relu", "keep")], device_type="cuda")
    assert a == b
    assert hash(a) == hash(b)
    assert len({a, b}) == 1
    assert a != famp.OpRules({"mm": "lower", "exp": "float32"}, device_type="cpu")
    assert a != {"mm": "lower", "exp": "float32"}
    # An overload key that repeats its packet's rule is dropped, as is "keep" for out=.
    assert famp.OpRules({"mm": "lower", "mm.default": "lower"}, device_type="cpu") == (
        famp.OpRules({"mm": "lower"}, device_type="cpu")
    )
    assert famp.OpRules({"mm": "lower", "mm.out": "keep"}, device_type="cpu") == (
        famp.OpRules({"mm": "lower"}, device_type="cpu")
    )


@pytest.mark.parametrize("device", DEVICES)
def test_to_dict_is_json_and_round_trips(device: str) -> None:
    rules = famp.default_rules(device)
    d = json.loads(json.dumps(rules.to_dict()))
    assert famp.OpRules.from_dict(d) == rules
    assert pickle.loads(pickle.dumps(rules)) == rules
    assert eval(repr(rules), {"OpRules": famp.OpRules}) == rules


def test_from_dict_validates_keys() -> None:
    with pytest.raises(KeyError, match="device_type"):
        famp.OpRules.from_dict({"rules": {}})
    with pytest.raises(ValueError, match="unknown keys \\['extra'\\]"):
        famp.OpRules.from_dict({"device_type": "cpu", "rules": {}, "extra": 1})
    with pytest.raises(ValueError, match="'half'"):
        famp.OpRules.from_dict({"device_type": "cpu", "rules": {"mm": "half"}})


def test_str_is_a_readable_table_of_every_entry() -> None:
    rules = famp.default_rules("cuda")
    text = str(rules)
    assert text == rules.table()
    assert (
        text.splitlines()[0]
        == f"OpRules for device_type 'cuda' ({len(rules)} entries; unlisted ops: keep)"
    )
    words = text.replace(",", " ").split()
    for op in rules:
        assert op in words, op
    assert all(len(line) <= 100 for line in text.splitlines())


# --- properties ----------------------------------------------------------------------------------

OPS = sorted(
    {k for d in DEVICES for k in famp.default_rules(d)}
    | {"relu", "linear.out", "conv2d.padding", "sum.dim_IntList", "norm.ScalarOpt_dtype"}
)


def _returns_a_view(op: str) -> bool:
    """Whether a functional overload the key covers returns a view of an input (its schema's
    alias annotation without a write: `Tensor(a)`), read off torch."""
    packet, dot, overload = op.partition(".")
    for name in [overload] if dot else _all_overloads(packet):
        schema = getattr(getattr(torch.ops.aten, packet), name)._schema
        if _functional_with_tensor(packet, name) and any(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
        ):
            return True
    return False


def _mutates(op: str) -> bool:
    """Whether the key names an overload that writes into its inputs, read off its schema."""
    packet, dot, overload = op.partition(".")
    return bool(dot) and getattr(getattr(torch.ops.aten, packet), overload)._schema.is_mutable


APPLICABLE = {
    op: [
        r
        for r in famp.RULE_NAMES
        if (r not in ("float32_set_opt_dtype", "float32_append_dtype"))
        or famp.default_rules("cuda").lookup(*(op.partition(".")[::2])) == r
    ]
    if not _returns_a_view(op)
    else ["keep", "banned"]  # casting rules: tested on their own below
    for op in OPS
    if not _mutates(op)
} | {op: ["keep"] for op in OPS if _mutates(op)}  # run as given: tested on their own below
changes_st = st.dictionaries(st.sampled_from(OPS), st.just(None), max_size=8).flatmap(
    lambda ops: st.fixed_dictionaries({op: st.sampled_from(APPLICABLE[op]) for op in ops})
)


def _expected_lookup(
    base: famp.OpRules, changes: dict[str, str], packet: str, overload: str
) -> str:
    """Reference semantics of override + lookup, written from the documented rules alone."""
    if f"{packet}.{overload}" in changes:
        return changes[f"{packet}.{overload}"]
    if packet in changes:
        return changes[packet] if _functional_with_tensor(packet, overload) else "keep"
    return base.lookup(packet, overload)


@given(device=st.sampled_from(DEVICES), changes=changes_st)
def test_override_never_mutates_and_lookup_follows_the_documented_rules(
    device: str, changes: dict[str, str]
) -> None:
    base = famp.default_rules(device)
    snapshot = (dict(base), hash(base))
    new = base.override(changes)
    assert (dict(base), hash(base)) == snapshot
    assert new.device_type == device
    for packet in sorted({key.partition(".")[0] for key in OPS}):
        for o in _all_overloads(packet):
            assert new.lookup(packet, o) == _expected_lookup(base, changes, packet, o), (packet, o)


@given(device=st.sampled_from(DEVICES), changes=changes_st)
def test_to_dict_from_dict_round_trip(device: str, changes: dict[str, str]) -> None:
    rules = famp.default_rules(device).override(changes)
    d = rules.to_dict()
    assert json.loads(json.dumps(d)) == d
    back = famp.OpRules.from_dict(d)
    assert back == rules
    assert hash(back) == hash(rules)
    assert back.to_dict() == d


@given(device=st.sampled_from(DEVICES), changes=changes_st)
def test_override_is_idempotent_and_order_free_for_disjoint_packets(
    device: str, changes: dict[str, str]
) -> None:
    base = famp.default_rules(device)
    once = base.override(changes)
    assert once.override(changes) == once
    packets = {k.partition(".")[0] for k in changes}
    for packet in packets:
        mine = {k: v for k, v in changes.items() if k.partition(".")[0] == packet}
        rest = {k: v for k, v in changes.items() if k.partition(".")[0] != packet}
        assert base.override(mine).override(rest) == once


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"linear": "float32_set_opt_dtype"},
            r"'float32_set_opt_dtype' does not apply to op 'linear'",
        ),
        ({"norm": "float32_append_dtype"}, r"'norm'.*norm.Scalar, norm.ScalarOpt_dim"),
        ({"sum.out": "float32_append_dtype"}, r"'sum.out'"),
    ],
)
def test_dtype_rules_only_apply_to_ops_with_a_dtype_argument(
    changes: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        famp.default_rules("cuda").override(changes)
    ok = famp.default_rules("cpu").override(
        {"sum": "float32_set_opt_dtype", "norm.Scalar": "float32_append_dtype"}
    )
    assert ok.lookup("sum", "dim_IntList") == "float32_set_opt_dtype"


def test_docs_rule_table_is_the_generated_one_and_names_its_torch() -> None:
    from famp._autocast.rules_table import END, GENERATED_FROM, START, markdown_table

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "autocast.md").read_text()
    assert START in text, "run python -m famp._autocast.rules_table into docs/autocast.md"
    assert END in text, "run python -m famp._autocast.rules_table into docs/autocast.md"
    committed = text.split(START, 1)[1].split(END, 1)[0].strip()
    # The docs hold the newest shipped release's table; under that release it is regenerated.
    newest = max(TABLES, key=famp_tables.release_key)
    assert committed.splitlines()[0] == GENERATED_FROM.format(release=newest)
    if famp_tables.torch_release() == newest:
        assert committed == markdown_table(), (
            "docs/autocast.md is stale: python -m famp._autocast.rules_table"
        )
    else:
        assert markdown_table().splitlines()[0] == GENERATED_FROM.format(
            release=famp_tables.torch_release()
        )


_TRACED_RULES = famp.default_rules("cpu").override({"relu": "float32"})


def _cast_by_rule(x: torch.Tensor) -> torch.Tensor:
    y = x.to(torch.bfloat16) if _TRACED_RULES.lookup("linear") == "lower" else x
    if _TRACED_RULES["relu"] == "float32" and "relu" in _TRACED_RULES:
        y = y * 2
    return y


def test_rules_are_read_inside_a_fullgraph_compiled_function() -> None:
    out = torch.compile(_cast_by_rule, fullgraph=True, backend="eager")(torch.ones(2))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch.full((2,), 2.0, dtype=torch.bfloat16))


# --- GRU and LSTM on any CPU --------------------------------------------------------------------
# On CPUs with AVX512-BF16 (or AMX) torch runs nn.LSTM/nn.GRU in bfloat16 through oneDNN's
# mkldnn_rnn_layer; elsewhere it falls back to the native path. famp must equal torch.autocast on
# both: in-process here (whichever path this CPU takes, and with oneDNN off), and in a process
# whose oneDNN is capped at AVX2 (ONEDNN_MAX_CPU_ISA), which takes the path of a CPU without
# AVX512-BF16 even on one that has it.

RNN_CASES = [(kind, dtype) for kind in ("LSTM", "GRU") for dtype in ("bfloat16", "float16")]


def rnn_mismatches(kind: str, dtype_name: str) -> list[str]:
    """GRU/LSTM forward and backward under famp.autocast (default rules, and an override of an op
    the RNN does not use, which routes every call through famp's mode) vs torch.autocast."""
    dtype = getattr(torch, dtype_name)
    short = {"bfloat16": "bf16", "float16": "f16"}[dtype_name]
    torch.manual_seed(0)
    module = getattr(torch.nn, kind)(5, 4, num_layers=2, batch_first=True)
    x = torch.randn(2, 3, 5, requires_grad=True)
    params = [x, *module.parameters()]

    def loss_and_grads(fn: typing.Callable[[torch.Tensor], typing.Any]) -> list[typing.Any]:
        # An error is an outcome: where torch raises (oneDNN without bfloat16 RNN support), famp
        # must raise the same.
        try:
            out, hidden, inner_dtype = fn(x)
            hs = hidden if isinstance(hidden, tuple) else (hidden,)
            loss = out.sum() + sum(h.pow(2).sum() for h in hs)
            return [inner_dtype, out, *hs, *torch.autograd.grad(loss, params)]
        except RuntimeError as e:
            return [f"{type(e).__name__}: {e}"]

    def run(x: torch.Tensor) -> typing.Any:
        out, hidden = module(x)
        return out, hidden, str(out.dtype)  # the dtype the RNN computed in

    def under_torch(x: torch.Tensor) -> typing.Any:
        with torch.autocast("cpu", dtype=dtype):
            out, hidden, inner_dtype = run(x)
        # famp's policy below casts floating outputs to float32 (exact from any dtype)
        return out.float(), torch_pytree.tree_map(lambda h: h.float(), hidden), inner_dtype

    expected = loss_and_grads(under_torch)
    rules = famp.default_rules("cpu").override({"cholesky_solve": "lower"})
    bad = []
    for label, kwargs in (("default rules", {}), ("override", {"rules": rules})):
        policy = f"c={short},o=f32"
        got = loss_and_grads(famp.autocast(run, policy, compile=False, **kwargs))
        if len(got) != len(expected):
            bad.append(f"{kind} {dtype_name} {label}: {got[0]!r} vs torch's {expected[0]!r}")
            continue
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            try:
                if isinstance(e, str):  # an error, or the dtype the RNN computed in
                    assert g == e
                else:
                    assert_bitwise_equal(g, e)
            except AssertionError:
                bad.append(f"{kind} {dtype_name} {label}: output {i} differs")
    return bad


@pytest.mark.parametrize("mkldnn", [True, False], ids=["onednn", "native"])
@pytest.mark.parametrize(("kind", "dtype"), RNN_CASES)
def test_gru_lstm_under_famp_autocast_equal_torch_autocast_bitwise(
    kind: str, dtype: str, mkldnn: bool
) -> None:
    before = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = mkldnn  # flags() warns about TF32 on CPU-only builds
    try:
        assert rnn_mismatches(kind, dtype) == []
    finally:
        torch.backends.mkldnn.enabled = before


@pytest.mark.slow
def test_gru_lstm_equal_torch_on_a_cpu_without_avx512_bf16() -> None:
    root = pathlib.Path(__file__).resolve().parents[2]
    code = (
        "import torch, tests.autocast.test_rules as t\n"
        "assert not torch.backends.mkldnn.is_available() or not "
        "torch.ops.mkldnn._is_mkldnn_bf16_supported()\n"
        "print(sum((t.rnn_mismatches(k, d) for k, d in t.RNN_CASES), []))\n"
    )
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "PYTHONPATH": str(root)}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_rules_data_holds_the_tables_in_the_form_the_generator_writes() -> None:
    # python -m famp._autocast.rules_derive rewrites rules_data.py with tables.store: one base
    # release in full, the other releases as changes to it, xpu as changes to cuda's table.
    from famp._autocast import rules_data

    text = pathlib.Path(rules_data.__file__).read_text()
    assert text.endswith(famp_tables.store(TABLES))
    assert min(TABLES, key=famp_tables.release_key) == rules_data.BASE_RELEASE
    assert set(rules_data.CHANGES) == set(TABLES) - {rules_data.BASE_RELEASE}
    assert "xpu" not in rules_data.BASE
    # Each release's changes are those between its tables and the base release's.
    for release, by_device in rules_data.CHANGES.items():
        for device, table in TABLES[release].items():
            base = famp_tables.by_key(TABLES[rules_data.BASE_RELEASE][device])
            changes = famp_tables.changes_between(base, famp_tables.by_key(table))
            assert by_device.get(device, {}) == changes


@pytest.mark.parametrize("protocol", range(2, pickle.HIGHEST_PROTOCOL + 1))
def test_a_pickle_names_public_famp_only(protocol: int) -> None:
    # A pickle that named a private module would not load after famp reorganizes its internals
    # (as one made before famp/_autocast/ existed, naming famp._rules, no longer does).
    rules = famp.default_rules("cpu").override({"mm": "float32"})
    data = pickle.dumps(rules, protocol=protocol)
    assert b"famp._" not in data
    assert b"_autocast" not in data
    assert pickle.loads(data) == rules


# --- views: no cast that would make them views of a copy ------------------------------------

VIEW_OPS = ["view", "reshape", "transpose", "t", "select", "narrow", "split", "unsqueeze", "expand"]


@pytest.mark.parametrize("op", VIEW_OPS)
@pytest.mark.parametrize("rule", ["lower", "float32", "promote"])
def test_a_casting_rule_for_an_op_returning_a_view_is_refused(op: str, rule: str) -> None:
    """A cast input would make the result a view of a copy: a write through it would be lost
    (torch's autocast casts no such op). Refused in every constructor, nothing applied."""
    assert _returns_a_view(op)
    base = _refused_by_every_constructor(op, rule, "view")
    assert base.override({op: "banned"})[op] == "banned"  # neither casts
    assert base.override({op: "keep"}) == base


def test_a_view_op_torch_itself_casts_keeps_its_rule_and_takes_others_on_that_device() -> None:
    """torch's CPU autocast registers `view_as_complex` (float32): famp's table follows it and
    accepts other casting rules for it there, as torch already casts its input; on a device
    whose autocast does not cast it, a casting rule is refused."""
    registered = _registered("cpu")
    assert ("view_as_complex", "default") in registered
    assert _returns_a_view("view_as_complex")
    cpu = famp.default_rules("cpu")
    assert cpu.lookup("view_as_complex") == "float32"
    assert cpu.override({"view_as_complex": "lower"}).lookup("view_as_complex") == "lower"
    assert ("view_as_complex", "default") not in _registered("cuda")
    with pytest.raises(ValueError, match=r"view_as_complex.*view of its input"):
        famp.default_rules("cuda").override({"view_as_complex": "float32"})


def test_a_casting_rule_for_a_view_would_lose_a_write_through_it() -> None:
    """Why the refusal: torch's own autocast, which casts `view_as_complex` on the CPU, returns
    a view of a float32 copy of a bfloat16 input, so a write through the result is lost."""
    x = torch.randn(3, 2, dtype=torch.bfloat16)
    before = x.clone()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.view_as_complex(x).mul_(2)
    assert torch.equal(x, before)  # lost
    x.view(-1).mul_(2)
    assert torch.equal(x, before * 2)  # a plain view writes through


# Composites whose schemas mark no alias but which return their input, or a view of it: the
# premise read off torch by calling each (`Tensor.type_as` of the same dtype returns the tensor).
_RETURNS_INPUT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "type_as": lambda t: t.type_as(t),
    "atleast_1d": torch.atleast_1d,
    "broadcast_tensors": lambda t: torch.broadcast_tensors(t, t)[0],
    "meshgrid": lambda t: torch.meshgrid(t, indexing="ij")[0],
}


@pytest.mark.parametrize("op", list(_RETURNS_INPUT))
def test_a_casting_rule_for_a_composite_returning_its_input_is_refused(op: str) -> None:
    """The schema says nothing, torch's behaviour does: famp probes such composites on the
    installed torch, and refuses a cast that would make their result a copy's."""
    t = torch.ones(3)
    result = _RETURNS_INPUT[op](t)
    assert result.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    assert not _returns_a_view(op)  # the schema does not say it
    for device in ("cpu", "cuda"):
        with pytest.raises(ValueError, match=rf"op '{op}'.*the input itself"):
            famp.default_rules(device).override({op: "float32"})
    assert famp.default_rules("cpu").override({op: "keep"}) == famp.default_rules("cpu")


_NEW_TENSORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "cosine_similarity": lambda t: torch.cosine_similarity(t, t, dim=0),
    "kron": lambda t: torch.kron(t, t),
    "inner": lambda t: torch.inner(t, t),
    "outer": lambda t: torch.outer(t, t),
}


@pytest.mark.parametrize("op", list(_NEW_TENSORS))
def test_composites_that_return_new_tensors_take_casting_rules(op: str) -> None:
    """The probe refuses only what aliases: composites of tensor arguments that compute new
    tensors (read off torch: their results share no memory with their inputs), which torch's
    CPU autocast does not list, take any rule there."""
    t = torch.ones(3)
    assert _NEW_TENSORS[op](t).untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    assert (op, "default") not in _registered("cpu")
    assert famp.default_rules("cpu").override({op: "float32"})[op] == "float32"


# --- in-place and out= overloads: run as given, so only "keep" applies -----------------------

MUTATING = ["mm.out", "add.out", "add_.Tensor", "relu_", "relu_.default", "linear.out"]


@pytest.mark.parametrize("op", MUTATING)
@pytest.mark.parametrize("rule", [r for r in famp.RULE_NAMES if r != "keep"])
def test_a_rule_for_an_in_place_or_out_overload_is_refused(op: str, rule: str) -> None:
    """famp, like torch.autocast, runs in-place and out= overloads as given: before 2026-12-01
    `{"mm.out": "lower"}` was accepted (lookup said 'lower') and never applied. Refused in every
    constructor, nothing applied; "keep" is accepted and changes nothing."""
    base = _refused_by_every_constructor(op, rule, "out=")
    assert base.override({op: "keep"}) == base


def test_in_place_and_out_overloads_run_as_given_as_under_torch_autocast() -> None:
    """Why the refusal: torch.autocast runs `mm(out=)` and `add_` in the given dtypes, and so
    does famp.autocast (bitwise), whatever the rules could say."""
    x = torch.tensor([[1.2345678, 2.3456789]])
    w = torch.tensor([[3.3333333], [1.1111111]])

    def fn(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.mm(a, b, out=torch.empty(1, 1)), a.clone().add_(b.T)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = fn(x, w)
    for got, want, plain in zip(
        famp.autocast(fn, "c=bf16,o=f32", device_type="cpu")(x, w), expected, fn(x, w), strict=True
    ):
        assert_bitwise_equal(got, want)
        assert_bitwise_equal(got, plain)


def test_an_op_named_twice_in_rule_pairs_is_refused() -> None:
    """Before 2026-12-01 the last of two rules for one op won silently, as a dict keeps it."""
    for pairs in ([("mm", "lower"), ("mm", "float32")], [("mm.out", "keep"), ("mm.out", "keep")]):
        with pytest.raises(ValueError, match=rf"rules name op '{pairs[0][0]}' twice"):
            famp.OpRules(pairs, device_type="cpu")
    pairs = [("mm", "lower"), ("mm.default", "float32")]  # a packet and its overload: two keys
    assert famp.OpRules(pairs, device_type="cpu").lookup("mm") == "float32"


def _refused_by_every_constructor(op: str, rule: str, why: str) -> famp.OpRules:
    """`{op: rule}` is refused by `override`, `OpRules` and `from_dict` with a ValueError naming
    both and `why`, nothing applied; the default rules it was offered to."""
    base = famp.default_rules("cpu")
    for build in (
        lambda: base.override({op: rule}),
        lambda: famp.OpRules({op: rule}, device_type="cuda"),
        lambda: famp.OpRules.from_dict({"device_type": "cpu", "rules": {op: rule}}),
    ):
        with pytest.raises(
            ValueError, match=rf"rule '{rule}' does not apply to op '{op}'.*{re.escape(why)}"
        ):
            build()
    assert base == famp.default_rules("cpu")
    return base
