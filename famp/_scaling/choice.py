"""`famp.select_tree`: choose between two trees with a 0-d bool tensor, leaf by leaf.

Eagerly, with a readable predicate, each result is the chosen leaf itself. Compiled on the CPU,
the plain tensors of both trees go through one `famp::select_` operator (`select_op`): each
result is a copy of its `on_true` leaf, into which the operator copies the `on_false` leaf where
the predicate is false. Elsewhere (other devices, tensor subclasses, leaves that require grad,
complex leaves, `on_true` leaves that are views, `torch.func` transforms) each pair is one
`torch.where`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import optree
import torch

from famp._compat import VIEW_BASE, functorch_transforms_active
from famp._scaling.program import reader_operand
from famp._scaling.trees import PLAIN_TENSORS, keystr, to_device
from famp._typing import PyTree, Tensor, TreeT


def select_tree(pred: Tensor, on_true: TreeT, on_false: TreeT) -> TreeT:
    """Choose between two trees elementwise with a 0-d bool tensor, without a host sync.

    Each leaf becomes `torch.where(pred, a, b)`; use it to skip an update after an overflow:
    `params = famp.select_tree(famp.all_finite(grads), new_params, params)`. Both trees must have
    the same structure, and paired leaves the same dtype, shape, device and layout. `None`
    leaves pass through.

    Eagerly, with `pred` on the CPU, outside `torch.compile` and `torch.func` transforms, famp
    reads `pred` (a memory read, not a device sync) and each result leaf is the chosen input
    leaf itself: `torch.where`'s values without a pass over memory, and no new tensors, as
    `GradScaler` leaves parameters untouched on a skipped step. An in-place write to a result
    leaf is then seen by the input leaf too. Pairs where a leaf requires grad (with grad
    enabled) still go through `torch.where`, which gives both trees gradients.
    Compiled, the results keep eager `torch.where`'s bits for every dtype and are new tensors.
    On the CPU, pairs of plain tensors that carry no graph are chosen by one operator for the
    whole tree: each result is a copy of its `on_true` leaf, overwritten with the `on_false`
    leaf only where `pred` is false. Inductor writes an `on_true` leaf computed in the same
    compiled function (an update) straight into its copy, so a step that is not skipped makes
    no pass over memory for the choice. Other pairs take `torch.where` (float16 and bfloat16
    leaves as 16-bit integers: inductor would rewrite their NaN bit patterns).

    Args:
        pred: A 0-d (or one-element) `torch.bool` tensor.
        on_true: The tree chosen where `pred` is `True`.
        on_false: The tree chosen where `pred` is `False`.

    Returns:
        A tree with `on_true`'s structure.

    Raises:
        TypeError: `pred` is not a bool tensor, a leaf is not a tensor, or paired leaves differ
            in dtype; the message names the path.
        ValueError: The structures differ, `pred` has more than one element, or paired leaves
            differ in shape, device or layout (before 2026-12-01 eager calls took such a pair
            and the result's device depended on `pred`'s value).

    Examples:
        >>> import famp, torch
        >>> famp.select_tree(torch.tensor(False), {"w": torch.ones(2)}, {"w": torch.zeros(2)})
        {'w': tensor([0., 0.])}
    """
    if not isinstance(pred, torch.Tensor) or pred.dtype != torch.bool:
        what = pred.dtype if isinstance(pred, torch.Tensor) else type(pred).__name__
        raise TypeError(f"pred must be a torch.bool tensor, got {what}")
    if pred.numel() != 1:
        raise ValueError(f"pred must have exactly one element, got shape {tuple(pred.shape)}")
    take = bool(pred.item()) if readable(pred) else None
    return select(lambda: pred.reshape(()), take, on_true, on_false)


def select(
    make_pred: Callable[[], Tensor],
    take: bool | None,
    on_true: TreeT,
    on_false: TreeT,
    names: tuple[str, str, str, str] = ("famp.select_tree", "pred", "on_true", "on_false"),
) -> TreeT:
    """`select_tree` after its checks of the predicate: `take` is its value where it was read.
    `names`: the function, its predicate and its two trees, as errors name them.

    `take` (True: `on_true`) comes from `readable` predicates, eagerly; `None` elsewhere, where
    `make_pred()` gives the 0-d bool predicate that `torch.where` and `famp::select_` read. It
    runs only where one of them needs it (once per leaf device for `where`, once for the
    operator), so an eager read makes no tensor (`skip_on_overflow` builds the predicate from
    `found_inf` only then).
    """
    grad = torch.is_grad_enabled()
    if take is not None:  # read eagerly: plain containers by hand, anything else below
        try:
            return cast(TreeT, _chosen(take, grad, on_true, on_false))
        except _NotPlainError:
            pass
    on_device: dict[torch.device, Tensor] = {}  # the predicate moved once per device, not per leaf
    what = f"{names[0]}'s {names[1]}"  # the predicate, as a device error names it
    compiling = torch.compiler.is_compiling()
    # Compiled, per device: what the last leaf read and how many leaves read (`reader_operand`).
    readers: dict[torch.device, tuple[Tensor, int]] = {}
    mismatched: list[bool] = []
    # Compiled on the CPU: the copies of on_true leaves that `select_op` overwrites, and theirs.
    batched = compiling and not functorch_transforms_active()
    copies: list[Tensor] = []
    others: list[Tensor] = []

    def pick(a: object, b: object) -> object:
        if not (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.device == b.device
            and a.layout == b.layout
        ):
            mismatched.append(True)  # named below, with its path
            return a
        carries_graph = grad and (a.requires_grad or b.requires_grad)
        if take is not None and not carries_graph:
            return a if take else b
        if (  # written out, not helpers: Dynamo inlines each call per leaf (0.1-0.3 s, 120 pairs)
            batched
            and not carries_graph
            and type(a) in PLAIN_TENSORS  # what famp::select_ copies; a DTensor takes torch.where
            and type(b) in PLAIN_TENSORS
            and a.is_cpu
            and b.is_cpu
            and a.layout == torch.strided
            and b.layout == torch.strided
            and not a.is_complex()  # inductor keeps no complex mutation (auto_functionalized_v2)
            # Nor a view's clone: inductor drops it and reads the view from storage offset 0.
            and getattr(a, VIEW_BASE) is None
        ):
            # A copy of a's bits (float16/bfloat16 as integers, see `_HALF_BITS`).
            copy = a.view(torch.int16).clone().view(a.dtype) if a.dtype in _HALF else a.clone()
            copies.append(copy)
            others.append(b)
            return copy
        where = on_device.get(a.device)
        if where is None:
            where = on_device[a.device] = to_device(make_pred(), a.device, what)
        if compiling:
            last, count = readers.get(a.device, (where, 0))
            where = reader_operand(where, last, count)
            readers[a.device] = (where, count + 1)
            bits = _HALF_BITS.get(a.dtype)
            plain = type(a) is torch.Tensor and type(b) is torch.Tensor  # not a DTensor, say
            if bits is not None and plain and not (a.requires_grad or b.requires_grad):
                # Inductor selects float16/bfloat16 values through float32 and writes NaNs back
                # in its own bit pattern; their bits as integers are selected as they are.
                return torch.where(where, a.view(bits), b.view(bits)).view(a.dtype)
        return torch.where(where, a, b)

    # One tree_map, not a flatten and an unflatten: it checks the structures, and Dynamo traces
    # optree's flatten op by op (seconds for a few hundred leaves) but maps dicts, lists and
    # tuples itself. The paths are looked up only for an error.
    try:
        mapped = optree.tree_map(pick, cast(Any, on_true), cast(Any, on_false))
    except ValueError:
        if not compiling:  # optree's error, in select_tree's words
            _check_structures(on_true, on_false, names)
        raise
    if mismatched:
        if not compiling:  # on_false may hold a subtree where on_true has a leaf
            _check_structures(on_true, on_false, names)
        _raise_mismatch(on_true, on_false, names[0])
    if copies:
        select_op(to_device(make_pred(), torch.device("cpu"), what), copies, others)
    return cast(TreeT, mapped)


class _NotPlainError(Exception):
    """`_chosen` met what it leaves to `select`'s general path."""


def _chosen(take: bool, grad: bool, a: Any, b: Any) -> Any:
    """The tree `select` returns for a read predicate, where both trees are plain containers.

    Dicts, lists and tuples of exactly those types, `None` and tensors, walked in pairs by hand:
    new containers of `a`'s structure and key order holding the chosen leaves, as the
    `optree.tree_map` of the general path gives them, in a fraction of its time (optree sorts
    every dict's keys). Raises `_NotPlainError` for anything else (another container, a pair
    that carries a graph, a mismatch), which the general path then handles or names in its
    error.
    """
    kind = type(a)
    if kind is not type(b):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            kind = torch.Tensor  # a Parameter and a tensor, say: a pair of leaves all the same
        else:
            raise _NotPlainError
    if kind is dict:
        if a.keys() != b.keys():
            raise _NotPlainError
        return {key: _chosen(take, grad, value, b[key]) for key, value in a.items()}
    if kind is list:
        if len(a) != len(b):
            raise _NotPlainError
        return [_chosen(take, grad, x, y) for x, y in zip(a, b, strict=True)]
    if kind is tuple:
        if len(a) != len(b):
            raise _NotPlainError
        return tuple(_chosen(take, grad, x, y) for x, y in zip(a, b, strict=True))
    if a is None:
        return None
    if (
        isinstance(a, torch.Tensor)
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.device == b.device
        and a.layout == b.layout
        and not (grad and (a.requires_grad or b.requires_grad))
    ):
        return a if take else b
    raise _NotPlainError


def _check_structures(on_true: PyTree, on_false: PyTree, names: tuple[str, ...]) -> None:
    """`select_tree`'s error for trees of different structures."""
    spec, false_spec = optree.tree_structure(on_true), optree.tree_structure(on_false)
    if spec != false_spec:
        raise ValueError(
            f"{names[0]}: {names[2]} and {names[3]} must have the same structure, got {spec} "
            f"and {false_spec}"
        ) from None


# Compiled, half-precision leaves are selected as integers of their width (`select_tree`).
_HALF_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16}
_HALF = tuple(_HALF_BITS)


def _raise_mismatch(on_true: PyTree, on_false: PyTree, name: str) -> None:
    """`select_tree`'s error for the first pair of leaves that differ, naming its path."""
    paths, true_leaves, _ = optree.tree_flatten_with_path(on_true)
    false_leaves: list[Any] = []  # what pairs with each leaf of on_true (a subtree, maybe)
    optree.tree_map(lambda _, b: false_leaves.append(b), on_true, on_false)
    for path, a, b in zip(paths, true_leaves, false_leaves, strict=True):
        for leaf in (a, b):
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(
                    f"{name}: the leaf at {keystr(path)} must be a Tensor or None, "
                    f"got {type(leaf).__name__} {leaf!r}"
                )
        if a.dtype != b.dtype:
            raise TypeError(
                f"{name}: the leaves at {keystr(path)} differ in dtype: {a.dtype} and {b.dtype}"
            )
        if a.shape != b.shape:
            raise ValueError(
                f"{name}: the leaves at {keystr(path)} differ in shape: "
                f"{tuple(a.shape)} and {tuple(b.shape)}"
            )
        if a.device != b.device or a.layout != b.layout:
            raise ValueError(
                f"{name}: the leaves at {keystr(path)} differ in device or layout: "
                f"{a.device} ({a.layout}) and {b.device} ({b.layout}); the result's would depend "
                "on the predicate's value"
            )


def readable(pred: Tensor) -> bool:
    """Whether `select_tree` may read `pred` and return chosen leaves (see its docstring).

    Not while compiling (a guard on data) or under `torch.func` transforms (a batched `pred`),
    and not for a `pred` off the CPU (a sync), a fake or a subclass. Leaves that require grad
    take `torch.where` even so: it gives both trees gradients (zeros for the one not chosen).
    """
    if torch.compiler.is_compiling() or type(pred) is not torch.Tensor or not pred.is_cpu:
        return False
    return not functorch_transforms_active()


# `famp::select_`: compiled, one node for a whole tree's choice, whatever its number of leaves.
# Defined with `torch.library.define`/`impl` rather than `torch.library.custom_op`, whose Python
# wrapper costs about 0.4 µs more per tensor argument on each call (measured: 140 against 39 µs
# for 240 tensors).
torch.library.define(
    "famp::select_", "(Tensor pred, Tensor(a!)[] on_true, Tensor[] on_false) -> ()"
)


@torch.library.impl("famp::select_", "cpu")
def _select_impl(pred: Tensor, on_true: list[Tensor], on_false: list[Tensor]) -> None:
    """Where `pred` is false, copy each `on_false` tensor into its `on_true` tensor, in place.

    Compiled, `on_true` holds the copies `select` made, which inductor writes in place of
    buffers of their own; a step whose `pred` is true costs this one read of `pred`.
    """
    if not pred.item():  # a CPU tensor: a memory read, not a device sync
        for target, source in zip(on_true, on_false, strict=True):
            target.copy_(source)


def _select_fake(pred: Tensor, on_true: list[Tensor], on_false: list[Tensor]) -> None:
    """Traced: the copies keep their sizes and strides; nothing is returned."""


torch.library.register_fake("famp::select_", _select_fake)


select_op = torch.ops.famp.select_.default
