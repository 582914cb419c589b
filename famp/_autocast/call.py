"""The record of one `famp.autocast` call: its policy, rules, module scopes and weight casts.

A record lives on the thread's stack of calls (`recompute.calls`) while its call runs (and again
while torch recomputes a checkpointed block of it). Module rules enter and leave scopes through
the global module hooks (`hooks.py`), and `FampMode` hands it each op that may need a rule other
than torch's (`run_op`). `current_state` reads the autocast state a module rule sets.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from famp._autocast import hooks, keywords
from famp._autocast.casts import AS_TORCH, apply_rule
from famp._autocast.inputs import cast_inputs, check_inputs, wrote
from famp._autocast.mode import FampMode, own_cast, run_plain
from famp._autocast.op_calls import call, inplace_target, op_name, writes_first_arg, written
from famp._autocast.overrides import plain
from famp._autocast.patterns import (
    MatchedTree,
    match_tree,
    warn_uncast_keywords,
    warn_unmatched,
)
from famp._autocast.policy import Policy
from famp._autocast.raised import end_traced, leave_last, unwind
from famp._autocast.recompute import calls, observe
from famp._autocast.region import enter_state, policy_state, region, swap_state
from famp._autocast.tree_hooks import hook_tree, unhook_tree
from famp._autocast.unreached import UNREACHED, decline, may_enter, switched
from famp._autocast.weights import WeightCasts, dtype_switched, replay_starts, unwatched
from famp._compat import forward_hooks, is_compiled_module

SCRIPTED = torch.jit.ScriptModule  # refuses Python hooks of its own: its keyword inputs as given


class CallRecord:
    """What one call of a transformed function knows: its policy, rules, module scopes, cache."""

    def __init__(self, transform: Any, device_type: str) -> None:
        self.transform = transform
        self.device_type = device_type
        self.base = policy_state(transform.policy)
        self.overrides = transform.overrides
        self.patterns = transform.patterns
        self.policies = transform.policies
        # Eagerly, in-place writes and dtype switches are watched; compiled graphs have no cache.
        self.track = not torch.compiler.is_compiling()
        self.intercepts = transform.track_casts or self.overrides is not None or bool(self.patterns)
        self.suspended = 0  # > 0 while a nested famp.autocast call runs
        self.proxy: CallRecord | None = None  # no mode: the call whose mode watches its ops
        self.grad_free = False  # a grad-free op ran (a reentrant checkpoint's block may follow)
        self.grad_free_block: Any = None  # the checkpointed block a grad-free op ran in, if any
        self.recompute_only = False  # a replay that acts only inside a recomputation
        self.group = 0  # a replay's: how many calls below it on the stack (famp's modes off)
        self.seen_dtype = self.base[1]  # the autocast dtype of the last op FampMode saw
        self.casts = WeightCasts(device_type)  # eagerly: the weight-cast caches, kept fresh
        # One entry per module entered: the autocast state in effect inside it, None if famp's own.
        self.scopes: list[tuple[bool, torch.dtype] | None] = []
        self.entered: list[torch.nn.Module] = []  # the modules entered in this record, in order
        self.made: dict[int, Any] = {}  # eagerly: per depth in `entered`, inputs.cast_inputs'
        # Eagerly, per matched module entered: its depth in `scopes`, torch's state before it.
        self.restores: list[tuple[int, tuple[bool, torch.dtype]]] = []
        # Each module's policy, for the root entered last and per root; by id (Dynamo fails on
        # dicts keyed by the modules it traces), the modules kept alive by `held`.
        self.module_policy: dict[int, Policy | None] = {}
        self.roots: dict[int, MatchedTree] = {}  # root -> `match_tree(root, ...)`
        self.held: list[torch.nn.Module] = []
        self.late: list[torch.nn.Module] = []  # matched modules left from their last hook
        self.late_hooks: list[Any] = []  # traced: their own hook dicts (raised.leave_last)
        self.raised: list[torch.nn.Module] = []  # traced: matched modules that raised, caught
        # Keyword inputs (keywords.py): the modules rules match below the current root; traced,
        # the hooks given them while a root runs; the module whose scope famp entered last.
        self.root_matched: list[torch.nn.Module] = []
        self.root_hooks: list[Any] = []
        self.entering: torch.nn.Module | None = None
        self.paths: list[str] = []  # the module paths of the roots entered (eagerly)
        # Per module entered: the context that leaves it to torch's fast path, or None; and every
        # such context opened (closed by the call's region at the latest: a KeyboardInterrupt).
        self.declined: list[contextlib.ExitStack | None] = []
        self.opened: list[contextlib.ExitStack] = []
        # Module hooks: for module rules, and eagerly for torch's fast paths while intercepting.
        self.hooked = bool(self.patterns)
        self.tree: list[Any] | None = None  # traced: the matched modules' hooks (tree_hooks.py)
        self.trained: list[torch.nn.Module] = []
        if not self.hooked and self.intercepts and self.track:
            self.hooked, self.trained = may_enter(transform.fn)
        # Eagerly: op function -> overrides.plain(...) for FampMode's fast path (outside scopes).
        self.plain_ops = transform.plain_ops.setdefault(device_type, {}) if self.track else None

    # Activation checkpointing (famp._autocast.recompute): a record made again for a recomputation.

    def frozen(self) -> Callable[[], CallRecord]:
        """A factory of this call's record as it is now, with a fresh cast cache."""
        args = (self.transform, self.device_type, self.module_policy, tuple(self.scopes), self.held)
        return partial(CallRecord.replayed, *args)

    @staticmethod
    def replayed(
        transform: Any,
        device_type: str,
        module_policy: dict[int, Policy | None],
        scopes: tuple[tuple[bool, torch.dtype] | None, ...],
        held: list[torch.nn.Module],
    ) -> CallRecord:
        record = CallRecord(transform, device_type)
        record.group = replay_starts()  # the records below this replay's, in `calls()`
        record.track = True  # a recomputation runs eagerly, in backward
        record.module_policy, record.held = module_policy, held  # the ids' modules kept alive
        record.scopes = list(scopes)
        record.hooked = bool(record.patterns) or record.intercepts
        return record

    def new_mode(self) -> FampMode:
        return FampMode(self)

    def use_hooks(self, change: int, eager: bool = False) -> None:
        if eager:  # a replay ends (`eager` only then): custom backwards ran without famp's modes
            unwatched()
        if change > 0 and self.patterns and not self.track:  # traced: the matched modules' own
            self.tree = hook_tree(self, self.transform.fn)
            self.hooked = self.tree is None
        if self.hooked:
            hooks.use(change, post=bool(self.patterns), eager=eager)
        if change < 0 and self.root_hooks:  # traced, a root's: if it never left
            keywords.remove(self.root_hooks)
            self.root_hooks = []
        if change < 0 and self.tree is not None:
            unhook_tree(self.tree)

    # Module scopes (called from the global forward hooks while this call is innermost).

    def enter_module(self, module: torch.nn.Module, args: tuple[Any, ...]) -> Any:
        if not self.patterns:
            # No scopes, and no hook at exits (hooks.py): modules left to torch till then.
            if isinstance(module, UNREACHED):
                declined = decline(self, module, args, None)
                if declined is not None:  # its hook goes with it (closed by the region at last)
                    declined.callback(hooks.on_exit(module, declined.close).remove)
            return None
        if is_compiled_module(module):
            return None  # `torch.compile(model)`'s wrapper: paths start at the model it wraps
        if self.track and not torch.compiler.is_compiling():
            observe(self, args)
        if not self.scopes:  # `module` is a root: its paths start here, each time it is one
            self.enter_root(module)
            if torch.compiler.is_compiling():  # traced: keyword hooks of their own, off at its exit
                self.root_hooks.extend(keywords.add(self.root_matched))
        policy = self.module_policy.get(id(module))
        outer = self.scopes[-1] if self.scopes else None
        self.entering = None
        self.entered.append(module)
        if policy is None:
            self.scopes.append(outer)
            self.declined.append(decline(self, module, args, outer) if self.track else None)
            if len(self.scopes) == 1 and forward_hooks(module):  # a root: its hooks inside it
                self._leave_last(module)
            return None
        inner = policy_state(policy)
        self.scopes.append(inner)
        self._switch(inner)
        if self.track and not torch.compiler.is_compiling():  # torch's state too, till its exit
            self.restores.append((len(self.scopes), enter_state(self.device_type, inner)))
        args = cast_inputs(self, module, policy, args, len(self.entered), fresh=True)
        self.entering = module  # its keyword inputs: cast by famp's next hook (keywords.py)
        if len(self.scopes) > 1 and not self.root_hooks and not isinstance(module, SCRIPTED):
            hooks.ask_keywords(module)  # no root (its call had begun), nor one traced hooks reach
        self.declined.append(decline(self, module, args, inner) if self.track else None)
        if forward_hooks(module):  # the module's own forward hooks run in its scope: leave last
            self._leave_last(module)
        return args

    def enter_root(self, module: torch.nn.Module) -> None:
        """Take `module` as the root (its tree matched once per root: `patterns.match_tree`)."""
        if id(module) not in self.roots:
            self.held.append(module)
            self.roots[id(module)] = tree = match_tree(module, self.patterns, self.policies)
            if self.track:  # eagerly: which patterns match, for the warning on the others
                self.paths.extend(path for path, _ in tree[2])
        self.module_policy, self.root_matched, _ = self.roots[id(module)]

    def _leave_last(self, module: torch.nn.Module) -> None:
        """torch runs global forward hooks (famp's) before a module's own: leave the scope of a
        matched module with forward hooks from one of its own, run after theirs, as a nested
        `famp.autocast` call of the module would (its output cast then casts the hooks' output).
        """
        if torch.compiler.is_compiling():  # no handle while tracing: a copy of them, famp's last
            leave_last(self, module)
            return
        thread, depth = threading.get_ident(), len(self.scopes)

        def leave(left: torch.nn.Module, args: tuple[Any, ...], kwargs: Any, output: Any) -> Any:
            if threading.get_ident() != thread:
                return None
            if ended := all(r is not self for r in calls()):  # a KeyboardInterrupt left it
                handle.remove()
            if ended or len(self.scopes) != depth:  # not yet: a call of itself inside, ending
                return None
            handle.remove()
            self.late.pop()
            return self.exit_module(left, output, True, kwargs)

        self.late.append(module)
        handle = module.register_forward_hook(leave, always_call=True, with_kwargs=True)

    def exit_module(
        self, module: torch.nn.Module, output: Any, last: bool = False, kwargs: Any = None
    ) -> Any:
        if is_compiled_module(module) or (not last and self.late and self.late[-1] is module):
            return None  # a wrapper, or a module left from its own last hook
        if self.entered and self.entered[-1] is not module and torch.compiler.is_compiling():
            unwind(self, module)  # modules entered inside it that raised (caught): no hook left
        if not self.entered or self.entered[-1] is not module:
            return None  # not entered: a global pre-hook before famp's raised (caught outside)
        del self.entered[-1]
        if eager := self.track and not torch.compiler.is_compiling():
            observe(self, output)
        del self.scopes[-1:]  # this module's entry
        if not self.scopes and self.root_hooks:  # the root's exit
            keywords.remove(self.root_hooks)
            self.root_hooks = []
        declined = self.declined.pop() if self.declined else None
        if declined is not None:
            declined.close()  # entered after torch's state was set (enter_module): left first
        if self.restores and self.restores[-1][0] == len(self.scopes) + 1:
            swap_state(self.device_type, self.restores.pop()[1])
        policy = self.module_policy.get(id(module))
        if policy is None:
            return None
        check_inputs(self, module, len(self.entered) + 1)  # eagerly: a write into a cast input
        if eager and kwargs:  # keyword inputs no hook of famp's may have reached (keywords.py)
            warn_uncast_keywords(self, module, kwargs, policy.compute_dtype)
        outer = self.scopes[-1] if self.scopes else None
        self._switch(outer or self.base)
        return own_cast(policy.cast_to_output, output)

    def finish(self) -> None:
        """After an eager call: warn (once per transform) about module rules that matched no
        module path, and about fast-path modules switched to eval mode during the call. After a
        traced one: leave the modules that raised (`raised.end_traced`)."""
        if not self.track:
            end_traced(self)
            return
        warned, patterns = self.transform.warned, self.patterns
        if patterns and "unmatched" not in warned and warn_unmatched(patterns, self.paths):
            warned.add("unmatched")
        if self.trained:
            switched(self, self.trained)

    def _switch(self, after: tuple[bool, torch.dtype]) -> None:
        # torch's cast cache ignores the dtype: a scope computing in another lower dtype than the
        # casts' (bfloat16, float32, float16; not bfloat16, float32, bfloat16) is a switch.
        if self.track and after[0] and after[1] is not self.seen_dtype:
            dtype_switched(calls(), pushed=True)
            self.seen_dtype = after[1]

    # One op call (from FampMode, when there are overrides or module rules).

    def run_op(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        track: bool,
    ) -> Any:
        """One op call by its rule; `track`: this call tracks and nothing is being compiled."""
        # Eagerly, most op calls: torch's kernels do it all (outside module rules' scopes).
        scope = self.scopes[-1] if self.scopes else None
        if (
            scope is None
            and self.plain_ops is not None
            and track
            and (kind := plain(func, self.overrides, self.device_type, self.plain_ops))
        ):
            return run_plain(self, func, args, kwargs, kind)
        dev = self.device_type
        state = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        if state != self.base:
            scope = None  # the function entered its own torch.autocast: it governs its body
        enabled, lower = scope or state
        packet, overload = op_name(func, memo=track)  # `track` is False while compiling
        # In a compiled region an eager call reaches (`track` False) casts are explicit: no watch.
        if track:
            self.casts.watch_call(func, packet, args, kwargs, lower if enabled else None)
        inplace = inplace_target(func, args, kwargs)  # an in-place op: no rule (torch casts none)
        rule = None
        if self.overrides is not None and enabled and inplace is None:
            rule = self.overrides.rule(func, packet, overload, args, kwargs)
        out = AS_TORCH  # also apply_rule's answer for a result that viewed a cast input
        if rule is not None:
            out = apply_rule(
                rule, func, packet, args, kwargs, dev, lower, self.casts.cache, self._off
            )
        if out is AS_TORCH and scope is not None:
            with region(dev, *scope):
                out = call(func, args, kwargs)
        elif out is AS_TORCH:
            out = call(func, args, kwargs)
        if track and (inplace is not None or writes_first_arg(packet, kwargs)):
            wrote(self, written(args, kwargs) if inplace is None else inplace)
        return out

    def _off(self) -> Any:
        return region(self.device_type, False, torch.get_autocast_dtype(self.device_type))
