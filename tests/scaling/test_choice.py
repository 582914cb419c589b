"""select_tree compiled on the CPU: one `famp::select_` for the plain leaves, torch.where's bits.

The values are checked against eager `torch.where` bit for bit (random bit patterns, NaN payloads
of every floating dtype), with static and dynamic shapes and after a recompile; what the
compiled program does is checked on the graph Dynamo traces and on the code inductor writes.
"""

from __future__ import annotations

import math
import re
from typing import Any

import optree
import pytest
import torch
from torch._inductor.utils import run_and_get_code

import famp
from tests.helpers import assert_bitwise_equal
from tests.scaling.test_scaler_unscale import random_bits

SELECT_OP = torch.ops.famp.select_.default
DTYPES = [torch.float32, torch.bfloat16, torch.float64, torch.float16, torch.int64, torch.bool]


def _leaves(gen: torch.Generator, n: int, shape: tuple[int, ...] = (3, 5)) -> list[torch.Tensor]:
    """n leaves of six dtypes: random bit patterns for the floating ones."""
    out = []
    for i in range(n):
        dtype = DTYPES[i % len(DTYPES)]
        if dtype == torch.int64:
            out.append(torch.randint(-9, 9, shape, generator=gen))
        elif dtype == torch.bool:
            out.append(torch.rand(shape, generator=gen) < 0.5)
        else:
            out.append(random_bits(shape, dtype, gen))
    return out


def _where(pred: torch.Tensor, new: Any, old: Any) -> Any:
    return optree.tree_map(lambda a, b: torch.where(pred, a, b), new, old)


def _select(pred: torch.Tensor, new: Any, old: Any) -> Any:
    return famp.select_tree(pred, new, old)


_COMPILED = {
    "static": torch.compile(_select, fullgraph=True),
    "dynamic": torch.compile(
        lambda pred, new, old: famp.select_tree(pred, new, old), fullgraph=True, dynamic=True
    ),
}


@pytest.mark.parametrize("mode", sorted(_COMPILED))
@pytest.mark.parametrize("pred", [True, False])
def test_compiled_select_equals_torch_where_and_leaves_its_inputs_untouched(
    mode: str, pred: bool
) -> None:
    """Bits of eager `torch.where`; new tensors; no input written, whichever tree is chosen.

    The trees share leaves (a tied leaf twice in `on_true`, one tensor on both sides), and the
    second call's shapes differ from the first's: a recompile under static shapes.
    """
    gen = torch.Generator().manual_seed(3)
    for shape in ((3, 5), (2, 7)):
        new, old = _leaves(gen, 12, shape), _leaves(gen, 12, shape)
        new[6] = new[0]  # tied: one tensor twice in on_true (both float32)
        old[7] = new[7]  # one tensor on both sides (bfloat16)
        before = [x.clone() for x in new + old]
        out = _COMPILED[mode](torch.tensor(pred), new, old)
        expected = _where(torch.tensor(pred), new, old)
        for got, want in zip(out, expected, strict=True):
            assert_bitwise_equal(got, want)
        for x, kept in zip(new + old, before, strict=True):
            assert_bitwise_equal(x, kept)
        inputs = {x.data_ptr() for x in new + old}
        assert not inputs & {x.data_ptr() for x in out}, "a result shares an input's memory"
        assert out[0].data_ptr() != out[6].data_ptr()  # a tied leaf gives two results, as where


def _dynamo_graph(fn: Any, *args: Any) -> tuple[Any, torch.fx.GraphModule]:
    """`fn(*args)` compiled with a backend that keeps the graph Dynamo traced."""
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, fullgraph=True, backend=backend)(*args)
    (graph,) = graphs
    return out, graph


@pytest.mark.parametrize("pred", [True, False])
def test_compiled_select_on_the_cpu_is_one_operator_and_where_for_leaves_with_a_graph(
    pred: bool,
) -> None:
    """40 plain leaves: one `famp::select_` call. Leaves that require grad: one where each.

    A `torch.where` per leaf cost 3.0-4.4 s of compile time (Dynamo and inductor) for a
    120-parameter step (docs/benchmarks.md). The operator has no derivative, so pairs in which a
    leaf requires grad (grad enabled) keep `torch.where`, which gives both trees gradients.
    """
    gen = torch.Generator().manual_seed(5)
    new, old = _leaves(gen, 40), _leaves(gen, 40)
    new += [torch.randn(4, generator=gen, requires_grad=True) for _ in range(3)]
    old += [torch.randn(4, generator=gen) for _ in range(3)]
    out, graph = _dynamo_graph(_select, torch.tensor(pred), new, old)
    for got, want in zip(out, _where(torch.tensor(pred), new, old), strict=True):
        assert_bitwise_equal(got, want)
    assert [x.requires_grad for x in out] == [False] * 40 + [True] * 3
    calls = [n for n in graph.graph.nodes if n.target is SELECT_OP]
    wheres = [n for n in graph.graph.nodes if n.target in (torch.where, torch.ops.aten.where.self)]
    assert len(calls) == 1
    assert len(calls[0].args[1]) == 40
    assert len(wheres) == 3


def test_compiled_select_takes_where_for_leaves_off_the_cpu() -> None:
    """Meta leaves (another device) are not the operator's: they take `torch.where`."""
    new = {"cpu": torch.ones(3), "meta": torch.ones(3, device="meta")}
    old = {"cpu": torch.zeros(3), "meta": torch.zeros(3, device="meta")}
    out, graph = _dynamo_graph(_select, torch.tensor(False), new, old)
    assert_bitwise_equal(out["cpu"], torch.zeros(3))
    assert out["meta"].device.type == "meta"
    calls = [n for n in graph.graph.nodes if n.target is SELECT_OP]
    wheres = [n for n in graph.graph.nodes if n.target in (torch.where, torch.ops.aten.where.self)]
    assert (len(calls), len(calls[0].args[1]), len(wheres)) == (1, 1, 1)


def test_compiled_select_under_vmap_selects_per_sample() -> None:
    """Under `torch.func.vmap` (no batching rule for the operator) each pair is a where."""
    preds = torch.tensor([True, False, True])
    a, b = torch.randn(3, 4), torch.randn(3, 4)

    def per_sample(p: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> Any:
        return famp.select_tree(p, {"w": x}, {"w": y})

    torch._dynamo.reset()
    out = torch.compile(torch.func.vmap(per_sample), fullgraph=True)(preds, a, b)
    assert_bitwise_equal(out["w"], torch.where(preds[:, None], a, b))


def _sgd_and_skip(params: Any, grads: Any, found_inf: torch.Tensor) -> Any:
    new = {k: params[k] - 0.1 * grads[k] for k in params}
    return famp.skip_on_overflow(found_inf, new, params)


def test_compiled_skip_writes_the_update_once_and_chooses_in_place() -> None:
    """The update is written into the buffers the step returns, and the skip chooses in them.

    Inductor's code allocates one buffer per parameter (and the predicate): the choice makes no
    copy of its own, and a step that is not skipped makes no pass over memory for it.
    """
    gen = torch.Generator().manual_seed(9)
    params = {f"w{i}": random_bits((4, 3), torch.float32, gen) for i in range(5)}
    params["h"] = random_bits((6,), torch.bfloat16, gen)
    grads = {k: torch.randn(v.shape, generator=gen).to(v.dtype) for k, v in params.items()}
    compiled = torch.compile(_sgd_and_skip, fullgraph=True)
    _, (code,) = run_and_get_code(compiled, params, grads, torch.tensor(0.0))
    call = code[code.index("def call(") :]
    assert call.count("torch.ops.famp.select_.default(") == 1
    allocated = re.findall(r"empty_strided_cpu\(\(([^)]*)\)", call)
    assert len(allocated) == len(params) + 1, allocated  # the outputs and the 0-d predicate
    for found_inf in (0.0, 1.0, math.nan, -0.0):
        found = torch.tensor(found_inf)
        out = compiled(params, grads, found)
        for key, got in out.items():
            new = params[key] - 0.1 * grads[key]
            assert_bitwise_equal(got, torch.where(found == 0, new, params[key]))


def _select_then_write(pred: torch.Tensor, new: Any, old: Any) -> Any:
    out = famp.select_tree(pred, new, old)
    for tree in (new, old):  # EMA-style in-place writes to both inputs after the choice
        for x in tree.values():
            x.mul_(2)
    return out


_COMPILED_WRITE = torch.compile(_select_then_write, fullgraph=True)


@pytest.mark.parametrize("pred", [True, False])
def test_compiled_select_is_not_changed_by_later_in_place_writes_to_its_inputs(pred: bool) -> None:
    """The results are the inputs' values when `select_tree` ran, as `torch.where`'s are."""
    gen = torch.Generator().manual_seed(13)
    floats = DTYPES[:4]  # finite values: doubling them is exact, compiled or not
    new = {f"w{i}": torch.randn(3, 5, generator=gen).to(t) for i, t in enumerate(floats)}
    old = {f"w{i}": torch.randn(3, 5, generator=gen).to(t) for i, t in enumerate(floats)}
    expected = _where(torch.tensor(pred), new, old)
    doubled = {k: v * 2 for k, v in new.items()}
    out = _COMPILED_WRITE(torch.tensor(pred), new, old)
    for key in expected:
        assert_bitwise_equal(out[key], expected[key])
        assert_bitwise_equal(new[key], doubled[key])  # the writes happened


def _loss_and_moment(
    w: torch.Tensor, x: torch.Tensor, m: torch.Tensor, pred: torch.Tensor
) -> tuple[torch.Tensor, Any]:
    loss = (w * x).square().sum()
    return loss, famp.select_tree(pred, {"m": m * 0.9 + x}, {"m": m})


_COMPILED_TRAINING = torch.compile(_loss_and_moment, fullgraph=True)


@pytest.mark.parametrize("pred", [True, False])
def test_compiled_select_in_a_graph_that_is_differentiated(pred: bool) -> None:
    """An input requires grad, so the graph is compiled for training: the choice (of tensors
    that carry no graph) is the operator's, and the backward is autograd's, unchanged."""
    gen = torch.Generator().manual_seed(17)
    w = torch.randn(5, generator=gen, requires_grad=True)
    x, m = torch.randn(5, generator=gen), torch.randn(5, generator=gen)
    loss, out = _COMPILED_TRAINING(w, x, m, torch.tensor(pred))
    loss.backward()
    expected = w.detach().clone().requires_grad_()
    (expected * x).square().sum().backward()
    assert expected.grad is not None
    assert w.grad is not None
    torch.testing.assert_close(w.grad, expected.grad, rtol=0, atol=1e-6)
    assert_bitwise_equal(out["m"], torch.where(torch.tensor(pred), m * 0.9 + x, m))
    assert not out["m"].requires_grad


def _layouts(gen: torch.Generator) -> list[torch.Tensor]:
    """Leaves in the layouts a tree may hold: transposed, strided slice, expanded, 0-d, empty."""
    base = random_bits((6, 4), torch.float32, gen)
    return [
        base.t(),
        base[::2, 1:],
        random_bits((1, 4), torch.bfloat16, gen).expand(3, 4),
        random_bits((), torch.float64, gen),
        torch.empty(0, 3),
    ]


_COMPILED_LAYOUTS = torch.compile(_select, fullgraph=True)


@pytest.mark.parametrize("pred", [True, False])
def test_compiled_select_of_leaves_in_any_layout_equals_torch_where(pred: bool) -> None:
    gen = torch.Generator().manual_seed(19)
    new, old = _layouts(gen), _layouts(gen)
    old[0] = old[0].contiguous()  # paired leaves of different layouts
    out = _COMPILED_LAYOUTS(torch.tensor(pred), new, old)
    for got, want in zip(out, _where(torch.tensor(pred), new, old), strict=True):
        assert_bitwise_equal(got, want)


def _slice_trees(flat: torch.Tensor, flat_old: torch.Tensor) -> tuple[Any, Any, torch.Tensor]:
    """Parameters kept as views of one flat buffer, an input, and of an intermediate result."""
    flipped = flat.flip(0)  # returned too: its slice must be copied, not written in place
    new = [flat[:6].view(2, 3), flat[6:], flat.view(4, -1)[1], flipped[2:], flat[::3]]
    old = [flat_old[:6].view(2, 3), flat_old[6:], flat_old.view(4, -1)[1], flat_old[2:]]
    return new, [*old, flat_old[::3]], flipped


def _slices(pred: torch.Tensor, flat: torch.Tensor, flat_old: torch.Tensor) -> Any:
    new, old, flipped = _slice_trees(flat, flat_old)
    return famp.select_tree(pred, new, old), flipped


_COMPILED_SLICES = {
    "static": torch.compile(_slices, fullgraph=True),
    "dynamic": torch.compile(_slices, fullgraph=True, dynamic=True),
}


@pytest.mark.parametrize("mode", sorted(_COMPILED))
@pytest.mark.parametrize("pred", [True, False])
def test_compiled_select_of_views_at_a_storage_offset_equals_torch_where(
    mode: str, pred: bool
) -> None:
    """Views past element 0 of an input or of an intermediate result keep their elements.

    Before 2026-12-01 inductor dropped the copy of such an `on_true` leaf that `famp::select_`
    writes, and read it from the buffer's element 0 (`flat[6:]` came back as `flat[:6]`); views
    now take `torch.where`.
    Leaves that are views passed in, and then (a recompile under static shapes) other sizes.
    """
    gen = torch.Generator().manual_seed(23)
    p = torch.tensor(pred)
    for size, dtype in ((12, torch.float32), (20, torch.bfloat16)):
        flat, flat_old = random_bits((size,), dtype, gen), random_bits((size,), dtype, gen)
        before = flat.clone(), flat_old.clone()
        out, flipped = _COMPILED_SLICES[mode](p, flat, flat_old)
        for got, want in zip(out, _where(p, *_slice_trees(flat, flat_old)[:2]), strict=True):
            assert_bitwise_equal(got, want)
        assert_bitwise_equal(flipped, flat.flip(0))
        assert_bitwise_equal(flat, before[0])
        assert_bitwise_equal(flat_old, before[1])
        new, old = [flat[2:], flat[1::2], flat[3:5]], [flat_old[2:], flat_old[1::2], flat_old[:2]]
        for got, want in zip(_COMPILED[mode](p, new, old), _where(p, new, old), strict=True):
            assert_bitwise_equal(got, want)
