"""Unscaling gradients and checking them for overflow: `famp.unscale_and_check`.

`unscale_and_check` is `GradScaler.unscale_` out of place, bit for bit: what torch's fused
`_amp_foreach_non_finite_check_and_unscale` kernel computes per (device, dtype) group,
multiplying by `f32(1/f64(scale))`, with about one pass over memory (`kernels.py`).
`found_inf` is one 0-d float32 tensor, exactly 0.0 or 1.0.

Deliberately not supported: sparse layouts other than COO; float16 is accepted (torch refuses it
in `GradScaler.unscale_`, see docs/loss-scaling.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch

from famp import _collectives
from famp._compat import functorch_transforms_active as are_functorch_transforms_active
from famp._scaling.aliasing import shared_memory
from famp._scaling.checks import FLOAT_DTYPES
from famp._scaling.differentiable import carry_tangents, differentiable_unscale
from famp._scaling.kernels import out_of_place, unscale_in_place, unscale_owned
from famp._scaling.program import where_program
from famp._scaling.state import ScalerState
from famp._scaling.trees import check_state_first, leaves_and_rebuild, path_of, to_device
from famp._typing import PyTree, Tensor, TreeT


def unscale_and_check(
    state: ScalerState, grads: TreeT, *, group: Any = None, donate: bool = False
) -> tuple[TreeT, Tensor]:
    """Unscale gradients and report whether any element is non-finite, in one pass.

    Every tensor is multiplied by `f32(1/f64(scale))` in float32 (float64 for float64 grads)
    and cast back to its dtype, exactly as torch's fused
    `_amp_foreach_non_finite_check_and_unscale` kernel does, grouped by device and dtype like
    `GradScaler.unscale_`. Inf and NaN pass through and every gradient is unscaled even after
    one. Unlike `GradScaler`, float16 gradients are accepted. Sparse COO gradients have their
    values unscaled (float16 ones are coalesced first, as torch does); `None` leaves pass
    through. DTensor gradients (FSDP2) are unscaled shard by shard and `found_inf` is
    max-reduced over their mesh's non-replicated dimensions, as `GradScaler` does through
    DTensor dispatch. Under `torch.func.vmap` the kernel's arithmetic runs as separate ops
    (bit-equal), and `found_inf` is per sample. Under `torch.compile` the results are the
    same with static shapes, `dynamic=True`, `mark_dynamic` and after a recompile.

    Gradients that require grad (from `torch.autograd.grad(..., create_graph=True)`, or inside
    an outer `torch.func.grad`) are unscaled differentiably: the values are the kernel's and the
    backward is that of torch's gradient-penalty recipe, `g * (1.0 / scaler.get_scale())`: the
    incoming gradient times `1 / scale` (in float32 for float32 and narrower grads).

    Eagerly on the CPU, where one call's big float32 (or float64) grads total 128 MiB or more,
    famp unscales them with a program it compiles with `torch.compile` on the first such call
    (a few seconds, once per process, dtype and thread count), one pass over memory instead of
    two; where compiling fails it warns once and keeps torch's kernel. Same bits either way.
    Inside a step compiled on the CPU, the unscale is one `famp::unscale` operator that runs
    this eager path when the step runs: inductor compiles one node for it, not a loop per
    gradient (`famp.value_and_grad` unscales its own big gradients in place of them instead).

    Args:
        state: The `famp.ScalerState` whose scale produced the gradients.
        grads: A pytree of float16/bfloat16/float32/float64 tensors, dense or sparse COO.
        group: A `torch.distributed` process group; `found_inf` is max-reduced across it so
            every rank agrees (`None`: no communication).
        donate: `True` consumes the inputs: their buffers are unscaled in place and returned, the
            speed of `GradScaler.unscale_`. Do not use the inputs afterwards. Leaves that share
            memory (the same tensor twice, as tied weights give; overlapping views) are unscaled
            once: each holds its own contents unscaled, eagerly and compiled. Eagerly, views of
            one buffer with different dtypes, and expanded tensors, are refused (compiled, their
            memory cannot be seen: do not donate them).

    Returns:
        `(unscaled_grads, found_inf)`: the same tree structure, and a 0-d float32 tensor on the
            scale's device equal to 1.0 iff any element was non-finite, else 0.0. A disabled state
            returns `(grads, 0.0)`.

    Raises:
        TypeError: `state` is not a `famp.ScalerState` (the message says when the arguments
            are swapped), `donate` is not a bool, `group` is not a process group or None, or a
            leaf is not a floating tensor, is nested or has an unsupported layout (its path).
        ValueError: A leaf is on the meta device while the scale is not; or, with
            `donate=True`, leaves share memory with different dtypes, a leaf overlaps itself,
            or a leaf requires grad; the message names the paths.

    Examples:
        >>> import famp, torch
        >>> state = famp.init_scaler(4.0)
        >>> grads, found_inf = famp.unscale_and_check(state, [torch.tensor([8.0, float("inf")])])
        >>> grads
        [tensor([2., inf])]
        >>> found_inf
        tensor(1.)
    """
    check_state_first("unscale_and_check", state, "grads", grads)
    if not isinstance(donate, bool):
        raise TypeError(f"famp.unscale_and_check: donate must be a bool, got {donate!r}")
    _collectives.check_group(group)  # before donated grads are unscaled in place
    if not state.enabled:
        return grads, torch.zeros((), dtype=torch.float32, device=state.scale.device)
    leaves, rebuild = leaves_and_rebuild(grads)
    out, found_inf = unscale_leaves(
        state, leaves, lambda: cast(PyTree, grads), group=group, donate=donate
    )
    return rebuild(out), found_inf


def unscale_leaves(
    state: ScalerState,
    leaves: list[Any],
    tree: Callable[[], PyTree],
    *,
    group: Any = None,
    donate: bool = False,
    owned: list[bool] | None = None,
    fresh: bool = False,
) -> tuple[list[Any], Tensor]:
    """`unscale_and_check` of a tree's leaves: the unscaled leaves, in order, and `found_inf`.

    `famp.value_and_grad` calls it eagerly on the gradients as autograd lists them, before it
    builds their tree (a flatten and an unflatten less), with `owned`: which leaves are
    autograd's fresh results that nothing else references, unscaled in place; compiled, with
    `fresh=True`: the leaves are intermediate results of the compiled step that nothing else
    reads, which inductor then unscales in place where it can (`kernels._compiled`; the same
    values either way). `tree` gives the tree of `leaves`, only for the paths that errors name.
    """
    if not state.enabled:
        return leaves, torch.zeros((), dtype=torch.float32, device=state.scale.device)
    if group is None and (found_owned := unscale_owned(state.scale, leaves, owned)) is not None:
        return leaves, found_owned  # autograd's own grads, one dtype on the CPU: done in place
    scale_device = state.scale.device
    # What the kernel reads: plain dense tensors themselves (the fast path), a DTensor's local
    # shard, a sparse tensor's values (float16 ones coalesced first, because summing duplicate
    # entries may overflow float16; torch's _unscale_grads_ does the same).
    dense: list[Tensor] = []
    special: dict[int, tuple[Tensor, Tensor]] = {}  # index -> (leaf, the tensor read)
    # What the kernel reads, grouped by device and dtype as GradScaler groups it.
    groups: dict[torch.device, dict[torch.dtype, list[int]]] = {}
    # Gradients that carry a graph (create_graph=True, an outer torch.func.grad): the kernel has
    # no derivative, so the same results through an autograd Function with the recipe's backward.
    grad_enabled = torch.is_grad_enabled()
    differentiable = False
    for i, leaf in enumerate(leaves):  # one pass, each property read once: microseconds a call
        if type(leaf) is torch.Tensor and leaf.layout == torch.strided:
            read = leaf
            dtype = read.dtype
            if dtype not in FLOAT_DTYPES or read.is_nested:
                _check_leaf(tree, leaf, scale_device)
        else:
            _check_leaf(tree, leaf, scale_device)
            source = _collectives.local_shard(leaf) if _collectives.is_dtensor(leaf) else leaf
            if source.is_sparse:
                source = source.coalesce() if source.dtype == torch.float16 else source
                read = source._values()
            else:
                read = source
            special[i] = (leaf, source)
            dtype = read.dtype
        dense.append(read)
        if grad_enabled and not differentiable:
            differentiable = read.requires_grad
        by_dtype = groups.get(device := read.device)
        if by_dtype is None:
            groups[device] = {dtype: [i]}
        elif (index := by_dtype.get(dtype)) is None:
            by_dtype[dtype] = [i]
        else:
            index.append(i)
    if not differentiable and not donate:  # dual tensors' tangents, as the recipe's
        differentiable = carry_tangents(dense)
    for device, by_dtype in groups.items():  # meta leaves: once per device, not per leaf
        if device.type == "meta":
            first = min(i for index in by_dtype.values() for i in index)
            _check_leaf(tree, leaves[first], scale_device)
    if differentiable and donate:
        path = path_of(
            tree(), next(x for x, d in zip(leaves, dense, strict=True) if d.requires_grad)
        )
        raise ValueError(
            f"famp.unscale_and_check: donate=True cannot unscale in place the leaf at "
            f"{path}, which requires grad (create_graph=True); pass donate=False"
        )
    inv_scale64 = state.scale.double().reciprocal()
    inv_scale = inv_scale64.float()
    # The fused kernel has no vmap batching rule: under torch.func transforms, the same arithmetic
    # as separate ops (per-sample found_inf under vmap), out of place.
    transformed = are_functorch_transforms_active()
    in_place = donate and not transformed
    # Eager donation: leaves that share memory (the same tensor twice, overlapping views) are
    # computed out of place from what they hold and written back, so that every element is
    # unscaled once, as compiled (functionalized) donation does. Compiled: dynamo sees no pointers.
    shared: set[int] = set()
    if in_place and not torch.compiler.is_compiling():
        clusters, self_overlapping = shared_memory(dense)
        for cluster in clusters:
            if len({dense[i].dtype for i in cluster}) > 1:
                named = ", ".join(path_of(tree(), leaves[i]) for i in cluster)
                raise ValueError(
                    f"famp.unscale_and_check: with donate=True, the leaves at "
                    f"{named} share memory with different "
                    f"dtypes ({', '.join(str(dense[i].dtype) for i in cluster)}); pass donate=False"
                )
            shared.update(cluster)
        if self_overlapping:
            raise ValueError(
                f"famp.unscale_and_check: with donate=True, the leaf at "
                f"{path_of(tree(), leaves[self_overlapping[0]])} has elements that share memory "
                f"(an expanded tensor), which in place would be unscaled more than once; pass "
                f"donate=False"
            )
    write_back: dict[int, Tensor] = {}
    out = list(dense)
    # One device and one dtype (the common case): the group is `dense` itself, in order.
    whole = len(groups) == 1 and len(next(iter(groups.values()))) == 1
    found_inf: Tensor | None = None
    for device, by_dtype in groups.items():
        inv = to_device(inv_scale, device, "the state's scale")
        found = torch.zeros((), dtype=torch.float32, device=device)
        for index in by_dtype.values():
            tensors = dense if whole else [dense[i] for i in index]
            if differentiable:
                new, found = differentiable_unscale(tensors, found, inv_scale64.to(device))
            elif transformed:
                new, found = where_program(tensors, found, inv)
            elif owned is not None:  # autograd's fresh grads: in place where only famp holds them
                mine = [dense[i] for i in index if owned[i]]
                if mine:
                    unscale_in_place(mine, found, inv)
                new = tensors
                others = [i for i in index if not owned[i]]
                if others:
                    results, found = out_of_place([dense[i] for i in others], found, inv)
                    copies = dict(zip(others, results, strict=True))
                    new = [copies.get(i, dense[i]) for i in index]
            elif in_place:
                alone = [x for i, x in zip(index, tensors, strict=True) if i not in shared]
                if alone:
                    unscale_in_place(alone, found, inv)
                aliased = [i for i in index if i in shared]
                if aliased:
                    results, found = out_of_place([dense[i] for i in aliased], found, inv)
                    write_back.update(zip(aliased, results, strict=True))
                new = tensors
            else:
                new, found = out_of_place(tensors, found, inv, fresh=fresh)
            if whole:
                out = list(new)
            else:
                for i, t in zip(index, new, strict=True):
                    out[i] = t
        # max, never sum: found_inf stays exactly 0.0 or 1.0 whatever the number of devices.
        found = to_device(found, scale_device, "found_inf")  # new: one device's is the result
        found_inf = found if found_inf is None else torch.maximum(found_inf, found)
    if found_inf is None:  # no gradients
        found_inf = torch.zeros((), dtype=torch.float32, device=scale_device)
    for i in sorted(write_back):  # in leaf order, after every result was computed
        dense[i].copy_(write_back[i])
    dtensors = []
    for i, (leaf, source) in special.items():
        values = out[i]
        if source.is_sparse:  # in place: its values were unscaled
            values = source if in_place else _sparse_like(source, values)
        if _collectives.is_dtensor(leaf):
            dtensors.append(leaf)
            values = leaf if in_place else _collectives.dtensor_like(leaf, values)
        out[i] = values
    if dtensors:
        found_inf = _collectives.reduce_found_inf_over_meshes(found_inf, dtensors)
    if group is not None:
        found_inf = _collectives.all_reduce_max(found_inf, group)
    return out, found_inf


def _check_leaf(tree: Callable[[], PyTree], leaf: object, scale_device: torch.device) -> None:
    if not isinstance(leaf, torch.Tensor) or leaf.dtype not in FLOAT_DTYPES:
        what = leaf.dtype if isinstance(leaf, torch.Tensor) else type(leaf).__name__
        raise TypeError(
            f"famp.unscale_and_check: the leaf at {path_of(tree(), leaf)} must be a "
            f"float16/bfloat16/float32/float64 tensor or None, got {what}"
        )
    if leaf.is_nested:
        raise TypeError(
            f"famp.unscale_and_check: the leaf at {path_of(tree(), leaf)} is a nested tensor "
            f"(layout {leaf.layout}); only strided and sparse_coo tensors are supported, as in "
            f"GradScaler"
        )
    if leaf.layout not in (torch.strided, torch.sparse_coo):
        raise TypeError(
            f"famp.unscale_and_check: the leaf at {path_of(tree(), leaf)} has layout "
            f"{leaf.layout}; only strided and sparse_coo are supported"
        )
    if leaf.is_meta and scale_device.type != "meta":
        raise ValueError(
            f"famp.unscale_and_check: the leaf at {path_of(tree(), leaf)} is on the meta device "
            f"(no data), so found_inf on {scale_device} cannot be computed from it; meta gradients "
            f"need a meta scale: famp.init_scaler(..., device='meta')"
        )


def _sparse_like(src: Tensor, values: Tensor) -> Tensor:
    return torch.sparse_coo_tensor(
        src._indices(),
        values,
        src.shape,
        is_coalesced=src.is_coalesced(),
        check_invariants=False,  # indices and size come from a valid tensor
    )
