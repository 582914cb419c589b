"""One rank of the distributed cells of tests/autocast/test_autocast_compose.py, on 2 gloo ranks.

Each cell runs famp and its reference on this rank and records both in ``OUT/rank{r}.pt`` as
``{cell: {"actual": [tensors], "expected": [tensors], ...}}``; the test compares them bit for bit.
A cell that raises records its error instead, so that one failure does not hide the others.

- ``ddp_default``: ``DistributedDataParallel`` under famp's default rules against
  ``torch.autocast`` on an identical DDP model: loss and gradients.
- ``ddp_module_rule``: a module rule written for the wrapper (``module.head``) under DDP against
  the same rule (``head``) on the unwrapped model, gradients all-reduced by hand (mean over 2
  ranks: exact); ``ddp_module_rule_keywords``: the head's input passed by keyword, against the
  rule by hand. ``ddp_unprefixed_warns`` records whether the unprefixed rule warned.
  ``ddp_override``: an op override under DDP against the same override on the unwrapped model,
  gradients all-reduced by hand.
- ``fsdp2_default``: ``fully_shard`` with ``MixedPrecisionPolicy(param_dtype=bfloat16)`` under
  famp against ``torch.autocast``; ``fsdp2_module_rule``: a float32 rule on the head (full-precision
  parameters) against the head run by hand under ``torch.autocast(enabled=False)``;
  ``fsdp2_module_rule_keywords``: the same with the head sharded on its own and its input passed
  by keyword (FSDP2's pre-forward hook takes keyword inputs too); ``fsdp2_step_inside_a_call``: an
  optimizer step inside one call (an override, ``track_casts``) against ``torch.autocast`` with
  its cast cache off; ``fsdp2_no_write_keeps_casts``: no write, ``track_casts``, against
  ``torch.autocast`` with its cache on.
- ``fsdp1_default``: FSDP1 with ``MixedPrecision(param_dtype=bfloat16)`` against ``torch.autocast``;
  ``fsdp1_module_rule``: a ``*head`` rule through FSDP1's ``_fsdp_wrapped_module.`` prefix, against
  the head run by hand.
"""

from __future__ import annotations

import datetime
import functools
import pathlib
import sys
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import famp  # noqa: E402

BF16 = torch.bfloat16


class Net(nn.Module):
    def __init__(self, by_hand_f32_head: bool = False, by_keyword: bool = False) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)
        self.by_hand = by_hand_f32_head
        self.by_keyword = by_keyword  # the head's input passed as `input=`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.tanh(self.body(x)))
        if self.by_hand:  # what the module rule {"head": "f32"} means, written with torch.autocast
            with torch.autocast("cpu", enabled=False):
                return self.head(input=h.float()) if self.by_keyword else self.head(h.float())
        return self.head(input=h) if self.by_keyword else self.head(h)


def net(by_hand: bool = False, by_keyword: bool = False) -> Net:
    torch.manual_seed(0)
    return Net(by_hand, by_keyword)


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)


def loss_of(model: Callable[..., torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x).float(), y)


def step(forward: Callable[..., torch.Tensor], model: nn.Module, rank: int) -> list[torch.Tensor]:
    """Loss and every gradient (full tensors) of one forward/backward."""
    x, y = batch(rank)
    loss = loss_of(forward, x, y)
    loss.backward()
    grads = []
    for p in model.parameters():
        g = p.grad
        full = g.full_tensor() if hasattr(g, "full_tensor") else g
        grads.append(full.detach().clone())
    return [loss.detach(), *grads]


def under_torch_autocast(model: nn.Module) -> Callable[..., torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=BF16):
            return model(x)

    return forward


def ddp_default(rank: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    ours, theirs = DistributedDataParallel(net()), DistributedDataParallel(net())
    actual = step(famp.autocast(ours, "c=bf16,o=f32"), ours, rank)
    expected = step(under_torch_autocast(theirs), theirs, rank)
    return {"actual": actual, "expected": expected}


def ddp_module_rule(rank: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    wrapped, plain = DistributedDataParallel(net()), net()
    actual = step(
        famp.autocast(wrapped, "c=bf16,o=f32", module_rules={"module.head": "f32"}), wrapped, rank
    )
    expected = step(famp.autocast(plain, "c=bf16,o=f32", module_rules={"head": "f32"}), plain, rank)
    for g in expected[1:]:
        dist.all_reduce(g)
        g.div_(2)
    return {"actual": actual, "expected": expected}


def ddp_module_rule_keywords(rank: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    ours = DistributedDataParallel(net(by_keyword=True))
    theirs = DistributedDataParallel(net(by_hand=True, by_keyword=True))
    forward = famp.autocast(ours, "c=bf16,o=f32", module_rules={"module.head": "f32"})
    actual = step(forward, ours, rank)
    expected = step(under_torch_autocast(theirs), theirs, rank)
    return {"actual": actual, "expected": expected}


def ddp_override(rank: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    rules = famp.default_rules("cpu").override({"linear": "float32"})
    wrapped, plain = DistributedDataParallel(net()), net()
    actual = step(famp.autocast(wrapped, "c=bf16,o=f32", rules=rules), wrapped, rank)
    expected = step(famp.autocast(plain, "c=bf16,o=f32", rules=rules), plain, rank)
    default = net()
    changed = not torch.equal(
        step(famp.autocast(default, "c=bf16,o=f32"), default, rank)[0], expected[0]
    )
    for g in expected[1:]:
        dist.all_reduce(g)
        g.div_(2)
    return {"actual": actual, "expected": expected, "override_changed_the_loss": changed}


def ddp_unprefixed_warns(rank: int) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    wrapped = DistributedDataParallel(net())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        famp.autocast(wrapped, "c=bf16,o=f32", module_rules={"head": "f32"})(batch(rank)[0])
    return {"warnings": [str(w.message) for w in caught if w.category is famp.AutocastWarning]}


def fsdp2_default(rank: int) -> dict[str, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    ours, theirs = net(), net()
    for model in (ours, theirs):
        fully_shard(model.body, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
    actual = step(famp.autocast(ours, "c=bf16,o=f32"), ours, rank)
    expected = step(under_torch_autocast(theirs), theirs, rank)
    return {"actual": actual, "expected": expected}


def fsdp2_module_rule(rank: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    ours, theirs = net(), net(by_hand=True)
    for model in (ours, theirs):
        fully_shard(model, reshard_after_forward=False)
    forward = famp.autocast(ours, "c=bf16,o=f32", module_rules={"head": "f32"})
    actual = step(forward, ours, rank)
    expected = step(under_torch_autocast(theirs), theirs, rank)
    return {"actual": actual, "expected": expected}


def fsdp2_module_rule_keywords(rank: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    # The head sharded on its own: FSDP2's pre-forward hook (with keyword inputs, first among
    # the head's) and famp's, which goes before it, as famp's global hook goes before both.
    ours, theirs = net(by_keyword=True), net(by_hand=True, by_keyword=True)
    for model in (ours, theirs):
        fully_shard(model.head, reshard_after_forward=False)
        fully_shard(model, reshard_after_forward=False)
    forward = famp.autocast(ours, "c=bf16,o=f32", module_rules={"head": "f32"})
    actual = step(forward, ours, rank)
    expected = step(under_torch_autocast(theirs), theirs, rank)
    return {"actual": actual, "expected": expected}


def fsdp2_step_inside_a_call(rank: int) -> dict[str, Any]:
    """A backward and an SGD step inside one call, then a second forward: FSDP2 all-gathers the
    stepped weights into the unsharded parameters' storage, which it freed after the first use
    (`resize_`), keeping their version; famp's watch (an override, `track_casts`) recasts them,
    as `torch.autocast` with its cast cache off does."""
    from torch.distributed.fsdp import fully_shard

    def run(model: Net, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
        model(x).float().pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        return model(x)

    def cache_off(body: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def forward(x: torch.Tensor) -> torch.Tensor:
            with torch.autocast("cpu", dtype=BF16, cache_enabled=False):
                return body(x)

        return forward

    rules = famp.default_rules("cpu").override({"bmm": "float32"})  # no bmm here: the watch only
    actual, expected = [], []
    for reshard in (True, False):
        for kwargs in ({"rules": rules}, {"track_casts": True}):
            for results, ours in ((actual, True), (expected, False)):
                model = net()
                fully_shard(model.body, reshard_after_forward=reshard)
                fully_shard(model, reshard_after_forward=reshard)
                body = functools.partial(run, model, torch.optim.SGD(model.parameters(), lr=0.5))
                forward = famp.autocast(body, "c=bf16,o=f32", **kwargs) if ours else cache_off(body)
                results += step(forward, model, rank)
    return {"actual": actual, "expected": expected}


def fsdp2_no_write_keeps_casts(rank: int) -> dict[str, Any]:
    """No weight written in the call: famp's watch (`track_casts`) keeps every cast, as
    `torch.autocast`'s cache does, while FSDP2 frees the blocks' unsharded weights after use and
    in-place ops write into tensors that may get their old addresses (a weight used before and
    after them, `mid`, rounds its gradient as with one cast). Before 2026-12-02 a freed weight's
    old data pointer matched such a write in 9 to 11 of 20 steps on one machine."""
    from torch.distributed.fsdp import fully_shard

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin1, self.lin2 = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.lin2(nn.functional.relu(self.lin1(x), inplace=True))

    class Mid(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.mid, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
            self.blocks = nn.ModuleList([Block(), Block()])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.mid(self.inp(x))
            for block in self.blocks:
                h = block(h)
            return self.head(self.mid(h))

    actual, expected = [], []
    for i in range(10):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(100 * i + rank))
        for results, ours in ((expected, False), (actual, True)):
            torch.manual_seed(0)
            model = Mid()
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
            if ours:
                out = famp.autocast(model, "c=bf16,o=f32", track_casts=True)(x)
            else:
                with torch.autocast("cpu", dtype=BF16):
                    out = model(x).float()
            out.pow(2).sum().backward()
            grad = model.mid.weight.grad
            results += [out.detach(), grad.full_tensor() if hasattr(grad, "full_tensor") else grad]
    return {"actual": actual, "expected": expected}


def fsdp1_default(rank: int) -> dict[str, Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision

    mp = MixedPrecision(param_dtype=BF16, reduce_dtype=torch.float32)
    ours = FullyShardedDataParallel(net(), mixed_precision=mp, device_id=torch.device("cpu"))
    theirs = FullyShardedDataParallel(net(), mixed_precision=mp, device_id=torch.device("cpu"))
    actual = step(famp.autocast(ours, "c=bf16,o=f32"), ours, rank)
    expected = step(under_torch_autocast(theirs), theirs, rank)
    return {"actual": actual, "expected": expected}


def fsdp1_module_rule(rank: int) -> dict[str, Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel

    # FSDP1 wraps: the paths become `_fsdp_wrapped_module.head`; "*head" matches either.
    ours = FullyShardedDataParallel(net(), device_id=torch.device("cpu"))
    theirs = FullyShardedDataParallel(net(by_hand=True), device_id=torch.device("cpu"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", famp.AutocastWarning)
        forward = famp.autocast(ours, "c=bf16,o=f32", module_rules={"*head": "f32"})
        actual = step(forward, ours, rank)
    expected = step(under_torch_autocast(theirs), theirs, rank)
    return {"actual": actual, "expected": expected}


CELLS = [
    ddp_default,
    ddp_module_rule,
    ddp_module_rule_keywords,
    ddp_override,
    ddp_unprefixed_warns,
    fsdp2_default,
    fsdp2_module_rule,
    fsdp2_module_rule_keywords,
    fsdp2_step_inside_a_call,
    fsdp2_no_write_keeps_casts,
    fsdp1_default,
    fsdp1_module_rule,
]


def main() -> None:
    out_dir = pathlib.Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    record: dict[str, Any] = {}
    try:
        for cell in CELLS:
            try:
                record[cell.__name__] = cell(rank)
            except Exception:  # recorded for the test to report
                record[cell.__name__] = {"error": traceback.format_exc()}
            dist.barrier()
        torch.save(record, out_dir / f"rank{rank}.pt")
        print(f"compose_worker rank {rank} done", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
