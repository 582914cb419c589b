"""Helpers shared by famp's tests."""

from __future__ import annotations

import torch


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal dtype, shape, device, and bit pattern (NaN payloads and signed zeros included)."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.device == expected.device, (actual.device, expected.device)
    a, e = actual.detach(), expected.detach()
    if a.is_sparse:
        a, e = a.coalesce(), e.coalesce()
        assert torch.equal(a.indices(), e.indices())
        a, e = a.values(), e.values()
    if a.is_floating_point():
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        assert torch.equal(a.contiguous().view(bits), e.contiguous().view(bits)), (a, e)
    else:
        assert torch.equal(a, e), (a, e)
