"""Every Python block in README.md, famp/README.md and docs/**/*.md runs, and shows what it prints.

Conventions for writing docs (every new page is picked up automatically):

* A fenced ``python`` block runs as written, in a fresh namespace per page (blocks of one page run
  in order and share it, so a later block may use an earlier one's names), in an empty temporary
  working directory, after ``torch.manual_seed(0)`` and ``random.seed(0)``.
* A fenced ``text`` block that directly follows a ``python`` block (blank lines allowed between)
  is that block's output: what it prints must equal it exactly (trailing spaces ignored).
* A block that cannot run in one process (a multi-rank snippet that needs a live process group or
  a wrapped model) is marked with an HTML comment right before its fence, with the reason:
  ``<!-- no-test: needs a live FSDP2 model on every rank -->``. Use it sparingly; a test checks
  that every marker gives a reason.
* ``torch.compile`` runs with ``backend="aot_eager"`` unless a block names a backend: Dynamo still
  traces the block (``fullgraph=True`` is still enforced) and AOTAutograd still builds its graphs,
  without inductor's C++ compile time, which the benchmarks measure instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import os
import pathlib
import random
import re
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = sorted(
    [ROOT / "README.md", ROOT / "famp" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
)
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\n`]*)$")
_NO_TEST = re.compile(r"<!--\s*no-test(?P<reason>[^>]*)-->")


@dataclasses.dataclass
class Block:
    """One fenced code block of a page."""

    page: pathlib.Path
    line: int  # 1-based line of the opening fence
    info: str
    code: str
    no_test: str | None = None  # the marker's reason, when marked
    output: str | None = None  # the text block that follows, when there is one


def blocks(page: pathlib.Path) -> list[Block]:
    """The page's fenced blocks, with their no-test markers and expected output attached."""
    lines = page.read_text().splitlines()
    out: list[Block] = []
    pending_marker: str | None = None
    last_closed = -10  # index of the line that closed the previous block
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match is None:
            marker = _NO_TEST.search(lines[i])
            if marker is not None:
                pending_marker = marker.group("reason").strip(" :")
            elif lines[i].strip():
                pending_marker = None
            i += 1
            continue
        fence, indent = match.group("fence"), match.group("indent")
        info = match.group("info").strip().split(" ")[0].lower()
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j])
            j += 1
        block = Block(page, i + 1, info, textwrap.dedent("\n".join(body)) + "\n", pending_marker)
        follows = all(not s.strip() for s in lines[last_closed + 1 : i])
        if info in ("text", "output") and out and out[-1].info in ("python", "py") and follows:
            out[-1].output = block.code
        else:
            out.append(block)
        pending_marker = None
        last_closed = j
        i = j + 1
    return out


def _python(page: pathlib.Path) -> list[Block]:
    return [b for b in blocks(page) if b.info in ("python", "py")]


def _rel(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


@contextlib.contextmanager
def _aot_eager_compile() -> Iterator[None]:
    original = torch.compile

    @functools.wraps(original)
    def compile_(model: Any = None, **kwargs: Any) -> Any:
        kwargs.setdefault("backend", "aot_eager")
        if model is None:
            return lambda fn: original(fn, **kwargs)
        return original(model, **kwargs)

    torch.compile = compile_  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.compile = original


def _normalized(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


RUNNABLE = [p for p in PAGES if any(b.no_test is None for b in _python(p))]


@pytest.mark.slow
@pytest.mark.parametrize("page", RUNNABLE, ids=_rel)
def test_every_python_block_of_the_page_runs_and_prints_what_it_shows(
    page: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    torch.manual_seed(0)
    random.seed(0)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with _aot_eager_compile():
            for block in _python(page):
                if block.no_test is not None:
                    continue
                where = f"{_rel(page)}:{block.line}"
                stdout = io.StringIO()
                with contextlib.redirect_stdout(stdout):
                    exec(compile(block.code, where, "exec"), namespace)
                if block.output is not None:
                    assert _normalized(stdout.getvalue()) == _normalized(block.output), where
    finally:
        os.chdir(cwd)
        torch._dynamo.reset()


def test_every_no_test_marker_gives_a_reason_and_marks_a_python_block() -> None:
    marked = [b for p in PAGES for b in blocks(p) if b.no_test is not None]
    for block in marked:
        assert block.no_test, f"{_rel(block.page)}:{block.line}: <!-- no-test: REASON -->"
        assert block.info in ("python", "py"), f"{_rel(block.page)}:{block.line}"
    runnable = sum(b.no_test is None for p in PAGES for b in _python(p))
    assert len(marked) < runnable  # sparingly


def test_the_block_parser_finds_markers_and_outputs(tmp_path: pathlib.Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# t\n\n<!-- no-test: needs two ranks -->\n```python\nimport x\n```\n\n"
        "```python\nprint(1)\n```\n\n```text\n1\n```\n\nProse.\n\n```text\nnot output\n```\n"
        "- item:\n\n  ```python\n  y = 2\n  ```\n"
    )
    found = blocks(page)
    assert [(b.info, b.no_test, b.output) for b in found] == [
        ("python", "needs two ranks", None),
        ("python", None, "1\n"),
        ("text", None, None),
        ("python", None, None),
    ]
    assert found[-1].code == "y = 2\n"
