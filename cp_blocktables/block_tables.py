"""`BlockTables`: per-group block tables, their forward-pass copies and slot mappings.

One instance lives in each CP rank's model runner. Per step the engine

1. stages new block ids (`append_block_ids`) and flushes them with one launch
   (`apply_staged_writes`), publishing the per-row block counts;
2. gathers the batch's rows into the persistent forward-pass tables
   (`gather_block_tables`), whose addresses never change, so CUDA graphs can
   capture them;
3. maps every token to the slot of this rank's KV cache it writes
   (`compute_slot_mappings`), or to `PAD_SLOT_ID` when it writes nothing here;
   steps 2 and 3 also come as one launch (`gather_and_compute_slot_mappings`).

The class is spread over modules by idea: construction and the write path
here; the forward pass's reads in `_reads`; the derived device tensors and
their rebuild after sleep mode in `_layout_tensors`; input checks in
`_inputs`; the kernels in `kernels/`.

See SPEC.md sections 2, 3 and 8 for the formulas; choices where the contract
is silent are listed in docs/contract-notes.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from operator import add, gt

import numpy as np
import torch

from . import integrity
from ._inputs import InputChecks
from ._layout_tensors import LayoutTensors
from ._reads import ForwardPassReads
from .buffers import UvaBackedTensor
from .contract import INT32_MAX, NULL_BLOCK_ID, PAD_SLOT_ID, BlockTablesConfig
from .staged import FusedStagedWriter, StagedWriteTensor


def _expand(ids: Sequence[int], m: int) -> list[int]:
    """Allocator ids to kernel ids: `b` becomes `b*m, b*m+1, ..., b*m+m-1`, in order."""
    kernel_ids = np.asarray(ids, dtype=np.int64)[:, None] * m + np.arange(m, dtype=np.int64)
    return kernel_ids.ravel().tolist()


_INT_TYPES = frozenset({int})  # the ids' types that need no closer look


def _refuse_id_types(req_index: int, new_block_ids: Sequence[Sequence]) -> None:
    """Raise `ValueError` unless every id is an integer (numpy integers too, bools not)."""
    for g, ids in enumerate(new_block_ids):
        for v in ids:
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
                raise ValueError(
                    f"append_block_ids: request {req_index}, group {g}: block id {v!r} "
                    f"is not an int"
                )


class BlockTables(LayoutTensors, ForwardPassReads):
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
        self._any_reach = any(self.sliding_window_reach)
        # SPEC 8.3; also on under CPBT_INTEGRITY_CHECKS=1. See integrity.py.
        self.integrity_checks = integrity.enabled(integrity_checks)
        num_groups = self.num_kv_cache_groups
        # Kernel blocks per allocator block, and the row capacity in kernel blocks.
        self._kernel_factors = [cfg.kernel_blocks_per_block(g) for g in range(num_groups)]
        self._expands = any(m > 1 for m in self._kernel_factors)
        self._table_widths = [cfg.table_width(g) for g in range(num_groups)]
        self._inputs = InputChecks(cfg, self.device)
        self._zeros = [0] * num_groups  # append_block_ids' starts when overwriting

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
        self.init_block_table_layout_tensors()

    # ------------------------------------------------------------ writes

    def append_block_ids(
        self, req_index: int, new_block_ids: tuple[list[int], ...], overwrite: bool
    ) -> None:
        """Stage `new_block_ids[g]` for row `req_index` of every group `g`.

        With `overwrite` the ids start at column 0 (a new request in a reused
        row), else after the row's current blocks. Each allocator id `b` is
        staged as its `m` kernel ids `b*m .. b*m+m-1` (SPEC.md 8.1) and counts
        advance by `m` per id. Either every group is staged or, on error, none.
        """
        if type(req_index) is not int or not 0 <= req_index < self.max_num_reqs:
            self._inputs.append(req_index, new_block_ids)  # refuses, or passes a numpy int
            req_index = int(req_index)
        elif len(new_block_ids) != self.num_kv_cache_groups:
            self._inputs.append(req_index, new_block_ids)  # refuses
        counts = self.num_blocks.np  # [num_groups, max_num_reqs]: the host truth
        if self._expands or self.redirect_writes_to_null_block:
            self._append_general(req_index, new_block_ids, overwrite, counts)
            return
        # The common case, in C-level passes over every group at once: lengths,
        # capacity, every id's type, the range. Every check runs before anything
        # is staged: an error leaves no partial state.
        if overwrite:
            starts = self._zeros
            ends = list(map(len, new_block_ids))
        else:
            starts = counts[:, req_index].tolist()
            ends = list(map(add, starts, map(len, new_block_ids)))
        flat = list(chain.from_iterable(new_block_ids))
        if not _INT_TYPES.issuperset(map(type, flat)):
            _refuse_id_types(req_index, new_block_ids)  # unless every id is an integer
        if any(map(gt, ends, self._table_widths)) or (
            flat and (min(flat) < 0 or max(flat) > INT32_MAX)
        ):
            self._inputs.append_ends(req_index, new_block_ids, ends)  # raises: capacity, range
        for g, (table, ids) in enumerate(zip(self.block_tables, new_block_ids)):
            if len(ids):
                table._stage_checked(req_index, starts[g], ids)
            counts[g, req_index] = ends[g]

    def _append_general(
        self, req_index: int, new_block_ids: Sequence, overwrite: bool, counts: np.ndarray
    ) -> None:
        """`append_block_ids` with kernel-block expansion or null-block redirection."""
        num_groups = self.num_kv_cache_groups
        starts = [0] * num_groups if overwrite else counts[:, req_index].tolist()
        factors = self._kernel_factors
        ends = [s + len(ids) * m for s, ids, m in zip(starts, new_block_ids, factors)]
        # Every check runs before anything is staged: an error leaves no partial state.
        _refuse_id_types(req_index, new_block_ids)
        self._inputs.append_ends(req_index, new_block_ids, ends)
        redirect = self.redirect_writes_to_null_block
        for g, (table, ids, m) in enumerate(zip(self.block_tables, new_block_ids, factors)):
            if len(ids):
                if redirect:
                    ids = [NULL_BLOCK_ID] * len(ids)
                table._stage_checked(req_index, starts[g], _expand(ids, m) if m > 1 else ids)
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

    def _validating(self) -> bool:
        if self.validate_inputs is None:
            return self.device.type == "cpu"
        return self.validate_inputs
