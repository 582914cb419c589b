"""Every private torch name famp uses, in one place, each with the reason it is needed.

famp follows the installed torch: public API wherever torch has one. Where it has none, the private
name is imported here, and only here, so that a torch upgrade that moves it breaks one module (and
the tests that pin it across the supported window), never a user's numbers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

# --- autocast (famp/_autocast*.py) ----------------------------------------------------------------


# `saved_tensors_hooks_top()`: the innermost active `torch.autograd.graph.saved_tensors_hooks`
# pair, or None. torch has no public query: famp needs it to tell that an op runs inside a
# non-reentrant checkpoint's block (whose saved tensors the checkpoint's hooks pack), to restore
# its state when torch recomputes that block. A partial of the builtin: it runs once per op.
saved_tensors_hooks_top: Callable[[], tuple[object, object] | None] = functools.partial(
    torch._C._autograd._top_saved_tensors_default_hooks, False
)


def functorch_transforms_active() -> bool:
    """Whether a `torch.func` transform (grad, vmap, ...) is running here.

    No public query exists: `famp.autocast(compile=True)` must not call `torch.compile` there
    (it cannot run inside `torch.func` transforms) and runs the function directly instead.
    """
    return bool(torch._C._are_functorch_transforms_active())


# The types of `torch.ops.aten.<op>` (a packet) and `torch.ops.aten.<op>.<overload>`: famp's mode
# receives them as the functions of op calls and names the aten op from them. Not public types.
OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket


def op_schema(op: OpOverload) -> torch.FunctionSchema:
    """The schema of an op overload: famp reads argument names, defaults and mutability from it."""
    schema: torch.FunctionSchema = op._schema
    return schema


def overload_name(op: OpOverload) -> str:
    """The overload name of an op overload (`"default"`, `"dim_IntList"`, ...)."""
    name: str = op._overloadname
    return name


def packet_name(packet: OpOverloadPacket) -> str:
    """The qualified name of an op packet (`"aten::linear"`)."""
    name: str = packet._qualified_op_name
    return name


_TRACED_HOOK_KEY = -0xFA4D  # negative: never meets a handle id (those count up from 0)


def traced_module_hooks(pre: object | None, post: object | None) -> None:
    """Set (or, with None, remove) famp's global module forward hooks while Dynamo traces.

    Eagerly famp registers them with `register_module_forward_pre_hook` and
    `register_module_forward_hook(always_call=True)`; Dynamo cannot trace the creation of their
    `RemovableHandle` (a class attribute counts the ids), so while tracing famp writes the same
    entries into torch's hook dicts under a fixed key.
    """
    import torch.nn.modules.module as torch_module

    dicts: tuple[dict[int, Any], ...] = (
        torch_module._global_forward_pre_hooks,
        torch_module._global_forward_hooks,
        torch_module._global_forward_hooks_always_called,
    )
    if pre is not None:
        for table, value in zip(dicts, (pre, post, True), strict=True):
            table[_TRACED_HOOK_KEY] = value
    else:
        for table in dicts:
            del table[_TRACED_HOOK_KEY]


def tree_leaves(tree: object) -> list[object]:
    """The leaves of a pytree by torch's registry (device inference of `famp.autocast`).

    The user's containers are registered with torch's pytree, whose module is private.
    """
    from torch.utils import _pytree

    return _pytree.tree_leaves(tree)


def in_backward() -> bool:
    """Whether an autograd backward pass is running on this thread.

    No public query: famp's checkpoint hooks leave what they entered in a node's post-hook, which
    never runs when that node's backward raises; a later call outside backward cleans up.
    """
    return bool(torch._C._current_graph_task_id() != -1)
