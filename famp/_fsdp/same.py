"""Equality of optimizer-state values across ranks: tensors bit for bit, containers recursively."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from famp._collectives import is_dtensor


def same(a: object, b: object) -> bool:
    """Equal values, tensors bit for bit (dtype and shape included), containers recursively."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and (a.dtype, a.shape) == (b.dtype, b.shape)
            and bool(torch.equal(_bits(a), _bits(b)))  # NaNs too: a diverged run's replicas
        )
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # NaN (a diverged run's lr, loss scale): the same on every rank
    return type(a) is type(b) and bool(a == b)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A floating or complex tensor's bytes (NaN equals NaN, -0.0 differs from 0.0)."""
    if (t.is_floating_point() or t.is_complex()) and not is_dtensor(t):
        # The values, not the view's bits: a negative or conjugate view (a bit set on the tensor,
        # as one flipped byte of a saved file sets it) cannot be viewed as bytes.
        t = t.detach().resolve_conj().resolve_neg()
        return t.reshape(-1).contiguous().view(torch.uint8)
    return t
