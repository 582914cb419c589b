"""The `Examples:` of the public autocast classes' methods run.

pytest's doctest collection reaches a class through `famp/__init__.py` (whose `__module__` is
"famp") but skips its methods, whose `__module__` is still their private module's. These tests
run them.
"""

from __future__ import annotations

import doctest

import pytest

import famp

CLASSES = ("OpRules", "Policy", "Trace", "OpRecord")
# The methods that have examples today: losing one from the collection fails the test below.
EXPECTED = {
    "famp.OpRules.from_dict",
    "famp.OpRules.lookup",
    "famp.OpRules.override",
    "famp.OpRules.table",
    "famp.OpRules.to_dict",
    "famp.Trace.counts",
    "famp.Trace.summary",
    "famp.Trace.table",
}


def method_examples() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder()
    found = []
    for name in CLASSES:
        tests = finder.find(getattr(famp, name), f"famp.{name}", module=False, globs={})
        # The class docstring itself is collected from famp/__init__.py already.
        found += [t for t in tests if t.examples and t.name != f"famp.{name}"]
    return sorted(found, key=lambda t: t.name)


def test_every_method_example_is_found() -> None:
    assert not EXPECTED - {t.name for t in method_examples()}


@pytest.mark.parametrize("test", method_examples(), ids=lambda t: t.name)
def test_method_example_runs(test: doctest.DocTest) -> None:
    report: list[str] = []
    runner = doctest.DocTestRunner(
        optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS, verbose=False
    )
    runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)
    assert runner.tries == len(test.examples) > 0
