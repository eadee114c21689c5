"""`BlockTables`' write path and state against the reference: appends, overwrites, the
null-block redirect, capacity, the fused apply; zero groups, the public attributes and
the layout tensors. Slot mappings and gathers are in `test_block_tables_reads.py`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cp_blocktables import BlockTables
from cp_blocktables._jit import launch_counts


def small(**overrides):
    """One 4-token-block group, 4 rows of 4 blocks, 32 tokens per step."""
    kwargs = dict(
        block_sizes=[4], max_num_reqs=4, max_num_batched_tokens=32, max_num_blocks_per_group=[4]
    )
    kwargs.update(overrides)
    return kwargs


# ------------------------------------------------------------------ appends


def test_append_extends_and_overwrite_restarts(pair):
    p = pair(**small())
    p.append(1, ([1, 2],))
    p.bt.apply_staged_writes()
    p.append(1, ([3],))
    p.bt.apply_staged_writes()
    np.testing.assert_array_equal(p.bt.block_tables[0].gpu[1, :3].cpu().numpy(), [1, 2, 3])
    p.append(1, ([9],), overwrite=True)
    p.bt.apply_staged_writes()
    assert p.bt.num_blocks.np[0, 1] == 1
    assert p.bt.num_blocks.gpu[0, 1].item() == 1
    out = p.gather([1], 1)
    np.testing.assert_array_equal(out[0][0, :1], [9])


def test_overwrite_in_same_step_wins(pair):
    """A row appended and then overwritten before one apply holds the overwrite."""
    p = pair(**small())
    p.append(0, ([1, 2, 3],))
    p.append(0, ([7, 8],), overwrite=True)
    p.append(0, ([9],))
    p.bt.apply_staged_writes()
    np.testing.assert_array_equal(p.bt.block_tables[0].gpu[0, :3].cpu().numpy(), [7, 8, 9])


@pytest.mark.parametrize("groups", [1, 2], ids=["one-group", "fused"])
def test_an_overwrite_ending_inside_an_append_at_capacity_leaves_the_next_row(pair, groups):
    """A row's append up to its capacity, then an overwrite ending inside it, behind
    another row's write in the same step: only the append's tail survives the overwrite
    (past the row's count), and no other row's blocks change (SPEC.md 4: last wins)."""
    p = pair(**small(block_sizes=[4] * groups, max_num_blocks_per_group=[4] * groups))
    p.append(1, ([1, 2],) * groups)
    p.append(2, ([3, 4],) * groups)
    p.bt.apply_staged_writes()
    p.append(0, ([10],) * groups)  # one element staged before the row's writes
    p.append(1, ([5, 6],) * groups)  # columns [2, 4): up to the row's capacity
    p.append(1, ([7, 8, 9],) * groups, overwrite=True)  # ends inside the append
    p.bt.apply_staged_writes()
    p.gather([0, 1, 2], 3)


def test_redirect_writes_to_null_block(pair):
    p = pair(**small(block_sizes=[4, 8], max_num_blocks_per_group=[4, 4]))
    assert BlockTables.redirect_writes_to_null_block is False
    p.bt.redirect_writes_to_null_block = True
    p.ref.redirect_writes_to_null_block = True
    p.append(2, ([5, 6], [7]))
    assert p.bt.block_tables[0]._staged_write_contents == [0, 0]
    p.bt.apply_staged_writes()
    np.testing.assert_array_equal(p.bt.num_blocks.np[:, 2], [2, 1])
    out = p.slots([2], [0, 2], [0, 5], 2)
    np.testing.assert_array_equal(out, [[0, 1], [0, 5]])
    assert BlockTables.redirect_writes_to_null_block is False


def test_over_capacity_append_stages_nothing(pair):
    p = pair(**small(block_sizes=[4, 4], max_num_blocks_per_group=[4, 2]))
    p.append(0, ([1], [2]))
    with pytest.raises(RuntimeError, match=r"request 0, group 1: .*end at 3.*capacity 2"):
        p.bt.append_block_ids(0, ([3], [4, 5]), False)
    assert p.bt.block_tables[0]._staged_write_contents == [1]
    np.testing.assert_array_equal(p.bt.num_blocks.np[:, 0], [1, 1])


def test_fused_apply_is_one_launch_and_skips_per_table_apply(pair, monkeypatch):
    p = pair(
        block_sizes=[4, 8, 16],
        max_num_reqs=4,
        max_num_batched_tokens=8,
        max_num_blocks_per_group=[4, 4, 4],
    )
    assert p.bt.fused_writer is not None
    for t in p.bt.block_tables:
        monkeypatch.setattr(t, "apply_write", lambda: pytest.fail("per-table apply called"))
    p.append(0, ([1, 2], [3], [4]))
    p.append(3, ([5], [6, 7], []))
    before, applies = sum(launch_counts.values()), launch_counts["_apply_writes_kernel"]
    p.bt.apply_staged_writes()
    assert sum(launch_counts.values()) - before == 1
    assert launch_counts["_apply_writes_kernel"] - applies == 1
    for g in range(3):
        np.testing.assert_array_equal(p.bt.block_tables[g].gpu.cpu().numpy(), p.ref.tables[g])
        assert not p.bt.block_tables[g]._staged_write_indices


@pytest.mark.parametrize(
    "block_sizes",
    [[4], [4, 8], [4, 8, 16]],
    ids=["one-group", "two-groups", "three-groups"],
)
def test_one_apply_publishes_every_groups_writes(pair, block_sizes):
    """Each group count has its own apply path (one table, or the fused writer): after
    one apply every group's table, slots and gather hold its own ids."""
    n = len(block_sizes)
    p = pair(
        block_sizes=block_sizes,
        max_num_reqs=4,
        max_num_batched_tokens=16,
        max_num_blocks_per_group=[4] * n,
    )
    p.append(1, tuple([10 * g + 1, 10 * g + 2] for g in range(n)))
    p.append(3, tuple([10 * g + 5] for g in range(n)))
    p.bt.apply_staged_writes()
    for g in range(n):
        np.testing.assert_array_equal(p.bt.block_tables[g].gpu.cpu().numpy(), p.ref.tables[g])
        np.testing.assert_array_equal(p.bt.num_blocks.gpu[g].cpu().numpy(), p.ref.num_blocks[g])
    p.gather([3, 1], 2)
    p.slots([1, 3], [0, 2, 3], [0, 4, 1], 3)


def test_single_group_uses_its_own_apply(pair, monkeypatch):
    p = pair(**small())
    assert p.bt.fused_writer is None
    calls = []
    table = p.bt.block_tables[0]
    original = table.apply_write
    monkeypatch.setattr(table, "apply_write", lambda: calls.append(1) or original())
    p.append(0, ([1],))
    p.bt.apply_staged_writes()
    assert calls == [1]


def test_zero_groups(torch_device):
    bt = BlockTables([], 4, 8, [], torch_device)
    assert bt.num_kv_cache_groups == 0 and bt.fused_writer is None
    bt.append_block_ids(0, (), False)
    bt.apply_staged_writes()
    idx = torch.tensor([0], dtype=torch.int32, device=torch_device)
    assert bt.gather_block_tables(idx, 2) == ()
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=torch_device)
    pos = torch.tensor([0], dtype=torch.int64, device=torch_device)
    assert bt.compute_slot_mappings(idx, qsl, pos, 4).shape == (0, 4)
    assert bt.get_dummy_block_tables(2) == ()
    assert bt.get_dummy_slot_mappings(2).shape == (0, 2)


def test_public_state(torch_device):
    bt = BlockTables(
        [16, 32],
        8,
        64,
        [4, 2],
        torch_device,
        cp_size=4,
        cp_rank=2,
        cp_interleave=8,
        dcp_sharded=[True, False],
    )
    assert (bt.block_sizes, bt.max_num_reqs, bt.max_num_batched_tokens) == ([16, 32], 8, 64)
    assert (bt.cp_size, bt.cp_rank, bt.cp_interleave, bt.num_kv_cache_groups) == (4, 2, 8, 2)
    assert [t.gpu.shape for t in bt.block_tables] == [(8, 4), (8, 2)]
    assert all(t.gpu.dtype == torch.int32 for t in bt.block_tables)
    assert bt.num_blocks.np.shape == (2, 8) and bt.num_blocks.gpu.dtype == torch.int32
    assert [t.shape for t in bt.input_block_tables] == [(8, 4), (8, 2)]
    assert bt.slot_mappings.shape == (2, 64) and bt.slot_mappings.dtype == torch.int64
    assert bt.dcp_sharded.tolist() == [True, False] and bt.dcp_sharded.dtype == torch.bool
    assert bt.block_table_ptrs.dtype == torch.uint64
    assert bt.block_table_ptrs.tolist() == [t.gpu.data_ptr() for t in bt.block_tables]
    assert bt.input_block_table_ptrs.tolist() == [t.data_ptr() for t in bt.input_block_tables]


def test_reallocated_tables_may_have_spare_rows(pair):
    """Tables reallocated with more than `max_num_reqs` rows are accepted: kernels read
    only the first `max_num_reqs`."""
    p = pair(**small())
    rows = p.bt.max_num_reqs + 3
    p.bt.block_tables[0].gpu = torch.zeros(rows, 4, dtype=torch.int32, device=p.device)
    p.bt.input_block_tables[0] = torch.zeros(rows, 4, dtype=torch.int32, device=p.device)
    p.bt.init_block_table_layout_tensors()
    p.append(0, ([5],))
    p.bt.apply_staged_writes()
    p.gather([0], 1)
    assert p.bt.input_block_tables[0][0, 0].item() == 5


def test_layout_tensors_follow_reallocated_tables(pair):
    p = pair(**small())
    p.bt.block_tables[0].gpu = torch.zeros(4, 4, dtype=torch.int32, device=p.device)
    p.bt.input_block_tables[0] = torch.zeros(4, 4, dtype=torch.int32, device=p.device)
    p.bt.init_block_table_layout_tensors()
    p.append(0, ([3],))
    p.bt.apply_staged_writes()
    p.gather([0], 1)
    assert p.bt.block_tables[0].gpu[0, 0].item() == 3
    assert p.bt.input_block_tables[0][0, 0].item() == 3
