"""Layouts against real FSDP1/FSDP2 wrapping for world sizes 1 to 8, in one process.

torch's "fake" process group lets this process act as rank r of W: sharding is local, so the
parameters FSDP builds are real, while collectives are no-ops (no values from them are used).
Also the pure layout rules: construction, equality, repr and bad input.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

import famp
from tests.fsdp.fsdp_helpers import assert_same_osd
from tests.helpers import assert_bitwise_equal

RANKS = [(w, r) for w in range(1, 9) for r in range(w)]


@contextlib.contextmanager
def fake_rank(world_size: int, rank: int) -> Iterator[None]:
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with warnings.catch_warnings():
            # FSDP1 warns that it switches to NO_SHARD on one rank, and that FSDP1 is deprecated
            warnings.simplefilter("ignore", UserWarning)
            warnings.simplefilter("ignore", FutureWarning)
            yield
    finally:
        dist.destroy_process_group()


def odd_model() -> nn.Module:
    """Rows 5, 1, 6 and 3: uneven chunks and empty trailing shards; a (3, 24) weight for dim 1."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 5),
        nn.Linear(5, 1),
        nn.Linear(1, 6, bias=False),
        nn.Linear(6, 3),
        nn.Linear(24, 3),
    )


def adam_like_state(params: dict[str, tuple[int, ...]], seed: int = 1) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    state = {
        fqn: {
            "step": torch.tensor(3.0),
            "exp_avg": torch.randn(shape, generator=gen),
            "exp_avg_sq": torch.rand(shape, generator=gen),
        }
        for fqn, shape in params.items()
    }
    return {"state": state, "param_groups": [{"lr": 0.1, "params": list(params)}]}


@pytest.mark.parametrize(("world_size", "rank"), RANKS)
def test_fsdp2_layout_equals_fully_shard(world_size: int, rank: int) -> None:
    model = odd_model()
    full_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    shapes = {n: tuple(p.shape) for n, p in full_params.items()}
    dim1 = 24 % world_size == 0  # FSDP2 shards a dim other than 0 only evenly
    dims = {"4.weight": 1} if dim1 else None
    with fake_rank(world_size, rank):
        placement = (lambda p: Shard(1) if p.shape == (3, 24) else None) if dim1 else None
        for layer in model:
            fully_shard(layer, shard_placement_fn=placement)
        fully_shard(model, shard_placement_fn=placement)
        layout = famp.fsdp2_layout(shapes, world_size, shard_dims=dims)
        assert famp.layout_of(model) == layout
        # the values FSDP2 keeps on this rank are famp's shard of the full values
        as_state = {"state": {n: {"v": p} for n, p in full_params.items()}, "param_groups": []}
        as_state["param_groups"] = [{"params": list(full_params)}]
        mine = famp.shard_optim_state(as_state, layout, rank)
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor)
            assert_bitwise_equal(mine["state"][name]["v"], param.to_local())
        # the to-load dict goes into a real optimizer over the DTensor parameters
        optim = torch.optim.Adam(model.parameters())
        full = adam_like_state(shapes)
        # from this rank's shard alone, as a per-rank checkpoint holds it
        shard = famp.shard_optim_state(full, layout, rank)
        optim.load_state_dict(
            famp.optim_state_dict_to_load(shard, layout, rank, optim, model=model)
        )
        loaded = optim.state_dict()
        for key, entry in loaded["state"].items():
            fqn = list(shapes)[key]
            for name, value in entry.items():
                expected = famp.shard_optim_state(full, layout, rank)["state"][fqn][name]
                local = value.to_local() if isinstance(value, DTensor) else value
                assert_bitwise_equal(local, expected)
            assert entry["exp_avg"].placements == model.get_parameter(fqn).placements


FSDP1_CONFIGS = [(False, None), (True, None), (True, torch.bfloat16)]


def _wrap_fsdp1(model: nn.Module, use_orig_params: bool, dtype: torch.dtype | None) -> nn.Module:
    kwargs: dict[str, Any] = {
        "device_id": torch.device("cpu"),
        "use_orig_params": use_orig_params,
        "mixed_precision": MixedPrecision(param_dtype=dtype) if dtype else None,
    }
    model[3] = FullyShardedDataParallel(model[3], **kwargs)
    return FullyShardedDataParallel(model, **kwargs)


@pytest.mark.parametrize(
    ("use_orig_params", "dtype"), FSDP1_CONFIGS, ids=["flat", "orig", "orig-bf16"]
)
@pytest.mark.parametrize(("world_size", "rank"), RANKS)
def test_fsdp1_layout_equals_fully_sharded_data_parallel(
    world_size: int, rank: int, use_orig_params: bool, dtype: torch.dtype | None
) -> None:
    model = odd_model()
    full_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    units = [
        {n: tuple(p.shape) for n, p in full_params.items() if not n.startswith("3.")},
        {n: tuple(p.shape) for n, p in full_params.items() if n.startswith("3.")},
    ]
    layout = famp.fsdp1_layout(
        units, world_size, use_orig_params=use_orig_params, param_dtype=dtype or torch.float32
    )
    with fake_rank(world_size, rank):
        wrapped = _wrap_fsdp1(model, use_orig_params, dtype)
        assert famp.layout_of(wrapped) == layout
        # the parameters FSDP1 keeps on this rank are famp's to-load slices of the full values
        as_state = {"state": {n: {"v": p} for n, p in full_params.items()}, "param_groups": []}
        as_state["param_groups"] = [{"params": list(full_params)}]
        optim = torch.optim.Adam(wrapped.parameters())
        if not use_orig_params:  # the optimizer sees one flat parameter per unit, root first
            by_unit = [list(unit) for unit in units]
            as_state["param_groups"] = [{"params": by_unit[0]}, {"params": by_unit[1]}]
            optim = torch.optim.Adam([{"params": [p]} for p in wrapped.parameters()])
        local = famp.optim_state_dict_to_load(as_state, layout, rank, optim, model=wrapped)["state"]
        for key, param in enumerate(p for g in optim.param_groups for p in g["params"]):
            if param.numel() == 0:  # use_orig_params=True: not in this rank's shard, no state
                assert key not in local
            else:
                assert_bitwise_equal(local[key]["v"], param.detach().reshape(param.shape))
        # and a real optimizer accepts the to-load dict of an Adam state
        full = adam_like_state({n: tuple(p.shape) for n, p in full_params.items()})
        full["param_groups"] = as_state["param_groups"]
        if not use_orig_params:
            full["param_groups"][1]["lr"] = 0.5
        to_load = famp.optim_state_dict_to_load(full, layout, rank, optim, model=wrapped)
        optim.load_state_dict(to_load)
        assert_same_osd(optim.state_dict()["state"], to_load["state"])
        assert [g["params"] for g in optim.state_dict()["param_groups"]] == [
            g["params"] for g in to_load["param_groups"]
        ]


def test_layouts_are_frozen_comparable_picklable_and_readable() -> None:
    a = famp.fsdp2_layout({"w": (5, 4), "b": (5,)}, 4)
    assert a == famp.fsdp2_layout({"w": [5, 4], "b": torch.Size([5])}, 4)
    assert a != famp.fsdp2_layout({"w": (5, 4), "b": (5,)}, 3)
    assert a != famp.fsdp2_layout({"b": (5,), "w": (5, 4)}, 4)  # order is part of the layout
    assert hash(a) == hash(famp.fsdp2_layout({"w": (5, 4), "b": (5,)}, 4))
    assert pickle.loads(pickle.dumps(a)) == a
    assert (a.world_size, a.fqns, a.shapes, a.shard_dims) == (4, ("w", "b"), ((5, 4), (5,)), (0, 0))
    assert repr(a) == "FSDP2Layout(world_size=4, params={'w': (5, 4), 'b': (5,)})"
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.world_size = 2  # type: ignore[misc]
    b = famp.fsdp1_layout([{"w": (5, 4)}, {"b": (5,)}], 2, use_orig_params=False)
    assert b.fqns == ("w", "b")
    assert b.shapes == ((5, 4), (5,))
    assert b.shard_dims == (0, 0)
    assert b == pickle.loads(pickle.dumps(b))
    assert b != famp.fsdp1_layout([{"w": (5, 4), "b": (5,)}], 2, use_orig_params=False)
    assert "use_orig_params=False" in repr(b)
    assert "units=[{'w': (5, 4)}, {'b': (5,)}]" in repr(b)
    many = famp.fsdp2_layout({f"p{i}": (2,) for i in range(20)}, 2)
    assert "... 14 more" in repr(many)


def test_fsdp1_alignment_counts_in_param_dtype() -> None:
    """Each parameter starts on a 16-byte boundary: every 4 fp32, 8 bf16 or 2 fp64 elements."""
    units = [{"a": (3,), "b": (5,), "c": (1,)}]
    flat = famp.fsdp1_layout(units, 1, use_orig_params=False)
    fp32 = famp.fsdp1_layout(units, 1, param_dtype=torch.float32)
    bf16 = famp.fsdp1_layout(units, 1, param_dtype=torch.bfloat16)
    fp64 = famp.fsdp1_layout(units, 1, param_dtype=torch.float64)
    # a at 0; b after padding to the boundary; c after the next boundary
    assert flat.flat_numel(0) == 3 + 5 + 1
    assert fp32.flat_numel(0) == 4 + 8 + 1
    assert bf16.flat_numel(0) == 8 + 8 + 1
    assert fp64.flat_numel(0) == 4 + 6 + 1
    # padded to a multiple of the world size, then split evenly
    assert famp.fsdp1_layout(units, 3, param_dtype=torch.bfloat16).flat_numel(0) == 6


BAD_LAYOUTS = [
    (lambda: famp.fsdp2_layout({"w": (4, 3)}, 0), ValueError, "world_size"),
    (lambda: famp.fsdp2_layout({"w": (4, 3)}, True), TypeError, "world_size"),
    (lambda: famp.fsdp2_layout({"w": (4, 3)}, 2.0), TypeError, "world_size must be an int"),  # type: ignore[arg-type]
    (lambda: famp.fsdp2_layout({"w": ()}, 2), ValueError, "'w'"),
    (lambda: famp.fsdp2_layout({"w": (4, 0)}, 2), ValueError, "'w'"),
    (lambda: famp.fsdp2_layout({"w": (4, -1)}, 2), ValueError, "'w'"),
    (lambda: famp.fsdp2_layout({"w": "4"}, 2), ValueError, "'w'"),
    (lambda: famp.fsdp2_layout({"": (4,)}, 2), ValueError, "names"),
    (lambda: famp.fsdp2_layout([("w", (4,))], 2), TypeError, "mapping"),  # type: ignore[arg-type]
    (lambda: famp.fsdp2_layout({"w": (4, 3)}, 2, shard_dims={"w": 1}), ValueError, "divisible"),
    (lambda: famp.fsdp2_layout({"w": (4, 3)}, 2, shard_dims={"w": 2}), ValueError, "'w'"),
    (lambda: famp.fsdp2_layout({"w": (4, 3)}, 2, shard_dims={"v": 0}), KeyError, "'v'"),
    (
        lambda: famp.fsdp2_layout({"w": (4, 4)}, 2, shard_dims=[("w", 1)]),  # type: ignore[arg-type]
        TypeError,
        r"shard_dims must be a dict \{fqn: dim\}, got \[\('w', 1\)\]",  # AttributeError before
    ),
    (lambda: famp.fsdp1_layout([{"w": (7,)}], 2).flat_numel(5), ValueError, r"unit .* got 5"),
    (lambda: famp.fsdp1_layout([{"w": (7,)}], 2).flat_numel(-1), ValueError, r"unit .* got -1"),
    (lambda: famp.fsdp1_layout([{"w": (7,)}], 2).flat_numel("0"), TypeError, "unit must be an int"),  # type: ignore[arg-type]
    (lambda: famp.fsdp1_layout({"w": (4,)}, 2), TypeError, "one per FSDP unit"),  # type: ignore[arg-type]
    (lambda: famp.fsdp1_layout([{"w": (4,)}, {"w": (4,)}], 2), ValueError, "'w' appears twice"),
    (lambda: famp.fsdp1_layout([{}], 2), ValueError, "unit 0 has no parameters"),
    (lambda: famp.fsdp1_layout([{"w": (4,)}], 2, param_dtype="bf16"), TypeError, "param_dtype"),  # type: ignore[arg-type]
    (
        lambda: famp.fsdp1_layout([{"w": (4,)}], 2, param_dtype=torch.int32),
        ValueError,
        "param_dtype must be a floating dtype .* got torch.int32",
    ),
    (lambda: famp.fsdp1_layout([{"w": (4,)}], 2, use_orig_params=1), TypeError, "use_orig_params"),  # type: ignore[arg-type]
    (lambda: famp.fsdp2_layout({"w": (4,)}, 2).local_shape("w", 2), ValueError, "rank"),
    (lambda: famp.fsdp2_layout({"w": (4,)}, 2).local_shape("w", 1.0), TypeError, "rank"),  # type: ignore[arg-type]
    (lambda: famp.fsdp2_layout({"w": (4,)}, 2).local_shape("v", 0), KeyError, "'v'"),
]


@pytest.mark.parametrize(("build", "error", "match"), BAD_LAYOUTS)
def test_bad_layouts_raise_naming_the_field(build: Any, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        build()


def test_negative_shard_dims_count_from_the_end() -> None:
    layout = famp.fsdp2_layout({"w": (3, 4)}, 2, shard_dims={"w": -1})
    assert layout.shard_dims == (1,)
    assert [layout.local_shape("w", r) for r in range(2)] == [(3, 2), (3, 2)]


def test_layout_of_refuses_a_non_module() -> None:
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module, got NoneType"):
        famp.layout_of(None)  # type: ignore[arg-type]


def test_layout_of_rejects_unwrapped_models() -> None:
    with pytest.raises(ValueError, match="no FSDP1 or FSDP2"):
        famp.layout_of(nn.Linear(2, 2))


def test_layout_of_rejects_partly_sharded_and_mixed_models() -> None:
    with fake_rank(2, 0):
        model = odd_model()
        fully_shard(model[0])  # the other layers keep plain parameters
        with pytest.raises(ValueError, match=r"'1\.weight' is not sharded by fully_shard"):
            famp.layout_of(model)
        model[1] = FullyShardedDataParallel(model[1], device_id=torch.device("cpu"))
        with pytest.raises(ValueError, match="mixes FSDP1 and FSDP2"):
            famp.layout_of(model)


@pytest.mark.parametrize("with_model", [False, True])
def test_an_fsdp1_layout_for_fsdp2_parameters_is_refused_by_name(with_model: bool) -> None:
    """A bare AssertionError from famp's internals before."""
    model = odd_model()
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    with fake_rank(2, 0):
        fully_shard(model)
        optim = torch.optim.Adam(model.parameters())
        full = adam_like_state(shapes)
        layout = famp.fsdp1_layout([shapes], 2, use_orig_params=True)
        kwargs = {"model": model} if with_model else {}
        with pytest.raises(
            TypeError, match=r"parameter for '0\.weight' is a DTensor \(FSDP2\), but the layout is"
        ):
            famp.optim_state_dict_to_load(full, layout, 0, optim, **kwargs)


def test_layout_of_rejects_fsdp1_units_with_different_compute_dtypes() -> None:
    with fake_rank(2, 1):
        model = odd_model()
        cpu = torch.device("cpu")
        bf16 = MixedPrecision(param_dtype=torch.bfloat16)
        model[3] = FullyShardedDataParallel(model[3], device_id=cpu, mixed_precision=bf16)
        wrapped = FullyShardedDataParallel(model, device_id=cpu)
        with pytest.raises(ValueError, match=r"FSDP units differ.*torch\.bfloat16"):
            famp.layout_of(wrapped)


def test_shard_on_a_mesh_gives_dtensors_placed_like_the_parameters() -> None:
    shapes = {"a": (5, 2), "b": (1,), "c": (3, 4)}
    full = adam_like_state(shapes)
    layout = famp.fsdp2_layout(shapes, world_size=4, shard_dims={"c": 1})
    with fake_rank(4, 2):
        mesh = init_device_mesh("cpu", (4,))
        shard = famp.shard_optim_state(full, layout, 2, mesh=mesh)
        plain = famp.shard_optim_state(full, layout, 2)
        for fqn, shape in shapes.items():
            entry = shard["state"][fqn]
            assert type(entry["step"]) is torch.Tensor  # replicated values stay plain
            for key in ("exp_avg", "exp_avg_sq"):
                value = entry[key]
                assert isinstance(value, DTensor)
                assert value.device_mesh == mesh
                assert value.placements == (Shard(1 if fqn == "c" else 0),)
                assert value.shape == shape
                assert value.stride() == full["state"][fqn][key].stride()
                assert value.dtype == torch.float32
                assert_bitwise_equal(value.to_local(), plain["state"][fqn][key])
        assert shard["state"]["b"]["exp_avg"].to_local().shape == (0,)  # an empty trailing shard


def test_shard_on_a_mesh_refuses_a_mismatched_mesh() -> None:
    shapes = {"a": (5, 2)}
    full = adam_like_state(shapes)
    layout = famp.fsdp2_layout(shapes, world_size=4)
    with fake_rank(4, 1):
        mesh = init_device_mesh("cpu", (4,))
        with pytest.raises(ValueError, match=r"rank must be this process's rank on the mesh, 1"):
            famp.shard_optim_state(full, layout, 2, mesh=mesh)
        with pytest.raises(ValueError, match=r"world size 3, got shape \(4,\)"):
            famp.shard_optim_state(full, famp.fsdp2_layout(shapes, world_size=3), 1, mesh=mesh)
        with pytest.raises(ValueError, match=r"world size 4, got shape \(2, 2\)"):
            famp.shard_optim_state(full, layout, 1, mesh=init_device_mesh("cpu", (2, 2)))
        with pytest.raises(
            TypeError, match=r"mesh must be a torch\.distributed\.DeviceMesh, got str"
        ):
            famp.shard_optim_state(full, layout, 1, mesh="cpu")
        fsdp1 = famp.fsdp1_layout([shapes], world_size=4)
        with pytest.raises(ValueError, match="mesh applies to FSDP2 layouts only"):
            famp.shard_optim_state(full, fsdp1, 1, mesh=mesh)
