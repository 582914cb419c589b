"""A copy of a module made inside a `famp.autocast` call with module rules (an EMA or teacher copy
taken in `forward`) carries none of famp's per-call hooks or state, as one made under
`torch.autocast`: the same hook dicts, scriptable, on torch's inference fast path; and called in
the same call, it runs as a module no rule matches (its caller's scope), as `torch.autocast` by
hand gives. Before 2026-12-01 a copy kept famp's keyword pre-hook (`cast_keywords`) for ever.
"""

from __future__ import annotations

import copy
import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import famp
from tests.helpers import assert_bitwise_equal

BF16 = torch.bfloat16
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)
_COPIES: dict[str, Callable[[Any], Any]] = {"deepcopy": copy.deepcopy, "copy": copy.copy}


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        y = self.a(x).relu()
        return y if scale is None else y * scale


class _Net(nn.Module):
    """Copies its block in `forward` (after calling it), and calls the copy there if `use`."""

    def __init__(self, how: str, use: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blk, self.head = _Block(), nn.Linear(8, 2)
        self.how, self.use = how, use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blk(x, scale=x)
        self.__dict__["snap"] = _COPIES[self.how](self.blk)  # not in the tree: no rule's path
        if self.use:
            h = h + self.snap(h, scale=h)
        out: torch.Tensor = self.head(h)
        return out


def _x() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


def _famp(net: nn.Module) -> Any:
    return famp.autocast(net, "c=bf16,o=f32", module_rules={"blk": "c=f32"}, compile=False)


def _by_hand(net: _Net, x: torch.Tensor) -> torch.Tensor:
    """The rule written with torch.autocast: `blk` in float32, its inputs cast; the copy, no
    rule's, under the call's bfloat16 autocast (its keyword input uncast)."""
    with torch.autocast("cpu", dtype=BF16):
        with torch.autocast("cpu", enabled=False):
            h = net.blk(x.float(), scale=x.float())
        net.__dict__["snap"] = _COPIES[net.how](net.blk)
        if net.use:
            h = h + net.snap(h, scale=h)
        return net.head(h).float()


def _hooks(module: nn.Module) -> list[dict[Any, Any]]:
    return [dict(getattr(m, name)) for m in module.modules() for name in _HOOK_DICTS]


@pytest.mark.parametrize("use", [False, True])
@pytest.mark.parametrize("how", list(_COPIES))
def test_a_copy_made_in_the_call_has_no_famp_hook_and_scripts(how: str, use: bool) -> None:
    net, ref = _Net(how, use), _Net(how, use)
    x = _x()
    y = _famp(net)(x)
    assert_bitwise_equal(y, _by_hand(ref, x))
    assert _hooks(net.snap) == _hooks(ref.snap)
    assert set(net.snap.__dict__) == set(ref.snap.__dict__)
    assert all(not any(d) for d in _hooks(net.snap))
    with warnings.catch_warnings():  # torch 2.13 deprecates TorchScript, 2.15 warns of it too
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        torch.jit.script(net.snap)  # before the fix: "try blocks aren't supported" (famp's hook)
    assert_bitwise_equal(net.snap(x, scale=x), ref.snap(x, scale=x))  # later calls: plain torch


class _FastPath(TorchDispatchMode):
    """Counts torch's fused encoder-layer kernel (its inference fast path); it does not make an
    argument have a torch function, so it does not turn that path off."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.fused += func is torch.ops.aten._transformer_encoder_layer_fwd.default
        return func(*args, **(kwargs or {}))


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layer(x, src_mask=None)
        self.__dict__["snap"] = copy.deepcopy(self.layer)
        return out


def test_a_layer_copied_in_the_call_takes_torchs_fast_path_as_one_copied_under_torch_autocast() -> (
    None
):
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(2))
    net, ref = _Encoder(), _Encoder()
    with torch.inference_mode():
        famp.autocast(net, "c=bf16,o=f32", module_rules={"layer": "c=f32"}, compile=False)(x)
        with torch.autocast("cpu", dtype=BF16):
            ref(x)
        assert _hooks(net.snap) == _hooks(ref.snap)
        counts = []
        for copied in (net.snap, ref.snap):
            with _FastPath() as mode:
                out = copied(x)
            counts.append((mode.fused, out))
    assert counts[0][0] == counts[1][0] == 1  # before the fix: 0 for famp's copy
    assert_bitwise_equal(counts[0][1], counts[1][1])


def test_a_rule_inside_a_fast_path_layer_still_sends_it_down_its_composite_path() -> None:
    # famp puts no hook on the matched `linear1` now; its rule applies on the composite path
    # only, so the layer takes none, as torch takes none with a hook there (and famp's rule on
    # `linear1` gave it one before 2026-12-01).
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(3))
    net = _Encoder()
    f = famp.autocast(net, "c=f32", module_rules={"layer.linear1": "c=bf16,o=f32"})
    fused = []
    with torch.inference_mode():
        for hooked in (False, True):
            handle = net.layer.linear1.register_forward_pre_hook(lambda m, a: None)
            if not hooked:
                handle.remove()
            with _FastPath() as mode:
                net(x)
            handle.remove()
            fused.append(mode.fused)
        with _FastPath() as mode:
            f(x)
    assert fused == [1, 0]
    assert mode.fused == fused[1]


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * scale  # bf16 under the rule: a float32 `scale` would promote


class _Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _Scaled()

    def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner(x, scale=s)
        return out


def test_threads_calling_one_matched_module_each_get_their_keyword_inputs_cast() -> None:
    # Each thread's famp call asks for the module's keyword inputs by a key in its dict; one
    # thread's answer must not take the key from another's ask (uncast: float32 outputs).
    import threading

    torch.manual_seed(0)
    outer = _Outer()
    f = famp.autocast(outer, "c=f32", module_rules={"inner": "c=bf16,o=bf16"})
    x, s = torch.randn(4, 16), torch.randn(4, 16)
    with torch.autocast("cpu", dtype=BF16):
        expected = outer.inner(x, scale=s.to(BF16))
    wrong: list[int] = []
    assert not torch.equal(f(x, s), outer.inner(x, scale=s).float())  # uncast: other values

    def worker() -> None:
        for _ in range(1000):
            if not torch.equal(f(x, s), expected.float()):
                wrong.append(1)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(previous)
    assert not wrong, f"{len(wrong)} of 4000 calls had a keyword input uncast"
