"""Which donated gradients share memory: `famp.unscale_and_check(..., donate=True)` eagerly.

In place, a tensor given twice or two overlapping views would be unscaled twice; `unscale.py`
computes such leaves out of place from what they hold and writes them back.
"""

from __future__ import annotations

import torch
from torch import Tensor


def shared_memory(tensors: list[Tensor]) -> tuple[list[list[int]], list[int]]:
    """Groups of tensors that share memory, and the tensors that overlap themselves, eagerly.

    Compares the byte span each tensor's elements lie in (from its first to its last element);
    spans that intersect count as shared. That is exact for the same tensor twice and for
    overlapping views, and conservative for interleaved ones (`x[:, 0]` and `x[:, 1]`), which
    are then handled as shared, correctly but without the in-place speed. A tensor whose span
    holds fewer elements than it has (a stride 0, from `expand`) overlaps itself.
    """
    self_overlapping = []
    spans = []  # (first byte, end byte, index), one pass reading each property once
    for i, x in enumerate(tensors):
        if type(x) is not torch.Tensor or x.is_meta:  # no pointers to read
            continue
        if x.is_contiguous():  # the common case: its bytes, no stride walk
            nbytes = x.nbytes
            if nbytes:
                start = x.data_ptr()
                spans.append((start, start + nbytes, i))
            continue
        numel = x.numel()
        if not numel:
            continue
        extent = 1 + sum((n - 1) * abs(st) for n, st in zip(x.shape, x.stride(), strict=True))
        if extent < numel:
            self_overlapping.append(i)
        # Virtual addresses: distinct devices' memory never shares one (a false match would
        # only cost the in-place speed).
        start = x.data_ptr()
        spans.append((start, start + extent * x.element_size(), i))
    shared: list[list[int]] = []
    if len(spans) < 2:
        return shared, self_overlapping
    spans.sort()
    cluster: list[int] = []
    end = -1
    for start, stop, i in spans:
        if start < end:
            cluster.append(i)
            end = max(end, stop)
            continue
        if len(cluster) > 1:
            shared.append(sorted(cluster))
        cluster, end = [i], stop
    if len(cluster) > 1:
        shared.append(sorted(cluster))
    return shared, self_overlapping
