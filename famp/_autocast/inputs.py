"""The inputs of a module a rule matches, and of a nested `famp.autocast` call: cast with the
policy's `cast_to_compute` (`cast_inputs`), and, eagerly, checked where the module or the call
ends (`check_inputs`).

A tensor the cast changes is a copy, and so is a list or dict rebuilt around one: a write the
module makes into it (a KV cache written in place, appended to, or set in a dict) would stay in
famp's copy, the caller's tensor (list, dict) never seeing it, and the next step would read a
stale cache, silently (0.59 off in three decode steps of a float16 rule). The module raises
`ValueError` at its exit instead, naming it and the input. Not for a copy famp widened (bfloat16
to float32): a module's own `.float()` of it returns the copy itself where torch would have
copied the caller's tensor, and a write after that (`scores.float().masked_fill_(...)`) is the
module's own. Nor for the call's own tuple of arguments and dict of keyword arguments, which no
caller holds (a module's pre-hook may edit them). A module whose `inplace` flag is set says it
writes into its input: its inputs are not cast (as `nn.ReLU(inplace=True)`'s), and the ops
inside still compute under the rule. Containers with nothing to cast are the caller's own
objects (`tree_casts.cast_tree`), so a float32 scope keeps every write. Compiled (Dynamo
tracing), famp casts without the check.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from famp._autocast.mode import own_cast
from famp._autocast.patterns import module_path
from famp._autocast.policy import Policy
from famp._autocast.tree_casts import Made, cast_tree
from famp._compat import no_torch_function, storage_identity, tensor_version

ROOT_KEYWORDS = -1  # `check_inputs`' depth of a root's keyword inputs, cast as its call begins
# Keys of `record.made` beside the depths: the storages of casts made under inference mode, and
# those of them an op wrote into.
_INFERENCE, _WRITTEN = -2, -3


def cast_inputs(
    record: Any, module: torch.nn.Module | None, policy: Policy, tree: Any, depth: int, fresh: bool
) -> Any:
    """`tree` (inputs of `module`, a matched module entered at `depth` in `record.entered`, or of
    the nested call `record` if None) cast to the compute dtype; eagerly, what the cast made is
    kept for `check_inputs` at that depth (`fresh`: it starts the depth's list)."""
    if module is not None and module.__dict__.get("inplace") is True:
        record.made.pop(depth, None)
        return tree  # it writes into its input: uncast, as torch (the docs' definition)
    if not record.track or torch.compiler.is_compiling():
        return own_cast(policy.cast_to_compute, tree)
    made: Made = []
    if fresh or depth not in record.made:
        record.made[depth] = made
    else:
        made = record.made[depth]
    start = len(made)
    out = own_cast(partial(cast_tree, dtype=policy.compute_dtype, made=made), tree)
    if len(made) == start:
        return out  # nothing cast (a float32 scope over float32 inputs): nothing to check
    kept = made[:start]
    with no_torch_function():  # famp's mode would see each read
        for cast, before, source in made[start:]:
            if source is None:  # a list or dict: not the call's own (args, kwargs), no caller's
                if cast is not out:
                    kept.append((cast, before, source))
            elif cast.element_size() > source.itemsize:
                continue  # widened: the module's own `.float()` of it returns it (see above)
            elif cast.is_inference():  # no version counter: famp's mode notes writes (`wrote`)
                storage = storage_identity(cast)
                record.made.setdefault(_INFERENCE, set()).add(storage)
                record.made.get(_WRITTEN, set()).discard(storage)  # a freed one's, before
                kept.append((cast, _INFERENCE, source))
            else:
                kept.append((cast, tensor_version(cast), source))
    made[:] = kept
    return out


def wrote(record: Any, target: Any) -> None:
    """After an op famp's mode saw wrote into `target` (a tensor, or a list or tuple of them):
    the weight watch's `invalidate`, and a write into an input's cast made under
    `torch.inference_mode` (no version counter) is noted for `check_inputs`."""
    record.casts.invalidate(target)
    storages = record.made.get(_INFERENCE)
    if storages:
        for t in target if isinstance(target, (list, tuple)) else (target,):
            if isinstance(t, torch.Tensor) and storage_identity(t) in storages:
                record.made.setdefault(_WRITTEN, set()).add(storage_identity(t))


def check_inputs(record: Any, module: Any, depth: int) -> None:
    """Raise `ValueError` if `module` (None: the nested call `record`) wrote into a cast that
    `cast_inputs` made of its inputs at `depth`, or changed a list or dict rebuilt around one.
    A root's (`depth` 1) keyword inputs, cast as its call began, are checked with it."""
    made = record.made.pop(depth, None) or []
    if depth == 1 and ROOT_KEYWORDS in record.made:
        made += record.made.pop(ROOT_KEYWORDS)
    if not made:
        return
    with no_torch_function():  # famp's mode would see each read
        changed = [
            (obj, source) for obj, before, source in made if _changed(record, obj, before, source)
        ]
    for obj, source in changed:
        if source is not None:
            what = f"a {source} tensor of shape {tuple(obj.shape)}, cast to {obj.dtype}"
        else:
            what = f"a {type(obj).__name__} holding a tensor famp cast (famp's copy of it)"
        if module is None:
            name = getattr(record.transform.fn, "__name__", "a function")
            where = f"the nested famp.autocast call of {name!r}"
            fix = (
                "pass such state in an object of a class of your own that is not a registered "
                "pytree node, which famp does not look into"
            )
        else:
            where = module_path(record.held, module)
            fix = (
                "set the module's `inplace = True` (famp then leaves its inputs uncast; the ops "
                "inside still compute under the rule), or hold such state as a buffer of the "
                "module or in an object of a class of your own that is not a registered pytree "
                "node, which famp does not look into"
            )
        raise ValueError(
            f"famp.autocast: {where} wrote into one of its inputs that famp had cast to its "
            f"compute dtype: {what}. The write went into famp's copy, and the caller's would "
            f"never see it (a stale cache, silently); {fix}."
        )


def _changed(record: Any, obj: Any, before: Any, source: torch.dtype | None) -> bool:
    if source is None:  # a list or dict famp rebuilt
        return not _same(obj, before)
    if before == _INFERENCE:  # its storage leaves the sets: a later tensor may take it
        storage = storage_identity(obj)
        record.made[_INFERENCE].discard(storage)
        written = storage in record.made.get(_WRITTEN, ())
        record.made.get(_WRITTEN, set()).discard(storage)
        return written
    return bool(tensor_version(obj) != before)


def _same(container: Any, before: list[Any]) -> bool:
    items = list(container.items()) if isinstance(container, dict) else container
    if len(items) != len(before):
        return False
    if isinstance(container, dict):
        return all(k is j and v is w for (k, v), (j, w) in zip(items, before, strict=True))
    return all(v is w for v, w in zip(items, before, strict=True))
