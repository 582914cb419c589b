"""`famp.Trace` and `famp.OpRecord`: what `famp.explain` returns, with its tables for a terminal."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import overload

import torch

_SHORT = {
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float32: "f32",
    torch.float64: "f64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.bool: "bool",
}


def _short(dtype: torch.dtype | None) -> str:
    if dtype is None:
        return "-"
    return _SHORT.get(dtype, str(dtype).removeprefix("torch."))


@dataclasses.dataclass(frozen=True)
class OpRecord:
    """One aten op that ran inside a `famp.explain` call.

    Attributes:
        op: The aten overload, such as `"aten.mm.default"`.
        module: The path of the innermost `nn.Module` running it, relative to the outermost
            module running (`""` outside any module, the backward pass included): a module
            called on its own is a root for that call of it, as for `famp.autocast`'s module
            rules (`model[1](x)` gives it `""`, `model(x)` `"1"`).
        rule: The famp rule governing it (see `famp.explain`), or `None` where autocast is off.
        source: `"default"`, `"override"` (the call's `rules` differ from the defaults
            here; in a nested `famp.autocast` call, its own) or `"module"` (a module rule's
            policy governs it).
        in_dtypes: The dtypes of its tensor arguments, in order.
        out_dtypes: The dtypes of its tensor results, in order.
        call: The torch function called from Python whose rule governs the op (`"linear"`),
            or `""` when the op's own rule applies.
    """

    op: str
    module: str
    rule: str | None
    source: str
    in_dtypes: tuple[torch.dtype, ...]
    out_dtypes: tuple[torch.dtype, ...]
    call: str = ""


class Trace(Sequence[OpRecord]):
    """The ops one `famp.explain` call ran, in order: a sequence of `famp.OpRecord`.

    Examples:
        >>> import famp, torch
        >>> lin = torch.nn.Linear(4, 2)
        >>> out, trace = famp.explain(lin, "c=bf16")(torch.randn(3, 4))
        >>> [(r.op, r.rule, r.out_dtypes) for r in trace][:2]
        [('aten._to_copy.default', 'lower', (torch.bfloat16,)), \
('aten._to_copy.default', 'lower', (torch.bfloat16,))]
    """

    def __init__(self, records: Sequence[OpRecord]) -> None:
        self._records = tuple(records)

    @overload
    def __getitem__(self, index: int) -> OpRecord: ...
    @overload
    def __getitem__(self, index: slice) -> Trace: ...
    def __getitem__(self, index: int | slice) -> OpRecord | Trace:
        if isinstance(index, slice):
            return Trace(self._records[index])
        return self._records[index]

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[OpRecord]:
        return iter(self._records)

    def __repr__(self) -> str:
        return f"Trace({len(self)} ops)"

    def table(self, module: str | None = None) -> str:
        """The trace as a table for a terminal: one row per op.

        Args:
            module: Only the ops of this module and its submodules (a path prefix); `None`: all.

        Returns:
            The table as text: op, module, call, rule, source, input and output dtypes.

        Examples:
            >>> import famp, torch
            >>> lin = torch.nn.Linear(4, 2)
            >>> _, trace = famp.explain(lin, "c=bf16")(torch.randn(3, 4))
            >>> print(trace.table())
            #  op                     module  call    rule   source   in           out
            0  aten._to_copy.default          linear  lower  default  f32          bf16
            1  aten._to_copy.default          linear  lower  default  f32          bf16
            2  aten._to_copy.default          linear  lower  default  f32          bf16
            3  aten.t.default                 linear  lower  default  bf16         bf16
            4  aten.addmm.default             linear  lower  default  bf16 bf16 bf16  bf16
        """
        rows = [("#", "op", "module", "call", "rule", "source", "in", "out")]
        for i, r in enumerate(self._records):
            if module is not None and not (
                r.module == module or r.module.startswith(module + ".") or not module
            ):
                continue
            rows.append(
                (
                    str(i),
                    r.op,
                    r.module,
                    r.call,
                    str(r.rule) if r.rule is not None else "-",
                    r.source,
                    " ".join(map(_short, r.in_dtypes)),
                    " ".join(map(_short, r.out_dtypes)),
                )
            )
        widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
        return "\n".join(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in rows
        )

    def counts(self) -> dict[tuple[str | None, torch.dtype | None], int]:
        """How many ops ran per (rule, first output dtype), in order of first appearance.

        Returns:
            `{(rule, dtype): count}`; the dtype is `None` for ops without a tensor result.

        Examples:
            >>> import famp, torch
            >>> _, trace = famp.explain(torch.nn.Linear(4, 2), "c=bf16")(torch.randn(3, 4))
            >>> trace.counts()
            {('lower', torch.bfloat16): 5}
        """
        out: dict[tuple[str | None, torch.dtype | None], int] = {}
        for r in self._records:
            key = (r.rule, r.out_dtypes[0] if r.out_dtypes else None)
            out[key] = out.get(key, 0) + 1
        return out

    def summary(self) -> str:
        """`counts()` as a short table for a terminal.

        Returns:
            One line per (rule, output dtype): the number of ops.

        Examples:
            >>> import famp, torch
            >>> _, trace = famp.explain(torch.nn.Linear(4, 2), "c=bf16")(torch.randn(3, 4))
            >>> print(trace.summary())
            rule   out   ops
            lower  bf16  5
        """
        rows = [("rule", "out", "ops")] + [
            (str(rule) if rule is not None else "-", _short(dtype), str(n))
            for (rule, dtype), n in self.counts().items()
        ]
        widths = [max(len(row[c]) for row in rows) for c in range(3)]
        return "\n".join(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in rows
        )
