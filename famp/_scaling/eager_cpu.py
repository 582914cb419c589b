"""Eagerly on the CPU, the kernel's results out of place with about one pass over memory.

torch's fused `_amp_foreach_non_finite_check_and_unscale_` kernel is the reference; its
functional variant copies every tensor and then makes a second pass over the copy. `kernels.py`
calls `out_of_place_cpu` for plain CPU tensors outside `torch.compile`, and so does the
compiled `famp::unscale` operator when the compiled step runs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from famp._compat import amp_foreach_non_finite_check_and_unscale_, foreach_clone
from famp._scaling import fused

CHUNK_BYTES = 1 << 20  # 1 MiB: what the second pass over a chunk or run still finds in cache


def out_of_place_cpu(
    tensors: list[Tensor], found: Tensor, inv: Tensor
) -> tuple[list[Tensor], Tensor]:
    """The fused kernel's results for CPU tensors, eagerly, with about one pass over memory.

    The kernel computes `cast(inv == 1 ? opmath(x) : opmath(x) * inv)` (at exactly 1 it skips
    the multiply, which keeps NaN payloads) and flags any non-finite input. Its functional
    variant clones every tensor and then makes a second pass over the whole copy. famp keeps
    that second pass in cache: small tensors go through the functional variant in runs of about
    `CHUNK_BYTES`. Each big dense float32/float64 tensor is copied
    chunk by chunk into a new tensor, the in-place kernel running on each chunk of the copy
    while it is still in cache (the kernel's own results: for these dtypes its vectorized loop
    and scalar tail agree, so where chunks end does not matter). Each big dense float16/bfloat16
    tensor gets a read-only min/max (min and max propagate NaN and show infs) followed by one
    multiply, which finds it still in cache and loops over it as the kernel does (at a scale of
    exactly 1, the kernel: it skips the multiply). Where the big float32/float64 tensors of a
    call total `fused.MIN_BYTES`, famp's compiled program replaces the chunks: one read and one
    write per tensor, as a clone (`_unscale_wide`). Tensors that are not dense take the
    functional variant, as on other devices. Results equal the kernel's bit for bit (tested on
    random bit patterns).
    """
    at_one = None  # whether inv is exactly 1, read (a memory read, not a sync) where needed
    out: list[Tensor] = []
    extremes: list[Tensor] = []
    run: list[Tensor] = []
    wides: list[int] = []  # where big dense float32/float64 tensors go in `out`
    size = 0
    for x in tensors:
        nbytes = x.nbytes  # numel × element size, whatever the strides
        if nbytes > CHUNK_BYTES and x.dim() > 0 and dense(x):
            wide = x.dtype in (torch.float32, torch.float64)
            if not wide and at_one is None:
                at_one = inv.item() == 1.0
            if wide or not at_one:  # else a half tensor at scale 1: the kernel, in a run
                found = _unscale_run(run, out, found, inv)
                run, size = [], 0
                if wide:
                    wides.append(len(out))
                    out.append(x)  # a placeholder: unscaled below, all of them together
                    continue
                extremes.extend(torch.aminmax(x))  # first: the multiply then reads x from cache
                out.append(torch.mul(x, inv))  # n-d: keeps x's dtype, computes in float32
                continue
        if size + nbytes > CHUNK_BYTES:
            found = _unscale_run(run, out, found, inv)
            run, size = [], 0
        run.append(x)
        size += nbytes
    found = _unscale_run(run, out, found, inv)
    if wides:
        found = _unscale_wide(out, wides, found, inv)
    if extremes:
        bad = torch.isfinite(torch.stack(extremes)).all().logical_not()
        found = torch.maximum(found, bad.to(torch.float32))
    return out, found


def _unscale_wide(out: list[Tensor], wides: list[int], found: Tensor, inv: Tensor) -> Tensor:
    """Unscale the big dense float32/float64 tensors at `wides` in `out`, in place of them.

    Those of a dtype that total `fused.MIN_BYTES` take famp's compiled one-pass program
    (`fused.py`); the others, and all of them if that program fails, the kernel a chunk at a
    time. A one-element tensor (a size `torch.compile` would fix) always takes the kernel.
    """
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i in wides:
        if out[i].numel() > 1:
            by_dtype.setdefault(out[i].dtype, []).append(i)
    for picked in by_dtype.values():
        nbytes = sum(out[i].numel() * out[i].element_size() for i in picked)
        tensors = [out[i] for i in picked]
        if nbytes >= fused.MIN_BYTES and fused.usable(tensors):
            result = fused.unscale(tensors, found, inv)
            if result is not None:
                new, found = result
                for i, t in zip(picked, new, strict=True):
                    out[i] = t
                done = set(picked)
                wides = [i for i in wides if i not in done]
    for i in wides:
        out[i] = _chunked(out[i], found, inv)
    return found


def dense(x: Tensor) -> bool:
    """Whether `x` is non-overlapping and dense: a permutation of a contiguous tensor.

    Such a tensor fills its storage from its offset on, `empty_like` and `clone` keep its
    strides, and elementwise loops visit it in storage order, as they visit its clone.
    """
    span = 1  # the strides, sorted, must be the running products of the sizes
    for size, stride in sorted(zip(x.shape, x.stride(), strict=True), key=lambda d: d[1]):
        if size != 1:
            if stride != span:
                return False
            span *= size
    return True


def _chunked(x: Tensor, found: Tensor, inv: Tensor) -> Tensor:
    """The kernel's result for a big dense CPU tensor: copied and unscaled a chunk at a time.

    Each chunk of the copy is unscaled in place right after it is written, while it is still in
    cache, so memory is read once and written once (the functional variant reads and writes the
    copy a second time). `found` is updated in place, as the kernel does.
    """
    new = torch.empty_like(x)  # the same strides as `x` (dense), so storage order matches
    source = x.as_strided((x.numel(),), (1,), x.storage_offset())
    target = new.as_strided((new.numel(),), (1,), new.storage_offset())
    step = max(CHUNK_BYTES // x.element_size(), 1)
    for start in range(0, x.numel(), step):
        chunk = target[start : start + step]
        chunk.copy_(source[start : start + step])
        amp_foreach_non_finite_check_and_unscale_([chunk], found, inv)
    return new


def _unscale_run(run: list[Tensor], out: list[Tensor], found: Tensor, inv: Tensor) -> Tensor:
    """Unscale a run of small tensors as the kernel's functional variant does, appending to out.

    Eagerly on the CPU (the only caller): what that variant is, a clone of every tensor and the
    in-place kernel on the clones, through torch's Python bindings rather than the operator
    call (about 5 µs less for the 14 small grads of a transformer block, measured on an Intel
    Xeon). `found` is this call's own, updated in place.
    """
    if run:
        new = foreach_clone(run)
        amp_foreach_non_finite_check_and_unscale_(new, found, inv)
        out.extend(new)
    return found
