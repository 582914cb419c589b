"""Code that torch.compile compiles inside a famp call keeps eager's gradients.

AOTAutograd traces a compiled frame's backward under the autocast state the frame began in (torch's
`backward_pass_autocast="same_as_forward"`, pytorch/pytorch#179804); eager backward runs after the
call, without autocast. Inside a famp call that state is famp's (bfloat16), while famp's rules run
some ops in float32: a frame compiled there (a compiled module inside an eager call, a frame that
Dynamo resumes after a graph break, a nested call compiled on its own) differentiated those ops in
bfloat16. famp has such compiles trace their backward without autocast. The references are eager:
the same famp call uncompiled, and torch.autocast with its autocast turned off by hand where famp's
rule says float32. aot_eager runs the traced aten graphs as they are, so the bits must match.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import famp
from tests.helpers import assert_bitwise_equal

BF16 = torch.bfloat16

# torch's own warnings: Dynamo reads `.grad` of the non-leaf tensors a resumed frame receives; a
# `torch.compile(module)` wrapper called while famp's global module hooks are on fires them twice
# (famp's hooks pass over the wrapper: `famp._compat.is_compiled_module`).
pytestmark = [
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf"),
    pytest.mark.filterwarnings("ignore:Using `torch.compile\\(module\\)` when there are global"),
]


class _Break(nn.Module):
    """A module Dynamo cannot trace: the frame around it ends in a graph break."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return x


def _model(break_at: int | None = None) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [
        nn.Linear(8, 16),
        nn.ReLU(),
        nn.Sequential(nn.Linear(16, 16), nn.GELU()),  # "block": computes in float32 by rule
        nn.Linear(16, 4),
    ]
    if break_at is not None:
        layers.insert(break_at, _Break())
    return nn.Sequential(*layers)


def _x(batch: int = 4) -> torch.Tensor:
    return torch.randn(batch, 8, generator=torch.Generator().manual_seed(batch))


def _output_and_grads(
    f: Callable[[torch.Tensor], torch.Tensor], model: nn.Module, batch: int = 4
) -> list[Any]:
    model.zero_grad()
    y = f(_x(batch))
    y.float().pow(2).sum().backward()
    return [y.detach(), *(p.grad for p in model.parameters())]


def _by_hand(block_in_float32: bool = True, batch: int = 4) -> list[Any]:
    """torch.autocast(bfloat16), off inside the block: what each case below computes."""
    model = _model()
    with torch.autocast("cpu", dtype=BF16):
        h = model[1](model[0](_x(batch)))
        if block_in_float32:
            with torch.autocast("cpu", enabled=False):
                h = model[2](h.float())
        else:
            h = model[2](h)
        y = model[3](h).float()
    y.pow(2).sum().backward()
    return [y.detach(), *(p.grad for p in model.parameters())]


def _assert_all_equal(actual: list[Any], expected: list[Any]) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        assert_bitwise_equal(a, e)


def _block_rule(model: nn.Module) -> dict[str, str]:
    path = next(name for name, m in model.named_children() if isinstance(m, nn.Sequential))
    return {path: "c=f32"}


@pytest.mark.parametrize("break_at", [0, 2, 3, 4])  # before, at the block, after it, at the end
def test_frames_resumed_after_a_graph_break_keep_eager_gradients(break_at: int) -> None:
    torch.compiler.reset()
    model = _model(break_at)
    f = famp.autocast(model, "c=bf16,o=f32", module_rules=_block_rule(model))
    compiled = torch.compile(f, backend="aot_eager")
    _assert_all_equal(_output_and_grads(compiled, model), _by_hand())


def test_a_compiled_module_inside_an_eager_call_with_overrides_keeps_eager_gradients() -> None:
    torch.compiler.reset()
    model, reference = _model(), _model()
    inside = nn.Sequential(
        model[0], model[1], torch.compile(model[2], backend="aot_eager"), model[3]
    )
    rules = famp.default_rules("cpu").override({"linear": "float32", "gelu": "float32"})
    f = famp.autocast(inside, "c=bf16,o=f32", rules=rules)
    expected = famp.autocast(reference, "c=bf16,o=f32", rules=rules)
    _assert_all_equal(_output_and_grads(f, model), _output_and_grads(expected, reference))


def test_a_compiled_nested_call_inside_an_eager_call_keeps_eager_gradients() -> None:
    torch.compiler.reset()
    model = _model()
    inner = torch.compile(famp.autocast(model[2], "c=f32"), backend="aot_eager")
    f = famp.autocast(lambda x: model[3](inner(model[1](model[0](x)))), "c=bf16,o=f32")
    _assert_all_equal(_output_and_grads(f, model), _by_hand())


class _OwnAutocastOff(nn.Module):
    """A block that turns autocast off itself (as models do around a loss or rotary embeddings)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            return self.block(x.float())


def test_a_compiled_module_that_turns_autocast_off_inside_a_call_keeps_eager_gradients() -> None:
    # The same as torch.autocast around the compiled module, in eager: famp's call of a compiled
    # module is no exception to the eager reference.
    torch.compiler.reset()
    model = _model()
    own = torch.compile(_OwnAutocastOff(model[2]), backend="aot_eager")
    f = famp.autocast(lambda x: model[3](own(model[1](model[0](x)))), "c=bf16,o=f32")
    _assert_all_equal(_output_and_grads(f, model), _by_hand())


# --- the setting famp changes: only while a compile runs inside a famp call ----------------------


def _config() -> Any:
    import torch._functorch.config

    return torch._functorch.config


def _spy(seen: list[object]) -> Callable[..., Any]:
    """aot_eager, recording the backward autocast setting each compile traces with."""

    def backend(graph: torch.fx.GraphModule, inputs: list[Any]) -> Any:
        seen.append(_config().backward_pass_autocast)
        return torch._dynamo.lookup_backend("aot_eager")(graph, inputs)

    return backend


def test_compiles_outside_famp_calls_keep_torchs_setting() -> None:
    torch.compiler.reset()
    model, seen = _model(), []
    famp.autocast(model, "c=bf16,o=f32", module_rules={"2": "c=f32"})(_x())
    outside = torch.compile(lambda x: model[2](x) * 2, backend=_spy(seen))
    with torch.autocast("cpu", dtype=BF16):
        outside(torch.randn(4, 16))
    inside = torch.compile(lambda x: model[2](x) * 3, backend=_spy(seen))
    famp.autocast(lambda x: inside(model[0](x)), "c=bf16")(_x())
    assert seen == ["same_as_forward", "off"]
    assert _config().backward_pass_autocast == "same_as_forward"


def test_a_setting_of_the_users_own_is_left_as_it_is() -> None:
    torch.compiler.reset()
    model, seen = _model(), []
    setting = [{"device_type": "cpu"}]  # backward under autocast(cpu), as a user may want
    with _config().patch(backward_pass_autocast=setting):
        inside = torch.compile(model, backend=_spy(seen))
        famp.autocast(inside, "c=bf16", module_rules={"2": "c=f32"})(_x())
        assert seen == [setting]
        assert _config().backward_pass_autocast == setting


def test_after_a_compiler_reset_and_a_recompile_calls_keep_eager_gradients() -> None:
    # torch.compiler.reset() drops Dynamo's compile callbacks, famp's among them (registered by
    # any call once Dynamo is loaded, the eager one here); a new batch size then recompiles the
    # frames (with dynamic sizes, as Dynamo does on a second shape).
    torch.compiler.reset()
    model = _model(break_at=4)
    f = famp.autocast(model, "c=bf16,o=f32", module_rules=_block_rule(model))
    f(_x())
    torch.compiler.reset()
    compiled = torch.compile(f, backend="aot_eager")
    for batch in (4, 6, 5):
        _assert_all_equal(_output_and_grads(compiled, model, batch), _by_hand(batch=batch))


def test_fsdp2_graph_breaks_inside_a_compiled_call_keep_eager_gradients(one_rank_mesh: Any) -> None:
    # FSDP2's hooks break Dynamo's graphs: each sharded module's forward is a resumed frame.
    from torch.distributed.fsdp import fully_shard

    results = []
    for compiled in (False, True):
        torch.compiler.reset()
        model = _model()
        fully_shard(model[2], mesh=one_rank_mesh)
        fully_shard(model, mesh=one_rank_mesh)
        f = famp.autocast(model, "c=bf16,o=f32", module_rules={"2": "c=f32"})
        if compiled:
            f = torch.compile(f, backend="aot_eager")
        y = f(_x())
        y.float().pow(2).sum().backward()
        grads = [p.grad.full_tensor() for p in model.parameters()]  # type: ignore[union-attr]
        results.append([y.detach(), *grads])
    _assert_all_equal(results[1], results[0])
    _assert_all_equal(results[0], _by_hand())
