"""Rekeying between optimizer.state_dict() ids and FQNs, against DCP's get/set_optimizer_state_dict.

FSDP2 models are covered in test_fsdp_real.py; here plain models with several param groups,
parameters without state, a shared (tied) parameter and torch.compile's wrapper.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

import famp
from tests.fsdp.fsdp_helpers import assert_same_osd


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(4, 3)
        self.frozen = nn.Linear(2, 2)  # in the optimizer, never gets a gradient: no state
        self.c = nn.Linear(4, 3)
        self.c.weight = self.b.weight  # shared: named "b.weight" first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        return self.b(h) + self.c(h)


def make(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Tied()
    optim = torch.optim.AdamW(
        [
            {"params": [model.b.weight, model.a.weight], "weight_decay": 0.1},
            {"params": [model.a.bias, model.frozen.weight, model.b.bias], "lr": 5e-3},
            {"params": [model.c.bias], "lr": 1.0, "betas": (0.5, 0.6)},
        ],
        lr=1e-2,
    )
    return model, optim


def step(model: nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    model(
        torch.randn(2, 3, generator=torch.Generator().manual_seed(seed))
    ).square().sum().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


@pytest.fixture
def trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    model, optim = make()
    step(model, optim, 1)
    step(model, optim, 2)
    return model, optim


def test_by_fqn_equals_get_optimizer_state_dict(trained: Any) -> None:
    model, optim = trained
    by_fqn = famp.optim_state_by_fqn(optim.state_dict(), model, optim)
    assert_same_osd(by_fqn, get_optimizer_state_dict(model, optim))
    assert "frozen.weight" not in by_fqn["state"]  # no gradient, no state
    assert by_fqn["param_groups"][1]["params"] == ["a.bias", "frozen.weight", "b.bias"]
    assert [g["lr"] for g in by_fqn["param_groups"]] == [1e-2, 5e-3, 1.0]


# torch.compile's first use imports torch.jit code that warns about its own deprecation
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_by_fqn_strips_the_compile_wrapper(trained: Any) -> None:
    model, optim = trained
    compiled = torch.compile(model)  # parameters are named "_orig_mod.a.weight", ...
    assert_same_osd(
        famp.optim_state_by_fqn(optim.state_dict(), compiled, optim),
        get_optimizer_state_dict(compiled, optim),
    )


def test_by_id_inverts_by_fqn_and_equals_set_optimizer_state_dict(trained: Any) -> None:
    model, optim = trained
    by_fqn = famp.optim_state_by_fqn(optim.state_dict(), model, optim)
    assert_same_osd(famp.optim_state_by_id(by_fqn, model, optim), optim.state_dict())
    fresh_model, fresh_optim = make(seed=1)
    fresh_model.load_state_dict(model.state_dict())
    fresh_optim.load_state_dict(
        famp.optim_state_by_id(copy.deepcopy(by_fqn), fresh_model, fresh_optim)
    )
    dcp_model, dcp_optim = make(seed=1)
    dcp_model.load_state_dict(model.state_dict())
    # strict=False: "frozen.weight" is in the optimizer but has no state
    options = StateDictOptions(strict=False)
    set_optimizer_state_dict(dcp_model, dcp_optim, copy.deepcopy(by_fqn), options=options)
    assert_same_osd(fresh_optim.state_dict(), dcp_optim.state_dict())
    assert_same_osd(fresh_optim.state_dict(), optim.state_dict())
    for m, o in ((model, optim), (fresh_model, fresh_optim)):
        step(m, o, 3)
    for (name, p), q in zip(model.named_parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_by_id_matches_by_identity_not_order_and_accepts_any_name_of_a_shared_parameter(
    trained: Any,
) -> None:
    model, optim = trained
    by_fqn = famp.optim_state_by_fqn(optim.state_dict(), model, optim)
    shuffled = copy.deepcopy(by_fqn)
    shuffled["param_groups"][0]["params"] = ["a.weight", "c.weight"]  # reordered; tied alias
    shuffled["state"]["c.weight"] = shuffled["state"].pop("b.weight")
    shuffled["state"] = dict(reversed(shuffled["state"].items()))
    assert_same_osd(famp.optim_state_by_id(shuffled, model, optim), optim.state_dict())


def test_by_fqn_keeps_int_keys_nested_and_values_untouched(trained: Any) -> None:
    model, optim = trained
    osd = optim.state_dict()
    by_fqn = famp.optim_state_by_fqn(osd, model, optim)
    assert by_fqn["state"]["a.weight"]["exp_avg"] is osd["state"][1]["exp_avg"]
    assert by_fqn["state"]["a.weight"] is not osd["state"][1]  # new dicts, same values


def _without(d: dict[str, Any], key: Any) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k != key}


BY_FQN_BAD = [
    (
        "group count",
        lambda o: {**o, "param_groups": o["param_groups"][:2]},
        ValueError,
        "2 groups but the optimizer has 3",
    ),
    (
        "group size",
        lambda o: {
            **o,
            "param_groups": [
                o["param_groups"][0],
                {**o["param_groups"][1], "params": [2, 3]},
                o["param_groups"][2],
            ],
        },
        ValueError,
        r"\['param_groups'\]\[1\] has 2 parameters",
    ),
    ("id in no group", lambda o: {**o, "state": {**o["state"], 9: {}}}, KeyError, "id 9"),
    ("no state", lambda o: _without(o, "state"), KeyError, "'state'"),
]


@pytest.mark.parametrize(
    ("mutate", "error", "match"), [c[1:] for c in BY_FQN_BAD], ids=[c[0] for c in BY_FQN_BAD]
)
def test_by_fqn_rejects_bad_input(
    trained: Any, mutate: Any, error: type[Exception], match: str
) -> None:
    model, optim = trained
    with pytest.raises(error, match=match):
        famp.optim_state_by_fqn(mutate(optim.state_dict()), model, optim)


def test_by_fqn_rejects_an_optimizer_parameter_outside_the_model(trained: Any) -> None:
    model, optim = trained
    optim.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    with pytest.raises(ValueError, match=r"parameter 6 \(group 3\) is not in model"):
        famp.optim_state_by_fqn(optim.state_dict(), model, optim)


def _groups(o: dict[str, Any], i: int, params: list[str]) -> dict[str, Any]:
    groups = copy.deepcopy(o["param_groups"])
    groups[i]["params"] = params
    return {**o, "param_groups": groups}


BY_ID_BAD = [
    ("unknown name", lambda o: _groups(o, 2, ["c.bias", "z.weight"]), KeyError, "'z.weight'"),
    (
        "parameter in another group",
        lambda o: _groups(o, 2, ["a.bias"]),
        ValueError,
        "'a.bias', but the optimizer has it in group 1",
    ),
    (
        "parameter missing from its group",
        lambda o: _groups(o, 1, ["a.bias", "b.bias"]),
        ValueError,
        r"\['param_groups'\]\[1\] has 2 parameters but the optimizer's group 1 has 3",
    ),
    ("empty group", lambda o: _groups(o, 2, []), ValueError, "optimizer.s group 2 has 1"),
    (
        "group count",
        lambda o: {**o, "param_groups": o["param_groups"][:1]},
        ValueError,
        "1 groups but the optimizer has 3",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "error", "match"), [c[1:] for c in BY_ID_BAD], ids=[c[0] for c in BY_ID_BAD]
)
def test_by_id_rejects_bad_input(
    trained: Any, mutate: Any, error: type[Exception], match: str
) -> None:
    model, optim = trained
    by_fqn = famp.optim_state_by_fqn(optim.state_dict(), model, optim)
    with pytest.raises(error, match=match):
        famp.optim_state_by_id(mutate(by_fqn), model, optim)


def test_by_id_rejects_state_of_a_parameter_in_no_group() -> None:
    model = nn.Linear(2, 2)
    optim = torch.optim.SGD([model.weight], lr=0.1)
    osd = {
        "state": {"bias": {"momentum_buffer": torch.zeros(2)}},
        "param_groups": [{"lr": 0.1, "params": ["weight"]}],
    }
    with pytest.raises(ValueError, match="'bias', which is in no param group"):
        famp.optim_state_by_id(osd, model, optim)
    with pytest.raises(KeyError, match="'nope', which is in no param group"):
        famp.optim_state_by_id({**osd, "state": {"nope": {}}}, model, optim)
