"""A policy's casts of a tree: each float16, bfloat16 and float32 tensor cast once, and what
needs no cast kept as it is, containers included (so a list a matched module appends to, or a
dict it writes into, is the caller's own where none of its tensors changes dtype)."""

from __future__ import annotations

from typing import Any

import torch

from famp._compat import torch_pytree as pytree
from famp._typing import TreeT

# The dtypes a cast may change; float64 (and everything else) passes through.
CASTABLE = frozenset({torch.float16, torch.bfloat16, torch.float32})
# Leaves of every pytree: a tuple or list of only these is one level deep.
FLAT_LEAVES = (torch.Tensor, torch.nn.Parameter, type(None), bool, int, float, str)
_NOT_PLAIN = object()
_MAX_DEPTH = 8  # deeper trees go through tree_map
_Done = list[tuple[torch.Tensor, torch.Tensor]]  # the (tensor, cast) pairs of a tree so far
# Where a caller asks (`cast_tree`'s `made`): each cast tensor with None (`inputs.cast_inputs`
# puts its version there) and its source's dtype, and each list and dict rebuilt with its items
# and None.
Made = list[tuple[Any, Any, torch.dtype | None]]


def cast_leaf(leaf: Any, dtype: torch.dtype) -> Any:
    """`leaf` cast to `dtype` if it is a float16, bfloat16 or float32 tensor, else `leaf`."""
    if isinstance(leaf, torch.Tensor) and leaf.dtype in CASTABLE and leaf.dtype != dtype:
        return leaf.to(dtype=dtype)  # the keyword: torch parses it about 1 µs faster
    return leaf


def _cast_once(leaf: Any, dtype: torch.dtype, done: _Done) -> Any:
    """`cast_leaf`, once per tensor of a tree, as `h32 = h.float(); attn(h32, h32, h32)`: a
    cast per place broke `query is key is value` and rounded each place's gradient."""
    if isinstance(leaf, torch.Tensor) and leaf.dtype in CASTABLE and leaf.dtype != dtype:
        for source, cast in done:
            if source is leaf:
                return cast
        cast = leaf.to(dtype=dtype)  # the keyword: torch parses it about 1 µs faster
        done.append((leaf, cast))
        return cast
    return leaf


def _same(cast: list[Any], values: Any) -> bool:
    return all(c is v for c, v in zip(cast, values, strict=True))


def cast_tree(tree: TreeT, dtype: torch.dtype, made: Made | None = None) -> TreeT:
    """`tree` with every leaf cast (`cast_leaf`), each tensor once (`_cast_once`), and every
    container none of whose leaves changes kept (the object itself, as `Tensor.to` keeps a
    tensor of the dtype): before 2026-12-02 each was rebuilt, and a KV cache a matched module
    appended to a list of went into famp's copy, silently. `made`, if given, receives what the
    cast made that the caller does not hold: each cast tensor with None and its source's dtype,
    and each list and dict rebuilt, with its items (`inputs.check_inputs` checks them)."""
    done: _Done = []
    out = _walk(tree, dtype, done, made)
    if made is not None and done:
        made.extend((cast, None, source.dtype) for source, cast in done)
    return out  # type: ignore[no-any-return]


def _walk(tree: Any, dtype: torch.dtype, done: _Done, made: Made | None) -> Any:
    """Plain tuples, lists and dicts over plain leaves are cast here, without torch's
    `tree_flatten`, which on torch 2.13-2.15 leaves a reference cycle per call (a closure that
    calls itself); other trees (named tuples, registered nodes, subclasses) are flattened, and
    rebuilt only if a leaf changes."""
    if isinstance(tree, torch.Tensor):
        return _cast_once(tree, dtype, done)
    if type(tree) in (tuple, list) and all(type(x) in FLAT_LEAVES for x in tree):
        cast = [_cast_once(x, dtype, done) for x in tree]  # the common case, without recursion
        return tree if _same(cast, tree) else _made(type(tree)(cast), made)
    out = _cast_plain(tree, dtype, _MAX_DEPTH, done, made)
    if out is not _NOT_PLAIN:
        return out
    leaves, spec = pytree.tree_flatten(tree)
    cast = [_cast_once(x, dtype, done) for x in leaves]
    if _same(cast, leaves):
        return tree
    out = pytree.tree_unflatten(cast, spec)  # every container new: each list and dict made
    if made is not None:
        _made_below(out, made, _MAX_DEPTH)
    return out


def _made(container: Any, made: Made | None) -> Any:
    if made is not None and isinstance(container, (list, dict)):
        items = list(container.items() if isinstance(container, dict) else container)
        made.append((container, items, None))
    return container


def _made_below(tree: Any, made: Made, depth: int) -> None:
    """Each list and dict of a rebuilt `tree`, through tuples (named ones too), lists and dicts."""
    if depth == 0 or not isinstance(tree, (list, tuple, dict)):
        return
    _made(tree, made)
    for value in tree.values() if isinstance(tree, dict) else tree:
        _made_below(value, made, depth - 1)


def _cast_plain(
    tree: Any, dtype: torch.dtype, depth: int, done: _Done, made: Made | None = None
) -> Any:
    """`tree` cast leaf by leaf if it is plain tuples, lists and dicts (as many levels as
    `depth`) over `FLAT_LEAVES`, else `_NOT_PLAIN`; a module function, so no cycle."""
    kind = type(tree)
    if kind in FLAT_LEAVES:
        return _cast_once(tree, dtype, done)
    if depth == 0 or kind not in (tuple, list, dict):
        return _NOT_PLAIN
    values = list(tree.values()) if kind is dict else tree
    cast = [_cast_plain(x, dtype, depth - 1, done, made) for x in values]
    if any(x is _NOT_PLAIN for x in cast):
        return _NOT_PLAIN
    if _same(cast, values):
        return tree
    return _made(dict(zip(tree, cast, strict=True)) if kind is dict else kind(cast), made)
