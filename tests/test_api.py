"""Conformance of the public API: every exported name is documented and reports its public path."""

from __future__ import annotations

import inspect
import pathlib

import pytest

import famp

ROOT = pathlib.Path(__file__).resolve().parents[1]
PUBLIC = [name for name in famp.__all__ if name != "__version__"]


def test_all_names_resolve() -> None:
    assert isinstance(famp.__version__, str)
    for name in famp.__all__:
        assert hasattr(famp, name), name
    assert len(set(famp.__all__)) == len(famp.__all__)


@pytest.mark.parametrize("name", PUBLIC)
def test_public_name_has_docstring_and_public_module(name: str) -> None:
    obj = getattr(famp, name)
    if inspect.isfunction(obj) or inspect.isclass(obj):
        assert obj.__module__ == "famp", f"famp.{name}.__module__ is {obj.__module__!r}"
        doc = inspect.getdoc(obj)
        assert doc, f"famp.{name} needs a docstring"
        assert len(doc.splitlines()[0]) > 10, f"famp.{name}'s docstring needs a summary line"


@pytest.mark.parametrize("name", PUBLIC)
def test_public_name_appears_in_docs(name: str) -> None:
    docs = "\n".join(p.read_text() for p in (ROOT / "docs").rglob("*.md"))
    assert f"famp.{name}" in docs, f"famp.{name} is not in docs/"


def test_every_example_of_a_public_name_and_its_methods_is_collected() -> None:
    """pytest's doctest collection (`--doctest-modules`) runs famp/__init__.py's DocTestFinder,
    which keeps only objects whose `__module__` is "famp": every method with an example must be
    among them, or its example would silently never run."""
    import doctest

    finder = doctest.DocTestFinder()
    collected = {t.name for t in finder.find(famp) if t.examples}
    with_examples = set()
    for name in PUBLIC:
        obj = getattr(famp, name)
        if isinstance(obj, type) or callable(obj):
            found = finder.find(obj, f"famp.{name}", module=False, globs={})
            with_examples |= {t.name for t in found if t.examples}
    assert with_examples, "no examples found at all"
    assert with_examples <= collected, sorted(with_examples - collected)
