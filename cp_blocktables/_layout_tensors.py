"""The derived device state of `BlockTables` and its rebuild (SPEC.md 3 and 8.4).

Kernels read per-group facts (table pointers and strides, widths, block and
kernel block sizes, reaches, sharded flags, the slot-mapping layout) from
small device tensors, so that one launch serves every group. They are derived
from host-side config and the tables' allocations, never the other way round:
`init_block_table_layout_tensors()` rebuilds all of them, which is what a
reallocation of the tables and a wake-up from sleep mode (which may discard
the contents of every device tensor) both need. Rebuilding writes in place
where a tensor exists, so CUDA graphs that captured its address stay valid.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import guards, kernels
from .contract import PAD_SLOT_ID


class LayoutTensors:
    """`BlockTables`' derived device tensors; a mixin over its public state.

    Needs `config`, `device`, `block_tables`, `input_block_tables`,
    `slot_mappings`, `sliding_window_reach` and `num_kv_cache_groups`.
    """

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
        inputs = self.input_block_tables
        guards.check_layout(tables, inputs, self.max_num_reqs, self.device)
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
        # Slots below these lie in the null KV block (integrity checks exempt them).
        put("_null_slot_floors", cfg.block_sizes, torch.int64)
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
        # Row slices of the forward-pass tables handed back by the reads, built once
        # per size (see `_reads`); the slot mappings' column slices are not cached.
        self._table_views: dict[int, tuple[torch.Tensor, ...]] = {}
