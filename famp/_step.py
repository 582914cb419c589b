"""Training steps: the scaler composed with ``torch.func`` and with fused ``torch.optim``.

``value_and_grad`` is flax's ``DynamicScale.value_and_grad`` with torch's numbers: scale the loss,
differentiate with ``torch.func.grad``, unscale and check in one pass, update the scale. A step
built from it is pure, branch-free and compiles with ``torch.compile(fullgraph=True)``.
``skip_on_overflow`` drops an update after an overflow without a host sync. ``optimizer_step``
hands ``found_inf`` (and the scale) to a fused ``torch.optim`` optimizer, whose kernel unscales and
skips, and returns ``found_inf`` so the caller knows whether the step was skipped (torch's
``GradScaler.step`` cannot say, pytorch/pytorch#55585).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch

from famp._scaler import ScalerState, update_scale
from famp._typing import Tensor, TreeT
from famp._unscale import scale, select_tree, unscale_and_check


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

    The returned function takes a ``famp.ScalerState`` first, then ``fn``'s arguments, and does
    what ``GradScaler`` does around ``loss.backward()``, as pure functions: the loss is multiplied
    by the scale (``famp.scale``), differentiated with ``torch.func.grad`` with respect to the
    arguments ``argnums``, unscaled and checked (``famp.unscale_and_check``), and the scale is
    updated (``famp.update_scale``): torch's growth timing, bit for bit. ``value`` is the loss as
    ``fn`` returned it, never scaled. The gradients are returned even after an overflow (they then
    hold inf or NaN): skip the update with ``famp.skip_on_overflow``. Composes with
    ``torch.compile(fullgraph=True)`` and ``torch.func.vmap``.

    Args:
        fn: The loss function. Returns a one-element floating tensor, or ``(loss, aux)`` when
            ``has_aux`` (``aux`` any pytree, returned detached).
        argnums: Which positional arguments of ``fn`` to differentiate (an int or a tuple of ints),
            as in ``torch.func.grad``.
        has_aux: ``fn`` returns ``(loss, aux)``.
        group: A ``torch.distributed`` process group across which ``found_inf`` is max-reduced
            (gradients that are local shards); ``None``: no communication.

    Returns:
        A function ``(state, *args, **kwargs) -> (value, grads, found_inf, new_state)``: ``value``
        is the loss (``(loss, aux)`` when ``has_aux``); ``grads`` has the structure of the
        ``argnums`` arguments (a tuple of them for a tuple ``argnums``); ``found_inf`` is a 0-d
        float32 tensor, 1.0 iff any gradient element is non-finite; ``new_state`` is the updated
        ``famp.ScalerState``.

    Raises:
        TypeError: ``argnums`` is not an int or a tuple of ints, ``has_aux`` is not a bool; when
            called: ``state`` is not a ``famp.ScalerState``, the loss is not a one-element floating
            tensor, or ``fn`` does not return a pair with ``has_aux``.

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
    _check_argnums(argnums)
    if not isinstance(has_aux, bool):
        raise TypeError(f"has_aux must be a bool, got {has_aux!r}")

    def scaled(state: ScalerState, *args: Any, **kwargs: Any) -> tuple[Tensor, Any]:
        # torch.func.grad's aux must hold tensors only, so "no aux" is the empty tuple here.
        out = fn(*args, **kwargs)
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError(
                    f"with has_aux=True, fn must return a pair (loss, aux), got "
                    f"{type(out).__name__}"
                )
            loss, aux = out
        else:
            loss, aux = out, ()
        if not (isinstance(loss, torch.Tensor) and loss.is_floating_point() and loss.numel() == 1):
            what = (
                f"a {loss.dtype} tensor of shape {tuple(loss.shape)}"
                if isinstance(loss, torch.Tensor)
                else type(loss).__name__
            )
            raise TypeError(f"fn must return a one-element floating tensor as loss, got {what}")
        return scale(state, loss), (loss, aux)

    @functools.wraps(fn)
    def step(state: ScalerState, *args: Any, **kwargs: Any) -> tuple[Any, Any, Tensor, ScalerState]:
        if not isinstance(state, ScalerState):
            raise TypeError(
                f"the first argument must be a famp.ScalerState, got {type(state).__name__}"
            )
        differentiate = torch.func.grad(
            functools.partial(scaled, state), argnums=argnums, has_aux=True
        )
        grads, (loss, aux) = differentiate(*args, **kwargs)
        grads, found_inf = unscale_and_check(state, grads, group=group)
        value = (loss, aux) if has_aux else loss
        return value, grads, found_inf, update_scale(state, found_inf)

    return step


def skip_on_overflow(found_inf: Tensor, updated: TreeT, current: TreeT) -> TreeT:
    """Keep ``current`` instead of ``updated`` after an overflow, without a host sync.

    Every leaf becomes ``torch.where(found_inf == 0, updated_leaf, current_leaf)``, so a non-zero
    (or NaN) ``found_inf`` rolls the whole tree back: pass parameters *and* optimizer state
    together, ``(new_params, new_opt_state)`` and ``(params, opt_state)``. A step counter kept in
    the optimizer state is rolled back too, like ``torch.optim``'s fused optimizers and optax's
    ``apply_if_finite`` do, so a learning-rate schedule computed from it does not advance on a
    skipped step; a schedule computed from your own iteration counter does (as a
    ``torch.optim.lr_scheduler`` stepped every iteration does under ``GradScaler``). Counters must
    be tensors; use ``famp.select_tree`` with your own predicate for anything else.

    Args:
        found_inf: A one-element tensor, ``found_inf`` of ``famp.value_and_grad`` or
            ``famp.unscale_and_check``; non-zero or NaN means overflow.
        updated: The tree after the update.
        current: The tree before it, with the same structure, dtypes and shapes.

    Returns:
        ``updated`` if ``found_inf`` is 0, else ``current``, leaf by leaf.

    Raises:
        TypeError: ``found_inf`` is not a tensor, or a leaf is not a tensor or differs in dtype.
        ValueError: ``found_inf`` has more than one element, or the trees differ in structure or
            shape.

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
    return select_tree(found_inf.reshape(()) == 0, updated, current)


def _grads(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def _fresh_momentum(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    """Fused-SGD parameters whose momentum buffer the coming step creates (see optimizer_step)."""
    if not isinstance(optimizer, torch.optim.SGD):
        return []
    return [
        p
        for g in optimizer.param_groups
        if g.get("fused") and g["momentum"] != 0
        for p in g["params"]
        if p.grad is not None and optimizer.state[p].get("momentum_buffer") is None
    ]


_CHECK_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check(grads: list[Tensor], state: ScalerState, group: Any) -> Tensor:
    """found_inf of the scaled grads: one fused pass with a unit scale, no unscaling (the
    optimizer's kernel unscales), as GradScaler._check_inf_per_device does."""
    device = state.scale.device
    if group is None and all(
        type(g) is torch.Tensor
        and g.layout == torch.strided
        and g.device == device
        and g.dtype in _CHECK_DTYPES
        for g in grads
    ):
        # The common case without unscale_and_check's generality (DTensors, sparse, devices).
        found_inf = torch.zeros((), dtype=torch.float32, device=device)
        one = torch.ones((), dtype=torch.float32, device=device)
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for same_dtype in by_dtype.values():  # writes each value back unchanged (x * 1)
            torch._amp_foreach_non_finite_check_and_unscale_(same_dtype, found_inf, one)
        return found_inf
    unit = dataclasses.replace(state, scale=torch.ones_like(state.scale))
    return unscale_and_check(unit, grads, group=group, donate=True)[1]


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    state: ScalerState | None = None,
    *,
    found_inf: Tensor | None = None,
    group: Any = None,
) -> Tensor:
    """Step a fused ``torch.optim`` optimizer that unscales and skips in its kernel; no host sync.

    The optimizer must apply ``grad_scale``/``found_inf`` itself (``torch.optim`` ``Adam``,
    ``AdamW``, ``SGD`` and ``Adagrad`` with ``fused=True``). With ``state``, the ``.grad`` of its
    parameters are the *scaled* gradients of ``famp.scale(state, loss).backward()``: unless given,
    ``found_inf`` is computed from them in one fused pass (max-reduced across ``group``), and the
    kernel divides them by ``state.scale`` and skips the update on overflow, exactly as
    ``GradScaler.step`` does with a fused optimizer. Without ``state`` the gradients are already
    unscaled (e.g. from ``famp.value_and_grad``) and ``found_inf`` is required. ``optimizer.step()``
    is always called, so ``torch.optim.lr_scheduler`` never warns that it was skipped; a skipped
    step leaves parameters, moments and the ``step`` count unchanged. Fused ``SGD`` with momentum
    creates its buffers with ``torch.empty_like`` on its first step and leaves them uninitialized
    if that step is skipped; famp zeroes them then, so the next step equals a first step (bit for
    bit with ``dampening=0``). Update the scale afterwards: ``famp.update_scale(state, found_inf)``.

    Args:
        optimizer: A ``torch.optim.Optimizer`` with ``_step_supports_amp_scaling``.
        state: The ``famp.ScalerState`` that scaled the loss, or ``None`` if the gradients are
            unscaled. A disabled state means unscaled gradients.
        found_inf: 1.0 to skip the step, 0.0 to apply it (a one-element float32 tensor); computed
            from the gradients when ``None`` (requires ``state``).
        group: A ``torch.distributed`` process group across which a computed ``found_inf`` is
            max-reduced (gradients that are local shards).

    Returns:
        ``found_inf``: a float32 tensor equal to 1.0 iff the step was skipped. It stays on the
        device, so asking ``bool(found_inf)`` is the only host sync, and only if you ask.

    Raises:
        TypeError: The optimizer cannot apply ``grad_scale``/``found_inf`` itself, ``state`` is not
            a ``famp.ScalerState``, or ``found_inf`` is not a float32 tensor.
        ValueError: Neither ``state`` nor ``found_inf`` is given, or ``found_inf`` has more than one
            element.

    Examples:
        >>> import famp, torch
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.SGD([w], lr=0.5, fused=True)
        >>> state = famp.init_scaler(1024.0)
        >>> famp.scale(state, w.sum()).backward()
        >>> found_inf = famp.optimizer_step(opt, state)
        >>> found_inf, w.detach()
        (tensor(0.), tensor([0.5000, 0.5000]))
        >>> state = famp.update_scale(state, found_inf)
    """
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        raise TypeError(
            f"famp.optimizer_step needs an optimizer that applies grad_scale/found_inf in its "
            f"step (torch.optim Adam, AdamW, SGD, Adagrad with fused=True), got "
            f"{type(optimizer).__name__} without _step_supports_amp_scaling; for others use "
            f"famp.unscale_and_check and famp.skip_on_overflow"
        )
    if state is not None and not isinstance(state, ScalerState):
        raise TypeError(f"state must be a famp.ScalerState or None, got {type(state).__name__}")
    scaled = state is not None and state.enabled
    if found_inf is None:
        if state is None:
            raise ValueError(
                "famp.optimizer_step needs state (scaled grads) or found_inf, got neither"
            )
        if scaled:
            found_inf = _check(_grads(optimizer), state, group)
        else:
            found_inf = torch.zeros((), dtype=torch.float32, device=state.scale.device)
    if not isinstance(found_inf, torch.Tensor) or found_inf.dtype != torch.float32:
        what = found_inf.dtype if isinstance(found_inf, torch.Tensor) else type(found_inf).__name__
        raise TypeError(f"found_inf must be a float32 tensor, got {what}")
    if found_inf.numel() != 1:
        raise ValueError(
            f"found_inf must have exactly one element, got shape {tuple(found_inf.shape)}"
        )
    fresh = _fresh_momentum(optimizer)
    # What GradScaler.step sets on a fused optimizer; restored afterwards, whatever happens.
    attributes = {
        "grad_scale": state.scale if state is not None and scaled else None,
        "found_inf": found_inf,
    }
    saved = {name: getattr(optimizer, name) for name in attributes if hasattr(optimizer, name)}
    for name, value in attributes.items():
        setattr(optimizer, name, value)
    try:
        optimizer.step()
    finally:
        for name in attributes:
            delattr(optimizer, name)
        for name, value in saved.items():
            setattr(optimizer, name, value)
    skipped = found_inf.reshape(()) != 0
    for p in fresh:
        buffer = optimizer.state[p]["momentum_buffer"]
        buffer.masked_fill_(skipped.to(buffer.device, non_blocking=True), 0.0)
    return found_inf


for _public in (value_and_grad, skip_on_overflow, optimizer_step):
    _public.__module__ = "famp"
