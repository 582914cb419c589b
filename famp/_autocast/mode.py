"""The TorchFunctionMode behind `famp.autocast`: op overrides, module scopes, fresh weight casts.

`famp.autocast` runs the user's function inside torch's own autocast state, so that every op the
default rules cover is cast by torch's C++ kernels exactly as `torch.autocast` casts it. This mode
adds what torch cannot express, one Python-level op call at a time:

- an op whose rule differs from the default table gets its inputs cast per the rule and runs with
  autocast off for the device (what torch's C++ wrappers do), so nothing inside it is recast;
- inside a module that a module rule matches, each op runs under that policy's autocast state;
- eagerly, an in-place update of a cacheable weight clears the weight-cast cache, so that no op
  reads a cast made before the update (torch's cache is keyed without the tensor version).

"Op call" means a call of a C++-bound torch function (`torch.*`, `torch.nn.functional.*` builtins,
`Tensor` methods, `torch.ops.aten.*`). torch's own Python functions (`torch.nn.functional`,
`torch.functional`, Python `Tensor` methods) are entered, so the ops they call are seen too; calls
made from inside an op's C++ implementation are not (the `bmm` inside `einsum`, the `linear` inside
`lstm`): override the outer op instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import FunctionType, MethodWrapperType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from famp._autocast.block_nodes import bracket_outputs
from famp._autocast.handed import dropped, recovered
from famp._autocast.op_calls import call, inplace_target, renorms, written
from famp._autocast.overrides import (
    TRACED_CALL,
    UNWATCHED,
    WRITES,
    entered_at,
    plain,
    traced_plain,
)
from famp._autocast.recompute import (
    calls,
    drop_abandoned_replays,
    observe_eagerly,
    recomputing_unrun,
)
from famp._autocast.threads import computes_in, done
from famp._autocast.tree_casts import FLAT_LEAVES
from famp._autocast.weights import dtype_switched, unwatched
from famp._compat import (
    modes_see_every_binding,
    no_torch_function,
    saved_tensors_hooks_top,
    torch_function_modes,
)


def _under(mode: TorchFunctionMode, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with mode:
        return fn(*args, **kwargs)


def run_plain(
    owner: Any, func: Callable[..., Any], args: tuple[Any, ...], kwargs: Any, kind: int
) -> Any:
    """An op call that needs nothing of famp (`kind`, `overrides.plain`'s answer), eagerly:
    torch's kernels do it all; the call record `owner` watches the weights it reads unless it
    can read no weight's cast, and catches a write: into its first argument for an in-place
    op (`WRITES`), via `out=` or an `inplace` flag."""
    if kind == WRITES and type(func) is not FunctionType:  # torch casts nothing of its target
        owner.casts.watch(args[1:], kwargs, owner.seen_dtype)  # (`op_calls.read_args`)
    elif kind != UNWATCHED:  # a Python in-place function may compute with its target too
        owner.casts.watch(args, kwargs, owner.seen_dtype)
    if kind == WRITES:
        out = call(func, args, kwargs or {}, memo=True)
        owner.casts.invalidate(written(args, kwargs))
        return out
    if not kwargs and type(func) is not FunctionType:
        return func(*args)
    out = call(func, args, kwargs or {}, memo=True)
    target = kwargs.get("out") if kwargs else None
    if target is None and type(func) is FunctionType:
        target = inplace_target(func, args, kwargs or {})  # `F.relu(x, inplace=True)`
    if target is not None:
        owner.casts.invalidate(target)
    return out


def own_cast(cast: Callable[[Any], Any], tree: Any) -> Any:
    """`cast(tree)`, famp's own cast of the values a matched module or a nested call takes or
    returns, past famp's modes where they would only call `Tensor.to` on plain tensors.

    Eagerly, outside checkpointed blocks, with grad on and no torch function mode but famp's,
    each `FampMode` hands a `Tensor.to` straight to torch (`run_plain`): it writes nothing and
    reads no weight cast, so there is nothing to watch. Going round the modes saves their Python
    dispatch (several microseconds a cast); tensor subclasses, other modes and the cases above
    keep the modes' way.
    """
    stack = calls()
    if (
        stack
        and not torch.compiler.is_compiling()
        and torch.is_grad_enabled()
        and saved_tensors_hooks_top() is None
        and all(r.track and not r.recompute_only and not r.grad_free for r in stack)
        and torch_function_modes() == sum(1 for r in stack if r.intercepts)
        and (
            type(tree) in FLAT_LEAVES
            or (type(tree) in (tuple, list) and all(type(x) in FLAT_LEAVES for x in tree))
        )
    ):
        with no_torch_function():
            return cast(tree)
    return cast(tree)


def watch_nested(owner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """An op of a nested `famp.autocast` call without a mode of its own (no overrides, module
    rules or `track_casts`) reaches the mode of the nearest call below that has one, `owner`'s:
    `owner` watches the weights it reads, in the dtype it runs in, so that a call nested in
    another dtype needs no clear of torch's cast cache (weights.py)."""
    top = calls()[-1]
    if top.intercepts or not top.track:
        return
    if top.proxy is None:
        top.proxy = next(r for r in reversed(calls()) if r.intercepts)
    if top.device_type != owner.device_type:
        unwatched()
    elif top.proxy is owner:
        dev = top.device_type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        owner.casts.watch(args, kwargs, dtype)


class FampMode(TorchFunctionMode):
    """Applies one `famp.autocast` call's overrides and module scopes; see the module docstring."""

    def __init__(self, owner: Any) -> None:
        super().__init__()
        self.owner = owner  # the CallRecord of the famp.autocast call this mode serves
        self.inside: set[Callable[..., Any]] = set()
        if torch.compiler.is_compiling():  # as Dynamo traces it, the mode sees every C binding
            modes_see_every_binding()

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        owner = self.owner
        if (
            # Eagerly, most calls: an op that is not overridden, not entered and writes into no
            # argument but in place, run outside any checkpointed block and any module rule's
            # scope with the call's own autocast dtype and nothing suspended, goes straight to
            # `run_plain`, where the general path below ends too. The dtype matters only to an
            # op that may read a weight's cast (the cache is dropped where it changed).
            owner.plain_ops is not None
            and not torch.compiler.is_compiling()  # first: Dynamo cannot trace the checks below
            and (not owner.scopes or owner.scopes[-1] is None)
            and not owner.suspended
            and not owner.grad_free
            and not owner.recompute_only
            and torch.is_grad_enabled()
            and saved_tensors_hooks_top() is None
            and (kind := plain(func, owner.overrides, owner.device_type, owner.plain_ops))
            and (
                kind == UNWATCHED or torch.get_autocast_dtype(owner.device_type) is owner.seen_dtype
            )
        ):
            return run_plain(owner, func, args, kwargs, kind)
        if kwargs is None:
            kwargs = {}
        if not owner.track or torch.compiler.is_compiling():  # traced: no eager bookkeeping
            if torch.compiler.is_compiling() and (not owner.scopes or owner.scopes[-1] is None):
                how = traced_plain(owner.overrides, func)  # a constant while Dynamo traces
                if how == TRACED_CALL:  # op_calls.call's work, written out: one frame less
                    return func(*args, **kwargs)
                if how:
                    return call(func, args, kwargs, method=True)
            return self._op(owner, func, args, kwargs, False)
        if owner.recompute_only and saved_tensors_hooks_top() is None:
            return call(func, args, kwargs)  # a custom backward, not the recomputation
        # Is this op inside a checkpointed block? Not asked of a tensor attribute's read or write
        # (`t._backward_hooks = ...`): torch sets one as it regenerates a view's grad_fn, holding
        # the view's lock, which reading that grad_fn here would wait for forever.
        block = None if type(func) is MethodWrapperType else observe_eagerly(owner, args)
        out = self._op(owner, func, args, kwargs, True)
        if block is not None and not recomputing_unrun():
            bracket_outputs(out, block, args, kwargs)
        return out

    def _op(
        self,
        owner: Any,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        track: bool,
    ) -> Any:
        """One op call; `track`: eager bookkeeping (the call tracks, and nothing is compiling)."""
        if type(func) is FunctionType and not torch.compiler.is_compiling():
            names = dropped(func)  # compiled, Dynamo hands on the call's own arguments
            if names:
                kwargs = recovered(func, args, kwargs, names)  # `F.l1_loss`'s `weight`
        if owner.suspended and track:
            drop_abandoned_replays()  # a backward raised in one (caught): its records go
        if owner.suspended:
            if track:
                watch_nested(owner, args, kwargs)
            return call(func, args, kwargs)  # a nested famp.autocast call governs this op
        if track:
            # Code inside may enter its own torch.autocast with another dtype: torch's weight-cast
            # cache ignores the dtype (weights.py).
            dtype = torch.get_autocast_dtype(owner.device_type)
            if dtype is not owner.seen_dtype:
                dtype_switched(calls(), pushed=False)
                owner.seen_dtype = dtype
                done(computes_in(owner.device_type, frozenset((dtype,))))  # other threads'
        if func is checkpoint and func not in self.inside:
            # Dynamo hands the checkpoint of a block to the mode (eagerly it is no torch function)
            # and traces the block with the mode popped: trace it with the mode pushed again.
            self.inside.add(func)
            try:
                block, *rest = args
                return func(functools.partial(_under, self, block), *rest, **kwargs)
            finally:
                self.inside.discard(func)
        if owner.overrides is not None and func not in self.inside:
            if torch.compiler.is_compiling():
                at = entered_at(owner.overrides, func)
                body = owner.overrides.bodies[at] if at >= 0 else None
            else:
                body = owner.overrides.enter.get(func)
            if body is None and renorms(func, args, kwargs):
                body = owner.overrides.renorming.get(func)
                if body is not None:  # it calls no function of its name: nothing to guard
                    with self:
                        return body(*args, **kwargs)
            if body is not None:
                self.inside.add(func)
                try:
                    with self:
                        return body(*args, **kwargs)
                finally:
                    self.inside.discard(func)
        return owner.run_op(func, args, kwargs, track)
