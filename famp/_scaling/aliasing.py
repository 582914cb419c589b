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
    are then handled as shared, correctly but without the in-place speed. A tensor with a
    stride 0 (from `expand`), or whose span holds fewer elements than it has, overlaps itself.
    One whose strides do not prove its elements apart (`unfold` windows with gaps between them:
    some do overlap, and torch's kernel would unscale those elements twice) is a group of its
    own, handled as shared.
    """
    self_overlapping = []
    shared: list[list[int]] = []
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
        if not x.numel():
            continue
        # Dims by stride: each must step over all the elements the smaller ones reach (the
        # sufficient condition for no overlap; torch itself gives up on the rest). A stride 0
        # (`expand`) always overlaps; others that fail (windows of `unfold` with gaps between
        # them) may, and are handled as shared: out of place, written back.
        extent, disjoint, expanded = 1, True, False
        for st, n in sorted((abs(st), n) for n, st in zip(x.shape, x.stride(), strict=True)):
            if n > 1:
                expanded |= st == 0
                disjoint &= st >= extent
                extent += (n - 1) * st
        if expanded or extent < x.numel():
            self_overlapping.append(i)
        elif not disjoint:
            shared.append([i])
        # Virtual addresses: distinct devices' memory never shares one (a false match would
        # only cost the in-place speed).
        start = x.data_ptr()
        spans.append((start, start + extent * x.element_size(), i))
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
