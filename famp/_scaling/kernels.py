"""How `famp.unscale_and_check` unscales one (device, dtype) group: the kernel's exact results.

torch's fused `_amp_foreach_non_finite_check_and_unscale_` kernel is the reference. Out of place
there are five ways to its results, chosen per call: runs of the kernel's functional variant,
the in-place kernel on each chunk of a copy (big float32/float64 CPU tensors), famp's compiled
one-pass program (`fused.py`, where those total `fused.MIN_BYTES`), a min/max and a multiply
(other big CPU tensors), and the kernel's arithmetic as plain ops (`where_program`), which
`torch.func` transforms and, off the CPU, inductor need. Compiled on the CPU, all of the eager
choice is one opaque node (`unscale_op`), and gradients that only the step reads are unscaled in
place by the kernel (`unscale_in_place_op`). Each is tested against `GradScaler` bit for bit,
NaN bit patterns included. `differentiable.py` gives the same results with the backward of
torch's gradient-penalty recipe.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor

from famp._compat import (
    amp_foreach_non_finite_check_and_unscale,
    amp_foreach_non_finite_check_and_unscale_,
    foreach_clone,
)
from famp._scaling import fused
from famp._scaling.program import NAN_BITS, where_program


def out_of_place(
    tensors: list[Tensor], found: Tensor, inv: Tensor, *, fresh: bool = False
) -> tuple[list[Tensor], Tensor]:
    """The fused kernel's results, out of place, with about one pass over memory.

    The kernel computes `cast(inv == 1 ? opmath(x) : opmath(x) * inv)` (at exactly 1 it skips
    the multiply, which keeps NaN payloads) and flags any non-finite input. Its functional
    variant clones every tensor and then makes a second pass over the whole copy. On the CPU,
    eagerly, famp keeps that second pass in cache: small tensors go through the functional
    variant in runs of about `_CHUNK_BYTES`. Each big dense float32/float64 tensor is copied
    chunk by chunk into a new tensor, the in-place kernel running on each chunk of the copy
    while it is still in cache (the kernel's own results: for these dtypes its vectorized loop
    and scalar tail agree, so where chunks end does not matter). Each big dense float16/bfloat16
    tensor gets a read-only min/max (min and max propagate NaN and show infs) followed by one
    multiply, which finds it still in cache and loops over it as the kernel does (at a scale of
    exactly 1, the kernel: it skips the multiply). Where the big float32/float64 tensors of a
    call total `fused.MIN_BYTES`, famp's compiled program replaces the chunks: one read and one
    write per tensor, as a clone (`_unscale_wide`). Tensors that are not dense take the
    functional variant, as on other devices. Compiled, `_compiled` decides; `fresh` says that
    the tensors are intermediate results of the compiled program that nothing else reads
    (`famp.value_and_grad`'s gradients), a hint that changes no value. Results equal the
    kernel's bit for bit (tested on random bit patterns).
    """
    if torch.compiler.is_compiling():
        return _compiled(tensors, found, inv, fresh)
    on_cpu = inv.device.type == "cpu" and type(inv) is torch.Tensor  # not a fake or meta scale
    if not on_cpu:
        return _kernel(tensors, found, inv)
    at_one = None  # whether inv is exactly 1, read (a memory read, not a sync) where needed
    out: list[Tensor] = []
    extremes: list[Tensor] = []
    run: list[Tensor] = []
    wides: list[int] = []  # where big dense float32/float64 tensors go in `out`
    size = 0
    for x in tensors:
        nbytes = x.nbytes  # numel × element size, whatever the strides
        if nbytes > _CHUNK_BYTES and x.dim() > 0 and _dense(x):
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
        if size + nbytes > _CHUNK_BYTES:
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


def _dense(x: Tensor) -> bool:
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
    step = max(_CHUNK_BYTES // x.element_size(), 1)
    for start in range(0, x.numel(), step):
        chunk = target[start : start + step]
        chunk.copy_(source[start : start + step])
        amp_foreach_non_finite_check_and_unscale_([chunk], found, inv)
    return new


def _compiled(
    tensors: list[Tensor], found: Tensor, inv: Tensor, fresh: bool
) -> tuple[list[Tensor], Tensor]:
    """What `torch.compile` traces: on the CPU one `famp` operator, elsewhere kernel or ops.

    On the CPU, plain tensors that carry no graph take one opaque node, whatever the number of
    tensors, their sizes or symbolic shapes. `fresh` ones (intermediate results nothing else
    reads) are copied and the copies unscaled in place by the kernel (`unscale_in_place_op`):
    inductor drops each copy and unscales the tensor where it lies, one pass over memory in
    place, and keeps a copy only where something else may still read the tensor. Others go
    through `unscale_op`: the eager `out_of_place` (about one pass over memory, as a clone)
    into new tensors. Elsewhere big float32/float64 tensors
    are traced as plain ops, which inductor fuses into one read and one write per tensor where
    the kernel's functional variant makes two passes; but each tensor so traced adds about 0.15 s
    of compile time (docs/benchmarks.md), so only tensors over `_CHUNK_BYTES` take it. Half
    dtypes keep the kernel, whose NaN bit patterns inductor does not keep.
    """
    if inv.device.type == "cpu" and _opaque(tensors):
        if fresh:  # `found` is this call's own, a new tensor: the kernel updates it in place
            copies = [x.clone() for x in tensors]
            unscale_in_place_op(copies, found, inv)
            return copies, found
        new, found = cast(tuple[list[Tensor], Tensor], unscale_op(tensors, found, inv))
        return list(new), found
    kernel: list[int] = []
    fused: list[int] = []
    for i, x in enumerate(tensors):  # total: every tensor takes exactly one of the two paths
        (fused if _fuses(x) else kernel).append(i)
    out = list(tensors)
    for picked, unscale in ((kernel, _kernel), (fused, where_program)):
        if picked:
            new, found = unscale([tensors[i] for i in picked], found, inv)
            for i, t in zip(picked, new, strict=True):
                out[i] = t
    return out, found


def _opaque(tensors: list[Tensor]) -> bool:
    """Whether `unscale_op` may stand for the kernel on `tensors`, while tracing.

    Not for tensor subclasses (a DTensor, say, has no sharding rule for famp's op: its local
    shard is unscaled instead, see `unscale.py`) and not for tensors that carry a graph (the op
    has no derivative; those go through `_Unscale`, whose forward runs without grad).
    """
    grad = torch.is_grad_enabled()
    return all(
        type(x) in (torch.Tensor, torch.nn.Parameter) and not (grad and x.requires_grad)
        for x in tensors
    )


@torch.library.custom_op(
    "famp::unscale",
    mutates_args=(),
    schema="(Tensor[] tensors, Tensor found, Tensor inv) -> (Tensor[], Tensor)",
)
def unscale_op(tensors: list[Tensor], found: Tensor, inv: Tensor) -> tuple[list[Tensor], Tensor]:
    """The kernel's results on CPU tensors, out of place: compiled, one node running `out_of_place`.

    Traced as plain ops, each tensor costs inductor about 0.15 s of compile time (its own
    reduction and loop to schedule, fuse and generate); through torch's kernel, two passes over
    memory a step. This op is opaque to the compiler (one node, whatever the tensors) and runs
    famp's eager `out_of_place` at run time: about one pass, as a clone. Returns new tensors
    and a new `found` (the kernel's: `found` itself, or 1.0 where any value is not finite).
    """
    new, found = out_of_place(list(tensors), found.clone(), inv)
    return new, found


@unscale_op.register_fake
def _(tensors: list[Tensor], found: Tensor, inv: Tensor) -> tuple[list[Tensor], Tensor]:
    return [torch.empty_like(x) for x in tensors], torch.empty_like(found)


# `famp::unscale_`: the kernel in place, for `_compiled`'s copies of fresh tensors. Functional
# to the compiler: inductor writes it in place of each copy's source where nothing else reads
# that source (its reinplacing of mutating operators), and drops the copies (same sizes and
# strides: `remove_noop_ops`); where something may still read a source, it keeps that copy.
# Defined with `torch.library.define`/`impl`, as `famp::select_` is (`choice.py`): a
# `torch.library.custom_op` wrapper costs about 0.4 µs more per tensor on each call.
torch.library.define("famp::unscale_", "(Tensor(a!)[] tensors, Tensor(b!) found, Tensor inv) -> ()")


@torch.library.impl("famp::unscale_", "cpu")
def _unscale_in_place_impl(tensors: list[Tensor], found: Tensor, inv: Tensor) -> None:
    """torch's `_amp_foreach_non_finite_check_and_unscale_`: `GradScaler.unscale_`'s kernel."""
    amp_foreach_non_finite_check_and_unscale_(tensors, found, inv)


def _unscale_in_place_fake(tensors: list[Tensor], found: Tensor, inv: Tensor) -> None:
    """Traced: each tensor keeps its sizes and strides, `found` its; nothing is returned."""


torch.library.register_fake("famp::unscale_", _unscale_in_place_fake)

unscale_in_place_op = torch.ops.famp.unscale_.default


def _fuses(x: Tensor) -> bool:
    """Whether compiled unscale traces `x` as plain ops: always a Python bool, never a symbol.

    Under dynamic shapes (`dynamic=True`, `mark_dynamic`, a recompile after a shape change)
    `x.numel()` is a symbolic int and a size test a symbolic bool, which no identity check or
    branch may read; such tensors take the kernel, whose bits are the same, without a guard.
    """
    if x.dtype in NAN_BITS:
        return False
    numel: object = x.numel()
    if not isinstance(numel, int):  # a torch.SymInt: its size is not known while tracing
        return False
    return numel * x.element_size() > _CHUNK_BYTES


def _kernel(tensors: list[Tensor], found: Tensor, inv: Tensor) -> tuple[list[Tensor], Tensor]:
    """The kernel's functional variant (a clone of every tensor, then the in-place kernel)."""
    new, found = amp_foreach_non_finite_check_and_unscale(tensors, found, inv)
    return list(new), found


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


_CHUNK_BYTES = 1 << 20  # 1 MiB: what the second pass over a chunk or run still finds in cache
