"""What `famp-reshard` prints: the source and per-rank summaries, and a progress bar on stderr."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

import torch

from famp._fsdp.layout import FSDP2Layout

if TYPE_CHECKING:
    from famp._fsdp.cli_sources import Source


PROGRESS_AUTO_BYTES = 256 * 2**20
_MAX_LISTED = 4


class Progress:
    """A one-line progress bar on stderr, redrawn when the percentage changes."""

    def __init__(
        self, label: str, total: int, enabled: bool, fmt: Callable[[int], str] = str
    ) -> None:
        self.label, self.total, self.enabled, self.fmt = label, max(total, 1), enabled, fmt
        self.done, self.shown = 0, -1

    def update(self, n: int) -> None:
        self.done += n
        percent = min(100, 100 * self.done // self.total)
        if self.enabled and percent != self.shown:
            self.shown = percent
            bar = "#" * (percent // 4)
            amount = f"{self.fmt(min(self.done, self.total))}/{self.fmt(self.total)}"
            sys.stderr.write(f"\r{self.label} [{bar:<25}] {percent:3d}% {amount}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            self.update(self.total - self.done)
            sys.stderr.write("\n")
            sys.stderr.flush()


def human(nbytes: float) -> str:
    """`nbytes` in B, KiB, MiB or GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def state_nbytes(osd: Mapping[str, Any]) -> tuple[int, int]:
    """Number of state tensors and their bytes."""
    tensors = list(_tensors(osd["state"]))
    return len(tensors), sum(t.numel() * t.element_size() for t in tensors)


def _tensors(value: object) -> Iterator[torch.Tensor]:
    """The tensors in `value`, inside dicts, lists and tuples too (nested optimizer state)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping | list | tuple):
        for v in value.values() if isinstance(value, Mapping) else value:
            yield from _tensors(v)


def progress_wanted(args: argparse.Namespace, total: int) -> bool:
    """`--progress`, else on for `total` bytes of 256 MiB or more on a terminal."""
    if args.progress is not None:
        return bool(args.progress)
    return total >= PROGRESS_AUTO_BYTES and sys.stderr.isatty()


@dataclass
class RankStats:
    """One output rank: its state tensors, their bytes and the parameters with empty shards."""

    tensors: int
    nbytes: int
    empty: list[str]


def rank_stats(shard: Mapping[str, Any], layout: FSDP2Layout, rank: int) -> RankStats:
    """`RankStats` of `rank`'s shard."""
    tensors = list(_tensors(shard["state"]))
    empty = [f for f in shard["state"] if 0 in layout.local_shape(f, rank)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return RankStats(len(tensors), nbytes, empty)


def print_source(source: Source, out: IO[str]) -> None:
    """The source's summary: what it is, its parameters and param groups, tensors and bytes."""
    full = source.full
    groups = full["param_groups"]
    n_params = sum(len(g["params"]) for g in groups)
    n_tensors, nbytes = state_nbytes(full)
    print(f"source      {source.what}", file=out)
    print(
        f"parameters  {n_params} in {len(groups)} param groups, {len(full['state'])} with state",
        file=out,
    )
    print(f"tensors     {n_tensors}, {human(nbytes)}", file=out)


def print_ranks(stats: Sequence[RankStats], layout: FSDP2Layout, out: IO[str]) -> None:
    """The target's summary: one line per rank."""
    print(f"target      FSDP2, dim-0 chunks on {layout.world_size} ranks", file=out)
    print(f"{'rank':>6}  {'tensors':>7}  {'bytes':>10}  empty shards", file=out)
    for rank, s in enumerate(stats):
        listed = ", ".join(s.empty[:_MAX_LISTED])
        more = f", ... {len(s.empty) - _MAX_LISTED} more" if len(s.empty) > _MAX_LISTED else ""
        empty = f"{len(s.empty)}" + (f": {listed}{more}" if s.empty else "")
        print(f"{rank:>6}  {s.tensors:>7}  {human(s.nbytes):>10}  {empty}", file=out)
