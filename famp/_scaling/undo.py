"""A non-fused optimizer's step, undone where it was skipped, without reading `skip` on the host.

`step_and_undo_if` copies what `optimizer.step()` may change (`reach.py`), steps, and selects the
copies back with `torch.where(skip, before, after)`, in place: the parameters (for an optimizer
torch does not ship, also those without a `.grad`), their `.grad` (some steps write into it),
every tensor of `optimizer.state` and of each param group but `'params'` (timm's Lamb counts
there), also inside lists, tuples and dicts (SOAP's per-parameter statistics). Every such
tensor is selected back, written or not: version counters miss writes (foreach ops on DTensors, a
write through `.data`), and inference tensors keep none. What a choice cannot restore (state
created on a first step, Python numbers such as `SparseAdam`'s count, keys added, lists grown,
sparse tensors written in place, a `.grad` the step replaced or freed) is restored after one host
read of `skip`, on the steps that changed it only.

State outside the parameters' entries is undone alike: `optimizer.state` keys that are no
parameter (MADGRAD's `state['k']`), the optimizer's own attributes (torch's own are left as the
step set them), and the random generators (torch's default ones, the CPU's and the parameters'
devices', and the attributes'), put back whichever thread drew from them during the step.
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from famp import _compat
from famp._scaling import reach
from famp._scaling.trees import to_device
from famp._typing import Tensor

# Python values that compare by value: a new but equal one is no change.
_PLAIN = (bool, int, float, complex, str)
_NONE: frozenset[int] = frozenset()

# Dicts flatten in insertion order in famp's optree namespace: keys need not sort (ZeRO's keyed by
# parameters). Set for good (held: collected, the context would set it back) for every thread.
_NAMESPACE = "famp.undo"
_INSERTION_ORDERED = optree.dict_insertion_ordered(True, namespace=_NAMESPACE)
_INSERTION_ORDERED.__enter__()


def _tensor_like(new: object, old: object) -> bool:
    return (
        isinstance(new, torch.Tensor)
        and isinstance(old, torch.Tensor)
        and new.shape == old.shape
        and new.dtype == old.dtype
        and new.device == old.device
        and new.layout == torch.strided
    )


def _same(new: object, old: object) -> bool:
    """Whether a value is unchanged, without comparing tensors (a host read)."""
    return new is old or (type(new) is type(old) and type(new) in _PLAIN and new == old)


def _flat(entries: dict[Any, Any]) -> tuple[list[Any], Any]:
    """A dict's values as leaves, inside lists, tuples and dicts too (SOAP's `state['GG']`), and
    its structure: the keys alone where no value is a container (torch's optimizers' states)."""
    values = list(entries.values())
    for v in values:  # not any(...): this runs for every parameter's state at every step
        if isinstance(v, (list, tuple, dict)):
            return optree.tree_flatten(entries, none_is_leaf=True, namespace=_NAMESPACE)  # type: ignore[arg-type]
    return values, tuple(entries)


def _generator_state(generator: torch.Generator) -> Tensor:
    """A generator's state, as 8-byte words where it can (compared 4x faster than bytes)."""
    state = generator.get_state()
    return state.view(torch.int64) if state.numel() % 8 == 0 else state


def _same_structure(spec: Any, old: Any) -> bool:
    try:
        return bool(spec == old)
    except RuntimeError:  # dict keys that are tensors, other than before: compared elementwise
        return False


def _unflat(spec: Any, leaves: list[Any]) -> dict[Any, Any]:
    if isinstance(spec, tuple):
        return dict(zip(spec, leaves, strict=True))
    return optree.tree_unflatten(spec, leaves)  # type: ignore[return-value]


class _Entries:
    """A dict's entries (an optimizer state, or a param group but its `'params'`) as they were:
    its tensors, also inside lists, tuples and dicts, copied (under `torch.no_grad()`); its other
    values kept. A restore puts the same objects back with their old values: a scheduler or a user
    may hold a group's tensor (a tensor `lr`), and a list appended in place is rebuilt as it was."""

    def __init__(
        self,
        entries: dict[Any, Any],
        tensors_at_once: bool = False,
        held: frozenset[int] = _NONE,
        generators: bool = False,
    ) -> None:
        """`held`: ids of tensors the undo restores itself (parameters, grads), not copied here;
        `generators`: random generators among the values kept by their state too (draws)."""
        self.leaves, self.spec = _flat(entries)
        leaves = enumerate(self.leaves)
        self.at = [i for i, v in leaves if isinstance(v, torch.Tensor) and id(v) not in held]
        self.generators = [
            (g, _generator_state(g))
            for g in (self.leaves if generators else ())
            if isinstance(g, torch.Generator)
        ]
        self.tensors: list[Tensor] = [self.leaves[i] for i in self.at]
        self.versions = [
            None if t.is_inference() else _compat.tensor_version(t) for t in self.tensors
        ]
        if tensors_at_once and self.tensors:  # one multi-tensor clone (dense, alike)
            self.copies = list(_compat.foreach_clone([t.detach() for t in self.tensors]))
        else:
            self.copies = [t.clone() for t in self.tensors]

    def select(self, entries: dict[Any, Any], on: Any, held: frozenset[int] = _NONE) -> bool:
        """Tensors written in place back where `skip` is true; whether anything else changed.

        A tensor that replaced an entry and is one of `held` (the ids of the parameters and
        grads, which the undo restores itself: `state['prev'] = p.grad`) is not written into:
        that would write into the grad; the entry is put back by the restore instead."""
        leaves, spec = _flat(entries)
        if not _same_structure(spec, self.spec):  # keys added or removed, containers resized
            return True
        if len(self.at) < len(leaves):  # Python values: a new but equal one is no change
            tensors = set(self.at)
            for i, (new, old) in enumerate(zip(leaves, self.leaves, strict=True)):
                if i not in tensors and not _same(new, old):  # held tensors: the same objects
                    return True
        changed = any(not torch.equal(_generator_state(g), state) for g, state in self.generators)
        for i, old, version, copy in zip(
            self.at, self.tensors, self.versions, self.copies, strict=True
        ):
            new = leaves[i]
            if new is not old and id(new) in held:
                changed = True
            elif _tensor_like(new, copy):  # never by version: see the module's docstring
                where = new.detach() if new.requires_grad else new
                torch.where(on(new.device), copy, new, out=where)
            elif new is not old or version is None or _compat.tensor_version(new) != version:
                changed = True  # replaced, or written (that the version saw): not a tensor choice
        return changed

    def restored(self) -> dict[Any, Any]:
        """The entries as they were: the same objects, their old values (tensors put back)."""
        for t, version, copy in zip(self.tensors, self.versions, self.copies, strict=True):
            if _tensor_like(t, copy):
                t.detach().copy_(copy)
            elif t.layout != torch.strided:  # sparse (SGD's momentum, sparse grads): put back
                t.copy_(copy)
            elif version is None or _compat.tensor_version(t) != version:  # reshaped: put back
                t.set_(copy.untyped_storage(), copy.storage_offset(), copy.shape, copy.stride())
        for g, state in self.generators:
            g.set_state(state.view(torch.uint8))
        return _unflat(self.spec, self.leaves)


def _entries(entries: dict[Any, Any], held: frozenset[int], generators: bool) -> _Entries | None:
    return _Entries(entries, held=held, generators=generators) if entries else None


def _changed(old: _Entries | None, entries: dict[Any, Any], on: Any, held: frozenset[int]) -> bool:
    """`old.select(...)`; for entries that were none, whether any appeared."""
    return bool(entries) if old is None else old.select(entries, on, held)


def _restore(old: _Entries | None, now: dict[Any, Any], into: dict[Any, Any]) -> None:
    """Entries `now` of `into` (an optimizer's state, its `vars`) back as `old` holds them."""
    before = {} if old is None else old.restored()
    for k in [k for k in now if k not in before]:
        del into[k]
    into.update(before)


def _group_entries(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def step_and_undo_if(optimizer: torch.optim.Optimizer, skip: Tensor) -> None:
    """`optimizer.step()`, then everything it changed back where `skip` is true."""
    optimizers = reach.wrapped(optimizer)
    params = reach.unique(p for o in optimizers for p in reach.may_write(o))
    all_groups = reach.unique(g for o in optimizers for g in o.param_groups)
    states = reach.unique(o.state for o in optimizers)
    grads = [p.grad for p in params]
    held = frozenset(id(t) for t in (*params, *grads) if t is not None)
    with torch.no_grad():
        groups = [_Entries(_group_entries(g), tensors_at_once=True) for g in all_groups]
        before = [[_Entries(s[p]) if p in s else None for p in params] for s in states]
        unkeyed = [_entries(reach.unkeyed(s), held, generators=False) for s in states]
        attributes = [_entries(reach.attributes(o), held, generators=True) for o in optimizers]
        generators = [(g, _generator_state(g)) for g in reach.default_generators(params)]
        before_params = [p.detach().clone() for p in params]
        # Some write into .grad (foreach SGD with nesterov); a skipped GradScaler step does not.
        before_grads = _Entries(dict(enumerate(grads)))
    optimizer.step()
    skips: dict[torch.device, Tensor] = {}

    def on(device: torch.device) -> Tensor:
        if device not in skips:
            skips[device] = to_device(skip, device, "found_inf")
        return skips[device]

    untensorlike = False  # whether the step changed what a tensor choice cannot restore
    with torch.no_grad():
        for group, old_group in zip(all_groups, groups, strict=True):
            untensorlike |= old_group.select(_group_entries(group), on)
        for s, old_unkeyed in zip(states, unkeyed, strict=True):
            untensorlike |= _changed(old_unkeyed, reach.unkeyed(s), on, held)
        for o, old_attributes in zip(optimizers, attributes, strict=True):
            untensorlike |= _changed(old_attributes, reach.attributes(o), on, held)
        untensorlike |= any(not torch.equal(_generator_state(g), v) for g, v in generators)
        for p, old in zip(params, before_params, strict=True):
            new = p.detach()
            torch.where(on(new.device), old, new, out=new)
        untensorlike |= before_grads.select(dict(enumerate(grads)), on)
        # a .grad the step replaced or freed (`p.grad = None`): put back after a host read
        untensorlike |= any(p.grad is not g for p, g in zip(params, grads, strict=True))
        for s, olds in zip(states, before, strict=True):
            for p, old_state in zip(params, olds, strict=True):
                new_state = s.get(p)
                if new_state is None or old_state is None:  # created, dropped
                    untensorlike |= new_state is not None or old_state is not None
                else:
                    untensorlike |= old_state.select(new_state, on, held)
        if untensorlike and bool(skip):  # the one host sync, on a step that created state
            before_grads.restored()  # a sparse one written in place
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            for group, old_group in zip(all_groups, groups, strict=True):
                entries = old_group.restored()
                for k in [k for k in group if k != "params" and k not in entries]:
                    del group[k]
                group.update(entries)
            for s, olds in zip(states, before, strict=True):
                for p, old_state in zip(params, olds, strict=True):
                    if old_state is None:
                        s.pop(p, None)
                    else:
                        s[p] = old_state.restored()
            for s, old_unkeyed in zip(states, unkeyed, strict=True):
                _restore(old_unkeyed, reach.unkeyed(s), s)
            for o, old_attributes in zip(optimizers, attributes, strict=True):
                _restore(old_attributes, reach.attributes(o), vars(o))
            for g, v in generators:
                g.set_state(v.view(torch.uint8))
