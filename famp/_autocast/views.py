"""Whether a casting rule's result is a view of a tensor the rule cast.

Such a call runs as torch runs it, uncast (`casts.apply_rule`): its result must view the caller's
tensor, so that a write through it reaches that tensor, as under `torch.autocast`
(`torch.einsum("ij->ji", x)`, `torch.einsum("ii->i", x)`).
"""

from __future__ import annotations

from typing import Any

import torch

from famp._compat import functorch_transforms_active, unbatched


def views_a_cast(
    out: Any, args: tuple[Any, ...], kwargs: dict[str, Any], cast: Any, cast_kwargs: Any
) -> bool:
    """Whether a result of `out` (a tensor, or a tuple or list of them) views a tensor of the
    cast arguments (`cast`, `cast_kwargs`) that is not one of the caller's (`args`, `kwargs`).

    Under `vmap` a view has no `_base` of its own; the tensor it wraps has. Dynamo cannot unwrap
    one: compiled, a view of a cast made under `vmap` is not seen (docs/autocast.md, a known
    limit)."""
    unwrap = functorch_transforms_active() and not torch.compiler.is_compiling()
    results = (out,) if isinstance(out, torch.Tensor) else out if type(out) in (tuple, list) else ()
    for o in results:
        if not isinstance(o, torch.Tensor):
            continue
        base = unbatched(o)._base if unwrap and o._base is None else o._base
        if base is not None:
            copies = _copies((*args, *kwargs.values()), (*cast, *cast_kwargs.values()))
            if any(base is c or (unwrap and base is unbatched(c)) for c in copies):
                return True
    return False


def _copies(before: tuple[Any, ...], after: tuple[Any, ...]) -> list[torch.Tensor]:
    """The tensors `cast_args` made: those of `after` (and of its lists) not in `before`. Also
    while Dynamo traces: `is` between the variables of its graph's tensors."""
    made = []
    for old, new in zip(before, after, strict=True):
        if isinstance(new, torch.Tensor):
            if new is not old:
                made.append(new)
        elif isinstance(new, (list, tuple)) and new is not old:
            made.extend(n for o, n in zip(old, new, strict=True) if n is not o)
    return made
