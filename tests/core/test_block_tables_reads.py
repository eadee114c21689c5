"""`BlockTables`' reads against hand-computed values and the reference: slot mappings and
gathers, one SPEC.md rule at a time (sections 2, 3 and 7). Appends and apply are in
`test_block_tables_writes.py`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hopper import flag_divisions, hopper_ttir, needs_cuda_backend

from cp_blocktables import NULL_BLOCK_ID, PAD_SLOT_ID
from cp_blocktables.kernels import _common, gather

P = PAD_SLOT_ID


def small(**overrides):
    """One 4-token-block group, 4 rows of 4 blocks, 32 tokens per step."""
    kwargs = dict(
        block_sizes=[4], max_num_reqs=4, max_num_batched_tokens=32, max_num_blocks_per_group=[4]
    )
    kwargs.update(overrides)
    return kwargs


# ------------------------------------------------------------------ slot mappings


@pytest.mark.parametrize(
    ("cp_size", "cp_rank", "interleave", "expected"),
    [
        pytest.param(1, 0, 1, [28, 29, 30, 31, 36, 37, 38, 39], id="C1"),
        pytest.param(2, 0, 1, [28, P, 29, P, 30, P, 31, P], id="C2-k0-I1"),
        pytest.param(2, 1, 1, [P, 28, P, 29, P, 30, P, 31], id="C2-k1-I1"),
        pytest.param(2, 0, 2, [28, 29, P, P, 30, 31, P, P], id="C2-k0-I2"),
        pytest.param(2, 1, 2, [P, P, 28, 29, P, P, 30, 31], id="C2-k1-I2"),
        pytest.param(2, 1, 4, [P, P, P, P, 28, 29, 30, 31], id="C2-k1-I4=bs"),
        pytest.param(4, 3, 1, [P, P, P, 28, P, P, P, 29], id="C4-k3-I1"),
        pytest.param(8, 5, 1, [P, P, P, P, P, 28, P, P], id="C8-k5-I1"),
    ],
)
def test_slot_mapping_by_hand(pair, cp_size, cp_rank, interleave, expected):
    p = pair(**small(cp_size=cp_size, cp_rank=cp_rank, cp_interleave=interleave))
    p.append(2, ([7, 9],))
    p.bt.apply_staged_writes()
    out = p.slots([2], [0, 8], list(range(8)), 8)
    np.testing.assert_array_equal(out[0], expected)


def test_sharded_unsharded_and_disabled_groups_side_by_side(pair):
    p = pair(
        block_sizes=[4, 4, 4],
        max_num_reqs=2,
        max_num_batched_tokens=8,
        max_num_blocks_per_group=[2, 2, 2],
        cp_size=2,
        cp_rank=1,
        dcp_sharded=[True, False, True],
        slot_mapping_enabled=[True, True, False],
    )
    p.append(0, ([5], [6, 8], [7]))
    p.bt.apply_staged_writes()
    out = p.slots([0], [0, 6], [0, 1, 2, 3, 4, 5], 6)
    np.testing.assert_array_equal(out[0], [P, 20, P, 21, P, 22])
    np.testing.assert_array_equal(out[1], [24, 25, 26, 27, 32, 33])
    np.testing.assert_array_equal(out[2], [P] * 6)


def test_prefix_cached_positions_far_from_zero(pair):
    p = pair(**small(max_num_blocks_per_group=[64]))
    p.append(1, (list(range(10, 74)),))
    p.bt.apply_staged_writes()
    out = p.slots([1], [0, 3], [250, 251, 252], 3)
    np.testing.assert_array_equal(out[0], [72 * 4 + 2, 72 * 4 + 3, 73 * 4])


def test_dummy_requests_and_padding_write_pad(pair):
    p = pair(**small())
    p.append(0, ([3],))
    p.append(1, ([5],))
    p.bt.apply_staged_writes()
    out = p.slots([1, -1, 0], [0, 2, 4, 5], [0, 1, 0, 1, 3], 8)
    np.testing.assert_array_equal(out[0], [20, 21, P, P, 15, P, P, P])


def test_batch_order_differs_from_row_order(pair):
    p = pair(**small())
    for r, block in enumerate([2, 3, 4, 5]):
        p.append(r, ([block],))
    p.bt.apply_staged_writes()
    out = p.slots([3, 0, 2], [0, 1, 2, 3], [1, 1, 1], 3)
    np.testing.assert_array_equal(out[0], [21, 9, 17])


@pytest.mark.parametrize("first", [3000, 1100], ids=["tail-crosses-tiles", "tail-in-tile"])
def test_smaller_step_pads_stale_tail(host_tiles, pair, first):
    """A step smaller than the one before leaves no stale slot, across tiles and within one."""
    p = pair(
        block_sizes=[16],
        max_num_reqs=2,
        max_num_batched_tokens=4096,
        max_num_blocks_per_group=[256],
    )
    p.append(0, (list(range(1, 257)),))
    p.bt.apply_staged_writes()
    p.slots([0], [0, first], list(range(first)), first)
    out = p.slots([0], [0, 5], list(range(5)), 1030)
    np.testing.assert_array_equal(out[0, 5:], P)


def test_slots_past_int32(pair):
    big = 2**31 - 2
    p = pair(
        **small(
            block_sizes=[1024], max_num_blocks_per_group=[2], cp_size=2, cp_rank=1, cp_interleave=8
        )
    )
    p.append(0, ([big, big + 1],))
    p.bt.apply_staged_writes()
    out = p.slots([0], [0, 3], [8, 2047, 2048 + 9], 3)
    assert out[0, 0] == big * 1024
    assert out[0, 1] == big * 1024 + 1023
    assert out[0, 2] == (big + 1) * 1024 + 1
    assert out[0, 0] > 2**32


def test_disabled_everywhere_and_zero_tokens(pair):
    p = pair(**small(slot_mapping_enabled=[False]))
    p.append(0, ([1],))
    p.bt.apply_staged_writes()
    out = p.slots([0], [0, 0], [0], 4)
    np.testing.assert_array_equal(out[0], [P] * 4)


def test_slot_mapping_into_caller_buffer(pair):
    p = pair(**small())
    p.append(0, ([6],))
    p.bt.apply_staged_writes()
    out = torch.full((1, 10), 77, dtype=torch.int64, device=p.device)
    got = p.bt.compute_slot_mappings(
        p.tensor([0]), p.tensor([0, 2]), p.tensor([0, 1], torch.int64), 4, out=out
    )
    assert got.data_ptr() == out.data_ptr()
    np.testing.assert_array_equal(out.cpu().numpy()[0], [24, 25] + [P] * 8)


@pytest.mark.parametrize(
    "num_tokens",
    [
        pytest.param(0, id="no-tokens"),
        pytest.param(3, id="some-tokens"),
        pytest.param(32, id="max_num_batched_tokens"),
    ],
)
def test_dummy_slot_mappings_fill_whole_buffer(pair, num_tokens):
    """Every count in `[0, max_num_batched_tokens]` (32 here) fills the whole buffer and
    returns `[:, :num_tokens]` (SPEC.md 3): an engine's profiling run passes the largest."""
    p = pair(**small())
    p.append(0, ([6],))
    p.bt.apply_staged_writes()
    p.slots([0], [0, 4], [0, 1, 2, 3], 4)
    view = p.bt.get_dummy_slot_mappings(num_tokens)
    assert view.shape == (1, num_tokens)
    # A view of the buffer's start (storage, not data_ptr: that is 0 for an empty view).
    base = p.bt.slot_mappings
    assert view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    assert view.storage_offset() == base.storage_offset()
    np.testing.assert_array_equal(p.bt.slot_mappings.cpu().numpy(), P)


# ------------------------------------------------------------------ gather


def test_gather_copies_rows_zeroes_dummy_and_padding(pair):
    p = pair(**small())
    p.append(0, ([1, 2],))
    p.append(3, ([4, 5, 6],))
    p.bt.apply_staged_writes()
    out = p.gather([3, -1, 0], 4)
    np.testing.assert_array_equal(out[0][0, :3], [4, 5, 6])
    np.testing.assert_array_equal(out[0][1], 0)
    np.testing.assert_array_equal(out[0][2, :2], [1, 2])
    np.testing.assert_array_equal(out[0][3], 0)


def test_gather_zeroes_rows_left_by_larger_batch(pair):
    p = pair(**small())
    for r in range(4):
        p.append(r, ([r + 1],))
    p.bt.apply_staged_writes()
    p.gather([0, 1, 2, 3], 4)
    out = p.gather([1], 1, num_rows=4)
    assert len(out[0]) == 1
    np.testing.assert_array_equal(p.bt.input_block_tables[0][1:].cpu().numpy(), 0)


def test_gather_into_caller_tables_with_ptrs(pair):
    p = pair(**small(block_sizes=[4, 8], max_num_blocks_per_group=[4, 2]))
    p.append(2, ([3, 4], [9]))
    p.bt.apply_staged_writes()
    out = [
        torch.full((4, 4), 55, dtype=torch.int32, device=p.device),
        torch.full((4, 2), 55, dtype=torch.int32, device=p.device),
    ]
    ptrs = torch.tensor([t.data_ptr() for t in out], dtype=torch.uint64, device=p.device)
    before = [t.clone() for t in p.bt.input_block_tables]
    views = p.bt.gather_block_tables(p.tensor([2, -1]), 3, out=out, out_ptrs=ptrs)
    assert [v.data_ptr() for v in views] == [t.data_ptr() for t in out]
    np.testing.assert_array_equal(out[0].cpu().numpy()[:3], [[3, 4, 55, 55], [0] * 4, [0] * 4])
    np.testing.assert_array_equal(out[1].cpu().numpy()[:3], [[9, 55], [0, 0], [0, 0]])
    np.testing.assert_array_equal(out[0].cpu().numpy()[3], 55)
    for b, t in zip(before, p.bt.input_block_tables):
        assert torch.equal(b, t)


def test_dummy_and_padding_rows_load_nothing_from_before_the_table(pair):
    """A dummy or padding row has no source row (its `r` is -1), and its entries are
    zeroed, never loaded: the load mask excludes such rows, so row -1, the memory before
    the table, is never read. Each table is reallocated (SPEC.md 3) as the rows after one
    of garbage: a load of row -1 would copy that garbage into the rows that must be zero,
    in the gather and in the fused read."""
    p = pair(**small(block_sizes=[4, 8], max_num_blocks_per_group=[4, 2]))
    for table in p.bt.block_tables:
        rows, width = table.gpu.shape
        tall = torch.full((rows + 1, width), 77, dtype=table.gpu.dtype, device=p.device)
        table.gpu = tall[1:].zero_()
    p.bt.init_block_table_layout_tensors()
    p.append(2, ([3, 4], [9]))
    p.bt.apply_staged_writes()
    for t in p.bt.input_block_tables:
        t.fill_(55)
    gathered = p.gather([-1, 2], 4)
    for t in p.bt.input_block_tables:
        t.fill_(55)
    fused, _ = p.bt.gather_and_compute_slot_mappings(
        p.tensor([-1, 2]), 4, p.tensor([0, 1, 2]), p.tensor([0, 0], torch.int64), 2
    )
    for out in (gathered, [t.cpu().numpy() for t in fused]):
        for g, ids in enumerate(([3, 4], [9])):
            np.testing.assert_array_equal(out[g][[0, 2, 3]], 0, err_msg=f"group {g}")
            np.testing.assert_array_equal(out[g][1, : len(ids)], ids, err_msg=f"group {g}")


def test_a_row_past_max_num_reqs_loads_nothing_from_past_the_table(torch_device):
    """docs/contract-notes.md: with validation off, a row outside `[0, max_num_reqs)` is a
    dummy, zeroed and never loaded. The gather kernel is handed a source table and counts
    with a third row past `max_num_reqs = 2`, holding a count of 3 and entries 7, 8, 9: a
    load of row 2 would copy them into the batch row that must be zero."""
    d = torch_device
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=d)  # noqa: E731
    i64 = lambda v: torch.tensor(v, dtype=torch.int64, device=d)  # noqa: E731
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64, device=d)  # noqa: E731
    src = i32([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    dst = torch.full((2, 3), 55, dtype=torch.int32, device=d)
    num_blocks = i32([[3, 3, 3]])
    gather.gather_block_tables(
        i32([1, 2]), 2, 2, ptrs([src]), i64([3]), ptrs([dst]), i64([3]), i32([3]), 3,
        num_blocks, i64([4]), i64([0]), None,
    )  # fmt: skip
    np.testing.assert_array_equal(dst.cpu().numpy(), [[4, 5, 6], [0, 0, 0]])


@pytest.mark.parametrize(
    "row",
    [
        pytest.param(3, id="one-past-max-num-reqs"),
        pytest.param(4, id="two-past-max-num-reqs"),
    ],
)
def test_rows_further_past_max_num_reqs_load_nothing_from_past_the_table(torch_device, row):
    """As above, for rows beyond `max_num_reqs = 2` rather than at it: a mask that only
    excludes the row equal to `max_num_reqs` (`r != max_num_reqs`) would load row 3 or 4
    of a source table that holds them, and copy its entries into the batch row that must
    be zero."""
    d = torch_device
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=d)  # noqa: E731
    i64 = lambda v: torch.tensor(v, dtype=torch.int64, device=d)  # noqa: E731
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64, device=d)  # noqa: E731
    src = i32([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12], [13, 14, 15]])
    dst = torch.full((2, 3), 55, dtype=torch.int32, device=d)
    num_blocks = i32([[3, 3, 3, 3, 3]])
    gather.gather_block_tables(
        i32([1, row]), 2, 2, ptrs([src]), i64([3]), ptrs([dst]), i64([3]), i32([3]), 3,
        num_blocks, i64([4]), i64([0]), None,
    )  # fmt: skip
    np.testing.assert_array_equal(dst.cpu().numpy(), [[4, 5, 6], [0, 0, 0]])


@pytest.mark.parametrize(
    ("computed", "first_live"),
    [
        pytest.param(20, 2, id="window-edge-on-block-edge"),
        pytest.param(21, 2, id="one-past-edge"),
        pytest.param(19, 1, id="one-before-edge"),
        pytest.param(12, 0, id="window-covers-all"),
    ],
)
def test_sliding_window_masks_blocks_wholly_below(pair, computed, first_live):
    """reach 12, bs 4: block j is dead iff (j + 1) * 4 <= computed - 12."""
    p = pair(**small(max_num_blocks_per_group=[8], sliding_window_reach=[12]))
    p.append(1, ([11, 12, 13, 14, 15, 16],))
    p.bt.apply_staged_writes()
    nct = [0, computed, 0, 0]
    out = p.gather([1], 1, num_computed_tokens=nct)
    row = out[0][0, :6]
    np.testing.assert_array_equal(row[:first_live], NULL_BLOCK_ID)
    np.testing.assert_array_equal(row[first_live:], [11, 12, 13, 14, 15, 16][first_live:])


def test_masking_is_off_under_cp(pair):
    p = pair(**small(cp_size=2, cp_rank=0, sliding_window_reach=[4]))
    assert p.bt.sliding_window_reach == [0]
    p.append(0, ([7, 8, 9],))
    p.bt.apply_staged_writes()
    out = p.gather([0], 1, num_computed_tokens=[100, 0, 0, 0])
    np.testing.assert_array_equal(out[0][0, :3], [7, 8, 9])


def test_dummy_block_tables_zero_persistent_rows(pair):
    p = pair(**small())
    for r in range(3):
        p.append(r, ([r + 1, r + 2],))
    p.bt.apply_staged_writes()
    p.gather([0, 1, 2], 3)
    views = p.bt.get_dummy_block_tables(1)
    assert views[0].data_ptr() == p.bt.input_block_tables[0].data_ptr()
    assert views[0].shape == (1, 4)
    np.testing.assert_array_equal(p.bt.input_block_tables[0].cpu().numpy(), 0)


def test_gather_many_wide_rows(host_tiles, pair):
    """Rows wider than a small tile and more rows than one program takes (the column loop,
    several row blocks, a multi-program apply); dummy and padding rows zeroed in full."""
    p = pair(block_sizes=[4, 8], max_num_reqs=9, max_num_batched_tokens=16,
             max_num_blocks_per_group=[2100, 300])  # fmt: skip
    for r in range(9):
        p.append(r, (list(range(r + 1, r + 1 + 262 * r + 4)), list(range(1, 30 * r + 2))))
    p.bt.apply_staged_writes()
    p.gather([8, 3, -1, 0, 7, 5, 1], 9)
    out = p.gather([2, -1, 6], 3, num_rows=9)
    np.testing.assert_array_equal(out[0][1], 0)
    np.testing.assert_array_equal(p.bt.input_block_tables[1][3:].cpu().numpy(), 0)


def test_gather_many_narrow_rows_in_16_element_tiles(monkeypatch, pair):
    """With the mutation run's 16-element host tiles a gather of 40 rows of 2-column tables
    takes 8 rows a program: several row blocks, each a power of two rows (the extent of
    `tl.arange`), whatever `next_power_of_2(num_rows)` allows."""
    monkeypatch.setattr(_common, "HOST_TILE", 16)
    monkeypatch.setattr(gather, "_GATHER_META", {})  # launch constants of these tiles only
    p = pair(**small(max_num_reqs=40, max_num_blocks_per_group=[2]))
    for r in range(40):
        p.append(r, ([r + 1, r + 2],))
    p.bt.apply_staged_writes()
    p.gather([*range(39, 20, -1), -1, *range(20)], 40)


@pytest.mark.parametrize("masked", [False, True], ids=["no-window", "sliding-window"])
def test_gather_many_wide_rows_in_one_default_tile(monkeypatch, pair, masked):
    """With the default 65,536-element host tiles a gather of 300 rows of a 2100-column table
    takes 16 rows x 4096 columns a program: a block of ROWS x COLS past Triton's 2**20
    elements (512 x 4096, `next_power_of_2(num_rows)` rows) does not run at all."""
    monkeypatch.setattr(_common, "HOST_TILE", 1 << 16)
    monkeypatch.setattr(gather, "_GATHER_META", {})  # launch constants of these tiles only
    p = pair(**small(max_num_reqs=300, max_num_blocks_per_group=[2100],
                     sliding_window_reach=[64] if masked else [0]))  # fmt: skip
    for r in range(0, 300, 7):
        p.append(r, (list(range(r + 1, r + 2 + 7 * r)),))
    p.bt.apply_staged_writes()
    nct = [4 * r for r in range(300)] if masked else None
    p.gather([*range(299, 0, -1), -1], 300, num_computed_tokens=nct)


# ------------------------------------------------------------------ sizes


def test_positions_past_int32_in_a_huge_table(pair):
    """A table spanning more than 2**31 positions takes the int64 index path."""
    bs = 2**20
    p = pair(**small(block_sizes=[bs], max_num_blocks_per_group=[4096], cp_size=2, cp_rank=1))
    p.append(0, (list(range(1, 2050)),))
    p.bt.apply_staged_writes()
    far = 2**31 + 5  # virtual block 1024 (id 1025), offset 5: odd, so rank 1 owns it
    out = p.slots([0], [0, 2], [far, far + 1], 2)
    assert out[0, 0] == 1025 * bs + 2 and out[0, 1] == P


def test_long_prefill_spanning_many_tiles(host_tiles, pair):
    """Tiles wholly inside one request skip the per-token search; their slots must not."""
    n = 20_000
    p = pair(
        block_sizes=[16, 12],
        max_num_reqs=3,
        max_num_batched_tokens=n + 8,
        max_num_blocks_per_group=[700, 1700],
        cp_size=3,
        cp_rank=2,
        cp_interleave=4,
        dcp_sharded=[True, False],
    )
    p.append(2, (list(range(1000, 1700)), list(range(5000, 6700))))
    p.append(0, ([9], [8]))
    p.bt.apply_staged_writes()
    p.slots([-1, 2, 0], [0, 3, 3 + n, 5 + n], [7, 8, 9, *range(100, 100 + n), 0, 1], n + 8)


# ------------------------------------------------------------------ what a GPU compiles


def _compiled_gather_ttir(constants: dict) -> str:
    """The gather kernel's TTIR as Triton compiles it for a Hopper GPU (no GPU needed)."""
    kernel = gather._gather_block_tables_kernel._compiled
    signature = {name: "i32" for name in kernel.arg_names}
    signature.update(
        idx_mapping="*i32", src_ptrs="*u64", src_strides="*i64", dst_ptrs="*u64",
        dst_strides="*i64", widths="*i32", num_blocks="*i32", block_sizes="*i64",
        reaches="*i64", num_computed_tokens="*i32",
    )  # fmt: skip
    return hopper_ttir(kernel, signature, constants)


@needs_cuda_backend
@pytest.mark.parametrize("mask_window", [False, True], ids=["no-window", "sliding-window"])
def test_the_compiled_gather_builds_and_divides_no_flags(mask_window):
    """The gather kernel as CUDA launches it, with a GPU's own constants, built on CPU for a
    Hopper GPU: the interpreter never compiles it. `gather_rows`, the work of one program,
    must be a `dual_device_fn` for the compiled kernel to call it at all, and no integer
    division may take a flag operand (`hopper.flag_divisions`): a row's `real` divided by
    `r < max_num_reqs` would read rows past the table on a GPU."""
    rows, constants = gather._gather_meta(False, 100, mask_window, 0)
    assert (rows, constants["COLS"]) == (16, 128)  # 2048 entries a program, 128 columns
    ttir = _compiled_gather_ttir(constants)
    assert "tt.store" in ttir
    assert flag_divisions(ttir) == []


@needs_cuda_backend
@pytest.mark.parametrize("max_width", [257, 2100], ids=["257-wide", "2100-wide"])
def test_the_compiled_gather_of_wide_tables_takes_512_columns(max_width):
    """Past 256 columns a GPU's program is 4 rows x 512 columns, a power of two (the extent
    of `tl.arange`; any other extent does not compile), looped over the columns."""
    rows, constants = gather._gather_meta(False, max_width, True, 0)
    assert (rows, constants["ROWS"], constants["COLS"]) == (4, 4, 512)
    assert "tt.store" in _compiled_gather_ttir(constants)


@needs_cuda_backend
@pytest.mark.parametrize("mask_window", [False, True], ids=["no-window", "sliding-window"])
def test_the_compiled_gather_of_one_column_tables_takes_2048_rows(mask_window):
    """Tables one column wide (`max_num_blocks_per_group` 1, kernel blocks the size of the
    blocks) give a GPU's program 2048 rows x 1 column: the whole budget, still a power of
    two (the extent of `tl.arange`), so the kernel builds for Hopper."""
    rows, constants = gather._gather_meta(False, 1, mask_window, 0)
    assert (rows, constants["ROWS"], constants["COLS"]) == (2048, 2048, 1)
    assert "tt.store" in _compiled_gather_ttir(constants)
