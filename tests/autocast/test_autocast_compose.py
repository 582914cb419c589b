"""famp.autocast composed with what users wrap around it or run inside it: the composition matrix.

Each cell compares famp bit for bit with its reference: with the default rules `torch.autocast`
on the same model in the same composition; with overrides or module rules, the same rules on the
plain eager run. docs/autocast.md's "Compatibility" table names the test of each cell.
"""

from __future__ import annotations

import copy
import functools
import gc
import pathlib
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given
from torch import nn
from torch.autograd import forward_ad
from torch.nn import functional as F  # noqa: N812

import famp
from famp._autocast import tree_casts
from tests.helpers import assert_bitwise_equal, famp_and_uncached_autocast, rank_files, torchrun

BF16 = torch.bfloat16

# --- the weight-cast cache against writes through aliases -----------------------------------------
# Reference: the same function under torch.autocast with torch's cast cache off, where every use
# casts the weight afresh.


def _write_data(lin: nn.Linear) -> None:
    lin.weight.data.add_(1.0)


def _write_detach(lin: nn.Linear) -> None:
    lin.weight.detach().add_(1.0)


def _write_state_dict(lin: nn.Linear) -> None:
    sd = lin.state_dict()
    sd["weight"].copy_(sd["weight"] * 0.5 + 1.0)


def _write_foreach(lin: nn.Linear) -> None:
    torch._foreach_mul_([p.detach() for p in lin.parameters()], 2.0)


def _write_view_no_grad(lin: nn.Linear) -> None:
    lin.weight.view(-1).add_(1.0)


def _write_data_set(lin: nn.Linear) -> None:
    lin.weight.data = lin.weight.data + 1.0


def _write_swa(lin: nn.Linear) -> None:
    # AveragedModel's EMA update: `_foreach_lerp_` (or copy_) on the averaged parameters' detach().
    torch._foreach_lerp_(
        [p.detach() for p in lin.parameters()], [torch.ones_like(p) for p in lin.parameters()], 0.5
    )


def _write_out_kwarg(lin: nn.Linear) -> None:
    # An `out=` write whose first argument is another tensor: the written tensor is `out`.
    torch.add(torch.ones_like(lin.weight), lin.weight.data, out=lin.weight.data)


def _write_inplace_flag(lin: nn.Linear) -> None:
    # torch's Python functions with an `inplace` flag write with `torch.relu_` and the like.
    F.relu(lin.weight.data, inplace=True)


def _write_inplace_flag_positional(lin: nn.Linear) -> None:
    F.hardtanh(lin.weight.data, -0.1, 0.1, True)  # the flag passed by position


def _write_inplace_module(lin: nn.Linear) -> None:
    nn.ReLU(inplace=True)(lin.weight.data)  # its forward passes `inplace=True` by keyword


def _write_setitem(lin: nn.Linear) -> None:
    lin.weight[0] = 1.0  # Tensor.__setitem__: index_put_ on the weight itself


def _write_init(lin: nn.Linear) -> None:
    nn.init.normal_(lin.weight, generator=torch.Generator().manual_seed(5))  # in-place random


def _write_vector_to_parameters(lin: nn.Linear) -> None:
    flat = torch.nn.utils.parameters_to_vector(lin.parameters())
    torch.nn.utils.vector_to_parameters(flat * 0.5 + 1.0, lin.parameters())


def _step(optimizer: type[torch.optim.Optimizer], **options: Any) -> Callable[[nn.Linear], None]:
    """An optimizer step on the weights, as a training loop inside the call would take it."""

    def write(lin: nn.Linear) -> None:
        for p in lin.parameters():
            p.grad = torch.ones_like(p)
        optimizer(lin.parameters(), lr=0.5, **options).step()
        for p in lin.parameters():
            p.grad = None

    return write


def _write_load_state_dict(lin: nn.Linear, assign: bool = False) -> None:
    lin.load_state_dict({k: v + 1.0 for k, v in lin.state_dict().items()}, assign=assign)


ALIAS_WRITES: dict[str, Callable[[nn.Linear], None]] = {
    "out_kwarg": _write_out_kwarg,
    "data": _write_data,
    "detach": _write_detach,
    "state_dict": _write_state_dict,
    "foreach_detached": _write_foreach,
    "view_made_under_no_grad": _write_view_no_grad,
    "data_assignment": _write_data_set,
    "ema_lerp": _write_swa,
    "setitem": _write_setitem,
    "inplace_flag": _write_inplace_flag,
    "inplace_flag_positional": _write_inplace_flag_positional,
    "inplace_module": _write_inplace_module,
    "init_normal": _write_init,
    "vector_to_parameters": _write_vector_to_parameters,
    "sgd_step": _step(torch.optim.SGD, foreach=False),
    "sgd_step_foreach": _step(torch.optim.SGD, foreach=True),
    "adamw_step_fused": _step(torch.optim.AdamW, fused=True),
    "load_state_dict": _write_load_state_dict,
    "load_state_dict_assign": functools.partial(_write_load_state_dict, assign=True),
}


def _write_between_uses(write: Callable[[nn.Linear], None]) -> tuple[nn.Linear, Callable[..., Any]]:
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        first = lin(x)
        with torch.no_grad():
            write(lin)
        return first, lin(x)

    return lin, f


def _options(kind: str) -> dict[str, Any]:
    """famp.autocast's keyword arguments for each kind of interception (rules built lazily)."""
    if kind == "override":
        return {"rules": famp.default_rules("cpu").override({"rms_norm": "lower"})}
    if kind == "module_rule":
        return {"module_rules": {"": "c=bf16,o=bf16"}}  # "": the module the function calls
    return {"track_casts": kind == "track_casts"}


@pytest.mark.parametrize("kind", ["track_casts", "override", "module_rule"])
@pytest.mark.parametrize("write", sorted(ALIAS_WRITES))
def test_cast_cache_sees_writes_through_aliases(write: str, kind: str) -> None:
    x = torch.randn(4, 8)
    lin, f = _write_between_uses(ALIAS_WRITES[write])
    (first, second), (ref_first, ref_second) = famp_and_uncached_autocast(
        f, lin, x, **_options(kind)
    )
    assert second.dtype == BF16
    assert ref_second.dtype == BF16
    assert_bitwise_equal(first, ref_first)
    assert_bitwise_equal(second, ref_second)
    assert not torch.equal(second, first)  # the write changed the weight: a stale cast would show


@pytest.mark.parametrize("kind", ["default", "track_casts", "override"])
def test_swapping_a_cast_weight_fails_where_torch_autocast_fails(kind: str) -> None:
    # torch.utils.swap_tensors refuses a weight that torch's cast cache holds a reference to;
    # famp keeps torch's cache (and its error); without the cache, the swap goes through.
    def swap(lin: nn.Linear) -> None:
        torch.utils.swap_tensors(lin.weight, nn.Parameter(lin.weight.detach() + 1.0))

    x = torch.randn(4, 8)
    _, f = _write_between_uses(swap)
    with pytest.raises(RuntimeError) as theirs, torch.autocast("cpu", dtype=BF16):
        f(x)
    _, f = _write_between_uses(swap)
    options = {} if kind == "default" else _options(kind)
    with pytest.raises(RuntimeError) as ours:
        famp.autocast(f, "c=bf16,o=bf16", **options)(x)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("rnn", ["RNN", "LSTM"])
@pytest.mark.parametrize("kind", ["track_casts", "override", "module_rule"])
def test_cast_cache_sees_writes_to_weights_an_op_reads_in_a_list(kind: str, rnn: str) -> None:
    # nn.RNN and nn.LSTM hand their weights to torch.rnn_tanh / torch.lstm as one list argument;
    # torch's autocast caches their casts like any other weight's. On a CPU without AVX512-BF16
    # (AVX2 only) torch's bfloat16 LSTM of a float32 input fails in oneDNN under autocast: famp
    # fails alike there, but for the module rule, which casts the module's input to bfloat16
    # first (as documented), and so equals torch.autocast given that input, which runs.
    torch.manual_seed(0)
    module = getattr(nn, rnn)(8, 8, batch_first=True)
    x = torch.randn(2, 3, 8)
    alias = module.weight_hh_l0.detach()  # made outside the call: the write names no weight

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        first = module(x)[0]
        with torch.no_grad():
            alias.add_(0.5)  # weight_hh_l0 is read only in the op's list of weights
        return first, module(x)[0]

    state = copy.deepcopy(module.state_dict())
    refused: RuntimeError | None = None
    try:
        with torch.autocast("cpu", dtype=BF16, cache_enabled=False):
            ref_first, ref_second = f(x.to(BF16) if kind == "module_rule" else x)
    except RuntimeError as error:  # this CPU's oneDNN has no bfloat16 LSTM
        refused = error
    module.load_state_dict(state)
    if refused is not None:
        with pytest.raises(RuntimeError) as ours:
            famp.autocast(f, "c=bf16,o=bf16", **_options(kind))(x)
        assert str(ours.value) == str(refused)
        return
    first, second = famp.autocast(f, "c=bf16,o=bf16", **_options(kind))(x)
    assert second.dtype == BF16
    assert_bitwise_equal(first, ref_first)
    assert_bitwise_equal(second, ref_second)
    assert not torch.equal(second, first)


@pytest.mark.parametrize("kind", ["track_casts", "override", "module_rule"])
def test_cast_cache_sees_an_out_write_into_a_weights_data_with_grad_enabled(kind: str) -> None:
    # With grad enabled, an op whose name writes nothing takes famp's shorter path per op; its
    # write through `out=` into `.data` (a version counter of its own) must still drop the casts.
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8)

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        first = lin(x)
        torch.add(torch.ones_like(lin.weight), lin.weight.data, out=lin.weight.data)
        return first, lin(x)

    state = copy.deepcopy(lin.state_dict())
    transform = famp.autocast(f, "c=bf16,o=bf16", **_options(kind))
    transform(x)  # a second call too: per-op answers are kept from an op's first call
    lin.load_state_dict(state)
    first, second = transform(x)
    lin.load_state_dict(state)
    with torch.autocast("cpu", dtype=BF16, cache_enabled=False):
        ref_first, ref_second = f(x)
    assert_bitwise_equal(first, ref_first)
    assert_bitwise_equal(second, ref_second)
    assert not torch.equal(second, first)


def test_the_reference_for_alias_writes_differs_from_torch_autocast_with_its_cache() -> None:
    # The cells above can fail: torch's own cache reads the stale cast after a write via `.data`.
    x = torch.randn(4, 8)
    _, f = _write_between_uses(_write_data)
    with torch.autocast("cpu", dtype=BF16):
        first, second = f(x)
    assert_bitwise_equal(first, second)


# --- torch's inference fast paths (nn.TransformerEncoder, nn.MultiheadAttention) -----------------
# In eval mode without grad torch runs these on fused kernels unless an argument "has a torch
# function", which famp's op interception would make true. famp leaves them to torch.


def _encoder(nested: bool) -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # enable_nested_tensor's notes about its own conditions
        return nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested).eval()


def _padding_mask() -> torch.Tensor:
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[0, 3:] = True
    return mask


FAST_PATH_OPTIONS: dict[str, dict[str, Any]] = {
    "track_casts": {"track_casts": True},
    # A rule casts the module's inputs: the reference casts them too.
    "module_rule": {"module_rules": {"": "c=bf16,o=bf16"}},  # "": the module f calls
}


@pytest.mark.parametrize("grad_mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("kind", sorted(FAST_PATH_OPTIONS))
@pytest.mark.parametrize("module", ["encoder", "attention"])
def test_inference_fast_path_gives_torch_autocast_bits(
    module: str, kind: str, grad_mode: str
) -> None:
    x, mask = torch.randn(3, 5, 16), _padding_mask()
    if module == "encoder":
        enc = _encoder(nested=False)

        def f(x: torch.Tensor) -> torch.Tensor:
            return enc(x, src_key_padding_mask=mask)
    else:
        torch.manual_seed(0)
        mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()

        def f(x: torch.Tensor) -> torch.Tensor:
            return mha(x, x, x, key_padding_mask=mask, need_weights=False)[0]

    context = torch.no_grad if grad_mode == "no_grad" else torch.inference_mode
    with context():
        with torch.autocast("cpu", dtype=BF16):
            expected = f(x.to(BF16) if kind == "module_rule" else x)
        actual = famp.autocast(f, "c=bf16,o=bf16", **FAST_PATH_OPTIONS[kind])(x)
    assert actual.dtype == BF16
    assert_bitwise_equal(actual, expected)


class _Holder(nn.Module):
    """A model that holds the encoder two levels down, beside a layer of its own."""

    def __init__(self, enc: nn.Module) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.blocks = nn.ModuleList([nn.Sequential(enc)])
        self.head = nn.Linear(16, 4).eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks[0](x))


@pytest.mark.parametrize("kind", ["track_casts", "override"])
def test_inference_fast_path_deep_in_the_module_called_gives_torch_autocast_bits(
    kind: str,
) -> None:
    # famp hooks module calls only where a fast-path module may be entered: a module called
    # directly holds one deep in its tree here, so the hook is there and declines it.
    import torch.nn.modules.module as torch_module

    model, x = _Holder(_encoder(nested=False)), torch.randn(3, 5, 16)
    options: dict[str, Any] = (
        {"track_casts": True}
        if kind == "track_casts"
        else {"rules": famp.default_rules("cpu").override({"rms_norm": "lower"})}  # no op here
    )
    hooked: list[bool] = []
    model.head.register_forward_pre_hook(
        lambda m, args: hooked.append(bool(torch_module._global_forward_pre_hooks))
    )
    with torch.no_grad():
        with torch.autocast("cpu", dtype=BF16):
            expected = model(x)
        f = famp.autocast(model, "c=bf16,o=bf16", **options)
        if kind == "override":
            with pytest.warns(famp.AutocastWarning, match="do not apply inside TransformerEncoder"):
                actual = f(x)
        else:
            actual = f(x)
        assert hooked == [False, True]
        assert_bitwise_equal(actual, expected)
        # Without it in the tree, famp registers no global module hook for the call at all.
        alone = famp.autocast(model.head, "c=bf16,o=bf16", **options)(x)
        assert hooked[-1] is False
        with torch.autocast("cpu", dtype=BF16):
            assert_bitwise_equal(alone, model.head(x))


class _Layers(nn.Module):
    """Encoder layers called with keyword inputs, the first twice, as nn.TransformerEncoder calls
    its layers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True) for _ in range(2)
        )

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, padding: torch.Tensor, layer: Callable[..., Any]
    ) -> torch.Tensor:
        for i in (0, 0, 1):
            x = layer(self.layers[i], x, src_mask=mask, src_key_padding_mask=padding)
        return x


@pytest.mark.parametrize("compute", ["bfloat16", "float16"])
@pytest.mark.parametrize("pattern", ["layers.?", "layers.0"])
def test_inference_fast_path_of_a_layer_a_module_rule_matches_gives_torch_autocast_bits(
    pattern: str, compute: str
) -> None:
    # nn.TransformerEncoderLayer takes no fast path while one of its modules has a hook: famp's
    # keyword cast for the layer a rule matches must not keep it off that path (its pre-hook did
    # before 2026-11-30: the composite path's bits; since 2026-12-01 famp puts none there). The
    # reference: each matched layer run by hand under torch.autocast, its inputs, positional and
    # keyword, cast as the rule casts them.
    model, dtype = _Layers().eval(), getattr(torch, compute)
    x = torch.randn(3, 5, 16)
    mask = torch.triu(torch.full((5, 5), -30.0), diagonal=1)  # float masks: the rule casts them
    padding = torch.where(_padding_mask(), -30.0, 0.0)
    matched = {0, 1} if pattern == "layers.?" else {0}  # "*" would match the layers' modules

    def by_hand(layer: nn.Module, h: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        if not any(layer is model.layers[i] for i in matched):
            return layer(h, **kwargs)  # type: ignore[no-any-return]
        cast = {k: v.to(dtype) if v.is_floating_point() else v for k, v in kwargs.items()}
        with torch.autocast("cpu", dtype=dtype):
            return layer(h.to(dtype), **cast).float()  # type: ignore[no-any-return]

    hooked: list[bool] = []

    def plain(layer: nn.Module, h: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        hooked.append(bool(layer._forward_pre_hooks))  # none of famp's
        return layer(h, **kwargs)  # type: ignore[no-any-return]

    f = famp.autocast(model, "f32", module_rules={pattern: f"c={compute},o=f32"})
    with torch.no_grad():
        expected = model(x, mask, padding, by_hand)
        for _ in range(2):
            assert_bitwise_equal(f(x, mask, padding, plain), expected)
        assert hooked == [False] * 6
        with torch.autocast("cpu", dtype=dtype):  # the composite path's bits differ: on grad
            composite = _Layers()(x.to(dtype), mask.to(dtype), padding.to(dtype), plain)
    assert not torch.equal(composite.float(), expected)
    for layer in model.layers:  # famp's pre-hooks are off the layers again
        assert not layer._forward_pre_hooks
        assert not layer._forward_pre_hooks_with_kwargs
    # With grad the layers run their composite path, where famp's interception casts as torch.
    assert_bitwise_equal(f(x, mask, padding, plain), model(x, mask, padding, by_hand))


def test_compiled_rule_on_a_fast_path_layer_runs_its_composite_path() -> None:
    # Compiled, famp's keyword hook is in the traced hook dicts: the layer takes its composite
    # path, whose eager bits aot_eager gives. torch traces the fast path of a layer under
    # torch.autocast by hand and fails when run: there is no compiled reference to match.
    model, x = _Layers().eval(), torch.randn(3, 5, 16)
    first = model.layers[0]

    def plain(layer: nn.Module, h: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        return layer(h)  # type: ignore[no-any-return]

    def ruled(h: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16):
            return first(first(h.to(BF16)).to(BF16))  # type: ignore[no-any-return]

    def by_hand(h: torch.Tensor, fast: bool = True) -> torch.Tensor:
        torch.backends.mha.set_fastpath_enabled(fast)  # for the first layer
        try:
            h = ruled(h)
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
        return model.layers[1](h.float())  # type: ignore[no-any-return]

    f = famp.autocast(model, "f32", module_rules={"layers.0": "c=bf16,o=f32"})
    with torch.no_grad():
        actual = torch.compile(f, fullgraph=True, backend="aot_eager")(x, None, None, plain)
        with pytest.raises(RuntimeError, match="same dtype"):
            torch.compile(ruled, fullgraph=True, backend="aot_eager")(x)
        assert not torch.equal(actual, by_hand(x))  # the eager fast path's bits
        assert_bitwise_equal(actual, by_hand(x, fast=False))


def test_a_keyboard_interrupt_in_a_layers_fast_path_leaves_no_hook_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # famp's keyword pre-hook steps aside while a matched layer runs its fast path, and comes
    # back as the layer is left, unless the call's hooks were taken off first.
    model, x = _Layers().eval(), torch.randn(3, 5, 16)
    fused = torch._transformer_encoder_layer_fwd

    def interrupted(*args: Any) -> Any:
        raise KeyboardInterrupt

    def plain(layer: nn.Module, h: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        return layer(h)  # type: ignore[no-any-return]

    f = famp.autocast(model, "f32", module_rules={"layers.?": "c=bf16,o=f32"})
    with torch.no_grad():
        monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", interrupted)
        with pytest.raises(KeyboardInterrupt):
            f(x, None, None, plain)
        monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", fused)
        for layer in model.layers:
            assert not layer._forward_pre_hooks
        with torch.autocast("cpu", dtype=BF16):
            expected = model.layers[1](model.layers[0](model.layers[0](x.to(BF16))))
        assert_bitwise_equal(f(x, None, None, plain), expected.float())  # bf16 → f32 → bf16: same


def test_inference_fast_path_with_overrides_warns_that_they_do_not_apply_there() -> None:
    x, mask = torch.randn(3, 5, 16), _padding_mask()
    enc = _encoder(nested=False)
    rules = famp.default_rules("cpu").override({"linear": "float32"})
    with torch.no_grad():
        with torch.autocast("cpu", dtype=BF16):
            expected = enc(x, src_key_padding_mask=mask)
        f = famp.autocast(lambda x: enc(x, src_key_padding_mask=mask), "c=bf16,o=bf16", rules=rules)
        with pytest.warns(famp.AutocastWarning, match="overrides do not apply inside"):
            actual = f(x)
        assert_bitwise_equal(actual, expected)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            f(x)  # once per transform
    # With grad, torch takes the composite path and the override applies (linear in float32).
    with torch.autocast("cpu", dtype=BF16):
        composite = enc(x, src_key_padding_mask=mask)
    assert not torch.equal(f(x), composite.to(BF16))


def test_fast_path_modules_in_train_mode_need_no_module_hook() -> None:
    # torch takes no inference fast path in train mode: famp registers no global module hook
    # for a call of a module whose fast-path modules all train; outputs and gradients are
    # torch.autocast's (the override reaches no op here).
    import torch.nn.modules.module as torch_module

    model, x = _Holder(_encoder(nested=False).train()), torch.randn(3, 5, 16)
    model.head.train()
    hooked: list[bool] = []
    model.head.register_forward_pre_hook(
        lambda m, args: hooked.append(bool(torch_module._global_forward_pre_hooks))
    )
    rules = famp.default_rules("cpu").override({"rms_norm": "lower"})
    torch.manual_seed(2)  # the encoder's dropout
    with torch.autocast("cpu", dtype=BF16):
        expected = model(x)
    expected_grads = torch.autograd.grad(expected.float().sum(), list(model.parameters()))
    torch.manual_seed(2)
    actual = famp.autocast(model, "c=bf16,o=bf16", rules=rules)(x)
    grads = torch.autograd.grad(actual.float().sum(), list(model.parameters()))
    assert hooked == [False, False]
    assert_bitwise_equal(actual, expected)
    for a, e in zip(grads, expected_grads, strict=True):
        assert_bitwise_equal(a, e)


def test_a_fast_path_module_switched_to_eval_during_the_call_warns() -> None:
    # Looked for as each call starts: modules that train leave the call unhooked; one switched
    # to eval mode inside the call may run under famp's interception, not torch's fast path.
    class Switching(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = _encoder(nested=False).train()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.enc.eval()
            with torch.no_grad():
                return self.enc(x)

    model, x = Switching(), torch.randn(3, 5, 16)
    rules = famp.default_rules("cpu").override({"rms_norm": "lower"})
    f = famp.autocast(model, "c=bf16,o=bf16", rules=rules)
    with pytest.warns(famp.AutocastWarning, match="TransformerEncoder.*switched to eval mode"):
        f(x)
    model.enc.train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f(x)  # once per transformed function


def test_inference_fast_path_that_raises_leaves_nothing_behind() -> None:
    # famp leaves the module to torch until it returns; when it raises, famp's interception
    # and the global hook that waits for the module's return are gone as well.
    import torch.nn.modules.module as torch_module

    enc = _encoder(nested=False)
    f = famp.autocast(enc, "c=bf16,o=bf16", track_casts=True)
    with torch.no_grad():
        bad = torch.randn(3, 5, 12)  # 12 features where the layers take 16
        with pytest.raises(RuntimeError) as theirs, torch.autocast("cpu", dtype=BF16):
            enc(bad)
        with pytest.raises(RuntimeError) as ours:
            f(bad)
        assert str(ours.value) == str(theirs.value)
        assert not torch_module._global_forward_hooks
        assert not torch_module._global_forward_pre_hooks
        assert torch._C._len_torch_function_stack() == 0
        x = torch.randn(3, 5, 16)
        with torch.autocast("cpu", dtype=BF16):
            expected = enc(x)
        assert_bitwise_equal(f(x), expected)


def _thread_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 16), nn.Softmax(-1),
        nn.Linear(16, 4),
    )  # fmt: skip


_OUTPUTS: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "tuple": lambda y, x: (y, x),
    "dict": lambda y, x: {"y": y, "x": x},
    "nested": lambda y, x: [{"y": y, "more": (x, None, 3)}, [x.double(), "s"]],
}
_FIRST: dict[str, Callable[[Any], torch.Tensor]] = {
    "tuple": lambda out: out[0],
    "dict": lambda out: out["y"],
    "nested": lambda out: out[0]["y"],
}


@pytest.mark.parametrize("out", list(_OUTPUTS))
@pytest.mark.parametrize("kind", ["default", "track_casts", "override", "module_rule"])
def test_a_call_leaves_no_reference_cycle(kind: str, out: str) -> None:
    # A cycle per call (a record and its mode holding each other) makes every call garbage for
    # the collector, whose full passes over a process of torch objects cost far more than a
    # step of a small model (docs/benchmarks.md, nineteenth pass).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8))
    options = {} if kind == "default" else _options(kind)
    # Outputs cast per leaf, as the module rule casts the module's positional inputs.
    f = famp.autocast(lambda x: _OUTPUTS[out](model(x), x), "c=bf16,o=f32", **options)
    x = torch.randn(4, 8)
    _FIRST[out](f(x)).sum().backward()  # first calls build caches, which live on
    # Every object so far, garbage included, is frozen: the collector counts only what the five
    # calls leave (a full pass over the suite's torch objects costs a second a case).
    gc.disable()
    gc.freeze()
    try:
        for _ in range(5):
            _FIRST[out](f(x)).sum().backward()
        assert gc.collect() == 0
    finally:
        gc.unfreeze()
        gc.enable()


class Pair(NamedTuple):
    a: Any
    b: Any


_plain_leaves = st.one_of(
    st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32]).map(
        lambda d: torch.ones(2, dtype=d)
    ),
    st.none(),
    st.integers(),
    st.floats(allow_nan=False),
    st.text(max_size=2),
    st.booleans(),
)
_trees = st.recursive(
    _plain_leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=2), inner, max_size=3),
        st.lists(inner, min_size=2, max_size=2).map(lambda xs: Pair(*xs)),  # a named tuple
    ),
    max_leaves=12,
)


@given(tree=_trees, dtype=st.sampled_from([torch.bfloat16, torch.float32]))
def test_policy_casts_of_a_tree_are_torchs_tree_map(tree: Any, dtype: torch.dtype) -> None:
    # famp casts plain tuples, lists and dicts itself (torch's tree_flatten leaves a reference
    # cycle per call); the result, its containers' types and key orders are tree_map's, and a
    # tree none of whose leaves changes is the tree itself (a module's cache list stays its own).
    want = torch.utils._pytree.tree_map(lambda leaf: tree_casts.cast_leaf(leaf, dtype), tree)
    got = tree_casts.cast_tree(tree, dtype)
    leaves = torch.utils._pytree.tree_leaves(tree)
    unchanged = all(
        w is x for w, x in zip(torch.utils._pytree.tree_leaves(want), leaves, strict=True)
    )
    assert (got is tree) is unchanged
    want_leaves, want_spec = torch.utils._pytree.tree_flatten(want)
    got_leaves, got_spec = torch.utils._pytree.tree_flatten(got)
    assert got_spec == want_spec
    assert repr(got_spec) == repr(want_spec)  # key orders and container types
    for g, w in zip(got_leaves, want_leaves, strict=True):
        assert type(g) is type(w)
        if isinstance(w, torch.Tensor):
            assert_bitwise_equal(g, w)
        else:
            assert g == w


def test_calls_with_rules_in_four_threads_give_each_threads_own_bits() -> None:
    # Four threads at once, each with its own model and rules (two overrides, module rules,
    # track_casts): famp's module hooks are global and counted across threads, its call stacks
    # are per thread. Every step of every thread equals the same call run alone, and no hook is
    # left behind.
    import threading

    options: list[dict[str, Any]] = [
        {"rules": famp.default_rules("cpu").override({"gelu": "lower", "softmax": "lower"})},
        {"rules": famp.default_rules("cpu").override({"layer_norm": "lower", "linear": "float32"})},
        {"module_rules": {"3": "f32", "5": "c=f16,o=f16"}},
        {"track_casts": True},
    ]
    x = torch.randn(5, 8)
    models = [_thread_model(i) for i in range(len(options))]  # seeded here: the RNG is global

    def steps(i: int, n: int, start: threading.Barrier | None = None) -> list[list[torch.Tensor]]:
        model = models[i]
        f = famp.autocast(lambda x: model(x).float().square().sum(), "c=bf16,o=f32", **options[i])
        if start is not None:
            start.wait(timeout=30)
        out = []
        for _ in range(n):
            for p in model.parameters():
                p.grad = None
            loss = f(x)
            loss.backward()
            out.append([loss.detach(), *(p.grad for p in model.parameters() if p.grad is not None)])
        return out

    alone = [steps(i, 1)[0] for i in range(len(options))]
    results: dict[int, list[list[torch.Tensor]]] = {}
    start = threading.Barrier(len(options))

    def worker(i: int) -> None:
        results[i] = steps(i, 30, start)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(options))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(results) == list(range(len(options)))
    for i, runs in results.items():
        for run in runs:
            assert len(run) == len(alone[i]) == 9  # the loss and eight gradients
            for a, e in zip(run, alone[i], strict=True):
                assert_bitwise_equal(a, e)
    assert not torch.nn.modules.module._global_forward_pre_hooks
    assert not torch.nn.modules.module._global_forward_hooks


def test_inference_fast_path_while_another_thread_calls_the_same_module() -> None:
    # Inference served from two threads: the other thread's call of the module famp left to
    # torch ends while famp's is still inside it. Only famp's own thread's return ends famp's
    # hands-off (interception back on, the waiting hook removed).
    import threading

    import torch.nn.modules.module as torch_module

    x, mask = torch.randn(3, 5, 16), _padding_mask()
    enc = _encoder(nested=False)
    with torch.no_grad():
        plain = enc(x, src_key_padding_mask=mask)  # what the other thread computes
        with torch.autocast("cpu", dtype=BF16):
            expected = enc(x, src_key_padding_mask=mask)
    others: list[torch.Tensor] = []

    def other_thread() -> None:
        with torch.no_grad():
            others.append(enc(x, src_key_padding_mask=mask))

    def in_the_middle(module: nn.Module, args: Any) -> None:
        handle.remove()  # once: the other thread's call passes here too
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join(timeout=60)

    handle = enc.layers[1].register_forward_pre_hook(in_the_middle)
    try:
        f = famp.autocast(
            lambda x: enc(x, src_key_padding_mask=mask), "c=bf16,o=bf16", track_casts=True
        )
        with torch.no_grad():
            actual = f(x)
    finally:
        handle.remove()
    assert len(others) == 1
    assert_bitwise_equal(others[0], plain)
    assert torch._C._is_torch_function_enabled()
    assert not torch_module._global_forward_hooks
    assert not torch_module._global_forward_pre_hooks
    assert actual.dtype == BF16
    assert_bitwise_equal(actual, expected.to(BF16))


@pytest.mark.parametrize("outer_kind", ["module_rule", "override"])
def test_inference_fast_path_in_a_nested_call_gives_torch_autocast_bits(outer_kind: str) -> None:
    # The modes on the stack are all famp's (the outer call's and the nested one's): famp leaves
    # the encoder to torch's fast path as torch.autocast does.
    x, mask = torch.randn(3, 5, 16), _padding_mask()
    enc = _encoder(nested=False)
    torch.manual_seed(1)
    head = nn.Linear(16, 4).eval()
    inner = famp.autocast(
        lambda x: enc(x, src_key_padding_mask=mask), "c=bf16,o=bf16", track_casts=True
    )
    outer_options: dict[str, Any] = (
        {"module_rules": {"": "f32"}}  # "": the root `head`
        if outer_kind == "module_rule"
        else {"rules": famp.default_rules("cpu").override({"linear": "float32"})}
    )
    outer = famp.autocast(lambda x: head(inner(x)), "c=bf16,o=f32", **outer_options)
    with torch.no_grad():
        with torch.autocast("cpu", dtype=BF16):
            # A nested call casts its inputs to its compute dtype, as a matched module's are.
            encoded = enc(x.to(BF16), src_key_padding_mask=mask).to(BF16)
        expected = head(encoded.float())  # `head` in float32, by the rule or the override
        if outer_kind == "override":
            with pytest.warns(famp.AutocastWarning, match="overrides do not apply inside"):
                actual = outer(x)
        else:
            actual = outer(x)
    assert_bitwise_equal(actual, expected)


def test_a_call_without_module_rules_nested_in_one_with_them_keeps_its_scopes() -> None:
    # Only calls with module rules track module exits; a nested call without them (with an
    # override, so it intercepts) leaves the outer call's scopes as they were: the outer rule
    # still applies to the root module called after it.
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 16))
    head = nn.Linear(16, 4)
    x = torch.randn(3, 16)
    rules = famp.default_rules("cpu").override({"rms_norm": "lower"})  # changes no op here
    inner = famp.autocast(body, "c=bf16,o=bf16", rules=rules)
    outer = famp.autocast(lambda x: head(inner(x)), "c=bf16,o=f32", module_rules={"": "f32"})
    with torch.autocast("cpu", dtype=BF16):
        # A nested call casts its inputs to its compute dtype, as a matched module's are.
        hidden = body(x.to(BF16)).to(BF16)
    expected = head(hidden.float())  # the rule "" runs the root `head` in float32
    actual = outer(x)
    assert actual.dtype == torch.float32
    assert_bitwise_equal(actual, expected)
    with torch.autocast("cpu", dtype=BF16):
        assert not torch.equal(head(hidden).float(), expected)  # the rule made a difference


def test_nested_tensor_fast_path_fails_as_under_torch_autocast() -> None:
    # torch's fused encoder layer rejects bfloat16 activations with nested tensors on CPU; famp
    # leaves the path to torch, so it fails (or works) exactly where torch.autocast does.
    x, mask = torch.randn(3, 5, 16), _padding_mask()
    enc = _encoder(nested=True)
    f = famp.autocast(lambda x: enc(x, src_key_padding_mask=mask), "c=bf16", track_casts=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's prototype note on nested tensors
        with pytest.raises(RuntimeError) as theirs, torch.autocast("cpu", dtype=BF16):
            enc(x, src_key_padding_mask=mask)
        with pytest.raises(RuntimeError) as ours:
            f(x)
    assert str(ours.value) == str(theirs.value)


def test_nested_tensor_fast_path_in_float32_zeroes_padded_rows_as_torch_does() -> None:
    x, mask = torch.randn(3, 5, 16), _padding_mask()
    enc = _encoder(nested=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's prototype note on nested tensors
        expected = enc(x, src_key_padding_mask=mask)
        actual = famp.autocast(
            lambda x: enc(x, src_key_padding_mask=mask), "f32", track_casts=True
        )(x)
    assert actual.dtype == torch.float32
    assert_bitwise_equal(actual, expected)
    assert not actual[0, 3:].any()  # the fused path's zeros for padded rows


# --- module rules that match nothing: wrappers' path prefixes ------------------------------------


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(x)))


class Wrapper(nn.Module):  # what DistributedDataParallel does to paths: `module.` in front
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def test_a_module_rule_that_matches_nothing_warns_once_naming_the_prefixed_path() -> None:
    torch.manual_seed(0)
    model, x = Head(), torch.randn(4, 6)
    wrapped = Wrapper(model)
    f = famp.autocast(wrapped, "c=bf16,o=f32", module_rules={"head": "f32"})
    with pytest.warns(famp.AutocastWarning, match=r"'head' \(nearest module paths: 'module\.head'"):
        f(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        f(x)  # once per transform
    # The rule written for the wrapper gives the unwrapped model's bits.
    for rules, fn in [({"module.head": "f32"}, wrapped), ({"*head": "f32"}, wrapped)]:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            actual = famp.autocast(fn, "c=bf16,o=f32", module_rules=rules)(x)
        expected = famp.autocast(model, "c=bf16,o=f32", module_rules={"head": "f32"})(x)
        assert_bitwise_equal(actual, expected)


def test_a_module_rule_in_a_function_that_calls_no_module_warns() -> None:
    f = famp.autocast(lambda x: x * 2, "c=bf16", module_rules={"head": "f32"})
    with pytest.warns(famp.AutocastWarning, match=r"'head' \(no module was called\)"):
        f(torch.ones(2))


# --- DDP, FSDP2, FSDP1 on 2 gloo ranks: one torchrun job (tests/autocast/compose_worker.py) -------

WORKER = pathlib.Path(__file__).with_name("compose_worker.py")
DISTRIBUTED_CELLS = [
    "ddp_default",
    "ddp_module_rule",
    "ddp_module_rule_keywords",
    "ddp_override",
    "fsdp2_default",
    "fsdp2_module_rule",
    "fsdp2_module_rule_keywords",
    "fsdp2_step_inside_a_call",
    "fsdp2_no_write_keeps_casts",
    "fsdp1_default",
    "fsdp1_module_rule",
]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("compose_job")
    files = rank_files(out, torchrun(WORKER, out))
    return [torch.load(f, weights_only=False) for f in files]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("cell", DISTRIBUTED_CELLS)
def test_distributed_cell_gives_its_references_bits(ranks: list[dict[str, Any]], cell: str) -> None:
    for record in ranks:
        result = record[cell]
        assert "error" not in result, result.get("error")
        assert len(result["actual"]) == len(result["expected"])
        for actual, expected in zip(result["actual"], result["expected"], strict=True):
            assert_bitwise_equal(actual, expected)
        assert result["actual"][0].dtype == torch.float32  # the loss
        assert result.get("override_changed_the_loss", True)  # the override cell is not vacuous


@pytest.mark.slow
@pytest.mark.distributed
def test_a_module_rule_on_a_ddp_model_without_its_prefix_warns(
    ranks: list[dict[str, Any]],
) -> None:
    for record in ranks:
        assert "error" not in record["ddp_unprefixed_warns"]
        (message,) = record["ddp_unprefixed_warns"]["warnings"]
        assert "'head' (nearest module paths: 'module.head')" in message


# --- torch.compile: static shapes, dynamic=True, a recompile after a shape change ----------------
# Default rules: compiled famp against compiled torch.autocast (inductor on both sides). Overrides
# and module rules: compiled (aot_eager, which runs the traced graph as is) against eager famp.


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 4))


MLP = _mlp()
MODULE_RULES = {"3": "f32"}


@functools.cache
def _rules() -> famp.OpRules:  # built when first needed, so that collection needs no rule table
    return famp.default_rules("cpu").override({"layer_norm": "float32", "linear": "float32"})


@functools.cache
def _famp_rules_transform() -> Callable[..., torch.Tensor]:
    return famp.autocast(MLP, "c=bf16,o=f32", rules=_rules(), module_rules=MODULE_RULES)


def _famp_rules(x: torch.Tensor) -> torch.Tensor:
    return _famp_rules_transform()(x)


_famp_default = famp.autocast(MLP, "c=bf16,o=f32")


def _torch_default(x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=BF16):
        return MLP(x).float()


def _loss_and_grads(f: Callable[..., torch.Tensor], x: torch.Tensor) -> list[torch.Tensor]:
    for p in MLP.parameters():
        p.grad = None
    out = f(x)
    out.pow(2).sum().backward()
    return [out.detach(), *(p.grad for p in MLP.parameters() if p.grad is not None)]


_COMPILED_CELLS: dict[tuple[str, str], Callable[..., torch.Tensor]] = {}


def _compiled_cell(name: str, mode: str) -> Callable[..., torch.Tensor]:
    key = (name, mode)
    if key not in _COMPILED_CELLS:
        fn = _famp_rules_transform() if name == "rules" else _famp_default
        fn = _torch_default if name == "torch" else fn
        backend = "aot_eager" if name == "rules" else "inductor"
        dynamic = {"static": False, "dynamic": True, "recompile": None}[mode]
        _COMPILED_CELLS[key] = torch.compile(fn, backend=backend, dynamic=dynamic)
    return _COMPILED_CELLS[key]


def _shapes(mode: str) -> list[int]:
    # "recompile": a second batch size makes Dynamo recompile (automatically dynamic).
    return [5, 7] if mode == "recompile" else [5]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["static", "dynamic", "recompile"])
def test_compiled_default_rules_give_compiled_torch_autocast_bits(mode: str) -> None:
    for n in _shapes(mode):
        x = torch.randn(n, 8)
        actual = _loss_and_grads(_compiled_cell("famp", mode), x)
        expected = _loss_and_grads(_compiled_cell("torch", mode), x)
        assert actual[0].dtype == torch.float32
        for a, e in zip(actual, expected, strict=True):
            assert_bitwise_equal(a, e)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["static", "dynamic", "recompile"])
def test_compiled_overrides_and_module_rules_give_eager_bits(mode: str) -> None:
    for n in _shapes(mode):
        x = torch.randn(n, 8)
        actual = _loss_and_grads(_compiled_cell("rules", mode), x)
        expected = _loss_and_grads(_famp_rules, x)
        assert actual[0].dtype == torch.float32
        for a, e in zip(actual, expected, strict=True):
            assert_bitwise_equal(a, e)


@pytest.mark.slow
# Dynamo reads .grad of the RNN's non-leaf output, an input of the frame it resumes after it.
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@pytest.mark.parametrize("rnn", ["GRU", "RNN"])
@pytest.mark.parametrize("kind", ["override", "module_rule"])
def test_compiled_call_reaching_an_rnn_module_gives_eager_bits(kind: str, rnn: str) -> None:
    # Dynamo refuses nn.GRU, nn.LSTM and nn.RNN (allow_rnn=False; with fullgraph=True it raises,
    # for famp as for torch) and runs the module eagerly behind a graph break. torch calls famp's
    # mode from there: Dynamo compiled that call as a graph of its own, which raised (a dtype
    # passed to torch.zeros as an int: a module rule on torch 2.13-2.15, an override after an
    # eager famp call on 2.15) or traced the RNN op (an override: other gradient bits than
    # eager's). famp's mode now runs eagerly there, as the module does: eager famp's bits, and
    # torch.autocast's by hand.
    torch.manual_seed(0)
    module, head = getattr(nn, rnn)(8, 8, batch_first=True), nn.Linear(8, 5)
    model = _RnnHead(module, head)
    op = rnn.lower() if rnn == "GRU" else "rnn_tanh"

    def by_hand(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16):
            with torch.autocast("cpu", enabled=False):
                out, _ = module(x.float())
            return head(out).float()  # type: ignore[no-any-return]

    def loss_and_grads(f: Callable[..., torch.Tensor], x: torch.Tensor) -> list[torch.Tensor]:
        out = f(x)
        return [out, *torch.autograd.grad(out.square().sum(), list(model.parameters()))]

    options: dict[str, Any] = (
        {"rules": famp.default_rules("cpu").override({op: "float32"})}
        if kind == "override"
        else {"module_rules": {"rnn": "f32"}}
    )
    f = famp.autocast(model, "c=bf16,o=f32", **options)
    x = torch.randn(3, 4, 8).to(BF16)
    expected = loss_and_grads(by_hand, x)
    for a, e in zip(loss_and_grads(f, x), expected, strict=True):
        assert_bitwise_equal(a, e)  # eagerly
    with pytest.raises(torch._dynamo.exc.Unsupported):  # the RNN (on 2.15 a rule: its paths)
        torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    for compiled in (
        torch.compile(f, backend="aot_eager"),
        torch.compile(by_hand, backend="aot_eager"),
    ):
        for a, e in zip(loss_and_grads(compiled, x), expected, strict=True):
            assert_bitwise_equal(a, e)


class _RnnHead(nn.Module):
    def __init__(self, rnn: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.rnn, self.head = rnn, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])  # type: ignore[no-any-return]


@pytest.mark.slow
def test_compiled_dropout_on_a_lower_dtype_gives_torchs_compiled_bits() -> None:
    # aot_eager's graph gives the gradients before a dropout on a bfloat16 activation other
    # bits than eager, for torch.autocast too: compiled famp equals compiled torch.autocast.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.Linear(16, 4))
    x = torch.randn(6, 8)

    def by_hand(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16):
            return model(x).float()  # type: ignore[no-any-return]

    def run(f: Callable[..., torch.Tensor]) -> list[torch.Tensor]:
        torch.manual_seed(3)
        out = f(x)
        return [out, *torch.autograd.grad(out.square().sum(), list(model.parameters()))]

    f = famp.autocast(model, "c=bf16,o=f32")
    expected = run(torch.compile(by_hand, fullgraph=True, backend="aot_eager"))
    actual = run(torch.compile(f, fullgraph=True, backend="aot_eager"))
    for a, e in zip(actual, expected, strict=True):
        assert_bitwise_equal(a, e)
    for a, e in zip(run(f), run(by_hand), strict=True):
        assert_bitwise_equal(a, e)  # eagerly


def test_torch_compile_model_keeps_the_models_paths_for_module_rules() -> None:
    model, x = _mlp(), torch.randn(5, 8)
    wrapped = torch.compile(model, backend="aot_eager")
    expected = famp.autocast(model, "c=bf16,o=f32", rules=_rules(), module_rules=MODULE_RULES)(x)
    with warnings.catch_warnings():
        # torch warns that famp's global module hooks also fire for the compile wrapper.
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)`")
        actual = famp.autocast(wrapped, "c=bf16,o=f32", rules=_rules(), module_rules=MODULE_RULES)(
            x
        )
        with pytest.warns(
            famp.AutocastWarning, match=r"'_orig_mod\.3' \(nearest module paths: '3'"
        ):
            famp.autocast(wrapped, "c=bf16", module_rules={"_orig_mod.3": "f32"})(x)
    assert_bitwise_equal(actual, expected)


def _block_model() -> nn.Sequential:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), block, nn.Linear(16, 4))


@pytest.mark.parametrize("rule", ["2", "2.2"])  # the compiled submodule, a module inside it
def test_a_compiled_submodule_keeps_its_own_paths_for_module_rules(rule: str) -> None:
    # `torch.compile(model[2])` inside a model: its modules' paths are `2`, `2.2`, as a compiled
    # root's are the model's own (not `2._orig_mod.2`). Before, the rule `2` silently matched the
    # wrapper, which famp passes over, and Dynamo failed on `2._orig_mod`'s lookup.
    x = torch.randn(5, 8)
    model, reference = _block_model(), _block_model()
    model[2] = torch.compile(model[2], backend="aot_eager")

    def loss_and_grads(m: nn.Module, rules: dict[str, str]) -> list[torch.Tensor]:
        loss = famp.autocast(m, "c=bf16,o=f32", module_rules=rules)(x).pow(2).sum()
        loss.backward()
        return [loss, *(p.grad for p in m.parameters())]  # type: ignore[misc]

    expected = loss_and_grads(reference, {rule: "c=f32"})
    assert not torch.equal(expected[0], loss_and_grads(_block_model(), {})[0])  # the rule acts
    with warnings.catch_warnings():  # torch's: famp's global hooks fire for the wrapper too;
        # Dynamo reads `.grad` of the (non-leaf) input the compiled submodule receives
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)`")
        warnings.filterwarnings("ignore", message=r"The .grad attribute of a Tensor that is not")
        actual = loss_and_grads(model, {rule: "c=f32"})
        with pytest.warns(famp.AutocastWarning, match=r"'2\._orig_mod' \(nearest module paths: "):
            famp.autocast(model, "c=bf16", module_rules={"2._orig_mod": "f32"})(x)
    for a, e in zip(actual, expected, strict=True):
        assert_bitwise_equal(a, e)


def test_torch_compile_model_inside_a_call_with_overrides_only_gives_eager_bits() -> None:
    # Without module rules famp's mode takes a shorter path per op eagerly; Dynamo traces the
    # compiled model with the mode active, and takes the full one. torch would trace the backward
    # of a region compiled inside autocast under that autocast; famp has it traced without, as
    # eager backward runs (the overrides' float32 ops get float32 gradients), with torch's
    # setting as it was (tests/autocast/test_compiled_backward.py).
    model, x = _mlp(), torch.randn(5, 8)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)

    def run(m: nn.Module) -> list[torch.Tensor]:
        model.zero_grad()
        f = famp.autocast(lambda x: m(x).float().pow(2).sum(), "c=bf16,o=f32", rules=_rules())
        loss = f(x)
        loss.backward()
        return [loss, *(p.grad for p in model.parameters())]  # type: ignore[misc]

    expected = run(model)
    with warnings.catch_warnings():
        # torch warns that famp's global module hook also fires for the compile wrapper.
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)`")
        actual = run(compiled)
    for a, e in zip(actual, expected, strict=True):
        assert_bitwise_equal(a, e)


# --- torch.export: strict (Dynamo) and non-strict ------------------------------------------------


def _export_options(kind: str) -> dict[str, Any]:
    if kind == "override":
        rules = famp.default_rules("cpu").override({"layer_norm": "lower", "gelu": "lower"})
        return {"rules": rules}
    return {
        "default": {},
        "module_rule": {"module_rules": {"1": "f32"}},
        "track_casts": {"track_casts": True},
    }[kind]


class _FampModel(nn.Module):
    """A model whose forward is a famp.autocast call: what torch.export traces."""

    def __init__(self, options: dict[str, Any]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))
        self.call = famp.autocast(self.body, "c=bf16,o=f32", **options)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.call(x)


class _TorchModel(_FampModel):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16):
            return self.body(x).float()


@pytest.mark.parametrize("kind", ["default", "override", "module_rule", "track_casts"])
def test_non_strict_export_gives_the_eager_calls_bits(kind: str) -> None:
    x = torch.randn(5, 8)
    model = _FampModel(_export_options(kind))
    exported = torch.export.export(model, (x,), strict=False).module()
    assert_bitwise_equal(exported(x), model(x))
    if kind == "default":  # and torch.autocast's exported program's
        theirs = torch.export.export(_TorchModel({}), (x,), strict=False).module()
        assert_bitwise_equal(exported(x), theirs(x))


# Strict export names famp's stack of running calls among the side effects of the forward: a
# famp call appends its record to it and removes it before it returns (no net change).
@pytest.mark.filterwarnings("ignore:While compiling, we found certain side effects")
def test_strict_export_does_what_it_does_with_torch_autocast() -> None:
    # Strict export (Dynamo) of a model that casts an autocast output back to float32 makes a
    # program that fails when run, with torch.autocast as with famp (torch 2.13 to 2.15): famp
    # gives torch's error, or, where torch's program runs, its bits.
    x = torch.randn(5, 8)

    def run(model: nn.Module) -> torch.Tensor | str:
        program = torch.export.export(model, (x,), strict=True).module()
        try:
            return program(x)
        except RuntimeError as error:
            return str(error)

    theirs, ours = run(_TorchModel({})), run(_FampModel({}))
    if isinstance(theirs, str):
        assert ours == theirs
    else:
        assert isinstance(ours, torch.Tensor)
        assert_bitwise_equal(ours, theirs)


# --- torch.func: grad, vmap, jacrev, functional_call ---------------------------------------------


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")  # torch's jvp of dropout
@pytest.mark.parametrize("where", ["grad", "vmap_different", "jvp"])
def test_an_overridden_dropouts_first_call_inside_a_transform_equals_torch(where: str) -> None:
    """famp asks once per (p, training) whether a dropout call returns its input (`ops._probe`,
    on a small tensor of its own). Asked first inside torch.func.grad, jvp or
    vmap(randomness="different"), the transform wrapped the probe's result and reading its
    storage raised NotImplementedError, where torch.autocast by hand runs (a differential hunt,
    2026-12-01); asked eagerly first, it worked. The probe now runs with the transforms off."""
    from famp._autocast import ops

    ops.returns_input_given.cache_clear()  # the first call of these values, in any test order
    rules = famp.default_rules("cpu").override({"dropout": "float32"})
    f = famp.autocast(lambda x: F.dropout(x, 0.3, True).sum(), "c=bf16,o=f32", rules=rules)

    def by_hand(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16), torch.autocast("cpu", enabled=False):
            return F.dropout(x.float(), 0.3, True).sum()

    def run(fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        torch.manual_seed(0)
        x = torch.randn(4, 5)
        if where == "grad":
            return torch.func.grad(fn)(x)
        if where == "jvp":
            return torch.func.jvp(fn, (x,), (torch.ones_like(x),))
        return torch.func.vmap(fn, randomness="different")(x)

    actual, expected = run(f), run(by_hand)
    for a, e in zip(
        torch.utils._pytree.tree_leaves(actual),
        torch.utils._pytree.tree_leaves(expected),
        strict=True,
    ):
        assert_bitwise_equal(a, e)


# Without the LayerNorm: torch's own batching rules fail on it under autocast in jacrev and vmap
# of grad, and famp fails with the same error (test_torch_func_fails_where_torch_autocast_fails).
torch.manual_seed(1)
FUNC_MLP = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
_PARAMS = {k: v.detach() for k, v in FUNC_MLP.named_parameters()}
_NORM_PARAMS = {k: v.detach() for k, v in MLP.named_parameters()}


def _call(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    model = FUNC_MLP if "0.weight" in p and len(p) == 4 else MLP
    return torch.func.functional_call(model, p, (x,)).float().pow(2).sum()


def _famp_call(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return famp.autocast(_call, "c=bf16,o=f32", device_type="cpu")(p, x)


def _rules_call(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    transform = famp.autocast(
        _call,
        "c=bf16,o=f32",
        device_type="cpu",
        rules=famp.default_rules("cpu").override({"tanh": "float32"}),
        module_rules={"2": "f32"},
    )
    return transform(p, x)


def _torch_call(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=BF16):
        return _call(p, x)


def _ones(p: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.ones_like(v) for k, v in p.items()}


FUNC_TRANSFORMS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "grad": lambda f: torch.func.grad(f),
    "vmap_grad": lambda f: torch.func.vmap(
        lambda p, x: torch.func.grad(f)(p, x[None]), in_dims=(None, 0)
    ),
    "jacrev": lambda f: torch.func.jacrev(lambda p, x: f(p, x) * x.sum()),
    "functional_call": lambda f: f,
    # Forward mode: a directional derivative, the Jacobian by columns, a Hessian-vector product.
    "jvp": lambda f: lambda p, x: torch.func.jvp(lambda q: f(q, x), (p,), (_ones(p),)),
    "jacfwd": lambda f: torch.func.jacfwd(lambda p, x: f(p, x) * x.sum()),
    "jvp_of_grad": lambda f: (
        lambda p, x: torch.func.jvp(lambda q: torch.func.grad(f)(q, x), (p,), (_ones(p),))
    ),
}


# torch's forward mode scripts its decompositions with `torch.jit.script` on first use, which warns.
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is")
@pytest.mark.parametrize("transform", sorted(FUNC_TRANSFORMS))
def test_torch_func_default_rules_give_torch_autocast_bits(transform: str) -> None:
    x = torch.randn(4, 8)
    make = FUNC_TRANSFORMS[transform]
    actual, expected = make(_famp_call)(_PARAMS, x), make(_torch_call)(_PARAMS, x)
    flat_a, flat_e = (
        torch.utils._pytree.tree_leaves(actual),
        torch.utils._pytree.tree_leaves(expected),
    )
    assert len(flat_a) == len(flat_e)
    for a, e in zip(flat_a, flat_e, strict=True):
        assert a.dtype == torch.float32
        assert_bitwise_equal(a, e)


def test_torch_func_grad_with_rules_gives_the_eager_autograd_bits() -> None:
    x = torch.randn(4, 8)
    params = {k: v.clone().requires_grad_(True) for k, v in _PARAMS.items()}
    actual = torch.func.grad(_rules_call)(_PARAMS, x)
    grads = torch.autograd.grad(_rules_call(params, x), list(params.values()))
    expected = dict(zip(params, grads, strict=True))
    for k in params:
        assert_bitwise_equal(actual[k], expected[k])


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is")
def test_torch_func_jvp_with_rules_gives_the_eager_forward_ad_bits() -> None:
    # Forward mode with an override and a module rule (which change ops' dtypes, so torch.autocast
    # is no reference): torch.func.jvp equals eager dual tensors through the same call.
    x = torch.randn(4, 8)
    tangents = _ones(_PARAMS)
    actual = torch.func.jvp(lambda p: _rules_call(p, x), (_PARAMS,), (tangents,))
    with forward_ad.dual_level():
        duals = {k: forward_ad.make_dual(v, tangents[k]) for k, v in _PARAMS.items()}
        primal, tangent = forward_ad.unpack_dual(_rules_call(duals, x))
        expected = (primal, tangent)
    for a, e in zip(actual, expected, strict=True):
        assert_bitwise_equal(a, e)


@pytest.mark.parametrize("transform", ["jacrev", "vmap_grad"])
def test_torch_func_fails_where_torch_autocast_fails(transform: str) -> None:
    x = torch.randn(4, 8)
    make = FUNC_TRANSFORMS[transform]
    with pytest.raises(RuntimeError) as theirs:
        make(_torch_call)(_NORM_PARAMS, x)
    with pytest.raises(RuntimeError) as ours:
        make(_famp_call)(_NORM_PARAMS, x)
    assert str(ours.value) == str(theirs.value)


# --- user forward hooks, custom autograd Functions, EMA updates ----------------------------------


def _hooked_mlp() -> nn.Module:
    model = _mlp()
    model[0].register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    model[2].register_forward_hook(lambda m, args, out: out + 1)
    model.register_forward_hook(lambda m, args, out: out.float().softmax(-1))
    return model


@pytest.mark.parametrize("kind", ["default", "track_casts"])
def test_user_forward_hooks_give_torch_autocast_bits(kind: str) -> None:
    model, x = _hooked_mlp(), torch.randn(5, 8)
    with torch.autocast("cpu", dtype=BF16):
        expected = model(x)
    (expected_grad,) = torch.autograd.grad(expected.pow(2).sum(), model[0].weight)
    actual = famp.autocast(model, "c=bf16,o=f32", track_casts=kind == "track_casts")(x)
    (actual_grad,) = torch.autograd.grad(actual.pow(2).sum(), model[0].weight)
    assert actual.dtype == torch.float32
    assert_bitwise_equal(actual, expected)
    assert_bitwise_equal(actual_grad, expected_grad)


def test_user_forward_hooks_with_module_rules_give_the_same_rules_without_hooks() -> None:
    # The hooks act on unmatched modules; the reference writes them into the model's code.
    class Written(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.net[1](self.net[0](x * 2))
            return self.net[3](self.net[2](h) + 1)

    hooked, written, x = _mlp(), Written(), torch.randn(5, 8)
    hooked[0].register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    hooked[2].register_forward_hook(lambda m, args, out: out + 1)
    actual = famp.autocast(hooked, "c=bf16,o=f32", module_rules={"3": "f32"})(x)
    expected = famp.autocast(written, "c=bf16,o=f32", module_rules={"net.3": "f32"})(x)
    assert actual.dtype == torch.float32
    assert_bitwise_equal(actual, expected)


class _Famp(torch.autograd.Function):
    @staticmethod
    @famp.custom_fwd(rule="float32")
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    @famp.custom_bwd
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return grad @ w.T, x.T @ grad


class _Torch(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return grad @ w.T, x.T @ grad


@pytest.mark.parametrize("kind", ["default", "track_casts", "override"])
def test_custom_function_in_a_model_gives_torch_custom_fwd_bits(kind: str) -> None:
    torch.manual_seed(0)
    lin, w, x = nn.Linear(8, 8), nn.Parameter(torch.randn(8, 8)), torch.randn(4, 8)

    def f(fn: Any) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda x: fn.apply(torch.relu(lin(x)), w).sum()

    with torch.autocast("cpu", dtype=BF16):
        expected = f(_Torch)(x)
    expected_grads = torch.autograd.grad(expected, [w, lin.weight])
    options = _options(kind)
    actual = famp.autocast(f(_Famp), "c=bf16,o=f32", **options)(x)
    actual_grads = torch.autograd.grad(actual, [w, lin.weight])
    assert actual.dtype == torch.float32
    assert_bitwise_equal(actual, expected)
    for a, e in zip(actual_grads, expected_grads, strict=True):
        assert_bitwise_equal(a, e)


@pytest.mark.parametrize("kind", ["default", "track_casts"])
def test_ema_updates_between_calls_give_torch_autocast_bits(kind: str) -> None:
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    def run(forward: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        model = _mlp()
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.5))
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        outs = []
        for step in range(3):
            x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
            forward(model, x).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
            ema.update_parameters(model)
            outs.append(forward(ema, x).detach())
        return outs

    def ours(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return famp.autocast(m, "c=bf16,o=f32", track_casts=kind == "track_casts")(x)

    def theirs(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16):
            return m(x).float()

    for a, e in zip(run(ours), run(theirs), strict=True):
        assert a.dtype == torch.float32
        assert_bitwise_equal(a, e)


def test_ema_update_inside_one_call_reads_fresh_casts() -> None:
    # AveragedModel.update_parameters between two uses of the averaged model inside one call
    # (its parameters are written through detach()): the second use reads a fresh cast.
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model, x = _mlp(), torch.randn(5, 8)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.25)
    ema = AveragedModel(_mlp(), multi_avg_fn=get_ema_multi_avg_fn(0.5))
    ema.n_averaged.fill_(1)  # past the first update, which copies

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        first = ema(x)
        ema.update_parameters(model)
        return first, ema(x)

    state = copy.deepcopy(ema.state_dict())
    first, second = famp.autocast(f, "c=bf16,o=f32", track_casts=True)(x)
    ema.load_state_dict(state)
    with torch.autocast("cpu", dtype=BF16, cache_enabled=False):
        ref_first, ref_second = f(x)
    assert_bitwise_equal(first, ref_first.float())
    assert_bitwise_equal(second, ref_second.float())
    assert not torch.equal(first, second)


@pytest.mark.slow
def test_every_transform_compiles_however_many_a_process_compiles() -> None:
    """Dynamo keeps at most 8 graphs per code object: transforms must not share one.

    With one shared wrapper, the ninth `torch.compile(famp.autocast(...))` of a process ran
    uncompiled (a warning only), so its numbers were eager's, not the compiled torch's.
    """
    graphs: list[int] = []

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(1)
        return gm.forward

    lin = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4)
    for k in range(12):
        transform = famp.autocast(lambda x, k=k: lin(x) * k, "c=bf16,o=f32")
        compiled = torch.compile(transform, backend=counting_backend, fullgraph=True)
        out = compiled(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = (lin(x) * k).float()
        assert_bitwise_equal(out, expected)
    assert len(graphs) == 12


class _TiedAttention(nn.Module):
    """Attention by einsum and a logit head through `weight.T`, the tied-embedding pattern."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 16)
        self.qk = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(x).chunk(2, -1)
        attn = torch.einsum("bid,bjd->bij", q, k).softmax(-1)
        return torch.bmm(attn, x) @ self.emb.weight.T


@pytest.mark.parametrize("model", ["encoder_layer", "tied_attention"])
def test_compiled_override_reaching_torchs_python_functions_gives_eager_bits(model: str) -> None:
    """A softmax override, compiled with fullgraph=True, gives eager famp's bits: inside
    `nn.TransformerEncoderLayer` (famp enters its copy of `F.multi_head_attention_forward`), and
    next to `weight.T` (which torch 2.15's Dynamo hands to the mode as `aten.numpy_T`). The op
    names famp memoizes eagerly must not be written while Dynamo traces (a function made during
    tracing cannot be put back into the memo: Dynamo failed), nor read (a guard on the memo
    would recompile whenever an eager call added a name), and a name is computed, not traced
    (torch 2.15 could not trace its string handling)."""
    torch.manual_seed(0)
    layer = (
        nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        if model == "encoder_layer"
        else _TiedAttention()
    )
    rules = famp.default_rules("cpu").override({"softmax": "float32"})
    transform = famp.autocast(layer, "c=bf16,o=f32", rules=rules)
    frames: list[int] = []

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        frames.append(1)
        return gm.forward

    compiled = torch.compile(transform, backend=counting_backend, fullgraph=True)
    x = torch.randn(3, 5, 16)

    def loss_and_grads(f: Callable[..., torch.Tensor]) -> list[torch.Tensor]:
        for p in layer.parameters():
            p.grad = None
        out = f(x)
        out.pow(2).sum().backward()
        return [out.detach(), *(p.grad for p in layer.parameters() if p.grad is not None)]

    actual = loss_and_grads(compiled)
    expected = loss_and_grads(transform)  # eagerly: famp memoizes names the trace did not see
    famp.autocast(nn.Sequential(nn.Softmax(-1)), "c=bf16", rules=rules)(x)  # and more names
    again = loss_and_grads(compiled)
    assert len(frames) == 1  # one graph, never recompiled by the memo's growth
    for a, e, b in zip(actual, expected, again, strict=True):
        assert_bitwise_equal(a, e)
        assert_bitwise_equal(b, e)
