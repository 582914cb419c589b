"""The one module that talks to ``torch.distributed``.

Every other famp module is pure and runs in one process; collectives and reading layouts off live
wrapped models live here, so that the import graph stays a tree.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

# --- found_inf reduction across ranks (used by unscale_and_check's `group=`) ---------------------


def all_reduce_max(found_inf: torch.Tensor, group: Any) -> torch.Tensor:
    """Max-reduce a one-element ``found_inf`` across ``group``, out of place (every rank agrees).

    Max rather than torch's ``ShardedGradScaler`` sum, so the result stays exactly 0.0 or 1.0.
    """
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed.ProcessGroup, got {type(group).__name__}"
        )
    reduced = found_inf.clone()
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=group)
    return reduced


# --- layouts read off live FSDP1 / FSDP2 models (layout_of) --------------------------------------
