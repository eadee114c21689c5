"""`get_dummy_block_tables` hands out rows that a profiling run may fill (SPEC.md section 3)."""

from __future__ import annotations

import numpy as np
import torch

from cp_blocktables import BlockTables


def test_rows_filled_by_a_profiling_pass_are_cleared_by_the_next_gather(torch_device):
    bt = BlockTables([4, 8], 6, 32, [4, 3], torch_device)
    bt.append_block_ids(0, ([1, 2], [3]), False)
    bt.apply_staged_writes()
    views = bt.get_dummy_block_tables(5)
    assert [v.data_ptr() for v in views] == [t.data_ptr() for t in bt.input_block_tables]
    for v in views:  # what a profiling pass does with the views it was given
        v.fill_(77)
    idx = torch.tensor([0, -1], dtype=torch.int32, device=torch_device)
    out = bt.gather_block_tables(idx, 2)
    np.testing.assert_array_equal(out[0][0, :2].cpu().numpy(), [1, 2])
    np.testing.assert_array_equal(out[1][0, :1].cpu().numpy(), [3])
    for t in bt.input_block_tables:
        np.testing.assert_array_equal(t[1:].cpu().numpy(), 0)


def test_dummy_rows_count_even_after_a_larger_gather(torch_device):
    bt = BlockTables([4], 6, 32, [4], torch_device)
    for r in range(6):
        bt.append_block_ids(r, ([r + 1],), False)
    bt.apply_staged_writes()
    bt.gather_block_tables(torch.arange(6, dtype=torch.int32, device=torch_device), 6)
    bt.get_dummy_block_tables(3)[0].fill_(5)
    np.testing.assert_array_equal(bt.input_block_tables[0][3:].cpu().numpy(), 0)
    bt.gather_block_tables(torch.tensor([2], dtype=torch.int32, device=torch_device), 1)
    np.testing.assert_array_equal(bt.input_block_tables[0][0, :1].cpu().numpy(), [3])
    np.testing.assert_array_equal(bt.input_block_tables[0][1:].cpu().numpy(), 0)
