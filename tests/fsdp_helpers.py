"""Helpers shared by the FSDP optimizer-state tests."""

from __future__ import annotations

from typing import Any

import torch

from tests.helpers import assert_bitwise_equal


def assert_same_osd(actual: Any, expected: Any, where: str = "osd") -> None:
    """Same keys and structure, equal non-tensor values, tensors bit for bit (dtype, shape too)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        assert_bitwise_equal(actual, expected)
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), where
        assert set(actual) == set(expected), (
            where,
            sorted(map(str, actual)),
            sorted(map(str, expected)),
        )
        for key in expected:
            assert_same_osd(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected), (where, type(actual), type(expected))
        assert len(actual) == len(expected), (where, len(actual), len(expected))
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same_osd(a, e, f"{where}[{i}]")
    else:
        assert type(actual) is type(expected), (where, actual, expected)
        assert actual == expected, (where, actual, expected)
