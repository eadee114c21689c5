"""Bad input that docs/bad-input.md lists and tests/test_contract.py does not already cover."""

from __future__ import annotations

import pytest
from refusals import GOOD, I32, I64, assert_same, state, with_one_row

from cp_blocktables import BlockTables


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
    return with_one_row()


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
