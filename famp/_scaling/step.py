"""Training steps: the scaler composed with `torch.func`.

`value_and_grad` is flax's `DynamicScale.value_and_grad` with torch's numbers: scale the loss,
differentiate with `torch.func.grad` (eagerly outside transforms, its results through plain
autograd: `grad.py`), unscale and check in one pass, update the scale. A step
built from it is pure, branch-free and compiles with `torch.compile(fullgraph=True)`.
`skip_on_overflow` drops an update after an overflow without a host sync. `optimizer_step`
(`optimizer_step.py`) does the same for `torch.optim` optimizers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from famp import _collectives
from famp._compat import torch_pytree
from famp._scaling.choice import readable, select
from famp._scaling.grad import eager_grad
from famp._scaling.state import ScalerState
from famp._scaling.trees import leaves_and_rebuild, scaled
from famp._scaling.unscale import unscale_leaves
from famp._scaling.update import update_scale
from famp._typing import Tensor, TreeT


def _check_argnums(argnums: object) -> None:
    def is_int(x: object) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    ok = is_int(argnums) or (
        isinstance(argnums, tuple) and len(argnums) > 0 and all(is_int(a) for a in argnums)
    )
    if not ok:
        raise TypeError(f"argnums must be an int or a non-empty tuple of ints, got {argnums!r}")


def value_and_grad(
    fn: Callable[..., Any],
    argnums: int | tuple[int, ...] = 0,
    has_aux: bool = False,
    *,
    group: Any = None,
) -> Callable[..., tuple[Any, Any, Tensor, ScalerState]]:
    """Transform a loss function into one that returns its value, unscaled grads and a new scale.

    The returned function takes a `famp.ScalerState` first, then `fn`'s arguments, and does
    what `GradScaler` does around `loss.backward()`, as pure functions: the loss is multiplied
    by the scale (`famp.scale`), differentiated with `torch.func.grad` with respect to the
    arguments `argnums`, unscaled and checked (`famp.unscale_and_check`), and the scale is
    updated (`famp.update_scale`): torch's growth timing, bit for bit. `value` is the loss as
    `fn` returned it, never scaled. The gradients are returned even after an overflow (they then
    hold inf or NaN): skip the update with `famp.skip_on_overflow`. Composes with
    `torch.compile(fullgraph=True)` and `torch.func.vmap`. Eagerly, outside transforms, with
    arguments that do not require grad (`p.detach()`) and are not inference tensors, the
    gradients come from plain autograd (`torch.func.grad`'s values; see the loss-scaling
    guide), and those that share memory with no other tensor are unscaled in place, at
    `GradScaler.unscale_`'s speed. Compiled on the CPU, inductor unscales big ones (128 MiB of
    float32 or float64) in place too, where nothing else reads them. Compiled on torch before
    2.15, a custom `torch.autograd.Function`'s `backward` is dropped silently (torch's bug,
    pytorch/pytorch#193279; see the loss-scaling guide); eagerly it runs.

    Args:
        fn: The loss function. Returns a floating tensor with one element (any shape: `()`,
            `(1,)`, ...), or `(loss, aux)` when `has_aux` (`aux` a pytree of tensors, as
            `torch.func.grad` requires; returned detached).
        argnums: Which positional arguments of `fn` to differentiate (an int or a tuple of ints),
            as in `torch.func.grad`.
        has_aux: `fn` returns `(loss, aux)`.
        group: A `torch.distributed` process group across which `found_inf` is max-reduced
            (gradients that are local shards); `None`: no communication.

    Returns:
        A function `(state, *args, **kwargs) -> (value, grads, found_inf, new_state)`: `value`
            is the loss (`(loss, aux)` when `has_aux`); `grads` has the structure of the
            `argnums` arguments (a tuple of them for a tuple `argnums`); `found_inf` is a 0-d
            float32 tensor, 1.0 iff any gradient element is non-finite; `new_state` is the updated
            `famp.ScalerState`.

    Raises:
        TypeError: `fn` is not callable, `argnums` is not an int or a non-empty tuple of
            ints, `has_aux` is not a bool, `group` is not a process group or None; when
            called: `state` is not a `famp.ScalerState`, the loss is not a floating tensor
            with one element, or `fn` does not return a pair with `has_aux`, or the aux holds
            a non-tensor leaf.

    Examples:
        >>> import famp, torch
        >>> def loss_fn(w, x):
        ...     return (w * x).sum()
        >>> step = famp.value_and_grad(loss_fn)
        >>> state = famp.init_scaler(2.0**10, growth_interval=1)
        >>> loss, grads, found_inf, state = step(state, torch.ones(2), torch.tensor([3.0, 4.0]))
        >>> loss, grads, found_inf, state.scale
        (tensor(7.), tensor([3., 4.]), tensor(0.), tensor(2048.))
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    _check_argnums(argnums)
    if not isinstance(has_aux, bool):
        raise TypeError(f"has_aux must be a bool, got {has_aux!r}")
    _collectives.check_group(group)  # here, not after fn's forward and backward have run

    def scaled_loss(state: ScalerState, *args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
        # torch.func.grad's aux must hold tensors only, so "no aux" is the empty tuple here.
        out = fn(*args, **kwargs)
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError(
                    f"with has_aux=True, fn must return a pair (loss, aux), got "
                    f"{type(out).__name__}"
                )
            loss, aux = out
            leaves = torch_pytree.tree_leaves(aux)  # torch.func.grad's pytree and requirement
            if not all(isinstance(x, torch.Tensor) for x in leaves):
                bad = next(x for x in leaves if not isinstance(x, torch.Tensor))
                raise TypeError(
                    f"with has_aux=True, aux must be a pytree of tensors (as torch.func.grad "
                    f"requires), got a {type(bad).__name__} leaf: {bad!r}"
                )
        else:
            loss, aux = out, ()
        if not (isinstance(loss, torch.Tensor) and loss.is_floating_point() and loss.numel() == 1):
            what = (
                f"a {loss.dtype} tensor of shape {tuple(loss.shape)}"
                if isinstance(loss, torch.Tensor)
                else type(loss).__name__
            )
            raise TypeError(f"fn must return a one-element floating tensor as loss, got {what}")
        # What famp.scale does to one tensor, without walking a tree (the state was checked, the
        # loss just now). torch.func.grad differentiates a 0-d output: a one-element loss of any
        # shape becomes one.
        out = scaled(state, loss) if state.enabled else loss
        return (out if out.dim() == 0 else out.reshape(())), (loss, aux)

    @functools.wraps(fn)
    def step(state: ScalerState, *args: Any, **kwargs: Any) -> tuple[Any, Any, Tensor, ScalerState]:
        if not isinstance(state, ScalerState):
            raise TypeError(
                f"the first argument must be a famp.ScalerState, got {type(state).__name__}"
            )
        loss_fn = functools.partial(scaled_loss, state)
        # torch.func.grad's, faster eagerly
        result = eager_grad(loss_fn, argnums, args, kwargs, state.scale)
        if result is None:
            grads, (loss, aux) = torch.func.grad(loss_fn, argnums=argnums, has_aux=True)(
                *args, **kwargs
            )
            # The gradients are new tensors that only this step reads: compiled, inductor
            # may unscale them in place (`unscale_leaves`'s `fresh`).
            leaves, rebuild_grads = leaves_and_rebuild(grads)
            leaves, found_inf = unscale_leaves(
                state, leaves, lambda: grads, group=group, fresh=True
            )
            grads = rebuild_grads(leaves)
        else:  # a list of gradients: unscaled before their tree is built, which is built once
            leaves, rebuild, (loss, aux), owned = result
            leaves, found_inf = unscale_leaves(
                state, leaves, lambda: rebuild(leaves), group=group, owned=owned
            )
            grads = rebuild(leaves)
        value = (loss, aux) if has_aux else loss
        return value, grads, found_inf, update_scale(state, found_inf)

    return step


def skip_on_overflow(found_inf: Tensor, updated: TreeT, current: TreeT) -> TreeT:
    """Keep `current` instead of `updated` after an overflow, without a host sync.

    Every leaf becomes `torch.where(found_inf == 0, updated_leaf, current_leaf)`, so a non-zero
    (or NaN) `found_inf` rolls the whole tree back: pass parameters *and* optimizer state
    together, `(new_params, new_opt_state)` and `(params, opt_state)`. A step counter kept in
    the optimizer state is rolled back too, like `torch.optim`'s fused optimizers and optax's
    `apply_if_finite` do, so a learning-rate schedule computed from it does not advance on a
    skipped step; a schedule computed from your own iteration counter does (as a
    `torch.optim.lr_scheduler` stepped every iteration does under `GradScaler`). Counters must
    be tensors; use `famp.select_tree` with your own predicate for anything else.

    Eagerly, with `found_inf` on the CPU, each result leaf is the chosen leaf itself (no copy;
    leaves that require grad, with grad enabled, excepted), so an in-place write into a result
    also changes that input leaf; compiled, results are new tensors (see `famp.select_tree`).

    Args:
        found_inf: A one-element tensor, `found_inf` of `famp.value_and_grad` or
            `famp.unscale_and_check`; non-zero or NaN means overflow.
        updated: The tree after the update.
        current: The tree before it, with the same structure, dtypes and shapes.

    Returns:
        `updated` if `found_inf` is 0, else `current`, leaf by leaf.

    Raises:
        TypeError: `found_inf` is not a tensor, or a leaf is not a tensor or differs in dtype.
        ValueError: `found_inf` has more than one element, or the trees differ in structure,
            or paired leaves in shape, device or layout.

    Examples:
        >>> import famp, torch
        >>> famp.skip_on_overflow(torch.tensor(1.0), {"w": torch.zeros(2)}, {"w": torch.ones(2)})
        {'w': tensor([1., 1.])}
    """
    if not isinstance(found_inf, torch.Tensor):
        raise TypeError(f"found_inf must be a Tensor, got {type(found_inf).__name__}")
    if found_inf.numel() != 1:
        raise ValueError(
            f"found_inf must have exactly one element, got shape {tuple(found_inf.shape)}"
        )
    # Read eagerly as select_tree reads its pred: no predicate tensor is made unless one is used.
    take = found_inf.item() == 0 if readable(found_inf) else None  # NaN: False, as `== 0`
    names = ("famp.skip_on_overflow", "found_inf", "updated", "current")
    return select(lambda: found_inf.reshape(()) == 0, take, updated, current, names)
