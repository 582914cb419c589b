"""The optimizer entries of a DCP checkpoint: nested or flattened, checked, made canonical.

`get_state_dict` saves an optimizer state dict under a key either nested (`optim.state.<fqn>.<name>`
and `optim.param_groups.<i>.<name>`, each a path in `planner_data`) or, with
`flatten_optimizer_state_dict=True`, flattened (`state.<fqn>.<name>` and
`param_groups.<fqn>.<name>` under the key). `dcp.py` reads the entries; this module checks
which form they are in and rebuilds famp's canonical full state from either.
"""

from __future__ import annotations

import os
from typing import Any

from famp._fsdp.dcp_paths import entry_path
from famp._fsdp.osd import group_fqns
from famp._fsdp.same import same

_OPTIM_KEYS = ("state", "param_groups")
_FLAT_PREFIXES = ("state.", "param_groups.")


def unflatten(items: dict[str, Any], where: str, model_order: list[str]) -> dict[str, Any]:
    """The canonical form of a state saved with `flatten_optimizer_state_dict=True`.

    The saved keys are `state.<fqn>.<name>` and `param_groups.<fqn>.<hyperparameter>`.
    Parameters whose hyperparameters are all equal form one group (the flattened form keeps no
    group boundaries); groups and parameters follow the model's order where the checkpoint has
    the model, else the saved order.
    """
    hyper: dict[str, dict[str, Any]] = {}
    for name, value in items.items():
        if name.startswith("param_groups."):
            fqn, _, hp_name = name[len("param_groups.") :].rpartition(".")
            if not fqn or not hp_name:
                raise ValueError(f"DCP entry '{where}.{name}' names no parameter")
            hyper.setdefault(fqn, {})[hp_name] = value
    if not hyper:
        raise KeyError(f"{where}.param_groups.<fqn>.<name> entries are not in the checkpoint")
    rank = {fqn: i for i, fqn in enumerate(model_order)}
    fqns = sorted(hyper, key=lambda f: rank.get(f, len(rank)))  # stable: saved order otherwise
    by_fqn_len = sorted(fqns, key=len, reverse=True)
    state: dict[str, dict[str, Any]] = {}
    for name, value in items.items():
        if not name.startswith("state."):
            continue
        rest = name[len("state.") :]
        owner = next((f for f in by_fqn_len if rest.startswith(f + ".")), None)
        if owner is None:
            raise ValueError(f"DCP entry '{where}.{name}': its parameter is in no param group")
        sub = rest[len(owner) + 1 :]
        if "." in sub:
            raise ValueError(
                f"DCP entry '{where}.{name}': nested optimizer state ({sub!r}) is not supported"
            )
        state.setdefault(owner, {})[sub] = value
    groups: list[dict[str, Any]] = []
    for fqn in fqns:
        hp = dict(sorted(hyper[fqn].items()))
        equal = next((g for g in groups if same(_hyper(g), hp)), None)
        if equal is None:
            groups.append({**hp, "params": [fqn]})
        else:
            equal["params"].append(fqn)
    return canonical({"state": state, "param_groups": groups}, where)


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def state_fqn(path: tuple[Any, ...], flat: bool, groups: list[dict[str, Any]]) -> str | None:
    """The FQN of the parameter whose state a tensor entry at `path` holds, or `None`."""
    if not flat:
        return str(path[2]) if len(path) == 4 and path[1] == "state" else None
    name = str(path[1])
    if not name.startswith("state."):
        return None
    fqns = sorted(group_fqns(groups, "param_groups"), key=len, reverse=True)
    return next((f for f in fqns if name[len("state.") :].startswith(f + ".")), None)


def check_optim_entries(metadata: Any, checkpoint_id: str | os.PathLike[str], key: str) -> bool:
    """Check the entries under `key`; return whether they are in the flattened layout."""
    paths = [entry_path(metadata, k) for k in metadata.state_dict_metadata]
    mine = [p for p in paths if p[0] == key]
    if not mine:
        tops = sorted({str(p[0]) for p in paths})
        raise KeyError(
            f"key {key!r} is not in DCP checkpoint {os.fspath(checkpoint_id)!r}; "
            f"its top-level keys are {tops}"
        )
    flat = all(len(p) == 2 and str(p[1]).startswith(_FLAT_PREFIXES) for p in mine)
    if flat:
        if not any(str(p[1]).startswith("param_groups.") for p in mine):
            raise KeyError(
                f"{key}.param_groups.<fqn>.<name> entries are not in DCP checkpoint "
                f"{os.fspath(checkpoint_id)!r}"
            )
        return True
    for p in mine:
        if len(p) < 3 or p[1] not in _OPTIM_KEYS:
            flat_key = ".".join(map(str, p))
            raise ValueError(
                f"DCP entry {flat_key!r} (path {p!r}) is not an optimizer state dict entry: "
                f"expected the paths ({key!r}, 'state', <fqn>, <name>) and ({key!r}, "
                f"'param_groups', <i>, <name>), or, all flattened, ({key!r}, "
                f"'state.<fqn>.<name>') and ({key!r}, 'param_groups.<fqn>.<name>')"
            )
    if not any(p[1] == "param_groups" for p in mine):
        raise KeyError(f"{key}.param_groups is not in DCP checkpoint {os.fspath(checkpoint_id)!r}")
    return False


def canonical(raw: dict[str, Any], where: str) -> dict[str, Any]:
    """Validate and order an optimizer state rebuilt from DCP entries."""
    groups = raw.get("param_groups")
    if not isinstance(groups, list) or not groups:
        raise ValueError(f"{where}.param_groups must be a non-empty list, got {groups!r}")
    out_groups = []
    for i, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise KeyError(f"{where}.param_groups.{i} has no 'params' entry, got {group!r}")
        params = group["params"]
        if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
            raise ValueError(
                f"{where}.param_groups.{i}.params must be a list of FQNs, got {params!r}"
            )
        hyper = {k: group[k] for k in sorted(group) if k != "params"}
        out_groups.append({**hyper, "params": list(params)})
    order = group_fqns(out_groups, f"{where}.param_groups")
    state = raw.get("state", {})
    if not isinstance(state, dict):  # an int path element made it a list
        raise ValueError(f"{where}.state must be a dict keyed by FQN, got {type(state).__name__}")
    for fqn, entry in state.items():
        if fqn not in order:
            raise ValueError(f"{where}.state.{fqn}: parameter {fqn!r} is in no param group")
        if not isinstance(entry, dict):
            raise ValueError(f"{where}.state.{fqn} must be a dict, got {type(entry).__name__}")
    out_state = {fqn: dict(sorted(state[fqn].items())) for fqn in order if fqn in state}
    return {"state": out_state, "param_groups": out_groups}
