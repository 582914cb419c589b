"""Which nodes of a non-reentrant checkpoint's block famp brackets (see `recompute.py`).

torch recomputes a non-reentrant (or selective) checkpoint's block from inside the backward of
the first node that unpacks one of the tensors the checkpoint packed: famp brackets every node
an op of the block made that may do so, with the state at the block's start.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction

from famp._autocast.recompute import (
    BRACKETED,
    REENTRANT_NODE,
    Snapshot,
    bracket,
    snapshot,
    tensors,
)
from famp._compat import is_view, node_number, node_saves_tensors

_REBASED_NODE = "torch::autograd::CopySlices"  # a base's node after an in-place op on its view


def bracket_outputs(out: Any, snapshot: Snapshot, args: Any, kwargs: Any) -> None:
    """Bracket the nodes an op made in a non-reentrant checkpoint's block whose backward may
    unpack a saved tensor (a custom Function's too): the first to run recomputes the block.
    Behind an output's node that saves none (a view, an add, a cast; only marked), the walk goes
    on to the nodes the op made unseen, up to its inputs' nodes: in a composite op's C++ code
    (`einsum`'s `bmm` behind a view) or a torch Python function famp does not enter
    (`nn.MultiheadAttention`'s, ending in a transpose). A node that saves tensors runs first: the
    walk stops there. Leaves' `AccumulateGrad` nodes, which outlive the graph, are left alone."""
    found: list[torch.Tensor] = []
    tensors(out, found)
    heads: list[Any] = [t.grad_fn for t in found if t.grad_fn is not None]
    starts = {id(node) for node in heads}  # `heads` keeps the nodes, and so their ids, alive
    views = {id(t.grad_fn) for t in found if is_view(t)}  # in place on a view: on to its base's
    stack = list(heads)
    inputs: dict[int, Any] | None = None  # read when the walk first needs them
    while stack:
        node = stack.pop()
        if node is None or BRACKETED in node.metadata or hasattr(node, "variable"):
            continue  # `variable`: a leaf's `AccumulateGrad` (no probe op run inside the block)
        start = id(node) in starts
        if not start and inputs is not None and id(node) in inputs:
            continue  # made before the op (the walk is behind an output here: `inputs` is read)
        kind: Any = type(node)
        if (  # it may unpack: it saves tensors, or runs a custom Function's or an op's backward
            isinstance(node, BackwardCFunction)
            or node_saves_tensors(kind)
            or node.name() == _REBASED_NODE
        ):
            bracket(node, snapshot)
            continue
        inputs = _input_nodes(args, kwargs) if inputs is None else inputs
        node.metadata[BRACKETED] = True  # seen: it unpacks nothing
        if not (start and id(node) in inputs) or id(node) in views:  # nor an input (`x.add_(1)`)
            stack.extend(next_node for next_node, _ in node.next_functions)


def _input_nodes(args: Any, kwargs: Any) -> dict[int, Any]:
    """The nodes of an op's tensor inputs, by id (the values keep them, and their ids, alive)."""
    found: list[torch.Tensor] = []
    tensors(args, found)
    if kwargs:
        tensors(kwargs, found)
    return {id(t.grad_fn): t.grad_fn for t in found if t.grad_fn is not None}


def bracket_behind(record: Any, values: Any) -> None:
    """After a grad-free op in `record`, a call without a mode: it sees no op, so a reentrant
    checkpoint's block in it (with a nested call inside, which needs the stack at recomputation)
    may lie anywhere behind the values of its next event (a nested call's start, its end). The
    nodes made since the call began (`record.unseen`: the first one's number, those walked) are
    walked once each, and the reentrant checkpoints' bracketed with the state of now: the
    call's, which has no module scopes. Before 2026-12-02 a call nested in such a block ran as
    an outermost call when it was recomputed: its inputs uncast."""
    if record.unseen is None or record.intercepts or not torch.is_grad_enabled():
        return
    first, walked = record.unseen
    found: list[torch.Tensor] = []
    tensors(values, found)
    stack: list[Any] = [t.grad_fn for t in found]
    state: Snapshot | None = None
    while stack:
        node = stack.pop()
        if node is None or hasattr(node, "variable"):  # `variable`: a leaf's `AccumulateGrad`
            continue
        number = node_number(node)
        if number < first or number in walked:
            continue
        walked.add(number)
        if node.name() == REENTRANT_NODE and BRACKETED not in node.metadata:
            state = state or snapshot()
            bracket(node, state, reentrant=weakref.ref(node))
        stack.extend(next_node for next_node, _ in node.next_functions)
