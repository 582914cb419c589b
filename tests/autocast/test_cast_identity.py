"""A tensor that a cast meets twice in one tree is cast once: `famp.cast_to_compute`, module
rules' input and output casts, nested calls. As by hand, `h32 = h.float(); attn(h32, h32, h32)`:
`nn.MultiheadAttention` sees `query is key is value` (its fused self-attention path), and the
occurrences' gradients are summed in the cast's dtype and rounded once. Against torch by hand."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import famp
from tests.helpers import assert_bitwise_equal


def test_cast_to_compute_casts_a_repeated_tensor_once() -> None:
    h, g = torch.randn(3), torch.randn(3)
    a, b, c, d = famp.cast_to_compute("c=bf16", [h, g, {"x": h}, (h,)])
    assert a is c["x"] is d[0]
    assert a is not b
    assert a.dtype == b.dtype == torch.bfloat16
    same = famp.cast_to_compute("c=f32", (h, h))  # no cast: the tensor itself, each time
    assert same[0] is same[1] is h


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(16, 16)
        self.attn = nn.MultiheadAttention(16, 4, batch_first=True)
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, hand: bool = False) -> torch.Tensor:
        h = self.inp(x)
        if hand:  # the rule `attn: f32` written out: one cast, autocast off inside
            h32 = h.float()
            with torch.autocast("cpu", enabled=False):
                a = self.attn(h32, h32, h32, need_weights=False)[0]
        else:
            a = self.attn(h, h, h, need_weights=False)[0]
        return self.out(a)  # type: ignore[no-any-return]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["train", "inference"])
def test_a_module_rule_casts_an_input_given_thrice_once(dtype: torch.dtype, mode: str) -> None:
    # Before 2026-12-01 famp cast `h` once per occurrence: in inference MultiheadAttention took
    # its composite path, not the fused one (0.00098 off in bfloat16), and in training `h`'s
    # gradient was three rounded ones summed (`inp.weight`'s 0.0078 off).
    net = _Net().train(mode == "train")
    x = torch.randn(4, 7, 16, generator=torch.Generator().manual_seed(1))
    w = torch.randn(4, 7, 3, generator=torch.Generator().manual_seed(2))
    policy = "c=bf16,o=f32" if dtype == torch.bfloat16 else "c=f16,o=f32"

    def run(fn: object) -> list[torch.Tensor]:
        net.zero_grad()
        if mode == "inference":
            with torch.no_grad():
                return [fn(x).float()]  # type: ignore[operator]
        out = fn(x).float()  # type: ignore[operator]
        (out * w).sum().backward()
        return [out, *(p.grad for p in net.parameters())]  # type: ignore[misc]

    def hand(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=dtype):
            return net(x, hand=True)

    want = run(hand)
    got = run(famp.autocast(net, policy, module_rules={"attn": "f32"}))
    for actual, expected in zip(got, want, strict=True):
        assert_bitwise_equal(actual, expected)
