"""ScalerState as a pytree: every field survives optree, torch's pytree, vmap and torch.compile."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
import torch.utils._pytree as torch_pytree

import famp
from tests.helpers import assert_bitwise_equal

Transform = Callable[[Callable[..., Any]], Callable[..., Any]]

STATES = {
    "default": lambda: famp.init_scaler(),
    "custom": lambda: famp.init_scaler(3.0, 1.37, 0.77, 5),
    "guards": lambda: famp.init_scaler(8.0, min_scale=0.25, max_scale=2.0**20, hysteresis=3),
    "static": lambda: famp.init_scaler(128.0, dynamic=False),
    "disabled": lambda: famp.init_scaler(enabled=False),
}
FIELDS = [f.name for f in dataclasses.fields(famp.ScalerState)]


def nontrivial(state: famp.ScalerState) -> famp.ScalerState:
    """Give every leaf a value no default has, so that a dropped field cannot go unnoticed."""
    count = state.overflow_count
    return dataclasses.replace(
        state,
        scale=torch.tensor(0.15625),
        growth_tracker=torch.tensor(3, dtype=torch.int32),
        overflow_count=None if count is None else torch.tensor(2, dtype=torch.int32),
    )


def assert_same_state(actual: famp.ScalerState, expected: famp.ScalerState) -> None:
    assert type(actual) is famp.ScalerState
    for name in FIELDS:
        a, e = getattr(actual, name), getattr(expected, name)
        if isinstance(e, torch.Tensor):
            assert_bitwise_equal(a, e)
        else:
            assert a == e, (name, a, e)
            assert type(a) is type(e), (name, a, e)


@pytest.fixture(params=list(STATES))
def state(request: pytest.FixtureRequest) -> famp.ScalerState:
    return nontrivial(STATES[request.param]())


def test_default_state_has_exactly_two_leaves() -> None:
    leaves = optree.tree_leaves(famp.init_scaler())
    assert [(x.dtype, x.shape) for x in leaves] == [(torch.float32, ()), (torch.int32, ())]
    assert len(torch_pytree.tree_leaves(famp.init_scaler())) == 2
    assert len(optree.tree_leaves(famp.init_scaler(hysteresis=2))) == 3


def test_optree_sees_the_leaves_with_and_without_a_namespace() -> None:
    """Plain optree calls (no namespace) and namespaced ones (torch's, a user's) see the leaves."""
    state = famp.init_scaler()
    for kwargs in ({}, {"namespace": "torch"}, {"namespace": "some-user-namespace"}):
        leaves = optree.tree_leaves({"s": state}, **kwargs)
        assert len(leaves) == 2
        assert all(isinstance(leaf, torch.Tensor) for leaf in leaves)


def test_every_field_survives_optree(state: famp.ScalerState) -> None:
    leaves, spec = optree.tree_flatten(state)
    assert all(isinstance(x, torch.Tensor) for x in leaves)
    assert_same_state(optree.tree_unflatten(spec, leaves), state)
    assert_same_state(optree.tree_map(lambda x: x.clone(), state), state)
    paths = optree.tree_paths(state)
    assert [p[0] for p in paths] == [
        n for n in ("scale", "growth_tracker", "overflow_count") if getattr(state, n) is not None
    ]
    doubled = optree.tree_map(lambda x: x * 2, state)
    assert_bitwise_equal(doubled.scale, state.scale * 2)
    assert doubled.growth_interval == state.growth_interval


def test_every_field_survives_torch_pytree(state: famp.ScalerState) -> None:
    leaves, spec = torch_pytree.tree_flatten(state)
    assert_same_state(torch_pytree.tree_unflatten(leaves, spec), state)
    assert_same_state(torch_pytree.tree_map(lambda x: x.clone(), state), state)
    loaded = torch_pytree.treespec_loads(torch_pytree.treespec_dumps(spec))
    assert loaded == spec
    assert_same_state(torch_pytree.tree_unflatten(leaves, loaded), state)
    keyed, _ = torch_pytree.tree_flatten_with_path(state)
    assert [torch_pytree.keystr(k) for k, _ in keyed][:2] == [".scale", ".growth_tracker"]


def test_every_field_survives_vmap(state: famp.ScalerState) -> None:
    batched = optree.tree_map(lambda x: torch.stack([x, x + 1]), state)
    out = torch.func.vmap(lambda s: s)(batched)
    assert_same_state(out, batched)
    found = torch.tensor([0.0, 1.0])
    updated = torch.func.vmap(famp.update_scale)(batched, found)
    for i in range(2):
        one = optree.tree_map(lambda x, i=i: x[i], batched)
        expected = famp.update_scale(one, found[i])
        assert_same_state(optree.tree_map(lambda x, i=i: x[i], updated), expected)


def _identity_through_pytrees(state: famp.ScalerState) -> famp.ScalerState:
    leaves, spec = optree.tree_flatten(state)
    state = optree.tree_unflatten(spec, [x + 0 for x in leaves])
    leaves, tspec = torch_pytree.tree_flatten(state)
    return torch_pytree.tree_unflatten([x * 1 for x in leaves], tspec)  # type: ignore[no-any-return]


def _update(state: famp.ScalerState, found_inf: torch.Tensor) -> famp.ScalerState:
    return famp.update_scale(state, found_inf)


def test_every_field_survives_compile(transform: Transform) -> None:
    for make in STATES.values():
        state = nontrivial(make())
        assert_same_state(transform(_identity_through_pytrees)(state), state)


@pytest.mark.parametrize("found", [0.0, 1.0])
def test_update_keeps_structure_dtype_shape_device(
    transform: Transform, state: famp.ScalerState, found: float
) -> None:
    new = transform(_update)(state, torch.tensor(found))
    assert optree.tree_structure(new) == optree.tree_structure(state)
    for a, b in zip(
        optree.tree_leaves(new),
        optree.tree_leaves(state),
        strict=True,
    ):
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device)
    for name in FIELDS:
        if not isinstance(getattr(state, name), torch.Tensor | None):
            assert getattr(new, name) == getattr(state, name)
    assert_bitwise_equal(new.scale, famp.update_scale(state, torch.tensor(found)).scale)


def test_state_is_immutable() -> None:
    state = famp.init_scaler()
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.scale = torch.tensor(1.0)  # type: ignore[misc]


def test_grad_flows_through_scale() -> None:
    state = famp.init_scaler(8.0)
    p = torch.tensor([1.0, -2.0, 3.0])
    g = torch.func.grad(lambda p: famp.scale(state, (p**2).sum()))(p)
    assert g.dtype == torch.float32
    assert_bitwise_equal(g, 2 * p * state.scale)


def _init_inside(x: torch.Tensor) -> tuple[torch.Tensor, famp.ScalerState]:
    state = famp.init_scaler(8.0, 1.5, growth_interval=3, hysteresis=2, max_scale=64.0)
    return famp.scale(state, x), state


def test_init_scaler_inside_a_compiled_function(transform: Transform) -> None:
    scaled, state = transform(_init_inside)(torch.ones(2))
    assert_bitwise_equal(scaled, torch.full((2,), 8.0))
    assert_same_state(
        state, famp.init_scaler(8.0, 1.5, growth_interval=3, hysteresis=2, max_scale=64.0)
    )
