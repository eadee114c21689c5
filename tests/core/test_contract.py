"""Bad input: every invalid argument gets a clear error naming it, and nothing changes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from refusals import GOOD, I32, I64, assert_same, state, with_one_row

from cp_blocktables import BlockTables


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        pytest.param(dict(block_sizes=16), "block_sizes must be a list", id="block_sizes-not-list"),
        pytest.param(dict(block_sizes=[16, 0]), r"block_sizes\[1\] must be >= 1", id="zero-bs"),
        pytest.param(
            dict(block_sizes=[16, 2.0]), r"block_sizes\[1\] must be an int", id="float-bs"
        ),
        pytest.param(dict(max_num_reqs=0), "max_num_reqs must be >= 1", id="no-reqs"),
        pytest.param(dict(max_num_batched_tokens=-1), "max_num_batched_tokens", id="neg-tokens"),
        pytest.param(
            dict(max_num_batched_tokens=2**29 + 1),
            r"max_num_batched_tokens times the number of groups must be at most 2\*\*30",
            id="slot-entries-past-2-30",
        ),
        pytest.param(
            dict(max_num_blocks_per_group=[8]),
            "max_num_blocks_per_group has 1 entries",
            id="blocks-len",
        ),
        pytest.param(
            dict(max_num_blocks_per_group=[8, 0]),
            r"max_num_blocks_per_group\[1\]",
            id="zero-blocks",
        ),
        pytest.param(dict(cp_size=0), "cp_size must be >= 1", id="cp-size-0"),
        pytest.param(dict(cp_size=2, cp_rank=2), "cp_rank must satisfy", id="rank-too-big"),
        pytest.param(dict(cp_rank=-1), "cp_rank must be >= 0", id="rank-negative"),
        pytest.param(dict(cp_interleave=0), "cp_interleave must be >= 1", id="interleave-0"),
        pytest.param(
            dict(cp_size=2, cp_interleave=3),
            r"does not divide block_sizes\[0\]=16 of "
            r"DCP-sharded group 0",
            id="interleave-not-dividing",
        ),
        pytest.param(
            dict(block_sizes=[16, 24], cp_size=2, cp_interleave=16),
            r"block_sizes\[1\]=24 of DCP-sharded group 1",
            id="interleave-vs-group-1",
        ),
        pytest.param(
            dict(slot_mapping_enabled=[True]),
            "slot_mapping_enabled has 1 entries",
            id="enabled-len",
        ),
        pytest.param(
            dict(dcp_sharded=[1, 0]), r"dcp_sharded\[0\] must be a bool", id="sharded-int"
        ),
        pytest.param(
            dict(sliding_window_reach=[0, -4]),
            r"sliding_window_reach\[1\] must be >= 0",
            id="negative-reach",
        ),
        pytest.param(dict(device="gpu0"), "device 'gpu0'", id="bad-device"),
        pytest.param(dict(device=None), "device None", id="no-device"),
    ],
)
def test_constructor_refuses(overrides, message):
    with pytest.raises(ValueError, match=message):
        BlockTables(**{**GOOD, **overrides})


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(dict(cp_interleave=3), id="single-rank"),
        pytest.param(
            dict(cp_size=2, cp_rank=1, cp_interleave=3, dcp_sharded=[False, False]),
            id="unsharded-rank-1",
        ),
    ],
)
def test_interleave_is_free_for_unsharded_or_single_rank(pair, overrides):
    """Interleave 3 divides no block size here; where it does not apply, slots must
    follow the plain rule of SPEC.md section 2 (`table[p // bs] * bs + p % bs`)."""
    kwargs = {k: v for k, v in {**GOOD, **overrides}.items() if k != "device"}
    p = pair(**kwargs)
    p.append(0, ([3, 5, 7], [2, 9]))
    p.append(1, ([4, 6], [8]))
    p.bt.apply_staged_writes()
    positions = [0, 5, 15, 16, 17, 31, 40, 41, 47]
    slots = p.slots([1, 0], [0, 6, 9], positions, 12)  # checked against the reference
    for g, bs in enumerate(kwargs["block_sizes"]):
        rows = {0: [3, 5, 7], 1: [4, 6]} if g == 0 else {0: [2, 9], 1: [8]}
        for t, (r, pos) in enumerate(zip([1] * 6 + [0] * 3, positions)):
            assert slots[g, t] == rows[r][pos // bs] * bs + pos % bs, (g, t)


@pytest.fixture
def bt() -> BlockTables:
    return with_one_row()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        pytest.param(
            lambda t: t.append_block_ids(4, ([1], [1]), False),
            r"req_index must be an int "
            r"in \[0, 4\)",
            id="row-out-of-range",
        ),
        pytest.param(
            lambda t: t.append_block_ids(0, ([1],), False),
            "new_block_ids has 1 entries",
            id="ids-per-group",
        ),
        pytest.param(
            lambda t: t.append_block_ids(0, ([1], [-2]), False),
            "block ids must lie",
            id="negative-id",
        ),
        pytest.param(
            lambda t: t.append_block_ids(1, ([1] * 7, [1]), False),
            r"request 1, group 0: .* end at 9, past the row capacity 8",
            id="capacity",
        ),
        pytest.param(
            lambda t: t.gather_block_tables(I32(1), 5),
            "num_reqs_padded must lie",
            id="padded-above-max",
        ),
        pytest.param(
            lambda t: t.gather_block_tables(I32(1, 2), 1),
            "num_reqs_padded must lie",
            id="padded-below-reqs",
        ),
        pytest.param(
            lambda t: t.gather_block_tables(I32(4), 1), r"idx_mapping\[0\] = 4", id="row-past-max"
        ),
        pytest.param(
            lambda t: t.gather_block_tables(I32(-2), 1),
            r"idx_mapping\[0\] = -2",
            id="row-below-dummy",
        ),
        pytest.param(
            lambda t: t.gather_block_tables(torch.tensor([1.0]), 1),
            "idx_mapping must be a 1-D int32 or int64",
            id="float-idx",
        ),
        pytest.param(
            lambda t: t.gather_block_tables(torch.tensor(1, dtype=torch.int32), 1),
            r"idx_mapping must be a 1-D int32 or int64 tensor, got torch.int32 of shape \(\)",
            id="scalar-idx",
        ),
        pytest.param(
            lambda t: t.gather_block_tables(I32(1), 1, num_computed_tokens=I32(1)),
            "num_computed_tokens must have at least 4",
            id="short-computed",
        ),
        pytest.param(
            lambda t: t.gather_block_tables(I32(1), 1, out_ptrs=I64(1)),
            "out_ptrs needs out",
            id="ptrs-without-out",
        ),
        pytest.param(
            lambda t: t.gather_block_tables(I32(1), 1, out=[torch.zeros(1, 8)] * 2),
            r"out\[0\] must be an int32",
            id="bad-out-table",
        ),
        pytest.param(
            lambda t: t.compute_slot_mappings(I32(1), I32(0, 3, 4), I64(0, 1, 2), 3),
            "query_start_loc must have 2 entries",
            id="qsl-length",
        ),
        pytest.param(
            lambda t: t.compute_slot_mappings(I32(1, 1), I32(0, 3), I64(0, 1, 2), 3),
            "query_start_loc must have 3 entries, got 2",
            id="qsl-short",
        ),
        pytest.param(
            lambda t: t.compute_slot_mappings(I32(1, 1), I32(0, 3, 2), I64(0, 1, 2), 3),
            "never decrease",
            id="qsl-decreasing",
        ),
        pytest.param(
            lambda t: t.compute_slot_mappings(I32(1), I32(1, 3), I64(0, 1, 2), 3),
            "start at 0",
            id="qsl-not-from-0",
        ),
        pytest.param(
            lambda t: t.compute_slot_mappings(I32(1), I32(-1, 2), I64(0, 1, 2), 3),
            r"query_start_loc must start at 0 and never decrease, got \[-1, 2\]",
            id="qsl-from-below-0",
        ),
        pytest.param(
            lambda t: t.compute_slot_mappings(I32(1), I32(0, 3), I64(0, 1), 3),
            "positions has 2",
            id="positions-short",
        ),
        pytest.param(
            lambda t: t.compute_slot_mappings(I32(1), I32(0, 2), I64(0, -1), 2),
            "positions must be >= 0",
            id="negative-position",
        ),
        pytest.param(
            lambda t: t.compute_slot_mappings(I32(0), I32(0, 2), I64(0, -1), 2),
            "positions must be >= 0, got -1",
            id="negative-position-row-0",
        ),
        pytest.param(
            lambda t: t.compute_slot_mappings(I32(1), I32(0, 1), I64(128), 1),
            "position 128 lies past group 0",
            id="position-past-table",
        ),
        pytest.param(
            lambda t: t.compute_slot_mappings(I32(1), I32(0, 1), I64(200), 1),
            r"position 200 lies past group 0's table \(8 blocks cover 128\)",
            id="position-well-past-table",
        ),
        pytest.param(
            lambda t: t.compute_slot_mappings(I32(1), I32(0, 2), I64(0, 1), 1),
            "less than the batch's 2 tokens",
            id="padded-below-tokens",
        ),
        pytest.param(
            lambda t: t.compute_slot_mappings(I32(1), I32(0, 1), I64(0), 65),
            r"num_tokens_padded must lie in \[0, 64\]",
            id="padded-above-buffer",
        ),
        pytest.param(
            lambda t: t.compute_slot_mappings(I32(1), I32(0, 1), I64(0), -1),
            r"num_tokens_padded must lie in \[0, 64\] .*, got -1",
            id="padded-negative",
        ),
        pytest.param(
            lambda t: t.compute_slot_mappings(I32(7), I32(0, 1), I64(0), 1),
            r"idx_mapping\[0\] = 7",
            id="slot-row-past-max",
        ),
        pytest.param(
            lambda t: t.get_dummy_slot_mappings(65), "num_tokens must lie", id="dummy-slots"
        ),
        pytest.param(
            lambda t: t.get_dummy_slot_mappings(-1),
            r"num_tokens must lie in \[0, 64\], got -1",
            id="dummy-slots-negative",
        ),
        pytest.param(lambda t: t.get_dummy_block_tables(5), "num_reqs must lie", id="dummy-tables"),
        pytest.param(
            lambda t: t.get_dummy_block_tables(-1), "num_reqs must lie", id="dummy-tables-negative"
        ),
    ],
)
def test_method_refuses_and_changes_nothing(bt, call, message):
    before = state(bt)
    with pytest.raises((ValueError, RuntimeError), match=message):
        call(bt)
    assert_same(before, state(bt))


def test_a_position_past_an_enabled_table_is_refused_after_a_disabled_group():
    """A group without slot mapping bounds no position (SPEC.md 3), but every enabled group
    after it still does: position 64 lies inside disabled group 0's table (8 blocks of 16)
    and past enabled group 1's (2 blocks of 32), so it is refused, and nothing changes."""
    t = BlockTables(
        **{**GOOD, "max_num_blocks_per_group": [8, 2], "slot_mapping_enabled": [False, True]}
    )
    t.append_block_ids(1, ([5, 6], [7]), False)
    t.apply_staged_writes()
    before = state(t)
    with pytest.raises(ValueError, match=r"position 64 lies past group 1's table \(2 blocks"):
        t.compute_slot_mappings(I32(1), I32(0, 1), I64(64), 1)
    assert_same(before, state(t))


@pytest.mark.parametrize(
    ("device", "by_default"), [("cpu", True), ("cuda", False), ("cuda:1", False)]
)
def test_values_are_checked_by_default_on_cpu_only(device, by_default):
    """docs/contract-notes.md: `validate_inputs = None` (the default) checks the values of
    the calls on CPU and not on CUDA, where the check costs a synchronisation per step;
    `True` and `False` hold on every device. Read through a stand-in holding the device,
    so the CUDA rule is tested without a GPU."""
    for setting, checked in ((None, by_default), (True, True), (False, False)):
        stand_in = SimpleNamespace(validate_inputs=setting, device=torch.device(device))
        assert BlockTables._validating(stand_in) is checked, setting
