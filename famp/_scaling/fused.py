"""Big float32/float64 CPU grads unscaled eagerly in one pass, by a program famp compiles once.

Out of place, torch's unscale kernel needs a copy of each gradient and a second pass over the
copy; `eager_cpu.py` keeps that pass in cache, which still costs about 1.4x a clone. Inductor fuses
the kernel's arithmetic as plain ops (`where_program`) into one read and one write per tensor,
as a clone does. So, eagerly, famp compiles that program once per dtype
(`torch.compile(dynamic=True, fullgraph=True)`) for `ARITY` flat tensors of any sizes and reuses
it for every call: fewer tensors are padded with distinct two-element zeros, and new sizes never
recompile. The first trace of each dtype and thread count is a warm-up on tensors of
distinct big sizes, so that inductor parallelizes the loops of every slot (it decides from the
sizes it traced) and no two slots share a size symbol. After `torch.compiler.reset()`, which
drops every compiled graph, the next call warms up again (a first trace on tensors of equal sizes
would tie their sizes, and each new size would then recompile).

Compiling takes seconds (inductor's caches on disk shorten it in later processes), so eager
unscaling takes this path only for calls whose big float32/float64 grads of one dtype total at
least `MIN_BYTES`: models whose steps repay it soon. Where compiling or running the program
fails (no C++ compiler, `torch.compiler.set_stance("fail_on_recompile")`, Dynamo unsupported),
famp warns once and keeps torch's kernel for the rest of the process: the same bits, slower.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from famp._compat import dynamo_disabled, dynamo_graphs, python_modes_active
from famp._scaling.program import where_program

ARITY = 8  # tensors per call: fewer calls of the compiled program's fixed cost (about 50 µs)
MIN_BYTES = 128 << 20  # per call: compiling (seconds) is repaid within about a thousand steps

_Program = Callable[..., tuple[list[Tensor], Tensor]]
_lock = threading.Lock()
_program: list[_Program] = []  # the compiled program, once built
_warmed: set[tuple[torch.dtype, int]] = set()  # (dtype, thread count) traced so far
_padding: dict[torch.dtype, list[Tensor]] = {}
_failure: list[str] = []  # why the program is not used, once it failed


def usable(tensors: list[Tensor]) -> bool:
    """Whether eager unscaling may call the compiled program on `tensors` here and now.

    Not under a mode or in inference mode, nor for inference tensors or tensors that require
    grad: each would be one more variant for Dynamo to compile (it caps them at 8 per function),
    for rare cases that torch's kernel serves with the same bits.
    """
    if _failure or torch.is_inference_mode_enabled() or python_modes_active():
        return False
    if any(x.requires_grad or x.is_inference() for x in tensors):
        return False
    return not dynamo_disabled()


def unscale(
    tensors: list[Tensor], found: Tensor, inv: Tensor
) -> tuple[list[Tensor], Tensor] | None:
    """The kernel's results for dense CPU tensors of one dtype, or None if the program failed.

    Each tensor is passed as a flat view of its storage span and its result given its strides
    (both dense: the same storage order). On a failure nothing was written: the caller computes
    every result again with the kernel, from the same `found`.
    """
    dtype = tensors[0].dtype
    flats = [x.as_strided((x.numel(),), (1,), x.storage_offset()) for x in tensors]
    results: list[Tensor] = []
    try:
        program = _warmed_program(dtype, found, inv)
        if dtype not in _padding:  # distinct tensors: Dynamo guards on which inputs are one
            _padding[dtype] = [torch.zeros(2, dtype=dtype, device="cpu") for _ in range(ARITY - 1)]
        padding = _padding[dtype]
        with torch.no_grad():  # one grad mode to compile for; the results carry no graph
            for start in range(0, len(flats), ARITY):
                batch = flats[start : start + ARITY]
                new, found = program(found, inv, *batch, *padding[: ARITY - len(batch)])
                results.extend(new[: len(batch)])
    except Exception as error:  # any failure of torch.compile: torch's kernel gives the same bits
        _give_up(error)
        return None
    return [y.as_strided(x.shape, x.stride()) for x, y in zip(tensors, results, strict=True)], found


def _batch(found: Tensor, inv: Tensor, *tensors: Tensor) -> tuple[list[Tensor], Tensor]:
    return where_program(list(tensors), found, inv)


def _warmed_program(dtype: torch.dtype, found: Tensor, inv: Tensor) -> _Program:
    """The compiled program, traced for this dtype and thread count on tensors of big sizes."""
    key = (dtype, torch.get_num_threads())
    if key in _warmed and dynamo_graphs(_batch.__code__):
        return _program[0]
    with _lock:
        if not _program:
            _program.append(torch.compile(_batch, dynamic=True, fullgraph=True))
        if not dynamo_graphs(_batch.__code__):  # `torch.compiler.reset()` dropped every graph
            _warmed.clear()
        if key not in _warmed:
            size = (1 << 20) // dtype.itemsize + 1
            with torch.no_grad():
                _program[0](
                    found,
                    inv,
                    *(torch.zeros(size + i, dtype=dtype, device="cpu") for i in range(ARITY)),
                )
            _warmed.add(key)
    return _program[0]


def _give_up(error: Exception) -> None:
    lines = str(error).strip().splitlines()
    reason = f"{type(error).__name__}: {lines[0] if lines else ''}"
    _failure.append(reason)
    warnings.warn(
        f"famp.unscale_and_check: torch.compile could not build or run famp's one-pass eager "
        f"unscale ({reason}); famp uses torch's unscale kernel for the rest of this process, "
        f"with the same results, more slowly",
        RuntimeWarning,
        stacklevel=2,
    )
