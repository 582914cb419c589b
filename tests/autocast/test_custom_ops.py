"""Custom ops (`torch.library.custom_op`) under `famp.autocast`: an op of another namespace is not
the aten op of its name. An override of `mm` (or `linear`) leaves `my_lib::mm` (`my_lib::linear`)
to torch, with its own autocast registration or none, as `torch.autocast` runs it. Against
`torch.autocast` with the override's casts written by hand, eagerly and compiled."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import famp
from tests.helpers import assert_bitwise_equal

BF16, F32 = torch.bfloat16, torch.float32


@torch.library.custom_op("famp_tests::mm", mutates_args=())
def custom_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


@custom_mm.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[1])


def _mm_context(ctx: object, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)  # type: ignore[attr-defined]


def _mm_backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = ctx.saved_tensors  # type: ignore[attr-defined]
    return grad @ b.t(), a.t() @ grad


custom_mm.register_autograd(_mm_backward, setup_context=_mm_context)
torch.library.register_autocast("famp_tests::mm", "cpu", BF16)  # its inputs cast to bfloat16


@torch.library.custom_op("famp_tests::linear", mutates_args=())
def custom_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """No autocast registration: torch hands it its inputs as they are."""
    return (x.float() @ w.float().t()).to(x.dtype)


@custom_linear.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


def _linear_backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x, w = ctx.saved_tensors  # type: ignore[attr-defined]
    g = grad.float()
    return (g @ w.float()).to(x.dtype), (g.t() @ x.float()).to(w.dtype)


custom_linear.register_autograd(_linear_backward, setup_context=_mm_context)

W = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))


def _mm_net(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(torch.tanh(custom_mm(x, w)), w).float().pow(2).sum()


def _mm_by_hand(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(custom_mm(x, w))  # its registration casts to bfloat16
    with torch.autocast("cpu", enabled=False):
        return torch.mm(h.float(), w.float()).float().pow(2).sum()  # `mm: float32`


def _linear_net(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(custom_linear(x, w), w).float().pow(2).sum()


def _linear_by_hand(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = custom_linear(x, w)  # float32 in, float32 out: no registration
    with torch.autocast("cpu", enabled=False):
        return torch.nn.functional.linear(h.float(), w.float()).float().pow(2).sum()


CASES: dict[str, tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor], str]] = {
    "registered_autocast": (_mm_net, _mm_by_hand, "mm"),
    "no_registration": (_linear_net, _linear_by_hand, "linear"),
}


def _run(fn: Callable[..., torch.Tensor], compiled: str | None) -> list[torch.Tensor]:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).requires_grad_()
    w = W.clone().requires_grad_()
    if compiled is not None:
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=compiled == "dynamic")
    loss = fn(x, w)
    loss.backward()
    return [loss, x.grad, w.grad]  # type: ignore[list-item]


@pytest.mark.parametrize("compiled", [None, "static", "dynamic"])
@pytest.mark.parametrize("case", list(CASES))
def test_an_override_leaves_a_custom_op_of_its_name_to_torch(
    case: str, compiled: str | None
) -> None:
    # Before 2026-12-01 famp named `famp_tests::mm` "mm": the `mm` override ran it in float32
    # (float32 inputs, past its registered cast to bfloat16) and cast `famp_tests::linear`'s.
    net, by_hand, op = CASES[case]
    rules = famp.default_rules("cpu").override({op: "float32"})

    def hand(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16):
            return by_hand(x, w)

    # Compiled, against `torch.autocast` by hand compiled alike: AOTAutograd runs its graph with
    # autocast off, so a custom op with no registration computes inside as given, not as eagerly.
    want = _run(hand, compiled)
    got = _run(famp.autocast(net, "c=bf16,o=f32", rules=rules), compiled)
    for actual, expected in zip(got, want, strict=True):
        assert_bitwise_equal(actual, expected)


def test_explain_names_a_custom_op_with_its_namespace() -> None:
    rules = famp.default_rules("cpu").override({"mm": "float32"})
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    _, trace = famp.explain(lambda x: _mm_net(x, W), "c=bf16,o=f32", rules=rules)(x)
    (custom,) = (r for r in trace if r.op.startswith("famp_tests."))
    assert custom.op == "famp_tests.mm.default"
    assert custom.rule != "float32"  # not `mm`'s override
    assert custom.in_dtypes == (BF16, BF16)  # its own registration's casts
    (mm,) = (r for r in trace if r.op == "aten.mm.default")
    assert (mm.rule, mm.in_dtypes) == ("float32", (F32, F32))
