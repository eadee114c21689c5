"""SPEC.md section 2 by hand, and the partition and round-trip properties of the reference."""

from __future__ import annotations

import numpy as np
import pytest

from cp_blocktables import PAD_SLOT_ID
from cp_blocktables.reference import (
    local_len,
    local_offset,
    owned_positions,
    owner,
    read_slots,
    slots_for_positions,
)

P = PAD_SLOT_ID

# (cp_size, interleave, block_size): owners and local offsets of positions 0..15, by hand.
HAND = {
    (2, 1, 4): ([0, 1] * 8, [0, 0, 1, 1, 2, 2, 3, 3] * 2),
    (2, 2, 4): ([0, 0, 1, 1] * 4, [0, 1, 0, 1, 2, 3, 2, 3] * 2),
    (2, 4, 4): ([0, 0, 0, 0, 1, 1, 1, 1] * 2, [0, 1, 2, 3] * 4),
    (4, 1, 2): ([0, 1, 2, 3] * 4, [0, 0, 0, 0, 1, 1, 1, 1] * 2),
    (8, 2, 4): ([0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7], [0, 1] * 8),
}


@pytest.mark.parametrize("key", HAND, ids=lambda k: "C{}-I{}-bs{}".format(*k))
def test_owner_and_local_offset_by_hand(key):
    c, i, bs = key
    owners, locals_ = HAND[key]
    p = np.arange(16)
    np.testing.assert_array_equal(owner(p, c, i, bs), owners)
    np.testing.assert_array_equal(local_offset(p, c, i, bs), locals_)


def test_slots_by_hand_c2_i1_bs4():
    row = np.array([7, 9])
    p = np.arange(16)
    rank0 = [28, P, 29, P, 30, P, 31, P, 36, P, 37, P, 38, P, 39, P]
    rank1 = [P, 28, P, 29, P, 30, P, 31, P, 36, P, 37, P, 38, P, 39]
    np.testing.assert_array_equal(slots_for_positions(row, p, 4, 2, 0, 1), rank0)
    np.testing.assert_array_equal(slots_for_positions(row, p, 4, 2, 1, 1), rank1)


def test_unsharded_slots_by_hand():
    row = np.array([3, 5, 2])
    np.testing.assert_array_equal(
        slots_for_positions(row, np.array([0, 3, 4, 9]), 4, 1, 0, 2), [12, 15, 20, 9]
    )


def test_slots_past_int32_are_exact():
    block = 2**31 - 1
    slots = slots_for_positions(np.array([block]), np.array([0, 1023]), 1024, 1, 0, 1)
    np.testing.assert_array_equal(slots, [block * 1024, block * 1024 + 1023])
    assert slots.dtype == np.int64


@pytest.mark.parametrize(
    ("seq_len", "expected"), [(11, [6, 5]), (8, [4, 4]), (1, [1, 0]), (0, [0, 0])]
)
def test_local_len_by_hand_c2_i2(seq_len, expected):
    assert [local_len(seq_len, k, 2, 2) for k in range(2)] == expected


@pytest.mark.parametrize("cp_size", [1, 2, 4, 8])
@pytest.mark.parametrize("interleave", [1, 2, 4, 16])
def test_ranks_partition_positions_and_round_trip(cp_size, interleave):
    """Every position of [0, L) is written once, on its owner, and read back in order."""
    bs = 16
    seq_len = 5 * bs * cp_size + 7
    row = np.arange(100, 100 + seq_len // bs + 1)
    positions = np.arange(seq_len)
    seen = np.zeros(seq_len, dtype=int)
    for k in range(cp_size):
        slots = slots_for_positions(row, positions, bs, cp_size, k, interleave)
        mine = slots != PAD_SLOT_ID
        seen += mine
        n = local_len(seq_len, k, cp_size, interleave)
        assert mine.sum() == n == len(owned_positions(seq_len, k, cp_size, interleave, bs))
        kv = dict(zip(slots[mine].tolist(), positions[mine].tolist()))
        assert len(kv) == n, "two positions share a slot"
        read_back = [kv[s] for s in read_slots(row, n, bs).tolist()]
        np.testing.assert_array_equal(
            read_back, owned_positions(seq_len, k, cp_size, interleave, bs)
        )
    np.testing.assert_array_equal(seen, 1)


def test_position_outside_row_is_refused():
    with pytest.raises(IndexError):
        slots_for_positions(np.array([1]), np.array([4]), 4, 1, 0, 1)


@pytest.mark.parametrize("cp_size", [1, 2, 8])
@pytest.mark.parametrize("interleave", [1, 4])
@pytest.mark.parametrize("start", [0, 37, 64])
def test_a_window_of_positions_is_the_tail_of_the_whole(cp_size, interleave, start):
    """`owned_positions(..., start)` and `read_slots(..., first)` equal the tails of the
    whole arrays: rank k's local tokens [local_len(start), local_len(L)) hold exactly
    its positions in [start, L), so a far start is read without arrays of its length."""
    bs, seq_len = 16, 150
    row = np.arange(100, 100 + seq_len // bs + 1)
    for k in range(cp_size):
        whole = owned_positions(seq_len, k, cp_size, interleave, bs)
        tail = owned_positions(seq_len, k, cp_size, interleave, bs, start=start)
        np.testing.assert_array_equal(tail, whole[whole >= start])
        first, n = (
            local_len(start, k, cp_size, interleave),
            local_len(seq_len, k, cp_size, interleave),
        )
        assert len(tail) == n - first
        np.testing.assert_array_equal(
            read_slots(row, n, bs, first=first), read_slots(row, n, bs)[first:]
        )


def test_owned_positions_past_2_31_cost_only_the_window():
    """Positions [2**31 - 3, 2**31 + 5) of a cp 2, interleave 2 layout: 8 positions, 4 a rank."""
    start, end = 2**31 - 3, 2**31 + 5
    got = [owned_positions(end, k, 2, 2, 2**20, start=start).tolist() for k in range(2)]
    assert sorted(got[0] + got[1]) == list(range(start, end))
    assert got[0] == [p for p in range(start, end) if (p // 2) % 2 == 0]
