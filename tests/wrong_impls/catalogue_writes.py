"""Wrong implementations of the write path: append, stage, apply (SPEC.md section 6, checks 6, 8).

Overwrites, warm-up redirects, the order and number of staged writes, appends
past a row's capacity (check 8: must raise and change nothing), and the
expansion of allocator ids into kernel ids (SPEC.md 8.1). Each class overrides
one hook of the correct `StandInBlockTables`; `catalogue` names the check that
must catch it.
"""

from __future__ import annotations

from cp_blocktables.contract import NULL_BLOCK_ID

from .stand_in import StandInBlockTables


class IgnoredOverwrite(StandInBlockTables):
    """Appends after the old blocks even when told to overwrite a reused row."""

    def _start(self, g, row, overwrite):
        return int(self.counts[g, row])


class RedirectIgnored(StandInBlockTables):
    """Stages real block ids during a warm-up that asked for the null block."""

    def _staged_ids(self, ids):
        return list(ids)


class LaterGroupsNotApplied(StandInBlockTables):
    """apply_staged_writes flushes group 0 only (a fused writer that stops early)."""

    def _apply(self, g, row, start, ids):
        if g == 0:
            super()._apply(g, row, start, ids)


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
