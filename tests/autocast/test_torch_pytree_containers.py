"""Why autocast and the policy casts walk trees with torch's pytree, not optree.

famp walks trees with optree everywhere else; a model's inputs and outputs are the exception.
Users register their containers with torch's pytree (`torch.utils._pytree.register_pytree_node`),
which torch's own functions walk (`torch.utils._pytree.tree_map`, `torch.compile`'s inputs,
`torch.func`). optree sees such a container as a leaf, so a cast or device inference through
optree would pass its tensors by.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optree
import pytest
import torch

import famp
from famp._compat import torch_pytree
from tests.helpers import assert_bitwise_equal

BF16 = torch.bfloat16


@dataclasses.dataclass
class Pair:
    """A user's container, registered with torch's pytree only."""

    first: Any
    second: Any


torch_pytree.register_pytree_node(
    Pair,
    lambda p: ([p.first, p.second], None),
    lambda children, _: Pair(*children),
)


@dataclasses.dataclass
class Unregistered:
    first: Any
    second: Any


def _pair() -> Pair:
    g = torch.Generator().manual_seed(0)
    return Pair(torch.randn(3, 4, generator=g), torch.randn(4, 5, generator=g))


def test_a_container_registered_with_torchs_pytree_only_is_a_leaf_to_optree() -> None:
    pair = _pair()
    assert optree.tree_leaves(pair) == [pair]
    leaves = torch_pytree.tree_leaves(pair)
    assert len(leaves) == 2
    assert leaves[0] is pair.first
    assert leaves[1] is pair.second


@pytest.mark.parametrize(
    ("cast", "policy", "dtype"),
    [
        (famp.cast_to_compute, "c=bf16", BF16),
        (famp.cast_to_output, "c=bf16,o=f16", torch.float16),
        (famp.cast_to_param, "p=bf16", BF16),
    ],
)
def test_policy_casts_reach_the_tensors_in_a_torch_pytree_container_as_torch_tree_map_does(
    cast: Any, policy: str, dtype: torch.dtype
) -> None:
    pair = Pair(_pair().first, torch.ones(2, dtype=torch.float64))
    out = cast(policy, pair)
    expected = torch_pytree.tree_map(lambda t: t.to(dtype) if t.dtype != torch.float64 else t, pair)
    assert isinstance(out, Pair)
    assert out.first.dtype == dtype
    assert out.second.dtype == torch.float64  # float64 is never cast
    assert_bitwise_equal(out.first, expected.first)
    assert out.second is pair.second


def test_autocast_infers_the_device_from_tensors_in_a_torch_pytree_container() -> None:
    def f(p: Any) -> torch.Tensor:
        return p.first @ p.second

    pair = _pair()
    out = famp.autocast(f, "c=bf16")(pair)  # device_type=None: found inside the container
    with torch.autocast("cpu", dtype=BF16):
        expected = f(pair)
    assert out.dtype == expected.dtype == BF16
    assert_bitwise_equal(out, expected)
    # The same container unregistered is a leaf: no tensor is found among the arguments.
    with pytest.raises(ValueError, match="needs a tensor not on meta among the args"):
        famp.autocast(f, "c=bf16")(Unregistered(pair.first, pair.second))


def test_a_module_rule_casts_the_tensors_in_a_torch_pytree_container_input() -> None:
    seen: list[torch.dtype] = []

    class Inner(torch.nn.Module):
        def forward(self, p: Pair) -> torch.Tensor:
            seen.extend((p.first.dtype, p.second.dtype))
            return p.first @ p.second

    class Outer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Inner()

        def forward(self, p: Pair) -> torch.Tensor:
            return self.inner(p)

    pair = _pair()
    out = famp.autocast(Outer(), "c=f32", module_rules={"inner": "c=bf16"})(pair)
    assert seen == [BF16, BF16]  # the module's positional input, cast inside the container
    assert out.dtype == torch.float32  # the outer policy's output dtype
    assert_bitwise_equal(out, (pair.first.to(BF16) @ pair.second.to(BF16)).float())
