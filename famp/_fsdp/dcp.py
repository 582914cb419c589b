"""Reading DCP checkpoints into famp's canonical optimizer state, offline, in one process.

`torch.distributed.checkpoint` (DCP) saves `{"model": msd, "optim": osd}` from
`get_state_dict` as flattened entries (`optim.state.<fqn>.exp_avg`,
`optim.param_groups.<i>.<key>`), each tensor as the chunks its ranks held. These functions
rebuild the FQN-keyed full optimizer state dict and the parameter shapes from such a checkpoint,
reading DCP's on-disk format with every stated fact checked (`dcp_reader.py`; the optimizer
entries in `dcp_entries.py`), with no process group; `famp.shard_optim_state` then cuts it for
any layout and world size.

DCP's reader lives in `torch.distributed.checkpoint`; famp confines that import to
`famp/_fsdp/dcp_reader.py` and imports it on the first read, so this module and `import famp` stay
free of it. No collective runs either way.

Not supported: storage other than a local (or mounted) file system; checkpoints written without
DCP's `planner_data` (before torch 2.0); reading only one rank's region (the full state is read).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from famp._fsdp.dcp_entries import canonical, check_optim_entries, state_fqn, unflatten
from famp._fsdp.osd import group_fqns


def load_dcp_optim_state(
    checkpoint_id: str | os.PathLike[str], *, key: str = "optim"
) -> dict[str, Any]:
    """Read the optimizer state of a DCP checkpoint into the full FQN-keyed form, offline.

    The checkpoint is what `dcp.save({"model": msd, key: osd}, checkpoint_id=...)` wrote at any
    world size, with `osd` from `get_state_dict` or `get_optimizer_state_dict` (FSDP2, or
    FSDP1 sharded), in the nested or the flattened layout
    (`StateDictOptions(flatten_optimizer_state_dict=True)`). Every tensor is assembled whole
    from its saved chunks (empty shards included), in this process, with no process group.

    The result is what `get_optimizer_state_dict` returns with `full_state_dict=True`:
    `{"state": {fqn: {name: value}}, "param_groups": [{..., "params": [fqn, ...]}]}`, tensors
    on CPU in their saved dtype. `state` follows the `param_groups` order; the keys inside each
    entry and each group come back sorted (`params` last), as the checkpoint does not keep
    their order.

    Nothing in the checkpoint is unpickled beyond plain data: the `.metadata` file may only name
    DCP's metadata classes, and non-tensor values are read with `torch.load(weights_only=True)`.
    Every tensor record must hold the dtype and shape its metadata states, inside its file.
    In the flattened layout, parameters whose hyperparameters are all equal come back as one
    param group (that layout keeps no group boundaries).

    Args:
        checkpoint_id: the checkpoint directory (it holds `.metadata` and `*.distcp` files).
        key: the top-level key the optimizer state was saved under.

    Returns:
        The full optimizer state dict. Pass it to `famp.shard_optim_state` for any layout, or to
            `set_optimizer_state_dict(..., options=StateDictOptions(full_state_dict=True))`.

    Raises:
        FileNotFoundError: `checkpoint_id` does not exist.
        KeyError: `key` or its `param_groups` is not in the checkpoint.
        ValueError: not a DCP checkpoint; metadata naming a class famp does not unpickle, or
            malformed; a record that disagrees with its metadata, lies outside its file or in a
            file outside the checkpoint; chunks that do not tile a tensor; an entry under
            `key` other than `state` and `param_groups`; a parameter in two param groups
            or a state entry in none.

    Examples:
        >>> import tempfile, warnings, torch, torch.distributed.checkpoint as dcp, famp
        >>> osd = {"state": {"w": {"step": torch.tensor(1.0), "exp_avg": torch.ones(2, 3)}},
        ...        "param_groups": [{"lr": 0.1, "params": ["w"]}]}
        >>> tmp = tempfile.TemporaryDirectory()
        >>> with warnings.catch_warnings():  # one process, no process group: DCP warns
        ...     warnings.simplefilter("ignore")
        ...     _ = dcp.save({"optim": osd}, checkpoint_id=tmp.name, no_dist=True)
        >>> full = famp.load_dcp_optim_state(tmp.name)
        >>> full["param_groups"], full["state"]["w"]["exp_avg"].shape
        ([{'lr': 0.1, 'params': ['w']}], torch.Size([2, 3]))
        >>> tmp.cleanup()
    """
    return load_optim_state(checkpoint_id, key, None)


def read_dcp_param_shapes(
    checkpoint_id: str | os.PathLike[str], *, key: str = "model", optim_key: str = "optim"
) -> dict[str, torch.Size]:
    """The shape of every parameter in a DCP checkpoint's optimizer state, for building a layout.

    Reads the metadata and the small `param_groups` entries only, no tensor data. For each FQN in
    the `param_groups` (in their order) the shape is that of the model entry `<key>.<fqn>`;
    without one, the common shape of the parameter's saved optimizer-state tensors of at least one
    dimension (`exp_avg`, `exp_avg_sq`, ...), or `torch.Size([])` if all of them are 0-d.

    A parameter with neither (a frozen one the optimizer holds without state, saved with
    `StateDictOptions(ignore_frozen_params=True)`, which leaves it out of the model entries) has
    no shape in the checkpoint: give the layout its shape from the model
    (`{n: p.shape for n, p in model.named_parameters()}`). `famp.load_dcp_optim_state` and
    `famp-reshard` read such checkpoints, as torch does.

    Args:
        checkpoint_id: the checkpoint directory.
        key: the top-level key of the model state dict (`{"model": msd, ...}`).
        optim_key: the top-level key of the optimizer state dict.

    Returns:
        `{fqn: torch.Size}`, ready for `famp.fsdp2_layout(shapes, world_size)`.

    Raises:
        FileNotFoundError: `checkpoint_id` does not exist.
        KeyError: `optim_key` is not in the checkpoint.
        ValueError: as for `famp.load_dcp_optim_state`, a parameter's state tensors disagree
            on its shape, or a parameter has neither a model entry nor optimizer state to read
            its shape from (a `KeyError` before 2026-12-01).

    Examples:
        >>> import tempfile, warnings, torch, torch.distributed.checkpoint as dcp, famp
        >>> msd = {"w": torch.zeros(2, 3), "b": torch.zeros(2)}
        >>> osd = {"state": {"w": {"step": torch.tensor(1.0), "exp_avg": torch.ones(2, 3)}},
        ...        "param_groups": [{"lr": 0.1, "params": ["w", "b"]}]}
        >>> tmp = tempfile.TemporaryDirectory()
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     _ = dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp.name, no_dist=True)
        >>> famp.read_dcp_param_shapes(tmp.name)
        {'w': torch.Size([2, 3]), 'b': torch.Size([2])}
        >>> tmp.cleanup()
    """
    shapes, _, shapeless = dcp_param_shapes(checkpoint_id, key, optim_key)
    if shapeless:
        fqn = next(iter(shapeless))
        more = f" (and {len(shapeless) - 1} more)" if len(shapeless) > 1 else ""
        raise ValueError(
            f"parameter {fqn!r}{more} has no entry {key}.{fqn} and no optimizer state to read its "
            f"shape from in {os.fspath(checkpoint_id)!r} (a frozen parameter saved with "
            "ignore_frozen_params=True?): take the shapes from the model, "
            "{n: p.shape for n, p in model.named_parameters()}"
        )
    return shapes


def dcp_param_shapes(
    checkpoint_id: str | os.PathLike[str], key: str, optim_key: str
) -> tuple[dict[str, torch.Size], set[str], list[str]]:
    """`read_dcp_param_shapes`; the FQNs whose shapes were read off the optimizer state; and, in
    `param_groups` order, those left out: no model entry and no optimizer state at all."""
    from famp._fsdp import dcp_reader as reader
    from famp._fsdp.dcp_metadata import is_tensor_entry

    ckpt = reader.Checkpoint(checkpoint_id)
    flat = check_optim_entries(ckpt.metadata, checkpoint_id, optim_key)
    model: dict[str, torch.Size] = {}
    for _, md, path in ckpt.entries([(key,)]):
        if is_tensor_entry(md) and len(path) == 2:
            model[str(path[1])] = torch.Size(md.size)  # type: ignore[union-attr]
    if flat:
        optim = load_optim_state(checkpoint_id, optim_key, None, tensors=False)
    else:
        groups = reader.read_entries(checkpoint_id, [(optim_key, "param_groups")])[optim_key]
        optim = canonical({"param_groups": groups["param_groups"]}, optim_key)
    state: dict[str, list[torch.Size]] = {}  # the top-level state tensors' shapes, by FQN
    for _, md, path in ckpt.entries([(optim_key,)]):
        deep = not flat and len(path) > 4 and path[1] == "state"  # inside a dict or list
        fqn = str(path[2]) if deep else state_fqn(path, flat, optim["param_groups"])
        if fqn is not None:
            sizes = state.setdefault(fqn, [])
            if is_tensor_entry(md) and not deep:
                sizes.append(torch.Size(md.size))  # type: ignore[union-attr]
    shapes, inferred, shapeless = {}, set(), []
    for fqn in group_fqns(optim["param_groups"], f"{optim_key}.param_groups"):
        shape = model.get(fqn)
        if shape is None and fqn not in state:  # no state at all: nothing to cut
            shapeless.append(fqn)
            continue
        if shape is None:
            inferred.add(fqn)
            shape = param_shape_from_state(f"{optim_key}.state.{fqn}", state[fqn])
        if shape is None:
            raise ValueError(
                f"parameter {fqn!r} has no entry {key}.{fqn}, and its optimizer state holds no "
                f"tensor at its top level to read its shape from, in "
                f"{os.fspath(checkpoint_id)!r}: save the model's state dict beside it under "
                f"{key!r}"
            )
        shapes[fqn] = shape
    return shapes, inferred, shapeless


def param_shape_from_state(where: str, shapes: Sequence[torch.Size]) -> torch.Size | None:
    """A parameter's shape read off its state tensors' shapes; `None` if there are none.

    The tensors of one dimension or more must agree (`exp_avg`, `exp_avg_sq`, ...); if all are
    0-d, the parameter is 0-d.
    """
    shaped = {tuple(s) for s in shapes if len(s) > 0}
    if len(shaped) > 1:
        raise ValueError(
            f"{where}: state tensors disagree on the parameter's shape: {sorted(shaped)}"
        )
    if shaped:
        return torch.Size(shaped.pop())
    return torch.Size([]) if shapes else None


def dcp_optim_nbytes(checkpoint_id: str | os.PathLike[str], key: str) -> int:
    """Bytes of the tensors saved under `key`, from the metadata alone."""
    from famp._fsdp import dcp_reader as reader
    from famp._fsdp.dcp_metadata import is_tensor_entry

    ckpt = reader.Checkpoint(checkpoint_id)
    check_optim_entries(ckpt.metadata, checkpoint_id, key)
    total = 0
    for _, md, _ in ckpt.entries([(key,)]):
        if is_tensor_entry(md):
            props, size = md.properties, md.size  # type: ignore[union-attr]
            total += torch.Size(size).numel() * torch.empty((), dtype=props.dtype).element_size()
    return total


def load_optim_state(
    checkpoint_id: str | os.PathLike[str],
    key: str,
    progress: Callable[[int], None] | None,
    *,
    tensors: bool = True,
) -> dict[str, Any]:
    """The canonical full state under `key`; `tensors=False`: no tensors of a flattened state."""
    from famp._fsdp import dcp_reader as reader
    from famp._fsdp.dcp_metadata import is_tensor_entry

    ckpt = reader.Checkpoint(checkpoint_id)
    flat = check_optim_entries(ckpt.metadata, checkpoint_id, key)
    if not flat:
        raw = reader.read_entries(checkpoint_id, [(key,)], progress)[key]
        return canonical(raw, key)
    entries = ckpt.entries([(key,)])
    wanted = [p for _, md, p in entries if tensors or not is_tensor_entry(md)]
    items = {str(p[1]): v for p, v in reader.iter_entries(ckpt, wanted, progress)}
    model_order = [str(p[1]) for _, _, p in ckpt.entries([("model",)]) if len(p) == 2]
    return unflatten(items, key, model_order)
