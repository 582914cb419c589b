"""The global module forward hooks through which famp.autocast sees modules being entered and left.

A pre-hook is present while a call with module rules runs, or one that intercepts ops and may
enter a module famp's interception does not reach inside (`unreached.py`): module rules enter
their scopes there, and such modules run as `unreached.decline` says
(`CallRecord.enter_module`). A forward hook, which module rules need to leave their scopes, is
present only while a call with module rules runs: any global hook sends every module call through
torch's slower hook path, and each one costs it more. All are registered with torch's public
functions, but the second pre-hook (keyword inputs: `keywords_hook`), set at a key that stays
from call to call (`famp._compat.keywords_pre_hook`), which a compiled graph may read. Dynamo
cannot trace the creation of their handles: while tracing they go through famp._compat (their
additions and removals cancel out in a graph). A compiled call of a module
with module rules needs none: its matched modules get hooks of their own (`tree_hooks.py`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle

from famp._autocast.keywords import cast_keywords
from famp._autocast.recompute import calls, drop_abandoned_replays, in_block
from famp._compat import (
    keywords_pre_hook,
    pre_hooks,
    remove_global_forward_hook,
    traced_module_hooks,
)

_users = {"pre": 0, "post": 0, "traced": 0}  # calls running that need each hook (all threads)
_HOOK_LOCK = threading.Lock()
_handles: dict[str, RemovableHandle] = {}
_keys: dict[str, int] = {}  # "keywords": `keywords_hook`'s key while set (the same each call)
# Who asked `keywords_hook` for a module's keyword inputs (`ask_keywords`): how many asks each
# module's key stands for, all threads (under `_HOOK_LOCK`), and this thread's own asks. A thread
# takes only its own asks back, and the key goes when none is left: another thread in a call of
# the same module keeps it (it took the key away from that thread's asks before 2026-12-01).
_asked: dict[int, int] = {}
_own = threading.local()


def pre_hook(module: torch.nn.Module, args: tuple[Any, ...]) -> Any:
    drop_abandoned_replays()  # a backward raised in one: its calls are over, modules outside
    stack = calls()
    if stack and (record := stack[-1]).hooked and (not record.recompute_only or in_block()):
        return record.enter_module(module, args)
    return None


def keywords_hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: Any = None) -> Any:
    """The second global pre-hook: torch calls it with the keyword inputs of a module `pre_hook`
    has just asked them for (`ask_keywords`); then famp judges whether torch takes a fast-path
    module's fast path (`unreached.judge`), and casts a matched module's keyword inputs
    (`keywords.cast_keywords`). Another thread's call of the module (famp's call not in it)
    leaves the key to the call that asked."""
    if kwargs is None or not _answered(module):
        return None
    stack = calls()
    if not (stack and (record := stack[-1]).hooked and (not record.recompute_only or in_block())):
        return None
    from famp._autocast.unreached import FAST_PATH_MODULES, judge  # unreached imports hooks

    if isinstance(module, FAST_PATH_MODULES):
        judge(record, module, args, kwargs)
    return cast_keywords(module, args, kwargs)


def ask_keywords(module: torch.nn.Module) -> None:
    """From `pre_hook` (a matched or fast-path module): have torch call `keywords_hook`, which
    runs next, with `module`'s keyword inputs. torch tests at each global pre-hook whether the
    module's own (private) dict of pre-hooks called with keyword inputs holds its key; the key is
    out again as it runs, so a copy of the module made later (`copy.deepcopy`) has none. The
    dict is no hook: `nn.TransformerEncoderLayer`'s fast path, off where a module of its tree
    has a hook, stays on."""
    key = _keys.get("keywords")
    if key is not None and torch.compiler.is_compiling():  # traced: no lock (one thread)
        pre_hooks(module)[1][key] = True
    elif key is not None:
        own = _own.__dict__.setdefault("asked", {})
        own[id(module)] = own.get(id(module), 0) + 1
        with _HOOK_LOCK:
            _asked[id(module)] = _asked.get(id(module), 0) + 1
            pre_hooks(module)[1][key] = True


def _answered(module: torch.nn.Module) -> bool:
    """Whether this thread asked for `module`'s keyword inputs: its asks taken back, and the
    module's key with them if no other thread's ask is left."""
    if torch.compiler.is_compiling():
        return pre_hooks(module)[1].pop(_keys["keywords"], None) is not None
    mine: int = _own.__dict__.get("asked", {}).pop(id(module), 0)
    if mine:
        with _HOOK_LOCK:
            left = _asked.pop(id(module)) - mine
            if left:
                _asked[id(module)] = left
            else:
                pre_hooks(module)[1].pop(_keys["keywords"], None)
    return mine > 0


def post_hook(module: torch.nn.Module, args: tuple[Any, ...], *rest: Any) -> Any:
    """Registered with its keyword inputs: (module, args, kwargs, output); torch calls it with
    (module, args, output) after a forward that raised, and while Dynamo traces (`_count`)."""
    drop_abandoned_replays()  # a backward raised in one, caught inside the module now ending
    stack = calls()
    record = stack[-1] if stack else None
    if (
        record is not None
        and record.hooked
        and record.patterns
        and (not record.recompute_only or in_block())
    ):
        return record.exit_module(module, rest[-1], kwargs=rest[0] if len(rest) == 2 else None)
    return None


def on_exit(module: torch.nn.Module, leave: Callable[[], object]) -> Any:
    """Call `leave` once, when the call of `module` now starting ends (also by an exception);
    the hook's handle.

    A global forward hook that removes itself: a hook of the module's own would turn torch's
    fast path of `nn.TransformerEncoderLayer` off (torch 2.14 on) where it is set to be kept.
    Only this thread's call of the module ends it (another thread may call the same module).
    """
    thread = threading.get_ident()

    def hook(left: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if left is module and threading.get_ident() == thread:
            handle.remove()
            leave()

    handle = register_module_forward_hook(hook, always_call=True)
    return handle


def _count(change: int, post: bool, eager: bool) -> None:
    if torch.compiler.is_compiling() and not eager:  # only module rules are hooked while tracing
        _users["traced"] += change
        if change > 0 and _users["traced"] == 1:  # those an eager call has not registered
            traced_module_hooks(
                None if "pre" in _handles else pre_hook, None if "post" in _handles else post_hook
            )
        elif change < 0 and _users["traced"] == 0:
            traced_module_hooks(None, None)
        return
    for kind, needed in (("pre", True), ("post", post)):
        if not needed:
            continue
        _users[kind] += change
        if change > 0 and _users[kind] == 1:
            _handles[kind] = (
                register_module_forward_pre_hook(pre_hook)
                if kind == "pre"
                else register_module_forward_hook(post_hook, always_call=True, with_kwargs=True)
            )
            if kind == "pre":  # right after it, so that torch calls it next
                _keys["keywords"] = keywords_pre_hook(keywords_hook)  # after `pre_hook`
        elif change < 0 and _users[kind] == 0:
            remove_global_forward_hook(_handles.pop(kind))  # the post-hook's: with kwargs
            if kind == "pre":
                keywords_pre_hook(None)
                del _keys["keywords"]


def use(change: int, post: bool, eager: bool = False) -> None:
    """Count a call that needs the hooks in (+1) or out (-1): the first registers them, the last
    removes them. `post`: the call needs the forward hook too (it has module rules). `eager`:
    for a replay left as a trace starts (`torch.compiler.is_compiling()` holds there too)."""
    if torch.compiler.is_compiling() and not eager:  # traced: net nothing in a graph
        _count(change, post, eager)
    else:
        with _HOOK_LOCK:
            _count(change, post, eager)
