"""famp: functional automatic mixed precision for PyTorch.

Everything PyTorch's AMP keeps in mutable objects (`torch.amp.GradScaler`, `torch.autocast`,
FSDP's optimizer-state loading) as pure functions over pytrees with explicit, immutable state.
"""

from __future__ import annotations

import types as _types

# --- loss scaling: _scaling/ --------------------------------------------------------------------
# isort: split
from famp._scaling.build import init_scaler
from famp._scaling.choice import select_tree
from famp._scaling.state import ScalerState
from famp._scaling.state_dict import from_state_dict, to_state_dict
from famp._scaling.trees import all_finite, scale
from famp._scaling.unscale import unscale_and_check
from famp._scaling.update import update_scale

# --- policies, op rules and autocast: _autocast/ ------------------------------------------------
# isort: split
from famp._autocast.custom_fwd import custom_bwd, custom_fwd
from famp._autocast.patterns import AutocastWarning
from famp._autocast.policy import Policy, cast_to_compute, cast_to_output, cast_to_param, get_policy
from famp._autocast.transform import autocast

# isort: split
from famp._autocast.defaults import default_rules
from famp._autocast.rules import RULE_NAMES, OpRules, Rule

# --- FSDP optimizer state: _fsdp/ ----------------------------------------------------------------
# isort: split
from famp._fsdp.build import fsdp1_layout, fsdp2_layout
from famp._fsdp.dcp import load_dcp_optim_state, read_dcp_param_shapes
from famp._fsdp.layout import FSDP1Layout, FSDP2Layout
from famp._fsdp.live import layout_of
from famp._fsdp.load import optim_state_dict_to_load
from famp._fsdp.rekey import optim_state_by_fqn, optim_state_by_id
from famp._fsdp.shard import reshard_optim_state, shard_optim_state, unshard_optim_state

# --- training steps: _scaling/ ------------------------------------------------------------------
# isort: split
from famp._scaling.optimizer_step import optimizer_step
from famp._scaling.step import skip_on_overflow, value_and_grad

# --- overflow forensics and autocast explain: _scaling/report.py, _autocast/explain.py ---------
# isort: split
from famp._autocast.explain import explain
from famp._autocast.trace import OpRecord, Trace
from famp._scaling.report import NonfiniteReport, nonfinite_report

__version__ = "0.1.0"

__all__: list[str] = [
    # loss scaling
    "ScalerState",
    "all_finite",
    "from_state_dict",
    "init_scaler",
    "scale",
    "select_tree",
    "to_state_dict",
    "unscale_and_check",
    "update_scale",
    # policies, op rules and autocast
    "AutocastWarning",
    "RULE_NAMES",
    "OpRules",
    "Policy",
    "Rule",
    "autocast",
    "cast_to_compute",
    "cast_to_output",
    "cast_to_param",
    "custom_bwd",
    "custom_fwd",
    "default_rules",
    "get_policy",
    # FSDP optimizer state
    "FSDP1Layout",
    "FSDP2Layout",
    "fsdp1_layout",
    "fsdp2_layout",
    "layout_of",
    "load_dcp_optim_state",
    "optim_state_by_fqn",
    "optim_state_by_id",
    "optim_state_dict_to_load",
    "read_dcp_param_shapes",
    "reshard_optim_state",
    "shard_optim_state",
    "unshard_optim_state",
    # training steps
    "optimizer_step",
    "skip_on_overflow",
    "value_and_grad",
    # overflow forensics and autocast explain
    "NonfiniteReport",
    "OpRecord",
    "Trace",
    "explain",
    "nonfinite_report",
]

# Every public function and class reports its public path (`famp.scale`, not the private module
# it lives in), as do a public class's own methods: reprs, tracebacks and the API docs read
# `famp.…`, and doctest collects their examples from this module. The one place it is set.
for _name in __all__:
    _obj = globals()[_name]
    if not (isinstance(_obj, type) or callable(_obj)):
        continue
    _home, _obj.__module__ = _obj.__module__, "famp"
    for _member in vars(_obj).values() if isinstance(_obj, type) else ():
        _member = getattr(_member, "__func__", getattr(_member, "fget", _member))
        if isinstance(_member, _types.FunctionType) and _member.__module__ == _home:
            _member.__module__ = "famp"
del _name, _obj, _home, _member
