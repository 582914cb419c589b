"""Sample inputs for every overload with an autocast kernel: small deterministic float32 tensors.

Float32 whatever torch's default dtype: under `torch.set_default_dtype(torch.float64)` torch's
autocast casts none of them, and every rule would agree with it.

`compare.py` runs each op on them (in five input variants) under torch's autocast and under the
reference of each rule. An op that a new torch autocasts needs a sample here before its rule can
be derived.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from famp._autocast.reference import Args

F32 = torch.float32


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


class _T:
    """Deterministic small CPU tensors."""

    def __init__(self) -> None:
        self.g = _gen()

    def __call__(self, *shape: int, lo: float = -1.0, hi: float = 1.0) -> torch.Tensor:
        return torch.rand(shape, generator=self.g, dtype=F32) * (hi - lo) + lo

    def pos(self, *shape: int) -> torch.Tensor:
        return self(*shape, lo=0.5, hi=2.0)

    def spd(self, n: int) -> torch.Tensor:
        a = self(n, n)
        return a @ a.T + n * torch.eye(n, dtype=F32)

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
    "cosine_embedding_loss": lambda t: (
        (t(3, 5), t(3, 5), torch.tensor([1.0, -1.0, 1.0], dtype=F32)),
        {},
    ),
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
    "hinge_embedding_loss": lambda t: ((t(3, 5), torch.ones(3, 5, dtype=F32)), {}),
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
    "margin_ranking_loss": lambda t: (
        (t(5), t(5), torch.tensor([1.0, -1, 1, -1, 1], dtype=F32)),
        {},
    ),
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
    "nanquantile": lambda t: ((t(3, 4), torch.tensor([0.25, 0.5], dtype=F32)), {"dim": 1}),
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
    "quantile": lambda t: ((t(3, 4), torch.tensor([0.25, 0.5], dtype=F32)), {"dim": 1}),
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
    "soft_margin_loss": lambda t: ((t(3, 5), torch.ones(3, 5, dtype=F32)), {}),
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
