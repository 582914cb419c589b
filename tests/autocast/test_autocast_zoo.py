"""famp.autocast with the default rules equals torch.autocast on a model zoo, op by op, bitwise.

For every model, dtype (bfloat16, float16 on CPU) and composition (plain autograd, and
`torch.func.grad_and_value` around both), the dtype of every op's output (forward and backward,
recorded by a TorchDispatchMode), the loss and every gradient are equal to torch's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import famp
from tests.helpers import assert_bitwise_equal


class DtypeLog(TorchDispatchMode):
    """Records (aten op, output dtypes) for every op that reaches dispatch."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[torch.dtype, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves(out)
        self.ops.append((str(func), tuple(t.dtype for t in leaves if isinstance(t, torch.Tensor))))
        return out


# --- the zoo: (module, loss(module, *inputs), inputs) --------------------------------------------


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 4, 3),
            nn.BatchNorm2d(4),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(4, 4, 3, padding=1),
            nn.AvgPool2d(2),
            nn.Flatten(),
            nn.Linear(4 * 2 * 2, 5),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class TiedLM(nn.Module):
    """Embedding + layer norm + an output projection tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.proj(self.emb(tokens)))
        return h @ self.emb.weight.T


class EinsumAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = torch.einsum("bid,bjd->bij", q, k) / 8**0.5
        attn = scores.softmax(-1)
        return torch.bmm(attn, v) + torch.baddbmm(v, attn, v)


class CellLoop(nn.Module):
    """An LSTMCell applied step by step: its weights are used (and cast) once per step."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(4, 6)
        self.gru = nn.GRUCell(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = c = torch.zeros(x.shape[1], 6)
        outs = []
        for step in x:
            h, c = self.cell(step, (h, c))
            outs.append(self.gru(h))
        return torch.stack(outs)


def _target(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


def _cnn() -> tuple[nn.Module, Callable[..., Any], tuple[Any, ...]]:
    labels = torch.tensor([0, 3, 4])
    return CNN(), lambda m, x: F.cross_entropy(m(x), labels), (torch.randn(3, 3, 10, 10),)


def _encoder() -> tuple[nn.Module, Callable[..., Any], tuple[Any, ...]]:
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    target = _target(2, 5, 8)
    return layer, lambda m, x: F.mse_loss(m(x), target), (torch.randn(2, 5, 8),)


def _encoder_norm_first() -> tuple[nn.Module, Callable[..., Any], tuple[Any, ...]]:
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, norm_first=True)
    mask = nn.Transformer.generate_square_subsequent_mask(5)
    return layer, lambda m, x: m(x, src_mask=mask).abs().mean(), (torch.randn(2, 5, 8),)


def _mha() -> tuple[nn.Module, Callable[..., Any], tuple[Any, ...]]:
    mha = nn.MultiheadAttention(8, 2, kdim=6, vdim=4)
    padding = torch.tensor([[False, False, True], [False, False, False]])

    def loss(m: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out, weights = m(q, k, v, key_padding_mask=padding)
        return out.pow(2).sum() + weights.sum()

    return mha, loss, (torch.randn(4, 2, 8), torch.randn(3, 2, 6), torch.randn(3, 2, 4))


def _gru() -> tuple[nn.Module, Callable[..., Any], tuple[Any, ...]]:
    gru = nn.GRU(4, 6, num_layers=2, batch_first=True)
    target = _target(2, 5, 6)
    return gru, lambda m, x: F.smooth_l1_loss(m(x)[0], target), (torch.randn(2, 5, 4),)


def _rnn() -> tuple[nn.Module, Callable[..., Any], tuple[Any, ...]]:
    rnn = nn.RNN(4, 6, bidirectional=True)
    return rnn, lambda m, x: F.huber_loss(m(x)[0], _target(5, 2, 12)), (torch.randn(5, 2, 4),)


def _cells() -> tuple[nn.Module, Callable[..., Any], tuple[Any, ...]]:
    return CellLoop(), lambda m, x: F.l1_loss(m(x), _target(4, 3, 6)), (torch.randn(4, 3, 4),)


def _tied() -> tuple[nn.Module, Callable[..., Any], tuple[Any, ...]]:
    tokens = torch.tensor([[1, 2, 3, 10], [4, 5, 6, 0]])
    labels = torch.tensor([[2, 3, 4, 5], [6, 7, 8, 9]])

    def loss(m: nn.Module, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(m(t).flatten(0, 1), labels.flatten())

    return TiedLM(), loss, (tokens,)


def _einsum() -> tuple[nn.Module, Callable[..., Any], tuple[Any, ...]]:
    probs = _target(2, 5, 8).softmax(-1)

    def loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.kl_div(F.log_softmax(m(x), -1), probs, reduction="batchmean")

    return EinsumAttention(), loss, (torch.randn(2, 5, 8),)


def _losses() -> tuple[nn.Module, Callable[..., Any], tuple[Any, ...]]:
    head = nn.Linear(6, 4)
    labels = torch.tensor([1, 0, 3])
    soft = _target(3, 4).sigmoid()

    def loss(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        y = m(x)
        return (
            F.binary_cross_entropy_with_logits(y, soft)
            + F.binary_cross_entropy(y.sigmoid(), soft)
            + F.nll_loss(F.log_softmax(y, -1), labels)
            + F.mse_loss(y, soft)
            + F.cosine_embedding_loss(y, soft, torch.tensor([1, -1, 1]))
            + F.margin_ranking_loss(y[:, 0], y[:, 1], torch.tensor([1.0, -1.0, 1.0]))
            + F.soft_margin_loss(y, soft.sign())
            + F.poisson_nll_loss(y, soft)
            + torch.logsumexp(y, -1).sum()
            + y.norm()
        )

    return head, loss, (torch.randn(3, 6),)


def _lstm() -> tuple[nn.Module, Callable[..., Any], tuple[Any, ...]]:
    lstm = nn.LSTM(4, 6, batch_first=True)
    return lstm, lambda m, x: m(x)[0].pow(2).mean(), (torch.randn(2, 5, 4),)


ZOO = {
    "cnn_batchnorm_pool": _cnn,
    "transformer_encoder": _encoder,
    "transformer_encoder_norm_first": _encoder_norm_first,
    "multihead_attention": _mha,
    "gru": _gru,
    "rnn_bidirectional": _rnn,
    "lstm_cell_gru_cell_loop": _cells,
    "embedding_layernorm_tied": _tied,
    "einsum_bmm_attention": _einsum,
    "losses": _losses,
    "lstm": _lstm,
}
DTYPES = [torch.bfloat16, torch.float16]


def _build(name: str) -> tuple[nn.Module, Callable[..., Any], tuple[Any, ...]]:
    torch.manual_seed(0)
    return ZOO[name]()


def _torch_loss(dtype: torch.dtype, loss: Callable[..., Any], policy: famp.Policy) -> Any:
    def run(model: nn.Module, *inputs: Any) -> Any:
        with torch.autocast("cpu", dtype=dtype):
            out = loss(model, *inputs)
        return policy.cast_to_output(out)

    return run


def _outcome(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except RuntimeError as e:  # torch's own kernels may refuse a dtype on this CPU (oneDNN LSTM)
        return e


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_autograd_matches_torch_autocast_op_by_op(name: str, dtype: torch.dtype) -> None:
    model, loss, inputs = _build(name)
    policy = famp.Policy(torch.float32, dtype, torch.float32)
    results = []
    for run in (_torch_loss(dtype, loss, policy), famp.autocast(loss, policy)):
        m = copy.deepcopy(model)  # BatchNorm updates its running stats in place
        params = [p for p in m.parameters() if p.requires_grad]

        def step(m: nn.Module = m, params: list[torch.Tensor] = params, run: Any = run) -> Any:
            with DtypeLog() as log:
                value = run(m, *inputs)
                grads = torch.autograd.grad(value, params)
            return value, grads, log.ops, [b.clone() for b in m.buffers()]

        results.append(_outcome(step))
    expected, actual = results
    if isinstance(expected, RuntimeError):
        assert isinstance(actual, RuntimeError)
        assert str(actual) == str(expected)
        return
    assert not isinstance(actual, RuntimeError), actual
    (value, grads, ops, buffers), (e_value, e_grads, e_ops, e_buffers) = actual, expected
    assert ops == e_ops
    assert any(dtype in dtypes for _, dtypes in ops), "nothing ran in the compute dtype"
    assert value.dtype == torch.float32
    assert_bitwise_equal(value, e_value)
    for g, e in zip(grads, e_grads, strict=True):
        assert g.dtype == torch.float32
        assert_bitwise_equal(g, e)
    for b, e in zip(buffers, e_buffers, strict=True):
        assert_bitwise_equal(b, e)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "f16"])
@pytest.mark.parametrize("name", [n for n in ZOO if n != "lstm"])
def test_zoo_func_grad_matches_torch_autocast(name: str, dtype: torch.dtype) -> None:
    model, loss, inputs = _build(name)
    policy = famp.Policy(torch.float32, dtype, torch.float32)
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.clone() for k, v in model.named_buffers()}

    def functional(p: dict[str, torch.Tensor], *xs: Any) -> Any:
        state = (p, {k: v.clone() for k, v in buffers.items()})
        return loss(lambda *a, **k: torch.func.functional_call(model, state, a, k), *xs)

    def torch_value(p: dict[str, torch.Tensor], *xs: Any) -> Any:
        with torch.autocast("cpu", dtype=dtype):
            out = functional(p, *xs)
        return policy.cast_to_output(out)

    expected = torch.func.grad_and_value(torch_value)(params, *inputs)
    actual = torch.func.grad_and_value(famp.autocast(functional, policy))(params, *inputs)
    (grads, value), (e_grads, e_value) = actual, expected
    assert_bitwise_equal(value, e_value)
    assert grads.keys() == e_grads.keys()
    for key in grads:
        assert grads[key].dtype == params[key].dtype
        assert_bitwise_equal(grads[key], e_grads[key])
