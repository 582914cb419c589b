"""Whether torch takes an inference fast path: the tests of the installed torch's `forward`.

`nn.MultiheadAttention` runs `torch._native_multi_head_attention`, `nn.TransformerEncoderLayer`
its fused layer, `nn.TransformerEncoder` turns a padded batch into a nested tensor, each where
the tests below of its `forward` (torch 2.13–2.15) all pass and no argument has a torch function.
famp's modes make that last test fail, so famp asks the others itself (`unreached.decline`),
with every input of the call, keyword ones too, and where they pass leaves the module to torch.
The arguments are named as the installed torch's `forward` names them.
`tests/autocast/test_fast_path_conditions.py` checks each answer against the path torch takes.

Not mirrored: a device other than CPU, CUDA and XPU (torch's private backend counts there), and
`make_fx` tracing (famp does not decline while compiling).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from famp._autocast.recompute import calls
from famp._compat import forward_hooks, no_torch_function, pre_hooks

_DEVICES = ("cpu", "cuda", "xpu")


def _names(cls: type) -> tuple[str, ...]:
    return tuple(inspect.signature(cls.forward).parameters)[1:]  # type: ignore[attr-defined]


_NAMES: dict[type, tuple[str, ...]] = {
    cls: _names(cls)
    for cls in (
        torch.nn.MultiheadAttention,
        torch.nn.TransformerEncoderLayer,
        torch.nn.TransformerEncoder,
    )
}


def takes_fast_path(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether torch runs `module(*args, **kwargs)` (a module of `_NAMES`' classes, eval mode or
    not) on its inference fast path, with no torch function mode active."""
    if not torch.backends.mha.get_fastpath_enabled() or torch.is_autocast_enabled():
        return False  # torch's own `is_autocast_enabled()`: CUDA's autocast
    names = _NAMES.get(type(module)) or _NAMES[_base(module)]
    given = dict(zip(names, args, strict=False))
    given.update(kwargs)
    if isinstance(module, torch.nn.MultiheadAttention):
        return _attention(module, given)
    if isinstance(module, torch.nn.TransformerEncoderLayer):
        return _layer(module, given["src"], given)
    assert isinstance(module, torch.nn.TransformerEncoder)
    return _nested(module, given)


def _base(module: torch.nn.Module) -> type:
    return next(cls for cls in _NAMES if isinstance(module, cls))


def _free(tensors: tuple[Any, ...]) -> bool:
    """Plain tensors on a fast path's device, none requiring grad where grad is on."""
    present = [t for t in tensors if t is not None]
    if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in present):
        return False  # a subclass: torch asks it (`has_torch_function`); famp leaves it to itself
    if any(t.device.type not in _DEVICES for t in present):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in present))


def _floating(mask: Any) -> bool:
    return mask is not None and torch.is_floating_point(mask)


def _attention(m: torch.nn.MultiheadAttention, given: dict[str, Any]) -> bool:
    query, key, value = given["query"], given["key"], given["value"]
    if _floating(given.get("attn_mask")) or _floating(given.get("key_padding_mask")):
        return False
    weight, bias = m.in_proj_weight, m.in_proj_bias
    if (
        query.dim() != 3
        or query is not key
        or key is not value
        or weight is None
        or bias is None  # torch tests it after the others, then takes its composite path
        or query.dtype != bias.dtype
        or query.dtype != weight.dtype
        or m.training
        or m.num_heads % 2
        or not m.batch_first
        or m.bias_k is not None
        or m.bias_v is not None
        or m.add_zero_attn
        or (query.is_nested and (given.get("key_padding_mask") is not None or _mask(given)))
        or torch.compiler.is_exporting()
    ):
        return False
    return _free((query, key, value, weight, bias, m.out_proj.weight, m.out_proj.bias))


def _mask(given: dict[str, Any]) -> bool:
    return given.get("attn_mask") is not None


def _layer_tensors(layer: torch.nn.TransformerEncoderLayer) -> tuple[Any, ...]:
    attn = layer.self_attn
    return (
        attn.in_proj_weight,
        attn.in_proj_bias,
        attn.out_proj.weight,
        attn.out_proj.bias,
        *(
            t
            for m in (layer.norm1, layer.norm2, layer.linear1, layer.linear2)
            for t in (m.weight, m.bias)
        ),
    )


def _hooked(layer: torch.nn.Module) -> bool:
    """Whether a module of `layer`'s tree has a forward (pre-)hook, the layer's own pre-hooks
    aside: they run after famp's judgment and before the layer's `forward` looks (one of the
    user's may take itself out there). A layer whose own pre-hook stays is left to torch as one
    taking its fast path (a known limit). A module inside it that a famp call's module rule
    matches counts as hooked (its rule applies on the composite path only)."""
    return any(
        forward_hooks(m) or (m is not layer and (pre_hooks(m)[0] or _ruled(m)))
        for m in layer.modules()
    )


def _ruled(module: torch.nn.Module) -> bool:
    return any(r.scopes and r.module_policy.get(id(module)) is not None for r in calls())


def _layer(layer: torch.nn.TransformerEncoderLayer, src: Any, given: dict[str, Any]) -> bool:
    attn = layer.self_attn
    if (
        src.dim() != 3
        or layer.training
        or not attn.batch_first
        or attn.in_proj_bias is None
        or attn.in_proj_weight is None  # torch: `_qkv_same_embed_dim` (the same, unless changed)
        or not layer.activation_relu_or_gelu
        or layer.norm1.eps != layer.norm2.eps
        or (
            src.is_nested
            and (given.get("src_key_padding_mask") is not None or given.get("src_mask") is not None)
        )
        or attn.num_heads % 2 == 1
        or _hooked(layer)
    ):
        return False
    return _free((src, *_layer_tensors(layer)))


def _nested(encoder: torch.nn.TransformerEncoder, given: dict[str, Any]) -> bool:
    """The encoder's own fast path: a padded batch made a nested tensor for its layers."""
    src, padding = given["src"], given.get("src_key_padding_mask")
    first = encoder.layers[0]
    if (
        not getattr(encoder, "use_nested_tensor", False)
        or first.training
        or src.dim() != 3
        or padding is None
        or src.is_nested
        or given.get("mask") is not None
    ):
        return False
    if getattr(encoder, "mask_check", True) and not _left_aligned(padding):
        return False
    return _free((src, *_layer_tensors(first)))


def _left_aligned(padding: torch.Tensor) -> bool:
    """Whether each row's kept entries come first (torch's `mask_check`; it syncs as torch's)."""
    with no_torch_function():  # famp's modes are on in its hook: the check is no op of the call
        kept = padding.logical_not().to(torch.uint8)
        return bool(torch.equal(kept, kept.cummin(-1).values))
