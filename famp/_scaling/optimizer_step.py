"""`famp.optimizer_step`: `GradScaler.step` for any `torch.optim` optimizer, no host sync.

Two paths, one result: what a `GradScaler` loop leaves, bit for bit.

- Optimizers that unscale and skip in their kernel (`Adam`, `AdamW`, `SGD`, `Adagrad` with
  `fused=True`) get the scale and a `found_inf` that is exactly 0.0 or 1.0, as
  `GradScaler.step` hands them (the kernels skip on exactly 1.0 only).
- Every other optimizer steps on gradients unscaled in place by `GradScaler.unscale_`'s kernel;
  a skipped step is then undone (`undo.py`: parameters, `.grad`, optimizer state and param
  groups selected back with `torch.where`), with no host read of `found_inf` where a tensor
  choice can restore everything. With a step hook registered, hooks must not see a step that
  is then undone: famp reads `skip` once and calls `step()` only if it applies, as
  `GradScaler.step` does.

Deliberately not supported: optimizers whose `step` needs a closure (`LBFGS`), and those
whose `step` takes `GradScaler`'s deprecated `grad_scaler=` argument (refused: stepped
without a `GradScaler` they would apply the scaled gradients).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, cast

import torch

from famp import _collectives, _compat
from famp._scaling.checks import FLOAT_DTYPES
from famp._scaling.kernels import unscale_in_place
from famp._scaling.reach import differentiated, with_grads, wrapped
from famp._scaling.state import ScalerState
from famp._scaling.trees import to_device
from famp._scaling.undo import step_and_undo_if
from famp._scaling.unscale import unscale_and_check
from famp._typing import Tensor


def _grads_of(params: list[torch.nn.Parameter]) -> list[Tensor]:
    return [p.grad for p in params if p.grad is not None]


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


def _check(grads: list[Tensor], state: ScalerState, group: Any) -> Tensor:
    """found_inf of the scaled grads: one fused pass with a unit scale, no unscaling (the
    optimizer's kernel unscales), as GradScaler._check_inf_per_device does."""
    device = state.scale.device
    if group is None and all(
        type(g) is torch.Tensor
        and g.layout == torch.strided
        and g.device == device
        and g.dtype in FLOAT_DTYPES
        for g in grads
    ):
        # The common case without unscale_and_check's generality (DTensors, sparse, devices).
        found_inf = torch.zeros((), dtype=torch.float32, device=device)
        one = torch.ones((), dtype=torch.float32, device=device)
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for same_dtype in by_dtype.values():  # writes each value back unchanged (x * 1)
            unscale_in_place(same_dtype, found_inf, one)
        return found_inf
    unit = dataclasses.replace(state, scale=torch.ones_like(state.scale))
    with torch.no_grad():  # grads of `backward(create_graph=True)` require grad
        return unscale_and_check(unit, grads, group=group, donate=True)[1]


def _check_optimizer(optimizer: object) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    parameters = inspect.signature(optimizer.step).parameters
    if _compat.step_supports_amp_scaling(optimizer) and "grad_scaler" in parameters:
        # GradScaler.step hands such an optimizer itself (a deprecated contract) and no
        # grad_scale/found_inf; stepped without it, the optimizer would apply the scaled grads.
        raise TypeError(
            f"famp.optimizer_step cannot step {type(optimizer).__name__}: its step() takes "
            f"GradScaler's deprecated grad_scaler= argument, a GradScaler object famp does not "
            f"have; unscale with famp.unscale_and_check(..., donate=True) and call "
            f"optimizer.step() yourself only where found_inf is 0"
        )
    closure = parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise TypeError(
            f"famp.optimizer_step cannot step {type(optimizer).__name__}: its step() requires a "
            f"closure that re-evaluates the loss (GradScaler.step refuses closures too); unscale "
            f"with famp.unscale_and_check and call optimizer.step(closure) yourself"
        )


def _grad_scale(optimizer: torch.optim.Optimizer, state: ScalerState | None) -> object:
    """The `grad_scale` that `GradScaler.step` hands a fused optimizer: for scaled grads its scale
    times the user's own `optimizer.grad_scale` (if set), for unscaled grads the user's alone."""
    if state is None:
        return getattr(optimizer, "grad_scale", None)
    if not hasattr(optimizer, "grad_scale"):
        return state.scale  # GradScaler's `scale * 1`, the same bits without the multiply
    return state.scale * getattr(optimizer, "grad_scale", 1)  # GradScaler.step's product


def _fused_step(optimizer: torch.optim.Optimizer, grad_scale: object, skip: Tensor) -> None:
    """What `GradScaler.step` does with a fused optimizer; attributes restored in any case."""
    fresh = _fresh_momentum(optimizer)
    attributes = {"grad_scale": grad_scale, "found_inf": skip}
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
    for p in fresh:  # torch's fused SGD leaves torch.empty_like buffers after a skipped first step
        buffer = optimizer.state[p]["momentum_buffer"]
        buffer.masked_fill_(to_device(skip, buffer.device, "found_inf") != 0, 0.0)


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    state: ScalerState | None = None,
    *,
    found_inf: Tensor | None = None,
    group: Any = None,
) -> Tensor:
    """Step any `torch.optim` optimizer as `GradScaler.step` does, without a host sync.

    With `state`, the `.grad` of the optimizer's parameters are the *scaled* gradients of
    `famp.scale(state, loss).backward()`. Without it they are already unscaled (e.g. from
    `famp.value_and_grad` or `famp.unscale_and_check`) and `found_inf` is required: after
    `unscale_and_check(..., donate=True)` (to clip, say), passing `state` would unscale them a
    second time, which famp cannot see (clipping writes into them). Any
    non-zero or NaN `found_inf` skips the step, as `famp.update_scale` reads it. Parameters,
    optimizer state, step counts and `.grad` end up exactly as a `GradScaler` loop leaves
    them, bit for bit (tested for every `torch.optim` optimizer but `LBFGS`, which needs a
    closure, in its for-loop, foreach and fused forms, over sequences with overflows), except
    for a parameter listed twice in a group (docs/loss-scaling.md, item 14).

    - **Fused optimizers** (`Adam`, `AdamW`, `SGD`, `Adagrad` with `fused=True`) get the
      scale and `found_inf` and unscale and skip in their kernel (`found_inf` computed from the
      scaled gradients in one fused pass, max-reduced across `group`, unless given).
    - **Every other optimizer** (for-loop or foreach): the gradients are unscaled in place
      (`famp.unscale_and_check(..., donate=True)`, `GradScaler.unscale_`'s kernel), the
      optimizer steps, and a skipped step is undone with `torch.where` on copies taken before it
      (one copy of the parameters and the optimizer state per step, and of the tensors the param
      groups hold, if any): parameters (those without a `.grad` too, for an optimizer torch
      does not ship), optimizer state and each param group's entries
      (optimizers that count steps in `group['step']`, as timm's `Lamb` does), tensors
      inside lists, tuples and dicts among them (SOAP's `state['GG']`), end as if the step
      never ran; so do entries of `state` keyed by no parameter (MADGRAD's `state['k']`), the
      optimizer's own attributes (Ranger21's `current_iter`), the random generators it draws
      from (torch's default ones too), and those of the optimizers it wraps (an attribute that
      is an optimizer: Lookahead's base, `ZeroRedundancyOptimizer`'s local one).
    - **Step hooks.** With any step hook registered (`register_step_pre_hook`,
      `register_step_post_hook`, on it or an optimizer it wraps, or the global
      `torch.optim.optimizer.register_optimizer_step_pre_hook` / `_post_hook`), a non-fused
      optimizer steps as under `GradScaler`: famp reads `found_inf` on the host and calls
      `optimizer.step()` only if the step applies (no copies, no undo), so no hook sees a
      skipped step (an EMA of the weights kept by a post-hook stays finite). A fused optimizer
      is stepped every time, and its hooks run every time, as under `GradScaler`. So is an
      optimizer whose step autograd records (`differentiable=True` in a param group, or
      gradients that require grad): an undo would leave the skipped step in the graph.

    A `grad_scale` you set on a fused optimizer yourself (e.g. for summed micro-batches) is
    multiplied by the scale, or passed alone when the gradients are unscaled, as
    `GradScaler.step` does; `GradScaler` then deletes it, famp restores it, so it applies on
    every step while it is set. Without step hooks `optimizer.step()` is always called, so
    `torch.optim.lr_scheduler` never warns that it was skipped. No host sync, except: with a
    step hook on a non-fused optimizer or a differentiable step (every step); on a step where a
    non-fused optimizer creates its state (its first: a skipped one must leave no state, and
    famp reads `found_inf` once to remove it); on a step that changes a Python value famp must
    restore (`SparseAdam` counts its steps in a Python int; `group['step'] += 1`; a key added to
    a param group; a list appended to, an attribute set, random numbers drawn; a state entry
    that is a parameter's `.grad` itself; a `.grad` the step replaced or freed, put back on a
    skip). On CUDA, a non-capturable optimizer keeps `step` on the CPU, and undoing it waits for
    the device (pass `capturable=True` or `fused=True` to avoid that). Known limits of stepping
    a skipped step (non-fused, no step hook): a `step()` that raises on non-finite gradients
    (`clip_grad_norm_(..., error_if_nonfinite=True)` inside it), or `capturable=True` on the
    CPU, raises where `GradScaler` calls no `step()`; and a skipped step puts torch's default
    generators back as they were, so what another thread drew from them during the step is drawn
    again (and its draws cost a host sync). A step hook (a no-op one) avoids both. Fused `SGD`
    with momentum leaves its buffers uninitialized after a skipped first step; famp zeroes them,
    so the next step equals a first step (bit for bit with `dampening=0`). Update the scale
    afterwards: `famp.update_scale(state, found_inf)`.

    Args:
        optimizer: A `torch.optim.Optimizer` whose `step()` needs no closure.
        state: The `famp.ScalerState` that scaled the loss, or `None` if the gradients are
            unscaled. A disabled state means unscaled gradients.
        found_inf: A float32 tensor with one element (any shape); 0.0 applies the step, anything
            else (non-zero or NaN) skips it. Computed from the gradients when `None` (requires
            `state`).
        group: A `torch.distributed` process group across which a computed `found_inf` is
            max-reduced (gradients that are local shards).

    Returns:
        A 0-d float32 tensor, 1.0 if the step was skipped, else 0.0. It stays on the device, so
            asking `bool(...)` is the only host sync, and only if you ask.

    Raises:
        TypeError: `optimizer` is not a `torch.optim.Optimizer`, its `step()` requires a
            closure (`LBFGS`) or takes `GradScaler`'s deprecated `grad_scaler=` argument,
            `state` is not a `famp.ScalerState`, `found_inf` is not a float32 tensor, or
            `group` is not a process group or None.
        ValueError: Neither `state` nor `found_inf` is given, or `found_inf` has more than one
            element or is on the meta device. Every check comes before anything is changed.

    Examples:
        >>> import famp, torch
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> opt = torch.optim.SGD([w], lr=0.5)
        >>> state = famp.init_scaler(1024.0)
        >>> famp.scale(state, w.sum()).backward()
        >>> found_inf = famp.optimizer_step(opt, state)
        >>> found_inf, w.detach()
        (tensor(0.), tensor([0.5000, 0.5000]))
        >>> state = famp.update_scale(state, found_inf)
    """
    _check_optimizer(optimizer)
    if state is not None and not isinstance(state, ScalerState):
        raise TypeError(f"state must be a famp.ScalerState or None, got {type(state).__name__}")
    if found_inf is None:
        if state is None:
            raise ValueError(
                "famp.optimizer_step needs state (scaled grads) or found_inf, got neither"
            )
    else:
        if not isinstance(found_inf, torch.Tensor) or found_inf.dtype != torch.float32:
            what = (
                found_inf.dtype if isinstance(found_inf, torch.Tensor) else type(found_inf).__name__
            )
            raise TypeError(f"found_inf must be a float32 tensor, got {what}")
        if found_inf.numel() != 1:
            raise ValueError(
                f"found_inf must have exactly one element, got shape {tuple(found_inf.shape)}"
            )
        if found_inf.is_meta:
            raise ValueError("found_inf must hold a value, got a tensor on the meta device")
    _collectives.check_group(group)
    scaled = state is not None and state.enabled
    if _compat.step_supports_amp_scaling(optimizer):
        if found_inf is None:
            assert state is not None
            found_inf = (
                _check(_grads_of(with_grads(optimizer)), state, group)
                if scaled
                else torch.zeros((), dtype=torch.float32, device=state.scale.device)
            )
        skip = (found_inf.reshape(()) != 0).float()  # the kernels skip on exactly 1.0 only
        grad_scale = _grad_scale(optimizer, state if scaled else None)
        # Compiled, eagerly behind a graph break (the fused kernel runs eagerly under a compiled
        # GradScaler.step too): Dynamo may give up a frame at a graph break inside the step,
        # which then ran without grad_scale.
        if torch.compiler.is_compiling():
            torch.compiler.disable(_fused_step)(optimizer, grad_scale, skip)  # type: ignore[no-untyped-call]
        else:
            _fused_step(optimizer, grad_scale, skip)
        return skip
    if torch.compiler.is_compiling():  # eagerly, behind a graph break: eager GradScaler's bits
        # (compiled torch compiles the optimizer.step() that GradScaler.step calls: other bits)
        eager = torch.compiler.disable(_step)  # type: ignore[no-untyped-call]
        return cast(Tensor, eager(optimizer, state, found_inf, group, scaled))
    return _step(optimizer, state, found_inf, group, scaled)


def _step(
    optimizer: torch.optim.Optimizer,
    state: ScalerState | None,
    found_inf: Tensor | None,
    group: Any,
    scaled: bool,
) -> Tensor:
    """`optimizer_step` of an optimizer that takes no `grad_scale`: unscale, step, undo a skip.
    Dynamo cannot trace the undo (a `NameError` inside Dynamo on torch 2.13)."""
    if scaled:
        assert state is not None
        params = with_grads(optimizer)
        with torch.no_grad():  # in place, as GradScaler's, also grads that require grad
            unscaled, computed = unscale_and_check(
                state, _grads_of(params), group=group, donate=True
            )
        for p, grad in zip(params, unscaled, strict=True):
            if grad is not p.grad:  # a float16 sparse gradient, coalesced (as GradScaler does)
                p.grad = grad
        found_inf = computed if found_inf is None else found_inf
    elif found_inf is None:  # a disabled state: plain gradients, nothing to skip
        assert state is not None
        optimizer.step()
        return torch.zeros((), dtype=torch.float32, device=state.scale.device)
    skip = found_inf.reshape(()) != 0
    if not any(_compat.optimizer_step_hooked(o) or differentiated(o) for o in wrapped(optimizer)):
        step_and_undo_if(optimizer, skip)
    elif not bool(skip):  # hooks must not see a step that is undone: GradScaler's host read
        optimizer.step()
    return skip.float()
