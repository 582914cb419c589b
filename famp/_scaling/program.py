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
    compiling = torch.compiler.is_compiling()
    shared = inv
    for i, x in enumerate(tensors):
        if compiling:
            inv = reader_operand(shared, inv, i)
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
        if compiling and i % READERS_PER_COPY == READERS_PER_COPY - 1 and i + 1 < len(tensors):
            # The same for the flags: one node reading them all would cost each fusion candidate
            # a walk over every flag (quadratic: 4.7 s of 36 for 120 grads of 768 x 768).
            found = own_copy(found)
    return out, found


# Compiled, how many tensors' ops read one copy of a 0-d operand they all share (`own_copy`).
READERS_PER_COPY = 8

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def own_copy(t: Tensor) -> Tensor:
    """0-d `t`, bit for bit, as a tensor that inductor computes into a buffer of its own.

    Inductor looks for fusions among the nodes that read one buffer, pair by pair (up to 64
    partners each, in every fusion round), and each pair it rejects costs about half a
    millisecond of compile time: one 0-d tensor read by the ops of every parameter (the
    predicate of `famp.skip_on_overflow`, the inverse scale of a compiled unscale) made compile
    time grow with the square of the parameter count (docs/benchmarks.md). Readers of a shared
    0-d tensor therefore read it through copies, `READERS_PER_COPY` readers each
    (`reader_operand`). A copy is `all` (bool) or `amax` (the value's bits as an integer) over
    64 repeats of `t`: `t` itself, computed by a reduction, which inductor does not inline into
    its readers as it would an elementwise op (reductions of up to
    `unroll_reductions_threshold` elements, 8 by default, it unrolls: hence 64).
    """
    if t.dtype == torch.bool:
        return t.reshape(1).expand(64).all()
    bits = _INT_OF_SIZE[t.element_size()]
    return t.view(bits).reshape(1).expand(64).amax().view(t.dtype)


def reader_operand(shared: Tensor, current: Tensor, i: int) -> Tensor:
    """What the `i`-th reader (from 0) of the 0-d `shared` reads, compiled.

    The first `READERS_PER_COPY` readers read `shared` itself (a graph with few readers is
    unchanged); each further `READERS_PER_COPY` read a new `own_copy`. `current` is what reader
    `i - 1` read.
    """
    if i < READERS_PER_COPY:
        return shared
    return own_copy(shared) if i % READERS_PER_COPY == 0 else current


# The NaN bit patterns (for a positive and a negative float32 NaN) of c10's float -> half/bfloat16.
NAN_BITS = {torch.float16: (0x7E00, -0x200), torch.bfloat16: (0x7FC0, 0x7FC0)}
