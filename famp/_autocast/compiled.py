"""`famp.autocast`'s own compile (`compile=True`; on CUDA by default): its calls.

The compile is famp's, not the caller's: a size that the caller marked with
`torch._dynamo.mark_dynamic` for a compile of theirs may be fixed in this graph (`x @ w` with a
weight of fixed size fixes `x`'s), where Dynamo would refuse the graph and `torch.autocast`, which
does not compile, runs. Marked tensors among the arguments are found before the call; a marked
tensor the arguments do not reach (a closure's, a module's buffer) costs one refused trace, which
torch logs, and a retry. Dynamo's switch is process-wide while such a call runs: a compile on
another thread meanwhile would not refuse its own marks either (marks refuse graphs; they change
no number).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from famp._autocast.mode import FampMode
from famp._autocast.recompute import (
    calls,
    drop_abandoned_replays,
    in_block,
    observe_eagerly,
    untraced,
)
from famp._compat import (
    BACKWARD_AUTOCAST,
    CHECKPOINT_EFFECTS,
    assume_constant_result,
    compile_callbacks,
    refused_marks,
    relaxed_marks,
    run_frames_eagerly,
)

_switched: list[object] = []  # torch's setting while famp set it "off" for this compile


def _compile_starts(_: object) -> None:
    # After a backward that raised inside a recomputation, what it entered is left (eagerly, at
    # the next famp call): a trace would find it, and fail on the module hooks it holds.
    drop_abandoned_replays()
    # A famp call runs on this thread: its autocast state is the one Dynamo sees at the frame's
    # start, but eager backward runs without it (famp's rules may compute in float32 inside).
    running = calls()
    module, name = BACKWARD_AUTOCAST
    if running and getattr(sys.modules[module], name) == "same_as_forward":
        _switched.append("same_as_forward")
        setattr(sys.modules[module], name, "off")
    if any(record.intercepts for record in running):
        # Its mode is pushed again inside each checkpointed block Dynamo traces (`mode._under`).
        scopes_in_checkpoints(True)


def _compile_ends(_: object) -> None:
    if _switched:
        module, name = BACKWARD_AUTOCAST
        setattr(sys.modules[module], name, _switched.pop())
    if _scoping:  # a compile inside an intercepting call, or a trace that raised in one
        _scoping.clear()
        module, name = CHECKPOINT_EFFECTS
        setattr(sys.modules[module], name, False)


_scoping: list[bool] = []  # famp's reasons for the config being on (it set it), innermost last


@assume_constant_result  # runs as Dynamo traces the call: before its checkpoints, and after
def scopes_in_checkpoints(enter: bool) -> bool:
    """Let Dynamo trace checkpointed blocks inside a call with module rules (entering and leaving
    a module's scope changes the call's record, outside the block) or inside an eager call with
    a mode (pushed again inside the block) from `enter=True` to `enter=False` or the compile's
    end (see `famp._compat`); a setting of the user's own stays."""
    module, name = CHECKPOINT_EFFECTS
    if enter and (_scoping or not getattr(sys.modules[module], name)):
        setattr(sys.modules[module], name, True)
        _scoping.append(True)
    elif not enter and _scoping:
        _scoping.pop()
        if not _scoping:
            setattr(sys.modules[module], name, False)
    return True


@assume_constant_result  # traced, it runs as Dynamo traces (before a graph break resumes)
def watch_compiles() -> bool:
    """Have code that torch.compile compiles while a famp call runs on the thread (a compiled
    module inside the call, a frame resumed after a graph break, a nested call's own compile)
    trace its backward without autocast, as eager backward runs after the call: torch traces it
    under the autocast state the frame began in, famp's, in which famp's rules were not (see
    `famp._compat`); and have `recompute.observe` and `in_block` run untraced where Dynamo
    traces an eager call's bookkeeping. Nothing to do before Dynamo is loaded: nothing compiles
    without it. First, the state a backward that raised in a recomputation left is dropped."""
    drop_abandoned_replays()  # each call's first step; traced, as the trace starts
    if "torch._dynamo" in sys.modules:
        if not untraced:
            disable = torch.compiler.disable
            untraced.extend([disable(observe_eagerly), disable(in_block)])  # type: ignore[no-untyped-call]
            run_frames_eagerly(FampMode.__torch_function__)  # from a module run eagerly
        handler = compile_callbacks()
        if _compile_starts not in handler.start_callbacks:  # torch.compiler.reset() drops them
            handler.register_start_callback(_compile_starts)
            handler.register_end_callback(_compile_ends)
    return True


def own_code(fn: Callable[..., Any]) -> Any:
    """A copy of a function with a code object of its own: Dynamo keeps its compiled graphs per
    code object, at most `recompile_limit` (8) of them, and the transforms of one process would
    all share the code of one wrapper, so that from the ninth transform compiled on, torch would
    run them uncompiled, with only a warning."""
    code = fn.__code__
    copy = types.FunctionType(
        code.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


def call_compiled(compiled: Callable[..., Any], marked: bool, *args: Any, **kwargs: Any) -> Any:
    """`compiled(*args, **kwargs)`, with the marks relaxed where `marked` (a tensor among the
    arguments carries `mark_dynamic` marks) or where Dynamo refused marks the arguments hide."""
    if marked:
        with relaxed_marks():
            return compiled(*args, **kwargs)
    try:
        return compiled(*args, **kwargs)
    except Exception as error:  # raised while tracing, before anything ran
        if not refused_marks(error):
            raise
    with relaxed_marks():
        return compiled(*args, **kwargs)
