"""`famp.autocast`: autocast as a function transform, with a policy, op rules and module rules.

The transform runs `fn` inside torch's own autocast state for the device, entered with the
policy's explicit compute dtype (never the ambient one, which `torch.compile` would freeze), so
that with the default rules every op is cast by torch's C++ kernels exactly as under
`torch.autocast(device_type, dtype=policy.compute_dtype)`. `famp._autocast.mode.FampMode` adds op
overrides, module rules and fresh weight casts; `famp._autocast.region` enters autocast states;
this module owns the call records, the module hooks, device inference and compilation.
"""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
import functools
import threading
import types
import warnings
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, TypeVar

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle

from famp._autocast.mode import CastCache as _CastCache
from famp._autocast.mode import FampMode, apply_rule, overrides_for
from famp._autocast.op_calls import call, op_name, writes_first_arg
from famp._autocast.policy import Policy, get_policy
from famp._autocast.recompute import (
    calls,
    drop_abandoned_replays,
    end_of_outermost_call,
    observe,
)
from famp._autocast.region import policy_state, region
from famp._autocast.rules import OpRules
from famp._compat import (
    assume_constant_result,
    functorch_transforms_active,
    is_compiled_module,
    is_view,
    no_torch_function,
    saved_tensors_hooks_top,
    tensor_version,
    torch_function_modes,
    traced_module_hooks,
    tree_leaves,
)


class AutocastWarning(UserWarning):
    """Warned by a `famp.autocast` call whose rules may not do what they say.

    Raised once per transformed function: for module rules that matched no module path in a call
    (typically a wrapper's prefix: `module.` for `DistributedDataParallel`,
    `_fsdp_wrapped_module.` for FSDP1), and for op overrides left out of torch's inference fast
    path. Filter it as any warning:
    `warnings.filterwarnings("ignore", category=famp.AutocastWarning)`.
    """


_FAST_PATH_MODULES = (
    torch.nn.MultiheadAttention,
    torch.nn.TransformerEncoderLayer,
    torch.nn.TransformerEncoder,
)

F = TypeVar("F", bound=Callable[..., Any])

# --- the record of one call -----------------------------------------------------------------------

_calls = calls


def current_state(device_type: str) -> tuple[bool, torch.dtype]:
    """(enabled, dtype) of autocast for the device here, famp's module rules included.

    Inside a module that a famp module rule matches, famp sets the rule's state around each op
    only, so torch's own state between ops is the transform's; this reports the module's.
    """
    state = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
    calls = _calls()
    if calls:
        record: _Call = calls[-1]
        scope = record.scopes[-1] if record.scopes else None
        if scope is not None and record.device_type == device_type and state == record.base:
            return scope
    return state


def _first_match(patterns: tuple[str, ...], path: str) -> int:
    """Index of the first glob pattern that matches a module path, or -1."""
    for i, pattern in enumerate(patterns):
        if fnmatch.fnmatchcase(path, pattern):
            return i
    return -1


# Dynamo cannot trace `re`; the match is a constant of the (constant) patterns and path.
_match: Callable[[tuple[str, ...], str], int] = assume_constant_result(_first_match)


class _Call:
    """What one call of a transformed function knows: its policy, rules, module scopes, cache."""

    def __init__(self, transform: _Transform, device_type: str) -> None:
        self.transform = transform
        self.device_type = device_type
        self.base = policy_state(transform.policy)
        self.overrides = transform.overrides
        self.patterns = transform.patterns
        self.policies = transform.policies
        # With FampMode active (overrides or module rules) and eagerly, in-place writes and
        # autocast dtype switches are watched so that no stale or wrong-dtype weight cast is read;
        # compiled graphs carry their casts explicitly and have no cache.
        self.track = not torch.compiler.is_compiling()
        self.intercepts = transform.track_casts or self.overrides is not None or bool(self.patterns)
        self.suspended = 0  # > 0 while a nested famp.autocast call runs
        self.grad_free = False  # a grad-free op ran (a reentrant checkpoint's block may follow)
        self.grad_free_block: Any = None  # the checkpointed block a grad-free op ran in, if any
        self.recompute_only = False  # a replay that acts only inside a recomputation
        self.seen_dtype = self.base[1]  # the autocast dtype of the last op FampMode saw
        self.cache = _CastCache()
        # The cacheable weights the ops have read since the cache was last cleared, with the
        # version each had then; their storages (built lazily) catch writes through `.data`.
        self.weights: dict[int, tuple[torch.Tensor, int]] = {}
        self.storages: frozenset[int] | None = None
        # One entry per module entered: the autocast state in effect inside it, None if famp's own.
        self.scopes: list[tuple[bool, torch.dtype] | None] = []
        self.module_policy: dict[torch.nn.Module, Policy | None] = {}
        self.transform = transform
        self.paths: list[str] = []  # the module paths of the roots entered (eagerly)
        # Per module entered: the context that leaves it to torch's fast path, or None.
        self.declined: list[contextlib.ExitStack | None] = []
        # Module hooks: for module rules, and eagerly for torch's fast paths while intercepting.
        self.hooked = bool(self.patterns) or (self.intercepts and self.track)

    # Activation checkpointing (famp._autocast.recompute): a record made again for a recomputation.

    def frozen(self) -> Callable[[], _Call]:
        """A factory of this call's record as it is now, with a fresh cast cache."""
        return partial(
            _Call.replayed, self.transform, self.device_type, self.module_policy, tuple(self.scopes)
        )

    @staticmethod
    def replayed(
        transform: _Transform,
        device_type: str,
        module_policy: dict[torch.nn.Module, Policy | None],
        scopes: tuple[tuple[bool, torch.dtype] | None, ...],
    ) -> _Call:
        record = _Call(transform, device_type)
        record.track = True  # a recomputation runs eagerly, in backward
        record.module_policy = module_policy
        record.scopes = list(scopes)
        record.hooked = bool(record.patterns) or record.intercepts
        return record

    def new_mode(self) -> FampMode:
        return FampMode(self)

    def use_hooks(self, change: int) -> None:
        if self.hooked:
            _hooks(change)

    # Module scopes (called from the global forward hooks while this call is innermost).

    def enter_module(self, module: torch.nn.Module, args: tuple[Any, ...]) -> Any:
        if is_compiled_module(module):
            return None  # `torch.compile(model)`'s wrapper: paths start at the model it wraps
        if self.track and not torch.compiler.is_compiling():
            observe(self, args)
        if not self.scopes and module not in self.module_policy and self.patterns:
            for path, sub in module.named_modules():  # `module` is a root: its paths start here
                if sub not in self.module_policy:
                    i = _match(self.patterns, path)
                    self.module_policy[sub] = self.policies[i] if i >= 0 else None
            if self.track:  # eagerly: which patterns match, for the warning on those that do not
                self.paths.extend(path for path, _ in module.named_modules())
        policy = self.module_policy.get(module)
        outer = self.scopes[-1] if self.scopes else None
        if policy is None:
            self.scopes.append(outer)
            self.declined.append(self._decline(module, args, outer))
            return None
        inner = policy_state(policy)
        self.scopes.append(inner)
        self._switch(outer or self.base, inner)
        args = policy.cast_to_compute(args)
        self.declined.append(self._decline(module, args, inner))
        return args

    def exit_module(self, module: torch.nn.Module, output: Any) -> Any:
        if is_compiled_module(module):
            return None
        if self.track and not torch.compiler.is_compiling():
            observe(self, output)
        inner = self.scopes.pop() if self.scopes else None
        declined = self.declined.pop() if self.declined else None
        if declined is not None:
            declined.close()
        policy = self.module_policy.get(module)
        if policy is None:
            return None
        outer = self.scopes[-1] if self.scopes else None
        self._switch(inner or self.base, outer or self.base)
        return policy.cast_to_output(output)

    def _decline(
        self, module: torch.nn.Module, args: tuple[Any, ...], scope: tuple[bool, torch.dtype] | None
    ) -> contextlib.ExitStack | None:
        """Leave a module that may take torch's inference fast path to torch, uninterrupted.

        `nn.MultiheadAttention`, `nn.TransformerEncoderLayer` and `nn.TransformerEncoder` take a
        fused path (and nested tensors) in eval mode without grad unless an argument "has a torch
        function", which famp's mode would make true. There, famp runs the module's `forward`
        with its mode off and the module's autocast state set around the whole `forward`.
        """
        if not (
            self.track
            and isinstance(module, _FAST_PATH_MODULES)
            and not torch.compiler.is_compiling()
            and not module.training
            and not torch.is_autocast_enabled()  # torch's own test (CUDA's autocast) declines
            and torch_function_modes() == 1  # famp's mode alone: another would decline too
        ):
            return None
        tensors = [*module.parameters(), *(a for a in args if isinstance(a, torch.Tensor))]
        if any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in tensors) or (
            torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        ):
            return None
        if self.overrides is not None and not self.transform.warned_fast_path:
            self.transform.warned_fast_path = True
            warnings.warn(
                f"famp.autocast: op overrides do not apply inside {type(module).__name__} in "
                "eval mode without grad, where torch runs it on its inference fast path; famp "
                "leaves that path to torch (autocast state as torch.autocast's, no interception)."
                " Call it with grad enabled or in train mode to apply the overrides there.",
                AutocastWarning,
                stacklevel=2,
            )
        stack = contextlib.ExitStack()
        if scope is not None:
            stack.enter_context(region(self.device_type, *scope))
        stack.enter_context(no_torch_function())
        return stack

    def warn_unmatched(self) -> None:
        """Warn (once per transform) about module rules that matched no module path."""
        matched = {p for p in self.patterns for path in self.paths if fnmatch.fnmatchcase(path, p)}
        unmatched = [p for p in self.patterns if p not in matched]
        if not unmatched or self.transform.warned_unmatched:
            return
        self.transform.warned_unmatched = True
        paths = sorted(set(self.paths))
        lines = []
        for pattern in unmatched:
            near = [p for p in paths if fnmatch.fnmatchcase(p, "*." + pattern)]
            near = near or difflib.get_close_matches(pattern, paths, n=3, cutoff=0.0)
            lines.append(f"{pattern!r} (nearest module paths: {', '.join(map(repr, near[:3]))})")
        if not paths:
            lines = [f"{p!r} (no module was called)" for p in unmatched]
        warnings.warn(
            "famp.autocast: module_rules matched no module in this call: "
            + "; ".join(lines)
            + ". Paths are relative to the outermost module called; a wrapper adds a prefix "
            "(DistributedDataParallel 'module.', FSDP1 '_fsdp_wrapped_module.'; not "
            "torch.compile(model), whose paths are the model's): write the pattern for the "
            "wrapped model ('module.head') or with a leading '*' ('*head').",
            AutocastWarning,
            stacklevel=3,
        )

    def _switch(self, before: tuple[bool, torch.dtype], after: tuple[bool, torch.dtype]) -> None:
        # torch's cast cache ignores the dtype: drop it when a scope changes the compute dtype.
        if self.track and before[0] and after[0] and before[1] != after[1]:
            torch.clear_autocast_cache()

    # One op call (from FampMode, when there are overrides or module rules).

    def run_op(
        self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        dev = self.device_type
        scope = self.scopes[-1] if self.scopes else None
        state = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        if state != self.base:
            scope = None  # the function entered its own torch.autocast: it governs its body
        enabled, lower = scope or state
        packet, overload = op_name(func)
        # Inside a compiled region that an eager call reaches (`torch.compile(model)`), the
        # graph's casts are explicit: nothing to watch.
        track = self.track and not torch.compiler.is_compiling()
        if track:
            self.watch(args, kwargs)
        rule = None
        if self.overrides is not None and enabled:
            rule = self.overrides.rule(packet, overload, args, kwargs)
        if rule is not None:
            out = apply_rule(rule, func, packet, args, kwargs, dev, lower, self.cache, self._off)
        elif scope is not None:
            with region(dev, *scope):
                out = call(func, args, kwargs)
        else:
            out = call(func, args, kwargs)
        if track and writes_first_arg(packet, kwargs):
            self.invalidate(args[0] if args else kwargs.get("out"))
        return out

    def _off(self) -> Any:
        return region(self.device_type, False, torch.get_autocast_dtype(self.device_type))

    # The weight-cast caches (torch's and famp's) against writes to the weights.

    def watch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Before an op: drop every weight cast if a weight it reads was written since its cast.

        torch's version counter is shared by a tensor's views and `detach()`es, so this sees
        writes through any of them, wherever they were made (inside C++ ops, other threads).
        """
        for t in _weights((*args, *kwargs.values())):
            seen = self.weights.get(id(t))
            if seen is None or seen[0] is not t:
                self.weights[id(t)] = (t, tensor_version(t))
                self.storages = None
            elif seen[1] != tensor_version(t):
                self.clear()
                self.weights[id(t)] = (t, tensor_version(t))

    def invalidate(self, target: object) -> None:
        """After an in-place write: drop every weight cast if it wrote into a watched weight.

        By storage, so that writes through `.data` (which has its own version counter) and any
        other alias are seen too.
        """
        tensors = target if isinstance(target, (list, tuple)) else (target,)
        if self.storages is None:
            self.storages = frozenset(_storage(t) for t, _ in self.weights.values()) - {0}
        for t in tensors:
            if isinstance(t, torch.Tensor) and (
                id(t) in self.weights or _storage(t) in self.storages
            ):
                self.clear()
                return

    def clear(self) -> None:
        torch.clear_autocast_cache()
        self.cache.entries.clear()
        self.weights.clear()
        self.storages = None


def _weights(values: tuple[Any, ...]) -> list[torch.Tensor]:
    """The tensors among the values (and in list values) that torch's cast cache may hold."""
    found = []
    for v in values:
        for t in v if isinstance(v, (list, tuple)) else (v,):
            if (
                isinstance(t, torch.Tensor)
                and t.requires_grad
                and t.dtype == torch.float32
                and not is_view(t)  # torch caches no view; `is_leaf` may raise on some views
                and t.is_leaf
            ):
                found.append(t)
    return found


def _storage(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # nested, sparse, functorch-wrapped tensors
        return 0


# --- module hooks ---------------------------------------------------------------------------------
# Global forward hooks, present only while a call with module rules runs (or a recomputation of
# such a call), registered with torch's public functions. Dynamo cannot trace the creation of their
# handles: while tracing they go through famp._compat (their additions and removals cancel out in
# a graph).

_hook_users = [0]  # calls with module rules running, in all threads
_HOOK_LOCK = threading.Lock()
_handles: list[RemovableHandle] = []


def _acts(record: _Call) -> bool:
    return not record.recompute_only or saved_tensors_hooks_top() is not None


def _pre_hook(module: torch.nn.Module, args: tuple[Any, ...]) -> Any:
    calls = _calls()
    if calls and calls[-1].hooked and _acts(calls[-1]):
        return calls[-1].enter_module(module, args)
    return None


def _post_hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    calls = _calls()
    if calls and calls[-1].hooked and _acts(calls[-1]):
        return calls[-1].exit_module(module, output)
    return None


def _count_hook_user(change: int) -> None:
    _hook_users[0] += change
    if change > 0 and _hook_users[0] == 1:
        if torch.compiler.is_compiling():
            traced_module_hooks(_pre_hook, _post_hook)
        else:
            _handles.append(register_module_forward_pre_hook(_pre_hook))
            _handles.append(register_module_forward_hook(_post_hook, always_call=True))
    elif change < 0 and _hook_users[0] == 0:
        if torch.compiler.is_compiling():
            traced_module_hooks(None, None)
        else:
            for handle in _handles:
                handle.remove()
            _handles.clear()


def _hooks(change: int) -> None:
    if torch.compiler.is_compiling():  # traced: the additions and removals cancel out in a graph
        _count_hook_user(change)
    else:
        with _HOOK_LOCK:
            _count_hook_user(change)


def own_code(fn: Callable[..., Any]) -> Any:
    """A copy of a function with a code object of its own.

    Dynamo keeps its compiled graphs per code object, at most `recompile_limit` (8) of them: the
    transforms of one process would all share the code of the one wrapper below, so that from the
    ninth transform compiled on, torch would run them uncompiled, with only a warning.
    """
    code = fn.__code__
    copy = types.FunctionType(
        code.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


# --- the transform --------------------------------------------------------------------------------


def _devices(tree: Any, found: set[str]) -> None:
    # The common containers directly (fast); anything else through torch's pytree registry.
    if isinstance(tree, torch.Tensor):
        found.add(tree.device.type)
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            _devices(item, found)
    elif isinstance(tree, dict):
        for item in tree.values():
            _devices(item, found)
    elif tree is not None and not isinstance(tree, (int, float, str, bool)):
        leaves = tree_leaves(tree)
        found.update(x.device.type for x in leaves if isinstance(x, torch.Tensor))


def _infer_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    found: set[str] = set()
    _devices(args, found)
    _devices(kwargs, found)
    accelerators = sorted(found - {"cpu", "meta"})
    if len(accelerators) > 1:
        raise ValueError(
            f"device_type=None: the arguments hold tensors on several devices {accelerators}; "
            "pass device_type"
        )
    if accelerators:
        return accelerators[0]
    if "cpu" in found:
        return "cpu"
    raise ValueError("device_type=None needs a tensor among the arguments; pass device_type='cpu'")


class _Transform:
    def __init__(
        self,
        fn: Callable[..., Any],
        policy: Policy,
        device_type: str | None,
        rules: OpRules | None,
        module_rules: Mapping[str, Policy | str] | None,
        compile: bool | None,
        track_casts: bool,
    ) -> None:
        self.fn = fn
        self.track_casts = track_casts
        self.policy = policy
        self.device_type = device_type
        self.rules = rules
        self.overrides = overrides_for(rules)
        items = list((module_rules or {}).items())
        self.patterns = tuple(pattern for pattern, _ in items)
        self.policies = tuple(get_policy(p) for _, p in items)
        self.compile = compile
        self.compiled: Callable[..., Any] | None = None
        self.warned_unmatched = False
        self.warned_fast_path = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        device_type = self.device_type or _infer_device(args, kwargs)
        if self.rules is not None and self.rules.device_type != device_type:
            raise ValueError(
                f"rules are for device_type {self.rules.device_type!r} but the call runs on "
                f"{device_type!r}; pass famp.default_rules({device_type!r}).override(...)"
            )
        if (
            torch.compiler.is_compiling()
            or functorch_transforms_active()  # torch.compile cannot run in torch.func
            or not (self.compile or (self.compile is None and device_type == "cuda"))
        ):
            return self.run(device_type, *args, **kwargs)
        if self.compiled is None:
            run = types.MethodType(own_code(_Transform.run), self)
            self.compiled = torch.compile(run, fullgraph=True)
        return self.compiled(device_type, *args, **kwargs)

    def run(self, device_type: str, /, *args: Any, **kwargs: Any) -> Any:
        record = _Call(self, device_type)
        if record.track:
            drop_abandoned_replays()
        stack = _calls()
        if record.track:
            # A checkpointed block may begin with this call: the event is the outer call's.
            observe(stack[-1] if stack else record, (args, kwargs))
        if stack:
            # Nested in another call, the transform is a module rule spelled as a function: its
            # positional inputs are cast to its compute dtype as a matched module's are.
            args = self.policy.cast_to_compute(args)
        for outer in stack:
            outer.suspended += 1
        stack.append(record)
        record.use_hooks(+1)
        try:
            with region(device_type, *record.base, call=True):
                if record.intercepts:
                    with FampMode(record):
                        out = self.fn(*args, **kwargs)
                else:
                    out = self.fn(*args, **kwargs)
            if record.track:
                observe(record, out)
        finally:
            stack.pop()
            if record.grad_free and stack:
                stack[-1].grad_free = True
                if stack[-1].grad_free_block is None:
                    stack[-1].grad_free_block = record.grad_free_block
            for outer in stack:
                outer.suspended -= 1
            record.use_hooks(-1)
            if not stack and record.track:
                end_of_outermost_call()
        if self.patterns and record.track:
            record.warn_unmatched()
        return self.policy.cast_to_output(out)


def autocast(
    fn: F,
    policy: Policy | str,
    *,
    device_type: str | None = None,
    rules: OpRules | None = None,
    module_rules: Mapping[str, Policy | str] | None = None,
    compile: bool | None = None,
    track_casts: bool = False,
) -> F:
    """Autocast as a function transform: `fn` computing under a policy and op rules.

    Each op inside the returned function runs under its rule; with the default rules that is
    exactly what `torch.autocast(device_type, dtype=policy.compute_dtype)` does (same dtype for
    every op, bitwise-equal outputs and gradients). A float32 or float64 compute dtype turns
    autocast off, as torch does for those dtypes. float64 and non-floating tensors are never cast.
    The floating outputs are cast to `policy.output_dtype` (float64 outputs excepted). Nothing
    leaks: the autocast state is restored after the call or an exception, and a nested transform
    with another dtype works (torch's weight-cast cache is cleared at the switch).

    `rules` may override ops (`famp.default_rules(d).override({"rms_norm": "lower"})`): an op
    whose rule differs from the default is cast per its rule and run with autocast off inside it.
    Overrides apply to ops called from Python, torch's own Python functions included, but not to
    ops that another op's C++ implementation calls (the `bmm` inside `einsum`).

    `module_rules` maps glob patterns over module paths (`fnmatch`, `*` matches dots too) to
    policies: inside a matched module each op runs under that policy's compute dtype, the module's
    positional inputs are cast to it and its outputs to that policy's output dtype; the first
    matching pattern wins and an inner matched module wins over an outer one. Paths are relative to
    the outermost module the call enters (with `torch.func.functional_call` too), wrapper
    included (`module.` for `DistributedDataParallel`); a pattern that matches no module path in a
    call warns once with a `famp.AutocastWarning` naming the nearest paths.

    In eval mode without grad, `nn.MultiheadAttention` and `nn.TransformerEncoder(Layer)` are left
    to torch's inference fast path (famp's interception would turn it off): overrides do not apply
    inside them there, and famp warns once if there are any.

    Args:
        fn: the function (or module) to transform.
        policy: a `famp.Policy` or a `famp.get_policy` string.
        device_type: autocast device type, such as "cpu" or "cuda"; None infers it from the
            arguments' tensors (an accelerator wins over "cpu").
        rules: op rules for the device (`famp.OpRules`); None means `famp.default_rules`.
        module_rules: glob pattern over module paths → `Policy` or policy string.
        compile: True compiles with `torch.compile(fullgraph=True)`; None compiles when the
            device type is "cuda"; False never compiles.
        track_casts: watch every op eagerly so that an in-place write to a weight inside the
            call (an optimizer or EMA update under `torch.no_grad()`) drops its cached cast,
            which torch's cache would keep reading. Always on with overrides or module rules;
            off by default otherwise because the per-op watch costs eager time (see
            docs/benchmarks.md). Compiled graphs have no cast cache and need no watch.

    Returns:
        A function with `fn`'s signature.

    Raises:
        TypeError: `fn` is not callable, or an argument has the wrong type.
        ValueError: an unknown device type, rules for another device type, or a bad policy.

    Examples:
        >>> import torch, famp
        >>> lin = torch.nn.Linear(4, 4)
        >>> f = famp.autocast(lambda x: lin(x).softmax(-1), "c=bf16,o=f32")
        >>> y = f(torch.randn(2, 4))
        >>> y.dtype, torch.is_autocast_enabled("cpu")
        (torch.float32, False)
        >>> inner_dtype = lambda x: lin(x).dtype
        >>> famp.autocast(inner_dtype, "c=bf16")(torch.randn(2, 4))
        torch.bfloat16
        >>> rules = famp.default_rules("cpu").override({"linear": "float32"})
        >>> famp.autocast(inner_dtype, "c=bf16", rules=rules)(torch.randn(2, 4))
        torch.float32
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable; got {type(fn).__name__}")
    policy = get_policy(policy)
    if device_type is not None:
        if not isinstance(device_type, str):
            raise TypeError(f"device_type must be a str or None; got {type(device_type).__name__}")
        try:
            available = torch.amp.is_autocast_available(device_type)
        except RuntimeError:
            available = False
        if not available:
            raise ValueError(
                f"device_type {device_type!r} has no autocast support in torch; "
                "use a torch device type such as 'cpu' or 'cuda'"
            )
    if rules is not None:
        if not isinstance(rules, OpRules):
            raise TypeError(f"rules must be a famp.OpRules or None; got {type(rules).__name__}")
        if device_type is not None and rules.device_type != device_type:
            raise ValueError(
                f"rules are for device_type {rules.device_type!r}, not {device_type!r}"
            )
    if module_rules is not None:
        if not isinstance(module_rules, Mapping):
            raise TypeError(
                f"module_rules must be a mapping of glob pattern to policy; got "
                f"{type(module_rules).__name__}"
            )
        for pattern in module_rules:
            if not isinstance(pattern, str):
                raise TypeError(f"module_rules keys must be str patterns; got {pattern!r}")
    if compile is not None and not isinstance(compile, bool):
        raise TypeError(f"compile must be True, False or None; got {compile!r}")
    if not isinstance(track_casts, bool):
        raise TypeError(f"track_casts must be True or False; got {track_casts!r}")
    transform = _Transform(fn, policy, device_type, rules, module_rules, compile, track_casts)

    def transformed(*args: Any, **kwargs: Any) -> Any:
        return transform(*args, **kwargs)

    if not torch.compiler.is_compiling():  # Dynamo cannot copy code; a traced build is its own
        transformed = own_code(transformed)
    functools.update_wrapper(transformed, fn, updated=())
    return transformed  # type: ignore[return-value]
