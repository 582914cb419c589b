"""The observers behind `famp.explain`: a dispatch mode, module hooks and a profile function.

`Recorder` records each aten op that reaches dispatch with its dtypes, the module path running it
(from global module hooks) and the torch function called from Python that encloses it (from
`sys.setprofile`); `Recorder.records` turns them into `famp.OpRecord`s with each op's rule.
`explain.py`'s docstring says what "rule" means at dispatch level.

The rule in effect is famp.autocast's own: the rules, module scope and autocast state of the
innermost `famp.autocast` call running (`recompute.calls()`, a nested call's own), read as
`CallRecord.run_op` reads them. Autocast's state at dispatch level is not the Python code's: inside
torch's C++ autocast wrappers (`mm`'s, reached from `x @ w`) it reads as off. So the state the
Python code set is kept from the profile function, at each return of a `torch.set_autocast_*`
setter (`torch.autocast`'s and famp's regions call them), and an op that reads autocast as off
while the Python code had it on is inside a wrapper.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import optree
import torch

from famp._autocast.call import CallRecord
from famp._autocast.defaults import default_rules
from famp._autocast.op_calls import op_name
from famp._autocast.ops import overloads
from famp._autocast.patterns import module_paths
from famp._autocast.recompute import calls
from famp._autocast.rules import OpRules
from famp._autocast.tables import DISPATCH_KEYS, registered_ops
from famp._autocast.trace import OpRecord
from famp._compat import (
    TorchDispatchMode,
    autocast_key_excluded,
    forward_hooks,
    graph_task,
    op_schema,
    overload_name,
)


def _is_torch_builtin(func: Any) -> bool:
    owner = getattr(func, "__self__", None)
    if isinstance(owner, torch.Tensor):
        return True
    module = getattr(func, "__module__", None) or getattr(owner, "__name__", None) or ""
    return isinstance(module, str) and module.startswith("torch")


@dataclasses.dataclass(frozen=True)
class _Effect:
    """What governs an op where it runs, as the innermost `famp.autocast` call decides it."""

    enabled: bool  # autocast on for the device
    scoped: bool  # inside a module that one of the call's module rules matches
    rules: OpRules | None  # the call's rules; None outside every famp.autocast call


@dataclasses.dataclass
class _Call:
    name: str  # the builtin's name
    effect: _Effect  # where it was called
    func: Any = None  # the builtin, or the Python function's frame
    overload: str | None = None  # the overload of a same-named op seen inside
    autocast: bool = False  # autocast on where it was called, and the op has no autocast kernel
    by_famp: bool = False  # famp's CallRecord.run_op: the call's rules apply inside it
    task: int = -1  # the autograd graph task it was called in (-1: none): it governs its ops


@dataclasses.dataclass
class _Raw:
    func: Any
    module: str
    call: _Call | None
    effect: _Effect | None  # where it ran, if no call governs it
    by_famp: bool  # inside famp's run_op: without, the call's rules did not apply (TorchScript)
    in_dtypes: tuple[torch.dtype, ...]
    out_dtypes: tuple[torch.dtype, ...]


def _dtypes(tree: Any) -> tuple[torch.dtype, ...]:
    # An aten op's arguments or results: lists, tuples, dicts and torch's structseqs of tensors.
    return tuple(x.dtype for x in optree.tree_leaves(tree) if isinstance(x, torch.Tensor))


class Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records the aten ops of one `famp.explain` call, with their modules and enclosing calls."""

    def __init__(self, device_type: str) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.device_type = device_type
        self.raw: list[_Raw] = []
        self.calls: list[_Call] = []  # the torch builtins running, outermost first
        self.modules: list[str] = []  # the paths of the modules running, outermost first
        self.entered: list[torch.nn.Module] = []  # those modules
        self.late: list[torch.nn.Module] = []  # modules left after their own forward hooks
        self.handles: list[Any] = []  # the hooks doing that (removed at the end, if not yet)
        self.thread = threading.get_ident()  # the calling thread: the only one recorded
        self.chained: Any = None  # the profile function of an explain this one runs inside
        # Per root (a module entered outside any other, each time it is one): its modules' paths.
        self.roots: dict[torch.nn.Module, dict[torch.nn.Module, str]] = {}
        self.paths: dict[torch.nn.Module, str] = {}  # those of the root running
        self.enabled = torch.is_autocast_enabled(device_type)  # as the Python code last set it
        self.key = DISPATCH_KEYS.get(device_type)  # torch's autocast dispatch key for the device
        self.wrapped = {p for p, _ in registered_ops(device_type)} if self.key else set()

    def effect(self, enabled: bool) -> _Effect:
        """What governs an op here, autocast being `enabled` for the device at Python level: the
        innermost famp.autocast call's rules and module scope, as `CallRecord.run_op` reads them
        (a state other than the call's own is the function's `torch.autocast`: it governs)."""
        stack = calls()
        if not stack:
            return _Effect(enabled, False, None)
        record = stack[-1]
        rules = record.transform.rules or default_rules(record.device_type)
        scope = record.scopes[-1] if record.scopes else None
        if scope is None or record.device_type != self.device_type:
            return _Effect(enabled, False, rules)
        if (enabled, torch.get_autocast_dtype(self.device_type)) == record.base:
            enabled = scope[0]
        return _Effect(enabled, True, rules)

    # dispatch: every aten op
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        packet = op_schema(func).name.partition("::")[2]
        last = self.calls[-1] if self.calls else None
        if last and last.autocast and packet == last.name and self.enabled and self.key:
            # Called from Python with autocast on, by no C++ autocast wrapper (it has none): its
            # kernel's own calls (the fused transformer fast path's linears) are cast as unobserved;
            # a dispatch mode runs the op with autocast's key excluded.
            was = autocast_key_excluded(self.key, False)
            try:
                out = func(*args, **kwargs)
            finally:
                autocast_key_excluded(self.key, was)
        else:
            out = func(*args, **kwargs)
        call = self.governing()
        if call is not None and call.overload is None:
            if packet == call.name:
                call.overload = overload_name(func)
            elif overload_name(func).endswith("out"):  # a composite's out= call (`matmul`'s)
                outs = [o for o in overloads(call.name) or () if o.endswith("out")]
                call.overload = outs[0] if outs else None
        effect = None
        if call is None:
            # Off here but on in the Python code: inside a C++ autocast wrapper (`x @ w`'s mm).
            effect = self.effect(torch.is_autocast_enabled(self.device_type) or self.enabled)
        self.raw.append(
            _Raw(
                func,
                self.modules[-1] if self.modules else "",
                call,
                effect,
                any(c.by_famp for c in self.live()),
                _dtypes((args, kwargs)),
                _dtypes(out),
            )
        )
        return out

    # module hooks: the module path stack
    def pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        if threading.get_ident() != self.thread:  # global hooks: other threads' modules too
            return
        if not self.modules:  # a root, for this call of it (as famp.autocast's module rules)
            self.paths = self.roots.setdefault(module, {})
        if module not in self.paths:  # the root, or a module outside its tree called inside it
            parent = self.modules[-1] if self.modules else ""
            for path, sub in module_paths(module, unique=False):
                self.paths.setdefault(sub, ".".join(p for p in (parent, path) if p))
        self.modules.append(self.paths[module])
        self.entered.append(module)
        if forward_hooks(module):  # torch runs them after global hooks: leave after them
            depth = len(self.modules)

            def leave(left: torch.nn.Module, args: Any, output: Any) -> None:
                if threading.get_ident() == self.thread and len(self.modules) == depth:
                    handle.remove()
                    self.late.pop()
                    self._leave(left)

            self.late.append(module)
            handle = module.register_forward_hook(leave, always_call=True)
            self.handles.append(handle)

    def post_hook(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if threading.get_ident() != self.thread or (self.late and self.late[-1] is module):
            return  # another thread's module, or one left after its own hooks
        self._leave(module)

    def _leave(self, module: torch.nn.Module) -> None:
        if self.entered and self.entered[-1] is module:
            self.entered.pop()
            self.modules.pop()

    # profile function: the torch functions called from Python
    def profile(self, frame: Any, event: str, arg: Any) -> None:
        if self.chained is not None:
            self.chained(frame, event, arg)
        if event == "c_call":
            if _is_torch_builtin(arg):
                self._push(getattr(arg, "__name__", ""), arg)
        elif event == "call":
            if frame.f_globals is _F_GLOBALS or frame.f_globals is _FUNCTIONAL_GLOBALS:
                self._push(frame.f_code.co_name, frame)
            elif frame.f_code is _RUN_OP:  # famp runs an op by its rule: `x + x` too, unprofiled
                self._push(op_name(frame.f_locals["func"], memo=False)[0], frame, by_famp=True)
        elif event == "return":
            if self.calls and self.calls[-1].func is frame:
                self.calls.pop()
        elif event in ("c_return", "c_exception"):
            if event == "c_return" and getattr(arg, "__name__", "").startswith("set_autocast"):
                self.enabled = torch.is_autocast_enabled(self.device_type)
            if self.calls and self.calls[-1].func == arg:
                # Equal, not the same object: from Python 3.12 (profiling through
                # sys.monitoring), a method called on its instance, `Tensor._is_view(t)`, arrives
                # as a new bound method at each event, equal to the one of its call.
                self.calls.pop()

    def _push(self, name: str, key: Any, by_famp: bool = False) -> None:
        on = torch.is_autocast_enabled(self.device_type)
        direct = on and not by_famp and name not in self.wrapped  # see __torch_dispatch__
        call = _Call(name, self.effect(on), key, autocast=direct, by_famp=by_famp)
        call.task = graph_task()
        self.calls.append(call)

    def live(self) -> list[_Call]:
        """The calls that may govern an op here: those of its autograd graph task. A backward
        pass's ops (`loss.backward()` inside a call famp ran, a checkpoint's recomputation, its
        nested backward) are governed by no call made outside it."""
        task = graph_task()
        return [c for c in self.calls if c.task == task]

    def governing(self) -> _Call | None:
        """The outermost running torch call named like an aten op: its rule is the op's."""
        for call in self.live():
            if overloads(call.name) is not None:
                return call
        return None

    def records(self, outside: OpRules) -> list[OpRecord]:
        """The records, each op with the rules of the famp.autocast call it ran in (`outside`:
        those of the ops outside every call, such as the output cast)."""
        out: list[OpRecord] = []
        for raw in self.raw:
            call = raw.call
            effect = call.effect if call is not None else raw.effect
            assert effect is not None
            rules = effect.rules or outside
            if not raw.by_famp:  # famp's mode never ran it: torch's defaults alone applied
                rules = default_rules(rules.device_type)
            if call is not None:
                key = (call.name, call.overload or _overload_of(rules, call.name))
            else:
                packet = op_schema(raw.func).name.partition("::")[2]
                key = (packet, overload_name(raw.func))
            name = call.name if call is not None else ""
            rule = rules.lookup(*key) if effect.enabled else None
            if rules.lookup(*key) != default_rules(rules.device_type).lookup(*key):
                source = "override"
            elif effect.scoped:
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
_RUN_OP = CallRecord.run_op.__code__
