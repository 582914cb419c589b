"""A non-fused optimizer's step, undone where it was skipped, without reading `skip` on the host.

`step_and_undo_if` copies what `optimizer.step()` may change, steps, and selects the copies back
with `torch.where(skip, before, after)`, in place: the parameters, their `.grad` (some
implementations write into it), every tensor of `optimizer.state`, and every tensor entry of each
param group other than `'params'` (optimizers that keep counters there: timm's Lamb, apex
FusedLAMB, several Lion and Adan ports). A group's tensors are copied in one multi-tensor clone,
and selected back only if the step wrote into them (their version counter moved): torch's own
optimizers never do, and most keep no tensors there. What a tensor choice cannot restore (state
created lazily on a first step, Python numbers such as `SparseAdam`'s count or a group's
`group['step'] += 1`, keys added or removed) is restored after one host read of `skip`, on the
steps that changed it only.
"""

from __future__ import annotations

from typing import Any

import torch

from famp import _compat
from famp._scaling.trees import to_device
from famp._typing import Tensor

# Python values of a param group that compare by value: a new but equal one is no change.
_PLAIN = (bool, int, float, complex, str)


def with_grads(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    return [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def _tensor_like(new: object, old: object) -> bool:
    return (
        isinstance(new, torch.Tensor)
        and isinstance(old, torch.Tensor)
        and new.shape == old.shape
        and new.dtype == old.dtype
        and new.device == old.device
        and new.layout == torch.strided
    )


def _same(new: object, old: object) -> bool:
    """Whether a group's value is unchanged, without comparing tensors (a host read)."""
    return new is old or (type(new) is type(old) and type(new) in _PLAIN and new == old)


class _Groups:
    """The param groups' entries other than `'params'`, as they were before the step."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.groups = optimizer.param_groups
        self.entries = [{k: v for k, v in g.items() if k != "params"} for g in self.groups]
        self.tensors = [v for e in self.entries for v in e.values() if isinstance(v, torch.Tensor)]
        self.versions = [_compat.tensor_version(t) for t in self.tensors]
        self.copies: tuple[Tensor, ...] = ()
        if self.tensors:
            with torch.no_grad():
                self.copies = _compat.foreach_clone([t.detach() for t in self.tensors])

    def select(self, on: Any) -> bool:
        """Tensors written in place back where `skip` is true; whether anything else changed."""
        changed = False
        with torch.no_grad():
            for t, version, old in zip(self.tensors, self.versions, self.copies, strict=True):
                if _compat.tensor_version(t) == version:
                    continue
                if _tensor_like(t, old):
                    new = t.detach()
                    torch.where(on(new.device), old, new, out=new)
                else:
                    changed = True
        return changed or not all(
            group.keys() - {"params"} == entries.keys()
            and all(_same(group[k], v) for k, v in entries.items())
            for group, entries in zip(self.groups, self.entries, strict=True)
        )

    def restore(self) -> None:
        """The entries as they were (after `select`: their tensors hold their old values)."""
        for t, old in zip(self.tensors, self.copies, strict=True):
            if not _tensor_like(t, old):
                with torch.no_grad():
                    # reshaped in place: onto the copy's storage, with its old shape
                    t.set_(old.untyped_storage(), old.storage_offset(), old.shape, old.stride())
        for group, entries in zip(self.groups, self.entries, strict=True):
            for k in [k for k in group if k != "params" and k not in entries]:
                del group[k]
            group.update(entries)


def step_and_undo_if(optimizer: torch.optim.Optimizer, skip: Tensor) -> None:
    """`optimizer.step()`, then everything it changed back where `skip` is true."""
    params = with_grads(optimizer)
    states = optimizer.state
    groups = _Groups(optimizer)
    with torch.no_grad():
        before_params = [p.detach().clone() for p in params]
        # Some implementations write into .grad (foreach SGD with nesterov adds the momentum);
        # a skipped GradScaler step leaves the unscaled gradients as they were.
        grads = [p.grad for p in params]
        before_grads = [g.clone() if g is not None and _tensor_like(g, g) else None for g in grads]
        before: list[dict[Any, Any] | None] = [
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in states[p].items()}
            if p in states
            else None
            for p in params
        ]
    optimizer.step()
    skips: dict[torch.device, Tensor] = {}

    def on(device: torch.device) -> Tensor:
        if device not in skips:
            skips[device] = to_device(skip, device)
        return skips[device]

    untensorlike = groups.select(on)  # state that a tensor choice cannot restore
    with torch.no_grad():
        for p, old in zip(params, before_params, strict=True):
            new = p.detach()
            torch.where(on(new.device), old, new, out=new)
        for grad, old_grad in zip(grads, before_grads, strict=True):
            if grad is not None and old_grad is not None:
                torch.where(on(grad.device), old_grad, grad, out=grad)
        for p, old_state in zip(params, before, strict=True):
            new_state = states.get(p)
            if new_state is None or old_state is None:
                untensorlike |= new_state is not old_state  # state created (or dropped)
                continue
            untensorlike |= new_state.keys() != old_state.keys()
            for k, v in new_state.items():
                if k not in old_state:
                    continue
                old_v = old_state[k]
                if _tensor_like(v, old_v):
                    torch.where(on(v.device), old_v, v, out=v)
                elif isinstance(v, torch.Tensor) or isinstance(old_v, torch.Tensor) or v != old_v:
                    untensorlike = True
    if untensorlike and bool(skip):  # the one host sync, on a step that created state
        groups.restore()
        for p, old_state in zip(params, before, strict=True):
            if old_state is None:
                states.pop(p, None)
            else:
                states[p] = old_state
