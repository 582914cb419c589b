"""Keyword inputs of the modules module rules match: cast as their positional inputs are.

torch gives a global forward pre-hook, through which famp enters a matched module's scope and
casts its positional inputs (`CallRecord.enter_module`), no keyword inputs, unless the module's
own (private) dict of pre-hooks called with keyword inputs holds that global hook's key. So
eagerly famp's global pre-hook puts the key of its second global pre-hook there as it enters a
matched module (`hooks.ask_keywords`), and that hook, which torch calls next, takes the key out
and casts the keyword inputs (`cast_keywords`), before the module's own pre-hooks, which see them
cast as they see the positional ones. Nothing of famp's stays in the module's dicts: a copy of
the module made while the call runs (`copy.deepcopy` in a `forward`) has none of famp's hooks.
Before 2026-12-01 famp gave the matched modules below a root pre-hooks of their own while the
root ran, and such a copy kept one for ever (not scriptable, off `nn.TransformerEncoderLayer`'s
inference fast path). While Dynamo traces a call without famp's eager global hooks, each time the
call enters a root famp gives every module a rule matches below it a pre-hook of its own in
copies of its hook dicts (with keyword inputs, first among its hooks: `famp._compat.add_pre_hook`),
whose own dicts are back when the root is left. The cast applies only where famp's global pre-hook
has just entered that module's scope on this thread (`CallRecord.entering`): another thread's
call of the module, or one outside famp's call, is left alone.

A root's own keyword inputs are out of a hook's reach: its call has begun when famp finds it.
`famp.autocast(module, ...)` casts them itself (`of_root`); a root entered otherwise (by
`torch.func.functional_call`, or a function calling a module) keeps them as given, and eagerly
famp warns (`patterns.warn_uncast_keywords`), as for a TorchScript module, which refuses
Python hooks of its own.
"""

from __future__ import annotations

from typing import Any

import torch

from famp._autocast.inputs import ROOT_KEYWORDS, cast_inputs
from famp._autocast.patterns import match
from famp._autocast.recompute import calls, observe
from famp._compat import add_pre_hook, remove_pre_hook


def cast_keywords(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """`module`'s keyword inputs cast to its rule's compute dtype, if this thread's innermost famp
    call has just entered its scope (and it does not write into its input); eagerly, first seen
    in the scope around it, as `CallRecord.enter_module` sees the positional ones (a reentrant
    checkpoint's output among them is recomputed there). From `hooks.keywords_hook`, and the
    pre-hook `add` gives while Dynamo traces; without `kwargs` (a hook taken off since the
    module's call began) nothing to do."""
    stack = calls()
    if kwargs is None or not stack or stack[-1].entering is not module:
        return None
    record = stack[-1]
    record.entering = None
    policy = record.module_policy.get(id(module))
    if not kwargs or policy is None:
        return None
    if record.track and not torch.compiler.is_compiling():
        # As `enter_module` observes the positional inputs: before the scope, so that a
        # reentrant block whose output comes in by keyword is recomputed in the outer scope.
        inner = record.scopes.pop()
        try:
            observe(record, kwargs)
        finally:
            record.scopes.append(inner)
    if module.__dict__.get("inplace") is True:  # it writes into its input: uncast, as torch
        return None
    return args, cast_inputs(record, module, policy, kwargs, len(record.entered), fresh=False)


def of_root(record: Any, fn: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword inputs of a call of `fn` whose record is `record`: cast if `fn` is a module
    a rule matches (its path is `""`), whose own hooks cannot reach them."""
    if not (kwargs and record.patterns and isinstance(fn, torch.nn.Module)):
        return kwargs
    i = match(record.patterns, "")
    if i < 0 or fn.__dict__.get("inplace") is True:
        return kwargs
    return cast_inputs(record, None, record.policies[i], kwargs, ROOT_KEYWORDS, fresh=True)  # type: ignore[no-any-return]


def add(modules: list[torch.nn.Module]) -> list[Any]:
    """Give each of `modules` the pre-hook `cast_keywords`, while Dynamo traces; what `remove`
    takes to take them off again."""
    return [add_pre_hook(m, cast_keywords) for m in modules]


def remove(added: list[Any]) -> None:
    """Take off the pre-hooks `add` gave, the last first."""
    for entry in reversed(added):
        remove_pre_hook(*entry)
