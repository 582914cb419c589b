"""Every private torch name famp uses, in one place, each with the reason it is needed.

famp follows the installed torch: public API wherever torch has one. Where it has none, the private
name is imported here, and only here, so that a torch upgrade that moves it breaks one module (and
the tests that pin it across the supported window), never a user's numbers.
"""

from __future__ import annotations

import torch

# --- scaler (applying a scale to trees: _unscale.py, _unscale_paths.py) ---
# The fused unscale kernel has no batching rule and no derivative: under torch.func transforms
# famp runs its arithmetic as plain ops instead. torch has no public way to ask.
are_functorch_transforms_active = torch._C._are_functorch_transforms_active
