"""famp's layout, checked: rooms as private subpackages, one-way imports, no reaching into
another module's private names, one docstring dialect, one place that sets public paths.

What famp/README.md's architecture section describes; each test names the offending file and line.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest
import torch

import famp

FAMP = pathlib.Path(famp.__file__).resolve().parent
TESTS = pathlib.Path(__file__).resolve().parent
MODULES = sorted(FAMP.rglob("*.py"))
ROOMS = ("_scaling", "_autocast", "_fsdp")
# The shared modules every room may import; they import no room.
SHARED = {"_compat", "_collectives", "_typing"}
# Which rooms a room may import (imports flow one way; loss scaling never imports FSDP or DCP).
MAY_IMPORT: dict[str, set[str]] = {"_scaling": set(), "_autocast": set(), "_fsdp": set()}
# Data tables may be longer than a module of code: the per-release autocast rule tables and the
# sample inputs every autocast op is run on when its rule is derived.
DATA = {"rules_data.py", "samples.py"}
# About 300 lines: a few over is no reason to cut a concept in two.
MAX_LINES = 310
# The one module of torch's private names, one entry each with its reason, kept in one place by
# design (tests/test_compat.py): it grows with what famp must read of torch, within its own bound.
REGISTRY_MAX_LINES = {"_compat.py": 530}


def _rel(path: pathlib.Path) -> str:
    return str(path.relative_to(FAMP.parent))


def _room(module: str) -> str | None:
    """`famp._scaling.state` -> `_scaling`; a shared or top-level module -> its own name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "famp" else None


def _imports(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """Every famp module a module imports (at the top or inside functions), with its line."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("famp")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            if base == "famp":  # `from famp import _x`
                found += [(node.lineno, f"famp.{a.name}") for a in node.names]
            elif base.startswith("famp."):
                found.append((node.lineno, base))
    return found


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(FAMP.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_the_top_level_holds_the_rooms_and_the_shared_modules_only() -> None:
    top = {p.stem for p in FAMP.glob("*.py")} - {"__init__", "__main__"}
    assert top == SHARED, f"top-level famp modules outside the rooms: {sorted(top - SHARED)}"
    rooms = {p.name for p in FAMP.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms == set(ROOMS)
    for room in ROOMS:
        assert (TESTS / room.lstrip("_")).is_dir(), f"tests/{room.lstrip('_')}/ mirrors {room}"


@pytest.mark.parametrize("path", MODULES, ids=_rel)
def test_each_module_is_about_300_lines_or_fewer(path: pathlib.Path) -> None:
    if path.name in DATA:
        return
    lines = len(path.read_text().splitlines())
    limit = REGISTRY_MAX_LINES.get(path.name, MAX_LINES)
    assert lines <= limit, f"{_rel(path)} has {lines} lines: split it by concept"


@pytest.mark.parametrize("path", MODULES, ids=_rel)
def test_imports_flow_one_way(path: pathlib.Path) -> None:
    name = _module_name(path)
    room = _room(name)
    bad = []
    for line, target in _imports(ast.parse(path.read_text()), name):
        other = _room(target)
        if other is None or other == room or name == "famp":
            continue
        if room in SHARED and other in ROOMS:
            bad.append(f"{_rel(path)}:{line} (shared) imports {target}")
        if room in ROOMS and other in ROOMS and other not in MAY_IMPORT[room]:
            bad.append(f"{_rel(path)}:{line} ({room}) imports {target}")
    assert not bad, "imports against the flow:\n" + "\n".join(bad)


def _defined_private_names(tree: ast.AST) -> set[str]:
    """Private names a module defines: functions, classes, assignments, attributes it sets."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)  # dataclass fields
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


_TREES = {path: ast.parse(path.read_text()) for path in MODULES}
_FAMP_PRIVATE = set().union(*(_defined_private_names(t) for t in _TREES.values()))


@pytest.mark.parametrize("path", [p for p in MODULES if p.name != "_compat.py"], ids=_rel)
def test_no_module_reads_another_modules_private_names(path: pathlib.Path) -> None:
    """`_compat.py` reads torch's private names by design (tests/test_compat.py checks that)."""
    tree = _TREES[path]
    own = _defined_private_names(tree)
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("famp"):
            bad += [
                f"{_rel(path)}:{node.lineno} imports {node.module}.{a.name}"
                for a in node.names
                if a.name.startswith("_")
                and not a.name.startswith("__")
                # a module of famp itself (`from famp import _compat`) is not a private name
                and not (FAMP / f"{a.name}.py").exists()
                and not (FAMP / a.name).is_dir()
            ]
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            name = node.attr
            if name.startswith("__") or name in own or hasattr(torch.Tensor, name):
                continue  # a tensor's own methods (`_values`) are torch's: tests/test_compat.py
            if name in _FAMP_PRIVATE:
                bad.append(f"{_rel(path)}:{node.lineno} reads .{name}, defined elsewhere in famp")
    assert not bad, "private names read across modules:\n" + "\n".join(bad)


@pytest.mark.parametrize("path", MODULES, ids=_rel)
def test_one_docstring_dialect_and_one_place_for_public_paths(path: pathlib.Path) -> None:
    text = path.read_text()
    rel = _rel(path)
    assert "``" not in text, f"{rel}: double backticks (docstrings use Markdown `code`)"
    roles = re.findall(r":(?:func|class|meth|attr|mod|data|obj|exc):`", text)
    assert not roles, f"{rel}: RST roles {roles} (mkdocstrings shows them literally)"
    assert not re.search(r"^\s*Example:\s*$", text, re.M), f"{rel}: `Example:` (use `Examples:`)"
    if path != FAMP / "__init__.py":
        assert '__module__ = "famp"' not in text, f"{rel}: famp/__init__.py sets public paths"
        assert not re.search(r"^__all__\b", text, re.M), f"{rel}: __all__ belongs to famp only"
        assert not re.search(r"^__test__\b", text, re.M), f"{rel}: doctests collect from famp"


def test_every_public_name_reports_its_public_path() -> None:
    for name in famp.__all__:
        obj = getattr(famp, name)
        if isinstance(obj, type) or callable(obj):
            assert obj.__module__ == "famp", name
