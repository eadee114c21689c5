"""Wrong implementations layered on the project's own `BlockTables`.

They show that the harness catches a bug on top of the real kernels too, not
only in the pure-torch stand-in; `catalogue` names the check that must catch
each.
"""

from __future__ import annotations

import torch

from cp_blocktables import BlockTables


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
