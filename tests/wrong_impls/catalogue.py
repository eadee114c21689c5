"""Wrong implementations, one bug each, and the check of SPEC.md section 6 that catches it.

`CATALOGUE` maps a short name to (`--impl` spec, check number). Most are
subclasses of the correct `StandInBlockTables`; the last ones wrap the
project's own `BlockTables`, to show that the harness catches a bug layered on
the real kernels too.
"""

from __future__ import annotations

import torch

from cp_blocktables import BlockTables
from cp_blocktables.contract import PAD_SLOT_ID

from .stand_in import StandInBlockTables


class WrongOwner(StandInBlockTables):
    """Ownership rotated by one rank: every token lands on its neighbour."""

    def _owner(self, o, c, i):
        return (o // i + 1) % c


class DroppedInterleaveRemainder(StandInBlockTables):
    """Local offset forgets `o mod I`: the I tokens of a run share one slot."""

    def _local(self, o, c, i):
        return (o // (i * c)) * i


class UnshardedGroupSharded(StandInBlockTables):
    """Treats every group as DCP-sharded, the replicated ones too."""

    def _group_cp(self, g):
        return self.cp_size


class MissingTailPadding(StandInBlockTables):
    """Clears only the batch's own tokens: a smaller step leaves the old tail."""

    def _clear_slot_buffer(self, buf, num_tokens):
        buf[:, :num_tokens].fill_(PAD_SLOT_ID)


class DummyRowsRead(StandInBlockTables):
    """A dummy entry (-1) is used as a row index: Python reads the last row."""

    def _gather_source_row(self, entry):
        return entry % self.max_num_reqs


class DummyTokensWritten(StandInBlockTables):
    """Tokens of dummy requests get slots (from row 0) instead of PAD."""

    def _writes(self, rows):
        return torch.ones_like(rows, dtype=torch.bool)


class StaleDirtyRows(StandInBlockTables):
    """Zeroes only up to num_reqs_padded: rows left by a larger batch survive."""

    def _rows_to_zero(self, num_reqs_padded):
        return num_reqs_padded


class WindowOffByOne(StandInBlockTables):
    """Masks with `<` instead of `<=`: the block ending exactly at the window edge survives."""

    def _masked(self, g, nct, num):
        reach, bs = self._reach()[g], self.block_sizes[g]
        j = torch.arange(num)
        return (j + 1) * bs < nct - reach


class MaskingUnderCp(StandInBlockTables):
    """Applies the configured sliding window under cp_size > 1, where columns are no range."""

    def _reach(self):
        return list(self.cfg.sliding_window_reach)


class Int32Slots(StandInBlockTables):
    """Computes slots in int32: values past 2**31 wrap."""

    def _store_slots(self, slots):
        return slots.to(torch.int32).to(torch.int64)


class IgnoredOverwrite(StandInBlockTables):
    """Appends after the old blocks even when told to overwrite a reused row."""

    def _start(self, g, row, overwrite):
        return int(self.counts[g, row])


class PositionsIgnored(StandInBlockTables):
    """Uses a token's index within its request's chunk instead of its position."""

    def _token_positions(self, positions, qsl, batch):
        return torch.arange(batch.shape[0]) - qsl[batch]


class BatchIndexAsRow(StandInBlockTables):
    """Reads table row `b` (the batch index) instead of `idx_mapping[b]`."""

    def _token_rows(self, idx, batch):
        return torch.where(idx[batch] >= 0, batch, -1)


class AllRanksWrite(StandInBlockTables):
    """Every rank writes every token of a sharded group (no PAD for non-owners)."""

    def _non_owner_value(self, slot):
        return slot


class RedirectIgnored(StandInBlockTables):
    """Stages real block ids during a warm-up that asked for the null block."""

    def _staged_ids(self, ids):
        return list(ids)


class DummyRunKeepsTables(StandInBlockTables):
    """get_dummy_block_tables leaves the previous batch's ids in the persistent tables."""

    def _dummy_tables(self, num_reqs):
        pass


class DisabledGroupWritten(StandInBlockTables):
    """Writes slots for groups whose slot mapping is disabled."""

    def _enabled(self, g):
        return True


class VirtualBlockIgnored(StandInBlockTables):
    """Sharded groups index the table by `p // bs`, not by the virtual block `p // (bs*C)`."""

    def _column(self, pos, bs, c):
        return pos // bs


class LaterGroupsNotApplied(StandInBlockTables):
    """apply_staged_writes flushes group 0 only (a fused writer that stops early)."""

    def _apply(self, g, row, start, ids):
        if g == 0:
            super()._apply(g, row, start, ids)


class OursInt32Slots(BlockTables):
    """The project's BlockTables, with its slot mapping squeezed through int32 afterwards."""

    def compute_slot_mappings(self, *args, **kwargs):
        out = super().compute_slot_mappings(*args, **kwargs)
        self.slot_mappings.copy_(self.slot_mappings.to(torch.int32).to(torch.int64))
        return out


class OursNoWindowMask(BlockTables):
    """The project's BlockTables, called without num_computed_tokens: no window masking."""

    def gather_block_tables(
        self, idx_mapping, num_reqs_padded, out=None, out_ptrs=None, num_computed_tokens=None
    ):
        return super().gather_block_tables(idx_mapping, num_reqs_padded, out, out_ptrs, None)


_MODULE = "tests.wrong_impls.catalogue"

CATALOGUE: dict[str, tuple[str, int]] = {
    "wrong_owner": (f"{_MODULE}:WrongOwner", 1),
    "dropped_interleave_remainder": (f"{_MODULE}:DroppedInterleaveRemainder", 1),
    "unsharded_group_sharded": (f"{_MODULE}:UnshardedGroupSharded", 2),
    "missing_tail_padding": (f"{_MODULE}:MissingTailPadding", 3),
    "dummy_rows_read": (f"{_MODULE}:DummyRowsRead", 6),
    "dummy_tokens_written": (f"{_MODULE}:DummyTokensWritten", 3),
    "stale_dirty_rows": (f"{_MODULE}:StaleDirtyRows", 6),
    "window_off_by_one": (f"{_MODULE}:WindowOffByOne", 6),
    "masking_under_cp": (f"{_MODULE}:MaskingUnderCp", 6),
    "int32_slots": (f"{_MODULE}:Int32Slots", 2),
    "ignored_overwrite": (f"{_MODULE}:IgnoredOverwrite", 6),
    "positions_ignored": (f"{_MODULE}:PositionsIgnored", 2),
    "batch_index_as_row": (f"{_MODULE}:BatchIndexAsRow", 2),
    "all_ranks_write": (f"{_MODULE}:AllRanksWrite", 1),
    "redirect_ignored": (f"{_MODULE}:RedirectIgnored", 6),
    "dummy_run_keeps_tables": (f"{_MODULE}:DummyRunKeepsTables", 6),
    "disabled_group_written": (f"{_MODULE}:DisabledGroupWritten", 3),
    "virtual_block_ignored": (f"{_MODULE}:VirtualBlockIgnored", 1),
    "later_groups_not_applied": (f"{_MODULE}:LaterGroupsNotApplied", 6),
    "ours_int32_slots": (f"{_MODULE}:OursInt32Slots", 2),
    "ours_no_window_mask": (f"{_MODULE}:OursNoWindowMask", 6),
}
"""name -> (`--impl` spec, the check that must report it)."""
