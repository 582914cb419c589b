"""What torch's Python functions hand to the torch function modes, and what some leave out.

torch's Python functions begin `if has_torch_function(...): return handle_torch_function(func,
relevant_args, *args, **kwargs)`, handing their call to the modes. Some leave a parameter out of
the call they hand on: torch 2.13 to 2.15's `F.l1_loss` drops `weight`, `torch.chain_matmul` drops
`out`. Under any torch function mode, famp's included, such a call ran without it: with an
override or `track_casts`, `F.l1_loss(a, b, weight=w)` gave the unweighted loss. `dropped` reads
which parameters a function leaves out, from its bytecode; famp's mode takes their values from
the function's own frame, waiting below on the stack (`recovered`).
"""

from __future__ import annotations

import dis
import sys
import types
from collections.abc import Callable
from typing import Any

from famp._autocast.op_calls import recall, remember

# Instructions that push a local (Python 3.10 to 3.13: 3.13 pushes two with one instruction).
_LOADS = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_LOAD_FAST", "LOAD_DEREF"})
_DROPPED: dict[Any, tuple[str, ...]] = {}


def dropped(func: Callable[..., Any]) -> tuple[str, ...]:
    """The parameters of torch's Python function `func` that its `handle_torch_function` call
    does not hand on (`F.l1_loss`: `("weight",)`); `()` for any other function."""
    known = recall(_DROPPED, func)
    if known is None:
        known = _dropped(func) if isinstance(func, types.FunctionType) else ()
        remember(_DROPPED, func, known)
    return known


def _dropped(func: types.FunctionType) -> tuple[str, ...]:
    code = func.__code__
    if "handle_torch_function" not in code.co_names:
        return ()
    params = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]  # not `*args`
    instructions = iter(dis.get_instructions(code))
    for ins in instructions:  # `handle_torch_function`, `overrides.handle_torch_function`
        if ins.argval == "handle_torch_function" and ins.opname.startswith("LOAD_"):
            break
    else:
        return ()
    relevant: list[str] = []  # the locals loaded first: `relevant_args`, one tuple or one name
    passed: set[str] | None = None  # the locals loaded after it: those handed on
    for ins in instructions:
        if ins.opname.startswith("RETURN"):
            break
        names = ins.argval if isinstance(ins.argval, tuple) else (ins.argval,)
        if ins.opname in _LOADS:
            (relevant.extend if passed is None else passed.update)(names)
        elif passed is None and relevant:  # the tuple of those loaded, or the first alone
            whole = ins.opname == "BUILD_TUPLE" and ins.argval == len(relevant)
            passed = set() if whole else set(relevant[1:])
    passed = passed or set()
    return tuple(p for p in params if p not in passed)


def recovered(
    func: types.FunctionType, args: tuple[Any, ...], kwargs: dict[str, Any], names: tuple[str, ...]
) -> dict[str, Any]:
    """`kwargs` with those of the parameters `names` that `func` dropped and the call lacks, read
    from `func`'s own frame: the innermost running `func`'s code, a few frames below the mode."""
    given = func.__code__.co_varnames[: min(len(args), func.__code__.co_argcount)]
    names = tuple(n for n in names if n not in kwargs and n not in given)
    if not names:
        return kwargs
    frame: types.FrameType | None = sys._getframe(1)
    for _ in range(8):
        if frame is None or frame.f_code is func.__code__:
            break
        frame = frame.f_back
    if frame is None or frame.f_code is not func.__code__:
        return kwargs
    values = frame.f_locals
    return {**kwargs, **{n: values[n] for n in names if n in values}}
