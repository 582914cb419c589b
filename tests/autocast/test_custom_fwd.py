"""famp.custom_fwd / famp.custom_bwd: argument checks (issue 12), one test per documented error."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import famp
from tests.helpers import assert_bitwise_equal

BAD_FWD: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"forward": 3}, TypeError, "forward must be a function .* got int 3"),
    ({"forward": "f"}, TypeError, "forward must be a function"),
    ({"rule": 3}, TypeError, "rule must be a str"),
    ({"rule": "fp32"}, ValueError, "rule must be one of keep, lower, float32, promote; got 'fp32'"),
    ({"device_type": "bogus"}, ValueError, "device_type must be a device type .* got 'bogus'"),
    ({"device_type": "cuda:0"}, ValueError, "device_type must be a device type .* got 'cuda:0'"),
    ({"device_type": torch.device("cpu")}, TypeError, "device_type must be None or a str"),
]


@pytest.mark.parametrize(("kwargs", "error", "match"), BAD_FWD)
def test_custom_fwd_refuses_bad_arguments_naming_them(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        famp.custom_fwd(**kwargs)


def test_custom_bwd_refuses_a_non_callable() -> None:
    with pytest.raises(TypeError, match="backward must be a function, got NoneType None"):
        famp.custom_bwd(None)  # type: ignore[type-var]


def test_custom_fwd_accepts_what_it_documents() -> None:
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x

    for device_type in (None, "cpu", "cuda"):
        decorator = famp.custom_fwd(rule="float32", device_type=device_type)
        assert callable(decorator(forward))
    assert callable(famp.custom_bwd(forward))


def _setup_context_square(forward_decorator: Any) -> Any:
    class Square(torch.autograd.Function):
        @staticmethod
        @forward_decorator
        def forward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return x * x * y

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[torch.Tensor, ...], output: Any) -> None:
            ctx.save_for_backward(*inputs)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x, y = ctx.saved_tensors
            return 2 * x * y * grad, x * x * grad

    return Square


@pytest.mark.parametrize(
    ("rule", "cast_inputs"), [("float32", torch.float32), ("lower", torch.bfloat16)]
)
def test_custom_fwd_without_ctx_casts_every_input_as_torch(
    rule: str, cast_inputs: torch.dtype
) -> None:
    # A `forward` with `setup_context` has no ctx: its first argument is an input, which torch's
    # custom_fwd casts; famp took it for a ctx and left it uncast (bfloat16 or float32 numbers).
    ours = _setup_context_square(famp.custom_fwd(rule=rule))
    theirs = _setup_context_square(torch.amp.custom_fwd(device_type="cpu", cast_inputs=cast_inputs))
    x = (torch.randn(8) * 3).to(torch.bfloat16 if rule == "float32" else torch.float32)
    y = torch.randn(8, dtype=torch.float32 if rule == "float32" else torch.bfloat16)
    results = []
    for fn in (theirs, ours):
        a, b = x.clone().requires_grad_(), y.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn.apply(a, b)
        grads = torch.autograd.grad(out.float().sum(), [a, b])
        results.append((out, *grads))
    for got, expected in zip(results[1], results[0], strict=True):
        assert got.dtype == expected.dtype
        assert torch.equal(got, expected)


def _summing(forward_decorator: Any) -> Any:
    class Summing(torch.autograd.Function):
        """`x` times the sum of the tensors inside `bag`, whatever container holds them."""

        @staticmethod
        @forward_decorator
        def forward(ctx: Any, x: torch.Tensor, bag: Any) -> torch.Tensor:
            tensors = _tensors_in(bag)
            ctx.dtypes = [x.dtype, *(t.dtype for t in tensors)]
            total = tensors[0] * 0
            for t in tensors:
                total = total + t
            return x * total

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
            return grad, None

    return Summing


def _tensors_in(bag: Any) -> list[torch.Tensor]:
    if isinstance(bag, torch.Tensor):
        return [bag]
    if isinstance(bag, dict):
        return [t for item in bag.items() for t in _tensors_in(item)]
    if isinstance(bag, (str, bytes)):
        return []
    return [t for v in bag for t in _tensors_in(v)]


BAGS: dict[str, Any] = {
    "set": lambda ts: set(ts),
    "frozenset": lambda ts: frozenset(ts),
    "dict_keys_and_values": lambda ts: {ts[0]: ts[1], "k": ts[2]},
    "deque": lambda ts: __import__("collections").deque(ts),
    "generator": lambda ts: (t for t in ts),
    "nested_set_in_list": lambda ts: [ts[0], {ts[1], ts[2]}],
    "with_a_string": lambda ts: ["ab", *ts],
}


# "promote" cannot read a generator's tensors before the cast reads them (documented).
@pytest.mark.parametrize(
    ("rule", "cast_inputs", "bag"),
    [
        (rule, cast_inputs, bag)
        for rule, cast_inputs in [
            ("float32", torch.float32),
            ("lower", torch.bfloat16),
            ("promote", torch.float32),
        ]
        for bag in sorted(BAGS)
        if (rule, bag) != ("promote", "generator")
    ],
)
def test_custom_fwd_casts_tensors_in_every_container_torch_casts(
    bag: str, rule: str, cast_inputs: torch.dtype
) -> None:
    # torch's custom_fwd also casts a mapping's tensor keys and the tensors of any other iterable
    # (which it hands on as a generator); famp cast only lists, tuples and dict values, so such
    # tensors reached forward in their own dtype: other numbers than torch's. "promote" finds the
    # widest dtype among them all (one float32 tensor inside the container): torch's float32 cast.
    ours = _summing(famp.custom_fwd(rule=rule))
    theirs = _summing(torch.amp.custom_fwd(device_type="cpu", cast_inputs=cast_inputs))
    other = torch.float32 if rule == "lower" else torch.bfloat16
    dtypes = [torch.float32 if rule == "promote" and i == 2 else other for i in range(3)]
    tensors = [
        torch.randn(6, generator=torch.Generator().manual_seed(i)).to(d)
        for i, d in enumerate(dtypes)
    ]
    x = torch.randn(6, generator=torch.Generator().manual_seed(9)).to(other)
    results = []
    for fn in (theirs, ours):
        a = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn.apply(a, BAGS[bag](tensors))
        (grad,) = torch.autograd.grad(out.float().sum(), [a])
        results.append((out, grad, out.grad_fn.dtypes))  # type: ignore[union-attr]
    (out, grad, dtypes), (expected_out, expected_grad, expected_dtypes) = results[1], results[0]
    assert dtypes == expected_dtypes == [cast_inputs] * 4
    assert out.dtype == expected_out.dtype
    assert torch.equal(out, expected_out)
    assert grad.dtype == expected_grad.dtype
    assert torch.equal(grad, expected_grad)


def _torch_decorated(cast_inputs: torch.dtype | None) -> Any:
    """A matmul Function with torch's own `custom_fwd` / `custom_bwd`, recording the autocast
    state each of its passes saw."""

    class MatMul(torch.autograd.Function):
        seen: ClassVar[list[tuple[bool, torch.dtype]]] = []

        @staticmethod
        @torch.amp.custom_fwd(device_type="cpu", cast_inputs=cast_inputs)
        def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            MatMul.seen.append((torch.is_autocast_enabled("cpu"), x.dtype))
            ctx.save_for_backward(x, w)
            return x @ w.t()

        @staticmethod
        @torch.amp.custom_bwd(device_type="cpu")
        def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            MatMul.seen.append((torch.is_autocast_enabled("cpu"), g.dtype))
            x, w = ctx.saved_tensors
            return g @ w, g.t() @ x

    return MatMul


class _Block(torch.nn.Module):
    """`reentrant`: None, or the body checkpointed (reentrant or not), recomputed in backward."""

    def __init__(self, function: Any, reentrant: bool | None) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8) / 3)
        self.function = function
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reentrant is None:
            return self.body(x)
        out: torch.Tensor = checkpoint(self.body, x, use_reentrant=self.reentrant)
        return out

    def body(self, x: torch.Tensor) -> torch.Tensor:
        # Code that reads the autocast state, as attention kernels' wrappers do.
        if torch.is_autocast_enabled("cpu"):
            x = x * 1.5
        return torch.tanh(self.function.apply(x, self.w))


@pytest.mark.parametrize("reentrant", [None, True, False])
@pytest.mark.parametrize("cast_inputs", [None, torch.float16])
@pytest.mark.parametrize(("rule", "inner"), [("f32", None), ("c=f16,o=bf16", torch.float16)])
def test_torch_custom_fwd_and_code_inside_a_matched_module_see_the_modules_state(
    rule: str, inner: torch.dtype | None, cast_inputs: torch.dtype | None, reentrant: bool | None
) -> None:
    # Inside a module a rule matches, torch's own autocast state is the rule's: torch's custom_fwd
    # records it (custom_bwd runs backward under it, cast_inputs casts by it) and code reading
    # torch.is_autocast_enabled sees it. famp had set the rule's state around each op only: the
    # backward ran in bfloat16 where torch.autocast nested by hand runs it in float32. Also with
    # the module's body checkpointed: the recomputation sees the same state (torch's checkpoint
    # restores the state it found, which is the module's).
    torch.manual_seed(0)
    block = _Block(_torch_decorated(cast_inputs), reentrant)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), block)
    x = torch.randn(4, 8)

    def grads(out: torch.Tensor) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        out.float().sum().backward()  # reentrant checkpointing refuses autograd.grad
        return [out.detach(), *(p.grad for p in model.parameters() if p.grad is not None)]

    function = model[1].function
    function.seen.clear()
    actual = grads(famp.autocast(model, "c=bf16,o=f32", module_rules={"1": rule})(x))
    seen = list(function.seen)
    function.seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = model[0](x)
        with torch.autocast("cpu", dtype=inner or torch.bfloat16, enabled=inner is not None):
            out = model[1](h.to(inner or torch.float32))
        out = out.to(torch.bfloat16 if inner else torch.float32).float()
    expected = grads(out)
    assert seen == function.seen
    assert len(actual) == len(expected) == 4  # the output and four gradients
    for a, e in zip(actual, expected, strict=True):
        assert_bitwise_equal(a, e)
