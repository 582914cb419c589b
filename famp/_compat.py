"""Every private torch name famp uses, in one place, each with the reason it is needed.

famp follows the installed torch: public API wherever torch has one. Where it has none, the private
name is imported here, and only here, so that a torch upgrade that moves it breaks one module (and
the tests that pin it across the supported window), never a user's numbers.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

# --- autocast: the weight-cast cache and torch's inference fast paths (ac-compose) ---------------


def tensor_version(t: torch.Tensor) -> int:
    """torch's version counter of a tensor: the only record of in-place writes to it."""
    return int(t._version)


def is_view(t: torch.Tensor) -> bool:
    """Whether a tensor is a view: torch's cast cache skips views; `is_leaf` may raise on them."""
    return bool(t._is_view())


def torch_function_modes() -> int:
    """How many torch function modes are active: famp leaves torch's fast paths alone only when
    its own mode is the one that would make torch decline them."""
    return int(torch._C._len_torch_function_stack())


def no_torch_function() -> Any:
    """A context without torch function handling, where `has_torch_function` answers False as it
    does without famp's mode (torch's public API has no way to pop one mode)."""
    return torch._C.DisableTorchFunction()


def is_compiled_module(module: object) -> bool:
    """Whether a module is `torch.compile(model)`'s wrapper (its class is private to Dynamo)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)
