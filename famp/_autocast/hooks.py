"""The global module forward hooks through which module rules enter and leave their scopes.

They are present only while a call with module rules runs (or a recomputation of
such a call), registered with torch's public functions. Dynamo cannot trace the creation of their
handles: while tracing they go through famp._compat (their additions and removals cancel out in
a graph).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle

from famp._autocast.recompute import calls
from famp._compat import saved_tensors_hooks_top, traced_module_hooks

_hook_users = [0]  # calls with module rules running, in all threads
_HOOK_LOCK = threading.Lock()
_handles: list[RemovableHandle] = []


def _acts(record: Any) -> bool:
    return not record.recompute_only or saved_tensors_hooks_top() is not None


def pre_hook(module: torch.nn.Module, args: tuple[Any, ...]) -> Any:
    stack = calls()
    if stack and stack[-1].hooked and _acts(stack[-1]):
        return stack[-1].enter_module(module, args)
    return None


def post_hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    stack = calls()
    if stack and stack[-1].hooked and _acts(stack[-1]):
        return stack[-1].exit_module(module, output)
    return None


def _count(change: int) -> None:
    _hook_users[0] += change
    if change > 0 and _hook_users[0] == 1:
        if torch.compiler.is_compiling():
            traced_module_hooks(pre_hook, post_hook)
        else:
            _handles.append(register_module_forward_pre_hook(pre_hook))
            _handles.append(register_module_forward_hook(post_hook, always_call=True))
    elif change < 0 and _hook_users[0] == 0:
        if torch.compiler.is_compiling():
            traced_module_hooks(None, None)
        else:
            for handle in _handles:
                handle.remove()
            _handles.clear()


def use(change: int) -> None:
    """Count a call that needs the hooks in (+1) or out (-1): the first registers them, the last
    removes them."""
    if torch.compiler.is_compiling():  # traced: the additions and removals cancel out in a graph
        _count(change)
    else:
        with _HOOK_LOCK:
            _count(change)
