"""The device type an `famp.autocast` call runs on, read off its arguments' tensors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from famp._compat import tree_leaves


def any_tensor(tree: Any, test: Callable[[torch.Tensor], object]) -> bool:
    """Whether `test` holds for a tensor in `tree`, tried in order until one does: the common
    containers directly (fast), anything else through torch's pytree registry."""
    if isinstance(tree, (list, tuple)):
        items: Any = tree
    elif isinstance(tree, dict):
        items = tree.values()
    else:
        items = (tree,)
    for item in items:
        if isinstance(item, torch.Tensor):
            if test(item):
                return True
        elif isinstance(item, (list, tuple, dict)):
            if any_tensor(item, test):
                return True
        elif (
            item is not None
            and not isinstance(item, (int, float, str, bool))
            and any(test(x) for x in tree_leaves(item) if isinstance(x, torch.Tensor))
        ):
            return True
    return False


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def infer_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    found: set[str] = set()

    def add(x: torch.Tensor) -> None:  # a plain tensor's is_cpu: no device object to build
        found.add("cpu" if type(x) in _PLAIN and x.is_cpu else x.device.type)

    any_tensor((args, kwargs), add)
    accelerators = sorted(found - {"cpu", "meta"})
    if len(accelerators) > 1:
        raise ValueError(
            f"device_type=None: the arguments hold tensors on several devices {accelerators}; "
            "pass device_type"
        )
    if accelerators:
        return accelerators[0]
    if "cpu" in found:
        return "cpu"
    raise ValueError("device_type=None needs a tensor not on meta among the args; pass device_type")
