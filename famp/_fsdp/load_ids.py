"""Which optimizer parameter (id) each name of an FQN-keyed state is (`optim_state_dict_to_load`).

Torch matches by name: DCP's `set_optimizer_state_dict` rebuilds the state's `param_groups` in
the optimizer's order from the model's names (`_split_optim_state_dict`), and FSDP1's
`optim_state_dict_to_load` rekeys every name to the id of the parameter that has it
(`_rekey_sharded_optim_state_dict`). An optimizer alone names nothing, so famp matches names to
parameters through `model=`, by identity as torch does. Without the model, ids follow the order
of `osd`'s groups and only the shapes can be checked; where two parameters of one group have the
same shape, their order cannot be verified and famp refuses rather than risk swapping their state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from famp._collectives import is_dtensor
from famp._fsdp.layout import FSDP1Layout, FSDP2Layout, Shape, flat_slice, flat_units, specs
from famp._fsdp.live import check_fsdp2_param, flat_param_names
from famp._fsdp.rekey import optimizer_params, param_names

Entry = tuple[str, list[str], list[Shape]]  # a label, the names it covers, its possible shapes


def _entries(names: Sequence[str], layout: FSDP1Layout | FSDP2Layout, rank: int) -> list[Entry]:
    """Per optimizer parameter of one group: a label, the names it covers, its possible shapes."""
    if isinstance(layout, FSDP2Layout):  # local chunks (DTensors are checked whole, see below)
        return [(repr(f), [f], [layout.local_shape(f, rank)]) for f in names]
    entries: list[Entry] = []
    if layout.use_orig_params and layout.world_size == 1:  # NO_SHARD: original shapes
        return [(repr(f), [f], [specs(layout)[f][0]]) for f in names]
    if not layout.use_orig_params:  # one flat parameter per unit
        for unit in dict.fromkeys(flat_slice(layout, f).unit for f in names):
            fqns = [s.fqn for s in flat_units(layout)[unit][0]]
            entries.append((f"FSDP unit {unit}", fqns, [(layout.flat_numel(unit),)]))
        return entries
    for fqn in names:
        start, end = layout.param_slice(fqn, rank)
        entries.append((repr(fqn), [fqn], [(end - start,)]))
    return entries


def _signature(entry: Entry, layout: FSDP1Layout | FSDP2Layout) -> object:
    """What the optimizer's parameter shows of `entry`; None where a swap would change nothing."""
    fqn, shape = entry[1][0], entry[2][0]
    if isinstance(layout, FSDP2Layout):  # a DTensor shows its global shape and shard dim
        full, dim = specs(layout)[fqn]
        return f"global shape {full}, Shard({dim})"
    if layout.use_orig_params and layout.world_size > 1 and shape == (0,):
        return None  # no element on this rank: FSDP1 keeps no state for it
    return f"shape {shape}"


def _refuse_unverifiable(entries: list[Entry], g: int, layout: Any, rank: int) -> None:
    seen: dict[object, str] = {}
    for entry in entries:
        sig = _signature(entry, layout)
        if sig is not None and sig in seen:
            raise ValueError(
                f"osd['param_groups'][{g}] lists {seen[sig]} and {entry[0]}, which look the same "
                f"to the optimizer on rank {rank} ({sig}): famp cannot tell from the optimizer "
                "alone which is which (torch matches them by name); pass model= to match them "
                "by name"
            )
        seen[sig] = entry[0]


def _by_name(
    entries: list[list[Entry]], opt: list[list[torch.Tensor]], names: dict[Any, list[str]]
) -> list[list[Entry]]:
    """`entries` of every group reordered as the optimizer's group lists the named parameters."""
    where = {
        n: (g, i) for g, ps in enumerate(opt) for i, p in enumerate(ps) for n in names.get(p, ())
    }
    ordered: list[list[Entry]] = []
    for g, group in enumerate(entries):
        slots: list[Entry | None] = [None] * len(opt[g])
        for entry in group:
            found = where.get(entry[1][0])
            if found is None or found[0] != g:
                has = "no parameter of that name" if found is None else f"it in group {found[0]}"
                raise ValueError(
                    f"osd['param_groups'][{g}] lists {entry[0]}, but the optimizer has {has} "
                    "(matched by name through model)"
                )
            slots[found[1]] = entry
        missing = [i for i, e in enumerate(slots) if e is None]
        if missing:
            labels = [names.get(opt[g][i], ["a parameter not in model"])[0] for i in missing]
            raise ValueError(
                f"the optimizer's param group {g} holds {labels}, which "
                f"osd['param_groups'][{g}] does not list"
            )
        ordered.append([e for e in slots if e is not None])
    return ordered


def optimizer_ids(
    groups: Sequence[Any],
    layout: FSDP1Layout | FSDP2Layout,
    rank: int,
    optimizer: object,
    model: object,
) -> tuple[dict[str, int], list[list[int]], list[torch.Tensor | None]]:
    """Optimizer ids: per parameter (or FSDP1 unit) its position in the optimizer's groups."""
    entries = [_entries(group["params"], layout, rank) for group in groups]
    opt: list[list[torch.Tensor]] | None = None
    if optimizer is not None:
        opt = optimizer_params(optimizer)
        if len(opt) != len(groups):
            raise ValueError(
                f"the optimizer has {len(opt)} param groups but osd['param_groups'] has "
                f"{len(groups)}"
            )
    if model is not None and opt is None:
        raise ValueError("model= matches names to the optimizer's parameters: pass optimizer too")
    if opt is not None and model is not None:
        flat = isinstance(layout, FSDP1Layout) and not layout.use_orig_params
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        entries = _by_name(entries, opt, flat_param_names(model) if flat else param_names(model))
    key_of: dict[str, int] = {}
    group_keys: list[list[int]] = []
    params: list[torch.Tensor | None] = []
    for g, group_entries in enumerate(entries):
        if opt is not None and len(opt[g]) != len(group_entries):
            raise ValueError(
                f"the optimizer's param group {g} has {len(opt[g])} parameters but "
                f"osd['param_groups'][{g}] gives {len(group_entries)}"
            )
        group_keys.append([])
        for i, (label, fqns, shapes) in enumerate(group_entries):
            param = None if opt is None else opt[g][i]
            if param is not None and is_dtensor(param):  # FSDP2: local shape, placement, mesh
                if not isinstance(layout, FSDP2Layout):
                    raise TypeError(
                        f"the optimizer's parameter for {label} is a DTensor (FSDP2), but the "
                        f"layout is a {type(layout).__name__}: give famp.layout_of(model) or "
                        "famp.fsdp2_layout(...)"
                    )
                check_fsdp2_param(param, fqns[0], *specs(layout)[fqns[0]], layout, rank)
            elif param is not None and tuple(param.shape) not in shapes:
                raise ValueError(
                    f"the optimizer's parameter for {label} on rank {rank} has shape "
                    f"{tuple(param.shape)}, expected {' or '.join(map(str, shapes))}: do its "
                    "param_groups list the parameters in the order of osd['param_groups']? "
                    "(pass model= to match them by name)"
                )
            for fqn in fqns:
                if fqn in key_of:
                    raise ValueError(f"{label} has parameters in two param groups")
                key_of[fqn] = len(params)
            group_keys[-1].append(len(params))
            params.append(param)
        if opt is not None and model is None:
            _refuse_unverifiable(group_entries, g, layout, rank)
    return key_of, group_keys, params
