"""The forward pass's reads of `BlockTables` (SPEC.md 3 and 8.2).

Per step the engine gathers the batch's rows into the persistent forward-pass
tables and maps every token to its slot, with two launches or, fused, one.
Both write only persistent buffers whose addresses never change (CUDA graphs
capture them) or caller-owned ones; the gather also keeps the count of rows
it may have left non-zero, so that the next one clears them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import guards, integrity, kernels
from .contract import PAD_SLOT_ID


class ForwardPassReads:
    """`BlockTables`' read methods; a mixin over its state (see `BlockTables`)."""

    # ------------------------------------------------------------ gather

    def gather_block_tables(
        self,
        idx_mapping: torch.Tensor,
        num_reqs_padded: int,
        out: Sequence[torch.Tensor] | None = None,
        out_ptrs: torch.Tensor | None = None,
        num_computed_tokens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """Copy the batch's rows into the forward-pass tables; returns `[:num_reqs_padded]` views.

        Row `b` gets entries `[0, num_blocks)` of row `idx_mapping[b]` (entries
        past that are never read and left as they are); dummy rows and rows
        `[num_reqs, num_rows)` become zero. `num_rows` is `num_reqs_padded`, or
        for the persistent tables at least the rows the previous gather wrote.
        """
        self._inputs.gather(idx_mapping, num_reqs_padded, num_computed_tokens)
        if self._validating():
            self._inputs.rows(idx_mapping)
        if out is None and out_ptrs is not None:
            raise ValueError("out_ptrs needs out: the tensors it points to")
        if out is None:
            dst = self.input_block_tables
            dst_ptrs, dst_strides = self.input_block_table_ptrs, self.input_block_table_strides
            num_rows = self._claim_input_rows(num_reqs_padded)
        else:
            dst = self._inputs.out_tables(out, num_reqs_padded)
            guards.check_out_tables(dst, out_ptrs, self.device)
            dst_ptrs = (
                out_ptrs
                if out_ptrs is not None
                else self._device_tensor([t.data_ptr() for t in dst], torch.uint64)
            )
            dst_strides = self._device_tensor([t.stride(0) for t in dst], torch.int64)
            num_rows = num_reqs_padded
        if self.num_kv_cache_groups:
            kernels.gather_block_tables(
                *self._gather_args(idx_mapping, num_rows, dst_ptrs, dst_strides),
                self._window_mask(num_computed_tokens),
            )
        if self.integrity_checks:
            self._check_gathered(dst, idx_mapping, num_computed_tokens)
        if out is None:
            return self._table_views_of(num_reqs_padded)
        return tuple(t[:num_reqs_padded] for t in dst)

    def _table_views_of(self, num_rows: int) -> tuple[torch.Tensor, ...]:
        """`[:num_rows]` views of the persistent forward-pass tables, built once per size:
        slicing costs about a microsecond a tensor, on the CPU's critical path."""
        views = self._table_views.get(num_rows)
        if views is None:
            views = self._table_views[num_rows] = tuple(
                t[:num_rows] for t in self.input_block_tables
            )
        return views

    def get_dummy_block_tables(self, num_reqs: int) -> tuple[torch.Tensor, ...]:
        """Zero persistent rows that may hold ids; returns `[:num_reqs]` views of them.

        The returned rows count as written (SPEC section 3): a profiling pass may
        fill them, and the next gather into the persistent tables zeroes them.
        """
        if not 0 <= num_reqs <= self.max_num_reqs:
            raise ValueError(f"num_reqs must lie in [0, {self.max_num_reqs}], got {num_reqs}")
        rows = max(num_reqs, self._input_rows_written)
        for t in self.input_block_tables:
            t[:rows].zero_()
        # The views handed out may be filled by a profiling run: they count as
        # written, so the next gather into the persistent tables clears them.
        self._input_rows_written = num_reqs
        return tuple(t[:num_reqs] for t in self.input_block_tables)

    def _claim_input_rows(self, num_reqs_padded: int) -> int:
        """Rows a gather into the persistent tables must write; records what it leaves."""
        num_rows = max(num_reqs_padded, self._input_rows_written)
        self._input_rows_written = num_reqs_padded
        return num_rows

    def _window_mask(self, num_computed_tokens: torch.Tensor | None) -> torch.Tensor | None:
        """`num_computed_tokens` when some group masks its sliding window, else `None`."""
        if num_computed_tokens is not None and self._any_reach:
            return num_computed_tokens
        return None

    def _gather_args(
        self,
        idx_mapping: torch.Tensor,
        num_rows: int,
        dst_ptrs: torch.Tensor,
        dst_strides: torch.Tensor,
    ) -> tuple:
        """Arguments of `kernels.gather_block_tables` up to `num_computed_tokens`."""
        return (
            idx_mapping,
            num_rows,
            self.max_num_reqs,
            self.block_table_ptrs,
            self.block_table_strides,
            dst_ptrs,
            dst_strides,
            self.block_table_widths,
            self._max_width,
            self.num_blocks.gpu,
            self.kernel_block_sizes_tensor,
            self.sliding_window_reach_tensor,
        )

    # ------------------------------------------------------------ slot mappings

    def compute_slot_mappings(
        self,
        idx_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        num_tokens_padded: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Slot of every token in every group, `PAD_SLOT_ID` where it writes nothing here.

        Fills the whole output buffer in one launch (tokens past
        `qsl[num_reqs]` become `PAD_SLOT_ID`) and returns `[:, :num_tokens_padded]`.
        """
        buf = self._inputs.slots(
            idx_mapping, query_start_loc, positions, num_tokens_padded, out, self.slot_mappings
        )
        if self._validating():
            self._inputs.rows(idx_mapping)
            self._inputs.tokens(idx_mapping, query_start_loc, positions, num_tokens_padded)
        if out is None:
            self._slot_plan.launch(idx_mapping, query_start_loc, positions, num_tokens_padded)
        else:
            kernels.compute_slot_mappings(
                idx_mapping,
                query_start_loc,
                positions,
                self.max_num_reqs,
                self._layout,
                self.cp_rank,
                self.cp_interleave,
                buf,
                num_tokens_padded,
            )
        if self.integrity_checks:
            self._check_slots(buf, query_start_loc, idx_mapping, positions, num_tokens_padded)
        return buf[:, :num_tokens_padded]

    # ------------------------------------------------------------ both reads

    def gather_and_compute_slot_mappings(
        self,
        idx_mapping: torch.Tensor,
        num_reqs_padded: int,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        num_tokens_padded: int,
        num_computed_tokens: torch.Tensor | None = None,
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """`gather_block_tables` then `compute_slot_mappings` on the persistent buffers, one launch.

        Same checks, effects and results as the two calls (SPEC.md 8.2): every
        check runs before the launch, so a refused call changes nothing.
        Returns `(tables, slot_mappings)` as the two methods would.
        """
        num_reqs = self._inputs.gather(idx_mapping, num_reqs_padded, num_computed_tokens)
        buf = self._inputs.slots(
            idx_mapping, query_start_loc, positions, num_tokens_padded, None, self.slot_mappings,
            num_reqs,
        )  # fmt: skip
        if self._validating():
            self._inputs.rows(idx_mapping)
            self._inputs.tokens(idx_mapping, query_start_loc, positions, num_tokens_padded)
        num_rows = self._claim_input_rows(num_reqs_padded)
        if self.num_kv_cache_groups:
            kernels.gather_and_compute_slot_mappings(
                *self._gather_args(
                    idx_mapping,
                    num_rows,
                    self.input_block_table_ptrs,
                    self.input_block_table_strides,
                ),
                self._window_mask(num_computed_tokens),
                query_start_loc,
                positions,
                self._layout,
                self.cp_rank,
                self.cp_interleave,
                buf,
                num_tokens_padded,
            )
        if self.integrity_checks:  # the same checks, in the same order, as the two calls
            self._check_gathered(self.input_block_tables, idx_mapping, num_computed_tokens)
            self._check_slots(buf, query_start_loc, idx_mapping, positions, num_tokens_padded)
        return self._table_views_of(num_reqs_padded), buf[:, :num_tokens_padded]

    # ------------------------------------------------------------ integrity (SPEC.md 8.3)

    def _check_gathered(
        self,
        dst: Sequence[torch.Tensor],
        idx_mapping: torch.Tensor,
        num_computed_tokens: torch.Tensor | None,
    ) -> None:
        integrity.check_gathered_block_tables(
            dst, [t.gpu for t in self.block_tables], idx_mapping, self.num_blocks.gpu,
            self.num_blocks.np, self.kernel_block_sizes, self.sliding_window_reach,
            num_computed_tokens,
        )  # fmt: skip

    def _check_slots(
        self,
        buf: torch.Tensor,
        query_start_loc: torch.Tensor,
        idx_mapping: torch.Tensor,
        positions: torch.Tensor,
        num_tokens_padded: int,
    ) -> None:
        integrity.check_slot_mappings(
            buf, query_start_loc, idx_mapping, positions, self._null_slot_floors,
            num_tokens_padded,
        )  # fmt: skip

    def get_dummy_slot_mappings(self, num_tokens: int) -> torch.Tensor:
        """Fill the persistent buffer with `PAD_SLOT_ID`; returns `[:, :num_tokens]`."""
        if not 0 <= num_tokens <= self.max_num_batched_tokens:
            raise ValueError(
                f"num_tokens must lie in [0, {self.max_num_batched_tokens}], got {num_tokens}"
            )
        self.slot_mappings.fill_(PAD_SLOT_ID)
        return self.slot_mappings[:, :num_tokens]
