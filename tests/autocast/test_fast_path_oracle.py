"""famp's judgment of torch's inference fast paths (`famp._autocast.fast_path.takes_fast_path`)
against the path the installed torch takes: the aten ops its call dispatches, seen by a
`TorchDispatchMode` (which, unlike famp's torch function modes, leaves the fast path open).
Over a grid of modes, grad, frozen parameters, masks, dtypes, self-attention or not, keyword
or positional inputs and torch's fastpath flag; a torch release that changes a test of its
`forward` fails here."""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from famp._autocast.fast_path import takes_fast_path

_FAST_OPS = {
    nn.MultiheadAttention: "_native_multi_head_attention",
    nn.TransformerEncoderLayer: "_transformer_encoder_layer_fwd",
    nn.TransformerEncoder: "_nested_tensor_from_mask",
}


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _module(kind: type, frozen: bool, train: bool, batch_first: bool) -> nn.Module:
    torch.manual_seed(0)
    if kind is nn.MultiheadAttention:
        m: nn.Module = nn.MultiheadAttention(16, 4, batch_first=batch_first)
    else:
        layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=batch_first)
        m = layer if kind is nn.TransformerEncoderLayer else nn.TransformerEncoder(layer, 2)
    m.train(train)
    for p in m.parameters():
        p.requires_grad_(not frozen)
    return m


def _call(kind: type, x: torch.Tensor, mask: Any, keyword: bool, self_attn: bool) -> Any:
    if kind is nn.MultiheadAttention:
        y = x if self_attn else x.clone()
        if keyword:
            return (), {"query": x, "key": x, "value": y, "key_padding_mask": mask}
        return (x, x, y, mask), {}
    name = "src_key_padding_mask"
    return ((x,), {name: mask}) if keyword else ((x, None, mask), {})


_GRID = list(
    itertools.product(
        [False, True],  # train
        [False, True],  # grad enabled
        [False, True],  # frozen parameters
        [False, True],  # the input requires grad
        [None, "bool", "float"],  # padding mask
        [False, True],  # by keyword
        [False, True],  # self-attention (MultiheadAttention: query is key is value)
        [False, True],  # batch_first
        [True, False],  # torch.backends.mha fastpath flag
        [torch.float32, torch.bfloat16],  # the input's dtype (parameters float32)
    )
)


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.filterwarnings("ignore:Converting mask without torch.bool dtype")
@pytest.mark.parametrize("kind", list(_FAST_OPS), ids=lambda k: k.__name__)
def test_famps_judgment_of_the_fast_path_is_the_path_torch_takes(kind: type) -> None:
    flag = torch.backends.mha.get_fastpath_enabled()
    seen = {True: 0, False: 0}
    try:
        for train, grad, frozen, needs, mask_kind, keyword, self_attn, bf, fast, dtype in _GRID:
            if kind is not nn.MultiheadAttention and not self_attn:
                continue  # the layers take one input
            torch.backends.mha.set_fastpath_enabled(fast)
            module = _module(kind, frozen, train, bf)
            x = torch.randn(2, 5, 16).to(dtype)
            x = x if bf else x.transpose(0, 1)
            x.requires_grad_(needs)
            mask = None
            if mask_kind is not None:
                mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
                mask = mask if mask_kind == "bool" else mask.float().masked_fill(mask, -1e9)
            args, kwargs = _call(kind, x, mask, keyword, self_attn)
            with torch.set_grad_enabled(grad):
                judged = takes_fast_path(module, args, kwargs)
                ops = _Ops()
                with ops, contextlib.suppress(RuntimeError, AssertionError):
                    module(*args, **kwargs)  # dtypes torch refuses: its error, either path
            taken = _FAST_OPS[kind] in ops.names
            case = (train, grad, frozen, needs, mask_kind, keyword, self_attn, bf, fast, dtype)
            assert judged == taken, case
            seen[taken] += 1
    finally:
        torch.backends.mha.set_fastpath_enabled(flag)
    assert seen[True] > 0  # both answers met
    assert seen[False] > 0
