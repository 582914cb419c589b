"""Running an op under torch's autocast next to the reference of each rule, and comparing.

`check_op` runs one overload on its sample (`samples.py`) in every input variant, under torch's
autocast and under the reference (`reference.py`) for each candidate rule, and keeps the rules
whose casts, dtypes (and, on real tensors, bits) and errors are torch's. Fake tensors reach any
device type's `Autocast<Device>` kernel without computing. `tests/autocast/test_rules.py` and
`benchmarks/verify_rules.py` use it to check the tables, `rules_derive.py` to derive them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, cast

import optree
import torch

from famp._autocast.reference import Args, apply_rule, names
from famp._autocast.samples import sample
from famp._compat import OpOverload, TorchDispatchMode, fake_tensor_mode
from famp._compat import op_schema as schema


def _map(fn: Callable[[Any], Any], args: Args) -> Args:
    """`fn` over the leaves of an op call's arguments (tensors in lists, tuples and dicts)."""
    return cast(Args, optree.tree_map(fn, cast(Any, args)))


VARIANTS = ("float32", "lower", "mixed", "float64", "given_dtype")
"""Input variants: all float32; all in the autocast dtype; the first floating input in the
autocast dtype and the rest float32; all float64 (never cast); float32 with `dtype=` given."""


def _has_dtype_arg(op: OpOverload) -> bool:
    return any(a.name == "dtype" for a in schema(op).arguments)


def variant_inputs(op: OpOverload, args: Args, variant: str, lower: torch.dtype) -> Args | None:
    """The sample in one input variant, or None where the variant does not apply."""
    seen = [0]

    def convert(x: Any) -> Any:
        if not (isinstance(x, torch.Tensor) and x.is_floating_point()):
            return x
        seen[0] += 1
        if variant == "lower" or (variant == "mixed" and seen[0] == 1):
            return x.to(lower)
        if variant == "float64":
            return x.to(torch.float64)
        return x

    a, k = _map(convert, args)
    if variant == "mixed" and seen[0] < 2:
        return None
    if variant == "given_dtype":
        if not _has_dtype_arg(op):
            return None
        k = {**k, "dtype": lower}
    return a, k


class _Trace(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records the aten ops below autocast: name, input dtypes and dtype arguments."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.calls: list[tuple[Any, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func.namespace != "prim":
            leaves: list[Any] = optree.tree_leaves(cast(Any, (args, kwargs)))
            self.calls.append(
                (
                    str(func),
                    tuple(x.dtype for x in leaves if isinstance(x, torch.Tensor)),
                    tuple(x for x in leaves if isinstance(x, torch.dtype)),
                )
            )
        return func(*args, **kwargs)


def _outcome(fn: Callable[[], Any]) -> tuple[Any, ...]:
    trace = _Trace()
    try:
        with trace:
            out = fn()
    except Exception as e:  # errors are outcomes to compare
        return ("error", type(e).__name__, str(e).split("\n\nWhile executing")[0], trace.calls)
    return ("ok", out, trace.calls)


class Autocast:
    """Turns autocast on for one device type inside the current (possibly fake) mode."""

    def __init__(self, device_type: str, dtype: torch.dtype) -> None:
        self.device_type, self.dtype = device_type, dtype

    def __enter__(self) -> None:
        self.prev = (
            torch.is_autocast_enabled(self.device_type),
            torch.get_autocast_dtype(self.device_type),
        )
        torch.set_autocast_enabled(self.device_type, True)
        torch.set_autocast_dtype(self.device_type, self.dtype)

    def __exit__(self, *exc: object) -> None:
        torch.set_autocast_enabled(self.device_type, self.prev[0])
        torch.set_autocast_dtype(self.device_type, self.prev[1])
        torch.clear_autocast_cache()


def run_both(
    rules: tuple[str, ...],
    op: OpOverload,
    args: Args,
    device_type: str,
    lower: torch.dtype,
) -> tuple[tuple[Any, ...], dict[str, tuple[Any, ...]]]:
    """torch's outcome under autocast, and the reference's outcome for each rule."""
    a, k = args

    def autocast_run() -> Any:
        with Autocast(device_type, lower):
            return op(*a, **k)

    actual = _outcome(autocast_run)

    def simulate(rule: str) -> Callable[[], Any]:
        return lambda: apply_rule(rule, op, a, k, device_type, lower)

    simulated = {r: _outcome(simulate(r)) for r in rules}
    return actual, simulated


def _bits(x: torch.Tensor) -> torch.Tensor:
    x = x.detach()
    if x.is_complex():
        x = torch.view_as_real(x.resolve_conj())
    if x.is_floating_point():
        x = x.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])
    return x


SCRATCH_OUTPUTS: dict[str, tuple[int, ...]] = {
    # oneDNN's RNN workspace: scratch memory kept for the backward pass, not a result. Where the
    # kernel really runs in bfloat16 (AVX512-BF16 CPUs) two calls on the same inputs leave
    # different bytes in it while output, hy and cy are equal bit for bit.
    "mkldnn_rnn_layer": (3,),
    # cuDNN's reserve buffer, likewise scratch for the backward pass.
    "_cudnn_rnn": (3,),
    # The dropout RNG's seed and offset (philox_seed, philox_offset), bookkeeping for the
    # backward pass: on an H100 (torch 2.11) two identical bfloat16 calls returned different ones.
    "_scaled_dot_product_flash_attention": (6, 7),
}
"""Packet → indices of outputs whose values are never compared (their dtype and shape are)."""


def same_outcome(
    actual: tuple[Any, ...],
    expected: tuple[Any, ...],
    *,
    values: bool,
    scratch: tuple[int, ...] = (),
) -> bool:
    """Same error, or same outputs (dtype, shape, device and, if `values`, bits) and casts.

    Top-level outputs at the `scratch` indices are compared without their values.
    """
    if actual[0] != expected[0] or actual[-1] != expected[-1]:
        return False
    if actual[0] == "error":
        return bool(actual[1:3] == expected[1:3])
    la, sa = optree.tree_flatten(actual[1])
    le, se = optree.tree_flatten(expected[1])
    if sa != se:
        return False
    skip: set[int] = set()
    if scratch and isinstance(actual[1], (tuple, list)):
        skip = {id(actual[1][i]) for i in scratch if i < len(actual[1])}
        skip |= {id(expected[1][i]) for i in scratch if i < len(expected[1])}
    for x, y in zip(la, le, strict=True):
        if id(x) in skip and id(y) in skip:
            if (x.dtype, x.shape, x.device) != (y.dtype, y.shape, y.device):
                return False
            continue
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if not isinstance(x, torch.Tensor):
            if x != y:
                return False
            continue
        if (x.dtype, x.shape, x.device) != (y.dtype, y.shape, y.device):
            return False
        if values and not torch.equal(_bits(x), _bits(y)):
            return False
    return True


def overload_of(name: str) -> OpOverload:
    packet, _, overload = name.partition(".")
    op: OpOverload = getattr(getattr(torch.ops.aten, packet), overload or "default")
    return op


def check_op(
    device_type: str, name: str, lower: torch.dtype, rules: tuple[str, ...], *, fake: bool
) -> tuple[set[str], int, int]:
    """Run one overload under torch's autocast and under the reference for each rule.

    Real tensors (CPU, or moved to a real device) compare bits; fake tensors (any device type: their
    `Autocast<Device>` kernels still run) compare dtypes, shapes and devices. Every run also
    compares the ops dispatched below autocast (the casts and what they feed).

    Returns:
        The rules that matched torch in every input variant, how many variants ran without an
            error under torch, and how many casts torch's kernel dispatched.
    """
    op = overload_of(name)
    with warnings.catch_warnings():
        # torch's deprecation notices for old linalg ops (torch.cholesky, ...) are not under test
        warnings.simplefilter("ignore", UserWarning)
        return _check_op(device_type, op, sample(name), lower, rules, fake=fake)


def _check_op(
    device_type: str,
    op: OpOverload,
    base: Args,
    lower: torch.dtype,
    rules: tuple[str, ...],
    *,
    fake: bool,
) -> tuple[set[str], int, int]:
    consistent, ran, casts = set(rules), 0, 0
    for variant in VARIANTS:
        inputs = variant_inputs(op, base, variant, lower)
        if inputs is None:
            continue
        if not fake:
            # Real tensors: CPU samples, moved to the device (a GPU for CUDA's real-tensor check).
            if device_type != "cpu":
                inputs = _map(
                    lambda x: x.to(device_type) if isinstance(x, torch.Tensor) else x, inputs
                )
            actual, simulated = run_both(rules, op, inputs, device_type, lower)
        else:
            with fake_tensor_mode(allow_non_fake_inputs=True):
                # Fake tensors carry no values: only dtypes and shapes are compared.
                moved = _map(
                    lambda x: (
                        torch.empty(x.shape, dtype=x.dtype, device=device_type)
                        if isinstance(x, torch.Tensor)
                        else x
                    ),
                    inputs,
                )
                actual, simulated = run_both(rules, op, moved, device_type, lower)
        ran += actual[0] == "ok"
        casts += sum(call[0] == "aten._to_copy.default" for call in actual[-1])
        scratch = SCRATCH_OUTPUTS.get(names(op)[0], ())
        consistent &= {
            r for r in rules if same_outcome(actual, simulated[r], values=not fake, scratch=scratch)
        }
    return consistent, ran, casts
