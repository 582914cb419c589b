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
torch's C++ wrapper for `linear` casts the inputs (the `_to_copy` ops) and runs `linear`'s pieces
(`t`, `addmm`) with autocast off, so each of them is governed by `linear`'s rule. A record's `rule`
is therefore the rule, in the call's table, of the outermost torch builtin called from Python that
encloses the op (`call` names it); an op reached without one (Python operators such as `a @ b` and
`a + b`, which are not profiled calls) gets its own aten overload's rule, and so does an op inside
a builtin that is not an aten op (the backward pass, run by `torch.autograd`'s engine); an
operator's op that famp runs by its rule (`CallRecord.run_op`, with overrides or module rules)
counts as a call of that op. Two blind spots follow, where the dtypes tell the truth and the rule
does not: the casts autocast makes for an operator (`a @ b`) show `"keep"` (`mm` itself shows
`"lower"`), and the ops that another op's C++ implementation calls through their own autocast
wrappers (the linears inside `_VF.gru` and `lstm_cell`) show the outer op's rule (`"keep"`),
although torch casts them. The rules, module rules and policy are those that `famp.autocast`
applies where the op runs: a nested `famp.autocast` call's own, inside it (the recorder reads the
innermost call's record). `rule` is `None` where autocast is off for the device (a float32 compute
dtype, a module rule computing in float32, the function's own `torch.autocast(enabled=False)`, the
output cast after the autocast region), operators' ops included. `source` is `"override"` where
those rules give the op another rule than the device's defaults, else `"module"` inside a module
that a module rule matches, else `"default"`. Module paths are `famp.autocast`'s: a module entered
outside any other is a root for that call of it.

Deliberately not supported: compiled execution (a compiled graph runs no aten ops one by one:
explain always runs eagerly), and threads other than the caller's (the profile function is the
calling thread's; `sys.setprofile` users such as `cProfile` are suspended meanwhile).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)

from famp._autocast.defaults import default_rules
from famp._autocast.policy import Policy
from famp._autocast.recorder import Recorder
from famp._autocast.rules import OpRules
from famp._autocast.trace import Trace
from famp._autocast.transform import autocast
from famp._compat import tree_leaves


def _infer_device(args: Any) -> str:
    # The user's arguments: containers registered with torch's pytree are walked, as by autocast.
    types = {x.device.type for x in tree_leaves(args) if isinstance(x, torch.Tensor)}
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
    docstring of `famp._autocast.explain` spells out the cases. Explain always runs eagerly, code
    compiled with `torch.compile` inside `fn` too (torch's `"force_eager"` stance): a compiled
    graph has no per-op dispatch to watch.

    Args:
        fn: The function (or module) to run.
        policy: A `famp.Policy` or a `famp.get_policy` string.
        **autocast_kwargs: `famp.autocast`'s keyword arguments (`device_type`, `rules`,
            `module_rules`, `track_casts`); `compile` may only be `False` or `None`.

    Returns:
        A function with `fn`'s arguments returning a pair: `fn`'s output as `famp.autocast`
            returns it, and the `famp.Trace`.

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
    transformed = autocast(fn, policy, compile=False, **autocast_kwargs)
    rules: OpRules | None = autocast_kwargs.get("rules")
    device_type: str | None = autocast_kwargs.get("device_type")

    @functools.wraps(fn)
    def explained(*args: Any, **kwargs: Any) -> tuple[Any, Trace]:
        dev = device_type or (rules.device_type if rules is not None else None)
        dev = dev or _infer_device((args, kwargs))
        recorder = Recorder(dev)
        pre = register_module_forward_pre_hook(recorder.pre_hook)
        post = register_module_forward_hook(recorder.post_hook, always_call=True)
        previous = sys.getprofile()
        if isinstance(getattr(previous, "__self__", None), Recorder):  # inside another explain
            recorder.chained = previous  # whose profile function then still sees every call
        # Compiled code inside `fn` runs eagerly too (Dynamo is loaded if anything was compiled).
        eager = "torch._dynamo" in sys.modules
        try:
            with recorder, torch.compiler.set_stance("force_eager") if eager else nullcontext():
                sys.setprofile(recorder.profile)
                try:
                    out = transformed(*args, **kwargs)
                finally:
                    sys.setprofile(previous)
        finally:
            pre.remove()
            post.remove()
            for handle in recorder.handles:  # a module's own hook that never ran (it raised)
                handle.remove()
        return out, Trace(recorder.records(rules or default_rules(dev)))

    return explained
