"""Bad input that docs/bad-input.md lists and tests/test_contract.py does not already cover."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cp_blocktables import BlockTables

GOOD = dict(
    block_sizes=[16, 32],
    max_num_reqs=4,
    max_num_batched_tokens=64,
    max_num_blocks_per_group=[8, 4],
    device="cpu",
)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param(
            dict(dcp_sharded=[True]),
            r"dcp_sharded has 1 entries but there are 2 KV-cache groups \(len\(block_sizes\)\)",
            id="sharded-len",
        ),
        pytest.param(
            dict(sliding_window_reach=[0, 0, 0]),
            r"sliding_window_reach has 3 entries but there are 2 KV-cache groups",
            id="reach-len",
        ),
    ],
)
def test_constructor_refuses_lists_of_the_wrong_length(overrides, message):
    with pytest.raises(ValueError, match=message):
        BlockTables(**{**GOOD, **overrides})


@pytest.fixture
def bt() -> BlockTables:
    t = BlockTables(**GOOD)
    t.append_block_ids(1, ([5, 6], [7]), False)
    t.apply_staged_writes()
    return t


def state(t: BlockTables) -> tuple:
    return (
        [x.gpu.clone() for x in t.block_tables],
        t.num_blocks.np.copy(),
        [list(x._staged_write_contents) for x in t.block_tables],
        t.slot_mappings.clone(),
    )


def assert_same(a: tuple, b: tuple) -> None:
    for x, y in zip(a[0], b[0]):
        assert torch.equal(x, y)
    np.testing.assert_array_equal(a[1], b[1])
    assert a[2] == b[2]
    assert torch.equal(a[3], b[3])


I32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
I64 = lambda *v: torch.tensor(v, dtype=torch.int64)  # noqa: E731


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        pytest.param(
            lambda t: t.append_block_ids(1, ([1] * 9, [1]), True),
            RuntimeError,
            r"request 1, group 0: blocks would end at 9, past the row capacity 8",
            id="overwrite-capacity",
        ),
        pytest.param(
            lambda t: t.append_block_ids(1, ([1], [1] * 4), False),
            RuntimeError,
            r"request 1, group 1: blocks would end at 5, past the row capacity 4",
            id="second-group-capacity",
        ),
        pytest.param(
            lambda t: t.gather_block_tables(I32(0, 1, 2, 3, -1), 5),
            ValueError,
            r"idx_mapping has 5 entries, more than max_num_reqs=4",
            id="too-many-requests",
        ),
    ],
)
def test_refused_calls_change_nothing(bt, call, error, message):
    before = state(bt)
    with pytest.raises(error, match=message):
        call(bt)
    assert_same(before, state(bt))


def test_junk_where_the_contract_allows_it_is_accepted(bt):
    """Dummy requests' positions and positions past num_tokens are never read: no error."""
    slots = bt.compute_slot_mappings(I32(-1, 1), I32(0, 2, 3), I64(-7, -(2**40), 17, -1, -5), 4)
    assert slots[:, :2].eq(-1).all() and slots[:, 3].eq(-1).all()
    assert slots[0, 2] == 6 * 16 + 1 and slots[1, 2] == 7 * 32 + 17
