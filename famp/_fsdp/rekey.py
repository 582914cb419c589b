"""Rekeying optimizer state between torch's parameter ids and parameter names (FQNs).

`optimizer.state_dict()` keys state by the position of each parameter in the concatenated
`param_groups`; FSDP1, DCP and famp key it by the parameter's name. The map between the two is
built as torch builds it (`torch.distributed.checkpoint.state_dict`): positions from
`optimizer.param_groups`, names from `model.named_parameters()`, matched by identity. A shared
parameter takes its first name; wrapper prefixes (`_fsdp_wrapped_module.`,
`_checkpoint_wrapped_module.`, `_orig_mod.`, DDP's `module.`) are dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from famp._fsdp.osd import split_osd

_WRAPPERS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def clean_fqn(name: str) -> str:
    """A parameter or module name without FSDP1, activation-checkpoint and compile wrappers."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPERS)


def param_names(model: torch.nn.Module) -> dict[torch.Tensor, list[str]]:
    """Every name of every parameter, first name first, wrapper prefixes dropped."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    names: dict[torch.Tensor, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        parts = name.split(".")[1:] if ddp else name.split(".")
        if "_flat_param" in parts:
            raise ValueError(
                f"model parameter {name!r} is an FSDP1 flat parameter (use_orig_params=False): "
                "its optimizer state has no per-parameter names; use FSDP.optim_state_dict or "
                "famp.unshard_optim_state on the SHARDED state dict instead"
            )
        names.setdefault(param, []).append(clean_fqn(".".join(parts)))
    return names


def optimizer_params(optimizer: object) -> list[list[torch.Tensor]]:
    """The parameters of each of `optimizer`'s param groups; a TypeError if it has none."""
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, list):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    return [list(g["params"]) for g in groups]


def _check_group_count(groups: Any, opt_params: list[list[torch.Tensor]], what: str) -> None:
    if len(groups) != len(opt_params):
        raise ValueError(
            f"{what}['param_groups'] has {len(groups)} groups but the optimizer has "
            f"{len(opt_params)}"
        )


def optim_state_by_fqn(
    osd: Mapping[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """`optimizer.state_dict()` keyed by parameter names instead of ids.

    Parameter `i` is the `i`-th parameter of the optimizer's concatenated param groups; its
    name is its first name in `model.named_parameters()`. Every group keeps its own
    hyperparameters; parameters without state stay without state. This is what
    `get_optimizer_state_dict(model, optimizer)` returns for an unsharded model (and for FSDP2,
    with DTensor values).

    Args:
        osd: an int-keyed `optimizer.state_dict()`.
        model: the module whose parameters the optimizer updates.
        optimizer: the optimizer that produced `osd` (or one built the same way).

    Returns:
        `{"state": {fqn: {...}}, "param_groups": [{..., "params": [fqn, ...]}]}`; state entries
            are new dicts holding the same values.

    Raises:
        KeyError: a state id that is not a parameter of the optimizer.
        ValueError: param groups that disagree with the optimizer's, an optimizer parameter that
            is not in `model`, an FSDP1 flat parameter.

    Examples:
        >>> import famp, torch
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> model(torch.ones(1, 2)).sum().backward(); opt.step()
        >>> sorted(famp.optim_state_by_fqn(opt.state_dict(), model, opt)["state"])
        ['bias', 'weight']
    """
    state, groups = split_osd(osd, "osd")
    opt_params = optimizer_params(optimizer)
    _check_group_count(groups, opt_params, "osd")
    names = param_names(model)
    fqn_of: dict[int, str] = {}
    out_groups = []
    for g, (group, params) in enumerate(zip(groups, opt_params, strict=True)):
        if len(group["params"]) != len(params):
            raise ValueError(
                f"osd['param_groups'][{g}] has {len(group['params'])} parameters but the "
                f"optimizer's group {g} has {len(params)}"
            )
        for pid, param in zip(group["params"], params, strict=True):
            if param not in names:
                raise ValueError(f"the optimizer's parameter {pid} (group {g}) is not in model")
            fqn_of[pid] = names[param][0]
        out_groups.append({**group, "params": [fqn_of[pid] for pid in group["params"]]})
    for pid in state:
        if pid not in fqn_of:
            raise KeyError(f"osd['state'] has id {pid!r}, which is in no param group")
    return {
        "state": {fqn_of[pid]: dict(entry) for pid, entry in state.items()},
        "param_groups": out_groups,
    }


def optim_state_by_id(
    osd: Mapping[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """An FQN-keyed optimizer state dict rekeyed by `optimizer`'s parameter ids, to load it.

    The inverse of `famp.optim_state_by_fqn`. Names are matched to parameters by identity
    (any of a shared parameter's names works); the `i`-th group of `osd` must hold exactly
    the parameters of the optimizer's `i`-th group, in any order, and keeps its
    hyperparameters. Ids follow the optimizer's order, as `optimizer.load_state_dict` expects.

    Args:
        osd: `{"state": {fqn: {...}}, "param_groups": [{..., "params": [fqn, ...]}]}`.
        model: the module whose parameters the optimizer updates.
        optimizer: the optimizer to load into.

    Returns:
        `{"state": {id: {...}}, "param_groups": [{..., "params": [id, ...]}]}`.

    Raises:
        KeyError: a name that is not a parameter of `model`.
        ValueError: a parameter in the wrong group or in none, a group count or size that
            differs from the optimizer's, a name for a parameter the optimizer does not update.

    Examples:
        >>> import famp, torch
        >>> model = torch.nn.Linear(2, 1)
        >>> groups = [{"params": [model.weight]}, {"params": [model.bias], "lr": 1.0}]
        >>> opt = torch.optim.SGD(groups, lr=0.1)
        >>> osd = {"state": {}, "param_groups": [{"lr": 0.1, "params": ["weight"]},
        ...                                      {"lr": 1.0, "params": ["bias"]}]}
        >>> famp.optim_state_by_id(osd, model, opt)["param_groups"][1]["params"]
        [1]
    """
    state, groups = split_osd(osd, "osd")
    opt_params = optimizer_params(optimizer)
    _check_group_count(groups, opt_params, "osd")
    param_of = {name: p for p, names in param_names(model).items() for name in names}
    ids: dict[torch.Tensor, tuple[int, int]] = {}  # param -> (group, id)
    for g, params in enumerate(opt_params):
        for param in params:
            ids[param] = (g, len(ids))
    key_of: dict[str, int] = {}
    out_groups = []
    for g, group in enumerate(groups):
        for fqn in group["params"]:
            if fqn not in param_of:
                raise KeyError(f"osd['param_groups'][{g}] names {fqn!r}, not a parameter of model")
            where = ids.get(param_of[fqn])
            if where is None or where[0] != g:
                found = "in no group" if where is None else f"in group {where[0]}"
                raise ValueError(
                    f"osd['param_groups'][{g}] lists {fqn!r}, but the optimizer has it {found}"
                )
            key_of[fqn] = where[1]
        if len({key_of[f] for f in group["params"]}) != len(opt_params[g]):
            raise ValueError(
                f"osd['param_groups'][{g}] has {len(group['params'])} parameters but the "
                f"optimizer's group {g} has {len(opt_params[g])}"
            )
        out_groups.append({**group, "params": [ids[p][1] for p in opt_params[g]]})
    for fqn in state:
        if fqn not in key_of:
            raise (KeyError if fqn not in param_of else ValueError)(
                f"osd['state'] has {fqn!r}, which is in no param group of osd"
            )
    return {
        "state": {key_of[fqn]: dict(entry) for fqn, entry in state.items()},
        "param_groups": out_groups,
    }
