"""famp.autocast composed with what users wrap around it or run inside it: the composition matrix.

Each cell compares famp bit for bit with its reference: with the default rules `torch.autocast`
on the same model in the same composition; with overrides or module rules, the same rules on the
plain eager run. docs/autocast.md's "Compatibility" table names the test of each cell.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import famp
from tests.helpers import assert_bitwise_equal

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


ALIAS_WRITES: dict[str, Callable[[nn.Linear], None]] = {
    "data": _write_data,
    "detach": _write_detach,
    "state_dict": _write_state_dict,
    "foreach_detached": _write_foreach,
    "view_made_under_no_grad": _write_view_no_grad,
    "data_assignment": _write_data_set,
    "ema_lerp": _write_swa,
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


@pytest.mark.parametrize("kind", ["track_casts", "override", "module_rule"])
@pytest.mark.parametrize("write", sorted(ALIAS_WRITES))
def test_cast_cache_sees_writes_through_aliases(write: str, kind: str) -> None:
    x = torch.randn(4, 8)
    lin, f = _write_between_uses(ALIAS_WRITES[write])
    state = copy.deepcopy(lin.state_dict())
    options: dict[str, Any] = {
        "track_casts": {"track_casts": True},
        "override": {"rules": famp.default_rules("cpu").override({"rms_norm": "lower"})},
        "module_rule": {"module_rules": {"": "c=bf16,o=bf16"}},  # the Linear is the root
    }[kind]
    first, second = famp.autocast(f, "c=bf16,o=bf16", **options)(x)
    lin.load_state_dict(state)
    with torch.autocast("cpu", dtype=BF16, cache_enabled=False):
        ref_first, ref_second = f(x)
    assert second.dtype == BF16
    assert ref_second.dtype == BF16
    assert_bitwise_equal(first, ref_first)
    assert_bitwise_equal(second, ref_second)
    assert not torch.equal(second, first)  # the write changed the weight: a stale cast would show


def test_the_reference_for_alias_writes_differs_from_torch_autocast_with_its_cache() -> None:
    # The cells above can fail: torch's own cache reads the stale cast after a write via `.data`.
    x = torch.randn(4, 8)
    _, f = _write_between_uses(_write_data)
    with torch.autocast("cpu", dtype=BF16):
        first, second = f(x)
    assert_bitwise_equal(first, second)
