"""The per-leaf figures of `famp.nonfinite_report`: non-finite count and largest finite |x|.

How they read memory: compiled, each leaf is one fused read (inductor fuses the count and the
masked max). Eagerly on the CPU, each leaf first gets a read-only `aminmax`; only leaves whose
extremes are not finite get the masked passes (reading a CPU tensor is a memory read, not a device
sync, as in `kernels.py`). Elsewhere eagerly, every leaf takes the masked passes. Under
`torch.func.vmap` the branch-free passes run, so the figures are per sample.
"""

from __future__ import annotations

import torch

from famp._compat import functorch_transforms_active
from famp._typing import Tensor


def _exact(x: Tensor) -> tuple[Tensor, Tensor]:
    """(non-finite count as int64, largest finite |x| as float32), branch-free."""
    if x.numel() == 0:
        zero = torch.zeros((), dtype=torch.float32, device=x.device)
        return torch.zeros((), dtype=torch.int64, device=x.device), zero
    finite = torch.isfinite(x)
    count = finite.logical_not().sum(dtype=torch.int64)
    amax = torch.where(finite, x.abs(), 0).amax().to(torch.float32)
    return count, amax


def leaf_figures(xs: list[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
    """Counts and amaxes of plain tensors: read-only extremes first on the CPU, eagerly."""
    cpu = not (torch.compiler.is_compiling() or functorch_transforms_active()) and all(
        type(x) is torch.Tensor and x.device.type == "cpu" for x in xs
    )
    if not cpu:
        pairs = [_exact(x) for x in xs]
        return [p[0] for p in pairs], [p[1] for p in pairs]
    nonempty = [i for i, x in enumerate(xs) if x.numel()]
    counts = [torch.zeros((), dtype=torch.int64) for _ in xs]
    amaxes = [torch.zeros((), dtype=torch.float32) for _ in xs]
    if not nonempty:
        return counts, amaxes
    extremes = torch.stack(
        [e.to(torch.float64) for i in nonempty for e in torch.aminmax(xs[i])]
    ).view(-1, 2)
    finite = torch.isfinite(extremes).all(1).tolist()  # a CPU memory read, not a device sync
    widest = extremes.abs().amax(1).to(torch.float32)
    for j, i in enumerate(nonempty):
        if finite[j]:
            amaxes[i] = widest[j]
        else:
            counts[i], amaxes[i] = _exact(xs[i])
    return counts, amaxes
