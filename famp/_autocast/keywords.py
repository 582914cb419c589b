"""Keyword inputs of the modules module rules match: cast as their positional inputs are.

torch gives a global forward pre-hook, through which famp enters a matched module's scope and
casts its positional inputs (`CallRecord.enter_module`), no keyword inputs. So each time a call
enters a root, famp gives every module a rule matches below it a forward pre-hook of its own,
with keyword inputs and first among its hooks (as `register_forward_pre_hook(with_kwargs=True,
prepend=True)` would, for less: `famp._compat.add_pre_hook`), and takes them off when the root
is left; a checkpointed block's recomputation gives them to the matched modules of the root it
ran in while it runs. torch runs such a hook right after the global ones, so its module's own
pre-hooks see the cast keyword inputs as they see the cast positional ones. The hook casts only
where famp's global pre-hook has just entered that module's scope on this thread
(`CallRecord.entering`): another thread's call of the module, or one outside famp's call, is
left alone.

A root's own keyword inputs are out of a hook's reach: its call has begun when famp finds it.
`famp.autocast(module, ...)` casts them itself (`of_root`); a root entered otherwise (by
`torch.func.functional_call`, or a function calling a module) keeps them as given, and eagerly
famp warns (`patterns.warn_uncast_keywords`), as for a TorchScript module, which refuses
Python hooks of its own.

`nn.TransformerEncoderLayer` takes no inference fast path while a module of its tree has a hook:
where famp leaves such a layer to that path (`unreached.decline`), its keyword pre-hook takes
itself out of the layer's dicts once it has run, before the layer's `forward` looks, and is put
back as the layer is left, for its next call in the root.
"""

from __future__ import annotations

from typing import Any

import torch

from famp._autocast.mode import own_cast
from famp._autocast.patterns import match
from famp._autocast.recompute import calls, observe
from famp._compat import add_pre_hook, pre_hooks, remove_pre_hook


def cast_keywords(
    module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The pre-hook: `module`'s keyword inputs cast to its rule's compute dtype, if this thread's
    innermost famp call has just entered its scope (and it does not write into its input);
    eagerly, first seen in the scope around it, as `CallRecord.enter_module` sees the positional
    ones (a reentrant checkpoint's output among them is recomputed there).
    Without `kwargs`, torch calls a hook taken off since the module's call began (famp's global
    pre-hook drops what a backward that raised in a recomputation left): nothing to do."""
    stack = calls()
    if kwargs is None or not stack or stack[-1].entering is not module:
        return None
    record = stack[-1]
    record.entering = None
    declined = record.declined[-1] if record.declined else None  # `module`'s, just entered
    if declined is not None and isinstance(module, torch.nn.TransformerEncoderLayer):
        _step_aside(record, module, declined)
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
    return args, own_cast(policy.cast_to_compute, kwargs)


def _step_aside(record: Any, module: torch.nn.Module, declined: Any) -> None:
    """Take this hook out of `module`'s dicts till `declined` (its fast-path context) closes,
    then put it back if the root's hooks still hold it (a KeyboardInterrupt may have taken them
    off first: then it stays off)."""
    own, with_kwargs = pre_hooks(module)
    keys = [key for key, hook in own.items() if hook is cast_keywords]
    for key in keys:
        del own[key]
        with_kwargs.pop(key, None)

    def back() -> None:
        held = {entry[3] for entry in record.root_hooks + record.keyword_hooks}
        for key in reversed(keys):
            if key in held:
                own[key] = cast_keywords
                own.move_to_end(key, last=False)
                with_kwargs[key] = True

    declined.callback(back)


def of_root(record: Any, fn: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword inputs of a call of `fn` whose record is `record`: cast if `fn` is a module
    a rule matches (its path is `""`), whose own hooks cannot reach them."""
    if not (kwargs and record.patterns and isinstance(fn, torch.nn.Module)):
        return kwargs
    i = match(record.patterns, "")
    if i < 0 or fn.__dict__.get("inplace") is True:
        return kwargs
    return own_cast(record.policies[i].cast_to_compute, kwargs)  # type: ignore[no-any-return]


def add(modules: list[torch.nn.Module]) -> list[Any]:
    """Give each of `modules` the pre-hook; what `remove` takes to take them off again."""
    return [add_pre_hook(m, cast_keywords) for m in modules]


def remove(added: list[Any]) -> None:
    """Take off the pre-hooks `add` gave, the last first."""
    for entry in reversed(added):
        remove_pre_hook(*entry)
