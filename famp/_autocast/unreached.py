"""Modules famp.autocast's interception does not reach inside, and what it does about them.

- `nn.MultiheadAttention`, `nn.TransformerEncoderLayer` and `nn.TransformerEncoder` take a fused
  inference path (and nested tensors) in eval mode without grad unless an argument "has a torch
  function", which famp's modes would make true: famp leaves that path to torch, running the
  module with its modes off and the module's autocast state around it.
- A TorchScript module (`torch.jit.script`, `torch.jit.trace`) runs its ops in TorchScript's
  interpreter, past torch function modes and Python module hooks: torch's autocast still casts
  them by the autocast state around the module, which famp sets eagerly to the module's scope (a
  module rule matching the script module or one outside it applies to it as a whole); op
  overrides and module rules for modules inside it cannot apply, and famp says so once.
  Compiled calls cannot do this (docs/autocast.md, "TorchScript modules").
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch

from famp._autocast import hooks
from famp._autocast.fast_path import takes_fast_path
from famp._autocast.patterns import AutocastWarning
from famp._autocast.recompute import calls
from famp._autocast.region import region
from famp._compat import no_torch_function, torch_function_modes

FAST_PATH_MODULES = (
    torch.nn.MultiheadAttention,
    torch.nn.TransformerEncoderLayer,
    torch.nn.TransformerEncoder,
)
UNREACHED = (*FAST_PATH_MODULES, torch.jit.ScriptModule)


def may_enter(fn: Any) -> tuple[bool, list[torch.nn.Module]]:
    """Whether a call of `fn` may enter a module of `UNREACHED` that famp must see, and the
    fast-path modules in train mode it holds. Yes unless `fn` is a module whose tree holds no
    TorchScript module and only fast-path modules in train mode: torch takes no fast path in
    train mode (`MultiheadAttention` and `TransformerEncoderLayer` test their own flag,
    `TransformerEncoder` its first layer's). Walking the tree costs under a microsecond a module;
    a global hook, through which famp sees the modules, costs torch's hook path several at every
    module call. A module switched to eval mode during the call is found after it (`switched`)."""
    if not isinstance(fn, torch.nn.Module):
        return True, []
    trained: list[torch.nn.Module] = []
    for m in fn.modules():
        if isinstance(m, FAST_PATH_MODULES) and m.training:
            trained.append(m)
        elif isinstance(m, UNREACHED):
            return True, []
    return False, trained


def switched(record: Any, trained: list[torch.nn.Module]) -> None:
    """After an eager call that left the fast-path modules `trained` unhooked: warn (once per
    transformed function) if one of them is in eval mode now: the call may have run it without
    leaving its inference fast path to torch."""
    moved = [type(m).__name__ for m in trained if not m.training]
    if moved and "switched" not in record.transform.warned:
        record.transform.warned.add("switched")
        warnings.warn(
            f"famp.autocast: {', '.join(sorted(set(moved)))} switched to eval mode during the "
            "call. famp looks for torch's inference fast paths as each call starts, so in this "
            "call it may have run one under its interception (op overrides applied, torch's "
            "slow path) instead of leaving it to torch's fast path as in eval mode otherwise. "
            "Switch modes between calls.",
            AutocastWarning,
            stacklevel=4,
        )


def decline(
    record: Any, module: torch.nn.Module, args: tuple[Any, ...], scope: tuple[bool, Any] | None
) -> contextlib.ExitStack | None:
    """The context to run `module` in, eagerly, if famp's interception does not reach inside it
    (see the module docstring), else None. `scope`: the autocast state famp's rules give it
    (None: the call's own, already in effect). A fast-path module's answer needs its keyword
    inputs, which torch gives no global pre-hook: famp's pre-hook asks them of its second one
    (`hooks.ask_keywords`), which answers through `judge`; None till then."""
    if not record.track or torch.compiler.is_compiling():
        return None
    if isinstance(module, torch.jit.ScriptModule):
        return _script(record, module, scope)
    if isinstance(module, FAST_PATH_MODULES):
        hooks.ask_keywords(module)
    return None


def judge(record: Any, module: torch.nn.Module, args: tuple[Any, ...], kwargs: Any) -> None:
    """With `module`'s keyword inputs, as `decline` asked: leave it to torch's fast path if
    torch takes it there; without module rules, till the module's call ends."""
    if not record.patterns:
        declined = _fast_path(record, module, args, kwargs, None)
        if declined is not None:  # its hook goes with it (closed by the region at last)
            declined.callback(hooks.on_exit(module, declined.close).remove)
    elif record.entered and record.entered[-1] is module and record.declined[-1] is None:
        record.declined[-1] = _fast_path(record, module, args, kwargs, record.scopes[-1])


def _fast_path(
    record: Any,
    module: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    scope: tuple[bool, Any] | None,
) -> contextlib.ExitStack | None:
    if not (
        torch_function_modes() == sum(1 for r in calls() if r.intercepts)  # famp's only
        and takes_fast_path(module, args, kwargs)
    ):
        return None
    warned = record.transform.warned
    if "fast path" not in warned and any(r.overrides is not None for r in calls()):
        warned.add("fast path")
        warnings.warn(
            f"famp.autocast: op overrides do not apply inside {type(module).__name__} where "
            "torch runs it on its inference fast path (eval mode, no grad needed, ...); famp "
            "leaves that path to torch (autocast state as torch.autocast's, no interception)."
            " Call it with grad enabled or in train mode to apply the overrides there.",
            AutocastWarning,
            stacklevel=3,
        )
    stack = contextlib.ExitStack()
    record.opened.append(stack)
    if scope is not None:
        stack.enter_context(region(record.device_type, *scope))
    stack.enter_context(no_torch_function())
    return stack


def _script(
    record: Any, module: torch.nn.Module, scope: tuple[bool, Any] | None
) -> contextlib.ExitStack | None:
    """A TorchScript module: its scope's autocast state around it; a warning (once per
    transformed function) if op overrides or module rules for modules inside it would apply."""
    if "script" not in record.transform.warned:
        overrides = any(r.overrides is not None for r in calls())
        inside = [
            _name(sub)
            for sub in module.modules()
            if sub is not module and record.module_policy.get(id(sub)) is not None
        ]
        if overrides or inside:
            record.transform.warned.add("script")
            what = "op overrides" if overrides else "module rules matching " + ", ".join(inside)
            warnings.warn(
                f"famp.autocast: {what} do not apply inside the TorchScript module "
                f"{_name(module)}: TorchScript runs its ops past "
                "famp's interception. torch's autocast still casts them, by the autocast state "
                "of the module rule that applies to the whole module, or of the call. Call the "
                "module's Python version for the rules to apply inside.",
                AutocastWarning,
                stacklevel=3,
            )
    if scope is None:
        return None
    stack = contextlib.ExitStack()
    record.opened.append(stack)
    stack.enter_context(region(record.device_type, *scope))
    return stack


def _name(module: torch.nn.Module) -> str:
    return str(getattr(module, "original_name", type(module).__name__))
