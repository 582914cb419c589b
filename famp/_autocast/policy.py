"""Mixed-precision policies: which dtype parameters are stored in, computed in, and returned in.

A `Policy` is plain, immutable data (jmp's model). Casts touch floating tensors of the
mixed-precision family only (float16, bfloat16, float32): float64 tensors are never narrowed,
like `torch.autocast`, which never casts float64; complex, float8, integer and boolean tensors
and every non-tensor leaf (Python floats included) pass through unchanged.
"""

from __future__ import annotations

import dataclasses

import torch

from famp._autocast.tree_casts import cast_tree
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


@dataclasses.dataclass(frozen=True)
class Policy:
    """Immutable mixed-precision policy: parameter, compute and output dtypes.

    Each field is float16, bfloat16, float32 or float64; a dtype name from `get_policy`'s grammar
    ("bf16", "full", ...) is converted. The casts map every float16, bfloat16 and float32 tensor
    in a pytree to the field's dtype. They never narrow a float64 tensor (a policy that names
    float64 widens the others to it), and they pass complex, float8, integer, boolean and
    non-tensor leaves (Python scalars included) through unchanged. A tensor a tree holds
    more than once is cast once (its places share the cast, as they shared the tensor), and a
    container none of whose tensors changes is returned as it is, the object itself, as
    `Tensor.to` returns a tensor already of the dtype.
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
        return cast_tree(tree, self.param_dtype)

    def cast_to_compute(self, tree: TreeT) -> TreeT:
        """Cast the float16/bfloat16/float32 tensors of `tree` to `compute_dtype`."""
        return cast_tree(tree, self.compute_dtype)

    def cast_to_output(self, tree: TreeT) -> TreeT:
        """Cast the float16/bfloat16/float32 tensors of `tree` to `output_dtype`."""
        return cast_tree(tree, self.output_dtype)

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
        A tree of the same structure, those leaves in `compute_dtype`; each container
            none of whose tensors changes is the one given (a module's list of cached keys
            stays the caller's list).

    Examples:
        >>> import torch, famp
        >>> tree = (torch.ones(1), torch.ones(1, dtype=torch.float64))
        >>> half, double = famp.cast_to_compute("c=f16", tree)
        >>> half.dtype, double.dtype
        (torch.float16, torch.float64)
        >>> cache = [torch.ones(1, dtype=torch.float16)]
        >>> famp.cast_to_compute("c=f16", (torch.ones(1), cache))[1] is cache
        True
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
