"""Wrong implementations whose gathered block tables are wrong (SPEC.md section 6, check 6).

Rows a gather must zero or must not read (dummy entries, rows left by a larger
batch or a dummy run), sliding-window masking, wide rows and the caller-owned
`out`. Each class overrides one hook of the correct `StandInBlockTables`;
`catalogue` names the check that must catch it.
"""

from __future__ import annotations

import torch

from .stand_in import StandInBlockTables


class DummyRowsRead(StandInBlockTables):
    """A dummy entry (-1) is used as a row index: Python reads the last row."""

    def _gather_source_row(self, entry):
        return entry % self.max_num_reqs


class StaleDirtyRows(StandInBlockTables):
    """Zeroes only up to num_reqs_padded: rows left by a larger batch survive."""

    def _rows_to_zero(self, num_reqs_padded):
        return num_reqs_padded


class DummyRunKeepsTables(StandInBlockTables):
    """get_dummy_block_tables leaves the previous batch's ids in the persistent tables."""

    def _dummy_tables(self, num_reqs):
        pass


class DummyTablesNotDirty(StandInBlockTables):
    """get_dummy_block_tables forgets the rows it handed out: a profiling run's ids survive the
    next, smaller gather (the seed's bug: dirty-row count 0 instead of num_reqs)."""

    def _dummy_rows_written(self, num_reqs):
        return 0


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


class WideRowsTruncated(StandInBlockTables):
    """The gather copies at most 2048 columns of a row."""

    def gather_block_tables(self, idx, nrp, out=None, out_ptrs=None, num_computed_tokens=None):
        res = super().gather_block_tables(idx, nrp, out, out_ptrs, num_computed_tokens)
        for t in res:
            t[: len(idx), 2048:] = 0
        return res


class GatherOutIgnored(StandInBlockTables):
    """gather_block_tables writes the persistent tables even when given the caller's out."""

    def gather_block_tables(self, idx, nrp, out=None, out_ptrs=None, num_computed_tokens=None):
        return super().gather_block_tables(idx, nrp, None, None, num_computed_tokens)


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
