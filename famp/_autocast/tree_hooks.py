"""Module rules in a compiled call of a module: hooks on the modules rules match, none global.

Eagerly, and compiled where the transformed function is no module, famp sees every module call
through global forward hooks (`hooks.py`), and any global hook sends every module call through
torch's slow hook path. Dynamo traces that path and famp's hooks at each module call: hundreds of
bytecodes a call, most of a compiled call's trace with module rules. Where Dynamo traces a call of
`famp.autocast(module, ...)`, the root is the module itself, and the modules whose scopes change
anything are those a rule matches: each of them gets a forward pre-hook (with keyword inputs, first
among its own) that enters its scope and casts its inputs, and a forward hook (last among its own)
that leaves it and casts its output; every other module keeps torch's fast path. What each op then
runs under is what the global hooks give: an unmatched module's scope is its caller's; a matched
module that raises leaves its scope through famp's wrapper of its `forward` (`raised.py`), torch
running no always-called hook there. The hooks live in copies of the modules' hook dicts while
Dynamo traces (no handle can be made there; the copies' additions and removals cancel out in a
graph).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from famp._autocast.mode import own_cast
from famp._autocast.raised import guard, unguard
from famp._autocast.recompute import calls
from famp._autocast.region import policy_state
from famp._compat import add_pre_hook, forward_hooks, is_compiled_module, remove_pre_hook

_KEY = -0xFA50  # famp's hooks among a module's own (handle ids count up from 0)


def _enter(
    record: Any, root: torch.nn.Module, module: torch.nn.Module, args: Any, kwargs: Any
) -> Any:
    stack = calls()
    if not stack or stack[-1] is not record:
        return None  # a nested famp call's module: its hooks govern it
    policy = record.module_policy[id(module)]
    record.scopes.append(policy_state(policy))
    if module.__dict__.get("inplace") is True:  # it writes into its input: uncast, as torch
        return None
    args = own_cast(policy.cast_to_compute, args)
    if kwargs and module is not root:  # a root's: cast as the call's (keywords.of_root)
        kwargs = own_cast(policy.cast_to_compute, kwargs)
    return args, kwargs


def _leave(record: Any, module: torch.nn.Module, args: Any, output: Any) -> Any:
    stack = calls()
    if not stack or stack[-1] is not record:
        return None
    del record.scopes[-1:]
    return own_cast(record.module_policy[id(module)].cast_to_output, output)


def hook_tree(record: Any, root: Any) -> list[Any] | None:
    """Give the modules the rules of `record` match in `root`'s tree their hooks, while Dynamo
    traces a call of `root`; what `unhook_tree` takes to take them off, or None where the global
    hooks stay: `root` is no module (a function's roots are found as it enters them), a compiled
    wrapper or a TorchScript module. A rule matching a TorchScript module inside does not apply
    in a compiled call either way (docs/autocast.md, "TorchScript modules")."""
    wrapper = isinstance(root, torch.jit.ScriptModule) or is_compiled_module(root)
    if not isinstance(root, torch.nn.Module) or wrapper:
        return None
    record.enter_root(root)
    hooked = [root] if record.module_policy.get(id(root)) is not None else []
    hooked += record.root_matched
    undo = []
    for module in hooked:  # entry first among its pre-hooks, exit last among its forward hooks
        post = forward_hooks(module)
        forward_hooks(module, {**post, _KEY: partial(_leave, record)})
        # torch runs no always-called hook where a forward raises under compile: famp's `forward`
        undo.append(
            (add_pre_hook(module, partial(_enter, record, root)), post, guard(record, module))
        )
    return undo


def unhook_tree(undo: list[Any]) -> None:
    """Put the modules' own hook dicts back (the last first)."""
    for added, post, guarded in reversed(undo):
        remove_pre_hook(*added)
        forward_hooks(added[0], post)
        unguard(*guarded)
