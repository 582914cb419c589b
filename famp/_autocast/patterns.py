"""Module rules' patterns: which module paths they match, and the warnings for those that match
none and for keyword inputs left uncast (`famp.AutocastWarning`)."""

from __future__ import annotations

import difflib
import fnmatch
import functools
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from famp._autocast.policy import Policy, get_policy
from famp._autocast.tree_casts import CASTABLE
from famp._compat import assume_constant_result, compiled_module_type
from famp._compat import torch_pytree as pytree


class AutocastWarning(UserWarning):
    """Warned by a `famp.autocast` call whose rules may not do what they say.

    Raised once per transformed function and cause: for module rules that matched no module path
    in a call (typically a wrapper's prefix: `module.` for `DistributedDataParallel`,
    `_fsdp_wrapped_module.` for FSDP1), for op overrides left out of torch's inference fast
    path, for op overrides and module rules that cannot reach inside a TorchScript module, and
    for the keyword inputs of a matched TorchScript module or of a matched root module reached
    otherwise than as the transformed function itself (`torch.func.functional_call`), which no
    hook reaches and its compute dtype would have cast. Filter it as any warning:
    `warnings.filterwarnings("ignore", category=famp.AutocastWarning)`.
    """


@functools.lru_cache(maxsize=1 << 16)
def _hits(patterns: tuple[str, ...], path: str) -> tuple[int, ...]:
    """The indices of the glob patterns that match a module path. A pure function of its
    arguments, kept: fnmatch's regular expression costs most of a microsecond a pattern, and
    each call with module rules matches every module path (242 modules, 2 patterns: ~0.4 ms)."""
    return tuple(i for i, pattern in enumerate(patterns) if fnmatch.fnmatchcase(path, pattern))


def _first_match(patterns: tuple[str, ...], path: str) -> int:
    """Index of the first glob pattern that matches a module path, or -1."""
    hits = _hits(patterns, path)
    return hits[0] if hits else -1


# Dynamo cannot trace `re`; the match is a constant of the (constant) patterns and path.
match: Callable[[tuple[str, ...], str], int] = assume_constant_result(_first_match)


def module_paths(root: torch.nn.Module, unique: bool = True) -> list[tuple[str, torch.nn.Module]]:
    """`root.named_modules()` with `torch.compile(module)`'s wrappers see-through: the modules of
    a compiled submodule `2` are `2`, `2.0`, ..., not `2._orig_mod`, `2._orig_mod.0` (as a compiled
    root's paths are the model's own); the wrapper, which famp passes over, keeps `2`. `unique`:
    a module held twice once, as `named_modules`'s `remove_duplicate`."""
    named = list(root.named_modules(remove_duplicate=unique))
    kind = compiled_module_type()
    wrappers = sorted((p for p, m in named if isinstance(m, kind)), key=len, reverse=True)
    if not wrappers:
        return named
    found = []
    for path, module in named:
        for wrapper in wrappers:  # the innermost first
            inner = f"{wrapper}._orig_mod" if wrapper else "_orig_mod"
            if path == inner or path.startswith(inner + "."):
                rest = path[len(inner) :]
                path = wrapper + rest if wrapper else rest[1:]
        found.append((path, module))
    return found


def rule_paths(root: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """`module_paths(root)` that module rules may match: not those that compute a parametrized
    weight (`torch.nn.utils.parametrize`), each `ParametrizationList` and the modules under it.
    Their input is the master parameter, which a scope's input cast would cast (NaN gradients
    through `orthogonal` in float16); they run in the scope of the module that reads the weight,
    as under `torch.autocast` around that module."""
    paths = module_paths(root, unique=False)  # a module held twice: a rule may name either path
    lists = [p for p, m in paths if isinstance(m, torch.nn.utils.parametrize.ParametrizationList)]
    if not lists:
        return paths
    return [(p, m) for p, m in paths if not any(p == t or p.startswith(t + ".") for t in lists)]


MatchedTree = tuple[dict[int, Any], list[torch.nn.Module], list[tuple[str, torch.nn.Module]]]


def match_tree(
    root: torch.nn.Module, patterns: tuple[str, ...], policies: tuple[Any, ...]
) -> MatchedTree:
    """The module rules `patterns` (with their `policies`) over the tree of `root`: each module's
    policy by id (None where no rule matches), the modules below `root` a rule matches that a
    hook of their own can be given (not a compiled wrapper, not a TorchScript module, which
    refuses Python hooks), and `rule_paths(root)`."""
    by_id: dict[int, Any] = {}
    named: dict[int, str] = {}  # the path whose rule a module held under several paths took
    matched, wrapper = [], compiled_module_type()
    paths = rule_paths(root)
    for path, sub in paths:  # one loop: Dynamo traces each pass over the tree
        i = match(patterns, path)
        policy = policies[i] if i >= 0 else None
        if by_id.get(id(sub)) is not None:  # one module, several paths: their rules agree
            if policy is not None and policy != by_id[id(sub)]:
                raise ValueError(
                    f"module_rules give one module, held under the paths {named[id(sub)]!r} and "
                    f"{path!r}, two policies: {by_id[id(sub)]} and {policy}"
                )
            continue
        by_id[id(sub)], named[id(sub)] = policy, path
        if (
            policy is not None
            and sub is not root
            and not isinstance(sub, (wrapper, torch.jit.ScriptModule))
        ):
            matched.append(sub)
    return by_id, matched, paths


def warn_unmatched(patterns: tuple[str, ...], paths: list[str]) -> bool:
    """Warn about the module rules that matched none of a call's module `paths`, naming the
    nearest paths; whether it warned."""
    matched = {i for path in set(paths) for i in _hits(patterns, path)}
    unmatched = [p for i, p in enumerate(patterns) if i not in matched]
    if not unmatched:
        return False
    known = sorted(set(paths))
    lines = []
    for pattern in unmatched:
        near = [p for p in known if fnmatch.fnmatchcase(p, "*." + pattern)]
        near = near or difflib.get_close_matches(pattern, known, n=3, cutoff=0.0)
        lines.append(f"{pattern!r} (nearest module paths: {', '.join(map(repr, near[:3]))})")
    if not known:
        lines = [f"{p!r} (no module was called)" for p in unmatched]
    warnings.warn(
        "famp.autocast: module_rules matched no module in this call: "
        + "; ".join(lines)
        + ". Paths are relative to the outermost module called; a wrapper adds a prefix "
        "(DistributedDataParallel 'module.', FSDP1 '_fsdp_wrapped_module.'; not "
        "torch.compile(module), whose paths are the module's): write the pattern for the "
        "wrapped model ('module.head') or with a leading '*' ('*head').",
        AutocastWarning,
        stacklevel=4,
    )
    return True


def warn_uncast_keywords(
    record: Any, module: torch.nn.Module, kwargs: dict[str, Any], dtype: torch.dtype
) -> None:
    """Warn, as `record`'s call leaves `module`, if a cast to the compute `dtype` would change a
    tensor of keyword inputs `kwargs` of that matched module that famp left as given: a root
    (no scope left in `record`) reached otherwise than as the transformed function, whose call
    had begun when famp found it, or a TorchScript module, which refuses Python hooks of its own
    (keywords.py); not a module that writes into its input. Once it has warned, `"keywords"` is
    in the transform's causes warned."""
    warned = record.transform.warned
    unreached = not record.scopes or isinstance(module, torch.jit.ScriptModule)
    if not unreached or module.__dict__.get("inplace") is True or "keywords" in warned:
        return
    names = [
        name
        for name, value in kwargs.items()
        if any(
            isinstance(leaf, torch.Tensor) and leaf.dtype in CASTABLE and leaf.dtype != dtype
            for leaf in pytree.tree_leaves(value)
        )
    ]
    if not names:
        return
    warned.add("keywords")
    warnings.warn(
        f"famp.autocast: the keyword inputs {', '.join(map(repr, names))} of "
        f"{module_path(record.held, module)} are not "
        f"cast to its compute dtype {dtype} (its positional inputs are): no hook of famp's reaches "
        "them (a TorchScript module, or the outermost module of the call reached otherwise than "
        "as the transformed function, whose call has begun when famp finds it); the ops inside "
        "take them as given. Pass them by position, transform the module itself "
        "(famp.autocast(module, ...)), or cast them (famp.cast_to_compute) to have them cast.",
        AutocastWarning,
        stacklevel=2,
    )


def module_path(roots: list[torch.nn.Module], module: torch.nn.Module) -> str:
    """How a warning names `module`: its path under the first of `roots` that holds it."""
    for root in roots:
        for path, sub in module_paths(root, unique=False):
            if sub is module:
                return f"the module {path!r} ({type(module).__name__})"
    return f"a {type(module).__name__} module"


def module_policies(rules: Iterable[tuple[str, Policy | str]]) -> tuple[Policy, ...]:
    """`module_rules`' policies; an error names the pattern whose policy `get_policy` refuses."""
    policies = []
    for pattern, spec in rules:
        try:
            policies.append(get_policy(spec))
        except (TypeError, ValueError) as e:
            raise type(e)(f"module_rules[{pattern!r}]: {e}") from None
    return tuple(policies)
