"""The fused unscale kernel's arithmetic as plain ops, which transforms and compilers can trace.

torch's `_amp_foreach_non_finite_check_and_unscale_` has no vmap rule, and inductor cannot fuse
it; `where_program` computes the same bits from ops they handle: under `torch.func` transforms
(`unscale.py`), in compiled steps (`kernels.py`) and in the kernel famp compiles for eager
unscaling (`fused.py`).
"""

from __future__ import annotations

import torch
from torch import Tensor


def where_program(tensors: list[Tensor], found: Tensor, inv: Tensor) -> tuple[list[Tensor], Tensor]:
    """The fused kernel's arithmetic as plain ops: `cast(opmath(x) * inv)`, any non-finite.

    At `inv == 1` the kernel skips the multiply, and so does this (NaN payloads are kept).
    """
    out = []
    for x in tensors:
        opmath, factor = (
            (x.double(), inv.double()) if x.dtype == torch.float64 else (x.float(), inv)
        )
        wide = torch.where(inv == 1, opmath, opmath * factor)  # at 1 the kernel keeps NaN bits
        narrow = wide.to(x.dtype)
        if x.dtype in NAN_BITS:  # c10's scalar casts write these NaNs; vectorized .to() differs
            positive, negative = (
                torch.tensor(b, dtype=torch.int16, device=x.device).view(x.dtype)
                for b in NAN_BITS[x.dtype]
            )
            # The sign of a NaN input (read off its bits: widening drops it), else the product's.
            sign = torch.where(torch.isnan(x), x.view(torch.int16) < 0, torch.signbit(wide))
            nan = torch.where(sign, negative, positive)
            narrow = torch.where(torch.isnan(wide), nan, narrow)
        out.append(narrow)
        found = torch.maximum(found, torch.isfinite(x).all().logical_not().to(found.dtype))
    return out, found


# The NaN bit patterns (for a positive and a negative float32 NaN) of c10's float -> half/bfloat16.
NAN_BITS = {torch.float16: (0x7E00, -0x200), torch.bfloat16: (0x7FC0, 0x7FC0)}
