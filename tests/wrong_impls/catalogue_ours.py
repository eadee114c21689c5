"""Wrong implementations layered on the project's own `BlockTables`.

They show that the harness catches a bug on top of the real kernels too, not
only in the pure-torch stand-in; `catalogue` names the check that must catch
each.
"""

from __future__ import annotations

import contextlib

import torch

from cp_blocktables import BlockTables, staged
from cp_blocktables import block_tables as _bt
from cp_blocktables.contract import PAD_SLOT_ID
from cp_blocktables.kernels import layout as _layout
from cp_blocktables.kernels import slot_mappings as _slots


class OursInt32Slots(BlockTables):
    """The project's BlockTables, with its slot mapping squeezed through int32 afterwards."""

    def compute_slot_mappings(self, *args, **kwargs):
        out = super().compute_slot_mappings(*args, **kwargs)
        self.slot_mappings.copy_(self.slot_mappings.to(torch.int32).to(torch.int64))
        return out


class _OursPadsWhereSpansFitInt32(BlockTables):
    """Maps positions from `PAD_FROM` on to PAD while every span `_spans()` gives is
    below 2**31, as a kernel that takes its int32 path then would."""

    PAD_FROM = 2**31

    def _spans(self) -> list[int]:
        raise NotImplementedError

    def compute_slot_mappings(
        self, idx_mapping, query_start_loc, positions, num_tokens_padded, out=None
    ):
        slots = super().compute_slot_mappings(
            idx_mapping, query_start_loc, positions, num_tokens_padded, out
        )
        spans = self._spans()
        if spans and max(spans) < 2**31:
            n = int(query_start_loc[-1])
            slots[:, :n][:, positions[:n] >= self.PAD_FROM] = PAD_SLOT_ID
        return slots


class OursInt32PathBelow2To30(_OursPadsWhereSpansFitInt32):
    """Maps positions from 2**30 on to PAD while every table spans fewer than 2**31
    positions, as an int32 path bounded by 2**30 instead of 2**31 would: legal tokens at
    the top of such tables are written on no rank."""

    PAD_FROM = 2**30

    def _spans(self) -> list[int]:
        cfg = self.config
        return [
            cfg.max_num_blocks_per_group[g] * cfg.block_sizes[g] * cfg.group_cp_size(g)
            for g in range(cfg.num_kv_cache_groups)
        ]


class OursShortStepsCutInMidBuffers(BlockTables):
    """Maps only the first 32 tokens of a step of at most eight requests of up to 64
    tokens each when the token buffer's 32-token steps up to 8,192 have bit 5 set
    (993 to 2,016 tokens, 3,041 to 4,064, ...), as a request-parallel kernel whose reach
    is `32 & steps` for `32 * steps` would: the rest keep PAD."""

    def compute_slot_mappings(
        self, idx_mapping, query_start_loc, positions, num_tokens_padded, out=None
    ):
        slots = super().compute_slot_mappings(
            idx_mapping, query_start_loc, positions, num_tokens_padded, out
        )
        steps = -(-min(self.max_num_batched_tokens, 8192) // 32)
        num_reqs = idx_mapping.shape[0]
        if steps & 32 and 0 < num_reqs <= 8 and num_tokens_padded <= 64 * num_reqs:
            slots[:, 32 : int(query_start_loc[-1])] = PAD_SLOT_ID
        return slots


class OursFullBufferLosesItsLastToken(BlockTables):
    """Starts batch entry 0 one token early in a step of at most eight entries of up to
    64 tokens each, as a request-parallel kernel that loads the entry's start with
    `other=-1` would: its programs reach the buffer rounded up to 32 tokens, so where
    entry 0 fills that reach its last token keeps what the buffer held."""

    def _keep_lost_token(self, dest, idx_mapping, query_start_loc, num_tokens_padded):
        """What `dest` holds at the lost token, and a function that puts it back."""
        num_reqs = idx_mapping.shape[0]
        reach = 32 * -(-min(self.max_num_batched_tokens, 8192) // 32)
        lost = (
            0 < num_reqs <= 8
            and num_tokens_padded <= 64 * num_reqs
            and int(query_start_loc[1]) == reach
        )
        held = dest[:, reach - 1].clone() if lost else None

        def restore(slots):
            if held is not None:
                slots[:, reach - 1] = held
            return slots

        return restore

    def compute_slot_mappings(
        self, idx_mapping, query_start_loc, positions, num_tokens_padded, out=None
    ):
        dest = self.slot_mappings if out is None else out
        restore = self._keep_lost_token(dest, idx_mapping, query_start_loc, num_tokens_padded)
        return restore(
            super().compute_slot_mappings(
                idx_mapping, query_start_loc, positions, num_tokens_padded, out
            )
        )

    def gather_and_compute_slot_mappings(
        self, idx_mapping, num_reqs_padded, query_start_loc, positions, num_tokens_padded,
        num_computed_tokens=None,
    ):  # fmt: skip
        restore = self._keep_lost_token(
            self.slot_mappings, idx_mapping, query_start_loc, num_tokens_padded
        )
        tables, slots = super().gather_and_compute_slot_mappings(
            idx_mapping, num_reqs_padded, query_start_loc, positions, num_tokens_padded,
            num_computed_tokens,
        )  # fmt: skip
        return tables, restore(slots)


class OursUnitBlockSpanWithoutCp(_OursPadsWhereSpansFitInt32):
    """Takes a table's span as columns x kernel block size ** CP size: the same or more
    for kernel blocks of 2 tokens or more, but one-token blocks then span their columns
    alone, so an int32 path is taken where only the CP factor carries a table past 2**31
    positions, and the positions past it map to PAD."""

    def _spans(self) -> list[int]:
        cp = self.config.group_cp_size
        return [
            t.gpu.shape[1] * k ** cp(g)
            for g, (t, k) in enumerate(zip(self.block_tables, self.kernel_block_sizes))
        ]


class OursGatherRowsByBatch(BlockTables):
    """Sizes its gather programs by the batch alone, every row in one program whatever the
    width: right up to Triton's largest block of 2**20 entries, refused past it (257 rows
    of 2,049 columns pad to 512 x 4,096), as the interpreter refuses such a launch."""

    def gather_block_tables(self, idx_mapping, num_reqs_padded, *args, **kwargs):
        def pow2(n: int) -> int:
            return 1 << max(n - 1, 0).bit_length()

        width = max((t.gpu.shape[1] for t in self.block_tables), default=0)
        if pow2(num_reqs_padded) * pow2(width) > 2**20:
            raise RuntimeError(f"numel ({pow2(num_reqs_padded) * pow2(width)}) exceeds 2**20")
        return super().gather_block_tables(idx_mapping, num_reqs_padded, *args, **kwargs)


class OursNoWindowMask(BlockTables):
    """The project's BlockTables, called without num_computed_tokens: no window masking."""

    def gather_block_tables(
        self, idx_mapping, num_reqs_padded, out=None, out_ptrs=None, num_computed_tokens=None
    ):
        return super().gather_block_tables(idx_mapping, num_reqs_padded, out, out_ptrs, None)


class OursDummyNotDirty(BlockTables):
    """The project's BlockTables with the seed's dummy-row bug put back."""

    def get_dummy_block_tables(self, num_reqs):
        out = super().get_dummy_block_tables(num_reqs)
        self._input_rows_written = 0
        return out


class OursRowsByWidth(BlockTables):
    """The project's BlockTables, its slot mapping finding row `r` at `r` times the table's
    width, not its row stride: right for the tables it allocates, wrong for tables an
    engine reallocates as views of wider rows (SPEC.md 3), which the wake-up probe makes."""

    def init_block_table_layout_tensors(self) -> None:
        super().init_block_table_layout_tensors()
        widths = [t.gpu.shape[1] for t in self.block_tables]
        self._layout.params[:, 3] = torch.tensor(widths, dtype=torch.int64)


class OursTwoGroupsUnfused(BlockTables):
    """The project's BlockTables, with the fused writer built only from three groups on: with
    exactly two (the commonest hybrid model), an apply publishes group 0's writes alone."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.num_kv_cache_groups == 2:
            self.fused_writer = None


class OursCutWriteKeepsLength(BlockTables):
    """The project's BlockTables, where the tail of a staged write that a later write of the
    same row cuts keeps the whole write's length: it runs on past the write's end, into the
    next row's live blocks when the write ended at the row's capacity."""

    def apply_staged_writes(self) -> None:
        for t in self.block_tables:
            _keep_cut_lengths(t)
        super().apply_staged_writes()


def _keep_cut_lengths(t: staged.StagedWriteTensor) -> None:
    rows, starts = t._staged_write_indices, t._staged_write_starts
    contents, cu_lens = t._staged_write_contents, t._staged_write_cu_lens
    pieces = staged._drop_overwritten(rows, starts, cu_lens)
    if pieces is None:
        return
    new_rows, new_starts, new_contents, new_cu = [], [], [], []
    for w, x, lo, _ in pieces:
        whole = cu_lens[w] - (cu_lens[w - 1] if w else 0)
        new_rows.append(rows[w])
        new_starts.append(x)
        new_contents.extend(contents[lo : lo + whole])
        new_cu.append(len(new_contents))
    t._staged_write_indices, t._staged_write_starts = new_rows, new_starts
    t._staged_write_contents, t._staged_write_cu_lens = new_contents, new_cu


class OursNullBlockRefused(BlockTables):
    """The project's BlockTables, checking appended ids against `[1, max]`: the null block's
    id 0, which engines append for window blocks they skip, is refused as out of range."""

    def append_block_ids(self, req_index, new_block_ids, overwrite) -> None:
        if any(0 in list(ids) for ids in new_block_ids):
            raise ValueError(f"append_block_ids: request {req_index}: block ids must be >= 1")
        super().append_block_ids(req_index, new_block_ids, overwrite)


class OursGatherFirstProgramRows(BlockTables):
    """Gathers as a kernel whose every program writes the first program's rows
    (`row_block // ROWS` for `row_block * ROWS`): right while one program of 16 rows
    holds the batch; from row 16 on the tables keep what they held before."""

    def gather_block_tables(self, idx_mapping, num_reqs_padded, out=None, *args, **kwargs):
        dst = list(self.input_block_tables if out is None else out)
        kept = [t[16:].clone() for t in dst]
        views = super().gather_block_tables(idx_mapping, num_reqs_padded, out, *args, **kwargs)
        for t, old in zip(dst, kept, strict=True):
            t[16:] = old
        return views


class OursDeviceByIndex(BlockTables):
    """Checks its tables' device with `==`: a tensor on the CPU reports `cpu`, never the
    `cpu:0` an engine may name, and one on a GPU `cuda:N`, never the bare `cuda`; an
    instance built on `cpu:0` or `cuda` refuses its own tables."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for g, t in enumerate(self.block_tables):
            if t.gpu.device != self.device:
                raise ValueError(f"block_tables[{g}] lies on {t.gpu.device}, not {self.device}")


def _kernel_ids_by_or(ids, m: int) -> list[int]:
    return [b * m | k for b in ids for k in range(m)]


class OursKernelIdsByOr(BlockTables):
    """Expands allocator block `b` into kernel blocks `b * m | k` instead of `b * m + k`: the
    same wherever `m` is a power of two, kernel blocks that repeat where it is not (3)."""

    def append_block_ids(self, req_index, new_block_ids, overwrite) -> None:
        saved = _bt._expand
        _bt._expand = _kernel_ids_by_or
        try:
            super().append_block_ids(req_index, new_block_ids, overwrite)
        finally:
            _bt._expand = saved


@contextlib.contextmanager
def _powers_of_two_by_all_ones():
    """`is_pow2` as `n & (n + 1) == 0` where the slot mapping's layout and launch read it."""
    saved = _layout.is_pow2, _slots.is_pow2
    _layout.is_pow2 = _slots.is_pow2 = lambda n: n > 0 and n & (n + 1) == 0
    try:
        yield
    finally:
        _layout.is_pow2, _slots.is_pow2 = saved


class OursPowersOfTwoByAllOnes(BlockTables):
    """Tests powers of two with `n & (n + 1)` for `n & (n - 1)`: 3, 7 and 15 pass and 2, 4
    and 8 fail, so a layout of powers of two divides (right, slower) and one whose every size
    is one below a power of two shifts by log2(3) for a 3."""

    def __init__(self, *args, **kwargs) -> None:
        with _powers_of_two_by_all_ones():
            super().__init__(*args, **kwargs)

    def compute_slot_mappings(self, *args, **kwargs):
        with _powers_of_two_by_all_ones():
            return super().compute_slot_mappings(*args, **kwargs)

    def gather_and_compute_slot_mappings(self, *args, **kwargs):
        with _powers_of_two_by_all_ones():
            return super().gather_and_compute_slot_mappings(*args, **kwargs)


class OursUnitBlockMaskedUnwindowed(BlockTables):
    """A masking gather takes the dead bound of a group without a window as 1 instead of -1:
    such a group of one-token kernel blocks loses entry 0 of every row whose computed tokens
    are one or more, beside any group that has a window."""

    def gather_block_tables(
        self, idx_mapping, num_reqs_padded, out=None, out_ptrs=None, num_computed_tokens=None
    ):
        tables = super().gather_block_tables(
            idx_mapping, num_reqs_padded, out, out_ptrs, num_computed_tokens
        )
        if num_computed_tokens is None or not any(self.sliding_window_reach):
            return tables
        rows = idx_mapping.cpu().tolist()
        computed = num_computed_tokens.cpu().tolist()
        for g, t in enumerate(tables):
            if self.sliding_window_reach[g] or self.kernel_block_sizes[g] != 1:
                continue
            for b, r in enumerate(rows):
                if r >= 0 and computed[r] >= 1:
                    t[b, 0] = 0
        return tables
