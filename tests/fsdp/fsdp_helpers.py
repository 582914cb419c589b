"""Helpers shared by the FSDP optimizer-state tests."""

from __future__ import annotations

import pathlib
import re
from typing import Any

import hypothesis.strategies as st
import torch

import famp
from tests.helpers import assert_bitwise_equal


def assert_same_osd(actual: Any, expected: Any, where: str = "osd") -> None:
    """Same keys and structure, equal non-tensor values, tensors bit for bit (dtype, shape too)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert_bitwise_equal(actual, expected)
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), where
        assert set(actual) == set(expected), (
            where,
            sorted(map(str, actual)),
            sorted(map(str, expected)),
        )
        for key in expected:
            assert_same_osd(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected), (where, type(actual), type(expected))
        assert len(actual) == len(expected), (where, len(actual), len(expected))
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same_osd(a, e, f"{where}[{i}]")
    else:
        assert type(actual) is type(expected), (where, actual, expected)
        nans = isinstance(expected, float) and expected != expected and actual != actual
        assert nans or actual == expected, (where, actual, expected)


def assert_same_tree(actual: Any, expected: Any, where: str = "") -> None:
    """Same nested structure and key order, same types, tensors of the same dtype bit for bit."""
    assert type(actual) is type(expected), where
    if isinstance(expected, dict):
        assert list(actual) == list(expected), where
        for key, value in expected.items():
            assert_same_tree(actual[key], value, f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same_tree(a, e, f"{where}.{i}")
    elif isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, where
        assert_bitwise_equal(actual, expected)
    else:
        assert actual == expected, where


def assert_osd_bitwise_equal(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    """Same FQNs in the same order, same state names, tensors bit for bit, equal param_groups."""
    assert list(actual["state"]) == list(expected["state"])
    for fqn, entry in expected["state"].items():
        assert sorted(actual["state"][fqn]) == sorted(entry), fqn
        for name, value in entry.items():
            assert_bitwise_equal(actual["state"][fqn][name], value)
    assert actual["param_groups"] == expected["param_groups"]


def load_dict(path: pathlib.Path | str) -> dict[str, Any]:
    """`torch.load(path, weights_only=True)`, which must be a dict."""
    obj = torch.load(path, weights_only=True)
    assert isinstance(obj, dict)
    return obj


def two_group_osd() -> dict[str, Any]:
    """A full state dict: `w` (4, 3) and `b` (4,) with random `exp_avg`, in two param groups."""
    return {
        "state": {
            "w": {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3)},
            "b": {"step": torch.tensor(3.0), "exp_avg": torch.randn(4)},
        },
        "param_groups": [{"lr": 0.1, "params": ["w"]}, {"lr": 0.2, "params": ["b"]}],
    }


DTYPES = [torch.float32, torch.bfloat16, torch.float64]


@st.composite
def shapes(draw: st.DrawFn) -> dict[str, tuple[int, ...]]:
    n = draw(st.integers(1, 4))
    dims = st.lists(st.integers(1, 7), min_size=1, max_size=3).map(tuple)
    return {f"layer{i}.{kind}": draw(dims) for i in range(n) for kind in ("weight", "bias")}


@st.composite
def layouts(draw: st.DrawFn, params: dict[str, tuple[int, ...]]) -> Any:
    world = draw(st.integers(1, 8))
    if draw(st.booleans()):
        dims = {}
        for fqn, shape in params.items():
            even = [d for d in range(1, len(shape)) if shape[d] % world == 0]
            if even and draw(st.booleans()):
                dims[fqn] = draw(st.sampled_from(even))
        return famp.fsdp2_layout(params, world, shard_dims=dims)
    names = list(params)
    cuts = (
        sorted(draw(st.sets(st.integers(1, len(names) - 1), max_size=3))) if len(names) > 1 else []
    )
    units = [
        {n: params[n] for n in names[a:b]}
        for a, b in zip([0, *cuts], [*cuts, len(names)], strict=True)
    ]
    return famp.fsdp1_layout(
        units,
        world,
        use_orig_params=draw(st.booleans()),
        param_dtype=draw(st.sampled_from(DTYPES)),
    )


@st.composite
def full_states(draw: st.DrawFn, params: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """An Adam-like full state; some parameters without state, two param groups."""
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    dtype = draw(st.sampled_from(DTYPES))
    state = {
        fqn: {
            "step": torch.tensor(float(draw(st.integers(1, 9)))),
            "exp_avg": torch.randn(shape, generator=gen).to(dtype),
            "exp_avg_sq": torch.rand(shape, generator=gen).to(dtype),
            "count": 7,  # a non-tensor entry (not a str: Optimizer.load_state_dict mangles those)
        }
        for fqn, shape in params.items()
        if draw(st.booleans())
    }
    names = list(params)
    groups = [
        {"lr": 0.1, "betas": (0.9, 0.99), "params": names[::2]},
        {"lr": 0.01, "betas": (0.8, 0.9), "params": names[1::2]},
    ]
    return {"state": state, "param_groups": groups}


def docs_block(page: str, defines: str) -> str:
    """The one ``python`` block of ``docs/<page>`` that contains ``defines``, as written there."""
    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / page).read_text()
    found = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL) if defines in b]
    assert len(found) == 1, (page, defines, len(found))
    return found[0]
