"""`custom_fwd` / `custom_bwd` for custom autograd Functions under famp's autocast.

torch's `torch.amp.custom_fwd(cast_inputs=dtype)` can only cast to one fixed dtype. famp's version
gives a custom Function the same rules as ops ("keep", "lower", "float32", "promote"), follows the
autocast state in effect (a famp policy, a famp module rule, or a `torch.autocast`), and
`custom_bwd` runs backward under the state the forward ran under.
"""

from __future__ import annotations

import collections.abc
import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.autograd.function import FunctionCtx

from famp._autocast.casts import eligible, promote_dtype
from famp._autocast.region import current_state, region

F = TypeVar("F", bound=Callable[..., Any])
_RULES = ("keep", "lower", "float32", "promote")


def _cast(value: Any, device_type: str, dtype: torch.dtype) -> Any:
    # torch.amp.autocast_mode._cast, case for case: a mapping's keys are cast too, and an iterable
    # that is neither a list nor a tuple (a set, a deque, a generator) becomes a generator of its
    # cast elements; strings and numpy arrays pass.
    if isinstance(value, torch.Tensor):
        return value.to(dtype=dtype) if eligible(value, device_type) else value
    if isinstance(value, (str, bytes)) or _ndarray(value):
        return value
    if isinstance(value, collections.abc.Mapping):
        return {
            _cast(k, device_type, dtype): _cast(v, device_type, dtype) for k, v in value.items()
        }
    if isinstance(value, collections.abc.Iterable):
        cast = (_cast(v, device_type, dtype) for v in value)
        return type(value)(cast) if isinstance(value, (list, tuple)) else cast
    return value


def _ndarray(value: object) -> bool:
    numpy = sys.modules.get("numpy")  # not imported: no value can be an array
    return numpy is not None and isinstance(value, numpy.ndarray)


def _leaves(value: Any) -> list[torch.Tensor]:
    """The tensors `_cast` casts, but those of iterables that are not collections (generators,
    data loaders): reading them could consume them, or run a loader, before the cast does."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (str, bytes)) or _ndarray(value):
        return []
    if isinstance(value, collections.abc.Mapping):
        return [t for item in value.items() for t in _leaves(item)]
    if isinstance(value, collections.abc.Collection):
        return [t for v in value for t in _leaves(v)]
    return []


def _device_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    for t in _leaves((args, kwargs)):
        return t.device.type
    return "cpu"


def _check_device_type(device_type: object) -> None:
    if device_type is None:
        return
    if not isinstance(device_type, str):
        raise TypeError(f"device_type must be None or a str, got {type(device_type).__name__}")
    try:
        available = ":" not in device_type and torch.amp.is_autocast_available(device_type)
    except RuntimeError:  # not a device type torch knows
        available = False
    if not available:
        raise ValueError(
            "device_type must be a device type with autocast support, such as 'cpu' or 'cuda', "
            f"got {device_type!r}"
        )


def custom_fwd(
    forward: F | None = None, *, rule: str = "keep", device_type: str | None = None
) -> Any:
    """Decorate a custom autograd Function's `forward` with an autocast rule.

    Where autocast is on for the device (inside `famp.autocast`, a famp module rule, or a
    `torch.autocast`), the floating, non-float64 tensors among `forward`'s arguments are cast
    per `rule` and `forward` runs with autocast off: "lower" casts to the autocast dtype in
    effect, "float32" to float32, "promote" to the widest floating dtype among them; "keep"
    casts nothing and runs `forward` under the current autocast state. Where autocast is off,
    `forward` runs unchanged. `rule="float32"` is torch's `custom_fwd(cast_inputs=torch.float32)`,
    and `rule="keep"` its `cast_inputs=None`. Tensors inside containers are cast where torch's
    `custom_fwd` casts them: a mapping's keys and values, the elements of any iterable but a
    string or a numpy array (one that is not a list or a tuple reaches `forward` as a generator;
    "promote", and `device_type=None`, do not read an iterable that is not a collection, such as
    a generator, which only the cast reads). A `forward` without ctx (a Function
    with `setup_context`) has all its arguments cast, as torch casts them; `custom_bwd` then has
    no forward state to restore.

    Args:
        forward: the `forward` staticmethod's function (or None, to get a decorator).
        rule: "keep", "lower", "float32" or "promote".
        device_type: the autocast device type; None uses the first tensor argument's device.

    Returns:
        The decorated `forward`, or a decorator.

    Raises:
        TypeError: `forward` is neither callable nor None, `rule` is not a str, or
            `device_type` is neither a str nor None.
        ValueError: an unknown rule, or a `device_type` that is not a device type with
            autocast support (`"bogus"`, `"cuda:0"`).

    Examples:
        >>> import torch, famp
        >>> class Square(torch.autograd.Function):
        ...     @staticmethod
        ...     @famp.custom_fwd(rule="float32")
        ...     def forward(ctx, x):
        ...         ctx.save_for_backward(x)
        ...         return x * x
        ...     @staticmethod
        ...     @famp.custom_bwd
        ...     def backward(ctx, g):
        ...         (x,) = ctx.saved_tensors
        ...         return 2 * x * g
        >>> f = famp.autocast(lambda x: Square.apply(x.bfloat16()), "c=bf16,o=bf16")
        >>> f(torch.ones(2)).dtype
        torch.bfloat16
    """
    if not isinstance(rule, str):
        raise TypeError(f"rule must be a str, one of {', '.join(_RULES)}; got {rule!r}")
    if rule not in _RULES:
        raise ValueError(f"rule must be one of {', '.join(_RULES)}; got {rule!r}")
    _check_device_type(device_type)
    if forward is not None and not callable(forward):
        raise TypeError(
            f"forward must be a function (or None, for a decorator), got "
            f"{type(forward).__name__} {forward!r}"
        )
    if forward is None:
        return functools.partial(custom_fwd, rule=rule, device_type=device_type)

    @functools.wraps(forward)
    def decorated(*args: Any, **kwargs: Any) -> Any:
        # A `forward` without ctx (one with `setup_context`): every argument is cast, as torch's
        # custom_fwd casts them, and no state is recorded (nor written onto the first argument).
        ctx = args[0] if args and isinstance(args[0], FunctionCtx) else None
        lead, args = ((ctx,), args[1:]) if ctx is not None else ((), args)
        dev = device_type or _device_of(args, kwargs)
        enabled, dtype = current_state(dev)
        casts = enabled and rule != "keep"
        if ctx is not None:
            ctx._famp_autocast = (dev, enabled and not casts, dtype)  # type: ignore[attr-defined]
        if not casts:
            if enabled:
                with region(dev, enabled, dtype):
                    return forward(*lead, *args, **kwargs)
            return forward(*lead, *args, **kwargs)
        if rule == "lower":
            target = dtype
        elif rule == "float32":
            target = torch.float32
        else:
            target = promote_dtype(dtype, _leaves((args, kwargs)), dev)
        with region(dev, False, dtype):
            return forward(*lead, *_cast(args, dev, target), **_cast(kwargs, dev, target))

    return decorated


def custom_bwd(backward: F) -> F:
    """Decorate a custom autograd Function's `backward`: run it under the forward's autocast state.

    Pairs with `famp.custom_fwd`: the backward runs with autocast on (with the same dtype) when the
    forward ran with it on ("keep" under autocast), and off otherwise, as torch's `custom_bwd`.

    Args:
        backward: the `backward` staticmethod's function.

    Returns:
        The decorated `backward`.

    Raises:
        TypeError: `backward` is not callable.

    Examples:
        >>> import famp
        >>> callable(famp.custom_bwd(lambda ctx, g: g))
        True
    """

    if not callable(backward):
        raise TypeError(f"backward must be a function, got {type(backward).__name__} {backward!r}")

    @functools.wraps(backward)
    def decorated(ctx: Any, *args: Any, **kwargs: Any) -> Any:
        state = getattr(ctx, "_famp_autocast", None)
        if state is None:
            return backward(ctx, *args, **kwargs)
        dev, enabled, dtype = state
        with region(dev, enabled, dtype):
            return backward(ctx, *args, **kwargs)

    return decorated  # type: ignore[return-value]
