"""famp.autocast composed with what users wrap around it or run inside it: the composition matrix.

Each cell compares famp bit for bit with its reference: with the default rules `torch.autocast`
on the same model in the same composition; with overrides or module rules, the same rules on the
plain eager run. docs/autocast.md's "Compatibility" table names the test of each cell.
"""

from __future__ import annotations

import copy
import pathlib
import socket
import subprocess
import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import famp
from tests.helpers import assert_bitwise_equal

BF16 = torch.bfloat16

# --- the weight-cast cache against writes through aliases -----------------------------------------
# Reference: the same function under torch.autocast with torch's cast cache off, where every use
# casts the weight afresh.


def _write_data(lin: nn.Linear) -> None:
    lin.weight.data.add_(1.0)


def _write_detach(lin: nn.Linear) -> None:
    lin.weight.detach().add_(1.0)


def _write_state_dict(lin: nn.Linear) -> None:
    sd = lin.state_dict()
    sd["weight"].copy_(sd["weight"] * 0.5 + 1.0)


def _write_foreach(lin: nn.Linear) -> None:
    torch._foreach_mul_([p.detach() for p in lin.parameters()], 2.0)


def _write_view_no_grad(lin: nn.Linear) -> None:
    lin.weight.view(-1).add_(1.0)


def _write_data_set(lin: nn.Linear) -> None:
    lin.weight.data = lin.weight.data + 1.0


def _write_swa(lin: nn.Linear) -> None:
    # AveragedModel's EMA update: `_foreach_lerp_` (or copy_) on the averaged parameters' detach().
    torch._foreach_lerp_(
        [p.detach() for p in lin.parameters()], [torch.ones_like(p) for p in lin.parameters()], 0.5
    )


ALIAS_WRITES: dict[str, Callable[[nn.Linear], None]] = {
    "data": _write_data,
    "detach": _write_detach,
    "state_dict": _write_state_dict,
    "foreach_detached": _write_foreach,
    "view_made_under_no_grad": _write_view_no_grad,
    "data_assignment": _write_data_set,
    "ema_lerp": _write_swa,
}


def _write_between_uses(write: Callable[[nn.Linear], None]) -> tuple[nn.Linear, Callable[..., Any]]:
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        first = lin(x)
        with torch.no_grad():
            write(lin)
        return first, lin(x)

    return lin, f


@pytest.mark.parametrize("kind", ["track_casts", "override", "module_rule"])
@pytest.mark.parametrize("write", sorted(ALIAS_WRITES))
def test_cast_cache_sees_writes_through_aliases(write: str, kind: str) -> None:
    x = torch.randn(4, 8)
    lin, f = _write_between_uses(ALIAS_WRITES[write])
    state = copy.deepcopy(lin.state_dict())
    options: dict[str, Any] = {
        "track_casts": {"track_casts": True},
        "override": {"rules": famp.default_rules("cpu").override({"rms_norm": "lower"})},
        "module_rule": {
            "module_rules": {"": "c=bf16,o=bf16"}
        },  # "": the module f calls  # the Linear is the root
    }[kind]
    first, second = famp.autocast(f, "c=bf16,o=bf16", **options)(x)
    lin.load_state_dict(state)
    with torch.autocast("cpu", dtype=BF16, cache_enabled=False):
        ref_first, ref_second = f(x)
    assert second.dtype == BF16
    assert ref_second.dtype == BF16
    assert_bitwise_equal(first, ref_first)
    assert_bitwise_equal(second, ref_second)
    assert not torch.equal(second, first)  # the write changed the weight: a stale cast would show


def test_the_reference_for_alias_writes_differs_from_torch_autocast_with_its_cache() -> None:
    # The cells above can fail: torch's own cache reads the stale cast after a write via `.data`.
    x = torch.randn(4, 8)
    _, f = _write_between_uses(_write_data)
    with torch.autocast("cpu", dtype=BF16):
        first, second = f(x)
    assert_bitwise_equal(first, second)


# --- torch's inference fast paths (nn.TransformerEncoder, nn.MultiheadAttention) -----------------
# In eval mode without grad torch runs these on fused kernels unless an argument "has a torch
# function", which famp's op interception would make true. famp leaves them to torch.


def _encoder(nested: bool) -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # enable_nested_tensor's notes about its own conditions
        return nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested).eval()


def _padding_mask() -> torch.Tensor:
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[0, 3:] = True
    return mask


FAST_PATH_OPTIONS: dict[str, dict[str, Any]] = {
    "track_casts": {"track_casts": True},
    # A rule casts the module's inputs: the reference casts them too.
    "module_rule": {"module_rules": {"": "c=bf16,o=bf16"}},  # "": the module f calls
}


@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("kind", sorted(FAST_PATH_OPTIONS))
@pytest.mark.parametrize("module", ["encoder", "attention"])
def test_inference_fast_path_gives_torch_autocast_bits(
    module: str, kind: str, grad_mode: str
) -> None:
    x, mask = torch.randn(3, 5, 16), _padding_mask()
    if module == "encoder":
        enc = _encoder(nested=False)

        def f(x: torch.Tensor) -> torch.Tensor:
            return enc(x, src_key_padding_mask=mask)
    else:
        torch.manual_seed(0)
        mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()

        def f(x: torch.Tensor) -> torch.Tensor:
            return mha(x, x, x, key_padding_mask=mask, need_weights=False)[0]

    context = torch.no_grad if grad_mode == "no_grad" else torch.inference_mode
    with context():
        with torch.autocast("cpu", dtype=BF16):
            expected = f(x.to(BF16) if kind == "module_rule" else x)
        actual = famp.autocast(f, "c=bf16,o=bf16", **FAST_PATH_OPTIONS[kind])(x)
    assert actual.dtype == BF16
    assert_bitwise_equal(actual, expected)


def test_inference_fast_path_with_overrides_warns_that_they_do_not_apply_there() -> None:
    x, mask = torch.randn(3, 5, 16), _padding_mask()
    enc = _encoder(nested=False)
    rules = famp.default_rules("cpu").override({"linear": "float32"})
    with torch.no_grad():
        with torch.autocast("cpu", dtype=BF16):
            expected = enc(x, src_key_padding_mask=mask)
        f = famp.autocast(lambda x: enc(x, src_key_padding_mask=mask), "c=bf16,o=bf16", rules=rules)
        with pytest.warns(famp.AutocastWarning, match="overrides do not apply inside"):
            actual = f(x)
        assert_bitwise_equal(actual, expected)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            f(x)  # once per transform
    # With grad, torch takes the composite path and the override applies (linear in float32).
    with torch.autocast("cpu", dtype=BF16):
        composite = enc(x, src_key_padding_mask=mask)
    assert not torch.equal(f(x), composite.to(BF16))


def test_nested_tensor_fast_path_fails_as_under_torch_autocast() -> None:
    # torch's fused encoder layer rejects bfloat16 activations with nested tensors on CPU; famp
    # leaves the path to torch, so it fails (or works) exactly where torch.autocast does.
    x, mask = torch.randn(3, 5, 16), _padding_mask()
    enc = _encoder(nested=True)
    f = famp.autocast(lambda x: enc(x, src_key_padding_mask=mask), "c=bf16", track_casts=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's prototype note on nested tensors
        with pytest.raises(RuntimeError) as theirs, torch.autocast("cpu", dtype=BF16):
            enc(x, src_key_padding_mask=mask)
        with pytest.raises(RuntimeError) as ours:
            f(x)
    assert str(ours.value) == str(theirs.value)


def test_nested_tensor_fast_path_in_float32_zeroes_padded_rows_as_torch_does() -> None:
    x, mask = torch.randn(3, 5, 16), _padding_mask()
    enc = _encoder(nested=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's prototype note on nested tensors
        expected = enc(x, src_key_padding_mask=mask)
        actual = famp.autocast(
            lambda x: enc(x, src_key_padding_mask=mask), "f32", track_casts=True
        )(x)
    assert actual.dtype == torch.float32
    assert_bitwise_equal(actual, expected)
    assert not actual[0, 3:].any()  # the fused path's zeros for padded rows


# --- module rules that match nothing: wrappers' path prefixes ------------------------------------


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


class Wrapper(nn.Module):  # what DistributedDataParallel does to paths: `module.` in front
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def test_a_module_rule_that_matches_nothing_warns_once_naming_the_prefixed_path() -> None:
    torch.manual_seed(0)
    model, x = Head(), torch.randn(4, 6)
    wrapped = Wrapper(model)
    f = famp.autocast(wrapped, "c=bf16,o=f32", module_rules={"head": "f32"})
    with pytest.warns(famp.AutocastWarning, match=r"'head' \(nearest module paths: 'module\.head'"):
        f(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f(x)  # once per transform
    # The rule written for the wrapper gives the unwrapped model's bits.
    for rules, fn in [({"module.head": "f32"}, wrapped), ({"*head": "f32"}, wrapped)]:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            actual = famp.autocast(fn, "c=bf16,o=f32", module_rules=rules)(x)
        expected = famp.autocast(model, "c=bf16,o=f32", module_rules={"head": "f32"})(x)
        assert_bitwise_equal(actual, expected)


def test_a_module_rule_in_a_function_that_calls_no_module_warns() -> None:
    f = famp.autocast(lambda x: x * 2, "c=bf16", module_rules={"head": "f32"})
    with pytest.warns(famp.AutocastWarning, match=r"'head' \(no module was called\)"):
        f(torch.ones(2))


# --- DDP, FSDP2, FSDP1 on 2 gloo ranks: one torchrun job (tests/compose_worker.py) ----------------

WORKER = pathlib.Path(__file__).with_name("compose_worker.py")
DISTRIBUTED_CELLS = [
    "ddp_default",
    "ddp_module_rule",
    "fsdp2_default",
    "fsdp2_module_rule",
    "fsdp1_default",
    "fsdp1_module_rule",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("compose_job")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        str(WORKER),
        str(out),
    ]
    root = WORKER.parents[1]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False, cwd=root)
    # Judged by what the ranks recorded: gloo's teardown sometimes aborts a finished process.
    files = [out / f"rank{r}.pt" for r in range(2)]
    assert all(f.exists() for f in files), proc.stdout[-3000:] + proc.stderr[-6000:]
    return [torch.load(f, weights_only=False) for f in files]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("cell", DISTRIBUTED_CELLS)
def test_distributed_cell_gives_its_references_bits(ranks: list[dict[str, Any]], cell: str) -> None:
    for record in ranks:
        result = record[cell]
        assert "error" not in result, result.get("error")
        assert len(result["actual"]) == len(result["expected"])
        for actual, expected in zip(result["actual"], result["expected"], strict=True):
            assert_bitwise_equal(actual, expected)
        assert result["actual"][0].dtype == torch.float32  # the loss


@pytest.mark.slow
@pytest.mark.distributed
def test_a_module_rule_on_a_ddp_model_without_its_prefix_warns(
    ranks: list[dict[str, Any]],
) -> None:
    for record in ranks:
        assert "error" not in record["ddp_unprefixed_warns"]
        (message,) = record["ddp_unprefixed_warns"]["warnings"]
        assert "'head' (nearest module paths: 'module.head')" in message
