"""`famp-reshard`'s outputs written atomically: a temporary sibling renamed into place.

Outputs that exist, or that are, hold or lie inside a SOURCE or each other, are refused before
anything is read (`--force` replaces a directory holding only what its `--format` writes);
outputs get the modes `open` and `mkdir` would give them.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import tempfile
from collections.abc import Sequence

import torch

# What famp-reshard writes into --out, per --format: a directory of only these is replaceable.
_OWN_FILES = {
    "rank-files": (re.compile(r"rank\d+\.pt"), "rank*.pt files"),
    "dcp": (re.compile(r"__\d+_0\.distcp|\.metadata"), "DCP files (.metadata, __<r>_0.distcp)"),
}


def check_targets(args: argparse.Namespace) -> None:
    """Reject outputs that exist, overlap a SOURCE or each other, before reading anything."""
    if args.dry_run:
        return
    if args.out is not None and args.full is not None:
        _check_apart(args.out, args.full)
    for path, kind in ((args.out, "--out"), (args.full, "--full")):
        if path is None:
            continue
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise FileNotFoundError(f"{kind} {path!r}: directory {parent!r} does not exist")
        _check_outside_sources(path, kind, args.sources)
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".famp-reshard-probe-", dir=parent))
        except OSError as err:
            raise OSError(f"{kind} {path!r}: cannot write in {parent!r}: {err.strerror}") from err
        if os.path.lexists(path) and not args.force:
            raise FileExistsError(f"{kind} {path!r} exists; pass --force to replace it")
        if kind == "--out" and os.path.lexists(path):
            check_replaceable(path, args.format)
        if kind == "--full" and os.path.isdir(path):
            raise ValueError(f"--full {path!r} is a directory; --full names a file to write")


def _inside(path: str, folder: str) -> bool:
    return path.startswith(os.path.join(folder, ""))


def _check_apart(out: str, full: str) -> None:
    """`--out` is replaced whole once written: `--full` may be neither it nor inside it."""
    o, f = os.path.realpath(out), os.path.realpath(full)
    if o == f or _inside(f, o) or _inside(o, f):
        raise ValueError(
            f"--out {out!r} and --full {full!r} are the same path or one is inside the other: "
            "give each its own path"
        )


def _check_outside_sources(path: str, kind: str, sources: Sequence[str]) -> None:
    """An output is written after its sources are read, or while a DCP checkpoint streams: it
    must not be a SOURCE, lie inside a SOURCE directory, or (`--out`, replaced whole) hold one."""
    target = os.path.realpath(path)
    for source in sources:
        real = os.path.realpath(source)
        if target == real or _inside(target, real):
            what = f"is SOURCE {source!r} or inside it"
        elif _inside(real, target):
            what = f"holds SOURCE {source!r}"
        else:
            continue
        raise ValueError(
            f"{kind} {path!r} {what}: famp-reshard never writes over the checkpoint it reads; "
            "give another path"
        )


def check_replaceable(out: str, fmt: str) -> None:
    """`--force` replaces a directory of what `fmt` writes only, never one holding more."""
    if not os.path.isdir(out) or os.path.islink(out):
        raise ValueError(f"--out {out!r} exists and is not a directory")
    pattern, what = _OWN_FILES[fmt]
    others = [
        n
        for n in os.listdir(out)
        if not pattern.fullmatch(n) or os.path.isdir(os.path.join(out, n))
    ]
    if others:
        raise ValueError(
            f"--out {out!r} holds files other than the {what} that --format {fmt} writes "
            f"({sorted(others)[:3]}); famp-reshard replaces only a directory of its own output "
            "in that format"
        )


def temp_path(path: str) -> str:
    """`path`'s name in a new temporary sibling directory: `torch.save` names a file's records
    after its name (`full.pt`: `full/data.pkl`), so what is written there is, once `place`d,
    the file `torch.save(obj, path)` writes. `discard` removes it."""
    parent, name = os.path.split(os.path.abspath(path))
    return os.path.join(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent), name)


def discard(tmp: str) -> None:
    """Remove a `temp_path` and its directory, if they are still there."""
    shutil.rmtree(os.path.dirname(tmp), ignore_errors=True)


def place(tmp: str, target: str, force: bool) -> None:
    """Rename the `temp_path` file `tmp` to `target`; an existing one needs `force`."""
    if os.path.lexists(target) and not force:
        raise FileExistsError(f"--full {target!r} exists; pass --force to replace it")
    os.replace(tmp, target)
    os.rmdir(os.path.dirname(tmp))


def replace_dir(tmp: str, target: str, force: bool, fmt: str) -> None:
    """Rename `tmp` to `target`; with `force`, an existing `target` of `fmt`'s files goes only
    after."""
    if not os.path.lexists(target):
        os.rename(tmp, target)
        return
    if not force:
        raise FileExistsError(f"{target!r} exists; pass --force to replace it")
    check_replaceable(target, fmt)
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


def save_temp(obj: object, path: str) -> str:
    """`torch.save(obj)` to a `temp_path` of `path`; `place` it once every output is written
    (the caller `discard`s it on failure)."""
    tmp = temp_path(path)
    try:
        torch.save(obj, tmp)
        set_default_modes(None, [tmp])
    except BaseException:
        discard(tmp)
        raise
    return tmp
