"""What a non-fused optimizer step may write, read off the optimizer (for `undo.py`).

The parameters (those with a `.grad`; every one, for an optimizer torch does not ship), the
optimizers it wraps, its own attributes beside torch's, the entries of its `state` keyed by no
parameter, and torch's default random generators it may draw from.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


def with_grads(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    return [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def may_write(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    """The parameters a step may write: torch's optimizers skip those without a `.grad` (tested
    over every optimizer of the installed torch); one torch does not ship may write them all (a
    decay of every parameter), so all are copied."""
    if type(optimizer).__module__.startswith("torch."):
        return with_grads(optimizer)
    return [p for g in optimizer.param_groups for p in g["params"]]


def wrapped(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizer and those it wraps, each once: optimizers among its attributes (Lookahead's
    base optimizer, `ZeroRedundancyOptimizer`'s local one), in lists, tuples and dicts too, and
    theirs. A wrapped optimizer keeps its own state, which a skipped step must leave as it was."""
    found = [optimizer]
    for o in found:
        for k, v in vars(o).items():
            if k in ("state", "param_groups"):  # per-parameter entries: no optimizer there
                continue
            held = v.values() if isinstance(v, dict) else v if isinstance(v, list | tuple) else (v,)
            for w in held:
                if isinstance(w, torch.optim.Optimizer) and all(w is not f for f in found):
                    found.append(w)
    return found


def unique(items: Any) -> list[Any]:
    return list({id(x): x for x in items}.values())


@functools.cache
def torch_attributes() -> frozenset[str]:
    """The attributes torch keeps on an optimizer, read from the installed torch: state, groups,
    defaults, hooks, flags, an LR scheduler's (a wrapped `step`, a flag that it was called)."""
    p = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.SGD([p], lr=0.0)
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    p.grad = torch.zeros(1)
    optimizer.step()
    optimizer.zero_grad()
    return frozenset(vars(optimizer))


def attributes(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's own attributes: torch's left out."""
    torch_own = torch_attributes()
    return {k: v for k, v in vars(optimizer).items() if k not in torch_own}


def unkeyed(state: dict[Any, Any]) -> dict[Any, Any]:
    """Entries of an optimizer's `state` not keyed by a parameter (MADGRAD's `state['k']`)."""
    return {k: v for k, v in state.items() if not isinstance(k, torch.Tensor)}


def default_generators(params: list[torch.nn.Parameter]) -> list[torch.Generator]:
    """torch's default random generators, the CPU's and those of the parameters' devices: a step
    that draws random numbers (noise, stochastic rounding) advances them, a skipped step must
    not, or every later draw (dropout's masks too) differs from a `GradScaler` loop's."""
    found = [torch.default_generator]
    for device in {p.device for p in params if not p.is_cpu}:
        defaults = getattr(getattr(torch, device.type, None), "default_generators", ())
        if device.index is not None and device.index < len(defaults):
            found.append(defaults[device.index])
    return found


def differentiated(optimizer: torch.optim.Optimizer) -> bool:
    """Whether autograd records the step (`differentiable=True`) or its grads carry a graph: an
    undo's writes would bump the versions of tensors saved for backward, and leave the skipped
    step's graph on the parameters (a meta-gradient with the skipped step in it)."""
    for group in optimizer.param_groups:  # loops, not any(): this runs at every step
        if group.get("differentiable"):
            return True
        for p in group["params"]:
            grad = p.grad
            if grad is not None and grad.requires_grad:
                return True
    return False
