"""Which nodes of a non-reentrant checkpoint's block famp brackets (see `recompute.py`).

torch recomputes a non-reentrant (or selective) checkpoint's block from inside the backward of
the first node that unpacks one of the tensors the checkpoint packed: famp brackets every node
an op of the block made that may do so, with the state at the block's start.
"""

from __future__ import annotations

import sys
import types
import weakref
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction

from famp._autocast.recompute import (
    BRACKETED,
    Snapshot,
    bracket,
    snapshot,
    tensors,
)
from famp._compat import is_view, node_saves_tensors, reentrant_forward_code

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


def bracket_reentrant(stack: list[Any], run: types.CodeType) -> None:
    """A call nested in calls without module rules starts with grad off, as in a reentrant
    checkpoint's forward. Calls without a mode see no op, and those with one see the checkpoint's
    node only if its output reaches one of their ops: else the node goes unbracketed, and the
    nested call, recomputed, runs as an outermost one (before 2026-12-02: its inputs uncast).
    Each reentrant checkpoint running on the Python stack below the outermost call is bracketed
    with the state where its block began: the calls whose frames (`run`'s code) lie outside it,
    which have no module scopes."""
    code = reentrant_forward_code
    frame: types.FrameType | None = sys._getframe(2)  # the nested call's caller
    inside = 0  # the calls started inside the block reached so far
    while code is not None and frame is not None and inside < len(stack):
        if frame.f_code is run:
            inside += 1
        elif frame.f_code is code:
            node = frame.f_locals.get("ctx")
            if node is not None and BRACKETED not in node.metadata:
                bracket(node, snapshot()[: len(stack) - inside], reentrant=weakref.ref(node))
        frame = frame.f_back
