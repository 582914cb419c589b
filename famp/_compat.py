"""Every private torch name famp uses, in one place, each with the reason it is needed.

famp follows the installed torch: public API wherever torch has one. Where it has none, the private
name is imported here, and only here, so that a torch upgrade that moves it breaks one module (and
the tests that pin it across the supported window), never a user's numbers.
"""

from __future__ import annotations

# --- nonfinite_report and explain (_report.py, _explain.py) -------------------------------------
# isort: split
# torch's pytree registry: a report must pass in and out of torch.compile, which flattens with it
# (famp.ScalerState registers the same way).
import torch.utils._pytree as torch_pytree

# Whether a torch.func transform (vmap, grad) is active: nonfinite_report's CPU shortcut reads
# tensor values, which a transform's wrapped tensors do not allow.
from torch._C import _are_functorch_transforms_active as functorch_transforms_active

# TorchDispatchMode: the public base class of dispatch modes lives in a private module; explain
# records every aten op (and its dtypes) with one.
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["TorchDispatchMode", "functorch_transforms_active", "torch_pytree"]
