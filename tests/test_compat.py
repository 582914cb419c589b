"""Private torch names live in famp/_compat.py only, each with the reason it is needed."""

from __future__ import annotations

import io
import pathlib
import re
import tokenize

import pytest

import famp._compat

FAMP = pathlib.Path(famp._compat.__file__).resolve().parent

# What counts as a private torch name in code: a `torch.<...>._name` attribute path, an import
# from a private torch module or of a private name, optree's private registry constant, and the
# private tensor attributes famp once used (`._version`, `._is_view`, FSDP1's `._handle`).
_PRIVATE = re.compile(
    r"torch(\.\w+)*\._(?!_)\w+"
    r"|from\s+torch[\w.]*\s+import\s+.*\b_\w+"
    r"|import\s+torch[\w.]*\._\w+"
    r"|__GLOBAL_NAMESPACE"
    r"|\._(version|is_view|handle|fwd_bwd_param_dtype|use_orig_params)\b"
)


def _code_lines(path: pathlib.Path) -> list[tuple[int, str]]:
    """The file's code with strings and comments blanked out, one entry per logical line."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    lines: dict[int, list[str]] = {}
    for tok in tokens:
        if tok.type in (tokenize.STRING, tokenize.COMMENT):
            continue
        if tok.type == getattr(tokenize, "FSTRING_START", None):
            continue
        lines.setdefault(tok.start[0], []).append(tok.string)
    return [(n, "".join(parts)) for n, parts in sorted(lines.items())]


@pytest.mark.parametrize(
    "path",
    sorted(p for p in FAMP.rglob("*.py") if p.name != "_compat.py"),
    ids=lambda p: str(p.relative_to(FAMP)),
)
def test_no_private_torch_name_outside_the_compat_module(path: pathlib.Path) -> None:
    found = [f"{path.name}:{n}: {code}" for n, code in _code_lines(path) if _PRIVATE.search(code)]
    assert found == [], "private torch names belong in famp/_compat.py:\n" + "\n".join(found)


def test_the_scan_finds_what_it_looks_for() -> None:
    """The pattern is not vacuous: it flags each kind of private use famp once had."""
    for code in (
        "torch._C._are_functorch_transforms_active()",
        "from torch.utils import _pytree",
        "import torch.utils._pytree as p",
        "t._version",
        "getattr(optree.registry, '__GLOBAL_NAMESPACE')",
        "module._handle",
        "torch.nn.modules.module._global_forward_hooks",
    ):
        assert _PRIVATE.search(code), code
    for code in (
        "torch.__version__",
        "torch.compile(f)",
        "torch.autocast('cpu')",
        "self._calls",
        "x.is_leaf",
    ):
        assert not _PRIVATE.search(code), code


def test_every_private_name_in_the_compat_module_says_why() -> None:
    """Each top-level definition of famp/_compat.py has a comment or docstring next to it."""
    source = (FAMP / "_compat.py").read_text().splitlines()
    for i, line in enumerate(source):
        if re.match(r"^(def |[A-Za-z_]\w*(: [^=]+)? = )", line):
            context = source[max(0, i - 4) : i + 3]
            assert any(s.strip().startswith(("#", '"""')) or "#" in s for s in context), (
                f"famp/_compat.py:{i + 1}: {line.strip()} has no reason next to it"
            )


def test_a_dynamo_without_the_overridable_set_gets_a_warning_not_silence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Should a torch move Dynamo's set of functions it hands to modes, compiled overrides could
    miss ops again: famp says so (a RuntimeWarning naming the docs) instead of going on."""
    import sys

    monkeypatch.setitem(sys.modules, "torch._dynamo.variables.torch", None)  # import fails
    with pytest.warns(RuntimeWarning, match=r"compiled, overrides may miss ops"):
        assert famp._compat.modes_see_every_binding() is False
