"""Complex leaves in a compiled `famp.select_tree`: `torch.where`'s bits, as eagerly.

Compiled on the CPU, `select_tree` copies plain leaves through one `famp::select_` operator;
inductor cannot keep that operator's write into a complex copy (compiling failed with
"auto_functionalized_v2 was not removed"), so complex leaves (the optimizer state of complex
parameters) take `torch.where`. The oracle is eager `torch.where` leaf by leaf.
"""

from __future__ import annotations

import pytest
import torch

import famp
from tests.helpers import assert_bitwise_equal


def _trees() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)

    def tree() -> dict[str, torch.Tensor]:
        return {
            "c64": torch.randn(3, 2, dtype=torch.complex64, generator=g),
            "c128": torch.randn(4, dtype=torch.complex128, generator=g),
            "f32": torch.randn(3, generator=g),
            "bf16": torch.randn(3, generator=g).bfloat16(),
            "step": torch.tensor(7),
        }

    return tree(), tree()


_SELECT = torch.compile(famp.select_tree, fullgraph=True)


# torch warns that inductor generates no code for complex operators (it falls back to eager).
@pytest.mark.filterwarnings("ignore:Torchinductor does not support code generation for complex")
@pytest.mark.parametrize("pred", [True, False])
def test_compiled_select_of_complex_leaves_gives_torch_where_bits(pred: bool) -> None:
    on_true, on_false = _trees()
    where = torch.tensor(pred)
    actual = _SELECT(where, on_true, on_false)
    for key, a in actual.items():
        expected = torch.where(where, on_true[key], on_false[key])
        assert a.dtype == expected.dtype == on_true[key].dtype
        if a.is_complex():
            a, expected = torch.view_as_real(a), torch.view_as_real(expected)
        assert_bitwise_equal(a, expected)
