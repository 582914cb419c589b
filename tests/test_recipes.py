"""docs/recipes.md: torch's "Automatic Mixed Precision examples" as famp code, each against torch.

Every recipe runs twice on the same data: torch's code (``torch.autocast`` + ``GradScaler``) and
the famp code of docs/recipes.md, with an overflow injected at a chosen step; parameters,
gradients, optimizer state and the scale must agree bit for bit after every step.
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.nn import functional

import famp
from tests.helpers import assert_bitwise_equal, rank_files, torchrun

ROOT = pathlib.Path(__file__).resolve().parents[1]
POLICY = famp.get_policy("params=float32,compute=bfloat16,output=float32")
STEPS, BAD = 6, frozenset({1, 4})  # overflows at steps 1 and 4
SCALER = {"init_scale": 2.0**10, "growth_interval": 2}  # grows, overflows, backs off


def net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def data(steps: int = STEPS, bad: frozenset[int] = BAD) -> Iterator[tuple[torch.Tensor, ...]]:
    """Batches of ``(input, target)``; an inf in the input of the ``bad`` steps."""
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(6, 8, generator=gen), torch.randint(0, 4, (6,), generator=gen)
        if step in bad:
            x[0, 0] = math.inf
        yield x, y


loss_fn = functional.cross_entropy


def assert_same(models: tuple[torch.nn.Module, ...], expected: tuple[torch.nn.Module, ...]) -> None:
    for model, other in zip(models, expected, strict=True):
        for p, q in zip(model.parameters(), other.parameters(), strict=True):
            assert p.dtype == torch.float32
            assert_bitwise_equal(p.detach(), q.detach())
            assert (p.grad is None) == (q.grad is None)
            if p.grad is not None and q.grad is not None:
                assert_bitwise_equal(p.grad, q.grad)


def assert_same_optimizers(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].keys() == sb[k].keys()
        for name, value in sa[k].items():
            if isinstance(value, torch.Tensor):
                assert_bitwise_equal(value, sb[k][name])
            else:  # SparseAdam counts its steps in a Python int
                assert type(value) is type(sb[k][name])
                assert value == sb[k][name]


def assert_same_scale(state: famp.ScalerState, scaler: torch.amp.GradScaler) -> None:
    assert state.scale.dtype == torch.float32
    assert_bitwise_equal(state.scale, scaler._scale)
    assert_bitwise_equal(state.growth_tracker, scaler._growth_tracker)


# --- typical mixed precision training -----------------------------------------------------------


def test_recipe_typical_loop_equals_torch() -> None:
    model, torch_model = net(), net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch_optimizer = torch.optim.SGD(torch_model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    state = famp.init_scaler(**SCALER)

    def compute_loss(input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        output = model(input)  # what torch's `with autocast():` block holds
        return loss_fn(output, target)

    compute_loss = famp.autocast(compute_loss, POLICY)
    skipped = []
    for input, target in data():
        torch_optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            output = torch_model(input)
            loss = loss_fn(output, target)
        scaler.scale(loss).backward()
        scaler.step(torch_optimizer)
        scaler.update()

        optimizer.zero_grad()
        loss = compute_loss(input, target)
        famp.scale(state, loss).backward()
        found_inf = famp.optimizer_step(optimizer, state)
        state = famp.update_scale(state, found_inf)

        skipped.append(found_inf)
        assert_same((model,), (torch_model,))
        assert_same_optimizers(optimizer, torch_optimizer)
        assert_same_scale(state, scaler)
    assert [bool(s) for s in skipped] == [i in BAD for i in range(STEPS)]


# --- gradient clipping: unscale, clip, step -----------------------------------------------------


@pytest.mark.parametrize("fused", [False, True])
def test_recipe_gradient_clipping_equals_torch(fused: bool) -> None:
    model, torch_model = net(), net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    torch_optimizer = torch.optim.AdamW(torch_model.parameters(), lr=1e-2, fused=fused)
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    state = famp.init_scaler(**SCALER)
    compute_loss = famp.autocast(lambda input, target: loss_fn(model(input), target), POLICY)
    max_norm = 0.05
    for input, target in data():
        torch_optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(torch_model(input), target)
        scaler.scale(loss).backward()
        scaler.unscale_(torch_optimizer)
        torch.nn.utils.clip_grad_norm_(torch_model.parameters(), max_norm)
        scaler.step(torch_optimizer)
        scaler.update()

        optimizer.zero_grad()
        famp.scale(state, compute_loss(input, target)).backward()
        grads = [p.grad for p in model.parameters()]
        _, found_inf = famp.unscale_and_check(state, grads, donate=True)  # .grad unscaled
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        famp.optimizer_step(optimizer, found_inf=found_inf)  # unscaled grads: no state
        state = famp.update_scale(state, found_inf)

        assert_same((model,), (torch_model,))
        assert_same_optimizers(optimizer, torch_optimizer)
        assert_same_scale(state, scaler)


# --- gradient accumulation ----------------------------------------------------------------------


def test_recipe_gradient_accumulation_equals_torch() -> None:
    iters_to_accumulate = 3
    model, torch_model = net(), net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch_optimizer = torch.optim.Adam(torch_model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    state = famp.init_scaler(**SCALER)
    compute_loss = famp.autocast(
        lambda input, target: loss_fn(model(input), target) / iters_to_accumulate, POLICY
    )
    batches = list(data(steps=12, bad=frozenset({4})))  # the second window overflows
    for i, (input, target) in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(torch_model(input), target) / iters_to_accumulate
        scaler.scale(loss).backward()
        if (i + 1) % iters_to_accumulate == 0:
            scaler.step(torch_optimizer)
            scaler.update()
            torch_optimizer.zero_grad()

        famp.scale(state, compute_loss(input, target)).backward()
        if (i + 1) % iters_to_accumulate == 0:
            found_inf = famp.optimizer_step(optimizer, state)
            state = famp.update_scale(state, found_inf)
            optimizer.zero_grad()

        assert_same((model,), (torch_model,))
        assert_same_optimizers(optimizer, torch_optimizer)
        assert_same_scale(state, scaler)


# --- gradient penalty ---------------------------------------------------------------------------


def test_recipe_gradient_penalty_equals_torch() -> None:
    model, torch_model = net(), net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch_optimizer = torch.optim.SGD(torch_model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    state = famp.init_scaler(**SCALER)
    compute_loss = famp.autocast(lambda input, target: loss_fn(model(input), target), POLICY)

    def penalized(loss: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
        grad_norm = 0
        for grad in grads:
            grad_norm += grad.pow(2).sum()
        return loss + grad_norm.sqrt()  # type: ignore[attr-defined]

    penalized = famp.autocast(penalized, POLICY)
    for input, target in data():
        torch_optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(torch_model(input), target)
        scaled_grad_params = torch.autograd.grad(
            outputs=scaler.scale(loss), inputs=torch_model.parameters(), create_graph=True
        )
        inv_scale = 1.0 / scaler.get_scale()
        grad_params = [p * inv_scale for p in scaled_grad_params]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            grad_norm = 0
            for grad in grad_params:
                grad_norm += grad.pow(2).sum()
            grad_norm = grad_norm.sqrt()  # type: ignore[attr-defined]
            loss = loss + grad_norm
        scaler.scale(loss).backward()
        scaler.step(torch_optimizer)
        scaler.update()

        optimizer.zero_grad()
        loss = compute_loss(input, target)
        scaled_grads = torch.autograd.grad(
            famp.scale(state, loss), list(model.parameters()), create_graph=True
        )
        grads, _ = famp.unscale_and_check(state, list(scaled_grads))  # differentiable
        famp.scale(state, penalized(loss, grads)).backward()
        found_inf = famp.optimizer_step(optimizer, state)
        state = famp.update_scale(state, found_inf)

        assert_same((model,), (torch_model,))
        assert_same_scale(state, scaler)


# --- multiple models, losses and optimizers -----------------------------------------------------


def two_models_two_losses(
    model0: torch.nn.Module, model1: torch.nn.Module, input: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    output0 = model0(input)
    output1 = model1(input)
    loss0 = loss_fn(2 * output0 + 3 * output1, target)
    loss1 = loss_fn(3 * output0 - 5 * output1, target)
    return loss0, loss1


@pytest.mark.parametrize("overflowing", ["model0", "model1", "both"])
def test_recipe_multiple_models_losses_optimizers_equals_torch(overflowing: str) -> None:
    """Each optimizer skips on its own overflow; the scale updates once, on both."""
    model0, model1, torch_model0, torch_model1 = net(0), net(1), net(0), net(1)
    optimizer0 = torch.optim.SGD(model0.parameters(), lr=0.1, momentum=0.9)
    optimizer1 = torch.optim.Adam(model1.parameters(), lr=1e-2)
    torch_optimizer0 = torch.optim.SGD(torch_model0.parameters(), lr=0.1, momentum=0.9)
    torch_optimizer1 = torch.optim.Adam(torch_model1.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    state = famp.init_scaler(**SCALER)
    compute_losses = famp.autocast(
        lambda input, target: two_models_two_losses(model0, model1, input, target), POLICY
    )
    bad_models = {"model0": (0,), "model1": (1,), "both": (0, 1)}[overflowing]

    def inject(models: tuple[torch.nn.Module, ...], step: int) -> None:
        for i in bad_models if step in BAD else ():
            models[i][0].weight.grad[0, 0] = math.inf  # type: ignore[index]

    for step, (input, target) in enumerate(data(bad=frozenset())):
        torch_optimizer0.zero_grad()
        torch_optimizer1.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss0, loss1 = two_models_two_losses(torch_model0, torch_model1, input, target)
        scaler.scale(loss0).backward(retain_graph=True)
        scaler.scale(loss1).backward()
        inject((torch_model0, torch_model1), step)
        scaler.step(torch_optimizer0)
        scaler.step(torch_optimizer1)
        scaler.update()

        optimizer0.zero_grad()
        optimizer1.zero_grad()
        loss0, loss1 = compute_losses(input, target)
        famp.scale(state, loss0).backward(retain_graph=True)
        famp.scale(state, loss1).backward()
        inject((model0, model1), step)
        found_inf0 = famp.optimizer_step(optimizer0, state)
        found_inf1 = famp.optimizer_step(optimizer1, state)
        state = famp.update_scale(state, torch.maximum(found_inf0, found_inf1))

        assert found_inf0.item() == float(step in BAD and 0 in bad_models)
        assert found_inf1.item() == float(step in BAD and 1 in bad_models)
        assert_same((model0, model1), (torch_model0, torch_model1))
        assert_same_optimizers(optimizer0, torch_optimizer0)
        assert_same_optimizers(optimizer1, torch_optimizer1)
        assert_same_scale(state, scaler)


def test_autocast_around_the_models_only_gives_other_numbers_than_torch() -> None:
    """Where famp.autocast belongs: around what torch's `with autocast():` block holds.

    Wrapping each model alone casts its output to the policy's float32 before the loss
    arithmetic, which torch runs on the models' bfloat16 outputs.
    """
    model0, model1 = net(0), net(1)
    input, target = next(data())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = two_models_two_losses(model0, model1, input, target)
    right = famp.autocast(
        lambda input, target: two_models_two_losses(model0, model1, input, target), POLICY
    )(input, target)
    wrong = two_models_two_losses(
        famp.autocast(model0, POLICY), famp.autocast(model1, POLICY), input, target
    )
    for a, b, c in zip(right, wrong, expected, strict=True):
        assert a.dtype == b.dtype == c.dtype == torch.float32
        assert_bitwise_equal(a, c)
        assert not torch.equal(b, c)


# --- autocast and custom autograd functions -----------------------------------------------------


def mymm_classes(fwd: Callable[..., Any], bwd: Callable[..., Any]) -> type[torch.autograd.Function]:
    class MyMM(torch.autograd.Function):
        @staticmethod
        @fwd
        def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(a, b)
            return a.mm(b)

        @staticmethod
        @bwd
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            a, b = ctx.saved_tensors
            return grad.mm(b.t()), a.t().mm(grad)

    return MyMM


class WithMyMM(torch.nn.Module):
    def __init__(self, mm: type[torch.autograd.Function]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(8, 16)
        self.second = torch.nn.Parameter(torch.randn(16, 4) / 4)
        self.mm = mm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mm.apply(self.first(x).relu(), self.second)  # type: ignore[no-any-return]


@pytest.mark.parametrize("cast", ["keep", "float32"])
def test_recipe_custom_autograd_functions_equal_torch(cast: str) -> None:
    torch_kwargs = {"cast_inputs": torch.float32} if cast == "float32" else {}
    torch_mm = mymm_classes(
        torch.amp.custom_fwd(device_type="cpu", **torch_kwargs),  # type: ignore[arg-type]
        torch.amp.custom_bwd(device_type="cpu"),
    )
    famp_mm = mymm_classes(famp.custom_fwd(rule=cast), famp.custom_bwd)
    model, torch_model = WithMyMM(famp_mm), WithMyMM(torch_mm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch_optimizer = torch.optim.SGD(torch_model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    state = famp.init_scaler(**SCALER)
    compute_loss = famp.autocast(lambda input, target: loss_fn(model(input), target), POLICY)
    for input, target in data():
        torch_optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            output = torch_model(input)
            assert output.dtype == (torch.float32 if cast == "float32" else torch.bfloat16)
            loss = loss_fn(output, target)
        scaler.scale(loss).backward()
        scaler.step(torch_optimizer)
        scaler.update()

        optimizer.zero_grad()
        famp.scale(state, compute_loss(input, target)).backward()
        state = famp.update_scale(state, famp.optimizer_step(optimizer, state))

        assert_same((model,), (torch_model,))
        assert_same_scale(state, scaler)


# --- sparse gradients ---------------------------------------------------------------------------


class Bag(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(50, 8, sparse=True)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(tokens).mean(1))  # type: ignore[no-any-return]


def test_recipe_sparse_gradients_equal_torch() -> None:
    model, torch_model = Bag(), Bag()

    def optimizers(m: Bag) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        return (
            torch.optim.SparseAdam(m.embedding.parameters(), lr=1e-2),
            torch.optim.Adam(m.head.parameters(), lr=1e-2),
        )

    sparse, dense = optimizers(model)
    torch_sparse, torch_dense = optimizers(torch_model)
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    state = famp.init_scaler(**SCALER)
    compute_loss = famp.autocast(lambda tokens, target: loss_fn(model(tokens), target), POLICY)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        tokens, target = torch.randint(0, 50, (6, 5), generator=gen), torch.randint(0, 4, (6,))
        for m in (model, torch_model):
            m.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(torch_model(tokens), target)
        scaler.scale(loss).backward()
        if step in BAD:
            torch_model.head.weight.grad[0, 0] = math.inf  # type: ignore[index]
        scaler.step(torch_sparse)
        scaler.step(torch_dense)
        scaler.update()

        famp.scale(state, compute_loss(tokens, target)).backward()
        assert model.embedding.weight.grad is not None
        assert model.embedding.weight.grad.is_sparse
        if step in BAD:
            model.head.weight.grad[0, 0] = math.inf  # type: ignore[index]
        found_inf = torch.maximum(
            famp.optimizer_step(sparse, state), famp.optimizer_step(dense, state)
        )
        state = famp.update_scale(state, found_inf)

        assert_same((model,), (torch_model,))
        assert_same_optimizers(sparse, torch_sparse)
        assert_same_optimizers(dense, torch_dense)
        assert_same_scale(state, scaler)


# --- choosing a fast step: a pure fused AdamW ---------------------------------------------------


def fused_adamw(
    params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], opt: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """docs/recipes.md's pure AdamW: torch's fused kernel, out of place."""
    names = list(params)
    count = opt["count"] + 1
    new, _, mu, nu, _ = torch.ops.aten._fused_adamw(
        [params[k] for k in names],
        [grads[k] for k in names],
        opt["mu"],
        opt["nu"],
        [],
        [count] * len(names),
        lr=1e-2,
        beta1=0.9,
        beta2=0.999,
        weight_decay=1e-2,
        eps=1e-8,
        amsgrad=False,
        maximize=False,
    )
    return dict(zip(names, new, strict=True)), {"count": count, "mu": list(mu), "nu": list(nu)}


def test_recipe_pure_fused_adamw_equals_torch() -> None:
    """The functional step with the pure fused AdamW against `GradScaler` (with `unscale_`, so
    that the kernel gets unscaled gradients, as famp's) and `AdamW(fused=True)`: parameters,
    moments, step counts and scale bit for bit, skipped steps included."""
    model, torch_model = net(), net()
    torch_optimizer = torch.optim.AdamW(torch_model.parameters(), lr=1e-2, fused=True)
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    state = famp.init_scaler(**SCALER)
    params = {k: v.detach() for k, v in model.named_parameters()}
    zeros = [torch.zeros_like(p) for p in params.values()]
    opt: dict[str, Any] = {"count": torch.zeros(()), "mu": zeros, "nu": zeros}
    forward = famp.autocast(
        lambda params, input: torch.func.functional_call(model, params, (input,)), POLICY
    )
    value_and_grad = famp.value_and_grad(
        lambda p, input, target: loss_fn(forward(p, input), target)
    )
    skipped = []
    for input, target in data():
        torch_optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(torch_model(input), target)
        scaler.scale(loss).backward()
        scaler.unscale_(torch_optimizer)
        scaler.step(torch_optimizer)
        scaler.update()

        _, grads, found_inf, state = value_and_grad(state, params, input, target)
        update = fused_adamw(params, grads, opt)
        params, opt = famp.skip_on_overflow(found_inf, update, (params, opt))

        skipped.append(bool(found_inf))
        names = [k for k, _ in torch_model.named_parameters()]
        assert list(params) == names
        for i, (name, p) in enumerate(torch_model.named_parameters()):
            assert_bitwise_equal(params[name], p.detach())
            moments = torch_optimizer.state[p]
            assert_bitwise_equal(opt["mu"][i], moments["exp_avg"])
            assert_bitwise_equal(opt["nu"][i], moments["exp_avg_sq"])
            assert_bitwise_equal(opt["count"], moments["step"])
        assert_same_scale(state, scaler)
    assert skipped == [i in BAD for i in range(STEPS)]


# --- DDP on 2 gloo ranks ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.distributed
def test_recipe_ddp_on_two_gloo_ranks_equals_torch(tmp_path: pathlib.Path) -> None:
    rank_files(tmp_path, torchrun(ROOT / "tests" / "recipes_ddp_worker.py", tmp_path))
    for rank in range(2):
        record = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert record["famp_found_inf"].tolist() == [float(i in BAD) for i in range(STEPS)]
        for name, value in record["famp"].items():
            assert_bitwise_equal(value, record["torch"][name])
    other = torch.load(tmp_path / "rank1.pt", weights_only=True)["famp"]
    for name, value in torch.load(tmp_path / "rank0.pt", weights_only=True)["famp"].items():
        assert_bitwise_equal(value, other[name])  # DDP keeps the replicas equal
