"""What one rank can check alone: returned views, dummy views, refused appends.

`_RankChecks` (a mixin of `executor._Executor`) checks that the tables and slot
mappings a call returns are views of the persistent buffers (or of the
caller's `out`) with the right shape and contents, that a dummy run hands out
zero rows and PAD slots, and that an append past a row's capacity raises
`RuntimeError` (SPEC.md sections 3 and 7). The leader checks contents against
the reference (`checks`).
"""

from __future__ import annotations

import torch

from ..contract import PAD_SLOT_ID
from .violations import Violation


class _RankChecks:
    """Checks of returned views and refused appends; needs `_Executor`'s state."""

    def _refused_append(self, s: int, a) -> list[Violation]:
        """An append past some group's capacity: `RuntimeError`, nothing staged (SPEC.md 3)."""
        what = "append_block_ids past a row's capacity"
        try:
            self.impl.append_block_ids(a.row, tuple(list(ids) for ids in a.block_ids), a.overwrite)
        except RuntimeError:
            return []
        except Exception as e:  # noqa: BLE001 - the wrong exception is a finding
            return [
                Violation(
                    8,
                    f"{what} raised {type(e).__name__} instead of RuntimeError: {e}",
                    s,
                    row=a.row,
                    request=a.uid,
                    expected="RuntimeError",
                    actual=type(e).__name__,
                )
            ]
        return [
            Violation(
                8,
                f"{what} did not raise",
                s,
                row=a.row,
                request=a.uid,
                expected="RuntimeError",
                actual="returned normally",
            )
        ]

    def _dummy_contents(self, s: int, tables, slots: torch.Tensor) -> list[Violation]:
        """What a dummy run hands out holds no block id and no slot (before anyone writes)."""
        found = []
        for g, t in enumerate(tables):
            if bool((t != 0).any()):
                found.append(
                    Violation(6, "get_dummy_block_tables handed out rows that are not zero", s, g)
                )
        if bool((self.impl.slot_mappings != PAD_SLOT_ID).any()):
            found.append(
                Violation(3, "get_dummy_slot_mappings left a non-PAD entry in slot_mappings", s)
            )
        return found

    def _check_views(
        self, s: int, tables: object, rows: int, same_ptr: bool, out: list | None = None
    ) -> list[Violation]:
        persistent = self.impl.input_block_tables if out is None else out
        tables = list(tables)
        if len(tables) != self.num_groups:
            return [Violation(6, f"returned {len(tables)} tables for {self.num_groups} groups", s)]
        found = []
        for g, t in enumerate(tables):
            if tuple(t.shape) != (rows, self.widths[g]):
                found.append(
                    Violation(
                        6,
                        "returned table has the wrong shape",
                        s,
                        g,
                        expected=str((rows, self.widths[g])),
                        actual=str(tuple(t.shape)),
                    )
                )
            elif same_ptr and not _starts_at(t, persistent[g]):
                found.append(
                    Violation(
                        6,
                        "get_dummy_block_tables returned a tensor that is not "
                        "a view of input_block_tables",
                        s,
                        g,
                    )
                )
            elif not torch.equal(t.to(torch.int64), persistent[g][:rows].to(torch.int64)):
                what = "input_block_tables" if out is None else "the caller's out"
                found.append(Violation(6, f"returned table differs from {what}[:{rows}]", s, g))
        return found

    def _check_slot_view(
        self, s: int, slots: torch.Tensor, n: int, same_ptr: bool, out: torch.Tensor | None = None
    ) -> list[Violation]:
        buf = self.impl.slot_mappings if out is None else out
        if tuple(slots.shape) != (self.num_groups, n):
            return [
                Violation(
                    3,
                    "returned slot mapping has the wrong shape",
                    s,
                    expected=str((self.num_groups, n)),
                    actual=str(tuple(slots.shape)),
                )
            ]
        if same_ptr and not _starts_at(slots, buf):
            return [
                Violation(
                    3,
                    "get_dummy_slot_mappings returned a tensor that is not a view of slot_mappings",
                    s,
                )
            ]
        if not torch.equal(slots.to(torch.int64), buf[:, :n].to(torch.int64)):
            what = "slot_mappings" if out is None else "the caller's out"
            return [Violation(3, f"returned slot mapping differs from {what}[:, :{n}]", s)]
        return []


def _starts_at(view: torch.Tensor, base: torch.Tensor) -> bool:
    """`view` starts where `base` does. An empty tensor reports `data_ptr()` 0, so an empty
    view (a dummy run of 0 requests or tokens) is judged by its storage and offset."""
    if view.numel() and base.numel():
        return view.data_ptr() == base.data_ptr()
    return (
        view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        and view.storage_offset() == base.storage_offset()
    )
