"""found_inf is max-reduced across real gloo ranks: group=..., and DTensor (FSDP2) grads."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tests.helpers import spawn_ranks

WORLD_SIZE = 2
# (rank -> has an inf) cases, run in one pair of processes to pay the start-up once.
CASES = [(False, True), (True, True), (False, False)]


def _worker(rank: int, port: int, results: Any) -> None:
    import torch.distributed as dist

    import famp
    from tests.helpers import init_gloo, report_finished

    init_gloo(rank, WORLD_SIZE, port)
    try:
        state = famp.init_scaler(4.0)
        subgroup = dist.new_group([0, 1])
        for case, has_inf in enumerate(CASES):
            grads = {"w": torch.full((3,), 8.0), "b": torch.tensor([2.0], dtype=torch.bfloat16)}
            if has_inf[rank]:
                grads["w"][rank] = math.inf
            local, local_found = famp.unscale_and_check(state, grads)
            out, found = famp.unscale_and_check(state, grads, group=dist.group.WORLD)
            _, found_sub = famp.unscale_and_check(state, grads, group=subgroup)
            results.put(
                (
                    rank,
                    case,
                    local_found.item(),
                    found.item(),
                    found_sub.item(),
                    str(found.dtype),
                    tuple(found.shape),
                    torch.equal(out["w"], local["w"]),
                    grads["w"][1].item(),
                )
            )
        results.put(("dtensor", rank, *_dtensor_case(rank)))
        report_finished(rank, results)
    finally:
        dist.destroy_process_group()


def _dtensor_case(rank: int) -> tuple[float, float, bool, bool, bool, bool]:
    """FSDP2-style DTensor grads, an inf on rank 1 only: famp against GradScaler.unscale_."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import famp

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))

    def grads() -> list[DTensor]:
        sharded = torch.arange(4.0) + 8 * rank
        if rank == 1:
            sharded[2] = math.inf
        return [
            DTensor.from_local(sharded, mesh, [Shard(0)], run_check=False),
            DTensor.from_local(
                torch.full((3,), 6.0, dtype=torch.bfloat16), mesh, [Replicate()], run_check=False
            ),
        ]

    ours = grads()
    out, found = famp.unscale_and_check(famp.init_scaler(3.0), ours)
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads()]
    for p, g in zip(params, grads(), strict=True):
        p.grad = g
    scaler = torch.amp.GradScaler("cpu", init_scale=3.0)
    opt = torch.optim.SGD(params, lr=0.1)
    scaler.scale(torch.ones(()))
    scaler.unscale_(opt)
    (expected_found,) = scaler._found_inf_per_device(opt).values()
    same = all(
        isinstance(o, DTensor)
        and o.placements == p.grad.placements
        and o.shape == p.grad.shape
        and torch.equal(o.to_local().view(-1), p.grad.to_local().view(-1))
        for o, p in zip(out, params, strict=True)
    )
    untouched = ours[0].to_local()[0].item() == 8.0 * rank
    # Compiled (fullgraph): the local shards go through famp::unscale, found_inf over the mesh.
    unscale = torch.compile(famp.unscale_and_check, fullgraph=True)
    compiled_out, compiled_found = unscale(famp.init_scaler(3.0), grads())
    compiled_same = compiled_found.item() == found.item() and all(
        isinstance(c, DTensor)
        and c.placements == o.placements
        and torch.equal(c.to_local().view(-1), o.to_local().view(-1))
        for c, o in zip(compiled_out, out, strict=True)
    )
    is_f32 = found.dtype == torch.float32
    return found.item(), expected_found.item(), same, untouched, is_f32, compiled_same


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_found_inf_is_max_reduced_across_gloo_ranks() -> None:
    count = WORLD_SIZE * (len(CASES) + 1)
    rows = spawn_ranks(_worker, WORLD_SIZE, lambda r, port, q: (r, port, q), count, 90)
    dtensor_rows = [row for row in rows if row[0] == "dtensor"]
    rows = [row for row in rows if row[0] != "dtensor"]
    for rank, case, local, found, found_sub, dtype, shape, same_grads, w1 in rows:
        has_inf = CASES[case]
        assert local == float(has_inf[rank])  # without group=, each rank sees only its grads
        assert found == float(any(has_inf))  # both ranks report 1.0 (max, not torch's sum)
        assert found_sub == found
        assert (dtype, shape) == (str(torch.float32), ())
        assert same_grads  # the reduction touches found_inf only
        assert w1 == (math.inf if has_inf[rank] and rank == 1 else 8.0)  # input not modified
    assert len(dtensor_rows) == WORLD_SIZE
    for _, _, found, expected_found, same, untouched, is_f32, compiled_same in dtensor_rows:
        assert found == expected_found == 1.0  # reduced over the mesh, as GradScaler's dispatch
        assert same  # placements, shapes and local values equal GradScaler.unscale_'s
        assert untouched
        assert is_f32
        assert compiled_same  # compiled: the same DTensors, bit for bit, and found_inf


def test_group_must_be_a_process_group() -> None:
    import famp

    with pytest.raises(TypeError, match=r"group must be a torch\.distributed\.ProcessGroup"):
        famp.unscale_and_check(famp.init_scaler(), [torch.ones(1)], group="world")


def test_a_bad_group_is_refused_before_anything_is_changed_or_run() -> None:
    """A bad `group` was found only at the reduction: donated grads and an optimizer's grads
    were unscaled in place by then, and value_and_grad had run fn's forward and backward."""
    import famp

    message = r"group must be a torch\.distributed\.ProcessGroup or None, got str 'world'"
    state = famp.init_scaler(1024.0)
    grads = [torch.full((3,), 1024.0), torch.full((2,), 2048.0)]
    with pytest.raises(TypeError, match=message):
        famp.unscale_and_check(state, grads, donate=True, group="world")
    assert grads[0].eq(1024.0).all()
    assert grads[1].eq(2048.0).all()
    for fused, found_inf in [(False, None), (True, None), (True, torch.zeros(()))]:
        w = torch.nn.Parameter(torch.ones(3))
        optimizer = torch.optim.Adam([w], lr=0.1, fused=fused)
        w.grad = torch.full((3,), 1024.0)
        with pytest.raises(TypeError, match=message):
            famp.optimizer_step(optimizer, state, found_inf=found_inf, group="world")
        assert w.grad.eq(1024.0).all()
        assert w.eq(1.0).all()
        assert not optimizer.state
    ran = []
    with pytest.raises(TypeError, match=message):
        famp.value_and_grad(lambda w: ran.append(1) or w.sum(), group="world")
    assert ran == []
