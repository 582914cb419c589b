"""famp.custom_fwd / famp.custom_bwd: argument checks (issue 12), one test per documented error."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import famp

BAD_FWD: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"forward": 3}, TypeError, "forward must be a function .* got int 3"),
    ({"forward": "f"}, TypeError, "forward must be a function"),
    ({"rule": 3}, TypeError, "rule must be a str"),
    ({"rule": "fp32"}, ValueError, "rule must be one of keep, lower, float32, promote; got 'fp32'"),
    ({"device_type": "bogus"}, ValueError, "device_type must be a device type .* got 'bogus'"),
    ({"device_type": "cuda:0"}, ValueError, "device_type must be a device type .* got 'cuda:0'"),
    ({"device_type": torch.device("cpu")}, TypeError, "device_type must be None or a str"),
]


@pytest.mark.parametrize(("kwargs", "error", "match"), BAD_FWD)
def test_custom_fwd_refuses_bad_arguments_naming_them(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        famp.custom_fwd(**kwargs)


def test_custom_bwd_refuses_a_non_callable() -> None:
    with pytest.raises(TypeError, match="backward must be a function, got NoneType None"):
        famp.custom_bwd(None)  # type: ignore[type-var]


def test_custom_fwd_accepts_what_it_documents() -> None:
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x

    for device_type in (None, "cpu", "cuda"):
        decorator = famp.custom_fwd(rule="float32", device_type=device_type)
        assert callable(decorator(forward))
    assert callable(famp.custom_bwd(forward))


def _setup_context_square(forward_decorator: Any) -> Any:
    class Square(torch.autograd.Function):
        @staticmethod
        @forward_decorator
        def forward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return x * x * y

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[torch.Tensor, ...], output: Any) -> None:
            ctx.save_for_backward(*inputs)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x, y = ctx.saved_tensors
            return 2 * x * y * grad, x * x * grad

    return Square


@pytest.mark.parametrize(
    ("rule", "cast_inputs"), [("float32", torch.float32), ("lower", torch.bfloat16)]
)
def test_custom_fwd_without_ctx_casts_every_input_as_torch(
    rule: str, cast_inputs: torch.dtype
) -> None:
    # A `forward` with `setup_context` has no ctx: its first argument is an input, which torch's
    # custom_fwd casts; famp took it for a ctx and left it uncast (bfloat16 or float32 numbers).
    ours = _setup_context_square(famp.custom_fwd(rule=rule))
    theirs = _setup_context_square(torch.amp.custom_fwd(device_type="cpu", cast_inputs=cast_inputs))
    x = (torch.randn(8) * 3).to(torch.bfloat16 if rule == "float32" else torch.float32)
    y = torch.randn(8, dtype=torch.float32 if rule == "float32" else torch.bfloat16)
    results = []
    for fn in (theirs, ours):
        a, b = x.clone().requires_grad_(), y.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn.apply(a, b)
        grads = torch.autograd.grad(out.float().sum(), [a, b])
        results.append((out, *grads))
    for got, expected in zip(results[1], results[0], strict=True):
        assert got.dtype == expected.dtype
        assert torch.equal(got, expected)
