"""Mixed-precision policies: which dtype parameters are stored in, computed in, and returned in.

A `Policy` is plain, immutable data (jmp's model). Casts touch floating tensors of the
mixed-precision family only (float16, bfloat16, float32): float64 tensors are never narrowed,
like `torch.autocast`, which never casts float64; complex, float8, integer and boolean tensors
and every non-tensor leaf (Python floats included) pass through unchanged.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import torch

from famp._compat import torch_pytree as pytree
from famp._typing import DTypeLike, TreeT

# Names accepted by `get_policy` and `Policy(...)`; the first name of each dtype is canonical.
_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "f32": torch.float32,
    "full": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "f16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
    "f64": torch.float64,
}
_CANONICAL: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float64: "float64",
}
_KEYS: dict[str, str] = {k: v for v in ("params", "compute", "output") for k in (v[0], v)}
# The dtypes a cast may change; float64 (and everything else) passes through.
CASTABLE = frozenset({torch.float16, torch.bfloat16, torch.float32})


def _as_dtype(field: str, value: object) -> torch.dtype:
    if isinstance(value, torch.dtype):
        if value not in _CANONICAL:
            accepted = ", ".join(f"torch.{name}" for name in _CANONICAL.values())
            raise ValueError(f"{field} must be one of {accepted}; got {value}")
        return value
    if isinstance(value, str):
        name = value.strip().lower().removeprefix("torch.")
        if name not in _DTYPE_NAMES:
            accepted = "|".join(_DTYPE_NAMES)
            raise ValueError(f"{field} must be a dtype name ({accepted}); got {value!r}")
        return _DTYPE_NAMES[name]
    shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:37]}..."
    raise TypeError(
        f"{field} must be a torch.dtype or a dtype name; got {type(value).__name__} {shown}"
    )


def cast_leaf(leaf: Any, dtype: torch.dtype) -> Any:
    """`leaf` cast to `dtype` if it is a float16, bfloat16 or float32 tensor, else `leaf`."""
    if isinstance(leaf, torch.Tensor) and leaf.dtype in CASTABLE and leaf.dtype != dtype:
        return leaf.to(dtype=dtype)  # the keyword: torch parses it about 1 µs faster
    return leaf


_Done = list[tuple[torch.Tensor, torch.Tensor]]  # the (tensor, cast) pairs of a tree so far


def _cast_once(leaf: Any, dtype: torch.dtype, done: _Done) -> Any:
    """`cast_leaf`, once per tensor of a tree, as `h32 = h.float(); attn(h32, h32, h32)`: a
    cast per place broke `query is key is value` and rounded each place's gradient."""
    if isinstance(leaf, torch.Tensor) and leaf.dtype in CASTABLE and leaf.dtype != dtype:
        for source, cast in done:
            if source is leaf:
                return cast
        cast = leaf.to(dtype=dtype)  # the keyword: torch parses it about 1 µs faster
        done.append((leaf, cast))
        return cast
    return leaf


def _cast_tree(tree: TreeT, dtype: torch.dtype) -> TreeT:
    """`tree` with every leaf cast (`cast_leaf`), each tensor once (`_cast_once`). Plain
    tuples, lists and dicts over plain leaves are cast here, without torch's `tree_flatten`,
    which on torch 2.13-2.15 leaves a reference cycle per call (a closure that calls itself);
    other trees (named tuples, registered nodes, subclasses) go through `tree_map`."""
    if isinstance(tree, torch.Tensor):
        return cast_leaf(tree, dtype)  # type: ignore[no-any-return]
    done: _Done = []
    if type(tree) in (tuple, list):
        items: tuple[Any, ...] | list[Any] = tree  # type: ignore[assignment]
        if all(type(x) in FLAT_LEAVES for x in items):  # the common case, without recursion
            return type(items)(_cast_once(x, dtype, done) for x in items)  # type: ignore[return-value]
    out = _cast_plain(tree, dtype, _MAX_DEPTH, done)
    if out is not _NOT_PLAIN:
        return out  # type: ignore[no-any-return]
    return pytree.tree_map(partial(_cast_once, dtype=dtype, done=done), tree)  # type: ignore[no-any-return]


def _cast_plain(tree: Any, dtype: torch.dtype, depth: int, done: _Done) -> Any:
    """`tree` cast leaf by leaf if it is plain tuples, lists and dicts (as many levels as
    `depth`) over `FLAT_LEAVES`, else `_NOT_PLAIN`; a module function, so no cycle."""
    kind = type(tree)
    if kind in FLAT_LEAVES:
        return _cast_once(tree, dtype, done)
    if depth == 0 or kind not in (tuple, list, dict):
        return _NOT_PLAIN
    values = tree.values() if kind is dict else tree
    cast = [_cast_plain(x, dtype, depth - 1, done) for x in values]
    if any(x is _NOT_PLAIN for x in cast):
        return _NOT_PLAIN
    return dict(zip(tree, cast, strict=True)) if kind is dict else kind(cast)


# Leaves of every pytree: a tuple or list of only these is one level deep.
FLAT_LEAVES = (torch.Tensor, torch.nn.Parameter, type(None), bool, int, float, str)
_NOT_PLAIN = object()
_MAX_DEPTH = 8  # deeper trees go through tree_map


@dataclasses.dataclass(frozen=True)
class Policy:
    """Immutable mixed-precision policy: parameter, compute and output dtypes.

    Each field is float16, bfloat16, float32 or float64; a dtype name from `get_policy`'s grammar
    ("bf16", "full", ...) is converted. The casts map every float16, bfloat16 and float32 tensor
    in a pytree to the field's dtype. They never narrow a float64 tensor (a policy that names
    float64 widens the others to it), and they pass complex, float8, integer, boolean and
    non-tensor leaves (Python scalars included) through unchanged. A tensor a tree holds
    more than once is cast once (its places share the cast, as they shared the tensor).
    `famp.autocast` computes in `compute_dtype` and returns `output_dtype`; `param_dtype` is
    for storing parameters.

    Args:
        param_dtype: dtype parameters are stored in.
        compute_dtype: dtype autocast's "lower" ops run in.
        output_dtype: dtype of a transformed function's floating outputs.

    Raises:
        TypeError: a field is neither a `torch.dtype` nor a string.
        ValueError: a field names an unsupported dtype.

    Examples:
        >>> import torch, famp
        >>> policy = famp.Policy(torch.float32, torch.bfloat16, torch.float32)
        >>> str(policy)
        'params=float32,compute=bfloat16,output=float32'
        >>> tree = {"w": torch.ones(2), "step": 3, "n": torch.ones(2, dtype=torch.int64)}
        >>> out = policy.cast_to_compute(tree)
        >>> out["w"].dtype, out["step"], out["n"].dtype
        (torch.bfloat16, 3, torch.int64)
    """

    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    output_dtype: torch.dtype

    def __post_init__(self) -> None:
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, field, _as_dtype(field, getattr(self, field)))

    def __str__(self) -> str:
        return (
            f"params={_CANONICAL[self.param_dtype]},compute={_CANONICAL[self.compute_dtype]},"
            f"output={_CANONICAL[self.output_dtype]}"
        )

    def cast_to_param(self, tree: TreeT) -> TreeT:
        """Cast the float16/bfloat16/float32 tensors of `tree` to `param_dtype`."""
        return _cast_tree(tree, self.param_dtype)

    def cast_to_compute(self, tree: TreeT) -> TreeT:
        """Cast the float16/bfloat16/float32 tensors of `tree` to `compute_dtype`."""
        return _cast_tree(tree, self.compute_dtype)

    def cast_to_output(self, tree: TreeT) -> TreeT:
        """Cast the float16/bfloat16/float32 tensors of `tree` to `output_dtype`."""
        return _cast_tree(tree, self.output_dtype)

    def with_param_dtype(self, dtype: DTypeLike) -> Policy:
        """A copy with `param_dtype` replaced."""
        return dataclasses.replace(self, param_dtype=_as_dtype("param_dtype", dtype))

    def with_compute_dtype(self, dtype: DTypeLike) -> Policy:
        """A copy with `compute_dtype` replaced."""
        return dataclasses.replace(self, compute_dtype=_as_dtype("compute_dtype", dtype))

    def with_output_dtype(self, dtype: DTypeLike) -> Policy:
        """A copy with `output_dtype` replaced."""
        return dataclasses.replace(self, output_dtype=_as_dtype("output_dtype", dtype))


def get_policy(spec: str | Policy) -> Policy:
    """Parse a policy string (jmp's grammar, extended); a `Policy` is returned unchanged.

    The string is either one dtype name, which sets all three dtypes, or comma-separated
    `key=dtype` pairs. Keys: `p`/`params`, `c`/`compute`, `o`/`output`. Dtype names:
    `float32`/`f32`/`full`, `bfloat16`/`bf16`, `float16`/`f16`/`half`, `float64`/`f64` (case and
    surrounding spaces are ignored). `params` defaults to float32, `compute` to `params`, and
    `output` to `compute`. `str(policy)` gives a string that parses back to an equal policy.

    Args:
        spec: the policy string, or a `Policy`.

    Returns:
        The `Policy`.

    Raises:
        TypeError: `spec` is neither a string nor a `Policy`.
        ValueError: an unknown or repeated key, an unknown dtype name, or an empty spec; the
            message lists what is accepted.

    Examples:
        >>> import famp
        >>> str(famp.get_policy("c=bf16"))
        'params=float32,compute=bfloat16,output=bfloat16'
        >>> str(famp.get_policy("params=float32,compute=float16,output=float32"))
        'params=float32,compute=float16,output=float32'
        >>> famp.get_policy("half") == famp.get_policy("p=f16,c=f16,o=f16")
        True
    """
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str):
        raise TypeError(
            f"policy must be a string or a famp.Policy; got {type(spec).__name__} {spec!r}"
        )
    if "=" not in spec:
        dtype = _as_dtype("policy", spec)
        return Policy(dtype, dtype, dtype)
    fields: dict[str, torch.dtype] = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in _KEYS:
            accepted = "|".join(_KEYS)
            raise ValueError(f"policy key must be one of {accepted} in key=dtype; got {part!r}")
        name = _KEYS[key]
        if name in fields:
            raise ValueError(f"policy key {name!r} is given twice in {spec!r}")
        fields[name] = _as_dtype(name, value)
    params = fields.get("params", torch.float32)
    compute = fields.get("compute", params)
    return Policy(params, compute, fields.get("output", compute))


def cast_to_param(policy: Policy | str, tree: TreeT) -> TreeT:
    """Cast a pytree's float16/bfloat16/float32 tensors to the policy's `param_dtype`.

    Args:
        policy: a `Policy` or a `get_policy` string.
        tree: the parameters, any pytree; only float16, bfloat16 and float32 tensor leaves
            change.

    Returns:
        A tree of the same structure, those leaves in `param_dtype`.

    Examples:
        >>> import torch, famp
        >>> famp.cast_to_param("p=bf16", [torch.ones(1), 2.0])[0].dtype
        torch.bfloat16
    """
    return get_policy(policy).cast_to_param(tree)


def cast_to_compute(policy: Policy | str, tree: TreeT) -> TreeT:
    """Cast a pytree's float16/bfloat16/float32 tensors to the policy's `compute_dtype`.

    `famp.autocast` casts the inputs of a module that a module rule matches so.

    Args:
        policy: a `Policy` or a `get_policy` string.
        tree: the inputs, any pytree (containers registered with torch's pytree included);
            only float16, bfloat16 and float32 tensor leaves change.

    Returns:
        A tree of the same structure, those leaves in `compute_dtype`.

    Examples:
        >>> import torch, famp
        >>> tree = (torch.ones(1), torch.ones(1, dtype=torch.float64))
        >>> half, double = famp.cast_to_compute("c=f16", tree)
        >>> half.dtype, double.dtype
        (torch.float16, torch.float64)
    """
    return get_policy(policy).cast_to_compute(tree)


def cast_to_output(policy: Policy | str, tree: TreeT) -> TreeT:
    """Cast a pytree's float16/bfloat16/float32 tensors to the policy's `output_dtype`.

    `famp.autocast` casts the outputs of the transformed function (and of a matched module) so.

    Args:
        policy: a `Policy` or a `get_policy` string.
        tree: the outputs, any pytree; only float16, bfloat16 and float32 tensor leaves change.

    Returns:
        The tree, those leaves in `output_dtype`.

    Examples:
        >>> import torch, famp
        >>> tree = {"y": torch.ones(1, dtype=torch.bfloat16)}
        >>> famp.cast_to_output("c=bf16,o=f32", tree)["y"].dtype
        torch.float32
    """
    return get_policy(policy).cast_to_output(tree)
