"""The observers behind `famp.explain`: a dispatch mode, module hooks and a profile function.

`Recorder` records each aten op that reaches dispatch with its dtypes, the module path running it
(from global module hooks) and the torch function called from Python that encloses it (from
`sys.setprofile`); `Recorder.records` turns them into `famp.OpRecord`s with each op's rule.
`explain.py`'s docstring says what "rule" means at dispatch level.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Sequence
from typing import Any

import optree
import torch

from famp._autocast.defaults import default_rules
from famp._autocast.ops import overloads
from famp._autocast.policy import Policy
from famp._autocast.rules import OpRules
from famp._autocast.trace import OpRecord
from famp._compat import TorchDispatchMode, op_schema, overload_name

LOWER = (torch.float16, torch.bfloat16)
"""The compute dtypes for which autocast is on."""


def _is_torch_builtin(func: Any) -> bool:
    owner = getattr(func, "__self__", None)
    if isinstance(owner, torch.Tensor):
        return True
    module = getattr(func, "__module__", None) or getattr(owner, "__name__", None) or ""
    return isinstance(module, str) and module.startswith("torch")


@dataclasses.dataclass
class _Call:
    name: str  # the builtin's name
    enabled: bool  # autocast on for the device where it was called
    scoped: bool  # inside a module a module rule matches
    func: Any = None  # the builtin, or the Python function's frame
    overload: str | None = None  # the overload of a same-named op seen inside


@dataclasses.dataclass
class _Raw:
    func: Any
    module: str
    call: _Call | None
    enabled: bool
    scoped: bool
    in_dtypes: tuple[torch.dtype, ...]
    out_dtypes: tuple[torch.dtype, ...]


def _dtypes(tree: Any) -> tuple[torch.dtype, ...]:
    # An aten op's arguments or results: lists, tuples, dicts and torch's structseqs of tensors.
    return tuple(x.dtype for x in optree.tree_leaves(tree) if isinstance(x, torch.Tensor))


class Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records the aten ops of one `famp.explain` call, with their modules and enclosing calls."""

    def __init__(
        self,
        device_type: str,
        base: tuple[bool, torch.dtype],
        module_rules: Sequence[tuple[str, Policy]],
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.device_type = device_type
        self.base = base
        self.module_rules = module_rules
        self.raw: list[_Raw] = []
        self.calls: list[_Call] = []  # the torch builtins running, outermost first
        self.modules: list[tuple[str, bool | None]] = []  # (path, autocast on if scoped)
        self.paths: dict[torch.nn.Module, str] = {}

    # dispatch: every aten op
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        call = self.governing()
        packet = op_schema(func).name.partition("::")[2]
        if call is not None and call.overload is None and packet == call.name:
            call.overload = overload_name(func)
        module, scope = self.modules[-1] if self.modules else ("", None)
        enabled = scope if scope is not None else torch.is_autocast_enabled(self.device_type)
        if call is None and scope is None and not enabled:
            enabled = self.base[0]  # inside a C++ wrapper that torch's autocast entered
        self.raw.append(
            _Raw(
                func,
                module,
                call,
                enabled,
                scope is not None,
                _dtypes((args, kwargs)),
                _dtypes(out),
            )
        )
        return out

    # module hooks: the module path stack
    def pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        if module not in self.paths:
            parent = self.modules[-1][0] if self.modules else ""
            for path, sub in module.named_modules(remove_duplicate=False):
                full = ".".join(p for p in (parent, path) if p)
                self.paths.setdefault(sub, full)
        path = self.paths[module]
        scope = self.modules[-1][1] if self.modules else None
        for pattern, policy in self.module_rules:
            if fnmatch.fnmatchcase(path, pattern):
                scope = policy.compute_dtype in LOWER
                break
        self.modules.append((path, scope))

    def post_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.modules:
            self.modules.pop()

    # profile function: the torch functions called from Python
    def profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "c_call":
            if _is_torch_builtin(arg):
                self._push(getattr(arg, "__name__", ""), arg)
        elif event == "call":
            if frame.f_globals is _F_GLOBALS or frame.f_globals is _FUNCTIONAL_GLOBALS:
                self._push(frame.f_code.co_name, frame)
        elif event == "return":
            if self.calls and self.calls[-1].func is frame:
                self.calls.pop()
        elif event in ("c_return", "c_exception") and self.calls and self.calls[-1].func == arg:
            # Equal, not the same object: from Python 3.12 (profiling through sys.monitoring), a
            # method called on its instance, `Tensor._is_view(t)`, arrives as a new bound method
            # at each event, equal to the one of its call.
            self.calls.pop()

    def _push(self, name: str, key: Any) -> None:
        scope = self.modules[-1][1] if self.modules else None
        enabled = scope if scope is not None else torch.is_autocast_enabled(self.device_type)
        self.calls.append(_Call(name, enabled, scope is not None, key))

    def governing(self) -> _Call | None:
        """The outermost running torch call named like an aten op: its rule is the op's."""
        for call in self.calls:
            if overloads(call.name) is not None:
                return call
        return None

    def records(self, rules: OpRules) -> list[OpRecord]:
        defaults = default_rules(rules.device_type)
        out: list[OpRecord] = []
        for raw in self.raw:
            packet = op_schema(raw.func).name.partition("::")[2]
            own = (packet, overload_name(raw.func))
            call = raw.call
            if call is not None:
                key = (call.name, call.overload or _overload_of(rules, call.name))
                enabled, name = call.enabled, call.name
            else:
                key, enabled, name = own, raw.enabled, ""
            rule = rules.lookup(*key) if enabled else None
            if rules.lookup(*key) != defaults.lookup(*key):
                source = "override"
            elif raw.scoped or (call is not None and call.scoped):
                source = "module"
            else:
                source = "default"
            out.append(
                OpRecord(
                    str(raw.func), raw.module, rule, source, raw.in_dtypes, raw.out_dtypes, name
                )
            )
        return out


def _overload_of(rules: OpRules, packet: str) -> str:
    """An overload that stands for a packet called from Python: any, if all share one rule."""
    names = overloads(packet) or ("default",)
    found = {rules.lookup(packet, o) for o in names if not o.endswith("out")}
    if len(found) == 1 or "default" in names:
        return "default" if "default" in names else names[0]
    return names[0]


# torch's Python functions that take part in torch function handling (F.layer_norm, F.softmax):
# famp.autocast may apply an override to the whole call, so they count as calls of their op.
_F_GLOBALS = vars(torch.nn.functional)
_FUNCTIONAL_GLOBALS = vars(torch.functional)
