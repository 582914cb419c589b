"""Keyword inputs of a matched module or a nested call: cast as its positional inputs are.

famp casts a matched module's positional inputs to its rule's compute dtype through a global
forward pre-hook, which torch gives no keyword inputs; the keyword inputs are cast from a
pre-hook of the module's own that famp gives each matched module below a root while the root
runs (`famp/_autocast/keywords.py`), a nested `famp.autocast` call casts its own. What famp
computes is pinned against `torch.autocast` by hand, and against the same call with the inputs
passed by position, eagerly, compiled (static and dynamic shapes, a recompile), in a compiled
submodule, under activation checkpointing and in another thread. A root reached otherwise than
as the transformed module itself (`torch.func.functional_call`) keeps its keyword inputs, with
a warning eagerly.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import famp
from tests.helpers import assert_bitwise_equal

BF16 = torch.bfloat16


class _Product(nn.Module):
    """Elementwise ops only: autocast casts nothing here, so only famp's input cast can."""

    def forward(self, x: Any = None, scale: Any = None, mask: Any = None) -> torch.Tensor:
        y = x * scale if scale is not None else x * x
        return y if mask is None else y.masked_fill(mask, 0.0)


class _Model(nn.Module):
    def __init__(self, call: str, checkpointed: dict[str, Any] | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.b = _Product()
        self.call = call
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed is None:
            return self._body(x)
        out: torch.Tensor = checkpoint(self._body, x, **self.checkpointed)
        return out

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        h, g = self.a(x), self.a(x * 0.7)  # bfloat16 under the call's policy
        if self.call == "keywords":
            return self.b(x=h, scale=g)
        if self.call == "mixed":
            return self.b(h, scale=g)
        if self.call == "checkpointed_module":  # the matched module itself, recomputed first
            out: torch.Tensor = checkpoint(self.b, h, scale=g, use_reentrant=False)
            return out
        if self.call == "positional":
            return self.b(h, g)
        if self.call == "compute_dtype":  # keyword inputs a cast would not change
            return self.b(x=h.float(), scale=g.float())
        if self.call == "not_castable":  # float64, bool: no cast changes them
            return self.b(h, scale=g.double(), mask=h > 0).float()
        raise AssertionError(self.call)


def _x(rows: int = 4) -> torch.Tensor:
    return torch.randn(rows, 8, generator=torch.Generator().manual_seed(1))


def _call(model: nn.Module, **options: Any) -> Any:
    return famp.autocast(model, "c=bf16,o=f32", module_rules={"b": "c=f32"}, **options)


def _by_hand(model: _Model, x: torch.Tensor) -> torch.Tensor:
    """The rule written with torch.autocast: `b` in float32, both its inputs cast."""
    with torch.autocast("cpu", dtype=BF16):
        h, g = model.a(x), model.a(x * 0.7)
        with torch.autocast("cpu", enabled=False):
            return h.float() * g.float()


def _keyword_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [
        str(w.message)
        for w in caught
        if issubclass(w.category, famp.AutocastWarning) and "keyword inputs" in str(w.message)
    ]


def _grads(model: nn.Module, y: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    y.float().sum().backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("call", ["keywords", "mixed", "positional"])
def test_a_matched_modules_keyword_inputs_are_cast_as_positional_ones(call: str) -> None:
    model = _Model(call)
    f = _call(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = f(_x()), f(_x())
    assert _keyword_warnings(caught) == []
    expected = _by_hand(model, _x())
    assert first.dtype == torch.float32
    assert_bitwise_equal(first, expected)
    assert_bitwise_equal(second, expected)
    for got, want in zip(_grads(model, f(_x())), _grads(model, _by_hand(model, _x())), strict=True):
        assert_bitwise_equal(got, want)
    assert not model.b._forward_pre_hooks  # famp's hook is the call's only
    assert not model.b._forward_pre_hooks_with_kwargs


def test_inputs_no_cast_would_change_are_left_as_given() -> None:
    for call, expected in (
        ("compute_dtype", lambda h, g: h.float() * g.float()),
        ("not_castable", lambda h, g: (h.float() * g.double()).masked_fill(h > 0, 0.0).float()),
    ):
        model = _Model(call)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y = _call(model)(_x())
        assert _keyword_warnings(caught) == []
        with torch.autocast("cpu", dtype=BF16):
            h, g = model.a(_x()), model.a(_x() * 0.7)
        with torch.autocast("cpu", enabled=False):
            assert_bitwise_equal(y, expected(h, g))


def test_the_modules_own_pre_hooks_see_its_keyword_inputs_cast() -> None:
    # famp's global pre-hook casts the positional inputs before the module's own pre-hooks run;
    # its keyword pre-hook comes first among the module's own, so they see both cast.
    model = _Model("mixed")
    seen: list[tuple[torch.dtype, ...]] = []

    def own(module: nn.Module, args: Any, kwargs: Any) -> None:
        seen.append((args[0].dtype, kwargs["scale"].dtype))

    handle = model.b.register_forward_pre_hook(own, with_kwargs=True)
    y = _call(model)(_x())
    handle.remove()
    assert seen == [(torch.float32, torch.float32)]
    assert_bitwise_equal(y, _by_hand(model, _x()))


def test_a_matched_module_with_forward_hooks_of_its_own() -> None:
    # famp leaves such a module's scope from a hook of the module's own (after theirs).
    model = _Model("keywords")
    model.b.register_forward_hook(lambda module, args, output: output * 2)
    assert_bitwise_equal(_call(model)(_x()), _by_hand(model, _x()) * 2)


def test_a_module_writing_into_its_input_gets_its_keyword_inputs_uncast() -> None:
    class _Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inplace = True  # as nn.ReLU(inplace=True): the write reaches the caller's tensor

        def forward(self, x: Any = None) -> torch.Tensor:
            return x.mul_(2)

    class _Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.s = _Scale()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x.to(BF16)
            self.s(x=h)
            return h

    y = famp.autocast(_Holder(), "c=bf16,o=bf16", module_rules={"s": "c=f32"})(_x())
    assert_bitwise_equal(y, _x().to(BF16) * 2)  # written in place, in bfloat16


class _Chain(nn.Module):
    """Two products: computed in bfloat16, the first one's rounding shows in the second."""

    def forward(self, x: Any = None, scale: Any = None) -> torch.Tensor:
        return x * scale * 1.1


def test_a_nested_calls_keyword_inputs_are_cast_as_positional_ones() -> None:
    inner = famp.autocast(_Chain(), "c=f32")
    h = torch.randn(4, 8).to(BF16)
    assert not torch.equal(h * h * 1.1, (h.float() * h.float() * 1.1).to(BF16))  # it can tell
    for outer in (
        famp.autocast(lambda x: inner(x=x, scale=x), "c=bf16"),
        famp.autocast(lambda x: inner(x, scale=x), "c=bf16"),
        famp.autocast(lambda x: inner(x, x), "c=bf16"),
    ):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y = outer(h)
        assert _keyword_warnings(caught) == []
        expected = (h.float() * h.float() * 1.1).to(BF16)
        assert_bitwise_equal(y, expected)
        # Traced whole, with eager's bits (aot_eager rounds as eager does).
        assert_bitwise_equal(torch.compile(outer, backend="aot_eager", fullgraph=True)(h), expected)


def test_the_transformed_modules_own_keyword_inputs_are_cast_where_a_rule_matches_it() -> None:
    h = torch.randn(4, 8).to(BF16)
    for rules in ({"": "c=f32"}, {"*": "c=f32"}):
        y = famp.autocast(_Product(), "c=bf16,o=f32", module_rules=rules)(x=h, scale=h)
        assert_bitwise_equal(y, h.float() * h.float())
    y = famp.autocast(_Product(), "c=bf16,o=f32", module_rules={"nothing": "c=f32"})
    with pytest.warns(famp.AutocastWarning, match="matched no module"):
        out = y(x=h, scale=h)
    assert_bitwise_equal(out, (h * h).float())  # unmatched: autocast casts no product


def test_a_root_reached_through_functional_call_keeps_its_keyword_inputs_and_warns() -> None:
    # Its call has begun when famp's global pre-hook finds it: no hook of its own reaches them.
    model = _Product()
    h = torch.randn(4, 8).to(BF16)
    f = famp.autocast(
        lambda x: torch.func.functional_call(model, {}, (), {"x": x, "scale": x}),
        "c=bf16,o=f32",
        module_rules={"": "c=f32"},
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = f(h), f(h)
    messages = _keyword_warnings(caught)
    assert len(messages) == 1, messages  # once per transformed function
    assert "'x', 'scale'" in messages[0], messages[0]
    assert "torch.float32" in messages[0], messages[0]
    assert_bitwise_equal(first, (h * h).float())  # the bfloat16 product, as given
    assert_bitwise_equal(second, (h * h).float())


class _ScriptableProduct(nn.Module):
    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x * scale


def test_a_matched_script_modules_keyword_inputs_stay_as_given_and_warn() -> None:
    # TorchScript modules refuse Python hooks of their own: famp gives them none.
    class _Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            with warnings.catch_warnings():  # torch deprecates TorchScript (2.15 warns again)
                warnings.simplefilter("ignore", DeprecationWarning)
                warnings.simplefilter("ignore", FutureWarning)
                self.s = torch.jit.script(_ScriptableProduct())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x.to(BF16)
            return self.s(h, scale=h)  # type: ignore[no-any-return]

    f = famp.autocast(_Holder(), "c=bf16,o=f32", module_rules={"s": "c=f32"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = f(_x())
    messages = _keyword_warnings(caught)
    assert len(messages) == 1, messages
    assert "'scale'" in messages[0], messages[0]
    h = _x().to(BF16)
    assert_bitwise_equal(y, (h.float() * h).float())  # x cast, scale as given: promoted


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_keyword_inputs_are_cast_as_positional_ones(dynamic: bool) -> None:
    # Traced whole by Dynamo (famp's hook goes into the module's hook dicts while it traces):
    # with aot_eager, eager's bits (`torch.autocast` by hand), at a second shape too (a
    # recompile, or the dynamic graph); famp's own compile (inductor, which computes bfloat16
    # products in float32 and so cannot tell) the bits of the same call with positional inputs.
    torch._dynamo.reset()
    model = _Model("keywords")
    own = (model.b._forward_pre_hooks, model.b._forward_pre_hooks_with_kwargs)
    traced = torch.compile(_call(model), backend="aot_eager", fullgraph=True, dynamic=dynamic)
    by_keyword = _call(_Model("keywords"), compile=True)
    by_position = _call(_Model("positional"), compile=True)
    for rows in (4, 6):
        assert_bitwise_equal(traced(_x(rows)), _by_hand(model, _x(rows)))
        x = _x(rows)
        if dynamic:
            torch._dynamo.mark_dynamic(x, 0)
        got = by_keyword(x)
        assert got.dtype == torch.float32
        assert_bitwise_equal(got, by_position(x))
    # The module's own hook dicts back, themselves: a handle (a weak reference to them) works.
    assert model.b._forward_pre_hooks is own[0]
    assert model.b._forward_pre_hooks_with_kwargs is own[1]
    assert not own[0]
    assert not own[1]
    model.b.register_forward_pre_hook(lambda module, args: None).remove()


def test_a_compiled_model_called_inside_an_eager_call_casts_and_gives_its_hooks_back() -> None:
    # The root is entered while Dynamo traces, the call itself runs eagerly.
    torch._dynamo.reset()
    model = _Model("keywords")
    own = (model.b._forward_pre_hooks, model.b._forward_pre_hooks_with_kwargs)
    compiled = torch.compile(model, backend="aot_eager")
    f = famp.autocast(lambda x: compiled(x), "c=bf16,o=f32", module_rules={"b": "c=f32"})
    with warnings.catch_warnings():  # torch's: famp's global hooks fire for the wrapper too
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)`")
        for _ in range(2):
            assert_bitwise_equal(f(_x()), _by_hand(model, _x()))
    assert model.b._forward_pre_hooks is own[0]
    assert model.b._forward_pre_hooks_with_kwargs is own[1]
    assert not own[0]
    assert not own[1]


@pytest.mark.parametrize("how", ["torch.compile(module)", "module.compile()"])
def test_a_compiled_submodule_inside_an_eager_call_casts_and_compiles_once(how: str) -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = _Model("keywords")
    if how == "module.compile()":
        model.b.compile(backend="eager")
    else:
        model.b = torch.compile(model.b, backend="eager")  # type: ignore[assignment]
    f = _call(model)
    with warnings.catch_warnings():  # torch's: famp's global hooks fire for the wrapper too;
        # Dynamo reads `.grad` of the (non-leaf) input the compiled submodule receives
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)`")
        warnings.filterwarnings("ignore", message=r"The .grad attribute of a Tensor that is not")
        graphs = []
        for _ in range(3):
            assert_bitwise_equal(f(_x()), _by_hand(model, _x()))
            graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    # famp's hook, given anew in each call, keeps the compiled module's guards: no recompile.
    assert graphs[0] > 0, graphs
    assert graphs[1:] == graphs[:1] * 2, graphs


@pytest.mark.parametrize(
    "options",
    [{"use_reentrant": True}, {"use_reentrant": False}],
    ids=["reentrant", "nonreentrant"],
)
def test_keyword_inputs_cast_in_a_checkpointed_blocks_recomputation(
    options: dict[str, Any],
) -> None:
    plain, checkpointed = _Model("keywords"), _Model("keywords", options)
    x = _x().requires_grad_()
    y = _call(checkpointed)(x)
    assert_bitwise_equal(y, _call(plain)(_x()))
    assert_bitwise_equal(y, _by_hand(plain, _x()))
    for got, want in zip(_grads(checkpointed, y), _grads(plain, _call(plain)(_x())), strict=True):
        assert_bitwise_equal(got, want)
    assert not checkpointed.b._forward_pre_hooks


def test_a_checkpointed_matched_modules_keyword_inputs_are_cast_in_its_recomputation() -> None:
    # The matched module is the first module its recomputation enters: its hook must be there
    # before famp's global pre-hook enters it again.
    model, plain = _Model("checkpointed_module"), _Model("mixed")
    y = _call(model)(_x())
    assert_bitwise_equal(y, _by_hand(plain, _x()))
    for got, want in zip(_grads(model, y), _grads(plain, _call(plain)(_x())), strict=True):
        assert_bitwise_equal(got, want)


class _RaisesOnRecompute(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b = _Product()
        self.runs = 0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        if self.runs == 2:
            raise KeyError("boom in the recomputation")
        out: torch.Tensor = self.b(h, scale=h)
        return out


@pytest.mark.parametrize("then", ["a call outside famp", "a compiled famp call"])
def test_hooks_a_raising_recomputation_left_go_with_the_next_call(then: str) -> None:
    # The backward raised inside a bracketed node: the recomputation's hooks stay on the matched
    # module until the next module call or famp call drops what it left (as for famp's global
    # hooks); a call of the module outside famp, whose own hook loop began with famp's hook in
    # it, gets torch's numbers.
    class _Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = _RaisesOnRecompute()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = checkpoint(self.block, x.to(BF16) * 1.1, use_reentrant=False)
            return out

    model = _Outer()
    f = famp.autocast(model, "c=bf16,o=f32", module_rules={"block.b": "c=f32"})
    with pytest.raises(KeyError, match="boom in the recomputation"):
        f(_x().requires_grad_()).sum().backward()
    # Nothing of famp's in the module's dicts (before 2026-12-01 the recomputation's own hook
    # stayed there till the next call).
    assert not model.block.b._forward_pre_hooks
    if then == "a call outside famp":
        h = _x().to(BF16)
        assert_bitwise_equal(model.block.b(h, scale=h), h * h)  # torch's bfloat16 product
    else:
        torch.compile(_call(_Model("keywords")), backend="aot_eager", fullgraph=True)(_x())
    assert not model.block.b._forward_pre_hooks
    assert not model.block.b._forward_pre_hooks_with_kwargs


def test_another_threads_call_of_a_matched_module_is_left_alone() -> None:
    model = _Model("keywords")
    h = torch.randn(4, 8).to(BF16)
    other: list[torch.Tensor] = []

    class _Calls(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.m(x)  # famp's keyword hook is on `m.b` till the root's exit
            thread = threading.Thread(target=lambda: other.append(self.m.b(x=h, scale=h)))
            thread.start()
            thread.join()
            return y

    y = famp.autocast(_Calls(), "c=bf16,o=f32", module_rules={"m.b": "c=f32"})(_x())
    assert_bitwise_equal(y, _by_hand(model, _x()))
    assert_bitwise_equal(other[0], h * h)  # bfloat16 in, bfloat16 out: not famp's


def test_keyword_inputs_cast_under_torch_func_grad_and_vmap() -> None:
    # The root reached through functional_call: its matched submodule's keyword inputs are cast.
    def grads(call: str) -> dict[str, torch.Tensor]:
        model = _Model(call)
        params = {k: v.detach() for k, v in model.named_parameters()}
        f = _call(lambda p, x: torch.func.functional_call(model, p, (x,)))
        out: dict[str, torch.Tensor] = torch.func.grad(lambda p, x: f(p, x).sum())(params, _x())
        return out

    by_keyword, by_position = grads("keywords"), grads("positional")
    for name, g in by_keyword.items():
        assert_bitwise_equal(g, by_position[name])

    def per_sample(call: str) -> torch.Tensor:
        out: torch.Tensor = torch.func.vmap(_call(_Model(call)))(_x().reshape(2, 2, 8))
        return out

    assert_bitwise_equal(per_sample("keywords"), per_sample("positional"))


class _Raises(nn.Module):
    def forward(self, x: Any = None, scale: Any = None) -> torch.Tensor:
        raise RuntimeError("inside the matched module")


def _raising_hook(module: nn.Module, args: Any, output: Any) -> None:
    if isinstance(module, _Product):  # the matched module
        raise RuntimeError("inside the matched module")


@pytest.mark.parametrize("where", ["forward", "a global forward hook before famp's"])
def test_a_matched_module_that_raises_with_keyword_inputs_leaves_famp_clean(where: str) -> None:
    # torch calls always-called global hooks without the keyword inputs after a forward or a hook
    # before them raised (after a hook, with the forward's output).
    model = _Model("keywords")
    if where == "forward":
        model.b = _Raises()
    f = _call(model)
    handle = None
    if where != "forward":
        handle = torch.nn.modules.module.register_module_forward_hook(_raising_hook)
    try:
        with pytest.raises(RuntimeError, match="inside the matched module"):
            f(_x())
    finally:
        if handle is not None:
            handle.remove()
    assert not model.b._forward_pre_hooks  # famp's keyword hook is gone too
    good = _Model("positional")
    y = _call(good)(_x())  # no scope or hook left behind: the next call computes as torch
    assert_bitwise_equal(y, _by_hand(good, _x()))
    assert not torch.nn.modules.module._global_forward_hooks
