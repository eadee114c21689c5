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
