"""The one module that talks to ``torch.distributed``.

Every other famp module is pure and runs in one process; collectives and reading layouts off live
wrapped models live here, so that the import graph stays a tree.
"""

from __future__ import annotations

# --- found_inf reduction across ranks (used by unscale_and_check's `group=`) ---------------------

# --- layouts read off live FSDP1 / FSDP2 models (layout_of) --------------------------------------
