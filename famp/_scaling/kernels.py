"""How `famp.unscale_and_check` unscales one (device, dtype) group: the kernel's exact results.

torch's fused `_amp_foreach_non_finite_check_and_unscale_` kernel is the reference. Out of place
there are six ways to its results, chosen per call: runs of the kernel's functional variant, a
multi-tensor clone and the in-place kernel on it (eagerly on CUDA), the in-place kernel on each
chunk of a copy (big float32/float64 CPU tensors), famp's compiled one-pass program (`fused.py`,
where those total `fused.MIN_BYTES`), a min/max and a multiply (other big CPU tensors), and the
kernel's arithmetic as plain ops (`where_program`), which `torch.func` transforms need, and devices
whose kernel lacks a dtype. Compiled on the CPU, all of the eager choice is one opaque node
(`unscale_op`); gradients that only the step reads (big ones on the CPU, all on CUDA) are unscaled
in place by the kernel (`unscale_in_place_op`), and on CUDA other gradients too, on one
multi-tensor clone (`copied_then_unscaled`). Each is tested against `GradScaler` bit for bit, NaN
bit patterns included. `differentiable.py` gives the same results with the backward of torch's
gradient-penalty recipe.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor

from famp._compat import (
    VIEW_BASE,
    amp_foreach_non_finite_check_and_unscale,
    amp_foreach_non_finite_check_and_unscale_,
    assume_constant_result,
    foreach_clone,
    functorch_transforms_active,
    real_tensors,
)
from famp._scaling import eager_cpu, fused
from famp._scaling.checks import FLOAT_DTYPES
from famp._scaling.program import NAN_BITS, where_program


def out_of_place(
    tensors: list[Tensor], found: Tensor, inv: Tensor, *, fresh: bool = False
) -> tuple[list[Tensor], Tensor]:
    """The fused kernel's results, out of place: the way to them for these tensors, here.

    Eagerly on the CPU, `eager_cpu.out_of_place_cpu` (about one pass over memory); on CUDA, a
    multi-tensor clone and the kernel in place on it (`_cloned`); on other devices, the kernel's
    functional variant. Compiled, `_compiled` decides; `fresh` says that the tensors are
    intermediate results of the compiled program that nothing else reads (`famp.value_and_grad`'s
    gradients), a hint that changes no value. Results equal the kernel's bit for bit (tested on
    random bit patterns).
    """
    if torch.compiler.is_compiling():
        return _compiled(tensors, found, inv, fresh)
    real = type(inv) is torch.Tensor  # not a fake or meta scale
    if real and inv.device.type == "cpu":
        return eager_cpu.out_of_place_cpu(tensors, found, inv)
    if real and inv.device.type == "cuda" and tensors and _runs(tensors, inv):
        return _cloned(tensors, found, inv)
    return _kernel(tensors, found, inv)


def _cloned(tensors: list[Tensor], found: Tensor, inv: Tensor) -> tuple[list[Tensor], Tensor]:
    """Eagerly on CUDA: the kernel's functional variant (a clone and a launch per tensor, then
    the kernel) in two launches: one multi-tensor clone, then the kernel (docs/benchmarks.md,
    "CUDA, third measurements"). The multi-tensor clone keeps its one launch only where every
    tensor is non-overlapping and dense, so others are cloned apart. Same bits and strides."""
    together = [x.is_contiguous() or eager_cpu.dense(x) for x in tensors]
    picked = [x for x, t in zip(tensors, together, strict=True) if t]
    batch = iter(foreach_clone(picked) if picked else ())
    copies = [next(batch) if t else x.clone() for x, t in zip(tensors, together, strict=True)]
    amp_foreach_non_finite_check_and_unscale_(copies, found, inv)
    return copies, found


def _compiled(
    tensors: list[Tensor], found: Tensor, inv: Tensor, fresh: bool
) -> tuple[list[Tensor], Tensor]:
    """What `torch.compile` traces: on the CPU one `famp` operator, on CUDA the kernel.

    On the CPU, plain tensors that carry no graph take one opaque node, whatever the number of
    tensors, their sizes or symbolic shapes. `fresh` ones (intermediate results nothing else
    reads) whose `out_of_place` would run famp's compiled program (`_wide`) are copied and the
    copies unscaled in place by the kernel (`unscale_in_place_op`): inductor drops each copy
    and unscales the tensor where it lies, one pass over memory in place, and keeps a copy only
    where something else may still read the tensor; the step's first run compiles no program.
    Others go through `unscale_op`: the eager `out_of_place` (about one pass over memory, as a
    clone) into new tensors, one node, which compiles faster than the copies and the mutating
    operator (about 1 s more for 120 small grads). On CUDA, for dtypes the kernel runs there,
    the kernel: `fresh` tensors copied and the copies unscaled in place as on the CPU (inductor
    drops the copies: one launch for all of them), others copied by torch's multi-tensor clone
    (one kernel for all, where the kernel's functional variant cloned each with a launch of its
    own) and the copies unscaled in place. Traced as plain ops, inductor launches three kernels
    per tensor, and the host's launches dominate (docs/benchmarks.md, "CUDA, second
    measurements": 2.6 against 1.1 times a clone, 200 grads; "third measurements").
    Elsewhere, and for subclasses or tensors that carry a graph, big float32/float64 tensors are
    traced as plain ops, which inductor fuses into one read and one write per tensor where the
    kernel's functional variant makes two passes; but each tensor so traced adds about 0.15 s of
    compile time, so only tensors over `eager_cpu.CHUNK_BYTES` take it. Half dtypes keep the
    kernel, whose NaN bit patterns inductor does not keep.
    """
    device_type = inv.device.type
    if device_type == "cpu" and _opaque(tensors):
        if fresh and _wide(tensors):  # `found` is this call's own: the kernel updates it
            return copied_then_unscaled(tensors, found, inv, fresh)
        new, found = cast(tuple[list[Tensor], Tensor], unscale_op(tensors, found, inv))
        return list(new), found
    if device_type == "cuda" and tensors and _opaque(tensors) and _runs(tensors, inv):
        return copied_then_unscaled(tensors, found, inv, fresh)
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


def copied_then_unscaled(
    tensors: list[Tensor], found: Tensor, inv: Tensor, fresh: bool
) -> tuple[list[Tensor], Tensor]:
    """Traced: copies of `tensors` unscaled in place by the kernel (`found`, this call's own,
    updated in place). `fresh` ones are cloned one by one, clones that inductor drops (it
    unscales them where they lie), views excepted (`famp._compat.VIEW_BASE`: inductor would read
    them from storage offset 0); others (on CUDA) by one multi-tensor clone, which inductor
    writes as one kernel for them all. Tested compiled on CPU tensors too, on every torch."""
    kept = [not fresh or getattr(x, VIEW_BASE) is not None for x in tensors]
    picked = [x for x, k in zip(tensors, kept, strict=True) if k]
    batch = iter(foreach_clone(picked) if picked else ())
    copies = [next(batch) if k else x.clone() for x, k in zip(tensors, kept, strict=True)]
    unscale_in_place_op(copies, found, inv)
    return copies, found


def _wide(tensors: list[Tensor]) -> bool:
    """Whether `out_of_place` would give `tensors` (one dtype) to `fused.py`'s program, traced.

    float32/float64 tensors over `eager_cpu.CHUNK_BYTES` that total `fused.MIN_BYTES`; with
    symbolic sizes, which no branch may read, float32/float64 tensors whatever their sizes.
    """
    if not tensors or tensors[0].dtype not in (torch.float32, torch.float64):
        return False
    total = 0
    for x in tensors:
        numel: object = x.numel()
        if not isinstance(numel, int):  # a torch.SymInt: its size is not known while tracing
            return True
        nbytes = numel * x.element_size()
        total += nbytes if nbytes > eager_cpu.CHUNK_BYTES else 0
    return total >= fused.MIN_BYTES


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


@torch.library.impl("famp::unscale_", ("cpu", "cuda"))
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
    return numel * x.element_size() > eager_cpu.CHUNK_BYTES


def _kernel(tensors: list[Tensor], found: Tensor, inv: Tensor) -> tuple[list[Tensor], Tensor]:
    """The kernel's functional variant (a clone of every tensor, then the in-place kernel), or,
    for a dtype the kernel does not run on this device, its arithmetic (`where_program`)."""
    if not _runs(tensors, inv):
        return where_program(tensors, found, inv)
    new, found = amp_foreach_non_finite_check_and_unscale(tensors, found, inv)
    return list(new), found


def unscale_in_place(tensors: list[Tensor], found: Tensor, inv: Tensor) -> None:
    """The kernel in place (`tensors` of one dtype and device; `found` updated in place), or,
    for a dtype the kernel does not run on this device, its arithmetic written back."""
    if not _runs(tensors, inv):
        new, new_found = where_program(tensors, found, inv)
        for x, value in zip(tensors, new, strict=True):
            x.copy_(value)
        found.copy_(new_found)
        return
    amp_foreach_non_finite_check_and_unscale_(tensors, found, inv)


def unscale_owned(scale: Tensor, leaves: list[Tensor], owned: list[bool] | None) -> Tensor | None:
    """`found_inf` after the kernel ran in place on `leaves`, or `None` (nothing done).

    `famp.value_and_grad`'s common eager case, a few microseconds of Python where the general
    path of `unscale_leaves` takes several times that (and makes the same kernel call, in place):
    autograd's own gradients, all famp's alone (`owned`: plain strided tensors, not meta), of one
    dtype, on the CPU with the scale, none nested or requiring grad (`owned` is `None` elsewhere).
    """
    if owned is None or not (scale.is_cpu and leaves and all(owned)):
        return None
    dtype = leaves[0].dtype
    if dtype not in FLOAT_DTYPES:
        return None
    for leaf in leaves:
        if leaf.dtype is not dtype or not leaf.is_cpu or leaf.requires_grad or leaf.is_nested:
            return None
    if functorch_transforms_active():
        return None
    found = torch.zeros((), dtype=torch.float32)
    unscale_in_place(leaves, found, scale.double().reciprocal().float())
    return found


def _runs(tensors: list[Tensor], inv: Tensor) -> bool:
    """Whether the kernel runs these tensors (one dtype, `inv`'s device). Fake tensors outside a
    compile (`FakeTensorMode`: shapes, no values) take it whatever their dtype, as before."""
    if not tensors or type(tensors[0]) is not torch.Tensor:
        return True
    return kernel_runs(inv.device.type, tensors[0].dtype)


_KERNEL_RUNS: dict[tuple[str, torch.dtype], bool] = {}


@assume_constant_result  # compiled: a constant, read when tracing, no guard on the tensors
def kernel_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch's unscale kernel runs `dtype` tensors on `device_type`, read off the
    installed torch by running it once on one element (then remembered).

    CUDA builds of torch up to at least 2.11 have no bfloat16 kernel (pytorch/pytorch#127176:
    "not implemented for 'BFloat16'"), so `GradScaler` cannot unscale bfloat16 gradients there.
    famp computes the same arithmetic as plain ops instead (`where_program`), which gives the
    CPU kernel's bits; a torch whose kernel runs bfloat16 is used as it is.
    """
    key = (device_type, dtype)
    if key not in _KERNEL_RUNS:  # the CPU kernel runs every floating dtype
        _KERNEL_RUNS[key] = device_type == "cpu" or _probe(device_type, dtype)
    return _KERNEL_RUNS[key]


def _probe(device_type: str, dtype: torch.dtype) -> bool:
    with real_tensors():
        one = torch.ones((), dtype=torch.float32, device=device_type)
        try:
            amp_foreach_non_finite_check_and_unscale_(
                [torch.zeros(1, dtype=dtype, device=device_type)], one.clone(), one
            )
        except NotImplementedError:
            return False
    return True
