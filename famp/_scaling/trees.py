"""Tree-wide operations of loss scaling: `famp.scale`, `famp.all_finite`, `famp.select_tree`.

Each takes its trees' leaves with optree (`None` leaves pass through) and names the path of a bad
leaf in its error; the helpers here do the same for `unscale.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import optree
import torch

from famp._compat import functorch_transforms_active
from famp._scaling.program import reader_operand
from famp._scaling.state import ScalerState
from famp._typing import PyTree, Tensor, TreeT


def keystr(path: Sequence[Any]) -> str:
    """A leaf's path as error messages print it: `tree['w'][0]`."""
    return "tree" + "".join(f"[{k!r}]" for k in path)


def leaves_and_rebuild(tree: TreeT) -> tuple[list[Any], Callable[[Sequence[Any]], TreeT]]:
    """`tree`'s leaves (`None` passes through) and a function that puts new leaves in their place.

    Eagerly, optree's flatten and unflatten. While `torch.compile` traces, one `optree.tree_map`
    gathers the leaves and another puts the new ones back: Dynamo maps dicts, lists and tuples
    itself, where it would trace optree's flatten and unflatten bytecode by bytecode (about 400
    traced steps a leaf: over a second for a model's gradients). Both visit the leaves in the
    same order, so the i-th new leaf takes the i-th leaf's place.
    """
    if not torch.compiler.is_compiling():
        leaves, spec = optree.tree_flatten(cast(PyTree, tree))
        return leaves, lambda new: cast(TreeT, optree.tree_unflatten(spec, new))
    gathered: list[Any] = []
    optree.tree_map(gathered.append, cast(PyTree, tree))

    def rebuild(new: Sequence[Any]) -> TreeT:
        placed = iter(new)
        return cast(TreeT, optree.tree_map(lambda _: next(placed), cast(PyTree, tree)))

    return gathered, rebuild


def path_of(tree: PyTree, leaf: object) -> str:
    """The path of `leaf` (found by identity) in `tree`, as errors print it; for errors only."""
    paths, leaves, _ = optree.tree_flatten_with_path(tree)
    return next((keystr(p) for p, x in zip(paths, leaves, strict=True) if x is leaf), "tree")


def check_tensors(fn: str, tree: PyTree, leaves: list[Any]) -> list[Tensor]:
    """`leaves` of `tree`, all tensors; else a TypeError naming `famp.<fn>` and the path."""
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"famp.{fn}: the leaf at {path_of(tree, leaf)} must be a Tensor or None, "
                f"got {type(leaf).__name__} {leaf!r}"
            )
    return leaves


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """`t` on `device`, for an op there to read next: asynchronously only to a CUDA device.

    A copy to the CPU with `non_blocking=True` returns before the data arrives (into pinned
    memory), and the CPU op that reads it next would read whatever was there before: found_inf
    or a scale from an accelerator would be garbage, silently. torch orders a copy to a CUDA
    device on its stream, so there it need not wait; to any other device it does (a sync only
    where a device's value must be read on another, which the result needs anyway).
    """
    if t.device == device:  # the common case, without a call into torch
        return t
    return t.to(device, non_blocking=device.type == "cuda")


def check_state_first(fn: str, state: object, other: str, value: object) -> None:
    """A TypeError in public terms when `state` is not a `ScalerState` (swapped, or None)."""
    if isinstance(state, ScalerState):
        return
    if isinstance(value, ScalerState):
        raise TypeError(
            f"famp.{fn} takes the state first: famp.{fn}(state, {other}); got "
            f"{type(state).__name__} as state and a famp.ScalerState as {other}"
        )
    raise TypeError(f"famp.{fn}: state must be a famp.ScalerState, got {type(state).__name__}")


def scale(state: ScalerState, tree: TreeT) -> TreeT:
    """Multiply every tensor of a pytree by the loss scale, as `GradScaler.scale`.

    Each leaf becomes `leaf * state.scale` (the scale moved to the leaf's device), so the dtypes
    are torch's: a 0-d float16/bfloat16 loss gives float32, an n-d float16 tensor stays float16.
    Lists, tuples, dicts and namedtuples keep their type; `None` leaves pass through. A disabled
    state returns `tree` itself.

    Args:
        state: The current `famp.ScalerState`.
        tree: A tensor or any pytree of tensors (one loss, several losses, a dict of them).

    Returns:
        A tree of the same structure with every tensor scaled.

    Raises:
        TypeError: `state` is not a `famp.ScalerState` (e.g. the arguments swapped, as in
            `scaler.scale(loss)`: the state comes first), or a leaf is not a tensor; the message
            names its path.

    Examples:
        >>> import famp, torch
        >>> state = famp.init_scaler(1024.0)
        >>> famp.scale(state, {"loss": torch.tensor(0.5, dtype=torch.bfloat16)})
        {'loss': tensor(512.)}
    """
    check_state_first("scale", state, "loss", tree)
    if not state.enabled:
        return tree
    leaves, rebuild = leaves_and_rebuild(tree)
    check_tensors("scale", cast(PyTree, tree), leaves)
    return rebuild([scaled(state, x) for x in leaves])


def scaled(state: ScalerState, x: Tensor) -> Tensor:
    """One tensor times the scale of an enabled `state`: what `scale` does to each leaf."""
    return x * to_device(state.scale, x.device)


def all_finite(tree: PyTree) -> Tensor:
    """Return a 0-d bool tensor: `True` iff every element of every tensor in `tree` is finite.

    No host sync. An empty tree gives `True`. Sparse tensors are checked through their values.

    Args:
        tree: A pytree of tensors (`None` leaves are skipped).

    Returns:
        A 0-d `torch.bool` tensor on the first leaf's device (CPU for an empty tree).

    Raises:
        TypeError: A leaf is not a tensor; the message names its path.

    Examples:
        >>> import famp, torch
        >>> famp.all_finite({"w": torch.ones(3), "b": torch.tensor([1.0, float("nan")])})
        tensor(False)
    """
    leaves = check_tensors("all_finite", tree, leaves_and_rebuild(tree)[0])
    if not leaves:
        return torch.ones((), dtype=torch.bool)
    device = leaves[0].device
    checks = [torch.isfinite(x._values() if x.is_sparse else x).all().to(device) for x in leaves]
    return torch.stack(checks).all()


def select_tree(pred: Tensor, on_true: TreeT, on_false: TreeT) -> TreeT:
    """Choose between two trees elementwise with a 0-d bool tensor, without a host sync.

    Each leaf becomes `torch.where(pred, a, b)`; use it to skip an update after an overflow:
    `params = famp.select_tree(famp.all_finite(grads), new_params, params)`. Both trees must have
    the same structure, and paired leaves the same dtype and shape. `None` leaves pass through.

    Eagerly, with `pred` on the CPU, outside `torch.compile` and `torch.func` transforms, famp
    reads `pred` (a memory read, not a device sync) and each result leaf is the chosen input
    leaf itself: `torch.where`'s values without a pass over memory, and no new tensors, as
    `GradScaler` leaves parameters untouched on a skipped step. An in-place write to a result
    leaf is then seen by the input leaf too. Pairs where a leaf requires grad (with grad
    enabled) still go through `torch.where`, which gives both trees gradients.
    Compiled, the results keep eager `torch.where`'s bits for every dtype (float16 and bfloat16
    leaves are selected as 16-bit integers: inductor would rewrite their NaN bit patterns), and
    the compile time grows linearly with the number of leaves (`reader_operand`).

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
            differ in shape.

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
    make_pred: Callable[[], Tensor], take: bool | None, on_true: TreeT, on_false: TreeT
) -> TreeT:
    """`select_tree` after its checks of the predicate: `take` is its value where it was read.

    `take` (True: `on_true`) comes from `readable` predicates, eagerly; `None` elsewhere, where
    `make_pred()` gives the 0-d bool predicate that `torch.where` reads. It runs only where a
    `where` needs it, once per leaf device, so an eager read makes no tensor
    (`skip_on_overflow` builds the predicate from `found_inf` only then).
    """
    grad = torch.is_grad_enabled()
    on_device: dict[torch.device, Tensor] = {}  # the predicate moved once per device, not per leaf
    compiling = torch.compiler.is_compiling()
    # Compiled, per device: what the last leaf read and how many leaves read (`reader_operand`).
    readers: dict[torch.device, tuple[Tensor, int]] = {}
    mismatched: list[bool] = []

    def pick(a: object, b: object) -> object:
        if not (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
        ):
            mismatched.append(True)  # named below, with its path
            return a
        if take is not None and not (grad and (a.requires_grad or b.requires_grad)):
            return a if take else b
        where = on_device.get(a.device)
        if where is None:
            where = on_device[a.device] = to_device(make_pred(), a.device)
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
            _check_structures(on_true, on_false)
        raise
    if mismatched:
        if not compiling:  # on_false may hold a subtree where on_true has a leaf
            _check_structures(on_true, on_false)
        _raise_mismatch(on_true, on_false)
    return cast(TreeT, mapped)


def _check_structures(on_true: PyTree, on_false: PyTree) -> None:
    """`select_tree`'s error for trees of different structures."""
    spec, false_spec = optree.tree_structure(on_true), optree.tree_structure(on_false)
    if spec != false_spec:
        raise ValueError(
            f"on_true and on_false must have the same structure, got {spec} and {false_spec}"
        ) from None


# Compiled, half-precision leaves are selected as integers of their width (`select_tree`).
_HALF_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _raise_mismatch(on_true: PyTree, on_false: PyTree) -> None:
    """`select_tree`'s error for the first pair of leaves that differ, naming its path."""
    paths, true_leaves, _ = optree.tree_flatten_with_path(on_true)
    false_leaves: list[Any] = []  # what pairs with each leaf of on_true (a subtree, maybe)
    optree.tree_map(lambda _, b: false_leaves.append(b), on_true, on_false)
    for path, a, b in zip(paths, true_leaves, false_leaves, strict=True):
        for leaf in (a, b):
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(
                    f"famp.select_tree: the leaf at {keystr(path)} must be a Tensor or None, "
                    f"got {type(leaf).__name__} {leaf!r}"
                )
        if a.dtype != b.dtype:
            raise TypeError(
                f"famp.select_tree: the leaves at {keystr(path)} differ in dtype: "
                f"{a.dtype} and {b.dtype}"
            )
        if a.shape != b.shape:
            raise ValueError(
                f"famp.select_tree: the leaves at {keystr(path)} differ in shape: "
                f"{tuple(a.shape)} and {tuple(b.shape)}"
            )


def readable(pred: Tensor) -> bool:
    """Whether `select_tree` may read `pred` and return chosen leaves (see its docstring).

    Not while compiling (a guard on data) or under `torch.func` transforms (a batched `pred`),
    and not for a `pred` off the CPU (a sync), a fake or a subclass. Leaves that require grad
    take `torch.where` even so: it gives both trees gradients (zeros for the one not chosen).
    """
    if torch.compiler.is_compiling() or type(pred) is not torch.Tensor or pred.device.type != "cpu":
        return False
    return not functorch_transforms_active()
