"""Overflow forensics: `famp.nonfinite_report`, which leaf (and rank) holds non-finite values.

Per leaf of a tree, the number of non-finite elements (`counts`, 0-d int64) and the largest
absolute finite value (`amax`, 0-d float32); plus `found_inf`, equal to what
`famp.unscale_and_check` reports on the same tree. Everything stays a tensor: no host sync until
`NonfiniteReport.summary()` is asked for. With a process group, one all-gather gives every rank
every rank's figures, one slot per leaf path (`None` leaves included: `_collectives`), eagerly
after a check that the ranks' paths agree, read on the host.

How each leaf is read is `figures.py`'s. Under `torch.func.vmap` the figures are per sample.

Deliberately not supported: sparse layouts (pass `t.coalesce().values()`), integer leaves.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import optree
import torch

from famp import _collectives
from famp._compat import OPTREE_GLOBAL_NAMESPACE, torch_pytree
from famp._scaling.checks import FLOAT_DTYPES
from famp._scaling.figures import leaf_figures
from famp._typing import PyTree, Tensor

_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
_NAMES[torch.float64] = "float64"
_DTYPES = {name: dtype for dtype, name in _NAMES.items()}


@dataclasses.dataclass(frozen=True, eq=False)
class NonfiniteReport:
    """Where a tree holds non-finite values, as tensors: the result of `famp.nonfinite_report`.

    A pytree (optree, torch's pytree, `torch.compile`): its leaves are the tensors of `counts`,
    `amax` and `found_inf`; the leaf paths, dtypes and world size are static metadata.

    Attributes:
        counts: The input's structure, each leaf a 0-d int64 tensor: the number of non-finite
            (inf or NaN) elements. With a group, a 1-d tensor of length world size, entry r
            from rank r (-1 where rank r's leaf is `None`).
        amax: The input's structure, each leaf a 0-d float32 tensor: the largest absolute finite
            value (0 for an empty or all-non-finite leaf; float64 values are rounded to float32).
            With a group, 1-d as `counts` (NaN where rank r's leaf is `None`).
        found_inf: 0-d float32, 1.0 iff any count (on any rank, with a group) is non-zero.
        paths: Static: each leaf's path, as `summary` prints it: its keys, indices and named
            tuples' field names, joined by dots (`"moments.var"`).
        dtypes: Static: each leaf's dtype name. With a group, for a leaf `None` on this rank,
            the first rank's that holds one (`"none"` if none does; compiled `"unknown"`).
        world_size: Static: the group's size, or `None` without a group.
    """

    counts: PyTree
    amax: PyTree
    found_inf: Tensor
    paths: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ()
    world_size: int | None = None

    def summary(self, limit: int = 10) -> str:
        """A short text: the non-finite leaves, worst first, and the half-precision headroom.

        The report's only host sync. Non-finite leaves are named by path (and rank with a group),
        most non-finite elements first, and their largest finite |x|. For float16 and bfloat16
        leaves, the headroom is `log2(finfo.max / amax)` bits: how many doublings of the values (or
        of the loss scale) they can take before overflowing; the lowest are listed, and a leaf that
        holds non-finite values has none (listed first, as overflowed).

        Args:
            limit: At most this many lines per section.

        Returns:
            The text, lines separated by newlines.

        Examples:
            >>> import famp, torch
            >>> grads = {"w": torch.tensor([1.0, float("inf")]), "b": torch.ones(2)}
            >>> print(famp.nonfinite_report(grads).summary())
            found_inf = 1: 1 of 2 leaves hold non-finite values
              w: 1 non-finite (float32), largest finite |x| 1
        """
        if isinstance(limit, bool) or not isinstance(limit, int):
            raise TypeError(f"limit must be an int >= 0, got {type(limit).__name__} {limit!r}")
        if limit < 0:
            raise ValueError(f"limit must be an int >= 0, got {limit!r}")
        counts = [c.reshape(-1).tolist() for c in optree.tree_leaves(self.counts)]
        amaxes = [a.reshape(-1).tolist() for a in optree.tree_leaves(self.amax)]
        bad: list[tuple[int, str, int, str, str]] = []  # amax inf: a float64 beyond float32
        head: list[tuple[float, str, str, float]] = []
        for path, dtype, cs, ms in zip(self.paths, self.dtypes, counts, amaxes, strict=True):
            for rank, (count, amax) in enumerate(zip(cs, ms, strict=True)):
                if count < 0:  # a None leaf on that rank (with a group)
                    continue
                where = path if self.world_size is None else f"{path} (rank {rank})"
                if count:
                    big = f"{amax:.4g}" if amax < math.inf else "beyond float32's range"
                    bad.append((count, where, int(count), dtype, big))
                if dtype in ("float16", "bfloat16"):  # an overflowed leaf has none: listed first
                    top = torch.finfo(_DTYPES[dtype]).max
                    bits = -math.inf if count else math.log2(top / amax) if amax > 0 else math.inf
                    head.append((bits, where, dtype, amax))
        held = sum(c >= 0 for cs in counts for c in cs)
        lines = [
            f"found_inf = {self.found_inf.item():g}: {len(bad)} of {held} "
            f"leaves{' (leaf, rank)' if self.world_size else ''} hold non-finite values"
        ]
        bad.sort(key=lambda b: (-b[0], b[1]))
        lines += [
            f"  {where}: {count} non-finite ({dtype}), largest finite |x| {big}"
            for _, where, count, dtype, big in bad[:limit]
        ]
        if len(bad) > limit:
            lines.append(f"  ... and {len(bad) - limit} more")
        if head:
            head.sort(key=lambda h: (h[0], h[1]))
            lines.append("headroom of float16/bfloat16 leaves, lowest first:")
            lines += [
                f"  {where}: {'none, it overflowed' if bits == -math.inf else f'{bits:.1f} bits'}"
                f" ({dtype}, largest finite |x| {amax:.4g})"
                for bits, where, dtype, amax in head[:limit]
            ]
        return "\n".join(lines)


_LEAF_NAMES = ("counts", "amax", "found_inf")


def _flatten(report: NonfiniteReport) -> tuple[list[Any], tuple[Any, ...]]:
    return [getattr(report, n) for n in _LEAF_NAMES], (
        report.paths,
        report.dtypes,
        report.world_size,
    )


def _unflatten(aux: tuple[Any, ...], children: Sequence[Any]) -> NonfiniteReport:
    counts, amax, found_inf = children
    return NonfiniteReport(counts, amax, found_inf, *aux)


_register_optree: Any = optree.register_pytree_node  # typed for Collection subclasses only
_register_optree(
    NonfiniteReport,
    lambda r: (*_flatten(r), _LEAF_NAMES),
    lambda aux, children: _unflatten(aux, list(children)),
    path_entry_type=optree.GetAttrEntry,
    namespace=OPTREE_GLOBAL_NAMESPACE,  # as famp.ScalerState
)
torch_pytree.register_pytree_node(
    NonfiniteReport,
    _flatten,
    lambda children, aux: _unflatten(aux, list(children)),
    serialized_type_name="famp.NonfiniteReport",
    to_dumpable_context=lambda aux: [list(aux[0]), list(aux[1]), aux[2]],
    from_dumpable_context=lambda d: (tuple(d[0]), tuple(d[1]), d[2]),
    flatten_with_keys_fn=lambda r: (
        [(torch_pytree.GetAttrKey(n), getattr(r, n)) for n in _LEAF_NAMES],
        _flatten(r)[1],
    ),
)


def _bare(node: Any, inner: bool = False) -> bool:  # a dict of Nones, empty lists, tuples, dicts
    if inner and (node is None or isinstance(node, (list, tuple))):
        return node is None or all(_bare(x, True) for x in node)
    return isinstance(node, dict) and all(_bare(x, True) for x in node.values())


def _path_str(path: Sequence[Any]) -> str:
    """A leaf's path as the summary prints it: keys, indices, and a named tuple's field names."""
    return ".".join(_entry_name(e) for e in path) if path else "<tree>"


def _entry_name(entry: Any) -> str:
    field = getattr(entry, "field", None)  # a namedtuple's or a structseq's (`torch.max`'s) field
    return field if isinstance(field, str) else str(entry.entry)


def nonfinite_report(tree: PyTree, *, group: Any = None) -> NonfiniteReport:
    """Count the non-finite elements of every leaf and find its largest finite magnitude.

    For each tensor leaf: `counts`, the number of inf and NaN elements (0-d int64), and `amax`, the
    largest absolute finite value (0-d float32; 0 for an empty or all-non-finite leaf; a float64
    value is rounded to float32, inf beyond its range). `found_inf` is 1.0 iff any count is
    non-zero: the value `famp.unscale_and_check` returns for the same tree (and the same `group`;
    DTensor leaves make it max-reduced over their mesh, as there). No host sync: call it every step
    and look only when `found_inf` says so, with `report.summary()`. Composes with
    `torch.compile(fullgraph=True)`, where each leaf is read once.

    With `group`, one all-gather gives every rank every rank's figures: each leaf of
    `counts` and `amax` is a 1-d tensor of length `group`'s size, entry r from rank r,
    matched by leaf path. A `None` leaf (FSDP1 with `use_orig_params=True` gives one to a
    parameter with no element on a rank) is a leaf here too: -1 and NaN stand for the ranks
    where it is `None`. Eagerly, the ranks first compare their leaf paths in a small all-gather
    read on the host (the one sync, with a second where this rank holds a `None` leaf: the
    dtype of others' tensors there); trees that differ raise the same `ValueError` on every
    rank. Compiled, nothing is read: give every rank the same paths, and the dtype of a leaf
    this rank lacks is `"unknown"`. Before 2026-12-01 famp gathered the tensors by position:
    `None` leaves in different places filed a rank's figures under another leaf, or failed in
    the collective. DTensor leaves (FSDP2 gradients) report this rank's local shard. Without
    `group`, `None` leaves stay `None`.

    Args:
        tree: A pytree of float16/bfloat16/float32/float64 tensors (DTensors included).
        group: A `torch.distributed` process group to gather every rank's figures over
            (`None`: this process only).

    Returns:
        A `famp.NonfiniteReport`.

    Raises:
        TypeError: A leaf is not a floating tensor, or is sparse; the message names its path.
            `group` is not a process group.
        ValueError: With `group`, eagerly, the ranks' trees have different leaf paths (on
            every rank; the message names them).

    Examples:
        >>> import famp, torch
        >>> grads = {"w": torch.tensor([3.0, float("nan"), -7.0]), "b": torch.zeros(2)}
        >>> report = famp.nonfinite_report(grads)
        >>> report.counts, report.amax, report.found_inf
        ({'w': tensor(1), 'b': tensor(0)}, {'w': tensor(7.), 'b': tensor(0.)}, tensor(1.))
        >>> print(report.summary())
        found_inf = 1: 1 of 2 leaves hold non-finite values
          w: 1 non-finite (float32), largest finite |x| 7
    """
    # Dynamo cannot flatten a dict without leaves (`{}`, `{"w": None}`): compiled, it is a leaf
    # of its own, which the report's trees hold as it is (it has no figures).
    bare = _bare if torch.compiler.is_compiling() else None
    # With a group, a None leaf is a slot too: its figures come from the ranks that hold a tensor.
    paths, every, spec = optree.tree_flatten_with_accessor(
        tree, is_leaf=bare, none_is_leaf=group is not None
    )
    kept = [not (bare and bare(leaf)) for leaf in every]
    paths = [p for p, k in zip(paths, kept, strict=True) if k]
    leaves = [leaf for leaf, k in zip(every, kept, strict=True) if k]
    local: list[Tensor] = []
    dtensors = []
    for path, leaf in zip(paths, leaves, strict=True):
        if leaf is None:
            continue
        if not isinstance(leaf, torch.Tensor) or leaf.dtype not in FLOAT_DTYPES:
            what = leaf.dtype if isinstance(leaf, torch.Tensor) else type(leaf).__name__
            raise TypeError(
                f"famp.nonfinite_report: the leaf at {_path_str(path)!r} must be a "
                f"float16/bfloat16/float32/float64 tensor or None, got {what}"
            )
        if _collectives.is_dtensor(leaf):
            dtensors.append(leaf)
            leaf = _collectives.local_shard(leaf)
        if leaf.layout != torch.strided:
            raise TypeError(
                f"famp.nonfinite_report: the leaf at {_path_str(path)!r} has layout "
                f"{leaf.layout}; only strided tensors are supported"
            )
        local.append(leaf)
    counts, amaxes = leaf_figures(local)
    device = local[0].device if local else torch.device("cpu")
    if counts:
        any_bad = torch.stack([c.to(device) for c in counts]).ne(0).any()
        found_inf = any_bad.to(torch.float32)
    else:
        found_inf = torch.zeros((), dtype=torch.float32, device=device)
    if dtensors:
        found_inf = _collectives.reduce_found_inf_over_meshes(found_inf, dtensors)
    names, dtypes, world_size = (
        [_path_str(p) for p in paths],
        [_NAMES[x.dtype] for x in local],
        None,
    )
    if group is not None:
        own = iter(zip(counts, amaxes, [list(_NAMES).index(x.dtype) for x in local], strict=True))
        slots = [None if leaf is None else next(own) for leaf in leaves]
        counts, amaxes, found_inf, world_size, codes = _collectives.all_gather_report(
            slots, found_inf, group, names
        )
        dtypes = [(*_NAMES.values(), "unknown", "none")[c] for c in codes]  # -2, -1: see there
    counts, amaxes = (
        [next(it) if k else x for k, x in zip(kept, every, strict=True)]
        for it in (iter(counts), iter(amaxes))
    )
    return NonfiniteReport(
        optree.tree_unflatten(spec, counts),
        optree.tree_unflatten(spec, amaxes),
        found_inf,
        tuple(names),
        tuple(dtypes),
        world_size,
    )
