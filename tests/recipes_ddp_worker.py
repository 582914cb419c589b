"""One rank of tests/test_recipes.py's DDP recipe, started by torchrun on 2 gloo ranks.

Trains the typical recipe under ``DistributedDataParallel`` twice, with torch's code
(``torch.autocast`` + ``GradScaler``) and with famp's (docs/recipes.md), each rank on its own
batches, an inf in rank 1's input at the overflow steps; writes both results to ``OUT/rank{r}.pt``.
"""

from __future__ import annotations

import datetime
import pathlib
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import famp  # noqa: E402
from tests.test_recipes import BAD, POLICY, SCALER, STEPS, loss_fn, net  # noqa: E402


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(6, 8, generator=gen), torch.randint(0, 4, (6,), generator=gen)
        if step in BAD and rank == 1:  # only rank 1 overflows; DDP's all-reduce spreads it
            x[0, 0] = float("inf")
        out.append((x, y))
    return out


def main(out: pathlib.Path) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    torch.set_num_threads(1)

    # torch's recipe
    torch_model = DistributedDataParallel(net())
    torch_optimizer = torch.optim.SGD(torch_model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    for input, target in batches(rank):
        torch_optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            output = torch_model(input)
            loss = loss_fn(output, target)
        scaler.scale(loss).backward()
        scaler.step(torch_optimizer)
        scaler.update()

    # famp's recipe (docs/recipes.md)
    model = DistributedDataParallel(net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = famp.init_scaler(**SCALER)
    compute_loss = famp.autocast(lambda input, target: loss_fn(model(input), target), POLICY)
    found = []
    for input, target in batches(rank):
        optimizer.zero_grad()
        famp.scale(state, compute_loss(input, target)).backward()
        found_inf = famp.optimizer_step(optimizer, state)
        state = famp.update_scale(state, found_inf)
        found.append(found_inf)

    record = {
        "famp": {k: v.detach() for k, v in model.module.named_parameters()},
        "torch": {k: v.detach() for k, v in torch_model.module.named_parameters()},
        "famp_found_inf": torch.stack(found),
    }
    record["famp"]["scale"] = state.scale
    record["torch"]["scale"] = scaler._scale  # type: ignore[assignment]
    torch.save(record, out / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
