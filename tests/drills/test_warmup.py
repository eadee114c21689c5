"""`null_block_warmup`: redirect inside, everything restored on exit (also on error), nesting."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cp_blocktables import BlockTables
from cp_blocktables.drills.serving import RequestPool
from cp_blocktables.drills.warmup import WarmupError, null_block_warmup

GROUPS = dict(block_sizes=[4, 8], max_num_reqs=4, max_num_batched_tokens=16)


@pytest.fixture
def bt() -> BlockTables:
    return BlockTables(**GROUPS, max_num_blocks_per_group=[3, 2], device="cpu")


@pytest.fixture
def pool() -> RequestPool:
    return RequestPool(4)


@pytest.fixture
def caches() -> list[torch.Tensor]:
    """Two groups' KV caches, every block (the null block too) full of data."""
    return [torch.arange(1, 1 + 6 * bs, dtype=torch.int64).view(6, bs) for bs in (4, 8)]


def gathered(bt: BlockTables, row: int) -> list[list[int]]:
    """Row `row` as the forward pass would read it (first entries of each group)."""
    tables = bt.gather_block_tables(torch.tensor([row], dtype=torch.int32), 1)
    counts = bt.num_blocks.np[:, row]
    return [t[0, : int(n)].tolist() for t, n in zip(tables, counts)]


def test_refused_while_serving_and_nothing_changes(bt, pool, caches):
    pool.admit(7, 2)
    before = [c.clone() for c in caches]
    with (
        pytest.raises(
            WarmupError, match=r"1 serving request\(s\) still hold rows \(row 2: request 7\); drain"
        ),
        null_block_warmup(bt, pool, caches),
    ):
        pytest.fail("the body must not run")
    assert "redirect_writes_to_null_block" not in vars(bt)
    assert pool.serving() == {2: 7}
    assert all(torch.equal(a, b) for a, b in zip(caches, before))


def test_inside_appends_stage_zero_and_exit_restores_everything(bt, pool, caches):
    before = [c.clone() for c in caches]
    with null_block_warmup(bt, pool, caches):
        assert bt.redirect_writes_to_null_block is True
        assert BlockTables.redirect_writes_to_null_block is False
        for row in range(4):
            pool.admit_warmup(100 + row, row)
        bt.append_block_ids(1, ([5, 6], [9]), True)
        assert [list(t._staged_write_contents) for t in bt.block_tables] == [[0, 0], [0]]
        bt.apply_staged_writes()
        assert gathered(bt, 1) == [[0, 0], [0]]
        caches[0][0].fill_(99)  # the warm-up's KV writes land in block 0
    assert bt.redirect_writes_to_null_block is False
    assert pool.snapshot() == RequestPool(4).snapshot()
    for cache, old in zip(caches, before):
        assert not cache[0].any()
        assert torch.equal(cache[1:], old[1:])
    bt.append_block_ids(1, ([5, 6], [9]), True)
    bt.apply_staged_writes()
    assert gathered(bt, 1) == [[5, 6], [9]]


def test_an_exception_in_the_body_propagates_and_is_cleaned_up(bt, pool, caches):
    with pytest.raises(ZeroDivisionError), null_block_warmup(bt, pool, caches):
        pool.admit_warmup(100, 3)
        bt.append_block_ids(3, ([5], [9]), True)
        raise ZeroDivisionError("a capture failed")
    assert bt.redirect_writes_to_null_block is False
    assert pool.free_rows() == [0, 1, 2, 3]
    assert not caches[0][0].any() and not caches[1][0].any()


def test_nested_warmups_keep_the_outer_value(bt, pool, caches):
    with null_block_warmup(bt, pool, caches):
        pool.admit_warmup(100, 0)
        with null_block_warmup(bt, pool, caches):
            pool.admit_warmup(101, 1)
            assert pool.free_rows() == [2, 3]
        assert bt.redirect_writes_to_null_block is True
        assert pool.free_rows() == [1, 2, 3]  # the inner warm-up's request is gone, not the outer's
        bt.append_block_ids(0, ([5], [9]), True)
        bt.apply_staged_writes()
        assert gathered(bt, 0) == [[0], [0]]
    assert bt.redirect_writes_to_null_block is False and pool.free_rows() == [0, 1, 2, 3]


def test_a_flag_set_before_the_warmup_stays_set(bt, pool, caches):
    bt.redirect_writes_to_null_block = True
    with null_block_warmup(bt, pool, caches):
        pass
    assert bt.redirect_writes_to_null_block is True


def test_over_capacity_append_in_a_warmup_stages_nothing(bt, pool, caches):
    with null_block_warmup(bt, pool, caches):
        bt.append_block_ids(0, ([5], [9]), True)
        counts = bt.num_blocks.np.copy()
        staged = [list(t._staged_write_contents) for t in bt.block_tables]
        with pytest.raises(
            RuntimeError,
            match=r"request 0, group 1: blocks would end at 3, past the row capacity 2",
        ):
            bt.append_block_ids(0, ([6], [10, 11]), False)
        np.testing.assert_array_equal(bt.num_blocks.np, counts)
        assert [list(t._staged_write_contents) for t in bt.block_tables] == staged
