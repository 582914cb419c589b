"""famp.nonfinite_report against a naive per-element reference, unscale_and_check and gloo ranks."""

from __future__ import annotations

import collections
import math
from typing import Any

import hypothesis
import hypothesis.strategies as st
import optree
import pytest
import torch

import famp
from famp._compat import torch_pytree
from tests.conftest import compiled
from tests.helpers import assert_bitwise_equal, spawn_ranks
from tests.scaling.report_worker import case_tree

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def naive(x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(non-finite count, largest finite |x| as float32), one Python float at a time."""
    values = x.double().reshape(-1).tolist()
    finite = [abs(v) for v in values if math.isfinite(v)]
    largest = max(finite, default=0.0)
    return sum(not math.isfinite(v) for v in values), torch.tensor(largest).to(torch.float32)


@st.composite
def leaves(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    n = draw(st.integers(0, 40))
    top = torch.finfo(dtype).max
    special = st.sampled_from([math.inf, -math.inf, math.nan, top, -top, 0.0, -0.0])
    values = draw(st.lists(st.floats(-1e4, 1e4) | special, min_size=n, max_size=n))
    shape = (n,) if draw(st.booleans()) or n % 2 else (2, n // 2)
    return torch.tensor(values, dtype=torch.float64).to(dtype).reshape(shape)


trees = st.dictionaries(st.sampled_from(list("abcdefgh")), leaves(), max_size=6)


@hypothesis.given(tree=trees)
def test_counts_and_amax_equal_a_naive_isfinite_reference(tree: dict[str, torch.Tensor]) -> None:
    report = famp.nonfinite_report(tree)
    assert report.counts.keys() == report.amax.keys() == tree.keys()
    for key, x in tree.items():
        count, amax = report.counts[key], report.amax[key]
        expected_count, expected_amax = naive(x)
        assert count.dtype == torch.int64
        assert count.shape == ()
        assert count.item() == expected_count
        assert amax.dtype == torch.float32
        assert_bitwise_equal(amax, expected_amax)
    any_bad = any(naive(x)[0] for x in tree.values())
    assert report.found_inf.dtype == torch.float32
    assert report.found_inf.item() == float(any_bad)
    # the same found_inf as unscale_and_check on the same tree
    _, found = famp.unscale_and_check(famp.init_scaler(8.0), tree)
    assert_bitwise_equal(report.found_inf, found)


def report_of(tree: Any) -> famp.NonfiniteReport:
    return famp.nonfinite_report(tree)


def _big_tree() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    tree: dict[str, Any] = {
        f"layer{i}": torch.randn(300_000, generator=gen, dtype=torch.float32) * 100
        for i in range(3)
    }  # over 1 MiB each: the CPU path's aminmax branch
    tree["layer1"][12345] = math.nan
    tree["layer2"][7] = -math.inf
    tree["layer2"][8] = math.inf
    tree["half"] = torch.tensor([1.0, 60000.0, math.inf], dtype=torch.float16)
    tree["wide"] = torch.tensor([1e300, -2.0], dtype=torch.float64)
    tree["nested"] = [torch.zeros(0, dtype=torch.bfloat16), None]
    return tree


@pytest.mark.slow
def test_compiled_report_equals_eager_and_the_reference() -> None:
    tree = _big_tree()
    eager = famp.nonfinite_report(tree)
    out = compiled(report_of)(tree)
    assert isinstance(out, famp.NonfiniteReport)
    assert (out.paths, out.dtypes, out.world_size) == (eager.paths, eager.dtypes, None)
    for a, e, x in zip(
        optree.tree_leaves(out.counts),
        optree.tree_leaves(eager.counts),
        optree.tree_leaves(tree),
        strict=True,
    ):
        assert a.dtype == torch.int64
        assert_bitwise_equal(a, e)
        assert a.item() == naive(x)[0]
    for a, e, x in zip(
        optree.tree_leaves(out.amax),
        optree.tree_leaves(eager.amax),
        optree.tree_leaves(tree),
        strict=True,
    ):
        assert a.dtype == torch.float32
        assert_bitwise_equal(a, e)
        assert_bitwise_equal(a, naive(x)[1])
    assert out.amax["wide"].item() == math.inf  # float64 1e300 rounds to float32 inf
    assert_bitwise_equal(out.found_inf, famp.unscale_and_check(famp.init_scaler(), tree)[1])


def found_and_worst(report: famp.NonfiniteReport) -> torch.Tensor:
    return report.found_inf + torch.stack(optree.tree_leaves(report.counts)).amax()


@pytest.mark.slow
def test_a_report_passes_into_a_compiled_function_as_a_pytree() -> None:
    report = famp.nonfinite_report(_big_tree())
    assert compiled(found_and_worst)(report).item() == 3.0


@pytest.mark.parametrize("tree", [_big_tree(), {"w": torch.ones(2)}, torch.ones(3), {}])
def test_report_round_trips_through_optree_and_torch_pytree(tree: Any) -> None:
    report = famp.nonfinite_report(tree)
    for flatten, unflatten in (
        (optree.tree_flatten, optree.tree_unflatten),
        (torch_pytree.tree_flatten, torch_pytree.tree_unflatten),
    ):
        leaves, spec = flatten(report)
        back = (
            unflatten(spec, leaves) if flatten is optree.tree_flatten else unflatten(leaves, spec)
        )
        assert isinstance(back, famp.NonfiniteReport)
        assert (back.paths, back.dtypes, back.world_size) == (
            report.paths,
            report.dtypes,
            report.world_size,
        )
        assert_bitwise_equal(back.found_inf, report.found_inf)
        assert optree.tree_structure(back.counts) == optree.tree_structure(report.counts)
    spec = torch_pytree.tree_structure(report)
    assert torch_pytree.treespec_loads(torch_pytree.treespec_dumps(spec)) == spec


def test_under_vmap_the_figures_are_per_sample() -> None:
    batch = torch.tensor([[1.0, -3.0, 2.0], [math.inf, 5.0, math.nan], [0.0, 0.0, 0.0]])

    def figures(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        report = famp.nonfinite_report({"g": x})
        return report.counts["g"], report.amax["g"], report.found_inf

    counts, amax, found = torch.func.vmap(figures)(batch)
    assert counts.dtype == torch.int64
    assert counts.tolist() == [naive(x)[0] for x in batch]
    assert amax.dtype == torch.float32
    assert amax.tolist() == [naive(x)[1].item() for x in batch]
    assert found.tolist() == [0.0, 1.0, 0.0]


def test_summary_names_the_bad_leaves_worst_first_with_headroom() -> None:
    tree = {
        "block.0.mlp.weight": torch.tensor([1.0, math.inf, math.nan, 2.0], dtype=torch.float16),
        "block.1.attn.weight": torch.tensor([math.nan, 4096.0], dtype=torch.float16),
        "norm.weight": torch.tensor([2.0**100], dtype=torch.bfloat16),
        "head.bias": torch.ones(3),
    }
    text = famp.nonfinite_report(tree).summary()
    lines = text.splitlines()
    assert lines[0] == "found_inf = 1: 2 of 4 leaves hold non-finite values"
    assert lines[1] == "  block.0.mlp.weight: 2 non-finite (float16), largest finite |x| 2"
    assert lines[2] == "  block.1.attn.weight: 1 non-finite (float16), largest finite |x| 4096"
    assert lines[3] == "headroom of float16/bfloat16 leaves, lowest first:"
    # A leaf that holds non-finite values has no headroom left: listed first, whatever its amax.
    assert lines[4] == "  block.0.mlp.weight: none, it overflowed (float16, largest finite |x| 2)"
    assert lines[5] == (
        "  block.1.attn.weight: none, it overflowed (float16, largest finite |x| 4096)"
    )
    assert lines[6].startswith(
        f"  norm.weight: {math.log2(torch.finfo(torch.bfloat16).max / 2**100):.1f} bits"
    )
    assert "head.bias" not in text


def test_summary_lists_an_all_inf_leaf_as_overflowed_before_a_finite_one() -> None:
    # An all-inf leaf has no finite values (amax 0): it must not read as infinite headroom.
    tree = {
        "overflowed": torch.full((4,), math.inf, dtype=torch.float16),
        "fine": torch.full((4,), 60000.0, dtype=torch.float16),
    }
    lines = famp.nonfinite_report(tree).summary().splitlines()
    assert lines[-2] == "  overflowed: none, it overflowed (float16, largest finite |x| 0)"
    assert lines[-1].startswith("  fine: 0.1 bits (float16")


def test_summary_counts_leaves_whose_paths_print_alike() -> None:
    # Two leaves, both non-finite, whose paths print the same: both are counted.
    tree = {"a.b": torch.tensor([math.inf]), "a": {"b": torch.tensor([math.nan])}}
    lines = famp.nonfinite_report(tree).summary().splitlines()
    assert lines[0] == "found_inf = 1: 2 of 2 leaves hold non-finite values"


def test_summary_refuses_a_limit_that_is_no_count() -> None:
    """limit=-1 printed "... and 2 more" for one leaf before."""
    report = famp.nonfinite_report({"a": torch.tensor([math.inf])})
    with pytest.raises(ValueError, match="limit must be an int >= 0, got -1"):
        report.summary(-1)
    with pytest.raises(TypeError, match=r"limit must be an int >= 0, got float 2\.0"):
        report.summary(2.0)  # type: ignore[arg-type]
    assert report.summary(0).splitlines() == [
        "found_inf = 1: 1 of 1 leaves hold non-finite values",
        "  ... and 1 more",
    ]


def test_summary_names_named_tuple_fields_by_name() -> None:
    # A namedtuple's leaves were named by position (`moments.1`); so were a structseq's, such as
    # torch.aminmax's result. Keys and list indices print as before.
    moments = collections.namedtuple("Moments", ["mean", "var"])
    tree = {
        "moments": moments(torch.ones(2), torch.tensor([math.inf])),
        "range": torch.aminmax(torch.tensor([1.0, math.nan])),
        "list": [torch.ones(1), torch.tensor([math.nan])],
    }
    report = famp.nonfinite_report(tree)
    assert report.paths == (
        "list.0",
        "list.1",
        "moments.mean",
        "moments.var",
        "range.min",
        "range.max",
    )
    lines = report.summary().splitlines()
    assert "  moments.var: 1 non-finite (float32), largest finite |x| 0" in lines


def test_summary_of_a_finite_tree_says_so() -> None:
    text = famp.nonfinite_report({"w": torch.ones(2)}).summary()
    assert text == "found_inf = 0: 0 of 1 leaves hold non-finite values"


@pytest.mark.parametrize(
    ("leaf", "match"),
    [
        (torch.ones(2, dtype=torch.int64), r"leaf at 'x\.1' must be a float16/.*got torch\.int64"),
        (3.0, r"leaf at 'x\.1' must be a float16/.*got float"),
        (torch.ones(2).to_sparse(), r"leaf at 'x\.1' has layout torch\.sparse_coo"),
    ],
)
def test_bad_leaves_raise_a_type_error_naming_the_path(leaf: Any, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        famp.nonfinite_report({"x": [torch.ones(1), leaf]})


def test_group_must_be_a_process_group() -> None:
    with pytest.raises(TypeError, match=r"group must be a torch\.distributed\.ProcessGroup"):
        famp.nonfinite_report([torch.ones(1)], group="world")


# --- gloo ranks: bad values on one rank only -----------------------------------------------------

CASES = [0, 1, 2]  # 0, 1: non-finite values on rank (case % world size) only; 2: all finite


def _launch(world_size: int) -> list[tuple[Any, ...]]:
    from tests.scaling.report_worker import worker

    count = (world_size + 2) * len(CASES) + world_size
    return spawn_ranks(
        worker, world_size, lambda r, port, q: (r, world_size, port, CASES, q), count, 120
    )


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_every_rank_receives_every_ranks_figures_over_2_and_3_gloo_ranks() -> None:
    # One launch of 3 ranks: every case over all 3, and over the group of ranks 0 and 1.
    world_size = 3
    rows = _launch(world_size)
    dtensor_rows = [row for row in rows if row[0] == "dtensor"]
    rows = [row for row in rows if row[0] != "dtensor"]
    assert sorted((row[0], row[1]) for row in rows) == sorted(
        (size, r) for size in (2, 3) for r in range(size) for _ in CASES
    )
    for size, rank, case, bad_rank, counts, amax, found, unscale_found, local, text in rows:
        found_dtype, found_value = found
        trees = [case_tree(case, r, bad_rank) for r in range(size)]
        for key in trees[0]:
            expected = [naive(t[key]) for t in trees]
            assert counts[key] == (torch.int64, (size,), [e[0] for e in expected])
            assert amax[key] == (torch.float32, (size,), [e[1].item() for e in expected])
        assert found_dtype == torch.float32
        assert found_value == unscale_found == float(bad_rank >= 0)
        assert local == float(rank == bad_rank)  # without group=, a rank sees its own leaves
        if bad_rank >= 0:
            bad_key = "head.weight" if case == 0 else "head.bias"
            assert f"  {bad_key} (rank {bad_rank}): " in text
            assert text.count("non-finite (") == 1  # only the bad rank's leaf is named
        else:
            assert text.startswith("found_inf = 0: 0 of ")
    assert len(dtensor_rows) == world_size
    for _, rank, count, amax, local_found, unscale_found, gathered, gathered_amax in dtensor_rows:
        last = rank == world_size - 1
        assert count == int(last)  # each rank reports its own shard
        assert amax == 10 * rank + 2.0
        assert local_found == unscale_found == 1.0  # max-reduced over the mesh, as unscale
        assert gathered == [0] * (world_size - 1) + [1]
        assert gathered_amax == [10 * r + 2.0 for r in range(world_size)]


def test_debugging_page_activation_report_names_the_overflowing_layer() -> None:
    """docs/debugging.md's run: a float16 layer with huge weights, found by its activations."""
    from torch.func import functional_call

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64),
        torch.nn.GELU(),
        torch.nn.LayerNorm(64),
        torch.nn.Linear(64, 64),
        torch.nn.GELU(),
        torch.nn.Linear(64, 4),
    )
    with torch.no_grad():
        model[3].weight.mul_(50000.0)
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
    policy = famp.get_policy("params=float32,compute=float16,output=float32")
    forward = famp.autocast(lambda p, x: functional_call(model, p, (x,)), policy)
    step = famp.value_and_grad(lambda p: torch.nn.functional.cross_entropy(forward(p, x), y))
    _, grads, found_inf, _ = step(famp.init_scaler(2.0**16), params)
    report = famp.nonfinite_report(grads)
    assert_bitwise_equal(report.found_inf, found_inf)
    assert all(c.item() > 0 for c in report.counts.values())
    acts: dict[str, torch.Tensor] = {}
    hooks = [
        m.register_forward_hook(lambda m, i, o, name=name: acts.__setitem__(name, o.detach()))
        for name, m in model.named_children()
    ]
    forward(params, x)
    for h in hooks:
        h.remove()
    activations = famp.nonfinite_report(acts)
    bad = [name for name, c in activations.counts.items() if c.item()]
    assert bad == ["3", "4", "5"]  # in forward order: layer 3 is where it starts
    assert all(acts[name].dtype == torch.float16 for name in acts)
    text = activations.summary()
    assert "  3: none, it overflowed (float16" in text


@pytest.mark.parametrize(
    "tree",
    [{}, {"w": None}, {"sub": {}, "w": torch.tensor([1.0, math.inf])}, {"s": [], "b": {"c": None}}],
    ids=["empty", "none", "empty_sub", "nested"],
)
def test_compiled_report_of_a_tree_with_leafless_dicts(tree: Any) -> None:
    # Dynamo cannot flatten a dict without leaves with optree (DictMetaData): the compiled
    # report raised Unsupported on {} and {"w": None}, where eagerly it works.
    eager = famp.nonfinite_report(tree)
    out = torch.compile(famp.nonfinite_report, fullgraph=True, backend="eager")(tree)
    assert optree.tree_structure(out.counts) == optree.tree_structure(eager.counts)
    assert (out.paths, out.dtypes) == (eager.paths, eager.dtypes)
    for a, e in zip(
        optree.tree_leaves((out.counts, out.amax)),
        optree.tree_leaves((eager.counts, eager.amax)),
        strict=True,
    ):
        assert_bitwise_equal(a, e)
    assert_bitwise_equal(out.found_inf, famp.unscale_and_check(famp.init_scaler(), tree)[1])


def test_summary_of_a_float64_leaf_beyond_float32s_range_says_so() -> None:
    # amax is float32 (documented): 1e300 rounds to inf, and the summary said "largest finite
    # |x| inf" of a leaf whose largest |x| is finite.
    tree = {"w": torch.tensor([1e300, math.nan], dtype=torch.float64)}
    report = famp.nonfinite_report(tree)
    assert report.amax["w"].item() == math.inf
    assert report.amax["w"].dtype == torch.float32
    assert torch.isfinite(tree["w"][0])  # the largest finite |x| is 1e300
    line = report.summary().splitlines()[1]
    assert line == "  w: 1 non-finite (float64), largest finite |x| beyond float32's range"


# --- gloo ranks whose None leaves differ (FSDP1 use_orig_params=True), or whose trees differ -----


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_none_leaves_in_different_places_on_each_rank_keep_their_figures_by_path() -> None:
    # Before 2026-12-01 famp gathered each rank's non-None leaves by position: rank 1's "b" was
    # filed under "a", and trees with different numbers of tensors aborted gloo.
    from tests.scaling.report_none_worker import worker

    reported = spawn_ranks(worker, 2, lambda r, port, q: (r, 2, port, q), 12, 150)
    rows = {(row[0], row[1]): row[2:] for row in reported}
    absent = (-1, math.nan)
    for name in ("moved", "fsdp1", "moved compiled", "moved float64-default"):
        local = [rows[(name.split()[0], r)][1] for r in range(2)]  # each rank's own figures
        assert any(v is None for v in local[0].values())  # some leaf is None on rank 0 only
        for rank in range(2):
            got, _, dtypes, paths, text, found, unscale_found = rows[(name, rank)]
            assert sorted(paths) == sorted(local[0])  # optree lists dict keys sorted
            for key, figure in got.items():
                count_dtype, counts, amax_dtype, amaxes = figure
                assert (count_dtype, amax_dtype) == (torch.int64, torch.float32)
                for r in range(2):
                    mine = local[r][key]
                    expected = absent if mine is None else (mine[1], mine[3])
                    assert counts[r] == expected[0], (name, key, r)
                    assert repr(amaxes[r]) == repr(expected[1]), (name, key, r)  # NaN: by repr
            assert found == unscale_found == 1.0
            if name != "moved compiled":  # eagerly, every rank prints the same summary
                assert text == rows[(name, 0)][4]
            if name == "fsdp1":  # run after the errors below: the group still works
                assert dtypes == ("float32",) * 4
                assert "  _fsdp_wrapped_module.2.weight (rank 1): 1 non-finite (float32)" in text
                assert text.count("non-finite (") == 1
            elif name in ("moved", "moved float64-default"):
                assert dtypes == ("float16", "bfloat16", "none", "float32")
                assert text == (
                    "found_inf = 1: 2 of 4 leaves (leaf, rank) hold non-finite values\n"
                    "  b (rank 1): 1 non-finite (bfloat16), largest finite |x| 3\n"
                    "  h (rank 1): 1 non-finite (float32), largest finite |x| 4\n"
                    "headroom of float16/bfloat16 leaves, lowest first:\n"
                    "  b (rank 1): none, it overflowed (bfloat16, largest finite |x| 3)\n"
                    "  a (rank 0): 15.0 bits (float16, largest finite |x| 2)"
                )
            else:  # compiled, a rank cannot read the dtypes of the leaves it lacks
                mine = rows[("moved", rank)]
                assert dtypes == tuple(
                    d if local[rank][k] else "unknown" for k, d in zip(paths, mine[2], strict=True)
                )
                assert repr(got) == repr(mine[0])  # NaN for absent entries: by repr
    for name, only in (("extra", "only on rank 1: 'c'"), ("renamed", "only on rank 0: 'b'")):
        messages = {rows[(name, r)][1] for r in range(2)}
        assert all(rows[(name, r)][0] == "ValueError" for r in range(2))
        assert len(messages) == 1  # every rank raises the same error
        (message,) = messages
        assert "the ranks' trees differ" in message
        assert only in message
    assert "rank 0 has 2 leaves, rank 1 has 3" in rows[("extra", 0)][1]
    assert "only on rank 1: 'z'" in rows[("renamed", 0)][1]
