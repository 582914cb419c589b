"""Weight casts that stay fresh: famp's cast cache, and the watch that drops both caches on writes.

torch's autocast caches the casts of leaf weights that require grad, keyed without the tensor
version: an in-place update of a weight inside a call (an optimizer or EMA step under
`torch.no_grad()`) would leave a stale cast in it. Eagerly, each `famp.autocast` call record
watches the weights read by its ops that may read a cast and drops every cached cast (torch's
and famp's own, which op overrides use) when one of them is written. Compiled graphs have no
cast cache.

torch's cache is also keyed without the dtype. Where module rules or nested calls compute in
two lower dtypes, the watch knows the dtype each weight was last read in since the cache was
last emptied, and empties it before an op reads a weight in another one: casts of weights read
on one side of a switch only stay cached, as in `torch.autocast` nested by hand. That needs every
op that may have cached a cast to have been watched (`dtype_switched`); else a switch empties the
cache as it happens.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from famp._autocast.op_calls import read_args
from famp._autocast.recompute import calls
from famp._autocast.threads import crowded
from famp._compat import (
    functorch_wrapped,
    is_view,
    storage_identity,
    tensor_version,
    torch_function_modes,
)


class _ThreadState(threading.local):
    def __init__(self) -> None:
        # The lower dtype each weight was last read in by a watched op since famp last emptied
        # torch's cache, and whether every op that may have cached a cast since was watched.
        self.read_in: dict[int, tuple[torch.Tensor, torch.dtype]] = {}
        self.complete = True


_LOCAL = _ThreadState()


def dtype_switched(stack: list[Any], pushed: bool) -> None:
    """The lower dtype in effect changes: empty torch's weight-cast cache unless each weight is
    checked as it is read (`WeightCasts.watch`). That holds while every op since the cache was
    last emptied was watched: each call on the stack tracks eagerly, the outermost intercepts
    (a nested call without a mode of its own is watched by the call below: `mode.watch_nested`)
    and their modes are in effect here (the autograd engine runs a custom backward without
    them), from the innermost replay's on (a replay's backward runs with its own modes only),
    and no other thread computes in a dtype this thread's casts may meet (`threads.crowded`).
    `pushed`: whether the innermost call's own mode is on torch's stack here (not as its region
    starts or ends, nor inside its own handler)."""
    if torch.compiler.is_compiling():  # a block compiled inside an eager call: no cast cache
        return
    modes = sum(1 for r in stack[max((r.group for r in stack), default=0) :] if r.intercepts)
    if stack and not pushed and stack[-1].intercepts:
        modes -= 1
    if not (
        _LOCAL.complete
        and stack
        and stack[0].intercepts
        and all(r.track and not r.recompute_only for r in stack)
        and torch_function_modes() >= modes
        and not crowded(stack[-1].device_type)
    ):
        forget_casts()


def unwatched(forget: bool = False) -> None:
    """Ops famp does not watch may have cached casts (the user's own `torch.autocast` around a
    call or a recomputation, a nested call on another device type): the next switch empties
    the cache. `forget`: the outermost call ends inside such an autocast; the weights read in it
    are let go (a functional loop makes new ones each step)."""
    _LOCAL.complete = False
    if forget:
        _LOCAL.read_in.clear()


def ends_in(dtype: torch.dtype) -> None:
    """The outermost call ends inside the user's `torch.autocast`, whose ops, which famp does not
    watch, go on in `dtype`: torch's cache is emptied if a weight's cast in it is of another
    dtype (the user's next read of it would take that cast), and the weights read are let go of
    (a functional loop makes new ones each step)."""
    if any(read is not dtype for _, read in _LOCAL.read_in.values()):
        forget_casts()
    unwatched(forget=True)


def emptied() -> None:
    """torch's cache is empty here (the outermost autocast state starts or ends)."""
    _LOCAL.read_in.clear()
    _LOCAL.complete = True


def replay_starts() -> int:
    """A recomputation in backward starts: the number of calls below its records. Outside any
    call, torch's cache is empty unless an autocast state is open around the backward."""
    below = len(calls())
    if not below:
        if torch.autocast_increment_nesting() == 1:
            emptied()
        else:
            unwatched()
        torch.autocast_decrement_nesting()
    return below


def forget_casts() -> None:
    """Empty torch's weight-cast cache; every call on this thread forgets what it watched."""
    torch.clear_autocast_cache()
    emptied()
    for record in calls():
        record.casts.forget()


class CastCache:
    """famp's own weight-cast cache: reused only for the same tensor, dtype and version."""

    def __init__(self) -> None:
        self.entries: dict[tuple[int, torch.dtype], tuple[torch.Tensor, int, torch.Tensor]] = {}

    def cast(self, t: torch.Tensor, dtype: torch.dtype, lower: torch.dtype) -> torch.Tensor:
        cacheable = (
            not torch.compiler.is_compiling()
            and dtype == lower
            and t.dtype == torch.float32
            and t.requires_grad
            and t.is_leaf
            and not is_view(t)
            and not t.is_inference()  # no version counter: a cast per use
            and not functorch_wrapped(t)  # torch caches nothing inside `torch.func.grad` either
            and torch.is_grad_enabled()
            and torch.is_autocast_cache_enabled()  # off: one cast per use, as torch's cache off
        )
        if not cacheable:
            return t.to(dtype=dtype)  # the keyword: torch parses it about 1 µs faster
        key = (id(t), dtype)
        hit = self.entries.get(key)
        if hit is not None and hit[0] is t and hit[1] == tensor_version(t):
            return hit[2]
        out = t.to(dtype=dtype)
        self.entries[key] = (t, tensor_version(t), out)
        return out


class WeightCasts:
    """One call's cast caches and the weights they hold casts of, with the version each had."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self.cache = CastCache()
        # The cacheable weights the ops have read since the caches were last cleared, with the
        # version each had then and the lower dtype of the last read (None: autocast off); their
        # storages and data pointers (`_storage`) catch writes through `.data` and other
        # aliases, each weight's looked up once, at the first write after its first read
        # (`pending` till then).
        self.weights: dict[int, tuple[torch.Tensor, int, torch.dtype | None]] = {}
        self.storages: set[int] = set()
        self.pointers: dict[int, torch.Tensor] = {}
        self.pending: list[torch.Tensor] = []

    def watch(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype | None
    ) -> None:
        """Before an op that runs in the lower dtype `dtype` (None: autocast off): drop every
        weight cast if a weight it reads was written since its cast, or read in another dtype.

        torch's version counter is shared by a tensor's views and `detach()`es, so this sees
        writes through any of them, wherever they were made (inside C++ ops, other threads).
        Runs before every op famp intercepts that may read a weight's cast (not before views,
        attribute reads or pointwise ops: `overrides.reads_no_cast`): one loop, the cheapest
        tests first.
        """
        for values in (args, kwargs.values()) if kwargs else (args,):
            for v in values:
                kind = type(v)
                if kind in _SCALARS:  # by type first: `isinstance(v, Tensor)` costs ~0.1 µs
                    continue
                if kind in _TENSORS or isinstance(v, torch.Tensor):
                    if (
                        v.requires_grad
                        and not is_view(v)
                        and v.is_leaf
                        and v.dtype is _F32
                        and not v.is_inference()
                    ):
                        self._read(v, dtype)
                elif kind is tuple or kind is list or isinstance(v, (list, tuple)):
                    for t in v:
                        if (
                            type(t) not in _SCALARS
                            and isinstance(t, torch.Tensor)
                            and _cacheable(t)
                        ):
                            self._read(t, dtype)

    def watch_call(
        self,
        func: Any,
        packet: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        dtype: torch.dtype | None,
    ) -> None:
        """`watch` before an op call, of the arguments it may read a cast from (`read_args`)."""
        self.watch(read_args(func, packet, args), kwargs, dtype)

    def _read(self, t: torch.Tensor, dtype: torch.dtype | None) -> None:
        """An op reads the cacheable weight `t` in `dtype`: watch it, or clear if it was written
        since, or read in another lower dtype (by this call or another on the thread)."""
        key = id(t)
        seen = self.weights.get(key)
        if seen is not None and seen[0] is t:
            if seen[1] != tensor_version(t):
                self.clear()
                seen = None
            elif dtype is None or seen[2] is dtype:
                return
        else:
            seen = None
        if dtype is not None and not torch.is_autocast_enabled(self.device_type):
            dtype = None  # the op casts nothing (FampMode's fast path passes the dtype in effect)
        if dtype is not None:
            read_in = _LOCAL.read_in
            last = read_in.get(key)
            if last is not None and last[0] is t and last[1] is not dtype:
                forget_casts()
                seen = None
            read_in[key] = (t, dtype)
        self.weights[key] = (t, tensor_version(t), dtype)
        if seen is None:
            self.pending.append(t)

    def invalidate(self, target: object) -> None:
        """After an in-place write: drop every weight cast if it wrote into a watched weight.

        By storage, so that writes through `.data` (which has its own version counter) and any
        other alias are seen too.
        """
        tensors = target if isinstance(target, (list, tuple)) else (target,)
        if self.pending:  # once per weight: a rebuild at each write was quadratic in a CNN
            for t in self.pending:
                storage, pointer = _storage(t)
                self.storages.add(storage)
                self.pointers[pointer] = t
            self.storages.discard(0)
            self.pointers.pop(0, None)
            self.pending.clear()
        for t in tensors:
            if isinstance(t, torch.Tensor):
                storage, pointer = _storage(t) if self.storages else (0, 0)
                held = self.pointers.get(pointer)  # moved: FSDP2 frees, reallocates (a hunt)
                moved = held is None or _storage(held)[1] != pointer
                if id(t) in self.weights or storage in self.storages or not moved:
                    self.clear()
                    return

    def clear(self) -> None:
        """Drop every weight cast, torch's and famp's."""
        self.cache.entries.clear()
        self.forget()
        forget_casts()

    def forget(self) -> None:
        """torch's cache was emptied: only the weights of famp's own casts still need watching
        (before 2026-12-02 they were let go too, and a write through `.data` after a dtype
        switch left famp's cast of the weight stale)."""
        self.weights.clear()
        self.storages.clear()
        self.pointers.clear()
        self.pending.clear()
        for t, version, _ in self.cache.entries.values():
            self.weights[id(t)] = (t, version, None)
            self.pending.append(t)


def _cacheable(t: torch.Tensor) -> bool:
    """Whether torch's cast cache may hold a cast of `t` (the test `watch` writes out inline)."""
    return (
        t.requires_grad
        and not is_view(t)  # torch caches no view; `is_leaf` may raise on some views
        and t.is_leaf
        and t.dtype is _F32
        and not t.is_inference()  # made under inference_mode: no version counter to watch
    )


_F32 = torch.float32  # a dtype is a singleton: `is` is the cheapest comparison
_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
# The types of most arguments that are no tensor: told apart by type, not by `isinstance`, which
# torch's tensor metaclass makes slow for them.
_SCALARS = frozenset({int, float, bool, type(None), str, torch.dtype, torch.device, torch.Size})


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """Two keys of the memory `t` writes into: its storage, which a `resize_` keeps (FSDP2 frees
    an unsharded weight after each use and all-gathers into it again, keeping its version: before
    2026-12-02 the move of its data pointer hid that write), and its data pointer, shared by
    aliases with a storage of their own (`torch.from_dlpack`). The pointer 0 (no memory) is no
    key."""
    try:
        return storage_identity(t), int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # nested, sparse, functorch-wrapped tensors
        return 0, 0
