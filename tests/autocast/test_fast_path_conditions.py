"""famp leaves a module to torch's inference fast path exactly where torch takes it.

`nn.MultiheadAttention`, `nn.TransformerEncoderLayer` and `nn.TransformerEncoder` take it by
tests of their inputs (keyword ones too), of some of their tensors, and of
`torch.backends.mha.get_fastpath_enabled()`; elsewhere they run their composite path, where op
overrides apply. References: `torch.autocast` with the override's casts written by hand.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

import famp
from tests.helpers import assert_bitwise_equal

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}


@contextlib.contextmanager
def _linear_in_float32() -> Iterator[None]:
    """The override `linear: float32` by hand: torch's `F.linear` in float32, autocast off."""
    original = F.linear

    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return original(x.float(), w.float(), None if b is None else b.float())

    F.linear = linear
    try:
        yield
    finally:
        F.linear = original


@contextlib.contextmanager
def _fastpath(enabled: bool) -> Iterator[None]:
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(enabled)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


class _Frozen(nn.Module):
    """A trainable linear, then a frozen fast-path module in eval mode, called as `how` says."""

    def __init__(self, kind: str, how: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(16, 16)
        layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
        self.inner: nn.Module = {
            "attention": lambda: nn.MultiheadAttention(16, 4, batch_first=True),
            "layer": lambda: layer,
            "encoder": lambda: nn.TransformerEncoder(layer, 2, enable_nested_tensor=False),
        }[kind]()
        self.inner.eval().requires_grad_(False)
        self.kind, self.how = kind, how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)  # requires grad: torch takes the composite path
        if self.kind == "attention":
            if self.how == "keyword":
                return self.inner(query=h, key=h, value=h, need_weights=False)[0]  # type: ignore[no-any-return]
            return self.inner(h, h, h, need_weights=False)[0]  # type: ignore[no-any-return]
        return self.inner(src=h) if self.how == "keyword" else self.inner(h)  # type: ignore[no-any-return]


def _run_and_grad(f: Any, model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    out = f(x)
    out.float().square().sum().backward()
    grads = tuple(p.grad.clone() for p in model.parameters() if p.grad is not None)
    model.zero_grad()
    return (out, *grads)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("kind", ["attention", "layer", "encoder"])
@pytest.mark.parametrize("how", ["position", "keyword"])
def test_an_override_applies_in_a_frozen_module_whose_input_requires_grad(
    dtype: str, kind: str, how: str
) -> None:
    # Before 2026-12-01 famp judged torch's fast path from positional inputs only: by keyword,
    # it left the module to torch and the override was dropped.
    model, x = _Frozen(kind, how), torch.randn(2, 5, 16)
    rules = famp.default_rules("cpu").override({"linear": "float32"})
    actual = _run_and_grad(famp.autocast(model, f"c={dtype},o=f32", rules=rules), model, x)

    def by_hand(x: torch.Tensor) -> torch.Tensor:
        with _linear_in_float32(), torch.autocast("cpu", dtype=DTYPES[dtype]):
            return model(x).float()

    expected = _run_and_grad(by_hand, model, x)
    assert actual[0].dtype == torch.float32
    for a, e in zip(actual, expected, strict=True):
        assert_bitwise_equal(a, e)


@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("how", ["position", "keyword"])
def test_an_override_applies_where_the_fast_path_is_turned_off(enabled: bool, how: str) -> None:
    # torch.backends.mha.set_fastpath_enabled(False): torch always takes the composite path.
    attention = _Frozen("attention", how).inner
    x = torch.randn(2, 5, 16)

    def model(x: torch.Tensor) -> torch.Tensor:
        if how == "keyword":
            return attention(query=x, key=x, value=x, need_weights=False)[0]  # type: ignore[no-any-return]
        return attention(x, x, x, need_weights=False)[0]  # type: ignore[no-any-return]

    rules = famp.default_rules("cpu").override({"linear": "float32"})
    with _fastpath(enabled), torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = famp.autocast(model, "c=bf16,o=f32", rules=rules)(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            plain = model(x).float()
            with _linear_in_float32():
                overridden = model(x).float()
    assert actual.dtype == torch.float32
    assert_bitwise_equal(actual, plain if enabled else overridden)
    messages = [str(w.message) for w in caught if issubclass(w.category, famp.AutocastWarning)]
    assert len(messages) == (1 if enabled else 0)
    assert all("where torch runs it on its inference fast path" in m for m in messages)


def _partly_frozen(frozen: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # enable_nested_tensor's notes about its own conditions
        enc = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(16), enable_nested_tensor=True)
    enc.eval()
    (enc.layers if frozen == "layers" else enc.layers[0]).requires_grad_(False)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[1, -3:] = True
    return enc, torch.randn(2, 6, 16), mask


NESTED_NOTE = "ignore:The PyTorch API of nested tensors:UserWarning"  # torch's, once a process


@pytest.mark.filterwarnings(NESTED_NOTE)
@pytest.mark.parametrize(
    "options", [{"module_rules": {"": "f32"}}, {"track_casts": True}], ids=["rule", "track"]
)
def test_an_encoder_with_frozen_layers_and_a_trainable_norm_takes_torchs_nested_path(
    options: dict[str, Any],
) -> None:
    # torch decides the nested-tensor path from the first layer's tensors and `src` only.
    # Before 2026-12-01 famp asked all the encoder's parameters, intercepted, and the padded
    # rows (and the norm's gradients) differed from torch's.
    enc, x, mask = _partly_frozen("layers")
    f = famp.autocast(lambda x: enc(x, src_key_padding_mask=mask), "f32", **options)
    actual = _run_and_grad(f, enc, x)
    expected = _run_and_grad(lambda x: enc(x, src_key_padding_mask=mask), enc, x)
    assert actual[0].dtype == torch.float32
    for a, e in zip(actual, expected, strict=True):
        assert_bitwise_equal(a, e)


@pytest.mark.filterwarnings(NESTED_NOTE)
def test_an_encoder_whose_first_layer_alone_is_frozen_fails_as_torch() -> None:
    # torch converts to a nested tensor, which the trainable second layer's attention rejects.
    enc, x, mask = _partly_frozen("first")
    with pytest.raises(AssertionError, match="does not support NestedTensor") as torchs:
        enc(x, src_key_padding_mask=mask)
    f = famp.autocast(lambda x: enc(x, src_key_padding_mask=mask), "f32", track_casts=True)
    with pytest.raises(AssertionError, match="does not support NestedTensor") as famps:
        f(x)
    assert str(famps.value) == str(torchs.value)
