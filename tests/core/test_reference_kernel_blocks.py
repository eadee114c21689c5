"""The reference's own rules (no shared helpers) and kernel block sizes (SPEC.md 8.1)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from cp_blocktables import PAD_SLOT_ID, BlockTablesConfig
from cp_blocktables.reference import (
    ReferenceBlockTables,
    expand_block_ids,
    local_len,
    owned_positions,
    read_slots,
    slots_for_positions,
)

P = PAD_SLOT_ID


def raw(**overrides) -> SimpleNamespace:
    """Raw constructor arguments, as the reference may be given them (no derived helpers)."""
    kwargs = dict(
        block_sizes=[8],
        max_num_reqs=3,
        max_num_batched_tokens=32,
        max_num_blocks_per_group=[4],
        cp_size=1,
        cp_rank=0,
        cp_interleave=1,
        slot_mapping_enabled=None,
        dcp_sharded=None,
        sliding_window_reach=None,
        kernel_block_sizes=None,
    )
    kwargs.update(overrides)
    return SimpleNamespace(**kwargs)


def test_expand_block_ids_by_hand():
    np.testing.assert_array_equal(expand_block_ids([3, 0, 5], 2), [6, 7, 0, 1, 10, 11])
    np.testing.assert_array_equal(expand_block_ids([3, 5], 1), [3, 5])
    assert expand_block_ids([], 4).shape == (0,)
    big = 2**31 - 1
    assert expand_block_ids([big], 4)[-1] == big * 4 + 3


def test_reference_ignores_the_config_helpers(monkeypatch):
    """Breaking the shared helpers must not move the reference's expectations."""
    cfg = dict(
        block_sizes=[4, 4],
        max_num_reqs=2,
        max_num_batched_tokens=8,
        max_num_blocks_per_group=[4, 4],
        cp_size=2,
        cp_rank=1,
        dcp_sharded=[True, False],
        sliding_window_reach=[4, 0],
    )

    def expectations():
        ref = ReferenceBlockTables(BlockTablesConfig(**cfg))
        ref.append_block_ids(0, ([5, 6], [7, 8]), False)
        slots = ref.slot_mappings([0], [0, 6], np.arange(6), 8)
        tables = ref.gathered_block_tables([0], 1, np.array([100, 0]))
        return slots, [v for v, _ in tables]

    want_slots, want_tables = expectations()
    monkeypatch.setattr(BlockTablesConfig, "group_cp_size", lambda self, g: 1)
    monkeypatch.setattr(BlockTablesConfig, "effective_sliding_window_reach", lambda self: [9, 9])
    got_slots, got_tables = expectations()
    np.testing.assert_array_equal(got_slots, want_slots)
    for got, want in zip(got_tables, want_tables):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(want_slots[0, :6], [P, 20, P, 21, P, 22])
    np.testing.assert_array_equal(want_slots[1, :6], [28, 29, 30, 31, 32, 33])
    np.testing.assert_array_equal(want_tables[0][0, :2], [5, 6])  # no masking under CP


def test_reference_reads_raw_defaults():
    ref = ReferenceBlockTables(raw(sliding_window_reach=[4]))
    assert ref.rules.group_cp == [1] and ref.rules.enabled == [True]
    assert ref.rules.kernel_block_sizes == [8] and ref.rules.m == [1]
    assert ref.tables[0].shape == (3, 4)


def test_kernel_tables_counts_and_slots_by_hand():
    ref = ReferenceBlockTables(raw(kernel_block_sizes=[2]))  # m = 4
    assert ref.tables[0].shape == (3, 16)
    ref.append_block_ids(1, ([3, 5],), False)
    np.testing.assert_array_equal(ref.tables[0][1, :8], [12, 13, 14, 15, 20, 21, 22, 23])
    assert ref.num_blocks[0, 1] == 8
    ref.append_block_ids(1, ([7],), False)
    assert ref.num_blocks[0, 1] == 12
    slots = ref.slot_mappings([1], [0, 4], np.array([0, 7, 8, 17]), 4)
    # A slot is a token address: block b's token t is b * 8 + t whatever K is.
    np.testing.assert_array_equal(slots[0], [24, 31, 40, 57])


def test_kernel_capacity_counts_expanded_ids_and_stays_atomic():
    ref = ReferenceBlockTables(
        raw(block_sizes=[8, 4], max_num_blocks_per_group=[2, 4], kernel_block_sizes=[4, 4])
    )
    ref.append_block_ids(0, ([1], [2]), False)
    with pytest.raises(RuntimeError, match="group 0: end 6 > capacity 4"):
        ref.append_block_ids(0, ([3, 4], [5]), False)
    np.testing.assert_array_equal(ref.num_blocks[:, 0], [2, 1])
    np.testing.assert_array_equal(ref.tables[1][0], [2, 0, 0, 0])


def test_kernel_redirect_stages_the_null_blocks_kernel_blocks():
    ref = ReferenceBlockTables(raw(kernel_block_sizes=[2]))
    ref.redirect_writes_to_null_block = True
    ref.append_block_ids(0, ([9, 9],), False)
    np.testing.assert_array_equal(ref.tables[0][0, :8], [0, 1, 2, 3, 0, 1, 2, 3])
    assert ref.num_blocks[0, 0] == 8


@pytest.mark.parametrize(("computed", "first_live"), [(20, 4), (21, 4), (19, 3), (12, 0)])
def test_kernel_masking_is_per_kernel_column(computed, first_live):
    """reach 12, K 2: kernel column j is dead iff (j + 1) * 2 <= computed - 12."""
    ref = ReferenceBlockTables(
        raw(block_sizes=[4], kernel_block_sizes=[2], sliding_window_reach=[12])
    )
    ref.append_block_ids(0, ([5, 6, 7],), False)
    ((values, defined),) = ref.gathered_block_tables([0], 1, np.array([computed, 0, 0]))
    row = [10, 11, 12, 13, 14, 15]
    np.testing.assert_array_equal(values[0, :first_live], 0)
    np.testing.assert_array_equal(values[0, first_live:6], row[first_live:])
    assert defined[0, :6].all() and not defined[0, 6:].any()


@pytest.mark.parametrize("cp_size", [1, 2, 4])
@pytest.mark.parametrize(
    ("block_size", "kernel", "interleave"), [(16, 4, 1), (16, 8, 4), (12, 4, 2), (8, 8, 8)]
)
def test_kernel_slots_are_token_addresses_and_round_trip(cp_size, block_size, kernel, interleave):
    """Same slot for every position whichever K divides B; the KV round trip holds with K."""
    seq_len = 3 * block_size * cp_size + 5
    alloc_row = np.arange(50, 50 + seq_len // (block_size * cp_size) + 1)
    positions = np.arange(seq_len)
    seen = np.zeros(seq_len, dtype=int)
    for k in range(cp_size):
        coarse = slots_for_positions(alloc_row, positions, block_size, cp_size, k, interleave)
        fine = slots_for_positions(
            alloc_row, positions, block_size, cp_size, k, interleave, kernel_block_size=kernel
        )
        np.testing.assert_array_equal(fine, coarse)
        mine = fine != P
        seen += mine
        n = local_len(seq_len, k, cp_size, interleave)
        kv = dict(zip(fine[mine].tolist(), positions[mine].tolist()))
        assert len(kv) == n
        reads = read_slots(alloc_row, n, block_size, kernel_block_size=kernel)
        np.testing.assert_array_equal(reads, read_slots(alloc_row, n, block_size))
        np.testing.assert_array_equal(
            [kv[s] for s in reads.tolist()],
            owned_positions(seq_len, k, cp_size, interleave, kernel),
        )
    np.testing.assert_array_equal(seen, 1)


def test_kernel_block_size_must_divide():
    with pytest.raises(ValueError, match="does not divide"):
        slots_for_positions(np.array([1]), np.array([0]), 8, 1, 0, 1, kernel_block_size=3)
