"""Wrong implementations, one bug each, and the check of SPEC.md section 6 that catches it.

`CATALOGUE` maps a short name to (`--impl` spec, check number). Most are
subclasses of the correct `StandInBlockTables`; the last ones wrap the
project's own `BlockTables`, to show that the harness catches a bug layered on
the real kernels too.
"""

from __future__ import annotations

import numpy as np
import torch

from cp_blocktables import BlockTables
from cp_blocktables.contract import NULL_BLOCK_ID, PAD_SLOT_ID

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


# ---------------------------------------------------------------- size regimes and paths


class DummyTablesNotDirty(StandInBlockTables):
    """get_dummy_block_tables forgets the rows it handed out: a profiling run's ids survive the
    next, smaller gather (the seed's bug: dirty-row count 0 instead of num_reqs)."""

    def _dummy_rows_written(self, num_reqs):
        return 0


class OursDummyNotDirty(BlockTables):
    """The project's BlockTables with the seed's dummy-row bug put back."""

    def get_dummy_block_tables(self, num_reqs):
        out = super().get_dummy_block_tables(num_reqs)
        self._input_rows_written = 0
        return out


class TokensPastTileDropped(StandInBlockTables):
    """One program per request handles at most 8192 of its tokens: the rest stay PAD."""

    def compute_slot_mappings(self, idx_mapping, query_start_loc, positions, n, out=None):
        res = super().compute_slot_mappings(idx_mapping, query_start_loc, positions, n, out)
        buf = self.slot_mappings if out is None else out
        qsl = query_start_loc.cpu().tolist()
        for lo, hi in zip(qsl[:-1], qsl[1:], strict=True):
            if hi - lo > 8192:
                buf[:, lo + 8192 : hi] = PAD_SLOT_ID
        return res


class WideRowsTruncated(StandInBlockTables):
    """The gather copies at most 2048 columns of a row."""

    def gather_block_tables(self, idx, nrp, out=None, out_ptrs=None, num_computed_tokens=None):
        res = super().gather_block_tables(idx, nrp, out, out_ptrs, num_computed_tokens)
        for t in res:
            t[: len(idx), 2048:] = 0
        return res


class TailClearCapped(StandInBlockTables):
    """Clears the stale tail one 8192-token tile past num_tokens only."""

    def _clear_slot_buffer(self, buf, num_tokens):
        buf[:, : num_tokens + 8192].fill_(PAD_SLOT_ID)


class StagedWritesCapped(StandInBlockTables):
    """The staging buffer holds max_num_reqs writes per group: later writes are dropped."""

    def apply_staged_writes(self):
        seen = {}
        for g, row, start, ids in self.staged:
            seen[g] = seen.get(g, 0) + 1
            if ids and seen[g] <= self.max_num_reqs:
                self._apply(g, row, start, ids)
        self.staged.clear()


class StagedWritesReversed(StandInBlockTables):
    """Applies the staged writes last-staged first: an overwrite loses to the append before it."""

    def apply_staged_writes(self):
        self.staged.reverse()
        super().apply_staged_writes()


class StartFromAppliedCount(StandInBlockTables):
    """A second append to a row in one step starts where the applied table ends, not the first
    append's end."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.applied = self.counts.copy()

    def _start(self, g, row, overwrite):
        return 0 if overwrite else int(self.applied[g, row])

    def apply_staged_writes(self):
        super().apply_staged_writes()
        self.applied = self.counts.copy()


class GatherOutIgnored(StandInBlockTables):
    """gather_block_tables writes the persistent tables even when given the caller's out."""

    def gather_block_tables(self, idx, nrp, out=None, out_ptrs=None, num_computed_tokens=None):
        return super().gather_block_tables(idx, nrp, None, None, num_computed_tokens)


class SlotOutIgnored(StandInBlockTables):
    """compute_slot_mappings writes the persistent buffer even when given the caller's out."""

    def compute_slot_mappings(self, idx_mapping, query_start_loc, positions, n, out=None):
        return super().compute_slot_mappings(idx_mapping, query_start_loc, positions, n)


class OutGatherMovesDirtyRows(StandInBlockTables):
    """A gather into the caller's out also resets the persistent tables' dirty-row count."""

    def gather_block_tables(self, idx, nrp, out=None, out_ptrs=None, num_computed_tokens=None):
        res = super().gather_block_tables(idx, nrp, out, out_ptrs, num_computed_tokens)
        self.rows_written = nrp
        return res


class NctRemembered(StandInBlockTables):
    """A gather without num_computed_tokens masks with the last ones it was given (cached)."""

    def gather_block_tables(self, idx, nrp, out=None, out_ptrs=None, num_computed_tokens=None):
        if num_computed_tokens is None:
            num_computed_tokens = getattr(self, "_last_nct", None)
        else:
            self._last_nct = num_computed_tokens.clone()
        return super().gather_block_tables(idx, nrp, out, out_ptrs, num_computed_tokens)


class OverflowClamped(StandInBlockTables):
    """An append past a row's capacity is cut to fit instead of raising."""

    def append_block_ids(self, req_index, new_block_ids, overwrite):
        cut = []
        for g, ids in enumerate(new_block_ids):
            room = (self.tables[g].shape[1] - self._start(g, req_index, overwrite)) // self.m[g]
            cut.append(list(ids)[: max(room, 0)])
        super().append_block_ids(req_index, tuple(cut), overwrite)


class OverflowPartlyStaged(StandInBlockTables):
    """Stages group by group and raises at the first that does not fit: earlier groups keep
    their new ids and counts."""

    def append_block_ids(self, req_index, new_block_ids, overwrite):
        for g, ids in enumerate(new_block_ids):
            start = self._start(g, req_index, overwrite)
            if not self._capacity_ok(g, start, list(ids)):
                raise RuntimeError(f"request {req_index} group {g}: past capacity")
            kernel_ids = self._expand(g, self._staged_ids(list(ids)))
            self.staged.append((g, req_index, start, kernel_ids))
            self.counts[g, req_index] = start + len(kernel_ids)


class RareWrongSlot(StandInBlockTables):
    """One compute_slot_mappings call in fifty (at random) moves one token's slot by one."""

    def compute_slot_mappings(self, idx_mapping, query_start_loc, positions, n, out=None):
        res = super().compute_slot_mappings(idx_mapping, query_start_loc, positions, n, out)
        rng = getattr(self, "_rng", None) or np.random.default_rng(1000 + self.cp_rank)
        self._rng = rng
        buf = self.slot_mappings if out is None else out
        real = (buf[:, : int(query_start_loc[-1])] != PAD_SLOT_ID).nonzero()
        if rng.random() < 1 / 50 and len(real):
            g, t = real[int(rng.integers(len(real)))].tolist()
            buf[g, t] += 1
        return res


class LastRankOffByOne(StandInBlockTables):
    """Only the last CP rank gets the local offset wrong (one past it, wrapping in the block)."""

    def _local(self, o, c, i):
        local = super()._local(o, c, i)
        return (local + 1) % (self.block_sizes[0]) if self.cp_rank == c - 1 else local


# ---------------------------------------------------------------- kernel block sizes (8.1)


class VirtualBlockFromAllocator(StandInBlockTables):
    """Sharded groups find the table column with the allocator block B: p // (B*C)."""

    def _column(self, pos, bs, c):
        g = self.block_sizes.index(bs)
        return pos // (self.alloc_block_sizes[g] * c)


class ExpansionReversed(StandInBlockTables):
    """Expands allocator id b into kernel ids b*m+m-1, ..., b*m (reversed)."""

    def _expand(self, g, ids):
        m = self.m[g]
        return [b * m + i for b in ids for i in reversed(range(m))]


class CountsInAllocatorBlocks(StandInBlockTables):
    """Advances num_blocks by one per allocator id instead of m: gathers copy too few entries."""

    def append_block_ids(self, req_index, new_block_ids, overwrite):
        starts = [self._start(g, req_index, overwrite) for g in range(self.num_kv_cache_groups)]
        super().append_block_ids(req_index, new_block_ids, overwrite)
        for g, ids in enumerate(new_block_ids):
            if self.m[g] > 1:
                self.counts[g, req_index] = starts[g] + len(ids)


class CapacityBeforeExpansion(StandInBlockTables):
    """Checks capacity against the allocator ids, not the expanded kernel ids."""

    def _capacity_ok(self, g, start, ids):
        return start + len(ids) <= self.tables[g].shape[1]

    def _apply(self, g, row, start, ids):
        ids = ids[: max(self.tables[g].shape[1] - start, 0)]
        super()._apply(g, row, start, ids)


class RedirectAfterExpansion(StandInBlockTables):
    """Under redirect, zeroes the kernel ids after expansion: 0, 0, ... instead of 0..m-1."""

    def _staged_ids(self, ids):
        return list(ids)

    def _expand(self, g, ids):
        out = super()._expand(g, ids)
        return [NULL_BLOCK_ID] * len(out) if self.redirect_writes_to_null_block else out


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
    "dummy_tables_not_dirty": (f"{_MODULE}:DummyTablesNotDirty", 6),
    "ours_dummy_not_dirty": (f"{_MODULE}:OursDummyNotDirty", 6),
    "tokens_past_tile_dropped": (f"{_MODULE}:TokensPastTileDropped", 1),
    "wide_rows_truncated": (f"{_MODULE}:WideRowsTruncated", 6),
    "tail_clear_capped": (f"{_MODULE}:TailClearCapped", 3),
    "staged_writes_capped": (f"{_MODULE}:StagedWritesCapped", 6),
    "staged_writes_reversed": (f"{_MODULE}:StagedWritesReversed", 6),
    "start_from_applied_count": (f"{_MODULE}:StartFromAppliedCount", 6),
    "gather_out_ignored": (f"{_MODULE}:GatherOutIgnored", 6),
    "slot_out_ignored": (f"{_MODULE}:SlotOutIgnored", 3),
    "out_gather_moves_dirty_rows": (f"{_MODULE}:OutGatherMovesDirtyRows", 6),
    "nct_remembered": (f"{_MODULE}:NctRemembered", 6),
    "overflow_clamped": (f"{_MODULE}:OverflowClamped", 8),
    "overflow_partly_staged": (f"{_MODULE}:OverflowPartlyStaged", 6),
    "rare_wrong_slot": (f"{_MODULE}:RareWrongSlot", 2),
    "last_rank_off_by_one": (f"{_MODULE}:LastRankOffByOne", 1),
    "virtual_block_from_allocator": (f"{_MODULE}:VirtualBlockFromAllocator", 1),
    "expansion_reversed": (f"{_MODULE}:ExpansionReversed", 6),
    "counts_in_allocator_blocks": (f"{_MODULE}:CountsInAllocatorBlocks", 6),
    "capacity_before_expansion": (f"{_MODULE}:CapacityBeforeExpansion", 8),
    "redirect_after_expansion": (f"{_MODULE}:RedirectAfterExpansion", 6),
}
"""name -> (`--impl` spec, the check that must report it)."""
