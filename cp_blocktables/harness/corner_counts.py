"""Corner counting of the harness workload (SPEC.md section 6): what a step's shape reached.

`_CornerCounts` counts, after a step is shaped, the corners of its batch
(padding, a smaller step or batch, a step that fills the token buffer,
garbage in the positions' tail, shuffled rows) and, per scheduled request,
those of the configuration and the traffic
(interleave against block size, mixed groups, windows at their boundary,
wide rows, slots past 2**31, tokens mapped through a table that spans 2**31
positions or at positions past 2**31, in a layout where no size is a power of
two or where one alone is not), and slots 1 and 2 written beside tokens 0 and 1
without a slot. A mixin of the workload generator (`workload._Generator`); the
life cycle (`lifecycle`) and the batch shape (`batch_shape`) count the corners
they reach themselves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .. import reference
from ..contract import PAD_SLOT_ID

if TYPE_CHECKING:
    from .lifecycle import _Request
    from .workload import Step


class _CornerCounts:
    def _count_shape_corners(self, step: Step, tail: np.ndarray) -> None:
        c = self.corners
        c["padded_tokens"] += step.num_tokens_padded > step.num_tokens
        c["padded_reqs"] += step.num_reqs_padded > step.num_reqs
        c["profiled_rows_reclaimed"] += step.num_reqs_padded < self.profiled_rows
        self.profiled_rows = 0
        c["smaller_step"] += step.num_tokens < self.prev_num_tokens
        c["giant_shrink"] += step.num_tokens + 8192 < self.prev_num_tokens
        short = 0 < step.num_reqs <= 2 and step.num_tokens <= 64
        c["short_step_long_buffer"] += short and self.cfg.max_num_batched_tokens > 8192
        c["full_batch"] += step.num_reqs == self.cfg.max_num_reqs
        c["wide_gather"] += step.num_reqs_padded > 16 and self._widest_table() > 2048
        # The buffer's last entry holds a real request's token.
        rows = step.token_rows()[0]
        full = step.num_tokens == self.cfg.max_num_batched_tokens and rows.size and rows[-1] >= 0
        c["full_step"] += bool(full)
        # ... and its last token alone in the last entry: in a buffer of a power of two
        # mapped in one tile, an entry starting at the tile's last token, where a search for
        # the tile's last entry must step past an entry that ends exactly at its bound.
        c["full_step_one_token_last"] += bool(full and rows.size > 1 and rows[-2] != rows[-1])
        c["smaller_batch"] += step.num_reqs_padded < self.rows_high
        c["positions_tail_garbage"] += bool(tail.any())
        rows = step.idx_mapping[step.idx_mapping >= 0]
        c["batch_order_shuffled"] += bool((np.diff(rows) < 0).any())
        self.prev_num_tokens = step.num_tokens
        self.rows_high = max(self.rows_high, step.num_reqs_padded)
        if step.kind == "real":
            self._count_small_slots_beside_pad(step)

    def _widest_table(self) -> int:
        """Columns of the widest table: a gather of more than 16 rows of more than 2,048
        columns (`wide_gather`) is over 32K entries, several programs of several rows on
        our interpreted tiles (65,536 entries: 16 rows of 4,096 columns) and on a GPU's
        (2,048 entries: 4 rows of 512), so a program that writes the wrong rows shows."""
        cfg = self.cfg
        return max((cfg.table_width(g) for g in range(self.num_groups)), default=0)

    def _count_small_slots_beside_pad(self, step: Step) -> None:
        """`small_slot_beside_pad`: a rank writes slot `2 - t` of a group while token `t`
        (0 or 1) has no slot there (a dummy's token, or a position another rank owns).

        Slots 1 and 2 are the smallest outside the null block (which holds the slots
        below the block size): only a group of block size 1 or 2 whose ids start at 1
        writes them. An integrity check (SPEC.md 8.3) compares slots and must keep the
        tokens without one apart from them, whatever stands in for their slot: ours
        sorts them under `-2 - t`, and a sign lost there gives 2 and 1. Groups of
        larger blocks cannot reach this and are skipped, so they cost nothing here.
        """
        cfg = self.cfg
        for g in range(self.num_groups):
            if cfg.block_sizes[g] > 2 or not cfg.slot_mapping_enabled[g]:
                continue
            for k in range(cfg.group_cp_size(g)):
                slots = self._rank_slots(step, g, k)
                live = slots[slots >= cfg.block_sizes[g]]
                for t in range(min(2, slots.size)):
                    self.corners["small_slot_beside_pad"] += bool(
                        slots[t] == PAD_SLOT_ID and (live == 2 - t).any()
                    )

    def _rank_slots(self, step: Step, g: int, k: int) -> np.ndarray:
        """SPEC.md section 2's slot of every token of `step` in group `g` on CP rank `k`
        (PAD for a dummy's tokens), from the requests' own blocks, not from any table."""
        cfg, qsl = self.cfg, step.query_start_loc
        slots = np.full(step.num_tokens, PAD_SLOT_ID, dtype=np.int64)
        for b, uid in enumerate(step.uids.tolist()):
            if uid < 0:
                continue
            lo, hi = int(qsl[b]), int(qsl[b + 1])
            slots[lo:hi] = reference.slots_for_positions(
                np.asarray(self.running[uid].blocks[g], dtype=np.int64),
                step.positions[lo:hi],
                cfg.block_sizes[g],
                cfg.group_cp_size(g),
                k,
                cfg.cp_interleave,
                cfg.kernel_block_sizes[g],
            )
        return slots

    def _count_step_corners(self, scheduled: list[tuple[_Request, int]]) -> None:
        cfg, c, p = self.cfg, self.corners, self.p
        kernel = cfg.kernel_block_sizes
        m = [p.kernel_factor(g) for g in range(self.num_groups)]
        # Positions a table row covers, as the kernels' layout computes it (columns in
        # kernel blocks times the kernel block size times the group's CP size). Once one
        # table spans 2**31, the slot mapping computes positions in int64 (`POS32` false):
        # `span_past_2_31` counts the tokens it maps in such a table's own group.
        spans = [
            cfg.table_width(g) * kernel[g] * cfg.group_cp_size(g) for g in range(self.num_groups)
        ]
        if cfg.cp_size > 1:
            for g in range(self.num_groups):
                if cfg.dcp_sharded[g]:
                    i, bs = cfg.cp_interleave, kernel[g]
                    c[
                        "interleave_1"
                        if i == 1
                        else "interleave_eq_block"
                        if i == bs
                        else "interleave_between"
                    ] += 1
                    c["interleave_eq_kernel"] += i == bs and m[g] > 1
            kinds = {
                (
                    "disabled"
                    if not cfg.slot_mapping_enabled[g]
                    else "sharded"
                    if cfg.dcp_sharded[g]
                    else "unsharded"
                )
                for g in range(self.num_groups)
            }
            c["mixed_groups"] += len(kinds) == 3
            c["window_configured_under_cp"] += self.pass_nct
        c["several_block_sizes"] += len(set(cfg.block_sizes)) > 1
        c["zero_groups"] += self.num_groups == 0
        c["one_group"] += self.num_groups == 1
        c["two_groups"] += self.num_groups == 2  # the fused apply of the fewest tables
        c["many_groups"] += self.num_groups >= 5
        c["kernel_blocks"] += any(x > 1 for x in m)
        c["kernel_blocks_mixed"] += any(x > 1 for x in m) and any(x == 1 for x in m)
        # Kernel ids `b * m + k` where `m` is no power of two: `|` or a shift stands in wrongly.
        c["kernel_ratio_not_power_of_two"] += any(x & (x - 1) for x in m)
        # No size a slot mapping divides by is a power of two (kernel block sizes, group
        # CP sizes, the interleave), so no shift can stand in for a division.
        sizes = [*kernel, *(cfg.group_cp_size(g) for g in range(self.num_groups))]
        odd = bool(sizes) and all(x & (x - 1) for x in [*sizes, cfg.cp_interleave])
        # One size alone is not a power of two, and a sloppy test (even, or no two adjacent
        # bits set) takes it for one: 20 among powers of two flips the whole layout's path.
        lone = {x for x in [*sizes, cfg.cp_interleave] if x & (x - 1)}
        lone = len(lone) == 1 and all(x % 2 == 0 and x & (x >> 1) == 0 for x in lone)
        # Every size is one below a power of two (all ones: 1, 3, 7, 15) and one is not 1:
        # a test that takes `n & (n + 1)` for `n & (n - 1)` shifts by log2(3) for a 3.
        ones = [*sizes, cfg.cp_interleave]
        ones = bool(sizes) and all(x & (x + 1) == 0 for x in ones) and max(ones) > 1
        for req, n in scheduled:
            self.real_tokens += n
            c["giant_request_step"] += n > 8192
            c["no_power_of_two"] += n if odd else 0
            c["lone_non_power_of_two"] += n if lone else 0
            c["all_ones_sizes"] += n if ones else 0
            for g in range(self.num_groups):
                w, bs = self.reach[g], kernel[g]
                if w and req.nct > w and (req.nct - w) % bs == 0:
                    c["window_boundary"] += 1
                c["wide_row"] += len(req.blocks[g]) * m[g] > 2048
                if cfg.slot_mapping_enabled[g]:
                    c["span_past_2_31"] += n if spans[g] >= 2**31 else 0
                    cols = np.arange(req.nct, req.nct + n) // self.virtual[g]
                    blocks = np.asarray(req.blocks[g], dtype=np.int64)[cols]
                    c["slot_past_2_31"] += int((blocks * cfg.block_sizes[g] >= 2**31).sum())
                    c["unit_block_past_width"] += self._past_unit_width(g, req.nct, n)
        self._count_far_corners(scheduled)

    def _past_unit_width(self, g: int, start: int, n: int) -> int:
        """`unit_block_past_width`: positions `[start, start + n)` at or past the width in
        blocks of a sharded group of block size 1 under CP. One block holds one slot, so
        only the virtual block (SPEC.md section 2: `block_size * cp_size` positions) reaches
        them, and a span taken with any other factor of 1 (`block_size ** cp_size`, the
        block size alone) refuses legal positions."""
        cfg = self.cfg
        if cfg.block_sizes[g] != 1 or not cfg.dcp_sharded[g] or cfg.group_cp_size(g) < 2:
            return 0
        width = cfg.table_width(g)
        return max(0, start + n - max(start, width))

    def _count_far_corners(self, scheduled: list[tuple[_Request, int]]) -> None:
        """Tokens mapped at positions past 2**31 (`Preset.far_start`), where the slot
        mapping must compute positions in int64; `past_2_31_by_cp` those of a layout whose
        tables stay below 2**31 positions without their CP factor (columns times kernel
        block size), so that a span computed without it takes the int32 path.
        `past_2_30_int32`: tokens at positions from 2**30 on while every table spans fewer
        than 2**31 positions with its CP factor, the top half of the int32 path's range."""
        cfg, c = self.cfg, self.corners
        if not any(cfg.slot_mapping_enabled):
            return
        widths = [cfg.table_width(g) * cfg.kernel_block_sizes[g] for g in range(self.num_groups)]
        bare = max(widths) < 2**31
        int32 = max(w * cfg.group_cp_size(g) for g, w in enumerate(widths)) < 2**31
        for req, n in scheduled:
            past = max(0, req.nct + n - max(req.nct, 2**31))  # of positions [nct, nct + n)
            c["position_past_2_31"] += past
            c["past_2_31_by_cp"] += past if bare else 0
            c["past_2_30_int32"] += max(0, req.nct + n - max(req.nct, 2**30)) if int32 else 0
