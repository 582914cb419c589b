"""`famp.explain`: every aten op a `famp.autocast` call runs, with its dtypes and its rule.

The function runs exactly as `famp.autocast(fn, policy, ..., compile=False)` runs it; three
observers watch it, none of which changes what runs:

- a `TorchDispatchMode` records each aten op that reaches dispatch, with its tensor arguments'
  and results' dtypes (the ops `torch.autocast` and a dispatch-mode logger see: the `_to_copy`
  casts that autocast inserts, and the pieces of composite ops, never the composite itself);
- global module forward hooks keep the stack of modules running, for each op's module path;
- a profile function (`sys.setprofile`) sees each call of a torch builtin from Python code
  (`F.linear`, `torch.conv2d`, `x.softmax`), the level where autocast's rules apply.

**What "rule" means at dispatch level.** Autocast's rule applies to the op called from Python:
torch's C++ wrapper for `linear` casts the inputs (the `_to_copy` ops) and runs `linear`'s
pieces (`t`, `addmm`) with autocast off, so each of them is governed by `linear`'s rule. A
record's `rule` is therefore the rule, in the call's table, of the outermost torch builtin
called from Python that encloses the op (`call` names it); an op reached without one (Python
operators such as `a @ b` and `a + b`, which are not profiled calls) gets its own aten
overload's rule, and so does an op inside a builtin that is not an aten op (the backward pass,
run by `torch.autograd`'s engine). Two blind spots follow, where the dtypes tell the truth and
the rule does not: the casts autocast makes for an operator (`a @ b`) show `"keep"` (`mm`
itself shows `"lower"`), and the ops that another op's C++ implementation calls through their
own autocast wrappers (the linears inside `_VF.gru` and `lstm_cell`) show the outer op's
rule (`"keep"`), although torch casts them. `rule` is `None` where autocast is off for the
device (a float32 compute dtype, a module rule computing in float32, the function's own
`torch.autocast(enabled=False)`, the output cast after the autocast region). `source` is
`"override"` where the call's rules give the op another rule than the device's defaults, else
`"module"` inside a module that a module rule matches, else `"default"`.

Deliberately not supported: compiled execution (a compiled graph runs no aten ops one by one:
explain always runs eagerly), and threads other than the caller's (the profile function is the
calling thread's; `sys.setprofile` users such as `cProfile` are suspended meanwhile).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, overload

import torch
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)

from famp._autocast.defaults import default_rules
from famp._autocast.policy import Policy, get_policy
from famp._autocast.rules import OpRules
from famp._compat import TorchDispatchMode, torch_pytree

_LOWER = (torch.float16, torch.bfloat16)
_SHORT = {
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float32: "f32",
    torch.float64: "f64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.bool: "bool",
}


def _short(dtype: torch.dtype | None) -> str:
    if dtype is None:
        return "-"
    return _SHORT.get(dtype, str(dtype).removeprefix("torch."))


@dataclasses.dataclass(frozen=True)
class OpRecord:
    """One aten op that ran inside a `famp.explain` call.

    Attributes:
        op: The aten overload, such as `"aten.mm.default"`.
        module: The path of the innermost `nn.Module` running it, relative to the outermost
            module the call entered (`""` outside any module, the backward pass included).
        rule: The famp rule governing it (see `famp.explain`), or `None` where autocast is off.
        source: `"default"`, `"override"` (the call's `rules` differ from the defaults
            here) or `"module"` (a module rule's policy governs it).
        in_dtypes: The dtypes of its tensor arguments, in order.
        out_dtypes: The dtypes of its tensor results, in order.
        call: The torch function called from Python whose rule governs the op (`"linear"`),
            or `""` when the op's own rule applies.
    """

    op: str
    module: str
    rule: str | None
    source: str
    in_dtypes: tuple[torch.dtype, ...]
    out_dtypes: tuple[torch.dtype, ...]
    call: str = ""


class Trace(Sequence[OpRecord]):
    """The ops one `famp.explain` call ran, in order: a sequence of `famp.OpRecord`.

    Examples:
        >>> import famp, torch
        >>> lin = torch.nn.Linear(4, 2)
        >>> out, trace = famp.explain(lin, "c=bf16")(torch.randn(3, 4))
        >>> [(r.op, r.rule, r.out_dtypes) for r in trace][:2]
        [('aten._to_copy.default', 'lower', (torch.bfloat16,)), \
('aten._to_copy.default', 'lower', (torch.bfloat16,))]
    """

    def __init__(self, records: Sequence[OpRecord]) -> None:
        self._records = tuple(records)

    @overload
    def __getitem__(self, index: int) -> OpRecord: ...
    @overload
    def __getitem__(self, index: slice) -> Trace: ...
    def __getitem__(self, index: int | slice) -> OpRecord | Trace:
        if isinstance(index, slice):
            return Trace(self._records[index])
        return self._records[index]

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[OpRecord]:
        return iter(self._records)

    def __repr__(self) -> str:
        return f"Trace({len(self)} ops)"

    def table(self, module: str | None = None) -> str:
        """The trace as a table for a terminal: one row per op.

        Args:
            module: Only the ops of this module and its submodules (a path prefix); `None`: all.

        Returns:
            The table as text: op, module, call, rule, source, input and output dtypes.

        Examples:
            >>> import famp, torch
            >>> lin = torch.nn.Linear(4, 2)
            >>> _, trace = famp.explain(lin, "c=bf16")(torch.randn(3, 4))
            >>> print(trace.table())
            #  op                     module  call    rule   source   in           out
            0  aten._to_copy.default          linear  lower  default  f32          bf16
            1  aten._to_copy.default          linear  lower  default  f32          bf16
            2  aten._to_copy.default          linear  lower  default  f32          bf16
            3  aten.t.default                 linear  lower  default  bf16         bf16
            4  aten.addmm.default             linear  lower  default  bf16 bf16 bf16  bf16
        """
        rows = [("#", "op", "module", "call", "rule", "source", "in", "out")]
        for i, r in enumerate(self._records):
            if module is not None and not (
                r.module == module or r.module.startswith(module + ".") or not module
            ):
                continue
            rows.append(
                (
                    str(i),
                    r.op,
                    r.module,
                    r.call,
                    str(r.rule) if r.rule is not None else "-",
                    r.source,
                    " ".join(map(_short, r.in_dtypes)),
                    " ".join(map(_short, r.out_dtypes)),
                )
            )
        widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
        return "\n".join(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in rows
        )

    def counts(self) -> dict[tuple[str | None, torch.dtype | None], int]:
        """How many ops ran per (rule, first output dtype), in order of first appearance.

        Returns:
            `{(rule, dtype): count}`; the dtype is `None` for ops without a tensor result.

        Examples:
            >>> import famp, torch
            >>> _, trace = famp.explain(torch.nn.Linear(4, 2), "c=bf16")(torch.randn(3, 4))
            >>> trace.counts()
            {('lower', torch.bfloat16): 5}
        """
        out: dict[tuple[str | None, torch.dtype | None], int] = {}
        for r in self._records:
            key = (r.rule, r.out_dtypes[0] if r.out_dtypes else None)
            out[key] = out.get(key, 0) + 1
        return out

    def summary(self) -> str:
        """`counts()` as a short table for a terminal.

        Returns:
            One line per (rule, output dtype): the number of ops.

        Examples:
            >>> import famp, torch
            >>> _, trace = famp.explain(torch.nn.Linear(4, 2), "c=bf16")(torch.randn(3, 4))
            >>> print(trace.summary())
            rule   out   ops
            lower  bf16  5
        """
        rows = [("rule", "out", "ops")] + [
            (str(rule) if rule is not None else "-", _short(dtype), str(n))
            for (rule, dtype), n in self.counts().items()
        ]
        widths = [max(len(row[c]) for row in rows) for c in range(3)]
        return "\n".join(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in rows
        )


# --- recording ------------------------------------------------------------------------------------


@functools.cache
def _aten_overloads(name: str) -> tuple[str, ...] | None:
    """The overloads of `torch.ops.aten.<name>`, or None if there is no such op."""
    if not name.isidentifier():
        return None
    try:
        return tuple(getattr(torch.ops.aten, name).overloads())
    except (AttributeError, RuntimeError):
        return None


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
    return tuple(x.dtype for x in torch_pytree.tree_leaves(tree) if isinstance(x, torch.Tensor))


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
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
        packet = func._schema.name.partition("::")[2]
        if call is not None and call.overload is None and packet == call.name:
            call.overload = func._overloadname
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
                scope = policy.compute_dtype in _LOWER
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
        elif (
            event in ("c_return", "c_exception", "return")
            and self.calls
            and self.calls[-1].func is (frame if event == "return" else arg)
        ):
            self.calls.pop()

    def _push(self, name: str, key: Any) -> None:
        scope = self.modules[-1][1] if self.modules else None
        enabled = scope if scope is not None else torch.is_autocast_enabled(self.device_type)
        self.calls.append(_Call(name, enabled, scope is not None, key))

    def governing(self) -> _Call | None:
        """The outermost running torch call named like an aten op: its rule is the op's."""
        for call in self.calls:
            if _aten_overloads(call.name) is not None:
                return call
        return None

    def records(self, rules: OpRules) -> list[OpRecord]:
        defaults = default_rules(rules.device_type)
        out: list[OpRecord] = []
        for raw in self.raw:
            packet = raw.func._schema.name.partition("::")[2]
            own = (packet, raw.func._overloadname)
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
    overloads = _aten_overloads(packet) or ("default",)
    found = {rules.lookup(packet, o) for o in overloads if not o.endswith("out")}
    if len(found) == 1 or "default" in overloads:
        return "default" if "default" in overloads else overloads[0]
    return overloads[0]


# torch's Python functions that take part in torch function handling (F.layer_norm, F.softmax):
# famp.autocast may apply an override to the whole call, so they count as calls of their op.
_F_GLOBALS = vars(torch.nn.functional)
_FUNCTIONAL_GLOBALS = vars(torch.functional)


def _infer_device(args: Any) -> str:
    types = {x.device.type for x in torch_pytree.tree_leaves(args) if isinstance(x, torch.Tensor)}
    accelerators = sorted(types - {"cpu", "meta"})
    return accelerators[0] if accelerators else "cpu"


def explain(
    fn: Callable[..., Any], policy: Policy | str, **autocast_kwargs: Any
) -> Callable[..., tuple[Any, Trace]]:
    """Run a function as `famp.autocast` would, and say what each aten op did and why.

    The returned function takes `fn`'s arguments, runs `fn` exactly as
    `famp.autocast(fn, policy, **autocast_kwargs)` runs it eagerly (same ops, same results, bit
    for bit) and returns `(output, trace)`. `trace` is a `famp.Trace`: one
    `famp.OpRecord` per aten op that ran, in order, with its overload, the innermost module
    running it, the famp rule that governed it and where that rule came from, and its input and
    output dtypes. The ops and dtypes are those a `TorchDispatchMode` logs under
    `torch.autocast` (the casts autocast inserts are `aten._to_copy` ops; composite ops
    appear as their pieces). An op's rule is that of the torch function called from Python that
    encloses it (the `addmm` inside `F.linear` runs under `linear`'s rule); the module
    docstring of `famp._autocast.explain` spells out the cases. Explain always runs eagerly: a
    compiled graph has no per-op dispatch to watch.

    Args:
        fn: The function (or module) to run.
        policy: A `famp.Policy` or a `famp.get_policy` string.
        **autocast_kwargs: `famp.autocast`'s keyword arguments (`device_type`, `rules`,
            `module_rules`, `track_casts`); `compile` may only be `False` or `None`.

    Returns:
        A function with `fn`'s arguments returning `(fn's output as famp.autocast returns it,
        trace)`.

    Raises:
        ValueError: `compile=True`; and every error `famp.autocast` raises for its arguments.
        TypeError: As `famp.autocast`.

    Examples:
        >>> import famp, torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        >>> rules = famp.default_rules("cpu").override({"layer_norm": "float32"})
        >>> out, trace = famp.explain(model, "c=bf16,o=f32", rules=rules)(torch.randn(2, 4))
        >>> out.dtype
        torch.float32
        >>> sorted({(r.module, r.call, r.rule, r.source) for r in trace})
        [('0', 'linear', 'lower', 'default'), ('1', 'layer_norm', 'float32', 'override')]
    """
    compile_ = autocast_kwargs.pop("compile", None)
    if compile_ not in (None, False):
        raise ValueError(
            f"compile must be False or None: explain watches eager ops; got {compile_!r}"
        )
    import famp  # famp.autocast, through its public name (its modules are free to move)

    transformed = famp.autocast(fn, policy, compile=False, **autocast_kwargs)
    policy = get_policy(policy)
    base = (policy.compute_dtype in _LOWER, policy.compute_dtype)
    rules: OpRules | None = autocast_kwargs.get("rules")
    device_type: str | None = autocast_kwargs.get("device_type")
    module_rules: Mapping[str, Policy | str] = autocast_kwargs.get("module_rules") or {}
    scopes = [(pattern, get_policy(p)) for pattern, p in module_rules.items()]

    @functools.wraps(fn)
    def explained(*args: Any, **kwargs: Any) -> tuple[Any, Trace]:
        dev = device_type or (rules.device_type if rules is not None else None)
        dev = dev or _infer_device((args, kwargs))
        recorder = _Recorder(dev, base, scopes)
        pre = register_module_forward_pre_hook(recorder.pre_hook)
        post = register_module_forward_hook(recorder.post_hook, always_call=True)
        previous = sys.getprofile()
        try:
            with recorder:
                sys.setprofile(recorder.profile)
                try:
                    out = transformed(*args, **kwargs)
                finally:
                    sys.setprofile(previous)
        finally:
            pre.remove()
            post.remove()
        return out, Trace(recorder.records(rules or default_rules(dev)))

    return explained
