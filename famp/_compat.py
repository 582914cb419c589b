"""Every private torch name famp uses, in one place, each with the reason it is needed.

famp follows the installed torch: public API wherever torch has one. Where it has none, the private
name is imported here, and only here, so that a torch upgrade that moves it breaks one module (and
the tests that pin it across the supported window), never a user's numbers.
"""

from __future__ import annotations

import torch

# --- autocast (famp/_autocast*.py) ----------------------------------------------------------------


def saved_tensors_hooks_top() -> tuple[object, object] | None:
    """The innermost active `torch.autograd.graph.saved_tensors_hooks` pair, or None.

    torch has no public query: famp needs it to tell that an op runs inside a non-reentrant
    checkpoint's block (whose saved tensors the checkpoint's hooks pack), to restore its state
    when torch recomputes that block.
    """
    top: tuple[object, object] | None = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return top
