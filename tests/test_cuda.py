"""Checks that need a CUDA GPU: famp on CUDA against torch on CUDA, bit for bit.

Every test here is marked ``cuda`` and skips where ``torch.cuda.is_available()`` is false
(tests/conftest.py). ``bash .ci/cuda`` runs them, failing instead of skipping, together with the
CUDA benchmark. docs/torch-versions.md says where and on which torch they last ran.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
from torch.func import functional_call
from torch.nn import functional

import famp
from famp._autocast.defaults import WRAPPER_RULES
from tests.autocast.autocast_reference import check_op
from tests.helpers import assert_bitwise_equal

pytestmark = pytest.mark.cuda

CUDA = "cuda"
LR = 0.1


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return net.to(CUDA)


def _batch(step: int, bad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(6, 8, generator=gen)
    y = torch.randint(0, 4, (6,), generator=gen)
    if bad:
        x[0, 0] = math.inf
    return x.to(CUDA), y.to(CUDA)


@functools.cache
def _shared_model() -> torch.nn.Module:
    return _model()  # built on first use: collection must not touch CUDA


def _famp_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model = _shared_model()
    forward = famp.autocast(  # eager, as the GradScaler run (CUDA inputs compile by default)
        lambda x: functional_call(model, params, (x,)), "c=f16,o=f32", compile=False
    )
    logits = forward(x)
    return functional.cross_entropy(logits, y)


def test_fp16_loss_scaling_on_cuda_equals_gradscaler_bitwise() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    config: dict[str, Any] = {"init_scale": 2.0**16, "growth_interval": 2}
    scaler = torch.amp.GradScaler(CUDA, **config)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = famp.init_scaler(**config, device=CUDA)
    step = famp.value_and_grad(_famp_loss)
    for i, bad in enumerate([False, True, False, False, True, False]):
        x, y = _batch(i, bad)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(CUDA, dtype=torch.float16):
            expected_loss = functional.cross_entropy(model(x).float(), y)
        scaler.scale(expected_loss).backward()
        scaler.step(opt)
        scaler.update()

        loss, grads, found_inf, state = step(state, params, x, y)
        new = {k: torch.add(p, grads[k], alpha=-LR) for k, p in params.items()}
        params = famp.skip_on_overflow(found_inf, new, params)

        assert_bitwise_equal(loss, expected_loss.detach())
        assert found_inf.item() == float(bad)
        assert_bitwise_equal(state.scale, scaler._scale)
        for k, p in model.named_parameters():
            assert_bitwise_equal(params[k], p.detach())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_cuda_rules_cast_as_torch_cuda_autocast_on_real_tensors(dtype: torch.dtype) -> None:
    """Every op of the CUDA table on real CUDA tensors: same casts, dtypes, errors and bits."""
    rules = famp.default_rules(CUDA)
    wrong = []
    for packet, overload in sorted(famp._autocast.tables.registered_ops(CUDA)):
        if (packet, overload) in WRAPPER_RULES[CUDA]:
            continue
        name = packet if overload == "default" else f"{packet}.{overload}"
        rule = rules.lookup(packet, overload)
        if rule not in check_op(CUDA, name, dtype, (rule,), fake=False)[0]:
            wrong.append((name, rule))
    assert wrong == []


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_cudnn_rnn_under_famp_autocast_equals_torch_autocast_bitwise(kind: str) -> None:
    """torch's hand-written cuDNN RNN wrapper runs under famp.autocast, overrides or not."""
    torch.manual_seed(0)
    module = getattr(torch.nn, kind)(5, 4, num_layers=2).to(CUDA)
    x = torch.randn(3, 2, 5, device=CUDA, requires_grad=True)

    def run(x: torch.Tensor) -> Any:
        out, _ = module(x)
        return out, str(out.dtype)

    with torch.autocast(CUDA, dtype=torch.float16):
        expected, expected_dtype = run(x)
    rules = famp.default_rules(CUDA).override({"cholesky_solve": "lower"})
    for kwargs in ({}, {"rules": rules}):
        out, dtype = famp.autocast(run, "c=f16,o=f16", compile=False, **kwargs)(x)
        assert dtype == expected_dtype
        assert_bitwise_equal(out, expected.half())


# The model is an argument: Dynamo refuses to trace a call of the cached `_shared_model` (a
# warning, an error under the suite's filterwarnings).
def _mlp_loss_torch(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast(CUDA, dtype=torch.float16):
        return model(x).float().pow(2).sum()


def _mlp_loss_famp(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    # torch.compile around it compiles the whole step, as it does the torch.autocast one
    return famp.autocast(model, "c=f16,o=f32", compile=False)(x).pow(2).sum()


def test_compiled_autocast_step_on_cuda_equals_compiled_torch_autocast_bitwise() -> None:
    """The transform compiled by inductor (Triton kernels) against compiled torch.autocast."""
    x = torch.randn(32, 8, device=CUDA)
    model = _shared_model()
    params = list(model.parameters())
    expected = torch.compile(_mlp_loss_torch, fullgraph=True)(model, x)
    e_grads = torch.autograd.grad(expected, params)
    actual = torch.compile(_mlp_loss_famp, fullgraph=True)(model, x)
    grads = torch.autograd.grad(actual, params)
    assert_bitwise_equal(actual, expected)
    for g, e in zip(grads, e_grads, strict=True):
        assert_bitwise_equal(g, e)


def test_mixed_devices_read_no_copy_before_it_arrives() -> None:
    # CPU-offloaded grads with a CUDA scale (and the reverse): every value that crosses to the CPU
    # must have arrived before a CPU op reads it. A kernel that keeps the GPU busy runs first, so
    # an asynchronous device-to-host copy would still be pending when the CPU op reads its target.
    grads = {"w": torch.tensor([8.0, 16.0]), "b": torch.tensor([math.inf, 4.0])}
    for scale_on, grads_on in ((CUDA, "cpu"), ("cpu", CUDA)):
        state = famp.init_scaler(4.0, growth_interval=1, device=scale_on)
        tree = {k: v.to(grads_on) for k, v in grads.items()}
        torch.cuda._sleep(1 << 30)  # about a second of GPU time, queued ahead of the copies
        out, found_inf = famp.unscale_and_check(state, tree)
        new_state = famp.update_scale(state, found_inf)
        kept = famp.skip_on_overflow(found_inf, out, tree)
        scaled = famp.scale(state, tree)
        assert out["w"].tolist() == [2.0, 4.0]
        assert found_inf.item() == 1.0
        assert new_state.scale.item() == 2.0
        assert kept["w"].tolist() == [8.0, 16.0]
        assert scaled["w"].tolist() == [32.0, 64.0]


class _Scaled(torch.nn.Module):
    """Ops autocast does not cast, so only a module rule's cast can; sorted, so that compiled,
    the product is stored in its dtype (fused, inductor keeps it in float32 either way)."""

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        return torch.sort(x * (x if scale is None else scale), dim=-1).values


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(8, 16)
        self.b = _Scaled()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        y = self.b(x=h, scale=self.a(x * 0.7))  # keyword inputs of the matched module
        return torch.softmax(y, dim=-1) + torch.log_softmax(h, dim=-1)


def _block_by_hand(block: _Block, x: torch.Tensor) -> torch.Tensor:
    """The policy, the module rule (`b` in float32) and the override, written with torch."""
    with torch.autocast(CUDA, dtype=torch.float16):
        h, g = block.a(x), block.a(x * 0.7)
        with torch.autocast(CUDA, enabled=False):
            y = torch.sort(h.float() * g.float(), dim=-1).values  # not rounded to float16
            return torch.softmax(y, dim=-1) + torch.log_softmax(h, dim=-1)  # overridden: "lower"


@pytest.mark.parametrize("compile", [False, None], ids=["eager", "famps-own-compile"])
def test_module_rules_overrides_and_keyword_inputs_on_cuda_equal_torch_by_hand(
    compile: bool | None,
) -> None:
    """On CUDA famp.autocast compiles by default: module rules, keyword inputs and an override
    give torch's bits there (Triton kernels) as eagerly, outputs and gradients."""
    block = _Block().to(CUDA)
    x = torch.randn(32, 8, device=CUDA)
    rules = famp.default_rules(CUDA).override({"log_softmax": "lower"})
    f = famp.autocast(
        block, "c=f16,o=f32", rules=rules, module_rules={"b": "c=f32"}, compile=compile
    )
    by_hand = _block_by_hand if compile is False else torch.compile(_block_by_hand, fullgraph=True)
    params = list(block.parameters())
    expected = by_hand(block, x)
    e_grads = torch.autograd.grad(expected.sum(), params)
    for _ in range(2):  # the second call runs what the first built
        actual = f(x)
        assert actual.dtype == torch.float32
        assert_bitwise_equal(actual, expected)
        grads = torch.autograd.grad(actual.sum(), params)
        for g, e in zip(grads, e_grads, strict=True):
            assert_bitwise_equal(g, e)
    assert not block.b._forward_pre_hooks  # famp's keyword hook came off with the root's exit


class _NoisySGD(torch.optim.Optimizer):
    """Gradient noise drawn on the parameters' device (SGLD): on CUDA, from torch's CUDA
    generator, which a skipped step must leave where a GradScaler loop leaves it."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": LR})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(group["lr"] * p.grad + 1e-3 * torch.randn_like(p))


def _noisy_loop(famp_side: bool, pattern: list[bool]) -> list[tuple[Any, ...]]:
    model = _model()
    opt = _NoisySGD(model.parameters())
    torch.cuda.manual_seed(3)
    scaler = torch.amp.GradScaler(CUDA, init_scale=2.0**10, growth_interval=2)
    state = famp.init_scaler(2.0**10, growth_interval=2, device=CUDA)
    seen = []
    for i, bad in enumerate(pattern):
        x, y = _batch(i, bad)
        opt.zero_grad()
        loss = functional.cross_entropy(functional.dropout(model(x), 0.1), y)  # a CUDA draw too
        (famp.scale(state, loss) if famp_side else scaler.scale(loss)).backward()
        if famp_side:
            state = famp.update_scale(state, famp.optimizer_step(opt, state))
        else:
            scaler.step(opt)
            scaler.update()
        params = [p.detach().clone() for p in model.parameters()]
        seen.append((params, torch.cuda.get_rng_state(), torch.get_rng_state()))
    return seen


def test_optimizer_step_leaves_the_cuda_generator_as_gradscaler_never_steps() -> None:
    """A skipped step of an optimizer drawing on CUDA: its draws are undone, so the parameters
    and every later draw (the next batch's dropout masks) equal a GradScaler loop's, bit for
    bit (tests/scaling/test_optimizer_step_nested.py checks the CPU generators)."""
    pattern = [False, True, False, True, True, False, False]
    expected, actual = _noisy_loop(False, pattern), _noisy_loop(True, pattern)
    for (params, cuda_rng, cpu_rng), (e_params, e_cuda_rng, e_cpu_rng) in zip(
        actual, expected, strict=True
    ):
        for p, e in zip(params, e_params, strict=True):
            assert_bitwise_equal(p, e)
        assert torch.equal(cuda_rng, e_cuda_rng)
        assert torch.equal(cpu_rng, e_cpu_rng)
