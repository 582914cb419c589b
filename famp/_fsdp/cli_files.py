"""`famp-reshard`'s outputs written atomically: a temporary sibling renamed into place.

Existing outputs are refused before anything is read (`--force` replaces a directory of rank
files only); outputs get the modes `open` and `mkdir` would give them.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import tempfile
from collections.abc import Sequence

import torch

_RANK_FILE = re.compile(r"rank\d+\.pt|__\d+_0\.distcp|\.metadata")


def check_targets(args: argparse.Namespace) -> None:
    """Reject existing outputs before reading anything."""
    if args.dry_run:
        return
    for path, kind in ((args.out, "--out"), (args.full, "--full")):
        if path is None:
            continue
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise FileNotFoundError(f"{kind} {path!r}: directory {parent!r} does not exist")
        if kind == "--full":
            _check_outside_sources(path, args.sources)
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".famp-reshard-probe-", dir=parent))
        except OSError as err:
            raise OSError(f"{kind} {path!r}: cannot write in {parent!r}: {err.strerror}") from err
        if os.path.lexists(path) and not args.force:
            raise FileExistsError(f"{kind} {path!r} exists; pass --force to replace it")
        if kind == "--out" and os.path.lexists(path):
            _check_replaceable(path)


def _check_outside_sources(path: str, sources: Sequence[str]) -> None:
    """`--full` is written after its sources are read, or while a DCP checkpoint streams: it
    must not replace a SOURCE file, nor a file inside a SOURCE directory."""
    target = os.path.realpath(path)
    for source in sources:
        real = os.path.realpath(source)
        if target == real or target.startswith(os.path.join(real, "")):
            raise ValueError(
                f"--full {path!r} is SOURCE {source!r} or inside it: famp-reshard never writes "
                "over the checkpoint it reads; give another path"
            )


def _check_replaceable(out: str) -> None:
    """`--force` replaces a directory of rank files only, never one holding anything else."""
    if not os.path.isdir(out) or os.path.islink(out):
        raise ValueError(f"--out {out!r} exists and is not a directory")
    others = [n for n in os.listdir(out) if not _RANK_FILE.fullmatch(n)]
    if others:
        raise ValueError(
            f"--out {out!r} holds files other than rank*.pt ({sorted(others)[:3]}); famp-reshard "
            "replaces only a directory it wrote"
        )


def place(tmp: str, target: str, force: bool) -> None:
    """Rename the streamed `--full` file `tmp` to `target`; an existing one needs `force`."""
    if os.path.lexists(target) and not force:
        raise FileExistsError(f"--full {target!r} exists; pass --force to replace it")
    os.replace(tmp, target)


def replace_dir(tmp: str, target: str, force: bool) -> None:
    """Rename `tmp` to `target`; with `force`, an existing `target` goes only after."""
    if not os.path.lexists(target):
        os.rename(tmp, target)
        return
    if not force:
        raise FileExistsError(f"{target!r} exists; pass --force to replace it")
    _check_replaceable(target)
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.old-", dir=os.path.dirname(tmp))
    moved = os.path.join(old, "x")
    os.rename(target, moved)
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(moved, target)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def set_default_modes(directory: str | None, files: Sequence[str]) -> None:
    """Give outputs the modes `open`/`mkdir` would (`tempfile` makes them private)."""
    mask = _umask()
    for path in files:
        os.chmod(path, 0o666 & ~mask)
    if directory is not None:
        os.chmod(directory, 0o777 & ~mask)


def atomic_save(obj: object, path: str, force: bool) -> None:
    """`torch.save(obj)` to a temporary sibling of `path`, renamed into place when whole."""
    parent, name = os.path.split(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.tmp-", dir=parent)
    os.close(fd)
    try:
        torch.save(obj, tmp)
        set_default_modes(None, [tmp])
        if os.path.lexists(path) and not force:
            raise FileExistsError(f"--full {path!r} exists; pass --force to replace it")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
