"""Every private torch name famp uses, in one place, each with the reason it is needed.

famp follows the installed torch: public API wherever torch has one. Where it has none, the private
name is imported here, and only here, so that a torch upgrade that moves it breaks one module (and
the tests that pin it across the supported window), never a user's numbers.
"""

from __future__ import annotations

# --- autocast op rules: _rules.py, _rules_derive.py --------------------------------------------
# isort: split
import torch
from torch._ops import OpOverload as OpOverload  # an aten overload's type; no public alias
from torch._subclasses.fake_tensor import FakeTensorMode as FakeTensorMode  # no computing
from torch.utils import _pytree as _torch_pytree
from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode  # see the casts

torch_pytree = _torch_pytree  # tree_map/flatten over aten call arguments (torch's own pytree)


def kernel_registrations(dispatch_key: str) -> list[str]:
    """The ops with a kernel registered for ``dispatch_key`` (``"AutocastCPU"``), as
    ``"aten::mm"`` names: the autocast ops are read off torch's dispatcher; no public API."""
    return list(torch._C._dispatch_get_registrations_for_dispatch_key(dispatch_key))


def schema(op: OpOverload) -> torch.FunctionSchema:
    """An overload's C++ schema: argument types decide what autocast casts; no public accessor."""
    return op._schema
