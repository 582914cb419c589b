"""Every private torch name famp uses, in one place, each with the reason it is needed.

famp follows the installed torch: public API wherever torch has one. Where it has none, the private
name is imported here, and only here, so that a torch upgrade that moves it breaks one module (and
the tests that pin it across the supported window), never a user's numbers.
"""

from __future__ import annotations

from typing import Any

import torch

# --- training steps: _step.py, _optimizer_step.py ------------------------------------------------


def step_supports_amp_scaling(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step()`` reads ``grad_scale``/``found_inf`` and skips in its kernel.

    torch marks such optimizers (fused Adam, AdamW, SGD, Adagrad) only with this private attribute,
    the one ``GradScaler.step`` reads.
    """
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def amp_foreach_non_finite_check_and_unscale_(
    tensors: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> Any:
    """``GradScaler``'s fused check-and-unscale kernel, which has no public name."""
    return torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, inv_scale)
