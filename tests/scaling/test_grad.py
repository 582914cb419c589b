"""`famp.value_and_grad` eagerly, outside transforms: torch.func.grad's results, through autograd.

The oracle is `torch.func.grad` itself, around the same scaled loss: values, gradients and
found_inf bit for bit, and what torch.func.grad gives beyond values (graphs kept for tensors
that require grad outside the call, zeros for unused inputs, one forward).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import optree
import pytest
import torch
from torch.func import functional_call
from torch.nn import functional

import famp
from famp._compat import functorch_transforms_active
from tests.helpers import assert_bitwise_equal, assert_trees_bitwise_equal

POLICY = famp.get_policy("params=float32,compute=bfloat16,output=float32")


def oracle(
    fn: Callable[..., Any],
    state: famp.ScalerState,
    argnums: int | tuple[int, ...],
    has_aux: bool,
    *args: Any,
    **kwargs: Any,
) -> tuple[Any, Any, torch.Tensor]:
    """value, grads, found_inf: torch.func.grad around the scaled loss, then famp's unscale."""

    def scaled(*a: Any, **k: Any) -> tuple[torch.Tensor, Any]:
        out = fn(*a, **k)
        loss, aux = out if has_aux else (out, ())
        return famp.scale(state, loss).reshape(()), (loss, aux)

    grads, (loss, aux) = torch.func.grad(scaled, argnums=argnums, has_aux=True)(*args, **kwargs)
    grads, found_inf = famp.unscale_and_check(state, grads)
    return ((loss, aux) if has_aux else loss), grads, found_inf


def cnn() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 4 * 4, 10),
    )


def transformer() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
        torch.nn.Flatten(),
        torch.nn.Linear(16 * 5, 10),
    )


CASES = {
    "cnn": (cnn, lambda: torch.randn(6, 1, 8, 8)),
    "transformer": (transformer, lambda: torch.randn(6, 5, 16)),
}


@pytest.mark.parametrize("model_name", list(CASES))
@pytest.mark.parametrize("argnums", [0, (0, 1)])
@pytest.mark.parametrize("has_aux", [False, True])
@pytest.mark.parametrize("overflow", [False, True])
def test_eager_value_and_grad_equals_torch_func_grad_bitwise(
    model_name: str, argnums: int | tuple[int, ...], has_aux: bool, overflow: bool
) -> None:
    build, make_x = CASES[model_name]
    model = build()
    forward = famp.autocast(lambda p, x: functional_call(model, p, (x,)), POLICY)
    transformed: list[bool] = []

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor, *, y: torch.Tensor) -> Any:
        transformed.append(functorch_transforms_active())
        logits = forward(params, x)
        loss = functional.cross_entropy(logits, y)
        return (loss, {"logits": logits, "n": [y]}) if has_aux else loss

    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x, y = make_x(), torch.randint(0, 10, (6,))
    if overflow:
        x.view(-1)[7] = torch.inf
    state = famp.init_scaler(2.0**16)
    value, grads, found_inf, new_state = famp.value_and_grad(loss_fn, argnums, has_aux)(
        state, params, x, y=y
    )
    assert transformed == [False]  # the eager path ran, once, outside any transform
    expected_value, expected_grads, expected_found = oracle(
        loss_fn, state, argnums, has_aux, params, x, y=y
    )
    assert_trees_bitwise_equal(value, expected_value, autograd=True)
    assert_trees_bitwise_equal(grads, expected_grads, autograd=True)
    assert_bitwise_equal(found_inf, expected_found)
    assert found_inf.item() == float(overflow)
    assert_bitwise_equal(new_state.scale, famp.update_scale(state, expected_found).scale)
    assert all(g.dtype == torch.float32 for g in optree.tree_leaves(grads))


def test_unused_inputs_and_a_loss_independent_of_them_get_zeros_as_torch_func_grad() -> None:
    state = famp.init_scaler(8.0)

    def uses_only_b(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (b * b).sum()

    def constant(a: torch.Tensor) -> torch.Tensor:
        return torch.ones((), dtype=torch.float32)

    a, b = torch.randn(3), torch.randn(2)
    for fn, args, argnums in ((uses_only_b, (a, b), (0, 1)), (constant, (a,), 0)):
        value, grads, found_inf, _ = famp.value_and_grad(fn, argnums)(state, *args)
        expected_value, expected_grads, expected_found = oracle(fn, state, argnums, False, *args)
        assert_trees_bitwise_equal(value, expected_value, autograd=True)
        assert_trees_bitwise_equal(grads, expected_grads, autograd=True)
        assert_bitwise_equal(found_inf, expected_found)


@pytest.mark.parametrize("requires_grad", ["nothing", "a closure", "a leaf made inside"])
def test_an_empty_tree_of_inputs_gets_an_empty_tree_of_grads_as_torch_func_grad(
    requires_grad: str,
) -> None:
    # torch.func.grad returns an empty tree, or raises where its own autograd call has a graph
    # to differentiate and no inputs; famp's eager path (plain autograd) must do the same.
    w = torch.full((3,), 2.0, requires_grad=True)

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if requires_grad == "a closure":
            x = w * x
        elif requires_grad == "a leaf made inside":
            x = torch.ones(3, requires_grad=True) * x
        return x.sum()

    state, x = famp.init_scaler(8.0), torch.arange(3.0)
    if requires_grad == "a leaf made inside":  # torch.func.grad's autograd call refuses it
        with pytest.raises(RuntimeError) as from_torch:
            oracle(loss_fn, state, 0, False, {}, x)
        with pytest.raises(RuntimeError) as from_famp:
            famp.value_and_grad(loss_fn)(state, {}, x)
        assert str(from_famp.value) == str(from_torch.value)
        return
    value, grads, found_inf, _ = famp.value_and_grad(loss_fn)(state, {}, x)
    expected_value, expected_grads, expected_found = oracle(loss_fn, state, 0, False, {}, x)
    assert grads == expected_grads == {}
    assert_bitwise_equal(value, expected_value)
    assert value.requires_grad == expected_value.requires_grad
    assert_bitwise_equal(found_inf, expected_found)


def skeleton(tree: Any) -> Any:
    """A tree's containers as they are: types, and dict keys in their order (optree sorts them)."""
    if isinstance(tree, dict):
        return (type(tree), [(k, skeleton(v)) for k, v in tree.items()])
    if isinstance(tree, (list, tuple)):
        return (type(tree), [skeleton(v) for v in tree])
    return type(tree)


Point = collections.namedtuple("Point", "x y")


@pytest.mark.parametrize(
    "make",
    [
        lambda t: {"z": t(3), "a": t(2), "m": t(1)},  # insertion order, not sorted
        lambda t: {"b": [t(2), (t(3), {"y": t(1), "x": t(2)})], "a": ()},
        lambda t: (t(2), [t(3)], {}),
        lambda t: [t(4)],
        lambda t: {"p": Point(t(2), t(3)), "q": [t(1)]},  # a namedtuple: torch's pytree walks it
        lambda t: collections.OrderedDict([("w", t(2)), ("b", t(1))]),
        lambda t: t(5),
    ],
)
@pytest.mark.parametrize("has_aux", [False, True])
def test_argument_containers_come_back_as_torch_func_grad_returns_them(
    make: Callable[[Callable[[int], torch.Tensor]], Any], has_aux: bool
) -> None:
    # The eager path walks plain dicts, lists and tuples by hand and the rest with torch's
    # pytree; both must give torch.func.grad's containers, key order and leaf order.
    gen = torch.Generator().manual_seed(0)
    tree = make(lambda n: torch.randn(n, generator=gen))
    weights = optree.tree_map(lambda x: torch.rand(x.shape, generator=gen), tree)
    state = famp.init_scaler(2.0**4)

    def loss_fn(params: Any) -> Any:
        pairs = zip(optree.tree_leaves(params), optree.tree_leaves(weights), strict=True)
        loss = sum((p * w).sum() for p, w in pairs)
        return (loss, {"b": [params], "a": (loss,)}) if has_aux else loss

    value, grads, found_inf, _ = famp.value_and_grad(loss_fn, has_aux=has_aux)(state, tree)
    expected_value, expected_grads, expected_found = oracle(loss_fn, state, 0, has_aux, tree)
    assert skeleton(grads) == skeleton(expected_grads) == skeleton(tree)
    assert skeleton(value) == skeleton(expected_value)
    assert_trees_bitwise_equal(grads, expected_grads, autograd=True)
    assert_trees_bitwise_equal(value, expected_value, autograd=True)
    assert_bitwise_equal(found_inf, expected_found)


@pytest.mark.parametrize("overflow", [False, True])
def test_sparse_embedding_grads_equal_torch_func_grads(overflow: bool) -> None:
    # Embedding(sparse=True) gives a sparse COO gradient: the eager path unscales it among the
    # dense ones, as the list autograd returns, and builds the same tree as torch.func.grad.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    if overflow:
        params["0.weight"][2, 1] = torch.inf
    idx = torch.tensor([[1, 2, 2], [7, 1, 0]])

    def loss_fn(p: dict[str, torch.Tensor]) -> torch.Tensor:
        return functional_call(model, p, (idx,)).square().mean()

    state = famp.init_scaler(2.0**12)
    value, grads, found_inf, _ = famp.value_and_grad(loss_fn)(state, params)
    expected_value, expected_grads, expected_found = oracle(loss_fn, state, 0, False, params)
    assert grads["0.weight"].layout == expected_grads["0.weight"].layout == torch.sparse_coo
    assert list(grads) == list(expected_grads) == list(params)
    for key in params:
        assert_bitwise_equal(grads[key], expected_grads[key])
    assert_bitwise_equal(value, expected_value)
    assert_bitwise_equal(found_inf, expected_found)
    assert found_inf.item() == float(overflow)
    # And GradScaler's own unscale of the module's .grad, after scaler.scale(loss).backward().
    model.load_state_dict(params)
    _assert_as_gradscaler(model, lambda: model(idx).square().mean(), 2.0**12, grads, found_inf)


def test_a_closure_that_requires_grad_keeps_torch_func_grads_graphs() -> None:
    # MAML-style: the outer parameter w is a closure of the loss; torch.func.grad's gradients,
    # loss and aux carry graphs to w, and second-order gradients flow through them.
    state = famp.init_scaler(4.0)
    x = torch.randn(5)

    def run(use_famp: bool) -> tuple[Any, ...]:
        w = torch.linspace(-1.0, 1.0, 5, requires_grad=True)

        def loss_fn(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            loss = ((v * w).sin() * x).sum()
            return loss, loss * 2

        if use_famp:
            (loss, aux), grads, _, _ = famp.value_and_grad(loss_fn, has_aux=True)(state, x)
        else:
            (loss, aux), grads, _ = oracle(loss_fn, state, 0, True, x)
        (outer,) = torch.autograd.grad((grads**2).sum() + loss + aux, w)
        return loss, aux, grads, outer

    for actual, expected in zip(run(True), run(False), strict=True):
        assert actual.requires_grad == expected.requires_grad
        assert_bitwise_equal(actual.detach(), expected.detach())


def test_an_input_that_requires_grad_gets_torch_func_grads_results() -> None:
    state = famp.init_scaler(4.0)
    w = torch.nn.Parameter(torch.randn(4))

    def loss_fn(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (v * v).sum(), v.sum()

    (loss, aux), grads, _, _ = famp.value_and_grad(loss_fn, has_aux=True)(state, w)
    (e_loss, e_aux), e_grads, _ = oracle(loss_fn, state, 0, True, w)
    for actual, expected in ((loss, e_loss), (aux, e_aux), (grads, e_grads)):
        assert actual.requires_grad == expected.requires_grad
        assert_bitwise_equal(actual.detach(), expected.detach())


def test_dropout_runs_the_forward_once_with_torch_func_grads_random_numbers() -> None:
    state = famp.init_scaler(2.0**10)

    def loss_fn(v: torch.Tensor) -> torch.Tensor:
        return functional.dropout(v, 0.5, training=True).square().sum()

    v = torch.randn(64)
    torch.manual_seed(3)
    value, grads, _, _ = famp.value_and_grad(loss_fn)(state, v)
    after = torch.rand(())
    torch.manual_seed(3)
    e_value, e_grads, _ = oracle(loss_fn, state, 0, False, v)
    assert_bitwise_equal(torch.rand(()), after)  # the same random numbers were drawn
    assert_bitwise_equal(value, e_value)
    assert_bitwise_equal(grads, e_grads)


@pytest.mark.parametrize("context", ["no_grad", "inference_mode", "enable_grad"])
def test_grad_modes_give_torch_func_grads_results(context: str) -> None:
    state = famp.init_scaler(2.0**10)
    v = torch.randn(4)

    def loss_fn(p: torch.Tensor) -> torch.Tensor:
        return (p.exp() * p).sum()

    mode = {
        "no_grad": torch.no_grad,
        "inference_mode": torch.inference_mode,
        "enable_grad": torch.enable_grad,
    }[context]
    with mode():
        value, grads, found_inf, _ = famp.value_and_grad(loss_fn)(state, v)
        e_value, e_grads, e_found = oracle(loss_fn, state, 0, False, v)
    assert_bitwise_equal(value, e_value)
    assert_bitwise_equal(grads, e_grads)
    assert_bitwise_equal(found_inf, e_found)


def test_an_aux_with_a_non_tensor_leaf_is_refused_on_every_path() -> None:
    # torch.func.grad refuses it; the eager path must not accept what compiled steps refuse.
    def loss_fn(v: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return v.sum(), {"n": 3}

    step = famp.value_and_grad(loss_fn, has_aux=True)
    with pytest.raises(TypeError, match=r"aux must be a pytree of tensors.*int leaf: 3"):
        step(famp.init_scaler(), torch.ones(2))
    with pytest.raises(TypeError, match="aux must be a pytree of tensors"):
        torch.func.vmap(step, in_dims=(None, 0))(famp.init_scaler(), torch.ones(3, 2))


class OptreePair:
    """A container of two tensors registered with optree only (as JAX-style code may do)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.a, self.b = a, b


optree.register_pytree_node(
    OptreePair,  # type: ignore[arg-type]
    lambda p: ((p.a, p.b), None, None),
    lambda _, leaves: OptreePair(*leaves),
    namespace="famp-tests",
)


def test_arguments_flatten_as_torch_func_grad_flattens_them() -> None:
    # Why grad.py walks the differentiated arguments with torch's pytree, not optree:
    # torch.func.grad (the path under vmap and torch.compile) flattens them with torch's pytree,
    # so a container only optree knows is refused there; the eager path must refuse it too,
    # not accept eagerly what the same step refuses once compiled.
    state = famp.init_scaler(2.0**8)

    def loss_fn(p: OptreePair) -> torch.Tensor:
        return (p.a * p.b).sum()

    p = OptreePair(torch.randn(3), torch.randn(3))
    assert len(optree.tree_leaves(p, namespace="famp-tests")) == 2  # optree sees the tensors
    with pytest.raises(ValueError, match="must be Tensor") as from_torch:
        oracle(loss_fn, state, 0, False, p)
    with pytest.raises(ValueError, match="must be Tensor") as from_famp:
        famp.value_and_grad(loss_fn)(state, p)
    assert str(from_famp.value) == str(from_torch.value)


@pytest.mark.parametrize("argnums", [(0, 0), (0, -2), 2, (1, 5)])
def test_argnums_that_torch_func_grad_refuses_are_refused_eagerly_too(argnums: Any) -> None:
    # Repeated (also through a negative index) or out of range: the eager path must not answer
    # where torch.func.grad raises (a repeated argnum would silently get zero gradients).
    def loss_fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a * b).sum()

    args = (torch.ones(2), torch.full((2,), 3.0))
    with pytest.raises(RuntimeError) as from_torch:
        oracle(loss_fn, famp.init_scaler(4.0), argnums, False, *args)
    with pytest.raises(RuntimeError) as from_famp:
        famp.value_and_grad(loss_fn, argnums)(famp.init_scaler(4.0), *args)
    assert str(from_famp.value) == str(from_torch.value)


def _checkpointed_loss(reentrant: bool | None) -> Callable[..., torch.Tensor]:
    from torch.utils.checkpoint import checkpoint

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if reentrant is None:
            h = torch.tanh(x @ p["a"])
        else:
            h = checkpoint(lambda h: torch.tanh(h @ p["a"]), x, use_reentrant=reentrant)
        return (h @ p["b"]).square().sum()

    return loss_fn


def test_a_non_reentrant_checkpoint_gives_the_gradients_of_no_checkpoint() -> None:
    # torch.func.grad refuses saved-tensor hooks; eagerly famp differentiates through them, and
    # the gradients must be those of the same loss without checkpointing, bit for bit.
    gen = torch.Generator().manual_seed(0)
    p = {"a": torch.randn(4, 4, generator=gen), "b": torch.randn(4, 4, generator=gen)}
    x, state = torch.randn(3, 4, generator=gen), famp.init_scaler(2.0**8)
    value, grads, found_inf, _ = famp.value_and_grad(_checkpointed_loss(False))(state, p, x)
    e_value, e_grads, e_found = oracle(_checkpointed_loss(None), state, 0, False, p, x)
    assert_bitwise_equal(value, e_value)
    assert_trees_bitwise_equal(grads, e_grads, autograd=True)
    assert_bitwise_equal(found_inf, e_found)


def test_a_reentrant_checkpoint_without_grad_inputs_warns_as_torch_does() -> None:
    # torch's reentrant checkpoint drops the gradients of a block whose inputs do not require
    # grad (plain backward() leaves them None) and says so; famp passes torch's warning on and
    # gives the zeros of an unused input (docs/loss-scaling.md). torch.func.grad refuses it.
    p = {"a": torch.ones(4, 4), "b": torch.ones(4, 4)}
    x, state = torch.ones(3, 4), famp.init_scaler(2.0**8)
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad=True"):
        _, grads, _, _ = famp.value_and_grad(_checkpointed_loss(True))(state, p, x)
    assert torch.count_nonzero(grads["a"]) == 0
    assert torch.count_nonzero(grads["b"]) > 0


@pytest.mark.parametrize("outside", [True, False])
@pytest.mark.parametrize("inside", [True, False])
def test_grad_mode_after_the_call_is_torch_func_grads_whatever_the_loss_leaves(
    outside: bool, inside: bool
) -> None:
    # A loss that switches grad mode and returns (a metrics helper that forgets to switch back):
    # torch.func.grad restores the mode the call found. Before 2026-12-01 the eager path left
    # it off after a loss that switched it off.
    state, v = famp.init_scaler(2.0**10), torch.randn(4)

    def loss_fn(p: torch.Tensor) -> torch.Tensor:
        loss = (p.sin() * p).sum()
        torch.set_grad_enabled(inside)
        return loss

    try:
        torch.set_grad_enabled(outside)
        e_value, e_grads, e_found = oracle(loss_fn, state, 0, False, v)
        expected_mode = torch.is_grad_enabled()
        torch.set_grad_enabled(outside)
        value, grads, found_inf, _ = famp.value_and_grad(loss_fn)(state, v)
        mode = torch.is_grad_enabled()
    finally:
        torch.set_grad_enabled(True)
    assert mode == expected_mode == outside
    assert_bitwise_equal(value, e_value)
    assert_bitwise_equal(grads, e_grads)
    assert_bitwise_equal(found_inf, e_found)


@pytest.mark.parametrize("made_in_inference_mode", ["params", "x", "x as keyword", "state"])
@pytest.mark.parametrize("overflow", [False, True])
def test_inference_tensors_get_torch_func_grads_and_gradscalers_results(
    made_in_inference_mode: str, overflow: bool
) -> None:
    # Plain autograd cannot differentiate an inference tensor or save one for backward, where
    # torch.func.grad can: such calls take torch.func.grad. Before 2026-12-01 eager famp raised
    # ("Setting requires_grad=True on inference tensor outside InferenceMode", "Inference
    # tensors cannot be saved for backward").
    model = cnn()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x = torch.randn(6, 1, 8, 8)
    if overflow:
        x.view(-1)[7] = torch.inf
    y = torch.randint(0, 10, (6,))
    state = famp.init_scaler(2.0**16)
    args: dict[str, Any] = {"params": params, "x": x, "state": state}
    key = made_in_inference_mode.split()[0]
    with torch.inference_mode():
        args[key] = optree.tree_map(torch.clone, args[key])
    assert all(t.is_inference() for t in optree.tree_leaves(args[key]))

    def loss_fn(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return functional.cross_entropy(functional_call(model, p, (x,)), y)

    step = famp.value_and_grad(loss_fn)
    if made_in_inference_mode == "x as keyword":
        value, grads, found_inf, new_state = step(args["state"], args["params"], x=args["x"], y=y)
    else:
        value, grads, found_inf, new_state = step(args["state"], args["params"], args["x"], y)
    e_value, e_grads, e_found = oracle(loss_fn, state, 0, False, params, x, y)
    assert_bitwise_equal(value, e_value)
    assert_trees_bitwise_equal(grads, e_grads)
    assert_bitwise_equal(found_inf, e_found)
    assert found_inf.item() == float(overflow)
    assert_bitwise_equal(new_state.scale, famp.update_scale(state, e_found).scale)
    # And GradScaler's unscale of the module's .grad, after scaler.scale(loss).backward().
    loss = lambda: loss_fn(dict(model.named_parameters()), x, y)  # noqa: E731
    _assert_as_gradscaler(model, loss, 2.0**16, grads, found_inf)


def test_an_inference_tensor_read_from_a_closure_is_refused_with_the_way_out() -> None:
    # Where fn reads it from outside its arguments, famp cannot see it before plain autograd
    # refuses to save it (torch.func.grad saves it): famp's error names the workaround.
    with torch.inference_mode():
        frozen = torch.randn(4, 4)
    state, w = famp.init_scaler(2.0**8), torch.randn(4, 4)

    def loss_fn(w: torch.Tensor) -> torch.Tensor:
        return (w @ frozen).sin().sum()

    oracle(loss_fn, state, 0, False, w)  # torch.func.grad differentiates it
    with pytest.raises(RuntimeError, match=r"pass it as an argument") as caught:
        famp.value_and_grad(loss_fn)(state, w)
    assert "Inference tensors cannot be saved for backward" in str(caught.value.__cause__)
    frozen_arg = famp.value_and_grad(lambda w, f: (w @ f).sin().sum())(state, w, frozen)
    assert_bitwise_equal(frozen_arg[1], oracle(loss_fn, state, 0, False, w)[1])


class _RoundSTE(torch.autograd.Function):
    """A straight-through estimator: `round` forward, the identity backward."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.round(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


# Dynamo's own tracing of torch.func.grad over an autograd.Function instantiates the Function
# (seen with torch 2.13), which torch deprecates.
@pytest.mark.filterwarnings("ignore:<class 'torch.autograd.function.Function'> should not be")
def test_a_custom_backward_is_honoured_eagerly_and_compiled_as_torch_func_grad_compiled() -> None:
    # A known limit of torch (docs/loss-scaling.md, pytorch/pytorch#193279): compiled,
    # torch.func.grad drops an autograd.Function's custom backward before torch 2.15 and
    # differentiates its forward (round: zeros), silently. famp compiled differentiates with
    # torch.func.grad, so it gives what torch gives; eagerly, plain autograd's (the backward).
    weights = torch.tensor([1.0, 2.0, 3.0])

    def loss_fn(w: torch.Tensor) -> torch.Tensor:
        return (_RoundSTE.apply(w) * weights).sum()

    state, w = famp.init_scaler(2.0**10), torch.tensor([0.3, 1.7, -2.2])
    _, grads, _, _ = famp.value_and_grad(loss_fn)(state, w)
    assert_bitwise_equal(grads, oracle(loss_fn, state, 0, False, w)[1])
    assert_bitwise_equal(grads, weights)
    torch._dynamo.reset()
    step = torch.compile(famp.value_and_grad(loss_fn), backend="aot_eager", fullgraph=True)
    compiled = step(state, w)[1]
    torch._dynamo.reset()
    by_torch = torch.compile(torch.func.grad(loss_fn), backend="aot_eager", fullgraph=True)(w)
    torch._dynamo.reset()
    assert_bitwise_equal(compiled, by_torch)
    expected = weights if torch.__version__ >= "2.15" else torch.zeros(3)
    assert_bitwise_equal(compiled, expected)


def _assert_as_gradscaler(
    model: torch.nn.Module, loss: Any, init_scale: float, grads: Any, found_inf: torch.Tensor
) -> None:
    """GradScaler's own unscale of `model`'s .grad after `scaler.scale(loss()).backward()` gives
    `grads` (by parameter name) and `found_inf`, bit for bit."""
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.scale(loss()).backward()
    scaler.unscale_(opt)
    for name, param in model.named_parameters():
        assert param.grad is not None
        assert_bitwise_equal(grads[name], param.grad)
    assert_bitwise_equal(found_inf, scaler._found_inf_per_device(opt)[torch.device("cpu")])
