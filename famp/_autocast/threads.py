"""The lower dtypes each thread computes in, for torch's weight-cast cache, one map for all threads.

torch keys that cache without the dtype, and famp may keep a thread's casts in it past a switch to
another lower dtype (weights.py). So each thread running an eager `famp.autocast` call, or a
recomputation of one in backward, has an entry per device type here: every lower dtype it has
computed in since its outermost one began (the call's own, its module rules', a nested call's, the
function's own `torch.autocast` where famp's mode sees it, a recomputation's). Whatever starts
computing while another thread's entry on the same device type holds another dtype turns the cache
off on its thread (`torch.set_autocast_cache_enabled`, a thread-local flag), so that it neither
reads the other thread's casts nor leaves its own for it.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

_ENTRIES: list[list[Any]] = []  # [thread id, device type, set of lower dtypes]
_LOCK = threading.Lock()


def computes_in(device_type: str, dtypes: frozenset[torch.dtype]) -> list[Any] | None:
    """This thread computes in `dtypes` on `device_type` from now on: add them to its entry, and
    turn torch's cache off on this thread if another thread's entry there holds another dtype.
    The entry made, where the thread had none (take it back with `done`), else None."""
    me = threading.get_ident()
    with _LOCK:
        own = None
        for entry in _ENTRIES:
            if entry[1] != device_type:
                continue
            if entry[0] == me:
                own = entry
            elif dtypes and entry[2] and len(entry[2] | dtypes) > 1:
                torch.set_autocast_cache_enabled(False)
        if own is not None:
            own[2] |= dtypes
            return None
        made = [me, device_type, set(dtypes)]
        _ENTRIES.append(made)
        return made


def crowded(device_type: str) -> bool:
    """Whether another thread computes on `device_type` in a dtype this thread's entry lacks, or
    lacks one of its own: casts this thread keeps past a switch may meet it there (a
    recomputation runs with the cache on as the checkpoint's forward ran, whatever this module
    set)."""
    me = threading.get_ident()
    with _LOCK:
        mine: set[torch.dtype] = next(
            (e[2] for e in _ENTRIES if e[0] == me and e[1] == device_type), set()
        )
        return any(
            e[0] != me and e[1] == device_type and e[2] and len(e[2] | mine) > 1 for e in _ENTRIES
        )


def done(entry: list[Any] | None) -> None:
    """The outermost call or recomputation that made `entry` ends."""
    if entry is None:
        return
    with _LOCK:
        for i, other in enumerate(_ENTRIES):
            if other is entry:
                del _ENTRIES[i]
                return


def recomputes(records: list[Any]) -> tuple[bool, list[Any]]:
    """A recomputation of the calls of `records` (`CallRecord`s) starts on this thread, in their
    own lower dtypes and their rules': what `recomputed` takes when it ends."""
    cache = torch.is_autocast_cache_enabled()
    entries = []
    for record in records:
        dtypes: frozenset[torch.dtype] = record.transform.rule_dtypes
        if record.base[0]:
            dtypes |= {record.base[1]}
        entries.append(computes_in(record.device_type, dtypes))
    return cache, entries


def recomputed(state: tuple[bool, list[Any]]) -> None:
    """The recomputation `recomputes` gave `state` ends: its entries go, the cache as before."""
    cache, entries = state
    torch.set_autocast_cache_enabled(cache)
    for entry in entries:
        done(entry)
