"""famp.custom_fwd / famp.custom_bwd: argument checks (issue 12), one test per documented error."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import famp

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
