"""Entering an autocast state for a region, as `torch.autocast` does, with famp's cache rules."""

from __future__ import annotations

from typing import Any

import torch

from famp._autocast.policy import Policy
from famp._autocast.recompute import calls
from famp._autocast.threads import computes_in, done
from famp._autocast.weights import dtype_switched, emptied, ends_in, forget_casts, unwatched

# --- autocast regions -----------------------------------------------------------------------------

_LOWER = (torch.float16, torch.bfloat16)


def policy_state(policy: Policy) -> tuple[bool, torch.dtype]:
    """(enabled, dtype) of the autocast state a policy computes in.

    torch.autocast accepts only float16 and bfloat16 and turns itself off (with a warning) for
    other dtypes; a float32 or float64 compute dtype therefore means autocast off.
    """
    return policy.compute_dtype in _LOWER, policy.compute_dtype


class _EagerRegion:
    """`torch.autocast.__enter__/__exit__` without its device checks, and with famp's cache rules.

    It also works for device types whose hardware is absent (fake CUDA tensors on a CPU machine,
    as in famp's tests), where `torch.autocast` warns and turns itself off. A call's region
    (`call=True`) is a dtype switch on entry and exit (`weights.dtype_switched`) when the dtype
    in effect before it (`outer`, famp's view of it inside a module rule's scope, else torch's)
    is another one, on or off: `torch.autocast(enabled=False)` keeps the dtype whose casts the
    cache holds. It turns the cache off while another thread computes in another dtype.
    """

    __slots__ = (
        "call",
        "device_type",
        "dtype",
        "enabled",
        "entry",
        "opened",
        "outer",
        "prev",
        "prev_cache",
        "rules",
        "switched",
    )

    def __init__(
        self,
        device_type: str,
        enabled: bool,
        dtype: torch.dtype,
        call: bool,
        outer: tuple[bool, torch.dtype] | None,
        rules: frozenset[torch.dtype],
        opened: list[Any],
    ) -> None:
        self.device_type, self.enabled, self.dtype, self.call = device_type, enabled, dtype, call
        self.outer, self.rules, self.opened = outer, rules, opened
        self.switched = False
        self.prev: tuple[bool, torch.dtype] = (False, dtype)
        self.prev_cache = True
        self.entry: list[Any] | None = None

    def __enter__(self) -> None:
        dev = self.device_type
        self.prev = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        self.prev_cache = torch.is_autocast_cache_enabled()
        if self.call and self.enabled:
            self.switched = (self.outer or self.prev)[1] != self.dtype
        if self.call:  # another thread's casts in another dtype: the cache off (threads.py)
            self.entry = computes_in(dev, self.rules | {self.dtype} if self.enabled else self.rules)
        torch.set_autocast_enabled(dev, self.enabled)
        if self.enabled or not self.call:  # a call computing in float32 keeps the dtype in effect,
            torch.set_autocast_dtype(dev, self.dtype)  # as torch.autocast(enabled=False) does
        nesting = torch.autocast_increment_nesting()
        if self.call and nesting == 1:
            emptied()  # torch empties its cache as the outermost autocast state ends
        elif self.call and len(calls()) == 1:
            unwatched()  # the outermost call, in a torch.autocast: casts famp did not see
        if self.switched:
            dtype_switched(calls(), pushed=False)

    def __exit__(self, *exc: object) -> None:
        for opened in reversed(self.opened):  # left open by a KeyboardInterrupt, else no-ops
            opened.close()
        nesting = torch.autocast_decrement_nesting()
        if nesting == 0:
            forget_casts()
        elif self.switched:
            dtype_switched(calls(), pushed=False)
        if self.call and nesting and len(calls()) == 1:  # it ends in the user's torch.autocast
            ends_in(self.prev[1])
        torch.set_autocast_enabled(self.device_type, self.prev[0])
        torch.set_autocast_dtype(self.device_type, self.prev[1])
        torch.set_autocast_cache_enabled(self.prev_cache)
        done(self.entry)


def region(
    device_type: str,
    enabled: bool,
    dtype: torch.dtype,
    call: bool = False,
    outer: tuple[bool, torch.dtype] | None = None,
    rules: frozenset[torch.dtype] = frozenset(),
    opened: list[Any] | None = None,
) -> Any:
    """A context manager that sets the device's autocast state for its body; `outer`: the
    state in effect before a call's region where famp's module scope sets it, not torch;
    `rules`: the lower dtypes a call's module rules compute in; `opened`: the contexts famp
    opened inside a call's region (`CallRecord.opened`), closed before it at the latest."""
    if torch.compiler.is_compiling():
        # Dynamo records torch.autocast as graph nodes; the cache is off while tracing anyway.
        return torch.autocast(device_type, dtype=dtype, enabled=enabled)
    return _EagerRegion(
        device_type, enabled, dtype, call, outer, rules, [] if opened is None else opened
    )


def swap_state(device_type: str, state: tuple[bool, torch.dtype]) -> tuple[bool, torch.dtype]:
    """Set the device's autocast (enabled, dtype) to `state`; return the state before."""
    before = torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    torch.set_autocast_enabled(device_type, state[0])
    torch.set_autocast_dtype(device_type, state[1])
    return before


def enter_state(device_type: str, state: tuple[bool, torch.dtype]) -> tuple[bool, torch.dtype]:
    """`swap_state`, but a disabled `state` keeps the dtype in effect, as
    `torch.autocast(enabled=False)` does (its casts stay in torch's cache for after it)."""
    if state[0]:
        return swap_state(device_type, state)
    return swap_state(device_type, (False, torch.get_autocast_dtype(device_type)))


def current_state(device_type: str) -> tuple[bool, torch.dtype]:
    """(enabled, dtype) of autocast for the device here, famp's module rules included.

    Inside a module that a famp module rule matches, eagerly torch's own state is the module's;
    compiled, famp sets it around each op only, and torch's state between ops is the
    transform's: this reports the module's.
    """
    state = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
    stack = calls()
    if stack:
        record = stack[-1]  # famp._autocast.call.CallRecord
        scope: tuple[bool, torch.dtype] | None = record.scopes[-1] if record.scopes else None
        if scope is not None and record.device_type == device_type and state == record.base:
            return scope
    return state
