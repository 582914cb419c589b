"""Every private torch name famp uses, in one place, each with the reason it is needed.

famp follows the installed torch: public API wherever torch has one. Where it has none, the private
name is imported here, and only here, so that a torch upgrade that moves it breaks one module (and
the tests that pin it across the supported window), never a user's numbers.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import operator
import sys
import types
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import optree
import torch
import torch.utils._pytree as torch_pytree_module
import torch.utils.checkpoint
from torch.utils import _python_dispatch

# --- autocast (famp/_autocast/) -------------------------------------------------------------------

# The innermost active `saved_tensors_hooks` pair, or None (no public query): tells that an op runs
# inside a non-reentrant checkpoint's block, to restore famp's state when torch recomputes it.
saved_tensors_hooks_top: Callable[[], tuple[object, object] | None] = functools.partial(
    torch._C._autograd._top_saved_tensors_default_hooks, False
)


# Whether a `torch.func` transform is running (no public query): `torch.compile` cannot run inside
# one, so `famp.autocast(compile=True)` runs the function directly there. The builtin itself.
functorch_transforms_active: Callable[[], bool] = torch._C._are_functorch_transforms_active
# Whether a tensor is a `torch.func` transform's wrapper (`grad`'s, `vmap`'s; no public query):
# torch's autocast runs beneath the transforms, on what they wrap, and caches no cast there.
functorch_wrapped: Callable[[torch.Tensor], bool] = torch._C._functorch.is_functorch_wrapped_tensor


def forward_ad_active() -> bool:
    """Whether a `torch.autograd.forward_ad.dual_level` is open (no public query): gradients of
    dual tensors carry tangents, which plain autograd and the in-place kernel drop."""
    return bool(torch.autograd.forward_ad._current_level >= 0)


# famp's own compile relaxes callers' `mark_dynamic` marks: no public API reads or relaxes them.
def dynamic_marks(tensor: torch.Tensor) -> bool:
    """Whether `torch._dynamo.mark_dynamic` marked a size of `tensor` (a private attribute)."""
    return hasattr(tensor, "_dynamo_dynamic_indices")


def relaxed_marks() -> Any:
    """A context in which Dynamo lets a graph fix marked sizes (a private config)."""
    return torch._dynamo.config.patch(allow_ignore_mark_dynamic=True)


def refused_marks(error: BaseException) -> bool:
    """Whether `error` is Dynamo refusing a graph that fixed a marked size (not imported here)."""
    shapes = sys.modules.get("torch.fx.experimental.symbolic_shapes")
    return shapes is not None and isinstance(error, shapes.ConstraintViolationError)


# Types (not public) of `torch.ops.aten.<op>` and `<op>.<overload>`: famp's mode names ops by them.
OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket
# The type of `torch.ops.higher_order.*`. Dynamo hands `torch.utils.checkpoint.checkpoint` to a
# torch function mode as one (`tag_activation_checkpoint`), which traced code finds `is` the
# function; the mode's traced fast path (overrides.traced_plain) leaves every one to famp's path.
HigherOrderOperator = torch._ops.HigherOrderOperator


def op_schema(op: OpOverload) -> torch.FunctionSchema:
    """The schema of an op overload: famp reads argument names, defaults and mutability from it."""
    return op._schema


def overload_name(op: OpOverload) -> str:
    """The overload name of an op overload (`"default"`, `"dim_IntList"`, ...)."""
    return str(op._overloadname)


def packet_name(packet: OpOverloadPacket) -> str:
    """The qualified name of an op packet (`"aten::linear"`)."""
    return str(packet._qualified_op_name)


_TRACED_HOOK_KEY = -0xFA4D  # negative: never meets a handle id (those count up from 0)


def traced_module_hooks(pre: Callable[..., Any] | None, post: Callable[..., Any] | None) -> None:
    """Set famp's global forward pre-hook and always-called hook (unless None: registered eagerly)
    in torch's dicts while Dynamo traces (it cannot trace handles' creation); None, None removes."""
    import torch.nn.modules.module as torch_module

    tables: tuple[dict[int, Any], ...] = (
        torch_module._global_forward_pre_hooks,
        torch_module._global_forward_hooks,
        torch_module._global_forward_hooks_always_called,
    )
    for table, value in zip(tables, (pre, post, None if post is None else True), strict=True):
        if pre is None and post is None:
            table.pop(_TRACED_HOOK_KEY, None)
        elif value is not None:
            table[_TRACED_HOOK_KEY] = value


def remove_global_forward_hook(handle: Any) -> None:
    """Remove a hook of `register_module_forward_hook(..., with_kwargs=True)` and its id, which
    torch 2.13-2.15 leaves in a private dict (`torch.compile(module)` warned ever after)."""
    import torch.nn.modules.module as torch_module

    handle.remove()
    torch_module._global_forward_hooks_with_kwargs.pop(handle.id, None)


def run_frames_eagerly(fn: Callable[..., Any]) -> None:
    """Have Dynamo run `fn`'s frames, and those it calls, eagerly when it meets them as frames of
    their own (still inlined where it traces a caller). A module Dynamo refuses (`nn.GRU`) runs
    eagerly behind a graph break, and torch calls famp's mode from it: Dynamo compiled that call
    as a graph of its own, which then passed `torch.zeros` a dtype as an int (TypeError on torch
    2.13-2.15) or traced the RNN op the eager module runs. Private: `set_code_exec_strategy`."""
    frames, kinds = sys.modules["torch._dynamo.eval_frame"], sys.modules["torch._dynamo.types"]
    skip = kinds.FrameExecStrategy(kinds.FrameAction.SKIP, kinds.FrameAction.SKIP)
    frames.set_code_exec_strategy(fn.__code__, skip)


# AOTAutograd traces compiled code's backward under the autocast its forward began in (torch's
# default "same_as_forward"; eager backward runs without, pytorch/pytorch#179804): famp sets this
# private config "off" for compiles inside its calls, from Dynamo's private compile callbacks.
BACKWARD_AUTOCAST = ("torch._functorch.config", "backward_pass_autocast")
# Dynamo refuses a checkpointed block's changes outside it (famp's module scopes, its mode pushed
# again: undone within the block) unless this private config is on: famp sets it while it traces.
CHECKPOINT_EFFECTS = ("torch._dynamo.config", "skip_fwd_side_effects_in_bwd_under_checkpoint")


def compile_callbacks() -> Any:
    return sys.modules["torch._dynamo"].callback_handler  # see above; asked once Dynamo is loaded


def tree_leaves(tree: object) -> list[object]:
    """A pytree's leaves by torch's registry (its module is private): `famp.autocast`'s device."""
    return torch_pytree_module.tree_leaves(tree)


# The block's function on a reentrant checkpoint's node (`CheckpointFunction`'s ctx, no public
# hook between its recomputation and the nested backward it then runs, where torch drops the
# torch function modes): famp wraps it while the node's backward runs to bracket the node of a
# reentrant checkpoint that the recomputed block ends in.
CHECKPOINT_FUNCTION_ATTR = "run_function"


@functools.cache
def node_saves_tensors(kind: type) -> bool:
    """Whether autograd nodes of this type hold saved tensors, which their backward unpacks first
    (no public query): torch's generated node types expose each as a `_raw_saved_<name>`
    attribute (docs: autograd mechanics, saved tensors). famp stops bracketing a checkpointed
    block's nodes behind one. A custom autograd Function's node type exposes none."""
    return any(name.startswith("_raw_saved_") for name in dir(kind))


# The autograd graph task running on this thread, -1 outside backward (no public query): after
# a raise in a checkpoint node (its post-hook, where famp leaves, never ran), a call outside
# backward cleans up (`in_backward`); explain's calls govern only the ops of their own task.
graph_task: Callable[[], int] = torch._C._current_graph_task_id

# The code of a reentrant checkpoint's forward (no public query): on the Python stack, its frame's
# `ctx` is the node whose backward recomputes the block. A call without a mode brackets no node:
# a call nested in such a block finds the checkpoint by this.
reentrant_forward_code: types.CodeType | None = getattr(
    getattr(getattr(torch.utils.checkpoint, "CheckpointFunction", None), "forward", None),
    "__code__",
    None,
)


def checkpoint_frame(hooks: tuple[object, object]) -> object | None:
    """The non-reentrant checkpoint whose saved-tensor hooks `hooks` are, one object in its
    block's forward and recomputation (no public query): torch's pack hooks hold it, as `frame`
    in the forward's and through `target_frame_ref` in the recomputation's, which Dynamo's
    `disable` wraps (`fn`). A call without a mode around the block brackets none of its nodes:
    a call nested in it finds its state by this at recomputation."""
    fn, frame = hooks[0], None
    for _ in range(3):
        code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
        if code is None or cells is None:
            return None
        found = dict(zip(code.co_freevars, cells, strict=True))
        if "frame" in found:
            frame = found["frame"].cell_contents
        elif "target_frame_ref" in found:
            ref = found["target_frame_ref"].cell_contents
            frame = ref() if callable(ref) else None
        elif "fn" in found:
            fn = found["fn"].cell_contents
            continue
        break
    return frame if isinstance(frame, _CHECKPOINT_FRAME) else None


# Nothing is an instance of it where torch has no such class (its hooks are then not understood).
_CHECKPOINT_FRAME: type = getattr(torch.utils.checkpoint, "_CheckpointFrame", type(None))


# --- import cost (famp/__init__.py, famp/_autocast/) ---------------------------------------------

_Fn = TypeVar("_Fn", bound=Callable[..., Any])

# `torch.compiler.assume_constant_result(fn)` (torch 2.13-2.15) without its import of Dynamo (~1 s)
# at famp's import; tests/test_import_cost.py checks that torch's sets exactly this attribute.
_DYNAMO_CONSTANT_MARK = "_dynamo_marked_constant"


def assume_constant_result(fn: _Fn) -> _Fn:
    """`torch.compiler.assume_constant_result(fn)`, without importing Dynamo (see above)."""
    setattr(fn, _DYNAMO_CONSTANT_MARK, True)
    return fn


# Dynamo hands a call to the torch function modes only for functions in its set (`torch.overrides`'
# list); eagerly, every C binding and Python function asking `has_torch_function` goes to them. Not
# in it: the bindings torch's Python functions call (`torch._C._nn.cross_entropy_loss`),
# `F.hardswish`...: compiled, their overrides did nothing. famp adds them, as eagerly.
_BINDINGS = ("_VariableFunctions", "_nn", "_linalg", "_special", "_fft", "_nested", "_sparse")
_ASKS = frozenset({"has_torch_function", "has_torch_function_unary", "has_torch_function_variadic"})


@assume_constant_result  # Dynamo runs it as it traces famp's mode (imported by then)
def modes_see_every_binding() -> bool:
    try:
        from torch._dynamo.variables.torch import get_overridable_functions  # cached: one set
    except ImportError:  # moved: say so rather than let overrides go silently unapplied
        message = "famp.autocast: compiled, overrides may miss ops (docs/autocast.md, Compilation)"
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return False
    functions = get_overridable_functions()
    python = [
        value
        for module in (torch.nn.functional, torch.functional)
        for value in list(vars(module).values())
        if isinstance(value, types.FunctionType)
    ]
    for namespace in (getattr(torch._C, name) for name in _BINDINGS):
        for name in dir(namespace):  # every aten op's binding, private ones too (_weight_norm)
            value = getattr(namespace, name)
            if (
                isinstance(value, types.BuiltinFunctionType)
                and not name.startswith("__")
                and (
                    not name.startswith("_")
                    or namespace is not torch._C._VariableFunctions
                    or hasattr(torch.ops.aten, name)  # generated: modes see each call eagerly
                )
            ):
                functions.add(value)
    functions.update(f for f in python if _ASKS & set(f.__code__.co_names))
    return True


# --- autocast: the weight-cast cache and torch's inference fast paths (ac-compose) ---------------

# torch's version counter of a tensor: the only record of in-place writes to it. Read before
# every op famp intercepts eagerly, so a C-level getter (an int), not a Python function.
tensor_version: Callable[[torch.Tensor], int] = operator.attrgetter("_version")

# Whether a tensor is a view: torch's cast cache skips views, and `is_leaf` may raise on them.
# The method itself (it returns a bool), for the same reason.
is_view: Callable[[torch.Tensor], bool] = torch.Tensor._is_view


def unbatched(t: torch.Tensor) -> torch.Tensor:
    """`t` without `vmap`'s wrappers (no public query): a view made under `vmap` has no `_base`
    of its own, the tensor it wraps has (`casts.apply_rule` asks if a result views a cast)."""
    while torch._C._functorch.is_batchedtensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


def torch_function_modes() -> int:
    """How many torch function modes are active (famp's alone makes torch's fast paths decline)."""
    return int(torch._C._len_torch_function_stack())


def no_torch_function() -> Any:
    """A context without torch function handling, where `has_torch_function` answers False as it
    does without famp's mode (torch's public API has no way to pop one mode)."""
    return torch._C.DisableTorchFunction()


def compiled_module_type() -> type:
    """`torch.compile(model)`'s wrapper class (private to Dynamo); before Dynamo is loaded, a
    class no module is an instance of."""
    if torch.compiler.is_compiling():  # Dynamo traces `sys.modules.get` slowly (~1.7 ms a call)
        return torch._dynamo.eval_frame.OptimizedModule
    return getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", type(None))


def is_compiled_module(module: object) -> bool:
    """Whether a module is `torch.compile(model)`'s wrapper (its class is private to Dynamo)."""
    return isinstance(module, compiled_module_type())


# --- autocast op rules: _autocast/tables.py, _autocast/compare.py ---------------------------------


def fake_tensor_mode(**kwargs: Any) -> Any:
    """A `FakeTensorMode(**kwargs)` to derive rules on (a private module, imported on first use)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(**kwargs)


def no_dispatch_modes() -> Any:
    """A context with no dispatch mode on (a compile's fake mode, explain's): no public API."""
    return _python_dispatch._disable_current_modes()


def real_tensors() -> Any:
    """A context without fake tensors, for `kernels.kernel_runs` and `ops._probe`: no public API
    leaves them. Inside a `torch.func` transform, without the transforms too (no public API
    either), which would wrap a probe's result (its storage cannot be read)."""
    from torch._subclasses import fake_tensor

    off = fake_tensor.unset_fake_temporarily()
    if not functorch_transforms_active():
        return off
    both = contextlib.ExitStack()  # entered here, left by the caller's `with`
    both.enter_context(off)
    both.enter_context(torch._C._DisableFuncTorch())
    return both


def kernel_registrations(dispatch_key: str) -> list[str]:
    """Ops with a kernel for `dispatch_key` (`"AutocastCPU"`), as `"aten::mm"`: no public API."""
    return list(torch._C._dispatch_get_registrations_for_dispatch_key(dispatch_key))


# --- reliability: scaler state (_scaling/state.py), FSDP1 layouts of live models (_fsdp/live.py)
# optree's public registration needs a namespace, and a namespaced node is one opaque leaf to
# optree calls without it: ScalerState registers in the global one, as builtins, for tree_map.
OPTREE_GLOBAL_NAMESPACE: str = getattr(optree.registry, "__GLOBAL_NAMESPACE")

# torch has no public pytree module: ScalerState must be a node of torch's own pytree for
# torch.func, torch.compile inputs/outputs and torch.export (treespec_dumps).
torch_pytree = torch_pytree_module

# The functional form of GradScaler's update kernel; famp's update is bit-exact with it because it
# calls it (there is no public functional name for it).
amp_update_scale = torch.ops.aten._amp_update_scale
# Its in-place binding (`GradScaler.update`'s): eager `update_scale` runs it on copies (faster).
amp_update_scale_ = torch._amp_update_scale_


def fsdp1_flat_params(module: Any) -> Any:
    """An FSDP1 unit's flat-parameter handle (None without parameters): no public accessor has
    the flat parameter's names and shapes, compute dtype or `use_orig_params`; `layout_of` does."""
    return module._handle


def fsdp1_unit_settings(handle: Any) -> tuple[list[str], list[tuple[int, ...]], Any, bool]:
    """`(fqns, shapes, compute dtype, use_orig_params)` of an FSDP1 handle (see above)."""
    flat = handle.flat_param
    shapes = [tuple(s) for s in flat._shapes]
    return list(flat._fqns), shapes, handle._fwd_bwd_param_dtype, bool(handle._use_orig_params)


# --- explain (famp/_autocast/explain.py) ----------------------------------------------------------

# The public base class of dispatch modes lives in a private module; explain records every aten op
# (and its dtypes) with one. Needed at import (a base class); `import torch` loads it already.
TorchDispatchMode = _python_dispatch.TorchDispatchMode


def autocast_key_excluded(dispatch_key: str, excluded: bool) -> bool:
    """(Un)exclude an autocast dispatch key (`"AutocastCPU"`; a dispatch mode runs each op with it
    excluded, so the op kernel's own calls go uncast); returns if it was. No public API."""
    key = getattr(torch._C.DispatchKey, dispatch_key)
    was = torch._C._dispatch_tls_is_dispatch_key_excluded(key)
    torch._C._dispatch_tls_set_dispatch_key_excluded(key, excluded)
    return bool(was)


# --- checkpoints (famp/_fsdp/dcp_writer.py) -------------------------------------------------


def dcp_storage_info(relative_path: str, offset: int, length: int) -> object:
    """DCP's per-item storage record (no public constructor) that `FileSystemReader` looks up
    byte ranges in, unpickled by name from a `.metadata`. Imported lazily: DCP is heavy."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path, offset, length)


# --- applying a scale and stepping (_scaling/kernels.py, optimizer_step.py, undo.py) -------------

# `GradScaler`'s fused check-and-unscale kernel, which has no public name (the builtin itself).
amp_foreach_non_finite_check_and_unscale_ = torch._amp_foreach_non_finite_check_and_unscale_
# Its functional form, where in-place updates are not allowed (torch.func, other devices).
amp_foreach_non_finite_check_and_unscale = torch.ops.aten._amp_foreach_non_finite_check_and_unscale


def python_modes_active() -> bool:
    """Whether a Python torch-function or dispatch mode is on (no public query): under a user's
    mode famp's eager fused unscale takes the kernel, not a compiled call the mode would see."""
    return bool(torch._C._is_torch_function_mode_enabled() or torch._C._len_torch_dispatch_stack())


def dynamo_disabled() -> bool:
    """Whether `torch.compile` is off (`TORCHDYNAMO_DISABLE=1`): famp's eager fused unscale then
    keeps the kernel. Only a private config holds it; imported lazily (`torch._dynamo` is heavy)."""
    import torch._dynamo

    return bool(torch._dynamo.config.disable)


def dynamo_graphs(code: types.CodeType) -> int:
    """How many graphs Dynamo keeps for `code` (a private debug query): fused unscale warms its
    program again after `torch.compiler.reset()` (a first trace on equal sizes would tie them)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(code))


def step_supports_amp_scaling(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` unscales and skips in its kernel (GradScaler's private mark)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def optimizer_step_hooked(optimizer: torch.optim.Optimizer) -> bool:
    """Whether step hooks (own or global; private dicts, read defensively) would see an undo."""
    shared = sys.modules.get("torch.optim.optimizer")  # loaded by `import torch`
    kinds = ("pre", "post")
    own = any(getattr(optimizer, f"_optimizer_step_{n}_hooks", None) for n in kinds)
    return own or any(getattr(shared, f"_global_optimizer_{n}_hooks", None) for n in kinds)


# Compiled, inductor (2.13, 2.15) may drop a clone that a mutating famp operator writes and read
# its source from storage offset 0: no such clone of a view (`_base`: no public query), in
# `_scaling/choice.py` and `kernels.py`. Dynamo reads no intermediate's storage offset.
VIEW_BASE = "_base"  # `is_view` (`Tensor._is_view`) is not traceable by Dynamo


def foreach_clone(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """A clone of each tensor (strides kept), in one call: no public multi-tensor clone exists."""
    return tuple(torch._foreach_clone(tensors))


# Eager value_and_grad unscales fresh grads in place only where no other holder of their memory
# (no public query) nor post-accumulate-grad hook (private) exists: else out of place, same bits.
_storage_use_count: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def storage_unshared(tensor: torch.Tensor) -> bool:
    """Whether no other tensor (nor a Python storage object) holds `tensor`'s memory."""
    return _storage_use_count is not None and _holders(tensor) <= _FRESH_HOLDERS


def _holders(tensor: torch.Tensor) -> int:  # counts `storage` too: kept alive while it counts
    storage = tensor.untyped_storage()
    return _storage_use_count(storage._cdata) if _storage_use_count is not None else 0


_FRESH_HOLDERS = _holders(torch.empty(1))  # the tensor (alive as the argument) and its storage


def storage_identity(tensor: torch.Tensor) -> int:
    """The identity of `tensor`'s storage, kept through `resize_` (FSDP2 frees and reallocates
    its unsharded weights, so their data pointer moves): no public query."""
    return int(tensor.untyped_storage()._cdata)


def grad_hooked(tensor: torch.Tensor) -> bool:  # see storage_unshared
    return getattr(tensor, "_post_accumulate_grad_hooks", True) is not None


_KEYWORDS_HOOK_KEY = -0xFA4F  # a key of its own: a global hook's in a module's dict gets kwargs
_keyword_hook_keys = itertools.count(0xFA500000)  # eagerly, negated: never a handle's id


def add_pre_hook(module: torch.nn.Module, hook: Callable[..., Any]) -> tuple[Any, ...]:
    """Give `module` the forward pre-hook `hook`, with keyword inputs and first among its own, in
    its hook dicts (private; a handle costs 7 µs, this 0.4); `remove_pre_hook(*returned)` takes it
    off. While Dynamo traces (no handle, no change in place) plain `dict` copies holding it."""
    own, with_kwargs = pre_hooks(module)
    if torch.compiler.is_compiling():  # set in `__dict__`: Dynamo traces no `Module.__setattr__`
        module.__dict__["_forward_pre_hooks"] = {_KEYWORDS_HOOK_KEY: hook, **own}
        module.__dict__["_forward_pre_hooks_with_kwargs"] = {
            **with_kwargs,
            _KEYWORDS_HOOK_KEY: True,
        }
        return module, own, with_kwargs, None
    key = -next(_keyword_hook_keys)
    own[key] = hook
    own.move_to_end(key, last=False)
    with_kwargs[key] = True
    return module, own, with_kwargs, key


def remove_pre_hook(module: torch.nn.Module, own: Any, with_kwargs: Any, key: Any) -> None:
    """Undo `add_pre_hook`: the hook out of the module's dicts, or its own dicts back."""
    if key is None:
        module.__dict__["_forward_pre_hooks"] = own
        module.__dict__["_forward_pre_hooks_with_kwargs"] = with_kwargs
    else:
        own.pop(key, None)
        with_kwargs.pop(key, None)


def keywords_pre_hook(hook: Callable[..., Any] | None) -> int:
    """Put `hook` among torch's global pre-hooks at a key that stays (None: take it off); the key:
    a handle's id, new each call, made a compiled graph that reads it recompile at each call."""
    table = sys.modules["torch.nn.modules.module"]._global_forward_pre_hooks
    table.pop(-0xFA4C, None) if hook is None else table.update({-0xFA4C: hook})
    return -0xFA4C


def pre_hooks(module: torch.nn.Module) -> tuple[Any, Any]:
    """A module's own forward pre-hooks and the keys given keyword inputs (global ones' too)."""
    return module.__dict__["_forward_pre_hooks"], module.__dict__["_forward_pre_hooks_with_kwargs"]


def forward_hooks(module: torch.nn.Module, hooks: Any = None) -> Any:
    """A module's own forward hooks (a private dict), replaced by `hooks` if given: while Dynamo
    traces (no hook handle can be made there) famp leaves a rule's scope after them."""
    own = module.__dict__["_forward_hooks"]
    if hooks is not None:
        module.__dict__["_forward_hooks"] = hooks
    return own
