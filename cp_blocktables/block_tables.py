"""`BlockTables`: per-group block tables, their forward-pass copies and slot mappings.

One instance lives in each CP rank's model runner. Per step the engine

1. stages new block ids (`append_block_ids`) and flushes them with one launch
   (`apply_staged_writes`), publishing the per-row block counts;
2. gathers the batch's rows into the persistent forward-pass tables
   (`gather_block_tables`), whose addresses never change, so CUDA graphs can
   capture them;
3. maps every token to the slot of this rank's KV cache it writes
   (`compute_slot_mappings`), or to `PAD_SLOT_ID` when it writes nothing here.

See SPEC.md sections 2 and 3 for the formulas; choices where the contract is
silent are listed in docs/contract-notes.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from operator import add, gt

import numpy as np
import torch

from . import guards, integrity, kernels
from .buffers import FusedStagedWriter, StagedWriteTensor, UvaBackedTensor
from .contract import INT32_MAX, NULL_BLOCK_ID, PAD_SLOT_ID, BlockTablesConfig


def _expand(ids: Sequence[int], m: int) -> list[int]:
    """Allocator ids to kernel ids: `b` becomes `b*m, b*m+1, ..., b*m+m-1`, in order."""
    kernel_ids = np.asarray(ids, dtype=np.int64)[:, None] * m + np.arange(m, dtype=np.int64)
    return kernel_ids.ravel().tolist()


_INDEX_DTYPES = (torch.int32, torch.int64)
_INT_TYPES = frozenset({int})  # the ids' types that need no closer look


def _refuse_id_types(req_index: int, group: int, ids: Sequence) -> None:
    """Raise unless every id is an integer (numpy integers included, bools not)."""
    for v in ids:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise ValueError(
                f"append_block_ids: request {req_index}, group {group}: block id {v!r} "
                f"is not an int"
            )


class BlockTables:
    """Block tables of every KV-cache group of one CP rank.

    Kernel block sizes (SPEC.md 8.1): `block_sizes[g]` is the allocator's block
    `B`, `kernel_block_sizes[g]` the attention kernel's `K`, `m = B // K`.
    Tables hold kernel block ids and `num_blocks` counts kernel blocks; every
    formula of section 2 uses `bs = K`. With `K == B` (the default) `m == 1`.

    Persistent buffers (allocated once; their addresses are stable):
    `block_tables[g].gpu` `[max_num_reqs, max_num_blocks_per_group[g] * m]` int32,
    `input_block_tables[g]` of the same shape, `slot_mappings`
    `[num_groups, max_num_batched_tokens]` int64, and the small per-group
    layout tensors built by `init_block_table_layout_tensors`.

    Host truth: `num_blocks.np` `[num_groups, max_num_reqs]`, the number of
    valid entries of each row; `apply_staged_writes` publishes it as
    `num_blocks.gpu`.
    """

    redirect_writes_to_null_block: bool = False
    """Set by a warm-up: every appended block id is staged as `NULL_BLOCK_ID`."""

    validate_inputs: bool | None = None
    """Check index/position values of each call (costs a device sync on CUDA).
    `None`: on for CPU devices, off for CUDA."""

    def __init__(
        self,
        block_sizes: list[int],
        max_num_reqs: int,
        max_num_batched_tokens: int,
        max_num_blocks_per_group: list[int],
        device: torch.device,
        cp_size: int = 1,
        cp_rank: int = 0,
        cp_interleave: int = 1,
        slot_mapping_enabled: list[bool] | None = None,
        dcp_sharded: list[bool] | None = None,
        sliding_window_reach: list[int] | None = None,
        kernel_block_sizes: list[int] | None = None,
        integrity_checks: bool = False,
    ) -> None:
        cfg = BlockTablesConfig(
            block_sizes,
            max_num_reqs,
            max_num_batched_tokens,
            max_num_blocks_per_group,
            cp_size,
            cp_rank,
            cp_interleave,
            slot_mapping_enabled,
            dcp_sharded,
            sliding_window_reach,
            kernel_block_sizes,
        )
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device {device!r} is not a torch device: {e}") from None
        self.config = cfg
        # get_device() of tensors on our device: -1 for CPU, None for any CUDA device.
        self._device_index = -1 if self.device.type == "cpu" else self.device.index
        self.block_sizes = cfg.block_sizes  # the allocator's blocks: what appends are given
        self.kernel_block_sizes = cfg.kernel_block_sizes  # what tables and slots are built of
        self.max_num_reqs = cfg.max_num_reqs
        self.max_num_batched_tokens = cfg.max_num_batched_tokens
        self.max_num_blocks_per_group = cfg.max_num_blocks_per_group
        self.cp_size = cfg.cp_size
        self.cp_rank = cfg.cp_rank
        self.cp_interleave = cfg.cp_interleave
        self.num_kv_cache_groups = cfg.num_kv_cache_groups
        self.slot_mapping_enabled = cfg.slot_mapping_enabled
        self.sliding_window_reach = cfg.effective_sliding_window_reach()
        # SPEC 8.3; also on under CPBT_INTEGRITY_CHECKS=1. See integrity.py.
        self.integrity_checks = integrity.enabled(integrity_checks)
        self._any_reach = any(self.sliding_window_reach)
        num_groups = self.num_kv_cache_groups
        # Kernel blocks per allocator block, and the row capacity in kernel blocks.
        self._kernel_factors = [cfg.kernel_blocks_per_block(g) for g in range(num_groups)]
        self._expands = any(m > 1 for m in self._kernel_factors)
        self._table_widths = [cfg.table_width(g) for g in range(num_groups)]
        # Largest allocator id whose last kernel id still fits an int32 table entry.
        self._max_block_ids = [(INT32_MAX + 1) // m - 1 for m in self._kernel_factors]

        self.block_tables = [
            StagedWriteTensor((max_num_reqs, w), torch.int32, self.device)
            for w in self._table_widths
        ]
        # [num_groups, max_num_reqs]
        self.num_blocks = UvaBackedTensor(
            (num_groups, max_num_reqs), torch.int32, device=self.device
        )
        self.input_block_tables = [torch.zeros_like(t.gpu) for t in self.block_tables]
        # [num_groups, max_num_batched_tokens]
        self.slot_mappings = torch.full(
            (num_groups, max_num_batched_tokens), PAD_SLOT_ID, dtype=torch.int64, device=self.device
        )
        self.fused_writer = (
            FusedStagedWriter(self.device, max_writes=max_num_reqs * num_groups)
            if num_groups >= 2
            else None
        )
        # Rows of input_block_tables the last gather may have left non-zero.
        self._input_rows_written = 0
        # Scratch of append_block_ids (no allocation per call).
        self._append_starts = [0] * num_groups
        self._append_ends = [0] * num_groups
        self._zeros = [0] * num_groups
        self.init_block_table_layout_tensors()

    # ------------------------------------------------------------ layout

    def _device_tensor(self, values: Sequence, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(list(values), dtype=dtype, device=self.device)

    def _put(self, name: str, values: Sequence, dtype: torch.dtype) -> torch.Tensor:
        """Set attribute `name` to `values` on the device, in place when it exists and fits."""
        host = torch.tensor(list(values), dtype=dtype)
        t = kernels.refill(self.__dict__.get(name), host, self.device)
        setattr(self, name, t)
        return t

    def init_block_table_layout_tensors(self) -> None:
        """(Re)build every derived device tensor from host-side state; reset the forward pass.

        Call after replacing `block_tables[g].gpu` or `input_block_tables[g]`,
        and on wake-up from sleep mode (SPEC.md 8.4), which may have discarded
        the contents of every device tensor: pointers, strides, widths, sizes,
        flags, reaches and the slot-mapping layout are rewritten from the host
        (in place where they exist, so that captured CUDA graphs stay valid),
        the forward-pass tables are zeroed and the slot mappings set to
        `PAD_SLOT_ID`, keeping their addresses. The persistent tables are not
        touched: the engine re-appends every live row with `overwrite=True`.
        """
        cfg = self.config
        tables = [t.gpu for t in self.block_tables]
        guards.check_layout(tables, self.input_block_tables, self.max_num_reqs, self.device)
        inputs = self.input_block_tables
        put = self._put
        put("block_table_ptrs", [t.data_ptr() for t in tables], torch.uint64)  # [num_groups]
        put("block_table_strides", [t.stride(0) for t in tables], torch.int64)
        put("input_block_table_ptrs", [t.data_ptr() for t in inputs], torch.uint64)
        put("input_block_table_strides", [t.stride(0) for t in inputs], torch.int64)
        put("block_table_widths", [t.shape[1] for t in tables], torch.int32)
        put("block_sizes_tensor", cfg.block_sizes, torch.int64)
        put("kernel_block_sizes_tensor", cfg.kernel_block_sizes, torch.int64)
        put("dcp_sharded", cfg.dcp_sharded, torch.bool)
        put("sliding_window_reach_tensor", self.sliding_window_reach, torch.int64)
        self._max_width = max((t.shape[1] for t in tables), default=1)
        old = self.__dict__.get("_layout")
        self._layout = kernels.GroupLayout.build(
            tables,
            self.block_table_ptrs,
            cfg.kernel_block_sizes,
            [cfg.group_cp_size(g) for g in range(self.num_kv_cache_groups)],
            cfg.slot_mapping_enabled,
            self.device,
            params_out=None if old is None else old.params,
        )
        # The forward pass's buffers: nothing in them may outlive a sleep.
        for t in inputs:
            t.zero_()
        self._input_rows_written = 0
        self.slot_mappings.fill_(PAD_SLOT_ID)
        # The slot mapping into the persistent buffer, its launch prepared once.
        self._slot_plan = kernels.SlotMappingPlan(
            self._layout, self.max_num_reqs, self.cp_rank, self.cp_interleave, self.slot_mappings
        )
        # Views handed back by the reads, built once per size (see `_table_views`).
        self._table_views: dict[int, tuple[torch.Tensor, ...]] = {}
        self._slot_views: dict[int, torch.Tensor] = {}
        # State of the integrity checks (SPEC.md 8.3), once they exist, is rebuilt here too.

    # ------------------------------------------------------------ writes

    def append_block_ids(
        self, req_index: int, new_block_ids: tuple[list[int], ...], overwrite: bool
    ) -> None:
        """Stage `new_block_ids[g]` for row `req_index` of every group `g`.

        With `overwrite` the ids start at column 0 (a new request in a reused
        row), else after the row's current blocks. Each allocator id `b` is
        staged as its `m` kernel ids `b*m .. b*m+m-1` (SPEC.md 8.1) and counts
        advance by `m` per id. Either every group is staged or, on error, none.

        Called for every request with new blocks in every step, on the CPU's
        critical path: the ids are checked once (their types in one C-level
        pass, their range by `min` and `max`), every check runs before anything
        is staged, and nothing is allocated beyond the staged lists themselves.
        """
        if type(req_index) is not int:
            if isinstance(req_index, (bool, np.bool_)) or not isinstance(req_index, np.integer):
                raise ValueError(
                    f"req_index must be an int in [0, {self.max_num_reqs}), got {req_index!r}"
                )
            req_index = int(req_index)
        if not 0 <= req_index < self.max_num_reqs:
            raise ValueError(
                f"req_index must be an int in [0, {self.max_num_reqs}), got {req_index!r}"
            )
        num_groups = self.num_kv_cache_groups
        if len(new_block_ids) != num_groups:
            raise ValueError(
                f"new_block_ids has {len(new_block_ids)} entries for {num_groups} KV-cache groups"
            )
        counts = self.num_blocks.np  # [num_groups, max_num_reqs]: the host truth
        if not self._expands and not self.redirect_writes_to_null_block:
            # The common case, in C-level passes: lengths, every id's type, the range.
            if overwrite:
                starts = self._zeros
                ends = list(map(len, new_block_ids))
            else:
                starts = counts[:, req_index].tolist()
                ends = list(map(add, starts, map(len, new_block_ids)))
            if any(map(gt, ends, self._table_widths)):
                self._refuse_capacity(req_index, ends)
            flat = list(chain.from_iterable(new_block_ids))
            if flat:
                if not _INT_TYPES.issuperset(map(type, flat)):
                    for g, ids in enumerate(new_block_ids):
                        _refuse_id_types(req_index, g, ids)
                if min(flat) < 0 or max(flat) > INT32_MAX:
                    self._refuse_id_range(req_index, new_block_ids)
            for g, (table, ids) in enumerate(zip(self.block_tables, new_block_ids)):
                if len(ids):
                    table._stage_checked(req_index, starts[g], ids)
                counts[g, req_index] = ends[g]
            return
        self._append_general(req_index, new_block_ids, overwrite, counts)

    def _refuse_capacity(self, req_index: int, ends: list[int]) -> None:
        for g, end in enumerate(ends):
            if end > self._table_widths[g]:
                unit = "kernel blocks" if self._kernel_factors[g] > 1 else "blocks"
                raise RuntimeError(
                    f"append_block_ids: request {req_index}, group {g}: {unit} would end at "
                    f"{end}, past the row capacity {self._table_widths[g]}"
                )

    def _refuse_id_range(self, req_index: int, new_block_ids: Sequence[Sequence[int]]) -> None:
        for g, ids in enumerate(new_block_ids):
            if len(ids) and (min(ids) < 0 or max(ids) > self._max_block_ids[g]):
                raise ValueError(
                    f"append_block_ids: request {req_index}, group {g}: block ids "
                    f"must lie in [0, {self._max_block_ids[g]}]"
                )

    def _append_general(
        self,
        req_index: int,
        new_block_ids: Sequence[Sequence[int]],
        overwrite: bool,
        counts: np.ndarray,
    ) -> None:
        """`append_block_ids` with kernel-block expansion or null-block redirection."""
        num_groups = self.num_kv_cache_groups
        factors, widths, max_ids = self._kernel_factors, self._table_widths, self._max_block_ids
        starts = self._append_starts
        ends = self._append_ends
        # Every check runs before anything is staged: an error leaves no partial state.
        for g in range(num_groups):
            ids = new_block_ids[g]
            start = 0 if overwrite else int(counts[g, req_index])
            end = start + len(ids) * factors[g]
            if end > widths[g]:
                unit = "kernel blocks" if factors[g] > 1 else "blocks"
                raise RuntimeError(
                    f"append_block_ids: request {req_index}, group {g}: {unit} would end at "
                    f"{end}, past the row capacity {widths[g]}"
                )
            if len(ids):
                if not _INT_TYPES.issuperset(map(type, ids)):
                    _refuse_id_types(req_index, g, ids)
                if min(ids) < 0 or max(ids) > max_ids[g]:
                    raise ValueError(
                        f"append_block_ids: request {req_index}, group {g}: block ids "
                        f"must lie in [0, {max_ids[g]}]"
                    )
            starts[g] = start
            ends[g] = end
        redirect = self.redirect_writes_to_null_block
        for g in range(num_groups):
            ids = new_block_ids[g]
            if not len(ids):
                counts[g, req_index] = ends[g]
                continue
            if redirect:
                ids = [NULL_BLOCK_ID] * len(ids)
            elif type(ids) is not list:
                ids = list(ids)
            if factors[g] > 1:
                ids = _expand(ids, factors[g])
            self.block_tables[g]._stage_checked(req_index, starts[g], ids)
            counts[g, req_index] = ends[g]

    def apply_staged_writes(self) -> None:
        """Make every staged write visible on the device and publish `num_blocks`."""
        if self.num_kv_cache_groups == 0:
            return
        if self.fused_writer is None:
            self.block_tables[0].apply_write()
        else:
            self.fused_writer.apply(
                self.block_tables, self.block_table_ptrs, self.block_table_strides
            )
        self.num_blocks.copy_to_uva()

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
        self._check_gather(idx_mapping, num_reqs_padded, num_computed_tokens)
        if self._validating():
            self._check_rows(idx_mapping)
        if out is None and out_ptrs is not None:
            raise ValueError("out_ptrs needs out: the tensors it points to")
        if out is None:
            dst = self.input_block_tables
            dst_ptrs, dst_strides = self.input_block_table_ptrs, self.input_block_table_strides
            num_rows = self._claim_input_rows(num_reqs_padded)
        else:
            dst = self._check_out_tables(out, num_reqs_padded)
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
            integrity.check_gathered_block_tables(
                dst, [t.gpu for t in self.block_tables], idx_mapping, self.num_blocks.gpu,
                self.num_blocks.np, self.kernel_block_sizes, self.sliding_window_reach,
                num_computed_tokens,
            )  # fmt: skip
        if out is None:
            return self._table_views_of(num_reqs_padded)
        return tuple(t[:num_reqs_padded] for t in dst)

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
        buf = self._check_slots(idx_mapping, query_start_loc, positions, num_tokens_padded, out)
        if self._validating():
            self._check_rows(idx_mapping)
            self._check_tokens(idx_mapping, query_start_loc, positions, num_tokens_padded)
        if out is None:
            self._slot_plan.launch(idx_mapping, query_start_loc, positions)
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
            )
        if self.integrity_checks:
            integrity.check_slot_mappings(
                buf, query_start_loc, idx_mapping, positions, self.block_sizes, num_tokens_padded
            )
        return self._slot_view_of(num_tokens_padded) if out is None else buf[:, :num_tokens_padded]

    def _table_views_of(self, num_rows: int) -> tuple[torch.Tensor, ...]:
        """`[:num_rows]` views of the persistent forward-pass tables, built once per size:
        slicing costs about a microsecond a tensor, on the CPU's critical path."""
        views = self._table_views.get(num_rows)
        if views is None:
            views = self._table_views[num_rows] = tuple(
                t[:num_rows] for t in self.input_block_tables
            )
        return views

    def _slot_view_of(self, num_tokens: int) -> torch.Tensor:
        """`[:, :num_tokens]` of the persistent slot mappings, built once per size."""
        view = self._slot_views.get(num_tokens)
        if view is None:
            view = self._slot_views[num_tokens] = self.slot_mappings[:, :num_tokens]
        return view

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
        num_reqs = self._check_gather(idx_mapping, num_reqs_padded, num_computed_tokens)
        buf = self._check_slots(
            idx_mapping, query_start_loc, positions, num_tokens_padded, None, num_reqs
        )
        if self._validating():
            self._check_rows(idx_mapping)
            self._check_tokens(idx_mapping, query_start_loc, positions, num_tokens_padded)
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
            )
        if self.integrity_checks:
            integrity.check_gathered_block_tables(
                self.input_block_tables, [t.gpu for t in self.block_tables], idx_mapping,
                self.num_blocks.gpu, self.num_blocks.np, self.kernel_block_sizes,
                self.sliding_window_reach, num_computed_tokens,
            )  # fmt: skip
            integrity.check_slot_mappings(
                buf, query_start_loc, idx_mapping, positions, self.block_sizes, num_tokens_padded
            )
        return self._table_views_of(num_reqs_padded), self._slot_view_of(num_tokens_padded)

    def get_dummy_slot_mappings(self, num_tokens: int) -> torch.Tensor:
        """Fill the persistent buffer with `PAD_SLOT_ID`; returns `[:, :num_tokens]`."""
        if not 0 <= num_tokens <= self.max_num_batched_tokens:
            raise ValueError(
                f"num_tokens must lie in [0, {self.max_num_batched_tokens}], got {num_tokens}"
            )
        self.slot_mappings.fill_(PAD_SLOT_ID)
        return self.slot_mappings[:, :num_tokens]

    # ------------------------------------------------------------ input checks

    def _check_gather(
        self,
        idx_mapping: torch.Tensor,
        num_reqs_padded: int,
        num_computed_tokens: torch.Tensor | None,
    ) -> int:
        """Shapes of a gather's inputs; returns `num_reqs`."""
        num_reqs = self._check_index_tensor("idx_mapping", idx_mapping)
        if not num_reqs <= num_reqs_padded <= self.max_num_reqs:
            raise ValueError(
                f"num_reqs_padded must lie in [num_reqs={num_reqs}, "
                f"max_num_reqs={self.max_num_reqs}], got {num_reqs_padded}"
            )
        if num_computed_tokens is not None:
            self._check_index_tensor(
                "num_computed_tokens", num_computed_tokens, min_len=self.max_num_reqs
            )
        return num_reqs

    def _check_slots(
        self,
        idx_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        num_tokens_padded: int,
        out: torch.Tensor | None,
        num_reqs: int | None = None,
    ) -> torch.Tensor:
        """Shapes of a slot mapping's inputs; returns the buffer it writes."""
        if num_reqs is None:  # else `idx_mapping` was checked by the caller
            num_reqs = self._check_index_tensor("idx_mapping", idx_mapping)
        self._check_index_tensor("query_start_loc", query_start_loc, exact_len=num_reqs + 1)
        self._check_index_tensor("positions", positions)
        if out is None:
            buf = self.slot_mappings
        else:
            buf = self._check_out_slots(out)
            guards.check_rows_disjoint(buf, "out")
        if not 0 <= num_tokens_padded <= buf.shape[1]:
            raise ValueError(
                f"num_tokens_padded must lie in [0, {buf.shape[1]}] (the output "
                f"buffer's length), got {num_tokens_padded}"
            )
        return buf

    def _validating(self) -> bool:
        if self.validate_inputs is None:
            return self.device.type == "cpu"
        return self.validate_inputs

    def _on_my_device(self, t: torch.Tensor) -> bool:
        """`cuda` (no index) matches any CUDA tensor; the caller set the current device."""
        index = t.get_device()  # -1 on CPU; cheaper than building `t.device`
        if self._device_index is None:
            return index >= 0
        return index == self._device_index

    def _check_index_tensor(
        self, name: str, t: object, exact_len: int | None = None, min_len: int = 0
    ) -> int:
        """Shape, dtype and device of a 1-D integer input (no device sync).

        The common case costs one combined test; the messages are built only on failure.
        """
        if isinstance(t, torch.Tensor) and t.dtype in _INDEX_DTYPES and t.dim() == 1:
            n = t.shape[0]
            index = t.get_device()  # -1 on CPU; cheaper than building `t.device`
            if (
                (index == self._device_index or (self._device_index is None and index >= 0))
                and (exact_len is None or n == exact_len)
                and n >= min_len
                and (n <= self.max_num_reqs or name != "idx_mapping")
                and t.is_contiguous()
            ):
                return n
        return self._refuse_index_tensor(name, t, exact_len, min_len)

    def _refuse_index_tensor(
        self, name: str, t: object, exact_len: int | None, min_len: int
    ) -> int:
        """`_check_index_tensor`'s slow path: raise the message that names the fault."""
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 1 or t.dtype not in _INDEX_DTYPES:
            raise ValueError(
                f"{name} must be a 1-D int32 or int64 tensor, got "
                f"{t.dtype} of shape {tuple(t.shape)}"
            )
        if not self._on_my_device(t):
            raise ValueError(f"{name} is on {t.device}, BlockTables on {self.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        n = t.shape[0]
        if exact_len is not None and n != exact_len:
            raise ValueError(f"{name} must have {exact_len} entries, got {n}")
        if n < min_len:
            raise ValueError(f"{name} must have at least {min_len} entries, got {n}")
        if name == "idx_mapping" and n > self.max_num_reqs:
            raise ValueError(
                f"idx_mapping has {n} entries, more than max_num_reqs={self.max_num_reqs}"
            )
        return n

    def _check_rows(self, idx_mapping: torch.Tensor) -> None:
        rows = idx_mapping.cpu().numpy()
        bad = (rows < -1) | (rows >= self.max_num_reqs)
        if bad.any():
            b = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"idx_mapping[{b}] = {rows[b]} is neither -1 (dummy) nor a row "
                f"in [0, {self.max_num_reqs})"
            )

    def _check_tokens(
        self,
        idx_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        num_tokens_padded: int,
    ) -> None:
        qsl = query_start_loc.cpu().numpy().astype(np.int64)
        if qsl[0] != 0 or (np.diff(qsl) < 0).any():
            raise ValueError(
                f"query_start_loc must start at 0 and never decrease, got {qsl.tolist()[:16]}"
            )
        num_tokens = int(qsl[-1])
        if num_tokens > positions.shape[0]:
            raise ValueError(
                f"query_start_loc ends at {num_tokens} tokens but positions has "
                f"{positions.shape[0]}"
            )
        if num_tokens > num_tokens_padded:
            raise ValueError(
                f"num_tokens_padded={num_tokens_padded} is less than the batch's "
                f"{num_tokens} tokens"
            )
        rows = np.repeat(idx_mapping.cpu().numpy(), np.diff(qsl))  # [num_tokens]
        pos = positions[:num_tokens].cpu().numpy()[rows >= 0]
        if pos.size == 0:
            return
        if pos.min() < 0:
            raise ValueError(f"positions must be >= 0, got {int(pos.min())}")
        cfg = self.config
        for g in range(self.num_kv_cache_groups):
            if not cfg.slot_mapping_enabled[g]:
                continue
            span = cfg.block_sizes[g] * cfg.group_cp_size(g) * cfg.max_num_blocks_per_group[g]
            if pos.max() >= span:
                raise ValueError(
                    f"position {int(pos.max())} lies past group {g}'s table "
                    f"({cfg.max_num_blocks_per_group[g]} blocks cover {span})"
                )

    def _check_out_tables(self, out: Sequence[torch.Tensor], rows: int) -> list[torch.Tensor]:
        if len(out) != self.num_kv_cache_groups:
            raise ValueError(f"out has {len(out)} tables for {self.num_kv_cache_groups} groups")
        for g, t in enumerate(out):
            width = self._table_widths[g]
            if (
                t.dtype != torch.int32
                or t.dim() != 2
                or t.shape[0] < rows
                or t.shape[1] < width
                or t.stride(1) != 1
                or not self._on_my_device(t)
            ):
                raise ValueError(
                    f"out[{g}] must be an int32 [>= {rows}, >= {width}] tensor "
                    f"with unit column stride on {self.device}, got {t.dtype} "
                    f"{tuple(t.shape)} on {t.device}"
                )
        return list(out)

    def _check_out_slots(self, out: torch.Tensor) -> torch.Tensor:
        if (
            out.dtype != torch.int64
            or out.dim() != 2
            or not self._on_my_device(out)
            or out.shape[0] != self.num_kv_cache_groups
            or out.stride(1) != 1
        ):
            raise ValueError(
                f"out must be an int64 [{self.num_kv_cache_groups}, n] tensor with "
                f"unit column stride on {self.device}, got {out.dtype} "
                f"{tuple(out.shape)} on {out.device}"
            )
        return out
