"""The reference for torch's Autocast<Device> kernels, and sample inputs for every op they cover.

Both live in famp (`famp/_autocast/reference.py`, `samples.py`, `compare.py`), which
`famp.default_rules` also uses to derive the rules of ops that its shipped tables do not know;
this module re-exports them for the tests.
"""

from __future__ import annotations

from famp._autocast.compare import (
    SCRATCH_OUTPUTS,
    VARIANTS,
    Autocast,
    check_op,
    overload_of,
    run_both,
    same_outcome,
    variant_inputs,
)
from famp._autocast.reference import apply_rule
from famp._autocast.samples import SAMPLES, sample

__all__ = [
    "SAMPLES",
    "SCRATCH_OUTPUTS",
    "VARIANTS",
    "Autocast",
    "apply_rule",
    "check_op",
    "overload_of",
    "run_both",
    "same_outcome",
    "sample",
    "variant_inputs",
]
