"""Eager `famp.value_and_grad` unscales autograd's fresh gradients in place, and nothing else.

The oracle is torch: the same module trained with `GradScaler` (`scale(loss).backward()`, then
`unscale_`), whose gradients and `found_inf` famp's must equal bit for bit. The rest checks that
the in-place write reaches no tensor the user can see: a tensor a hook or a custom Function
returns (or a view of one), memory two gradients share, a leaf kept by the loss function.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode

import famp
import famp._compat
from tests.helpers import assert_bitwise_equal

Hooks = Callable[[dict[str, torch.Tensor]], None]


def mlp(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)]
    return torch.nn.Sequential(*layers).to(dtype)


def gradscaler_grads(
    model: torch.nn.Module, x: torch.Tensor, scale: float, hooks: Hooks = lambda p: None
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The model's gradients after `GradScaler`'s backward and `unscale_`, and its found_inf."""
    params = dict(model.named_parameters())
    hooks(params)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(model(x).square().mean()).backward()
    scaler.unscale_(optimizer)
    found = sum(v.item() for v in scaler._found_inf_per_device(optimizer).values())
    return {k: p.grad for k, p in params.items()}, torch.tensor(float(found))


def famp_grads(
    model: torch.nn.Module,
    x: torch.Tensor,
    scale: float,
    hooks: Hooks = lambda p: None,
    mode: TorchDispatchMode | None = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        hooks(p)
        return functional_call(model, p, (x,)).square().mean()

    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = famp.init_scaler(scale)
    with mode or contextlib.nullcontext():
        _, grads, found_inf, _ = famp.value_and_grad(loss_fn)(state, params, x)
    return grads, found_inf


def assert_same_grads(
    got: tuple[dict[str, torch.Tensor], torch.Tensor],
    expected: tuple[dict[str, torch.Tensor], torch.Tensor],
) -> None:
    assert list(got[0]) == list(expected[0])
    for k in expected[0]:
        assert_bitwise_equal(got[0][k], expected[0][k])
    assert_bitwise_equal(got[1], expected[1])


class _UnscaleWrites(TorchDispatchMode):
    """Records the data pointers the in-place unscale kernel writes, and copies of tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[int] = []
        self.copies: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        if "_amp_foreach_non_finite_check_and_unscale_" in name:
            self.written += [t.data_ptr() for t in args[0]]
        elif "clone" in name or "copy" in name:
            first = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            if any(t.numel() > 1 for t in first):  # not the 0-d scale
                self.copies.append(name)
        return func(*args, **(kwargs or {}))


@given(
    exponent=st.integers(-20, 40),
    odd=st.booleans(),
    spike=st.sampled_from([1.0, 1e30, math.inf, math.nan]),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
)
def test_fresh_grads_are_unscaled_in_place_with_gradscalers_bits(
    exponent: int, odd: bool, spike: float, dtype: torch.dtype
) -> None:
    scale = 2.0**exponent * (3.0 if odd else 1.0)  # not only powers of two
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(exponent)).to(dtype)
    x[0, 0] = spike  # 1e30 overflows the scaled loss, inf and NaN reach every gradient
    seen = _UnscaleWrites()
    got = famp_grads(mlp(dtype), x, scale, mode=seen)
    assert_same_grads(got, gradscaler_grads(mlp(dtype), x, scale))
    # autograd's own results, written once each by torch's kernel, none copied
    assert sorted(seen.written) == sorted(g.data_ptr() for g in got[0].values())
    assert seen.copies == []


class _Cast(torch.nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)


@given(
    exponent=st.integers(-20, 40),
    spike=st.sampled_from([1.0, 1e30, math.inf, math.nan]),
    wide_first=st.booleans(),
)
def test_grads_of_two_dtypes_are_unscaled_in_place_with_gradscalers_bits(
    exponent: int, spike: float, wide_first: bool
) -> None:
    """float64 and float32 parameters in one model: the kernel runs once per dtype, as in
    `GradScaler.unscale_`, with one `found_inf`; famp's one-dtype shortcut must not take them."""
    first, second = (torch.float64, torch.float32) if wide_first else (torch.float32, torch.float64)

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(6, 8).to(first),
            torch.nn.Tanh(),
            _Cast(second),
            torch.nn.Linear(8, 3).to(second),
        )

    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(exponent)).to(first)
    x[0, 0] = spike
    seen = _UnscaleWrites()
    got = famp_grads(model(), x, 2.0**exponent, mode=seen)
    assert [g.dtype for g in got[0].values()] == [first, first, second, second]
    assert_same_grads(got, gradscaler_grads(model(), x, 2.0**exponent))
    assert sorted(seen.written) == sorted(g.data_ptr() for g in got[0].values())
    assert [c for c in seen.copies if "_to_copy" not in c] == []  # the casts are the model's


def test_a_hook_returning_a_tensor_the_user_holds_leaves_it_untouched() -> None:
    held = torch.full((3,), 5.0)
    before = held.clone()

    def hooks(p: dict[str, torch.Tensor]) -> None:
        p["2.bias"].register_hook(lambda g: held)

    x = torch.randn(5, 6)
    got = famp_grads(mlp(), x, 1024.0, hooks)
    assert_same_grads(got, gradscaler_grads(mlp(), x, 1024.0, hooks))
    assert_bitwise_equal(held, before)
    assert_bitwise_equal(got[0]["2.bias"], before / 1024.0)


def test_a_hook_returning_a_view_of_a_held_tensor_leaves_it_untouched() -> None:
    # GradScaler keeps such a view as .grad and unscales the user's tensor in place; famp may not.
    held = torch.arange(48.0)
    before = held.clone()

    def hooks(p: dict[str, torch.Tensor]) -> None:
        p["2.weight"].register_hook(lambda g: held[:24].view(3, 8))

    x = torch.randn(5, 6)
    grads, found = famp_grads(mlp(), x, 64.0, hooks)
    assert_bitwise_equal(held, before)
    assert_bitwise_equal(grads["2.weight"], before[:24].view(3, 8) / 64.0)
    expected, expected_found = gradscaler_grads(mlp(), x, 64.0, lambda p: None)
    for k in ("0.weight", "0.bias", "2.bias"):  # the hook changes only its own leaf's gradient
        assert_bitwise_equal(grads[k], expected[k])
    assert_bitwise_equal(found, expected_found)


class _Stored(torch.autograd.Function):
    """Identity whose backward returns a tensor kept on ctx, not derived from the incoming grad."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
        ctx.stored = stored
        return w.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.stored, None


def test_a_custom_function_returning_a_stored_tensor_leaves_it_untouched() -> None:
    stored = torch.full((4,), 3.0)

    def loss_fn(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return _Stored.apply(p["w"], stored).sum() + p["v"].square().sum()

    params = {"w": torch.ones(4), "v": torch.ones(4)}
    _, grads, found, _ = famp.value_and_grad(loss_fn)(famp.init_scaler(8.0), params)
    assert_bitwise_equal(stored, torch.full((4,), 3.0))
    assert_bitwise_equal(grads["w"], torch.full((4,), 3.0 / 8.0))
    assert_bitwise_equal(grads["v"], torch.full((4,), 2.0))
    assert found.item() == 0.0


class _Twice(torch.autograd.Function):
    """`a + b` whose backward gives both inputs views of one tensor."""

    @staticmethod
    def forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a + b

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:  # torch.func.grad needs it
        pass

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return g, g.view_as(g)


@pytest.mark.parametrize("combine", ["cat", "stack", "shared_backward", "same_leaf_twice"])
def test_grads_that_share_memory_are_each_unscaled_once(combine: str) -> None:
    def loss_fn(p: dict[str, torch.Tensor]) -> torch.Tensor:
        a, b = p["a"], p["b"]
        if combine == "cat":
            y = torch.cat([a, b])
        elif combine == "stack":
            y = torch.stack([a, b])
        elif combine == "shared_backward":
            y = _Twice.apply(a, b)
        else:
            y = a * b + a
        return (y * torch.arange(1.0, y.numel() + 1).view_as(y)).sum()

    params = {"a": torch.linspace(1, 2, 5), "b": torch.linspace(-1, 3, 5)}
    _, grads, _, _ = famp.value_and_grad(loss_fn)(famp.init_scaler(4.0), params)
    expected = torch.func.grad(loss_fn)(params)  # the unscaled loss's gradients: scale 4 is exact
    for k in params:
        assert_bitwise_equal(grads[k], expected[k])


def test_post_accumulate_grad_hooks_do_not_run_as_under_torch_func_grad() -> None:
    calls: list[torch.Tensor] = []

    def loss_fn(p: dict[str, torch.Tensor]) -> torch.Tensor:
        p["w"].register_post_accumulate_grad_hook(calls.append)
        return (p["w"] * 3.0).sum()

    _, grads, _, _ = famp.value_and_grad(loss_fn)(famp.init_scaler(16.0), {"w": torch.ones(3)})
    assert calls == []
    assert_bitwise_equal(grads["w"], torch.full((3,), 3.0))


def test_leaves_the_loss_function_keeps_have_no_grad_afterwards() -> None:
    kept: list[torch.Tensor] = []

    def loss_fn(p: dict[str, torch.Tensor]) -> torch.Tensor:
        kept.append(p["w"])
        return (p["w"] * p["w"]).sum()

    _, grads, _, _ = famp.value_and_grad(loss_fn)(famp.init_scaler(2.0), {"w": torch.ones(2)})
    assert kept[0].grad is None  # as under torch.func.grad, which fills no .grad
    assert_bitwise_equal(grads["w"], torch.full((2,), 2.0))


def test_overlapping_views_that_hooks_return_are_each_unscaled_once() -> None:
    # The hooks return overlapping views of a tensor that nothing else holds once both have run:
    # torch keeps both views as gradients, so in place their shared elements would be unscaled
    # twice.
    box: dict[str, Any] = {"calls": 0}

    def view(lo: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def hook(g: torch.Tensor) -> torch.Tensor:
            base = box.setdefault("base", torch.arange(8.0) * 4.0)
            box["calls"] += 1
            if box["calls"] == 2:
                del box["base"]
            return base[lo : lo + 5]

        return hook

    def loss_fn(p: dict[str, torch.Tensor]) -> torch.Tensor:
        p["a"].register_hook(view(0))
        p["b"].register_hook(view(2))
        return (p["a"] * p["b"]).sum()

    params = {"a": torch.ones(5), "b": torch.ones(5)}
    _, grads, _, _ = famp.value_and_grad(loss_fn)(famp.init_scaler(4.0), params)
    assert_bitwise_equal(grads["a"], torch.arange(0.0, 5.0))
    assert_bitwise_equal(grads["b"], torch.arange(2.0, 7.0))


def test_a_torch_without_the_storage_count_gets_the_same_grads_out_of_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # famp/_compat.py reads the count only where torch has it; elsewhere, nothing is in place.
    monkeypatch.setattr(famp._compat, "_storage_use_count", None)
    x = torch.randn(5, 6)
    seen = _UnscaleWrites()
    got = famp_grads(mlp(), x, 1024.0, mode=seen)
    assert_same_grads(got, gradscaler_grads(mlp(), x, 1024.0))
    assert seen.copies != []  # every gradient copied, then unscaled
