"""Module rules while Dynamo traces a call: modules left at their exits, also when they raise.

Eagerly famp leaves a module's scope in always-called forward hooks, which torch runs when the
module raises too. Under `torch.compile` torch runs no always-called hook when a forward raises
(`Module._call_impl`), so a module that raised, its exception caught by a caller inside the
call, would be left in its scope: its rule would govern the rest of the call. So:

- a compiled call of a module (`tree_hooks.py`) runs each matched module's `forward` through
  `guarded`, which leaves the module's scope (and those it entered) where the forward raises;
- a compiled call of a function (famp's global hooks, `CallRecord`) leaves, at a module's exit,
  the entries of the modules called inside it that raised (`unwind`): exact where none of them
  had a rule of its own (their scopes were the caller's). A module with a rule that raised leaves
  the ops after the catch computed under its rule, so the trace fails at the call's end
  (`end_traced`), loudly: `fullgraph=True` raises, otherwise Dynamo runs the call eagerly, where
  famp leaves the scope at the raise. A module whose own forward hooks famp leaves last from
  (`leave_last`) gets its own hook dict back either way.
"""

from __future__ import annotations

from typing import Any

import torch

from famp._autocast.recompute import calls
from famp._compat import forward_hooks

LEAVE_KEY = -0xFA4E  # famp's hook among a module's own while Dynamo traces (ids count up from 0)


def guarded(record: Any, forward: Any, *args: Any, **kwargs: Any) -> Any:
    """`forward` of a module `tree_hooks` hooked; where it raises, the module's scope (entered by
    its pre-hook just before, when `record` was innermost) and those it entered are left."""
    depth = len(record.scopes)
    entered = bool(calls()) and calls()[-1] is record
    try:
        return forward(*args, **kwargs)
    except BaseException:
        if entered:
            del record.scopes[depth - 1 :]
        raise


def guard(record: Any, module: torch.nn.Module) -> tuple[torch.nn.Module, Any]:
    """Run `module`'s `forward` through `guarded` (its `__dict__`: Dynamo traces no
    `Module.__setattr__`); what `unguard` takes."""
    own = module.__dict__.get("forward")
    module.__dict__["forward"] = _bind(record, module.forward)
    return module, own


def _bind(record: Any, forward: Any) -> Any:
    def forward_guarded(*args: Any, **kwargs: Any) -> Any:
        return guarded(record, forward, *args, **kwargs)

    return forward_guarded


def unguard(module: torch.nn.Module, own: Any) -> None:
    """Undo `guard`: the module's own `forward` attribute back, or none."""
    if own is None:
        del module.__dict__["forward"]
    else:
        module.__dict__["forward"] = own


def leave_last(record: Any, module: torch.nn.Module) -> None:
    """While Dynamo traces (no hook handle): leave `module`'s scope from a hook of its own, last
    (`CallRecord.leave_last`), in a copy of its hook dict; its dict is back when it is left."""
    own = forward_hooks(module)

    def leave_traced(left: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        forward_hooks(left, own)
        record.late.pop()
        record.late_hooks.pop()
        return record.exit_module(left, output, last=True)

    forward_hooks(module, {**own, LEAVE_KEY: leave_traced})
    record.late.append(module)
    record.late_hooks.append(own)


def unwind(record: Any, module: torch.nn.Module) -> None:
    """At `module`'s exit while Dynamo traces: leave the entries of the modules entered inside
    it that raised (their exceptions caught), noting those with a rule (`end_traced`)."""
    if all(m is not module for m in record.entered):
        return  # not entered (a global pre-hook before famp's raised): nothing above it is its
    while record.entered[-1] is not module:
        _leave_raised(record)


def _leave_raised(record: Any) -> None:
    left = record.entered.pop()
    del record.scopes[-1:]
    if record.declined:
        record.declined.pop()
    if record.late and record.late[-1] is left:
        record.late.pop()
        forward_hooks(left, record.late_hooks.pop())
    if record.module_policy.get(id(left)) is not None:
        record.raised.append(left)


def end_traced(record: Any) -> None:
    """After a traced call: leave what modules that raised left entered; fail if one had a rule."""
    while record.entered:
        _leave_raised(record)
    if record.raised:
        raise RuntimeError(
            f"famp.autocast: a module with a module rule ({type(record.raised[0]).__name__}) "
            "raised inside a compiled call of a function and its exception was caught there; "
            "torch runs no always-called forward hook under torch.compile, so the ops after the "
            "catch would run under the module's rule. Call the transformed function eagerly, or "
            "compile famp.autocast(module, ...) of a module instead"
        )
