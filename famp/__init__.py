"""famp: functional automatic mixed precision for PyTorch.

Everything PyTorch's AMP keeps in mutable objects (``torch.amp.GradScaler``, ``torch.autocast``,
FSDP's optimizer-state loading) as pure functions over pytrees with explicit, immutable state.
"""

from __future__ import annotations

# --- loss scaling: _scaler.py, _serialization.py -----------------------------------------------
from famp._scaler import ScalerState, init_scaler, update_scale
from famp._serialization import from_state_dict, to_state_dict
from famp._unscale import all_finite, scale, select_tree, unscale_and_check

# --- policies, op rules and autocast: _policy.py, _rules.py, _autocast.py ----------------------

# --- FSDP optimizer state: _fsdp.py, _dcp.py, _distributed.py ----------------------------------

# --- training steps: _step.py -------------------------------------------------------------------

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
    # FSDP optimizer state
    # training steps
]
