"""Deriving torch's autocast rule of an op by running it: the reference for every rule.

`apply_rule` runs one aten overload the way torch's wrapper for a cast policy would
(`aten/src/ATen/autocast_mode.h`: `cached_cast`, `prioritize`, `set_opt_dtype`,
`type_from_firstarg`), with autocast itself off. `check_op` runs an op under torch's autocast
and under the reference for each candidate rule, on `SAMPLES` inputs, and keeps the rules whose
casts, dtypes (and, on real tensors, bits) and errors are torch's. `famp.default_rules` uses it
for the ops of a torch release its shipped tables do not know (fake tensors: no computation);
`tests/autocast/test_rules.py` and `benchmarks/verify_rules.py` use it to check the tables.
C++ argument types decide what is cast:

- `Tensor`, `Tensor?` and `Tensor[]` arguments are cast; `Tensor?[]` (`index_put`'s
  indices) never are;
- `promote` picks float32 if any `Tensor` or `Tensor[]` argument is an eligible float32
  tensor, else the autocast dtype; `Tensor?` arguments are cast but do not vote;
- eligible means: on the autocast device, floating point and not float64.

`python -m famp._autocast.rules_derive` derives the running torch's tables and writes them into
`famp/_autocast/rules_data.py` under its release.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from famp._autocast.ops import APPEND_DTYPE_OVERLOADS, banned_message
from famp._compat import OpOverload, TorchDispatchMode, fake_tensor_mode, torch_pytree
from famp._compat import op_schema as schema

Args = tuple[tuple[Any, ...], dict[str, Any]]
Bound = list[tuple[str, "int | str", Any]]


def names(op: OpOverload) -> tuple[str, str]:
    """(packet, overload) of an aten overload: `("norm", "Scalar")`, `("mm", "default")`."""
    s = schema(op)
    return s.name.partition("::")[2], s.overload_name or "default"


def eligible(x: object, device_type: str) -> bool:
    return (
        isinstance(x, torch.Tensor)
        and x.device.type == device_type
        and x.is_floating_point()
        and x.dtype != torch.float64
    )


def _cast(x: Any, kind: str, dtype: torch.dtype, device_type: str) -> Any:
    if kind in ("Tensor", "Optional[Tensor]"):
        return x.to(dtype) if eligible(x, device_type) and x.dtype != dtype else x
    if kind == "List[Tensor]":
        return [_cast(t, "Tensor", dtype, device_type) for t in x]
    return x


def _bound(op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Bound:
    """(kind, where, value) of every argument given, in schema order."""
    out: Bound = []
    for i, a in enumerate(schema(op).arguments):
        if i < len(args):
            out.append((str(a.type), i, args[i]))
        elif a.name in kwargs:
            out.append((str(a.type), a.name, kwargs[a.name]))
    return out


def _rebuild(args: tuple[Any, ...], kwargs: dict[str, Any], changes: dict[Any, Any]) -> Args:
    new_args = list(args)
    new_kwargs = dict(kwargs)
    for where, value in changes.items():
        if isinstance(where, int):
            new_args[where] = value
        else:
            new_kwargs[where] = value
    return tuple(new_args), new_kwargs


def _promote_type(bound: Bound, lower: torch.dtype, device_type: str) -> torch.dtype:
    current = lower
    for kind, _, value in bound:
        tensors = [value] if kind == "Tensor" else value if kind == "List[Tensor]" else []
        for t in tensors:
            if not (
                isinstance(t, torch.Tensor)
                and t.device.type == device_type
                and t.is_floating_point()
            ):
                continue
            if t.dtype == torch.float64:
                continue
            if torch.float32 in (current, t.dtype):
                current = torch.float32
            elif not (current == lower and t.dtype == lower):
                raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return current


def apply_rule(
    rule: str,
    op: OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device_type: str,
    lower: torch.dtype,
) -> Any:
    """Run `op` as torch's autocast wrapper for `rule` would; autocast must be off."""
    bound = _bound(op, args, kwargs)
    if rule == "keep":
        return op(*args, **kwargs)
    if rule in ("lower", "float32", "promote"):
        if rule == "lower":
            dtype = lower
        elif rule == "float32":
            dtype = torch.float32
        else:
            dtype = _promote_type(bound, lower, device_type)
        changes = {where: _cast(v, kind, dtype, device_type) for kind, where, v in bound}
        new_args, new_kwargs = _rebuild(args, kwargs, changes)
        return op(*new_args, **new_kwargs)
    if rule == "float32_set_opt_dtype":
        if not eligible(args[0], device_type):
            return op(*args, **kwargs)
        given = {where: v for kind, where, v in bound if kind == "Optional[int]" and v is not None}
        slot = next(i for i, a in enumerate(schema(op).arguments) if a.name == "dtype")
        if given.get(slot) is not None or given.get("dtype") is not None:
            return op(*args, **kwargs)
        if slot < len(args):
            return op(*_rebuild(args, kwargs, {slot: torch.float32})[0], **kwargs)
        return op(*args, **{**kwargs, "dtype": torch.float32})
    if rule == "float32_append_dtype":
        packet, overload = APPEND_DTYPE_OVERLOADS[names(op)]
        target = getattr(getattr(torch.ops.aten, packet), overload)
        out_type = torch.float32 if eligible(args[0], device_type) else args[0].dtype
        # C++ passes every argument, defaults included, before the appended dtype.
        full = list(args)
        for a in schema(op).arguments[len(args) :]:
            full.append(kwargs.get(a.name, a.default_value))
        return target(*full, dtype=out_type)
    if rule == "banned":
        raise RuntimeError(banned_message(names(op)[0], device_type))
    raise ValueError(f"unknown rule {rule!r}")


# --- samples: float32 inputs on CPU for every overload with an autocast kernel --------------------


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


class _T:
    """Deterministic small CPU tensors."""

    def __init__(self) -> None:
        self.g = _gen()

    def __call__(self, *shape: int, lo: float = -1.0, hi: float = 1.0) -> torch.Tensor:
        return torch.rand(shape, generator=self.g) * (hi - lo) + lo

    def pos(self, *shape: int) -> torch.Tensor:
        return self(*shape, lo=0.5, hi=2.0)

    def spd(self, n: int) -> torch.Tensor:
        a = self(n, n)
        return a @ a.T + n * torch.eye(n)

    def int(self, *shape: int, hi: int) -> torch.Tensor:
        return torch.randint(0, hi, shape, generator=self.g)


def _unary(t: _T) -> Args:
    return (t.pos(3, 4) / 3,), {}


def _conv(nd: int) -> Callable[[_T], Args]:
    return lambda t: ((t(2, 4, *[5] * nd), t(6, 4, *[3] * nd), t(6)), {})


def _conv_padding(nd: int) -> Callable[[_T], Args]:
    return lambda t: ((t(2, 4, *[5] * nd), t(6, 4, *[3] * nd), t(6), [1] * nd, "same"), {})


def _conv_transpose(nd: int) -> Callable[[_T], Args]:
    return lambda t: ((t(2, 4, *[5] * nd), t(4, 6, *[3] * nd), t(6)), {})


def _loss(t: _T) -> Args:
    return (t(3, 5), t(3, 5)), {}


def _upsample(nd: int, align: bool | None) -> Callable[[_T], Args]:
    def make(t: _T) -> Args:
        size = [6] * nd
        extra = [] if align is None else [align]
        return (t(2, 3, *[4] * nd), size, *extra), {}

    return make


def _rnn_cell(gates: int) -> Callable[[_T], Args]:
    return lambda t: (
        (t(3, 5), t(3, 4), t(gates * 4, 5), t(gates * 4, 4), t(gates * 4), t(gates * 4)),
        {},
    )


def _sdpa_flash(t: _T) -> Args:
    return (t(2, 3, 4, 8), t(2, 3, 4, 8), t(2, 3, 4, 8)), {}


def _mkldnn_rnn_layer(t: _T) -> Args:
    # input (seq, batch, in), w_ih (4h, in), w_hh (4h, h), b_ih, b_hh, hx, cx; LSTM mode 2
    return (
        t(3, 2, 5), t(16, 5), t(16, 4), t(16), t(16), t(2, 4), t(2, 4),
        False, [], 2, 4, 1, True, False, False, False,
    ), {}  # fmt: skip


def _cudnn_rnn(t: _T) -> Args:
    # LSTM (mode 2), one layer, hidden 4, no projection: input (seq, batch, in), weights, hx, cx
    weights = [t(16, 5), t(16, 4), t(16), t(16)]
    return (
        t(3, 2, 5), weights, 4, None, t(1, 2, 4), t(1, 2, 4),
        2, 4, 0, 1, False, 0.0, False, False, [], None,
    ), {}  # fmt: skip


def _lu_solve(t: _T) -> Args:
    lu, piv = torch.linalg.lu_factor(t.spd(3))
    return (t(3, 2), lu, piv), {}


def _geqrf_pair(t: _T) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.geqrf(t(4, 3))


def _fractional(nd: int) -> Callable[[_T], Args]:
    return lambda t: ((t(1, 2, *[8] * nd), [2] * nd, [4] * nd, t.pos(1, 2, nd) / 2.1), {})


def _max_unpool2d(t: _T) -> Args:
    out, idx = torch.nn.functional.max_pool2d(t(1, 2, 4, 4), 2, return_indices=True)
    return (out, idx, [4, 4]), {}


def _max_unpool3d(t: _T) -> Args:
    out, idx = torch.nn.functional.max_pool3d(t(1, 2, 4, 4, 4), 2, return_indices=True)
    return (out, idx, [4, 4, 4], [2, 2, 2], [0, 0, 0]), {}


def _mha(t: _T) -> Args:
    e, h = 8, 2
    q = t(2, 3, e)
    return (q, q, q, e, h, t(3 * e, e), t(3 * e), t(e, e), t(e)), {"need_weights": False}


def _ctc(t: _T, tensor_lengths: bool) -> Args:
    log_probs = torch.log_softmax(t(6, 2, 5), -1)
    targets = t.int(2, 3, hi=4) + 1
    il, tl = [6, 6], [3, 2]
    if tensor_lengths:
        return (log_probs, targets, torch.tensor(il), torch.tensor(tl)), {}
    return (log_probs, targets, il, tl), {}


def _conv_args(t: _T) -> tuple[Any, ...]:
    return (t(2, 4, 5, 5), t(6, 4, 3, 3), t(6), [1, 1], [0, 0], [1, 1], False, [0, 0], 1)


SAMPLES: dict[str, Callable[[_T], Args]] = {
    "_addmm_activation": lambda t: ((t(4), t(3, 5), t(5, 4)), {"use_gelu": True}),
    "_convolution": lambda t: (
        (*_conv_args(t), False, False, True, True),
        {},
    ),
    "_convolution.deprecated": lambda t: (
        (*_conv_args(t), False, False, True),
        {},
    ),
    "_grid_sampler_2d_cpu_fallback": lambda t: ((t(1, 2, 4, 4), t(1, 3, 3, 2), 0, 0, False), {}),
    "_lu_with_info": lambda t: ((t.spd(3),), {}),
    "_mps_convolution": lambda t: (
        (t(2, 4, 5, 5), t(6, 4, 3, 3), t(6), [0, 0], [1, 1], [1, 1], 1),
        {},
    ),
    "_native_multi_head_attention": _mha,
    "_scaled_dot_product_flash_attention": _sdpa_flash,
    "_cudnn_rnn": _cudnn_rnn,
    "_thnn_fused_gru_cell": lambda t: ((t(3, 12), t(3, 12), t(3, 4), t(12), t(12)), {}),
    "_thnn_fused_lstm_cell": lambda t: ((t(3, 16), t(3, 16), t(3, 4), t(16), t(16)), {}),
    "_upsample_bicubic2d_aa": _upsample(2, False),
    "_upsample_bilinear2d_aa": _upsample(2, False),
    "_upsample_nearest_exact1d": _upsample(1, None),
    "_upsample_nearest_exact2d": _upsample(2, None),
    "_upsample_nearest_exact3d": _upsample(3, None),
    "acos": lambda t: ((t(3, 4, lo=-0.9, hi=0.9),), {}),
    "adaptive_avg_pool3d": lambda t: ((t(1, 2, 4, 4, 4), [2, 2, 2]), {}),
    "adaptive_max_pool3d": lambda t: ((t(1, 2, 4, 4, 4), [2, 2, 2]), {}),
    "addbmm": lambda t: ((t(3, 4), t(2, 3, 5), t(2, 5, 4)), {}),
    "addcdiv": lambda t: ((t(3, 4), t(3, 4), t.pos(3, 4)), {"value": 0.5}),
    "addcmul": lambda t: ((t(3, 4), t(3, 4), t(3, 4)), {"value": 0.5}),
    "addmm": lambda t: ((t(3, 4), t(3, 5), t(5, 4)), {}),
    "addmv": lambda t: ((t(3), t(3, 5), t(5)), {}),
    "addr": lambda t: ((t(3, 4), t(3), t(4)), {}),
    "asin": lambda t: ((t(3, 4, lo=-0.9, hi=0.9),), {}),
    "atan2": lambda t: ((t(3, 4), t(3, 4)), {}),
    "avg_pool3d": lambda t: ((t(1, 2, 4, 4, 4), [2, 2, 2]), {}),
    "baddbmm": lambda t: ((t(2, 3, 4), t(2, 3, 5), t(2, 5, 4)), {}),
    "batch_norm": lambda t: (
        (t(4, 3, 2), t(3), t(3), t(3), t.pos(3), False, 0.1, 1e-5, False),
        {},
    ),
    "bilinear": lambda t: ((t(3, 4), t(3, 5), t(6, 4, 5), t(6)), {}),
    "binary_cross_entropy": lambda t: ((t(3, 4, lo=0.1, hi=0.9), t(3, 4, lo=0, hi=1)), {}),
    "binary_cross_entropy_with_logits": lambda t: ((t(3, 4), t(3, 4, lo=0, hi=1), t(4)), {}),
    "bmm": lambda t: ((t(2, 3, 5), t(2, 5, 4)), {}),
    "cat": lambda t: (([t(2, 3), t(4, 3)],), {}),
    "cdist": lambda t: ((t(3, 4), t(5, 4)), {}),
    "chain_matmul": lambda t: (([t(3, 4), t(4, 5), t(5, 2)],), {}),
    "cholesky": lambda t: ((t.spd(3),), {}),
    "cholesky_inverse": lambda t: ((torch.linalg.cholesky(t.spd(3)),), {}),
    "cholesky_solve": lambda t: ((t(3, 2), torch.linalg.cholesky(t.spd(3))), {}),
    "conv1d": _conv(1),
    "conv1d.padding": _conv_padding(1),
    "conv2d": _conv(2),
    "conv2d.padding": _conv_padding(2),
    "conv3d": _conv(3),
    "conv3d.padding": _conv_padding(3),
    "conv_tbc": lambda t: ((t(5, 2, 4), t(3, 4, 6), t(6)), {}),
    "conv_transpose1d": _conv_transpose(1),
    "conv_transpose2d.input": _conv_transpose(2),
    "conv_transpose3d.input": _conv_transpose(3),
    "convolution": lambda t: (
        (t(2, 4, 5, 5), t(6, 4, 3, 3), t(6), [1, 1], [0, 0], [1, 1], False, [0, 0], 1),
        {},
    ),
    "cosh": _unary,
    "cosine_embedding_loss": lambda t: ((t(3, 5), t(3, 5), torch.tensor([1.0, -1.0, 1.0])), {}),
    "cosine_similarity": lambda t: ((t(3, 5), t(3, 5)), {}),
    "cross": lambda t: ((t(4, 3), t(4, 3)), {"dim": 1}),
    "cross_entropy_loss": lambda t: ((t(3, 5), t.int(3, hi=5)), {}),
    "ctc_loss.IntList": lambda t: _ctc(t, False),
    "ctc_loss.Tensor": lambda t: _ctc(t, True),
    "cudnn_convolution": lambda t: (
        (t(2, 4, 5, 5), t(6, 4, 3, 3), [0, 0], [1, 1], [1, 1], 1, False, False, True),
        {},
    ),
    "cudnn_convolution_transpose": lambda t: (
        (t(2, 4, 5, 5), t(4, 6, 3, 3), [0, 0], [0, 0], [1, 1], [1, 1], 1, False, False, True),
        {},
    ),
    "cumprod": lambda t: ((t(3, 4), 1), {}),
    "cumsum": lambda t: ((t(3, 4), 1), {}),
    "dist": lambda t: ((t(3, 4), t(3, 4)), {}),
    "dot": lambda t: ((t(5), t(5)), {}),
    "einsum": lambda t: (("ij,jk->ik", [t(3, 4), t(4, 5)]), {}),
    "erfinv": lambda t: ((t(3, 4, lo=-0.9, hi=0.9),), {}),
    "exp": _unary,
    "expm1": _unary,
    "fake_quantize_per_tensor_affine": lambda t: ((t(3, 4), 0.1, 0, -128, 127), {}),
    "fft_fft": lambda t: ((t(4, 8),), {}),
    "fft_fft2": lambda t: ((t(4, 8),), {}),
    "fft_fftn": lambda t: ((t(4, 8),), {}),
    "fft_hfft": lambda t: ((t(4, 8),), {}),
    "fft_ifft": lambda t: ((t(4, 8),), {}),
    "fft_ifft2": lambda t: ((t(4, 8),), {}),
    "fft_ifftn": lambda t: ((t(4, 8),), {}),
    "fft_ihfft": lambda t: ((t(4, 8),), {}),
    "fft_irfft": lambda t: ((t(4, 8),), {}),
    "fft_irfft2": lambda t: ((t(4, 8),), {}),
    "fft_irfftn": lambda t: ((t(4, 8),), {}),
    "fft_rfft": lambda t: ((t(4, 8),), {}),
    "fft_rfft2": lambda t: ((t(4, 8),), {}),
    "fft_rfftn": lambda t: ((t(4, 8),), {}),
    "fractional_max_pool2d": _fractional(2),
    "fractional_max_pool3d": _fractional(3),
    "frobenius_norm.dim": lambda t: ((t(3, 4), [1]), {}),
    "geqrf": lambda t: ((t(4, 3),), {}),
    "grid_sampler": lambda t: ((t(1, 2, 4, 4), t(1, 3, 3, 2), 0, 0, False), {}),
    "grid_sampler_2d": lambda t: ((t(1, 2, 4, 4), t(1, 3, 3, 2), 0, 0, False), {}),
    "grid_sampler_3d": lambda t: ((t(1, 2, 4, 4, 4), t(1, 3, 3, 3, 3), 0, 0, False), {}),
    "group_norm": lambda t: ((t(2, 4, 3), 2, t(4), t(4)), {}),
    "gru_cell": _rnn_cell(3),
    "hinge_embedding_loss": lambda t: ((t(3, 5), torch.ones(3, 5)), {}),
    "huber_loss": _loss,
    "index_copy": lambda t: ((t(5, 3), 0, torch.tensor([0, 4, 2]), t(3, 3)), {}),
    "index_put": lambda t: ((t(5, 3), [torch.tensor([0, 4])], t(2, 3)), {}),
    "inverse": lambda t: ((t.spd(3),), {}),
    "kl_div": lambda t: ((torch.log_softmax(t(3, 5), -1), torch.softmax(t(3, 5), -1)), {}),
    "l1_loss": _loss,
    "layer_norm": lambda t: ((t(2, 3, 4), [4], t(4), t(4)), {}),
    "linalg_cholesky": lambda t: ((t.spd(3),), {}),
    "linalg_cholesky_ex": lambda t: ((t.spd(3),), {}),
    "linalg_cond": lambda t: ((t.spd(3),), {}),
    "linalg_cond.p_str": lambda t: ((t.spd(3), "fro"), {}),
    "linalg_eig": lambda t: ((t.spd(3),), {}),
    "linalg_eigh": lambda t: ((t.spd(3),), {}),
    "linalg_eigvals": lambda t: ((t.spd(3),), {}),
    "linalg_eigvalsh": lambda t: ((t.spd(3),), {}),
    "linalg_householder_product": lambda t: (_geqrf_pair(t), {}),
    "linalg_inv": lambda t: ((t.spd(3),), {}),
    "linalg_inv_ex": lambda t: ((t.spd(3),), {}),
    # driver=None is not bitwise reproducible on CPU (two calls on the same inputs differ)
    "linalg_lstsq": lambda t: ((t.spd(3), t(3, 2)), {"driver": "gels"}),
    "linalg_matrix_sqrth": lambda t: ((t.spd(3),), {}),
    "linalg_matrix_norm": lambda t: ((t(3, 4), 2), {}),
    "linalg_matrix_norm.str_ord": lambda t: ((t(3, 4), "fro"), {}),
    "linalg_matrix_rank": lambda t: ((t.spd(3), 1e-3), {}),
    "linalg_matrix_rank.atol_rtol_float": lambda t: ((t.spd(3),), {"atol": 1e-3}),
    "linalg_matrix_rank.atol_rtol_tensor": lambda t: ((t.spd(3),), {"atol": t.pos(1)}),
    "linalg_matrix_rank.tol_tensor": lambda t: ((t.spd(3), t.pos(1) / 100), {}),
    "linalg_multi_dot": lambda t: (([t(3, 4), t(4, 5), t(5, 2)],), {}),
    "linalg_qr": lambda t: ((t(4, 3),), {}),
    "linalg_solve": lambda t: ((t.spd(3), t(3, 2)), {}),
    "linalg_svd": lambda t: ((t(4, 3),), {}),
    "linalg_svdvals": lambda t: ((t(4, 3),), {}),
    "linalg_tensorinv": lambda t: ((t.spd(4).reshape(4, 2, 2),), {"ind": 1}),
    "linalg_tensorsolve": lambda t: ((t.spd(4).reshape(2, 2, 4), t(2, 2)), {}),
    "linalg_vecdot": lambda t: ((t(3, 4), t(3, 4)), {}),
    "linalg_vector_norm": lambda t: ((t(3, 4),), {}),
    "linear": lambda t: ((t(3, 4), t(5, 4), t(5)), {}),
    "log": _unary,
    "log10": _unary,
    "log1p": _unary,
    "log2": _unary,
    "log_softmax.int": lambda t: ((t(3, 4), 1), {}),
    "logsumexp": lambda t: ((t(3, 4), [1]), {}),
    "lstm_cell": lambda t: ((t(3, 5), [t(3, 4), t(3, 4)], t(16, 5), t(16, 4), t(16), t(16)), {}),
    "lu_solve": _lu_solve,
    "margin_ranking_loss": lambda t: ((t(5), t(5), torch.tensor([1.0, -1, 1, -1, 1])), {}),
    "matmul": lambda t: ((t(2, 3, 5), t(5, 4)), {}),
    "max_pool3d": lambda t: ((t(1, 2, 4, 4, 4), [2, 2, 2]), {}),
    "max_unpool2d": _max_unpool2d,
    "max_unpool3d": _max_unpool3d,
    "mkldnn_rnn_layer": _mkldnn_rnn_layer,
    "mm": lambda t: ((t(3, 5), t(5, 4)), {}),
    "mse_loss": _loss,
    "multi_margin_loss": lambda t: ((t(3, 5), t.int(3, hi=5)), {}),
    "multilabel_margin_loss": lambda t: ((t(3, 5), torch.tensor([[3, 0, -1, 1, 2]] * 3)), {}),
    "multilabel_margin_loss_forward": lambda t: (
        (t(3, 5), torch.tensor([[3, 0, -1, 1, 2]] * 3), 1),
        {},
    ),
    "mv": lambda t: ((t(3, 5), t(5)), {}),
    "nanquantile": lambda t: ((t(3, 4), torch.tensor([0.25, 0.5])), {"dim": 1}),
    "nanquantile.scalar": lambda t: ((t(3, 4), 0.3), {"dim": 1}),
    "native_layer_norm": lambda t: ((t(2, 3, 4), [4], t(4), t(4), 1e-5), {}),
    "nll_loss": lambda t: ((torch.log_softmax(t(3, 5), -1), t.int(3, hi=5), t.pos(5)), {}),
    "nll_loss2d": lambda t: (
        (torch.log_softmax(t(2, 5, 3, 3), 1), t.int(2, 3, 3, hi=5), t.pos(5)),
        {},
    ),
    "norm.Scalar": lambda t: ((t(3, 4), 3), {}),
    "norm.ScalarOpt_dim": lambda t: ((t(3, 4), 3, [1]), {}),
    "nuclear_norm": lambda t: ((t(3, 4),), {}),
    "nuclear_norm.dim": lambda t: ((t(2, 3, 4), [1, 2]), {}),
    "orgqr": lambda t: (_geqrf_pair(t), {}),
    "ormqr": lambda t: ((*_geqrf_pair(t), t(4, 2)), {}),
    "pdist": lambda t: ((t(4, 3),), {}),
    "pinverse": lambda t: ((t(4, 3),), {}),
    "poisson_nll_loss": lambda t: ((t(3, 4), t.pos(3, 4), True, False, 1e-8, 1), {}),
    "polar": lambda t: ((t.pos(3, 4), t(3, 4)), {}),
    "pow.Scalar": lambda t: ((1.5, t(3, 4)), {}),
    "pow.Tensor_Scalar": lambda t: ((t.pos(3, 4), 1.5), {}),
    "pow.Tensor_Tensor": lambda t: ((t.pos(3, 4), t(3, 4)), {}),
    "prelu": lambda t: ((t(2, 3, 4), t(3)), {}),
    "prod": lambda t: ((t(3, 4),), {}),
    "prod.dim_int": lambda t: ((t(3, 4), 1), {}),
    "qr": lambda t: ((t(4, 3),), {}),
    "quantile": lambda t: ((t(3, 4), torch.tensor([0.25, 0.5])), {"dim": 1}),
    "quantile.scalar": lambda t: ((t(3, 4), 0.3), {"dim": 1}),
    "reciprocal": _unary,
    "reflection_pad1d": lambda t: ((t(2, 3, 5), [2, 1]), {}),
    "reflection_pad2d": lambda t: ((t(2, 3, 5, 5), [2, 1, 1, 2]), {}),
    "renorm": lambda t: ((t(3, 4), 2, 0, 0.5), {}),
    "replication_pad1d": lambda t: ((t(2, 3, 5), [2, 1]), {}),
    "replication_pad2d": lambda t: ((t(2, 3, 5, 5), [2, 1, 1, 2]), {}),
    "replication_pad3d": lambda t: ((t(1, 2, 4, 4, 4), [1, 1, 2, 0, 1, 1]), {}),
    "rms_norm": lambda t: ((t(2, 3, 4), [4], t(4)), {}),
    "rnn_relu_cell": _rnn_cell(1),
    "rnn_tanh_cell": _rnn_cell(1),
    "rsqrt": _unary,
    "scaled_dot_product_attention": lambda t: ((t(2, 3, 4, 8), t(2, 3, 5, 8), t(2, 3, 5, 8)), {}),
    "scatter_add": lambda t: ((t(5, 3), 0, torch.tensor([[0, 4, 2]]), t(1, 3)), {}),
    "sinh": _unary,
    "smooth_l1_loss": _loss,
    "soft_margin_loss": lambda t: ((t(3, 5), torch.ones(3, 5)), {}),
    "softmax.int": lambda t: ((t(3, 4), 1), {}),
    "softplus": lambda t: ((t(3, 4),), {}),
    "stack": lambda t: (([t(2, 3), t(2, 3)],), {}),
    "stft": lambda t: ((t(2, 32), 8), {"window": t.pos(8), "return_complex": True}),
    "stft.center": lambda t: ((t(2, 32), 8), {"window": t.pos(8), "return_complex": True}),
    "sum": lambda t: ((t(3, 4),), {}),
    "sum.dim_IntList": lambda t: ((t(3, 4), [1]), {}),
    "svd": lambda t: ((t(4, 3),), {}),
    "tan": lambda t: ((t(3, 4),), {}),
    "tensordot": lambda t: ((t(3, 4, 5), t(5, 4, 2), [1, 2], [1, 0]), {}),
    "trace": lambda t: ((t(3, 3),), {}),
    "triangular_solve": lambda t: ((t(3, 2), torch.linalg.cholesky(t.spd(3)).T.contiguous()), {}),
    "triplet_margin_loss": lambda t: ((t(3, 5), t(3, 5), t(3, 5)), {}),
    "upsample_bicubic2d": _upsample(2, False),
    "upsample_bilinear2d": _upsample(2, True),
    "upsample_linear1d": _upsample(1, False),
    "upsample_nearest1d": _upsample(1, None),
    "upsample_nearest2d": _upsample(2, None),
    "upsample_nearest3d": _upsample(3, None),
    "upsample_trilinear3d": _upsample(3, False),
    "vdot": lambda t: ((t(5), t(5)), {}),
    "view_as_complex": lambda t: ((t(3, 2),), {}),
}


def sample(name: str) -> Args:
    """Fresh float32 CPU inputs for one overload (`"packet"` or `"packet.overload"`)."""
    return SAMPLES[name](_T())


# --- running torch.autocast next to the reference -------------------------------------------

VARIANTS = ("float32", "lower", "mixed", "float64", "given_dtype")
"""Input variants: all float32; all in the autocast dtype; the first floating input in the
autocast dtype and the rest float32; all float64 (never cast); float32 with `dtype=` given."""


def _has_dtype_arg(op: OpOverload) -> bool:
    return any(a.name == "dtype" for a in schema(op).arguments)


def variant_inputs(op: OpOverload, args: Args, variant: str, lower: torch.dtype) -> Args | None:
    """The sample in one input variant, or None where the variant does not apply."""
    seen = [0]

    def convert(x: Any) -> Any:
        if not (isinstance(x, torch.Tensor) and x.is_floating_point()):
            return x
        seen[0] += 1
        if variant == "lower" or (variant == "mixed" and seen[0] == 1):
            return x.to(lower)
        if variant == "float64":
            return x.to(torch.float64)
        return x

    a, k = torch_pytree.tree_map(convert, args)
    if variant == "mixed" and seen[0] < 2:
        return None
    if variant == "given_dtype":
        if not _has_dtype_arg(op):
            return None
        k = {**k, "dtype": lower}
    return a, k


class _Trace(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records the aten ops below autocast: name, input dtypes and dtype arguments."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.calls: list[tuple[Any, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func.namespace != "prim":
            leaves = torch_pytree.tree_leaves((args, kwargs))
            self.calls.append(
                (
                    str(func),
                    tuple(x.dtype for x in leaves if isinstance(x, torch.Tensor)),
                    tuple(x for x in leaves if isinstance(x, torch.dtype)),
                )
            )
        return func(*args, **kwargs)


def _outcome(fn: Callable[[], Any]) -> tuple[Any, ...]:
    trace = _Trace()
    try:
        with trace:
            out = fn()
    except Exception as e:  # errors are outcomes to compare
        return ("error", type(e).__name__, str(e).split("\n\nWhile executing")[0], trace.calls)
    return ("ok", out, trace.calls)


class Autocast:
    """Turns autocast on for one device type inside the current (possibly fake) mode."""

    def __init__(self, device_type: str, dtype: torch.dtype) -> None:
        self.device_type, self.dtype = device_type, dtype

    def __enter__(self) -> None:
        self.prev = (
            torch.is_autocast_enabled(self.device_type),
            torch.get_autocast_dtype(self.device_type),
        )
        torch.set_autocast_enabled(self.device_type, True)
        torch.set_autocast_dtype(self.device_type, self.dtype)

    def __exit__(self, *exc: object) -> None:
        torch.set_autocast_enabled(self.device_type, self.prev[0])
        torch.set_autocast_dtype(self.device_type, self.prev[1])
        torch.clear_autocast_cache()


def run_both(
    rules: tuple[str, ...],
    op: OpOverload,
    args: Args,
    device_type: str,
    lower: torch.dtype,
) -> tuple[tuple[Any, ...], dict[str, tuple[Any, ...]]]:
    """torch's outcome under autocast, and the reference's outcome for each rule."""
    a, k = args

    def autocast_run() -> Any:
        with Autocast(device_type, lower):
            return op(*a, **k)

    actual = _outcome(autocast_run)

    def simulate(rule: str) -> Callable[[], Any]:
        return lambda: apply_rule(rule, op, a, k, device_type, lower)

    simulated = {r: _outcome(simulate(r)) for r in rules}
    return actual, simulated


def _bits(x: torch.Tensor) -> torch.Tensor:
    x = x.detach()
    if x.is_complex():
        x = torch.view_as_real(x.resolve_conj())
    if x.is_floating_point():
        x = x.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])
    return x


SCRATCH_OUTPUTS: dict[str, tuple[int, ...]] = {
    # oneDNN's RNN workspace: scratch memory kept for the backward pass, not a result. Where the
    # kernel really runs in bfloat16 (AVX512-BF16 CPUs) two calls on the same inputs leave
    # different bytes in it while output, hy and cy are equal bit for bit.
    "mkldnn_rnn_layer": (3,),
    # cuDNN's reserve buffer, likewise scratch for the backward pass.
    "_cudnn_rnn": (3,),
}
"""Packet → indices of outputs whose values are never compared (their dtype and shape are)."""


def same_outcome(
    actual: tuple[Any, ...],
    expected: tuple[Any, ...],
    *,
    values: bool,
    scratch: tuple[int, ...] = (),
) -> bool:
    """Same error, or same outputs (dtype, shape, device and, if `values`, bits) and casts.

    Top-level outputs at the `scratch` indices are compared without their values.
    """
    if actual[0] != expected[0] or actual[-1] != expected[-1]:
        return False
    if actual[0] == "error":
        return bool(actual[1:3] == expected[1:3])
    la, sa = torch_pytree.tree_flatten(actual[1])
    le, se = torch_pytree.tree_flatten(expected[1])
    if sa != se:
        return False
    skip: set[int] = set()
    if scratch and isinstance(actual[1], (tuple, list)):
        skip = {id(actual[1][i]) for i in scratch if i < len(actual[1])}
        skip |= {id(expected[1][i]) for i in scratch if i < len(expected[1])}
    for x, y in zip(la, le, strict=True):
        if id(x) in skip and id(y) in skip:
            if (x.dtype, x.shape, x.device) != (y.dtype, y.shape, y.device):
                return False
            continue
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if not isinstance(x, torch.Tensor):
            if x != y:
                return False
            continue
        if (x.dtype, x.shape, x.device) != (y.dtype, y.shape, y.device):
            return False
        if values and not torch.equal(_bits(x), _bits(y)):
            return False
    return True


def overload_of(name: str) -> OpOverload:
    packet, _, overload = name.partition(".")
    op: OpOverload = getattr(getattr(torch.ops.aten, packet), overload or "default")
    return op


def check_op(
    device_type: str, name: str, lower: torch.dtype, rules: tuple[str, ...], *, fake: bool
) -> tuple[set[str], int, int]:
    """Run one overload under torch's autocast and under the reference for each rule.

    Real tensors (CPU, or moved to a real device) compare bits; fake tensors (any device type: their
    `Autocast<Device>` kernels still run) compare dtypes, shapes and devices. Every run also
    compares the ops dispatched below autocast (the casts and what they feed).

    Returns:
        The rules that matched torch in every input variant, how many variants ran without an
        error under torch, and how many casts torch's kernel dispatched.
    """
    op = overload_of(name)
    with warnings.catch_warnings():
        # torch's deprecation notices for old linalg ops (torch.cholesky, ...) are not under test
        warnings.simplefilter("ignore", UserWarning)
        return _check_op(device_type, op, sample(name), lower, rules, fake=fake)


def _check_op(
    device_type: str,
    op: OpOverload,
    base: Args,
    lower: torch.dtype,
    rules: tuple[str, ...],
    *,
    fake: bool,
) -> tuple[set[str], int, int]:
    consistent, ran, casts = set(rules), 0, 0
    for variant in VARIANTS:
        inputs = variant_inputs(op, base, variant, lower)
        if inputs is None:
            continue
        if not fake:
            # Real tensors: CPU samples, moved to the device (a GPU for CUDA's real-tensor check).
            if device_type != "cpu":
                inputs = torch_pytree.tree_map(
                    lambda x: x.to(device_type) if isinstance(x, torch.Tensor) else x, inputs
                )
            actual, simulated = run_both(rules, op, inputs, device_type, lower)
        else:
            with fake_tensor_mode(allow_non_fake_inputs=True):
                # Fake tensors carry no values: only dtypes and shapes are compared.
                moved = torch_pytree.tree_map(
                    lambda x: (
                        torch.empty(x.shape, dtype=x.dtype, device=device_type)
                        if isinstance(x, torch.Tensor)
                        else x
                    ),
                    inputs,
                )
                actual, simulated = run_both(rules, op, moved, device_type, lower)
        ran += actual[0] == "ok"
        casts += sum(call[0] == "aten._to_copy.default" for call in actual[-1])
        scratch = SCRATCH_OUTPUTS.get(names(op)[0], ())
        consistent &= {
            r for r in rules if same_outcome(actual, simulated[r], values=not fake, scratch=scratch)
        }
    return consistent, ran, casts


# --- deriving the rules of a torch release ------------------------------------------------------

DTYPES = (torch.bfloat16, torch.float16)


def _display(packet: str, overload: str) -> str:
    return packet if overload == "default" else f"{packet}.{overload}"


def derive_rules(
    device_type: str,
    ops: list[tuple[str, str]],
    prior: dict[tuple[str, str], str],
    *,
    exhaustive: bool = False,
) -> tuple[dict[tuple[str, str], str], dict[str, str]]:
    """Each op's rule: the one rule whose reference agrees with torch's autocast in every run.

    Every op runs on fake tensors of `device_type` (which reach torch's `Autocast<Device>`
    kernel without computing) in bfloat16 and float16, in every input variant, under torch's
    autocast and under the reference for the `prior` rule (the newest shipped table's), which is
    taken if it agrees in every run; otherwise, or if `exhaustive`, under the reference for
    every rule, and the one that agrees is taken (the prior one if several agree). `exhaustive`
    also runs CPU ops on real tensors, comparing bits.

    Returns:
        (packet, overload) → rule for the classified ops, and op name → why for the others.
    """
    from famp._autocast.rules import RULE_NAMES

    derived: dict[tuple[str, str], str] = {}
    unclassified: dict[str, str] = {}
    real = [False] if exhaustive and device_type == "cpu" else []
    for packet, overload in ops:
        name = _display(packet, overload)
        if name not in SAMPLES:
            unclassified[name] = "famp has no sample inputs for it"
            continue
        runs = [(dtype, fake) for dtype in DTYPES for fake in [True, *real]]
        guess = prior.get((packet, overload))
        # The newest shipped table's rule, checked in every run, is enough when it agrees.
        if (
            not exhaustive
            and guess is not None
            and all(check_op(device_type, name, d, (guess,), fake=f)[0] for d, f in runs)
        ):
            derived[(packet, overload)] = guess
            continue
        agree = set(RULE_NAMES)
        for dtype, fake in runs:
            agree &= check_op(device_type, name, dtype, RULE_NAMES, fake=fake)[0]
        if len(agree) == 1:
            derived[(packet, overload)] = agree.pop()
        elif prior.get((packet, overload)) in agree:
            derived[(packet, overload)] = prior[(packet, overload)]
        elif agree:
            unclassified[name] = f"rules {', '.join(sorted(agree))} all agree with torch"
        else:
            unclassified[name] = "no rule agrees with torch"
    return derived, unclassified


def main() -> int:
    """Derive the running torch's tables (fake tensors everywhere, real ones on CPU) and write
    them into `famp/_autocast/rules_data.py` under its release; the other releases are kept."""
    import logging
    import pathlib
    import time

    from famp._autocast import rules_data, tables
    from famp._autocast.defaults import WRAPPER_RULES

    logging.disable(logging.CRITICAL)  # fake tensors log the errors they re-raise
    release = tables.torch_release()
    shipped = {r: t for r, t in tables.shipped_tables().items() if r != release}
    prior_release = max(shipped, key=tables.release_key) if shipped else None
    new: dict[str, tables.Table] = {}
    failed = False
    for device in tables.DEVICE_TYPES:
        start = time.perf_counter()
        prior = tables.expand(shipped[prior_release][device]) if prior_release else {}
        wrappers = WRAPPER_RULES.get(device, {})
        registered = tables.registered_ops(device)
        ops = sorted(registered - wrappers.keys())
        derived, unclassified = derive_rules(device, ops, prior, exhaustive=True)
        derived.update((op, r) for op, r in wrappers.items() if op in registered)
        for name, why in sorted(unclassified.items()):
            print(f"    {device}: cannot classify {name}: {why}")
            failed = True
        keys = tables.rule_keys(derived)
        new[device] = tables.by_rule(keys)
        print(f"{device}: {len(ops)} ops, {len(keys)} keys, {time.perf_counter() - start:.1f} s")
    if failed:
        return 1
    shipped[release] = new
    path = pathlib.Path(rules_data.__file__)
    text = path.read_text()
    head = text[: text.index("BASE_RELEASE = ")]
    path.write_text(head + tables.store(shipped))
    print(f"wrote torch {release}'s tables into {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
