"""unscale_and_check on trees that share memory, and its usage errors in public terms."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch

import famp
from tests.conftest import compiled
from tests.helpers import assert_bitwise_equal
from tests.scaling.test_scaler import torch_unscale


def _donate(state: famp.ScalerState, grads: Any) -> Any:
    return famp.unscale_and_check(state, grads, donate=True)


def _unscale(state: famp.ScalerState, grads: Any) -> Any:
    return famp.unscale_and_check(state, grads)


PATHS = {
    "eager": lambda state, grads: famp.unscale_and_check(state, grads),
    "eager-donate": _donate,
    "compiled": lambda state, grads: compiled(_unscale)(state, grads),
    "compiled-donate": lambda state, grads: compiled(_donate)(state, grads),
}


# --- the same tensor twice: tied weights -------------------------------------------------------


class TiedModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(6, 4)
        self.mid = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.embed(tokens))))


def scaled_backward(model: torch.nn.Module, scale_value: float, bad: bool) -> None:
    tokens = torch.tensor([0, 3, 5, 1])
    loss = model(tokens).square().mean() * scale_value
    loss.backward()
    if bad:
        model.embed.weight.grad[2, 1] = math.inf  # type: ignore[index]


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("scale_value", [1024.0, 3.0])
@pytest.mark.parametrize("bad", [False, True])
def test_tied_weights_are_unscaled_once_on_every_path_like_gradscaler(
    path: str, scale_value: float, bad: bool
) -> None:
    # The tree the issue describes: state_dict(keep_vars=True) lists the tied parameter twice.
    model = TiedModel()
    scaled_backward(model, scale_value, bad)
    grads = {k: v.grad for k, v in model.state_dict(keep_vars=True).items()}
    assert grads["embed.weight"] is grads["head.weight"]
    # GradScaler: the optimizer holds the parameter once.
    reference = TiedModel()
    scaled_backward(reference, scale_value, bad)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale_value)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    assert len(opt.param_groups[0]["params"]) == 3
    scaler.scale(torch.ones(()))
    scaler.unscale_(opt)
    expected_found = scaler._found_inf_per_device(opt)[torch.device("cpu")]
    out, found = PATHS[path](famp.init_scaler(scale_value), grads)
    for name, p in reference.state_dict(keep_vars=True).items():
        assert out[name].dtype == torch.float32
        assert_bitwise_equal(out[name], p.grad)
    assert_bitwise_equal(found, expected_found)
    assert found.item() == float(bad)


# --- overlapping views of one buffer -------------------------------------------------------------


def views_tree(bad: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(12, generator=gen) * 1e3
    if bad:
        base[4] = math.nan  # in the overlap of a and b
    grid = (torch.randn(4, 2, generator=gen) * 1e3).contiguous()
    tree = {
        "a": base[0:6],
        "b": base[3:9],  # overlaps a in 3, 4, 5
        "c": base[9:12],  # shares the buffer, not the elements
        "even": grid[:, 0],  # interleaved with odd: no element shared, the spans intersect
        "odd": grid[:, 1],
        "alone": torch.randn(5, generator=gen) * 1e3,
    }
    return base, tree


@pytest.mark.parametrize("bad", [False, True])
@pytest.mark.parametrize("scale_value", [3.0, 1.0])
def test_overlapping_views_give_the_same_bits_eager_and_compiled_donated_or_not(
    bad: bool, scale_value: float
) -> None:
    state = famp.init_scaler(scale_value)
    results = {}
    for path, run in PATHS.items():
        base, tree = views_tree(bad)
        # The oracle: each leaf unscaled by GradScaler from a private copy of what it holds.
        expected, expected_found = torch_unscale(scale_value, list(tree.values()))
        out, found = run(state, tree)
        for (name, leaf), e in zip(out.items(), expected, strict=True):
            assert leaf.dtype == torch.float32
            assert_bitwise_equal(leaf, e)
            if path.endswith("donate"):  # the given buffers hold the results, each unscaled once
                assert_bitwise_equal(tree[name], e)
        assert_bitwise_equal(found, expected_found)
        assert found.item() == float(bad)
        results[path] = base
    whole, _ = torch_unscale(scale_value, [views_tree(bad)[0]])
    for path in ("eager-donate", "compiled-donate"):
        assert_bitwise_equal(results[path], whole[0])  # every element unscaled exactly once


def test_disjoint_views_of_one_buffer_are_still_unscaled_in_place() -> None:
    flat = torch.arange(1.0, 11.0) * 3  # a flat gradient buffer, as DDP's bucket views
    grads = {"w": flat[0:6].view(2, 3), "b": flat[6:10]}
    pointers = {k: g.data_ptr() for k, g in grads.items()}
    expected, _ = torch_unscale(3.0, list(grads.values()))
    out, found = famp.unscale_and_check(famp.init_scaler(3.0), grads, donate=True)
    for (k, g), e in zip(out.items(), expected, strict=True):
        assert g.data_ptr() == pointers[k]
        assert_bitwise_equal(g, e)
    assert_bitwise_equal(flat, torch.arange(1.0, 11.0))
    assert found.item() == 0.0


def test_donated_views_with_different_dtypes_sharing_memory_are_refused() -> None:
    base = torch.arange(1.0, 9.0)
    grads = {"f": base[0:4], "h": base[2:8].view(torch.bfloat16)}
    before = base.clone()
    with pytest.raises(ValueError, match=r"tree\['f'\], tree\['h'\] share memory with different"):
        famp.unscale_and_check(famp.init_scaler(2.0), grads, donate=True)
    assert_bitwise_equal(base, before)  # nothing half-applied


def test_donated_expanded_tensor_is_refused() -> None:
    grads = {"ok": torch.ones(3), "e": torch.ones(1).expand(4)}
    with pytest.raises(ValueError, match=r"tree\['e'\] has elements that share memory"):
        famp.unscale_and_check(famp.init_scaler(2.0), grads, donate=True)
    assert_bitwise_equal(grads["ok"], torch.ones(3))
    # Out of place it is an ordinary read.
    out, _ = famp.unscale_and_check(famp.init_scaler(2.0), grads)
    assert_bitwise_equal(out["e"], torch.full((4,), 0.5))


def test_donated_expanded_tensor_with_a_wide_stride_is_refused_by_famp() -> None:
    grads = {"e": (torch.arange(200.0) * 4)[::100].unsqueeze(0).expand(3, 2)}  # strides (0, 100)
    with pytest.raises(ValueError, match=r"tree\['e'\] has elements that share memory"):
        famp.unscale_and_check(famp.init_scaler(2.0), grads, donate=True)


@pytest.mark.parametrize("bad", [False, True])
@pytest.mark.parametrize("scale_value", [3.0, 1024.0])
def test_donated_windows_that_overlap_with_gaps_between_them_are_unscaled_once(
    bad: bool, scale_value: float
) -> None:
    """`unfold` windows of a strided slice: shape (8, 2, 2), strides (10, 1, 1), neighbouring
    windows share an element, and their span (73 elements) is no smaller than their count (32),
    so the span alone does not show it. torch's kernel in place (what GradScaler.unscale_ runs
    on such a .grad) unscales each shared element twice; famp unscales every element once."""
    base = torch.randn(8, 10, generator=torch.Generator().manual_seed(0)) * 1e3
    if bad:
        base[2, 1] = math.inf  # in the element both windows of row 2 hold
    windows = base[:, :3].unfold(1, 2, 1)
    held = base.clone()[:, :3].unfold(1, 2, 1)  # the same layout, for GradScaler below
    expected, expected_found = torch_unscale(scale_value, [windows.clone()])
    out, found = famp.unscale_and_check(famp.init_scaler(scale_value), [windows], donate=True)
    assert out[0] is windows
    assert_bitwise_equal(windows, expected[0])
    assert_bitwise_equal(found, expected_found)
    # GradScaler.unscale_ on such a .grad (the kernel in place) unscales the shared ones twice.
    param = torch.nn.Parameter(torch.zeros(held.shape))
    param.grad = held
    scaler = torch.amp.GradScaler("cpu", init_scale=scale_value)
    scaler.scale(torch.ones(()))
    scaler.unscale_(torch.optim.SGD([param], lr=0.1))
    assert not torch.equal(held[:, 0, 1], expected[0][:, 0, 1])  # the shared elements
    assert torch.equal(held[:, 0, 0], expected[0][:, 0, 0])  # the others


def test_donating_gradients_that_require_grad_is_refused() -> None:
    g = torch.ones(3, requires_grad=True) * 4
    with pytest.raises(ValueError, match=r"donate=True .* tree\[1\], which requires grad"):
        famp.unscale_and_check(famp.init_scaler(2.0), [torch.ones(2), g], donate=True)


# --- usage errors --------------------------------------------------------------------------------


def test_scale_with_the_arguments_swapped_says_the_state_comes_first() -> None:
    state = famp.init_scaler(2.0)
    loss = torch.tensor(1.0)
    with pytest.raises(TypeError, match=r"takes the state first: famp.scale\(state, loss\)"):
        famp.scale(loss, state)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"state must be a famp\.ScalerState, got NoneType"):
        famp.scale(None, loss)  # type: ignore[arg-type]


def test_unscale_and_check_usage_errors_name_the_argument() -> None:
    state = famp.init_scaler(2.0)
    grads = [torch.ones(2)]
    with pytest.raises(TypeError, match=r"state first: famp.unscale_and_check\(state, grads\)"):
        famp.unscale_and_check(grads, state)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"state must be a famp\.ScalerState, got NoneType"):
        famp.unscale_and_check(None, grads)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="donate must be a bool, got 'yes'"):
        famp.unscale_and_check(state, grads, donate="yes")  # type: ignore[arg-type]
    assert_bitwise_equal(grads[0], torch.ones(2))


def test_meta_grads_need_a_meta_scale() -> None:
    grads = {"w": torch.ones(3, device="meta"), "b": torch.ones(2)}
    with pytest.raises(ValueError, match=r"tree\['w'\] is on the meta device"):
        famp.unscale_and_check(famp.init_scaler(4.0), grads)
    # With the scale on meta too, as GradScaler makes it from a meta loss: shapes only.
    state = famp.init_scaler(4.0, device="meta")
    out, found = famp.unscale_and_check(state, {"w": torch.ones(3, device="meta")})
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    p = torch.nn.Parameter(torch.ones(3, device="meta"))
    p.grad = torch.ones(3, device="meta")
    scaler.scale(torch.ones((), device="meta"))
    scaler.unscale_(torch.optim.SGD([p], lr=0.1))
    assert (out["w"].device, out["w"].dtype, out["w"].shape) == (p.grad.device, torch.float32, (3,))
    assert (found.device.type, found.dtype, found.shape) == ("meta", torch.float32, ())


_META_IN_PUBLIC_TERMS = r"is on the meta device \(shapes only, no values\), but the tensors it"


def test_a_meta_state_with_cpu_tensors_is_refused_naming_the_scale() -> None:
    """A state made on the meta device met CPU tensors: torch's own messages came out ("Cannot
    copy out of meta tensor; no data!", "Tensor.item() cannot be called on meta tensors")."""
    state = famp.init_scaler(4.0, device="meta")
    scale_error = "the state's scale " + _META_IN_PUBLIC_TERMS + " meets are on cpu: make it on cpu"
    with pytest.raises(ValueError, match=scale_error):
        famp.scale(state, torch.tensor(2.0))
    grads = {"a": torch.ones(2, device="meta"), "b": torch.full((2,), 4.0)}
    with pytest.raises(ValueError, match=scale_error):
        famp.unscale_and_check(state, grads, donate=True)
    assert_bitwise_equal(grads["b"], torch.full((2,), 4.0))  # nothing half-applied
    w = torch.nn.Parameter(torch.ones(3))
    w.grad = torch.full((3,), 4.0)
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=scale_error):
        famp.optimizer_step(opt, state)
    assert_bitwise_equal(w.detach(), torch.ones(3))
    assert_bitwise_equal(w.grad, torch.full((3,), 4.0))
    assert not opt.state
    for name in ("scale", "growth_tracker"):
        leaf = {"scale": torch.ones(()), "growth_tracker": torch.zeros((), dtype=torch.int32)}
        half_meta = famp.ScalerState(**{**leaf, name: getattr(state, name)})
        with pytest.raises(ValueError, match=rf"to_state_dict: state\.{name} is on the meta"):
            famp.to_state_dict(half_meta)


@pytest.mark.parametrize("fn", ["skip_on_overflow", "select_tree"])
def test_a_meta_predicate_with_cpu_trees_is_refused_naming_it(fn: str) -> None:
    """Eagerly, a meta found_inf (or pred) with CPU trees gave "Cannot copy out of meta tensor"."""
    meta = torch.zeros((), dtype=torch.bool, device="meta")
    updated, current = {"w": torch.zeros(2)}, {"w": torch.ones(2)}
    name = "found_inf" if fn == "skip_on_overflow" else "pred"
    with pytest.raises(ValueError, match=rf"famp\.{fn}'s {name} " + _META_IN_PUBLIC_TERMS):
        getattr(famp, fn)(meta, updated, current)


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_nested_tensors_are_refused_naming_the_leaf(layout: torch.layout) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # nested tensors are a prototype API
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=layout)
    # GradScaler's kernel raises NotImplementedError on them too.
    with pytest.raises(TypeError, match=r"the leaf at tree\['n'\] is a nested tensor"):
        famp.unscale_and_check(famp.init_scaler(4.0), {"ok": torch.ones(2), "n": nested})
