"""Activation checkpointing inside `famp.autocast`: famp's state is back while torch recomputes.

`torch.utils.checkpoint` restores torch's own autocast state (enabled, dtype, cache) around a
recomputation, and nothing else: famp's op overrides, module scopes and cast cache live in the call
record and its `TorchFunctionMode`, both gone by the time backward runs. famp therefore ties its
state to the autograd graph, with public node hooks: each node whose backward may recompute a
checkpointed block gets a pre-hook that re-enters the famp state in effect where the block began
(the stack of calls, each with its module scopes, and a fresh cast cache) and a hook that leaves it.

- Non-reentrant and selective checkpointing recompute from inside the backward of any node whose
  saved tensors the checkpoint packed: every node an op creates while saved-tensor hooks are
  active is bracketed, with the state at the first famp event of that block (an op, a module
  entry or exit, a nested call starting); which nodes, `block_nodes.py` says.
- Reentrant checkpointing recomputes inside the backward of its own node
  (`CheckpointFunctionBackward`), which famp finds on the block's outputs at the next famp event,
  where the state is the block's again, and behind it those of reentrant blocks chained to it.

Outside a recomputation the pushed state is inert: famp's mode applies overrides and module scopes
only while torch's autocast state is the call's own, which checkpoint restores around `fn` alone.
Compiled graphs need none of this: Dynamo traces the block once, famp's casts included, and the
recomputation replays that graph.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction

from famp._autocast.threads import recomputed, recomputes
from famp._compat import (
    CHECKPOINT_FUNCTION_ATTR,
    checkpoint_frame,
    graph_task,
    saved_tensors_hooks_top,
)

BRACKETED = "famp.recompute"  # marks a node famp has bracketed (Node.metadata)
REENTRANT_NODE = "CheckpointFunctionBackward"  # torch.utils.checkpoint.CheckpointFunction's node

# A snapshot: the calls in effect, outermost first, each as a factory of a fresh call record.
Snapshot = tuple[Callable[[], Any], ...]


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.calls: list[Any] = []  # running call records, innermost last
        self.regions: dict[int, tuple[object, Snapshot]] = {}  # checkpointed blocks seen
        self.replays: list[_Replay] = []  # replays entered on this thread, innermost last


_LOCAL = _ThreadState()


def calls() -> list[Any]:
    """This thread's stack of running `famp.autocast` call records, innermost last."""
    return _LOCAL.calls


def snapshot() -> Snapshot:
    return tuple(record.frozen() for record in calls())


# `observe_eagerly` and `in_block` with Dynamo off inside, made once Dynamo is loaded
# (`compiled.watch_compiles`).
untraced: list[Callable[..., Any]] = []


def observe(record: Any, values: Any) -> Snapshot | None:
    """`observe_eagerly`, also where Dynamo traces an eager call's frame that it resumed after a
    graph break (the call's record tracks): there it runs behind a graph break, where torch's
    query of the saved-tensor hooks, which Dynamo cannot trace, would have broken the graph too,
    with a warning."""
    if torch.compiler.is_compiling():
        return (untraced[0] if untraced else observe_eagerly)(record, values)
    return observe_eagerly(record, values)


def in_block() -> bool:
    """Whether saved-tensor hooks are active (a checkpointed block runs or is recomputed); where
    Dynamo traces an eager record's module hooks, behind a graph break as `observe`."""
    if torch.compiler.is_compiling() and untraced:
        return bool(untraced[1]())
    return saved_tensors_hooks_top() is not None


def observe_eagerly(record: Any, values: Any) -> Snapshot | None:
    """Called eagerly before each famp event; returns the block's snapshot inside a checkpoint.

    Inside saved-tensor hooks (a non-reentrant checkpoint) the first event of the block records
    the state. After a grad-free op (the forward of a reentrant checkpoint runs without grad), the
    tensors of each event are searched for a reentrant checkpoint's node, bracketed with the state
    of now (the block's: module entries and exits within it are balanced). `record` is the call
    whose event it is; the grad-free mark passes to the outer call when a nested one ends.
    """
    if not torch.is_grad_enabled():
        record.grad_free = True
        if record.grad_free_block is None and saved_tensors_hooks_top() is not None:
            # A custom Function's forward inside a non-reentrant checkpoint's block.
            record.grad_free_block = _region(saved_tensors_hooks_top())
        return None
    if record.grad_free:
        _bracket_opaque(record, values)
    top = saved_tensors_hooks_top()
    if top is None:
        return None
    return _region(top)


def _region(top: Any) -> Snapshot:
    regions = _LOCAL.regions
    key = id(top[0])
    found = regions.get(key)
    if found is None or found[0] is not top[0]:
        found = (top[0], snapshot())
        regions[key] = found
        stack = calls()
        if stack and not any(r.intercepts for r in stack):  # no node bracketed: see `replayed`
            frame = checkpoint_frame(top)
            if frame is not None:
                _FRAMES[frame] = found[1]
    return found[1]


# Non-reentrant checkpoints whose blocks began inside calls without a mode, with their state.
_FRAMES: weakref.WeakKeyDictionary[object, Snapshot] = weakref.WeakKeyDictionary()


def replayed() -> _Replay | None:
    """A call that starts with no call around it, inside the recomputation of such a block: the
    state where the block began, entered (`_Replay.exit` leaves it). Before 2026-12-02 a call
    nested in the block ran there as an outermost call: its input uncast."""
    top = saved_tensors_hooks_top() if _FRAMES else None
    frame = checkpoint_frame(top) if top is not None else None
    state = _FRAMES.get(frame) if frame is not None else None
    if state is None:
        return None
    replay = _Replay(state)
    replay.enter(None)
    return replay


def drop_abandoned_replays() -> None:
    """After a backward that raised inside a bracketed node: leave what its hooks entered.

    The node's post-hook never ran; torch has already restored the torch-function mode stack.
    Called when a call starts outside any backward, where no replay can be running.
    """
    while _LOCAL.replays and graph_task() == -1:
        _LOCAL.replays[-1]._leave()


def end_of_outermost_call() -> None:
    """Forget the blocks seen: the graph's hooks hold what recomputation needs."""
    _LOCAL.regions = {}


def tensors(values: Any, out: list[torch.Tensor], depth: int = 0) -> None:
    if isinstance(values, torch.Tensor):
        out.append(values)
    elif depth < 3 and isinstance(values, (list, tuple)):
        for v in values:
            tensors(v, out, depth + 1)
    elif depth < 3 and isinstance(values, dict):
        for v in values.values():
            tensors(v, out, depth + 1)


def recomputing_unrun() -> bool:
    """Whether the ops running now build a graph no backward runs: a non-reentrant checkpoint's
    recomputation, inside the backward of a node of its block, keeps only the tensors it saves
    (a reentrant one runs backward through its recomputed graph, whose nodes famp brackets)."""
    replays = _LOCAL.replays
    return bool(replays) and not (replays[-1].reentrant or replays[-1].recompute_only)


def _bracket_opaque(record: Any, values: Any) -> None:
    # Nodes famp did not see made: a reentrant checkpoint's, or a custom Function's.
    found: list[torch.Tensor] = []
    tensors(values, found)
    for t in found:
        node: Any = t.grad_fn
        if node is None or BRACKETED in node.metadata or hasattr(node, "variable"):
            continue
        if node.name() == REENTRANT_NODE:
            _bracket_chain(node, snapshot())
        elif record.grad_free_block is not None and isinstance(node, BackwardCFunction):
            # Its backward (user code) reads its saved tensors, which may start the block's
            # recomputation: famp's state is entered around it, but acts only inside the
            # recomputation (under the checkpoint's saved-tensor hooks), not on the user's ops.
            bracket(node, record.grad_free_block, recompute_only=True)


def bracket(
    node: Any, snapshot: Snapshot, recompute_only: bool = False, reentrant: Any = None
) -> None:
    metadata = node.metadata
    if BRACKETED in metadata:
        return
    metadata[BRACKETED] = True
    replay = _Replay(snapshot, recompute_only, reentrant)
    node.register_prehook(replay.enter)
    node.register_hook(replay.exit)


def _ends_in_blocks(block: Callable[..., Any], *args: Any) -> Any:
    """A reentrant block recomputed, then the nodes of reentrant checkpoints its outputs come
    from bracketed: made after famp's last event there, they run in the nested backward torch
    starts next, without the torch function modes of this one."""
    out = block(*args)
    found: list[torch.Tensor] = []
    tensors(out, found)
    for t in found:
        node: Any = t.grad_fn
        if node is not None and BRACKETED not in node.metadata and node.name() == REENTRANT_NODE:
            _bracket_chain(node, snapshot())
    return out


def _bracket_chain(node: Any, snapshot: Snapshot) -> None:
    """Bracket a reentrant checkpoint's node, and the nodes of the reentrant checkpoints whose
    outputs its block took directly (`for b in blocks: x = checkpoint(b, x)`): no famp event saw
    those outputs with grad on (the block's forward runs without grad), so none between them
    changed the state: their blocks began in this block's state."""
    stack = [node]
    while stack:
        node = stack.pop()
        if node is not None and BRACKETED not in node.metadata and node.name() == REENTRANT_NODE:
            bracket(node, snapshot, reentrant=weakref.ref(node))
            stack.extend(next_node for next_node, _ in node.next_functions)


class _Replay:
    """famp's state at the start of a checkpointed block, entered around one node's backward."""

    __slots__ = ("active", "recompute_only", "reentrant", "snapshot")

    def __init__(
        self, snapshot: Snapshot, recompute_only: bool = False, reentrant: Any = None
    ) -> None:
        self.snapshot = snapshot
        self.recompute_only = recompute_only
        # A reentrant checkpoint's node, weakly (it holds this replay through its hooks).
        self.reentrant: Callable[[], Any] | None = reentrant
        self.active: list[tuple[int, list[Any], list[Any], Any]] = []

    def enter(self, grad_outputs: Any) -> None:
        stack = calls()
        records = [make() for make in self.snapshot]
        for outer in stack:  # calls running on this thread while backward runs: suspended
            outer.suspended += len(records)
        for i, record in enumerate(records):
            record.recompute_only, record.suspended = self.recompute_only, len(records) - 1 - i
        depth = len(stack)
        stack.extend(records)
        threads = recomputes(records)  # the cache off where another thread's dtypes differ
        modes = []
        for record in records:
            record.use_hooks(+1)
            if record.intercepts:
                mode = record.new_mode()
                mode.__enter__()
                modes.append(mode)
        self.active.append((depth, records, modes, threads))
        _LOCAL.replays.append(self)
        node = self.reentrant() if self.reentrant is not None else None
        block = getattr(node, CHECKPOINT_FUNCTION_ATTR, None)
        if block is not None:
            setattr(node, CHECKPOINT_FUNCTION_ATTR, functools.partial(_ends_in_blocks, block))

    def exit(self, grad_inputs: Any, grad_outputs: Any) -> None:
        node = self.reentrant() if self.reentrant is not None else None
        wrapped = getattr(node, CHECKPOINT_FUNCTION_ATTR, None)
        if isinstance(wrapped, functools.partial) and wrapped.func is _ends_in_blocks:
            setattr(node, CHECKPOINT_FUNCTION_ATTR, wrapped.args[0])
        if not self.active:
            return
        for mode in reversed(self.active[-1][2]):
            mode.__exit__(None, None, None)
        self._leave()

    def _leave(self) -> None:
        depth, records, _, threads = self.active.pop()
        recomputed(threads)
        if _LOCAL.replays and _LOCAL.replays[-1] is self:
            _LOCAL.replays.pop()
        for record in records:
            record.use_hooks(-1, eager=True)  # also when a trace starts (`drop_abandoned_replays`)
        stack = calls()
        del stack[depth:]
        for outer in stack:
            outer.suspended -= len(records)
        if not stack:
            end_of_outermost_call()
