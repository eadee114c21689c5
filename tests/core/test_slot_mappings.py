"""The slot mapping's two program layouts (`kernels/slot_mappings.py`, `kernels/slot_programs.py`).

Every case runs both layouts, by tile and by request, on the same inputs, through
`compute_slot_mappings` (persistent and caller-owned buffers) and the fused read, over a
buffer full of garbage, and holds each to the reference; then the host's choice between
them is tested at its bounds.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hopper import flag_divisions, flag_shifts, hopper_ttir, needs_cuda_backend

from cp_blocktables import PAD_SLOT_ID, BlockTables, BlockTablesConfig
from cp_blocktables._jit import launch_counts
from cp_blocktables.kernels import _common, slot_mappings
from cp_blocktables.reference import ReferenceBlockTables

GARBAGE = 0x5EED  # what the buffers hold before a call: an entry left unwritten shows


def _config(**overrides) -> dict:
    kwargs = dict(
        block_sizes=[16, 32],
        max_num_reqs=8,
        max_num_batched_tokens=96,
        max_num_blocks_per_group=[64, 32],
    )
    kwargs.update(overrides)
    return kwargs


def _case(name, config, requests, padded=None, first_id=1, pos32=True, pow2=True):
    """A batch: `requests` as (row or -1, first position, tokens); `padded`: its
    `num_tokens_padded` (None: the buffer's length); `first_id`: the rows' first block
    id; `pos32`, `pow2`: the index paths (POS32, POW2) the config must take."""
    return pytest.param(config, requests, padded, first_id, (pos32, pow2), id=name)


CASES = [
    _case(
        "cp1-decodes-and-a-dummy",
        _config(),
        [(3, 900, 1), (0, 17, 1), (-1, 0, 1), (5, 1000, 1), (1, 0, 1), (7, 511, 1)],
    ),
    _case(
        "cp2-i1-sharded-unsharded-disabled",
        _config(
            block_sizes=[16, 16, 32],
            max_num_blocks_per_group=[16, 32, 8],
            cp_size=2,
            cp_rank=1,
            dcp_sharded=[True, False, True],
            slot_mapping_enabled=[True, True, False],
        ),
        [(2, 300, 7), (-1, 5, 3), (6, 0, 1), (4, 40, 20), (1, 2, 2)],
        padded=40,
    ),
    _case(
        "cp4-i2-kernel-blocks",
        _config(
            block_sizes=[16, 32],
            kernel_block_sizes=[8, 16],
            max_num_blocks_per_group=[16, 8],
            cp_size=4,
            cp_rank=3,
            cp_interleave=2,
        ),
        [(0, 100, 33), (5, 7, 1), (-1, 9, 2), (3, 250, 40)],
    ),
    _case(
        "cp3-i4-not-pow2",
        _config(block_sizes=[12, 24], cp_size=3, cp_rank=2, cp_interleave=4),
        [(1, 1000, 30), (2, 5, 5), (-1, 0, 4), (0, 2222, 1)],
        padded=50,
        pow2=False,
    ),
    _case(  # no size is a power of two, not even a CP size of 1: the division path
        "cp3-i3-no-power-of-two",
        _config(
            block_sizes=[12, 6],
            max_num_blocks_per_group=[24, 48],
            cp_size=3,
            cp_rank=1,
            cp_interleave=3,
        ),
        [(1, 300, 20), (-1, 0, 2), (4, 50, 9), (0, 860, 4), (6, 0, 1)],
        padded=40,
        pow2=False,
    ),
    _case(  # 20 and 16 have no two adjacent bits set, yet 20 is no power of two
        "cp2-i2-block-20-not-pow2",
        _config(block_sizes=[20, 16], cp_size=2, cp_rank=1, cp_interleave=2),
        [(2, 300, 7), (-1, 0, 2), (5, 41, 20), (0, 1000, 1)],
        pow2=False,
    ),
    _case(
        "cp2-positions-past-2**31",
        _config(block_sizes=[2**20], max_num_blocks_per_group=[2100], cp_size=2, cp_rank=1),
        [(0, 2**31 + 5, 6), (-1, 2**40, 2), (1, 2**31 - 3, 6)],
        pos32=False,
    ),
    _case(  # a row's span passes 2**31 only with the CP factor: POS32 must count it
        "cp2-span-past-2**31-only-with-cp",
        _config(block_sizes=[2**20], max_num_blocks_per_group=[1100], cp_size=2, cp_rank=0),
        [(0, 2**31 + 5, 6), (1, 2**31 - 3, 6)],
        pos32=False,
    ),
    _case(  # the span is exactly 2**31, so every position fits int32, but the block size,
        # 2**31, does not: POS32 must hold only below 2**31, or slots come out negative
        "cp1-one-block-of-2**31-positions",
        _config(block_sizes=[2**31], max_num_blocks_per_group=[1]),
        [(3, 2**31 - 7, 5), (-1, 0, 2), (0, 17, 4), (5, 2**31 - 2, 2)],
        pos32=False,
    ),
    _case(  # the span, 2000 * 2**20, lies just below 2**31, so POS32 holds: positions
        # from 2**30 up to the span's end fit int32 and lie in the table
        "cp2-positions-past-2**30-on-the-int32-path",
        _config(block_sizes=[2**20], max_num_blocks_per_group=[1000], cp_size=2, cp_rank=1),
        [(0, 2**30 - 3, 6), (-1, 2**40, 2), (1, 2000 * 2**20 - 6, 6), (2, 0, 3)],
    ),
    _case(  # as above by truncating division: 1300 blocks of 3 * 2**19 span just below 2**31
        "cp1-positions-past-2**30-on-the-int32-path-not-pow2",
        _config(block_sizes=[3 * 2**19], max_num_blocks_per_group=[1300]),
        [(0, 2**30 + 5, 4), (1, 1300 * 3 * 2**19 - 4, 4), (-1, 0, 1)],
        pow2=False,
    ),
    _case(
        "cp1-slots-past-2**31",
        _config(block_sizes=[16, 12], max_num_blocks_per_group=[64, 96]),
        [(4, 0, 3), (6, 777, 5), (-1, 3, 1)],
        padded=16,
        first_id=2**31 - 400,
        pow2=False,
    ),
    _case(
        "cp1-request-longer-than-one-step",
        _config(max_num_batched_tokens=2700, max_num_blocks_per_group=[256, 128]),
        [(-1, 0, 3), (2, 40, 2500), (5, 3000, 1), (0, 9, 60)],
    ),
    _case(
        "cp2-batch-fills-the-buffer",
        _config(cp_size=2, cp_rank=1, max_num_batched_tokens=64),
        [(6, 11, 20), (-1, 0, 0), (2, 500, 1), (1, 64, 43)],
    ),
    _case(
        "cp2-empty-requests-padded-tail",
        _config(cp_size=2, cp_rank=0, max_num_batched_tokens=128),
        [(1, 3, 0), (-1, 0, 0), (2, 31, 9), (3, 0, 0)],
        padded=20,
    ),
    _case(  # an entry starts at a tile's last token (127): the last-entry search meets
        # a query_start_loc entry equal to its bound
        "cp1-an-entry-starts-at-a-tiles-last-token",
        _config(max_num_batched_tokens=128),
        [(3, 5, 100), (0, 17, 27), (6, 40, 1)],
    ),
    _case("no-requests", _config(), [], padded=0),
]


def _batch(requests, num_groups: int):
    idx = np.array([r for r, _, _ in requests], dtype=np.int32)
    lens = np.array([n for _, _, n in requests], dtype=np.int64)
    qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    pos = [np.arange(n, dtype=np.int64) + p for _, p, n in requests]
    pos = np.concatenate([*pos, np.full(5, 2**50, np.int64)])  # garbage past the batch
    return idx, qsl, pos


def _build(torch_device, config: dict, requests, first_id: int, reallocate=None):
    """`BlockTables` and reference with every row the batch names full of distinct ids;
    `reallocate(table)`: each table's replacement, installed before the appends."""
    bt = BlockTables(device=torch_device, **config)
    ref = ReferenceBlockTables(BlockTablesConfig(**config))
    if reallocate is not None:
        for table in bt.block_tables:
            table.gpu = reallocate(table.gpu)
        bt.init_block_table_layout_tensors()
    next_id = first_id
    for r in sorted({r for r, _, _ in requests if r >= 0}):
        ids = []
        for w in config["max_num_blocks_per_group"]:
            ids.append(list(range(next_id, next_id + w)))
            next_id += w
        bt.append_block_ids(r, tuple(ids), True)
        ref.append_block_ids(r, tuple(ids), True)
    bt.apply_staged_writes()
    return bt, ref


@pytest.fixture
def force_layout(monkeypatch):
    """`force_layout(True)`: every call maps by request, `False`: by tile. Returns the list
    of the host's answers, one per call that consulted it."""

    def force(request_layout: bool) -> list[bool]:
        asked: list[bool] = []

        def rule(num_reqs, num_tokens_padded, most_reqs):
            asked.append(request_layout)
            return request_layout

        monkeypatch.setattr(slot_mappings, "by_request", rule)
        return asked

    return force


def _launches(name: str, call):
    """`call()`'s result; asserts it launched one kernel, `name`."""
    before, total = launch_counts[name], sum(launch_counts.values())
    result = call()
    assert sum(launch_counts.values()) - total == 1
    assert launch_counts[name] - before == 1
    return result


# A RuntimeWarning is an error: the interpreter reports an integer division or
# remainder by zero (undefined in compiled code) only as a warning, e.g. a tile
# that spans several entries from entry 0.
@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("layout", [False, True], ids=["by-tile", "by-request"])
@pytest.mark.parametrize(("config", "requests", "padded", "first_id", "flags"), CASES)
def test_each_layout_maps_every_entry_as_the_reference(
    torch_device, force_layout, layout, config, requests, padded, first_id, flags
):
    bt, ref = _build(torch_device, config, requests, first_id)
    plan = bt._slot_plan.pick.__self__
    assert (plan.tile_meta["POS32"], plan.tile_meta["POW2"]) == flags
    idx, qsl, pos = _batch(requests, bt.num_kv_cache_groups)
    out_len = bt.max_num_batched_tokens
    padded = out_len if padded is None else padded
    expected = ref.slot_mappings(idx, qsl, pos, out_len)
    t = lambda a: torch.from_numpy(a).to(torch_device)  # noqa: E731
    asked = force_layout(layout)

    bt.slot_mappings.fill_(GARBAGE)
    got = _launches(
        "_compute_slot_mappings_kernel",
        lambda: bt.compute_slot_mappings(t(idx), t(qsl), t(pos), padded),
    )
    np.testing.assert_array_equal(bt.slot_mappings.cpu().numpy(), expected)
    assert got.shape == (bt.num_kv_cache_groups, padded)

    out = torch.full_like(bt.slot_mappings, GARBAGE)
    _launches(
        "_compute_slot_mappings_kernel",
        lambda: bt.compute_slot_mappings(t(idx), t(qsl), t(pos), padded, out=out),
    )
    np.testing.assert_array_equal(out.cpu().numpy(), expected)

    bt.slot_mappings.fill_(GARBAGE)
    _launches(
        "_gather_and_slot_mappings_kernel",
        lambda: bt.gather_and_compute_slot_mappings(t(idx), len(idx), t(qsl), t(pos), padded),
    )
    np.testing.assert_array_equal(bt.slot_mappings.cpu().numpy(), expected)
    assert asked == [layout] * 3  # the host chose, and chose as forced, for every call


@pytest.mark.parametrize("layout", [False, True], ids=["by-tile", "by-request"])
def test_int64_index_tensors(torch_device, force_layout, layout):
    config = _config(cp_size=2, cp_rank=1, cp_interleave=2)
    requests = [(3, 50, 4), (-1, 0, 2), (1, 0, 40), (6, 77, 1)]
    bt, ref = _build(torch_device, config, requests, 1)
    idx, qsl, pos = _batch(requests, 2)
    force_layout(layout)
    bt.slot_mappings.fill_(GARBAGE)
    i64 = lambda a: torch.from_numpy(a.astype(np.int64)).to(torch_device)  # noqa: E731
    bt.compute_slot_mappings(i64(idx), i64(qsl), i64(pos), 60)
    expected = ref.slot_mappings(idx, qsl, pos, bt.max_num_batched_tokens)
    np.testing.assert_array_equal(bt.slot_mappings.cpu().numpy(), expected)


@pytest.mark.parametrize("layout", [False, True], ids=["by-tile", "by-request"])
@pytest.mark.parametrize(
    ("requests", "first"),
    [
        pytest.param([], 5, id="no-requests"),
        pytest.param([(-1, 0, 3), (2, 40, 2), (5, 7, 3)], 200, id="a-dummy-first"),
        pytest.param([(2, 40, 3)], 200, id="one-request"),
    ],
)
def test_the_first_query_start_loc_entry_is_never_read(
    torch_device, force_layout, layout, requests, first
):
    """Unchecked input (validation off): a `query_start_loc` that does not start at 0 (refused
    when validating, docs/bad-input.md). Entry 0 starts at token 0 in both layouts whatever
    `qsl[0]` holds, and a batch of no entries has no tokens: the slots are those of the same
    batch with `qsl[0] = 0`. A `qsl[0]` of 200 lies past the CPU's one 128-token tile, where
    reading it would end the search for the tile's last entry at entry 0 (with one entry,
    its first step reads `qsl[0]` if it reads entry starts instead of ends). The positions
    past the batch are 0, inside the tables, so that a token past the batch given entry 0
    would show a slot where PAD belongs."""
    bt, ref = _build(torch_device, _config(), requests, 1)
    bt.validate_inputs = False
    idx, qsl, pos = _batch(requests, 2)
    pos[qsl[-1] :] = 0
    expected = ref.slot_mappings(idx, qsl, pos, bt.max_num_batched_tokens)
    qsl[0] = first
    force_layout(layout)
    bt.slot_mappings.fill_(GARBAGE)
    t = lambda a: torch.from_numpy(a).to(torch_device)  # noqa: E731
    bt.compute_slot_mappings(t(idx), t(qsl), t(pos), 8)
    np.testing.assert_array_equal(bt.slot_mappings.cpu().numpy(), expected)


@pytest.mark.parametrize("layout", [False, True], ids=["by-tile", "by-request"])
@pytest.mark.parametrize(
    ("config", "spare"),
    [
        pytest.param(_config(), 3, id="cp1-3-spare-columns"),
        pytest.param(
            _config(block_sizes=[12, 24], cp_size=3, cp_rank=2, cp_interleave=4), 8,
            id="cp3-not-pow2-8-spare-columns",
        ),
    ],
)  # fmt: skip
def test_tables_reallocated_with_a_wider_row_pitch_are_read_at_their_row_stride(
    torch_device, force_layout, layout, config, spare
):
    """An engine may reallocate the tables and call `init_block_table_layout_tensors()`
    (SPEC.md 3), which takes any int32 table of unit column stride and disjoint rows: here
    views of a wider allocation whose spare columns hold garbage. Row `r` starts `r` row
    strides into the table, not `r` widths: the slots are the reference's in both layouts
    and in the fused read."""

    def pitched(table: torch.Tensor) -> torch.Tensor:
        rows, width = table.shape
        wide = torch.full((rows, width + spare), GARBAGE, dtype=table.dtype, device=table.device)
        return wide[:, :width].zero_()

    # 12 tokens (C * I under cp 3) give rows past 0 tokens on every rank
    requests = [(3, 300, 12), (0, 17, 5), (-1, 0, 1), (5, 100, 12), (7, 41, 12)]
    bt, ref = _build(torch_device, config, requests, 1, reallocate=pitched)
    assert all(t.gpu.stride(0) == t.gpu.shape[1] + spare for t in bt.block_tables)
    idx, qsl, pos = _batch(requests, bt.num_kv_cache_groups)
    expected = ref.slot_mappings(idx, qsl, pos, bt.max_num_batched_tokens)
    t = lambda a: torch.from_numpy(a).to(torch_device)  # noqa: E731
    force_layout(layout)
    bt.slot_mappings.fill_(GARBAGE)
    bt.compute_slot_mappings(t(idx), t(qsl), t(pos), 48)
    np.testing.assert_array_equal(bt.slot_mappings.cpu().numpy(), expected)
    bt.slot_mappings.fill_(GARBAGE)
    bt.gather_and_compute_slot_mappings(t(idx), len(idx), t(qsl), t(pos), 48)
    np.testing.assert_array_equal(bt.slot_mappings.cpu().numpy(), expected)


# ------------------------------------------------------------------ past a request program's reach

REACH_CONFIG = _config(
    block_sizes=[16], max_num_batched_tokens=9100, max_num_blocks_per_group=[700]
)
REACH_REQUESTS = [(1, 9, 3), (4, 100, slot_mappings.SMALL_BATCH_TOKENS + 900), (2, 5, 1)]


def test_request_layout_maps_tokens_past_its_reach_by_tile(torch_device, force_layout):
    """A request program reaches SMALL_BATCH_TOKENS tokens; the tail programs map the rest as
    the tile layout does. The host never sends such a step by request; the layouts agree anyway."""
    bt, ref = _build(torch_device, REACH_CONFIG, REACH_REQUESTS, 3)
    idx, qsl, pos = _batch(REACH_REQUESTS, 1)
    force_layout(True)
    bt.slot_mappings.fill_(GARBAGE)
    t = lambda a: torch.from_numpy(a).to(torch_device)  # noqa: E731
    bt.compute_slot_mappings(t(idx), t(qsl), t(pos), bt.max_num_batched_tokens)
    expected = ref.slot_mappings(idx, qsl, pos, bt.max_num_batched_tokens)
    np.testing.assert_array_equal(bt.slot_mappings.cpu().numpy(), expected)


def test_tail_programs_map_every_tile_past_the_reach(force_layout, monkeypatch):
    """As the test before, in 512-token interpreted tiles (a GPU's tile): the tail programs
    past the reach (8,192) start at 8,192 and at 8,704, the second one wholly past the reach
    and still inside the batch. Only small tiles make such a tile; the default one, a
    power of two past 9,100 tokens, puts the only tail tile past the reach exactly at it."""
    monkeypatch.setattr(_common, "HOST_TILE", 512)
    monkeypatch.setattr(slot_mappings, "_SLOT_LAUNCHES", {})  # launch constants bind tiles
    bt, ref = _build(torch.device("cpu"), REACH_CONFIG, REACH_REQUESTS, 3)
    assert bt._slot_plan.pick.__self__.request_meta["TILE"] == 512
    idx, qsl, pos = _batch(REACH_REQUESTS, 1)
    assert qsl[-1] > slot_mappings.SMALL_BATCH_TOKENS + 512  # a tail tile past 8,704 holds tokens
    force_layout(True)
    bt.slot_mappings.fill_(GARBAGE)
    t = torch.from_numpy
    bt.compute_slot_mappings(t(idx), t(qsl), t(pos), bt.max_num_batched_tokens)
    expected = ref.slot_mappings(idx, qsl, pos, bt.max_num_batched_tokens)
    np.testing.assert_array_equal(bt.slot_mappings.numpy(), expected)


def test_a_batch_larger_than_num_tokens_padded_said_is_still_mapped(torch_device):
    """Unchecked input (values are not read back on CUDA): the host picks the request layout
    from `num_tokens_padded`, yet every token of the larger batch gets its slot."""
    bt, ref = _build(torch_device, REACH_CONFIG, REACH_REQUESTS, 3)
    bt.validate_inputs = False
    idx, qsl, pos = _batch(REACH_REQUESTS, 1)
    assert slot_mappings.by_request(len(idx), 64, bt._slot_plan.pick.__self__.most_reqs)
    bt.slot_mappings.fill_(GARBAGE)
    t = lambda a: torch.from_numpy(a).to(torch_device)  # noqa: E731
    bt.compute_slot_mappings(t(idx), t(qsl), t(pos), 64)
    expected = ref.slot_mappings(idx, qsl, pos, bt.max_num_batched_tokens)
    np.testing.assert_array_equal(bt.slot_mappings.cpu().numpy(), expected)


@pytest.mark.parametrize("layout", [False, True], ids=["by-tile", "by-request"])
def test_a_batch_longer_than_the_output_buffer_writes_only_the_buffer(
    torch_device, force_layout, layout
):
    """Unchecked input (validation off): a batch of 50 tokens into a caller's `out` of 40
    (refused when validating, docs/bad-input.md: `[padded-below-tokens]`,
    `[padded-above-buffer]`). The buffer gets the reference's slots of its 40 tokens, and no
    store passes its end: `out` is a view of a wider tensor, whose spare columns must keep
    their garbage. 40 tokens are no whole number of a request program's 32-token steps."""
    requests = [(3, 50, 4), (-1, 0, 2), (1, 0, 40), (6, 77, 4)]
    bt, ref = _build(torch_device, _config(), requests, 1)
    bt.validate_inputs = False
    idx, qsl, pos = _batch(requests, bt.num_kv_cache_groups)
    out_len = 40
    assert qsl[-1] > out_len
    expected = ref.slot_mappings(idx, qsl, pos, bt.max_num_batched_tokens)[:, :out_len]
    wide = torch.full((bt.num_kv_cache_groups, 64), GARBAGE, dtype=torch.int64, device=torch_device)
    t = lambda a: torch.from_numpy(a).to(torch_device)  # noqa: E731
    force_layout(layout)
    bt.compute_slot_mappings(t(idx), t(qsl), t(pos), 8, out=wide[:, :out_len])
    np.testing.assert_array_equal(wide[:, :out_len].cpu().numpy(), expected)
    assert (wide[:, out_len:] == GARBAGE).all()


@pytest.mark.parametrize("layout", [False, True], ids=["by-tile", "by-request"])
@pytest.mark.parametrize(
    "qsl",
    [
        pytest.param([0, 3, -1, 6], id="entry-2-starts-at-minus-1"),
        pytest.param([0, -5, 6], id="entry-1-starts-at-minus-5"),
    ],
)
def test_an_unchecked_negative_query_start_loc_entry_writes_only_the_buffer(
    torch_device, force_layout, layout, qsl
):
    """Unchecked input (validation off): a `query_start_loc` entry below 0, so the starts
    decrease (refused when validating, docs/bad-input.md: `[qsl-decreasing]`). The kernels
    still store no entry outside the buffer (docs/contract-notes.md, input checks): `out` is
    a view one column into a wider tensor, and the columns before and after it (token -1 of
    each group, and the last column) keep their garbage. A request program starting at a
    negative token would store token -1 there. `positions` is a view one entry into a longer
    tensor, so that a read of token -1's position stays inside its allocation."""
    rows = [3, 1, 6][: len(qsl) - 1]
    bt, _ = _build(torch_device, _config(), [(r, 0, 1) for r in rows], 1)
    bt.validate_inputs = False
    idx = torch.tensor(rows, dtype=torch.int32)
    out_len = bt.max_num_batched_tokens
    pos = torch.zeros(1 + out_len, dtype=torch.int64, device=torch_device)[1:]
    shape = (bt.num_kv_cache_groups, out_len + 2)
    wide = torch.full(shape, GARBAGE, dtype=torch.int64, device=torch_device)
    t = lambda a: a.to(torch_device)  # noqa: E731
    force_layout(layout)
    bt.compute_slot_mappings(
        t(idx), t(torch.tensor(qsl, dtype=torch.int32)), pos, out_len, out=wide[:, 1 : 1 + out_len],
    )  # fmt: skip
    assert (wide[:, 0] == GARBAGE).all()
    assert (wide[:, -1] == GARBAGE).all()


def test_a_short_step_in_a_buffer_past_a_request_programs_reach_pads_every_entry(torch_device):
    """A buffer longer than SMALL_BATCH_TOKENS (9,100 tokens) and a step of two short requests:
    the host maps it by request, and its tail programs pad every entry past the batch up to
    the buffer's end (SPEC.md 3), although on CPU the tile layout's tile, the whole buffer,
    passes a request program's reach."""
    requests = [(1, 9, 3), (2, 5, 1)]
    bt, ref = _build(torch_device, REACH_CONFIG, requests, 3)
    idx, qsl, pos = _batch(requests, 1)
    assert bt._slot_plan.layout(len(idx), 16) == "request"
    bt.slot_mappings.fill_(GARBAGE)
    t = lambda a: torch.from_numpy(a).to(torch_device)  # noqa: E731
    bt.compute_slot_mappings(t(idx), t(qsl), t(pos), 16)
    expected = ref.slot_mappings(idx, qsl, pos, bt.max_num_batched_tokens)
    np.testing.assert_array_equal(bt.slot_mappings.cpu().numpy(), expected)


@pytest.mark.parametrize(
    "requests",
    [
        pytest.param([(3, 0, 64)], id="one-request"),
        pytest.param([(3, 7, 64), (1, 0, 0)], id="then-an-empty-entry"),
    ],
)
def test_a_first_entry_that_fills_the_buffer_maps_its_last_token(torch_device, requests):
    """A step whose first batch entry holds every token of a 64-token buffer, mapped by
    request (one 64-token request passes `by_request`): on CPU the entry's request program
    reaches the buffer's last token in its second 32-token step, and no tail program maps
    it (it lies below the reach). Entry 0 starts at token 0: a request program that starts
    it at -1 (its masked-off token) ends one token short and leaves token 63 unwritten."""
    config = _config(block_sizes=[16], max_num_blocks_per_group=[8], max_num_batched_tokens=64)
    bt, ref = _build(torch_device, config, requests, 1)
    idx, qsl, pos = _batch(requests, 1)
    assert qsl[1] == qsl[-1] == bt.max_num_batched_tokens
    assert bt._slot_plan.layout(len(idx), 64) == "request"
    bt.slot_mappings.fill_(GARBAGE)
    t = lambda a: torch.from_numpy(a).to(torch_device)  # noqa: E731
    bt.compute_slot_mappings(t(idx), t(qsl), t(pos), 64)
    expected = ref.slot_mappings(idx, qsl, pos, 64)
    np.testing.assert_array_equal(bt.slot_mappings.cpu().numpy(), expected)


@pytest.mark.parametrize("entries", [1, 4], ids=["first-entry", "every-entry"])
def test_a_request_program_writes_only_its_own_entrys_tokens(entries):
    """Request programs run side by side on a GPU: program `(b, g)` may write only tokens
    `[qsl[b], qsl[b + 1])` of group `g`, or it races with the program of the next entry (or
    with the tail programs). The interpreter runs programs in order, so a later one would
    overwrite an overrun: here only the request programs of the first `entries` entries run
    (no tail programs), over a buffer of garbage that every other token must keep."""
    requests = [(3, 50, 4), (-1, 0, 2), (1, 0, 40), (6, 77, 1)]
    bt, ref = _build(torch.device("cpu"), _config(), requests, 1)
    idx, qsl, pos = _batch(requests, 2)
    launch = bt._slot_plan.pick.__self__
    expected = ref.slot_mappings(idx, qsl, pos, bt.max_num_batched_tokens)
    expected[:, qsl[entries] :] = GARBAGE
    idx_t, qsl_t, pos_t = (torch.from_numpy(a) for a in (idx, qsl, pos))
    bt.slot_mappings.fill_(GARBAGE)
    slot_mappings._compute_slot_mappings_kernel.launch(
        torch.device("cpu"), (entries * launch.num_groups,), idx_t, len(idx), bt.max_num_reqs,
        qsl_t, pos_t, pos_t.shape[0], *bt._slot_plan.tail, **launch.request_meta,
    )  # fmt: skip
    np.testing.assert_array_equal(bt.slot_mappings.numpy(), expected)


def _rows_longer(extra: int):
    """`_build`'s `reallocate`: each table becomes a view of an allocation `extra` rows
    longer, whose extra rows hold block 3."""

    def reallocate(table: torch.Tensor) -> torch.Tensor:
        rows, width = table.shape
        longer = torch.full((rows + extra, width), 3, dtype=table.dtype, device=table.device)
        return longer[:rows].zero_()

    return reallocate


_one_row_longer = _rows_longer(1)

UNCHECKED_CONFIGS = [
    pytest.param(_config(), id="cp1-pow2"),
    pytest.param(
        _config(block_sizes=[12, 24], cp_size=3, cp_rank=0, cp_interleave=4),
        id="cp3-rank-0-not-pow2",  # rank 0 owns positions 0-3 and their neighbour -1
    ),
]


def _assert_every_slot_call_maps(bt, idx, qsl, pos, expected, torch_device):
    """Into the persistent buffer, into `out`, and fused with a gather: `expected` each time."""
    t = lambda a: torch.from_numpy(a).to(torch_device)  # noqa: E731
    bt.slot_mappings.fill_(GARBAGE)
    bt.compute_slot_mappings(t(idx), t(qsl), t(pos), bt.max_num_batched_tokens)
    np.testing.assert_array_equal(bt.slot_mappings.cpu().numpy(), expected)
    out = torch.full_like(bt.slot_mappings, GARBAGE)
    bt.compute_slot_mappings(t(idx), t(qsl), t(pos), bt.max_num_batched_tokens, out=out)
    np.testing.assert_array_equal(out.cpu().numpy(), expected)
    bt.slot_mappings.fill_(GARBAGE)
    bt.gather_and_compute_slot_mappings(t(idx), len(idx), t(qsl), t(pos), bt.max_num_batched_tokens)
    np.testing.assert_array_equal(bt.slot_mappings.cpu().numpy(), expected)


@pytest.mark.parametrize("layout", [False, True], ids=["by-tile", "by-request"])
@pytest.mark.parametrize("config", UNCHECKED_CONFIGS)
def test_unchecked_rows_past_the_table_and_negative_positions_pad(
    torch_device, force_layout, layout, config
):
    """Unchecked input (validation off; refused when validating, docs/bad-input.md:
    `[slot-row-past-max]`, `[negative-position]`): a row outside `[0, max_num_reqs)` is a
    dummy request, and a position outside its table, -1 included, maps to PAD_SLOT_ID
    (docs/contract-notes.md, input checks). Row `max_num_reqs` lies in an allocation one row
    longer whose extra row holds block ids, and position -1 falls in column -1 (by shifts:
    the last entry of the row before) or 0 (by truncating division), ids too: a kernel that
    read either would map a slot there."""
    legal = [(1, 40, 3), (2, 0, 2), (5, 17, 2)]
    bt, ref = _build(torch_device, config, legal, 1, reallocate=_one_row_longer)
    bt.validate_inputs = False
    # row past the table; then row 2's tokens at positions -1 and 0
    requests = [(1, 40, 3), (bt.max_num_reqs, 0, 4), (2, -1, 2), (5, 17, 2)]
    idx, qsl, pos = _batch(requests, bt.num_kv_cache_groups)
    negative = qsl[2]
    assert idx[1] == bt.max_num_reqs and pos[negative] == -1
    as_dummy, at_zero = idx.copy(), pos.copy()
    as_dummy[1], at_zero[negative] = -1, 0  # the reference maps legal input only
    expected = ref.slot_mappings(as_dummy, qsl, at_zero, bt.max_num_batched_tokens)
    expected[:, negative] = PAD_SLOT_ID
    force_layout(layout)
    _assert_every_slot_call_maps(bt, idx, qsl, pos, expected, torch_device)


@pytest.mark.parametrize("layout", [False, True], ids=["by-tile", "by-request"])
@pytest.mark.parametrize("config", UNCHECKED_CONFIGS)
def test_unchecked_rows_further_past_the_table_pad(torch_device, force_layout, layout, config):
    """As the test above, for rows `max_num_reqs + 1` and `max_num_reqs + 2`: every row
    outside `[0, max_num_reqs)`, not only the first one past it, is a dummy request whose
    tokens pad (docs/contract-notes.md, input checks). Both rows lie in an allocation three
    rows longer whose extra rows hold block ids, and their tokens sit at positions this rank
    owns: a kernel that read either row would map a slot there."""
    legal = [(1, 40, 3), (5, 17, 2)]
    bt, ref = _build(torch_device, config, legal, 1, reallocate=_rows_longer(3))
    bt.validate_inputs = False
    past = bt.max_num_reqs
    requests = [(1, 40, 3), (past + 1, 0, 4), (5, 17, 2), (past + 2, 0, 3)]
    idx, qsl, pos = _batch(requests, bt.num_kv_cache_groups)
    as_dummy = np.where(idx >= past, -1, idx).astype(np.int32)  # the reference maps legal input
    expected = ref.slot_mappings(as_dummy, qsl, pos, bt.max_num_batched_tokens)
    force_layout(layout)
    _assert_every_slot_call_maps(bt, idx, qsl, pos, expected, torch_device)


@pytest.mark.parametrize("layout", [False, True], ids=["by-tile", "by-request"])
@pytest.mark.parametrize("start", [2**32, 2**32 - 2], ids=["2**32", "2**32-2"])
@pytest.mark.parametrize("config", UNCHECKED_CONFIGS)
def test_unchecked_positions_past_2_31_pad_on_the_int32_path(
    torch_device, force_layout, layout, start, config
):
    """Unchecked input (validation off; refused when validating, docs/bad-input.md:
    `[position-past-table]`): where every table spans fewer than 2**31 positions (POS32),
    a position at or past 2**31 lies outside every table and maps to PAD_SLOT_ID
    (docs/contract-notes.md, input checks). Row 2's two tokens start at `start`: at 2**32
    their low 32 bits are positions 0 and 1, owned by this rank, so a kernel that took
    them as in range and narrowed them to int32 would map row 2's first slots there; at
    2**32 - 2 they are -2 and -1 as int32, so a kernel that bounded positions by 2**32
    would read the column before row 2's first."""
    legal = [(1, 40, 3), (2, 0, 2), (5, 17, 2)]
    bt, ref = _build(torch_device, config, legal, 1)
    assert bt._slot_plan.pick.__self__.tile_meta["POS32"]
    bt.validate_inputs = False
    requests = [(1, 40, 3), (2, start, 2), (5, 17, 2)]
    idx, qsl, pos = _batch(requests, bt.num_kv_cache_groups)
    far = slice(qsl[1], qsl[2])
    narrowed = pos.copy()
    narrowed[far] = [0, 1]  # the reference maps legal input only
    expected = ref.slot_mappings(idx, qsl, narrowed, bt.max_num_batched_tokens)
    assert (expected[:, far] != PAD_SLOT_ID).any()
    expected[:, far] = PAD_SLOT_ID
    force_layout(layout)
    _assert_every_slot_call_maps(bt, idx, qsl, pos, expected, torch_device)


# ------------------------------------------------------------------ inputs that end at a page

_AT_PAGE_END = textwrap.dedent(
    """
    import ctypes, mmap, sys
    import numpy as np, torch
    from cp_blocktables import PAD_SLOT_ID, BlockTables, BlockTablesConfig
    from cp_blocktables.reference import ReferenceBlockTables

    def at_page_end(values, dtype):
        # `values` in the last bytes of a page whose next page cannot be read
        buf = mmap.mmap(-1, 2 * mmap.PAGESIZE)
        start = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        assert ctypes.CDLL(None).mprotect(
            ctypes.c_void_p(start + mmap.PAGESIZE), mmap.PAGESIZE, 0) == 0
        size = np.dtype(dtype).itemsize * len(values)
        a = np.frombuffer(buf, dtype, len(values), mmap.PAGESIZE - size)
        a[:] = values
        return torch.from_numpy(a)

    config = dict(block_sizes=[16], max_num_reqs=4, max_num_batched_tokens=256,
                  max_num_blocks_per_group=[8])
    bt = BlockTables(device="cpu", **config)
    ref = ReferenceBlockTables(BlockTablesConfig(**config))
    for r in range(2):
        ids = ([1 + 8 * r + i for i in range(8)],)
        bt.append_block_ids(r, ids, True)
        ref.append_block_ids(r, ids, True)
    bt.apply_staged_writes()
    idx, qsl, pos = [1, 0], [0, 3, 5], [7, 8, 9, 0, 1]
    padded, given = int(sys.argv[1]), int(sys.argv[2])
    if given < len(pos):
        bt.validate_inputs = False  # fewer positions than tokens: unchecked input
    bt.compute_slot_mappings(at_page_end(idx, np.int32), at_page_end(qsl, np.int32),
                             at_page_end(pos[:given], np.int64), padded)
    expected = ref.slot_mappings(np.array(idx), np.array(qsl), np.array(pos), 256)
    # tokens of the batch past the positions given have no slot to hold to
    known = [t for t in range(256) if not given <= t < qsl[-1]]
    np.testing.assert_array_equal(bt.slot_mappings.numpy()[:, known], expected[:, known])
    print(bt._slot_plan.layout(len(idx), padded))
    """
)


@pytest.mark.parametrize(
    ("host_tile", "padded", "given", "layout"),
    [
        pytest.param("16", 200, 5, "tile", id="by-tile-small-tiles"),
        pytest.param("65536", 200, 5, "tile", id="by-tile-one-program"),
        pytest.param("16", 8, 5, "request", id="by-request-small-tiles"),
        pytest.param("16", 200, 4, "tile", id="by-tile-positions-short-unchecked"),
        pytest.param("16", 8, 4, "request", id="by-request-positions-short-unchecked"),
        pytest.param("16", 200, 3, "tile", id="by-tile-positions-two-short-unchecked"),
        pytest.param("16", 8, 3, "request", id="by-request-positions-two-short-unchecked"),
    ],
)
def test_inputs_that_end_at_an_unreadable_page_are_read_within_bounds(
    host_tile, padded, given, layout
):
    """`query_start_loc`, `idx_mapping` and `positions` each end at the last bytes before an
    unreadable page: a load one entry past any of them (a search step taken after the search
    has converged at `num_reqs`) is a segmentation fault. With `given` 4 or 3, `positions`
    holds one or two entries fewer than the batch has tokens, refused when validating and
    unchecked with `validate_inputs` off, where the kernels still read no entry past it
    (docs/contract-notes.md): neither the token at `num_positions` nor one past it. In a
    child process, so that a crash fails the test, not pytest."""
    env = {**os.environ, _common.HOST_TILE_ENV: host_tile}
    proc = subprocess.run(
        [sys.executable, "-c", _AT_PAGE_END, str(padded), str(given)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, f"child died with {proc.returncode}: {proc.stderr[-2000:]}"
    assert proc.stdout.split() == [layout]


# ------------------------------------------------------------------ the host's choice


@pytest.mark.parametrize(
    ("num_reqs", "num_tokens_padded", "most_reqs", "expected"),
    [
        pytest.param(256, 256, 1024, True, id="decode-256-requests"),
        pytest.param(256, 8192, 1024, True, id="mixed-8192-tokens-256-requests"),
        pytest.param(128, 8192, 1024, True, id="average-64-tokens"),
        pytest.param(128, 8193, 1024, False, id="past-8192-tokens"),
        pytest.param(256, 8193, 1024, False, id="past-8192-tokens-256-requests"),
        pytest.param(127, 8192, 1024, False, id="average-past-64-tokens"),
        pytest.param(1, 8192, 1024, False, id="lone-prefill"),
        pytest.param(1, 64, 1024, True, id="one-short-request"),
        pytest.param(9, 100, 8, False, id="more-entries-than-cpu-allows"),
        pytest.param(8, 100, 8, True, id="as-many-entries-as-cpu-allows"),
        pytest.param(0, 0, 8, True, id="no-requests-no-tokens"),
        pytest.param(0, 1, 8, False, id="no-requests-padded-tokens"),
    ],
)
def test_by_request_bounds(num_reqs, num_tokens_padded, most_reqs, expected):
    assert slot_mappings.by_request(num_reqs, num_tokens_padded, most_reqs) is expected


@pytest.mark.parametrize(
    ("on_host", "num_groups", "most_reqs"),
    [
        pytest.param(True, 1, 8, id="cpu-1-group"),
        pytest.param(True, 3, 2, id="cpu-3-groups"),
        pytest.param(True, 12, 1, id="cpu-12-groups"),
        pytest.param(False, 4, 1024, id="cuda-any-batch"),
    ],
)
def test_cpu_maps_by_request_only_where_its_programs_are_few(on_host, num_groups, most_reqs):
    """The interpreter pays milliseconds per program instance (GPUs do not)."""
    bt = BlockTables([16] * num_groups, 1024, 300, [8] * num_groups, "cpu")
    launch = slot_mappings._SlotLaunch(on_host, num_groups, 300, bt._layout, 1, 1024)
    assert launch.most_reqs == most_reqs


@pytest.mark.parametrize(
    "out_len",
    [
        pytest.param(1000, id="1000-tokens-32-steps"),
        pytest.param(2016, id="2016-tokens-63-steps"),
        pytest.param(4000, id="4000-tokens-125-steps"),
    ],
)
def test_a_request_program_reaches_every_token_of_a_buffer_of_many_steps(monkeypatch, out_len):
    """A CPU buffer of 1,000 to 4,000 tokens: a request program takes `cdiv(out_len, 32)`
    32-token steps, and the tail's tile (the default, the whole buffer) starts at token 0,
    below the reach. A legal step of two 40-token requests, mapped by request, gets every
    slot from its request programs, past the first step too. `HOST_TILE` is the default
    whatever `CPBT_HOST_TILE` says: 16-token tails would map the tokens anyway."""
    monkeypatch.setattr(_common, "HOST_TILE", 65536)
    monkeypatch.setattr(slot_mappings, "_SLOT_LAUNCHES", {})  # launch constants bind tiles
    config = _config(
        block_sizes=[16], max_num_blocks_per_group=[64], max_num_batched_tokens=out_len
    )
    requests = [(4, 7, 40), (1, 300, 40)]
    bt, ref = _build(torch.device("cpu"), config, requests, 1)
    idx, qsl, pos = _batch(requests, 1)
    plan = bt._slot_plan.pick.__self__
    assert plan.request_meta["REQ_TILES"] == -(-out_len // 32)
    assert plan.request_meta["TILE"] == _common.next_power_of_2(out_len)
    assert bt._slot_plan.layout(len(idx), 80) == "request"
    bt.slot_mappings.fill_(GARBAGE)
    t = torch.from_numpy
    bt.compute_slot_mappings(t(idx), t(qsl), t(pos), 80)
    expected = ref.slot_mappings(idx, qsl, pos, out_len)
    np.testing.assert_array_equal(bt.slot_mappings.numpy(), expected)


@pytest.mark.parametrize(
    ("padded", "request_layout"),
    [
        pytest.param(4 * slot_mappings.SHORT_REQUEST_TOKENS, True, id="at-the-switch"),
        pytest.param(4 * slot_mappings.SHORT_REQUEST_TOKENS + 1, False, id="one-token-past"),
    ],
)
def test_the_step_at_the_switch_point(torch_device, monkeypatch, padded, request_layout):
    """Four requests, one group: only `num_tokens_padded` moves the step across the switch,
    and both sides fill the whole buffer as the reference does."""
    config = _config(block_sizes=[16], max_num_blocks_per_group=[64], max_num_batched_tokens=300)
    requests = [(2, 70, 37), (-1, 0, 1), (0, 5, 1), (6, 900, 2)]
    bt, ref = _build(torch_device, config, requests, 1)
    idx, qsl, pos = _batch(requests, 1)
    asked = []
    rule = slot_mappings.by_request
    monkeypatch.setattr(slot_mappings, "by_request", lambda *a: asked.append(rule(*a)) or asked[-1])
    bt.slot_mappings.fill_(GARBAGE)
    t = lambda a: torch.from_numpy(a).to(torch_device)  # noqa: E731
    bt.compute_slot_mappings(t(idx), t(qsl), t(pos), padded)
    assert asked == [request_layout]
    expected = ref.slot_mappings(idx, qsl, pos, bt.max_num_batched_tokens)
    np.testing.assert_array_equal(bt.slot_mappings.cpu().numpy(), expected)


# ------------------------------------------------------------------ a GPU's launch constants


def test_each_back_end_launches_its_own_constants():
    """The tiles, request steps and search depth of each back end. Results do not depend on
    them (the next test holds the GPU's on CPU), so only this test sees a GPU's constants
    taken on CPU (`on_cpu`), a search depth left unrounded or a tail tile changed: the
    harness on CPU never launches them, and on CUDA they would only cost time."""
    bt = BlockTables([16], 1024, 9100, [700], "cpu")
    gpu = slot_mappings._SlotLaunch(False, 1, 9100, bt._layout, 1, 1024)
    host = slot_mappings._SlotLaunch(True, 1, 9100, bt._layout, 1, 1024)
    assert (gpu.tile_meta["TILE"], gpu.tile_meta["num_warps"]) == (512, 4)
    assert gpu.tile_meta["SEARCH_STEPS"] == 12  # 1024 entries: 11 steps, rounded up to 4s
    assert (gpu.request_meta["REQ_TILE"], gpu.request_meta["REQ_TILES"]) == (1024, 8)
    assert gpu.request_meta["TILE"] == 512  # the reach, 8192 tokens, is a multiple of it
    assert (gpu.tiles, gpu.tail_tiles) == (18, 18)
    tile = _common.host_tile(9100)
    assert host.tile_meta["TILE"] == tile
    assert host.tile_meta["SEARCH_STEPS"] == 11  # exact: the interpreter compiles nothing
    assert (host.request_meta["REQ_TILE"], host.request_meta["REQ_TILES"]) == (32, 256)
    assert host.request_meta["TILE"] == min(tile, slot_mappings.SMALL_BATCH_TOKENS)
    assert [_common.on_cpu(torch.device(d)) for d in ("cpu", "cuda")] == [True, False]
    assert [_common.search_steps(n) for n in (0, 1, 8, 15, 16, 1024)] == [0, 4, 4, 4, 8, 12]
    assert [_common.is_pow2(n) for n in (0, 1, 2, 3, 4, 6, 8, 12)] == [
        False, True, True, False, True, False, True, False,
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("n", "power"),
    [
        pytest.param(0, 1, id="0-gives-1"),
        pytest.param(1, 1, id="1-itself"),
        pytest.param(2, 2, id="2-itself"),
        pytest.param(3, 4, id="3-gives-4"),
        pytest.param(16, 16, id="16-itself"),
        pytest.param(17, 32, id="17-gives-32"),
    ],
)
def test_next_power_of_2_is_the_smallest_power_of_two_at_least_n(n, power):
    """Tile, gather and pool sizes take the smallest power of two >= n: a power of two is
    itself, not twice itself (a larger one is still correct, only bigger)."""
    assert _common.next_power_of_2(n) == power
    assert _common.host_tile(n) == min(power, _common.HOST_TILE)


@pytest.mark.parametrize(
    ("text", "tile"),
    [
        pytest.param(None, 65536, id="unset-65536"),
        pytest.param("16", 16, id="16"),
        pytest.param("2048", 2048, id="2048"),
        pytest.param("65536", 65536, id="65536"),
    ],
)
def test_the_host_tile_setting_takes_powers_of_two_from_16(monkeypatch, text, tile):
    """`CPBT_HOST_TILE` names the interpreted programs' size (`cp-blocktables mutate` sets 16)."""
    if text is None:
        monkeypatch.delenv(_common.HOST_TILE_ENV, raising=False)
    else:
        monkeypatch.setenv(_common.HOST_TILE_ENV, text)
    assert _common._host_tile_setting() == tile


@pytest.mark.parametrize(
    "text",
    [
        pytest.param("8", id="a-power-of-two-below-16"),
        pytest.param("24", id="24-adjacent-bits"),
        pytest.param("20", id="20-no-adjacent-bits"),
        pytest.param("40", id="40-no-adjacent-bits"),
        pytest.param("0x40", id="not-decimal"),
    ],
)
def test_the_host_tile_setting_refuses_other_sizes(monkeypatch, text):
    """A program's size must be a power of two (`tl.arange` takes no other) and at least 16:
    anything else is refused when the kernels are imported, naming the variable. 20 and 40
    have no two adjacent bits set, which a test of `n & (n >> 1)` would let through."""
    monkeypatch.setenv(_common.HOST_TILE_ENV, text)
    with pytest.raises(
        ValueError, match=rf"CPBT_HOST_TILE must be a power of two >= 16, got '{text}'"
    ):
        _common._host_tile_setting()


@pytest.mark.parametrize("layout", [False, True], ids=["by-tile", "by-request"])
def test_a_gpus_constants_map_as_the_reference_on_cpu(layout):
    """The constants a GPU launches with (512-token tiles, 1024-token request steps, a search
    depth rounded up to a multiple of 4), run by the interpreter: tiles that span several
    entries and searches of the rounded depth, which CPU launches never take otherwise."""
    config = _config(max_num_batched_tokens=1100, max_num_blocks_per_group=[128, 64])
    requests = [(3, 900, 1), (0, 17, 300), (-1, 0, 5), (5, 1000, 400), (1, 0, 1), (7, 511, 250)]
    bt, ref = _build(torch.device("cpu"), config, requests, 1)
    idx, qsl, pos = _batch(requests, bt.num_kv_cache_groups)
    out_len = bt.max_num_batched_tokens
    gpu = slot_mappings._SlotLaunch(False, bt.num_kv_cache_groups, out_len, bt._layout, 1, 8)
    assert gpu.tile_meta["SEARCH_STEPS"] == 4
    if layout:
        programs, meta = gpu.tail_tiles + len(idx) * gpu.num_groups, gpu.request_meta
    else:
        programs, meta = gpu.tiles, gpu.tile_meta
    assert programs > 1
    idx_t, qsl_t, pos_t = (torch.from_numpy(a) for a in (idx, qsl, pos))
    bt.slot_mappings.fill_(GARBAGE)
    slot_mappings._compute_slot_mappings_kernel.launch(
        torch.device("cpu"), (programs,), idx_t, len(idx), 8, qsl_t, pos_t, pos_t.shape[0],
        *bt._slot_plan.tail, **meta,
    )  # fmt: skip
    expected = ref.slot_mappings(idx, qsl, pos, out_len)
    np.testing.assert_array_equal(bt.slot_mappings.numpy(), expected)


@pytest.mark.parametrize(
    ("max_num_reqs", "num_entries", "depth"),
    [
        pytest.param(64, 64, 8, id="64-rows-64-entries"),
        pytest.param(32, 20, 8, id="32-rows-20-entries"),
        pytest.param(16, 16, 8, id="16-rows-16-entries"),
        pytest.param(8, 8, 4, id="8-rows-8-entries"),
    ],
)
def test_a_gpus_search_depth_finds_every_entry_on_cpu(max_num_reqs, num_entries, depth):
    """The GPU's search depth (`max_num_reqs.bit_length()`, 7, 6, 5 or 4 steps, rounded up to
    a multiple of 4), run by the interpreter over one 512-token tile that spans every entry: a
    depth short of `bit_length(num_reqs)` leaves later entries' tokens with an earlier entry's
    row. 64 entries take a seventh step (65 candidates), which a depth of 6 lacks; 16 entries
    a fifth (17 candidates), which a depth of 4 lacks; 8 entries a fourth (9 candidates),
    which a depth of 3 lacks. Positions run up to 30 times the entries (below 2,048)."""
    config = _config(
        max_num_reqs=max_num_reqs, max_num_batched_tokens=600, max_num_blocks_per_group=[128, 64]
    )
    requests = [
        ((7 * b) % max_num_reqs if b % 5 else -1, 30 * b, 1 + b % 3) for b in range(num_entries)
    ]
    bt, ref = _build(torch.device("cpu"), config, requests, 1)
    idx, qsl, pos = _batch(requests, bt.num_kv_cache_groups)
    out_len = bt.max_num_batched_tokens
    gpu = slot_mappings._SlotLaunch(
        False, bt.num_kv_cache_groups, out_len, bt._layout, 1, max_num_reqs
    )
    idx_t, qsl_t, pos_t = (torch.from_numpy(a) for a in (idx, qsl, pos))
    bt.slot_mappings.fill_(GARBAGE)
    slot_mappings._compute_slot_mappings_kernel.launch(
        torch.device("cpu"), (gpu.tiles,), idx_t, len(idx), max_num_reqs, qsl_t, pos_t,
        pos_t.shape[0], *bt._slot_plan.tail, **gpu.tile_meta,
    )  # fmt: skip
    expected = ref.slot_mappings(idx, qsl, pos, out_len)
    np.testing.assert_array_equal(bt.slot_mappings.numpy(), expected)
    assert gpu.tile_meta["SEARCH_STEPS"] == depth


_COMPILED_LAYOUTS = pytest.mark.parametrize(
    ("by_request", "pow2", "pos32"),
    [
        pytest.param(False, True, True, id="by-tile-shifts-int32"),
        pytest.param(True, False, False, id="by-request-divisions-int64"),
    ],
)
"""Two builds of the CUDA slot-mapping kernel that between them take every branch."""


def _compiled_ttir(by_request: bool, pow2: bool, pos32: bool, num_groups: int = 2) -> str:
    """The slot-mapping kernel's TTIR as Triton compiles it for a Hopper GPU (no GPU needed)."""
    kernel = slot_mappings._compute_slot_mappings_kernel._compiled
    signature = {name: "i32" for name in kernel.arg_names}
    signature.update(
        idx_mapping="*i32", query_start_loc="*i32", positions="*i64", table_ptrs="*u64",
        group_params="*i64", out="*i64",
    )  # fmt: skip
    constants = dict(
        NUM_GROUPS=num_groups, SEARCH_STEPS=4, POS32=pos32, POW2=pow2, PAD_ID=-1, TILE=512,
        BY_REQUEST=by_request, REQ_TILE=1024 if by_request else 1, REQ_TILES=8 if by_request else 1,
    )  # fmt: skip
    return hopper_ttir(kernel, signature, constants)


@needs_cuda_backend
@_COMPILED_LAYOUTS
def test_the_compiled_kernel_builds_and_divides_no_flags(by_request, pow2, pos32):
    """What CUDA launches, built on CPU: the interpreter never compiles it. Both device
    functions must be `dual_device_fn`s for it to build at all, and no integer division may
    take a boolean operand: numpy gives `x // False == 0`, so a flag divided by a flag acts
    as `&` in the interpreter, while LLVM folds an i1 division to its dividend (dividing by
    zero is undefined) and drops the divisor's condition on a GPU."""
    ttir = _compiled_ttir(by_request, pow2, pos32)
    assert flag_divisions(ttir) == []


@needs_cuda_backend
@_COMPILED_LAYOUTS
def test_the_compiled_kernel_shifts_no_flags(by_request, pow2, pos32):
    """The builds of the test before: no shift may take a boolean operand either (three back
    ends, three answers: `flag_shifts`)."""
    assert flag_shifts(_compiled_ttir(by_request, pow2, pos32)) == []


@needs_cuda_backend
@pytest.mark.parametrize("by_request", [False, True], ids=["by-tile", "by-request"])
def test_the_compiled_kernel_loops_over_groups_at_run_time(by_request):
    """SPEC.md 1 allows any number of groups. A loop over them unrolled at compile time
    grows the kernel with the groups: for 257 (the harness's many-groups probe) an H100
    took 148 s to build the request layout and 71 s the tile layout, and the probe's
    rank fell past its peers' collective timeout. The build for 257 groups must hold no
    more stores than the build for 2."""
    stores = [
        _compiled_ttir(by_request, True, True, num_groups=n).count("tt.store") for n in (2, 257)
    ]
    assert stores[0] > 0 and stores[1] == stores[0]


@needs_cuda_backend
@_COMPILED_LAYOUTS
def test_the_compiled_kernel_maps_in_integers(by_request, pow2, pos32):
    """The builds of the tests before: no float arithmetic. Token indices and
    `query_start_loc` compare as integers; Triton's `/` divides in float32, which rounds
    token indices past 2**24 (a search bound of `t0 + TILE / 1` can then fall below the
    tile's last token and end the search short of its entry)."""
    floats = re.findall(r"arith\.(?:sitofp|uitofp|cmpf|addf|subf|mulf|divf)\b[^\n]*",
                        _compiled_ttir(by_request, pow2, pos32))  # fmt: skip
    assert floats == []


@needs_cuda_backend
@_COMPILED_LAYOUTS
def test_the_compiled_kernel_loads_under_no_constant_false_mask(by_request, pow2, pos32):
    """The builds of the tests before: every load may read. A load whose mask folds to
    `false` (`mask=lo1 is last`: Triton folds `is` to a constant) reads nothing and gives 0,
    so a search step over it always moves right and its bound never narrows."""
    dead = re.findall(r"tt\.load [^\n]*, %false\b[^\n]*", _compiled_ttir(by_request, pow2, pos32))
    assert dead == []


@pytest.mark.parametrize("cp_rank", [0, 8191])
def test_a_span_past_2_31_through_the_cp_factor_of_one_token_blocks_maps_in_int64(cp_rank):
    """Blocks of one token under CP 8,192: a table of 2**18 + 4 columns spans 2**31 + 2**15
    positions only through the CP factor, so POS32 must not hold, and the rank's positions
    past 2**31 (columns 2**18 on) map to their blocks rather than PAD."""
    width = 2**18 + 4
    config = _config(
        block_sizes=[1], max_num_reqs=1, max_num_batched_tokens=8,
        max_num_blocks_per_group=[width], cp_size=2**13, cp_rank=cp_rank,
    )  # fmt: skip
    bt, ref = _build(torch.device("cpu"), config, [(0, 0, 1)], 1)
    assert not bt._slot_plan.pick.__self__.tile_meta["POS32"]
    near = [cp_rank + j * 2**13 for j in range(4)]
    positions = np.array([*near, *(2**31 + p for p in near)], dtype=np.int64)
    idx, qsl = np.array([0], dtype=np.int32), np.array([0, 8], dtype=np.int32)
    t = torch.from_numpy
    out = bt.compute_slot_mappings(t(idx), t(qsl), t(positions), 8)
    expected = ref.slot_mappings(idx, qsl, positions, 8)
    assert expected[0, 4:].min() > 2**18  # the reference's blocks past 2**31, no PAD
    np.testing.assert_array_equal(out.numpy(), expected)
