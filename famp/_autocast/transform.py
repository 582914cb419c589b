"""`famp.autocast`: autocast as a function transform, with a policy, op rules and module rules.

The transform runs `fn` inside torch's own autocast state for the device, entered with the
policy's explicit compute dtype (never the ambient one, which `torch.compile` would freeze), so
that with the default rules every op is cast by torch's C++ kernels exactly as under
`torch.autocast(device_type, dtype=policy.compute_dtype)`. Each call pushes a record
(`call.CallRecord`) on the thread's stack of calls; `mode.FampMode` adds op overrides, module
rules and fresh weight casts; `region` enters autocast states. This module owns the arguments,
device inference and compilation.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

from famp._autocast import keywords
from famp._autocast.block_nodes import bracket_reentrant
from famp._autocast.call import CallRecord
from famp._autocast.compiled import call_compiled, own_code, scopes_in_checkpoints, watch_compiles
from famp._autocast.devices import any_tensor, infer_device
from famp._autocast.inputs import ROOT_KEYWORDS, cast_inputs, check_inputs
from famp._autocast.mode import FampMode, own_cast
from famp._autocast.overrides import overrides_for
from famp._autocast.patterns import module_policies
from famp._autocast.policy import Policy, get_policy
from famp._autocast.recompute import calls, end_of_outermost_call, observe, replayed
from famp._autocast.region import current_state, policy_state, region
from famp._autocast.rules import OpRules
from famp._compat import dynamic_marks, functorch_transforms_active

F = TypeVar("F", bound=Callable[..., Any])


class Transform:
    """A transformed function: the arguments of its `famp.autocast` call, and its compiled run."""

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
        self.policies = module_policies(items)
        self.rule_dtypes = frozenset(s[1] for s in map(policy_state, self.policies) if s[0])
        self.compile = compile
        self.compiled: Callable[..., Any] | None = None
        self.warned: set[str] = set()  # the causes of the AutocastWarnings given (once each)
        self.plain_ops: dict[str, dict[Any, int]] = {}  # eagerly, per device: op -> plain(...)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        device_type = self.device_type or infer_device(args, kwargs)
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
            run = types.MethodType(own_code(Transform.run), self)
            self.compiled = torch.compile(run, fullgraph=True)
        marked = any_tensor(args, dynamic_marks) or any_tensor(kwargs, dynamic_marks)
        return call_compiled(self.compiled, marked, device_type, *args, **kwargs)

    def run(self, device_type: str, /, *args: Any, **kwargs: Any) -> Any:
        watch_compiles()  # first (it leaves replays a raising backward left): nothing to undo
        record = CallRecord(self, device_type)
        stack = calls()
        replay = replayed() if record.track and not stack else None  # pushes onto `stack`
        if record.track:
            # A checkpointed block may begin with this call: the event is the outer call's.
            observe(stack[-1] if stack else record, (args, kwargs))
            if stack and not torch.is_grad_enabled() and not any(r.patterns for r in stack):
                bracket_reentrant(stack, Transform.run.__code__)
        if stack:
            # Nested: a module rule spelled as a function, its inputs cast as a matched module's.
            args = cast_inputs(record, None, self.policy, args, 0, fresh=True)
            kwargs = (
                cast_inputs(record, None, self.policy, kwargs, 0, fresh=False) if kwargs else kwargs
            )
        kwargs = keywords.of_root(record, self.fn, kwargs)  # a module's a rule matches
        # The state in effect here, a module rule's scope included, before the call sets its own.
        before = current_state(device_type) if stack and record.track else None
        if stack and record.track and stack[-1].track and stack[-1].device_type == device_type:
            record.casts = stack[-1].casts  # one watch: torch's cache keeps nested calls' casts
        for outer in stack:
            outer.suspended += 1
        stack.append(record)
        record.use_hooks(+1)
        if traced_scopes := bool(self.patterns) and not record.track:  # module rules, compiled
            scopes_in_checkpoints(True)
        try:
            with region(device_type, *record.base, True, before, self.rule_dtypes, record.opened):
                if record.intercepts:
                    with FampMode(record):
                        out = self.fn(*args, **kwargs)
                else:
                    out = self.fn(*args, **kwargs)
            if record.track:
                observe(record, out)
                check_inputs(record, None, 0)  # a nested call's (its own inputs)
                check_inputs(record, self.fn, ROOT_KEYWORDS)  # a root module's keywords
        finally:
            stack.pop()
            if record.grad_free and stack:
                stack[-1].grad_free = True
                if stack[-1].grad_free_block is None:
                    stack[-1].grad_free_block = record.grad_free_block
            for outer in stack:
                outer.suspended -= 1
            record.use_hooks(-1)
            if traced_scopes:
                scopes_in_checkpoints(False)
            if not stack and record.track:
                end_of_outermost_call()
            if replay is not None:
                replay.exit(None, None)
        record.finish()
        return own_cast(self.policy.cast_to_output, out)


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
    with another dtype works (no op reads a cast of the other dtype from torch's cast cache).

    `rules` may override ops (`famp.default_rules(d).override({"rms_norm": "lower"})`): an op
    whose rule differs from the default is cast per its rule and run with autocast off inside it.
    Overrides apply to ops called from Python, torch's own Python functions included, but not to
    ops that another op's C++ implementation calls (the `bmm` inside `einsum`).

    `module_rules` maps glob patterns over module paths (`fnmatch`, `*` matches dots too) to
    policies: inside a matched module each op runs under that policy's compute dtype, its inputs
    are cast to it (keyword ones too, but a matched root's not entered as `fn`: they warn) and
    its outputs to that policy's output dtype; the first matching pattern wins and an inner
    matched module wins over an outer one. Paths are relative to the outermost module the call
    enters (with `torch.func.functional_call` too), wrapper included (`module.` for
    `DistributedDataParallel`); a pattern that matches no module path in a call warns once with a
    `famp.AutocastWarning` naming the nearest paths.

    In eval mode without grad, `nn.MultiheadAttention` and `nn.TransformerEncoder(Layer)` are left
    to torch's inference fast path (famp's interception would turn it off): overrides do not apply
    inside them there, and famp warns once if there are any.

    Args:
        fn: the function (or module) to transform.
        policy: a `famp.Policy` or a `famp.get_policy` string.
        device_type: autocast device type, such as "cpu" or "cuda" (not a device: "cuda:0");
            None infers it from the arguments' tensors (an accelerator wins over "cpu").
        rules: op rules for the device (`famp.OpRules`); None means `famp.default_rules`.
        module_rules: glob pattern over module paths → `Policy` or policy string.
        compile: True compiles with `torch.compile(fullgraph=True)`; None compiles when the
            device type is "cuda"; False never compiles. Sizes marked `mark_dynamic` for a
            compile of the caller's may be fixed in this one's graph.
        track_casts: watch every op eagerly so that an in-place write to a weight inside the
            call (an optimizer or EMA update under `torch.no_grad()`) drops its cached cast,
            which torch's cache would keep reading. Always on with overrides or module rules;
            off by default otherwise because the per-op watch costs eager time (see
            docs/benchmarks.md). Compiled graphs have no cast cache and need no watch.

    Returns:
        A function with `fn`'s signature.

    Raises:
        TypeError: `fn` is not callable, or an argument has the wrong type.
        ValueError: an unknown device type, rules for another device type, or a bad policy; when
            called, an override that would cast running statistics the op updates in place.

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
    policy = _checked(fn, policy, device_type, rules, module_rules, compile, track_casts)
    transform = Transform(fn, policy, device_type, rules, module_rules, compile, track_casts)

    def transformed(*args: Any, **kwargs: Any) -> Any:
        return transform(*args, **kwargs)

    if not torch.compiler.is_compiling():  # Dynamo cannot copy code; a traced build is its own
        transformed = own_code(transformed)
    functools.update_wrapper(transformed, fn, updated=())
    return transformed  # type: ignore[return-value]


def _checked(
    fn: Callable[..., Any],
    policy: Policy | str,
    device_type: str | None,
    rules: OpRules | None,
    module_rules: Mapping[str, Policy | str] | None,
    compile: bool | None,
    track_casts: bool,
) -> Policy:
    """`famp.autocast`'s arguments checked, in the order of its signature: the policy."""
    if not callable(fn):
        raise TypeError(f"fn must be callable; got {type(fn).__name__}")
    checked = get_policy(policy)
    if device_type is not None:
        if not isinstance(device_type, str):
            raise TypeError(f"device_type must be a str or None; got {type(device_type).__name__}")
        try:  # torch.autocast takes a device ("cuda:0"), but its settings are per device type
            available = ":" not in device_type and torch.amp.is_autocast_available(device_type)
        except RuntimeError:
            available = False
        if not available:
            raise ValueError(
                f"device_type {device_type!r} is no device type with autocast support in torch; "
                "use one such as 'cpu' or 'cuda' (not a device such as 'cuda:0')"
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
    return checked
