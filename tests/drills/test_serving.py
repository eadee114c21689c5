"""The simulated serving state: request pool, KV caches written through slots, tags."""

from __future__ import annotations

import numpy as np
import pytest

from cp_blocktables.contract import PAD_SLOT_ID
from cp_blocktables.drills.serving import (
    WARMUP_UID_BASE,
    KVCache,
    RequestPool,
    ServingState,
    describe_tag,
    kv_tag,
)
from cp_blocktables.harness.presets import PRESETS
from cp_blocktables.harness.workload import generate


@pytest.fixture
def pool() -> RequestPool:
    p = RequestPool(4)
    p.admit(11, 2)
    return p


def test_pool_admits_finishes_and_drains(pool):
    pool.admit(12, 0)
    assert pool.serving() == {0: 12, 2: 11}
    assert pool.free_rows() == [1, 3]
    assert pool.finish(11) == 2
    assert pool.drain() == [12]
    assert pool.serving() == {} and pool.free_rows() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        pytest.param(
            lambda p: p.admit(12, 2), RuntimeError, "row 2 is held by request 11", id="held"
        ),
        pytest.param(lambda p: p.admit(12, 4), ValueError, r"row 4 outside \[0, 4\)", id="row"),
        pytest.param(
            lambda p: p.finish(99), KeyError, "request 99 is not in the pool", id="unknown"
        ),
        pytest.param(
            lambda p: p.admit_warmup(5, 0), RuntimeError, "not open for a warm-up", id="closed"
        ),
    ],
)
def test_pool_refuses_and_changes_nothing(pool, call, error, message):
    before = pool.snapshot()
    with pytest.raises(error, match=message):
        call(pool)
    assert pool.snapshot() == before


def test_warmup_requests_take_free_rows_and_close_restores(pool):
    saved = pool.open_for_warmup()
    pool.admit_warmup(100, 0)
    pool.admit_warmup(101, 3)
    with pytest.raises(RuntimeError, match="no serving request may start during a warm-up"):
        pool.admit(13, 1)
    with pytest.raises(RuntimeError, match="row 2 is held by request 11"):
        pool.admit_warmup(102, 2)
    assert pool.free_rows() == [1]
    pool.close_warmup(saved)
    assert pool.snapshot() == saved
    assert pool.free_rows() == [0, 1, 3]


def test_tags_name_rank_request_and_position():
    tags = kv_tag(3, np.array([7, 0]), np.array([40, 5]))
    assert (tags != 0).all()
    assert describe_tag(int(tags[0])) == "rank 3, request 7, position 40"
    assert describe_tag(int(tags[1])) == "rank 3, no request, position 5"
    assert describe_tag(0) == "zero"
    assert describe_tag(int(kv_tag(0, [WARMUP_UID_BASE + 4], [2])[0])) == (
        "rank 0, warm-up request 4, position 2"
    )


@pytest.fixture
def cache() -> KVCache:
    return KVCache(block_size=4, first_block=2**31 - 8, num_blocks=3)


def test_cache_writes_through_slots_with_the_null_block_first(cache):
    first = cache.first_block
    slots = np.array([first * 4 + 1, PAD_SLOT_ID, (first + 2) * 4 + 3, 2, 99 * 4])
    outside = cache.write(slots, np.array([10, 20, 30, 40, 50]))
    assert outside == 1  # block 99 is not in this cache
    assert cache.data[1, 1] == 10 and cache.data[3, 3] == 30 and cache.data[0, 2] == 40
    assert int(cache.data.sum()) == 80
    assert cache.rows_for(np.array([0, first, first + 2, first + 3, 1])).tolist() == [
        0,
        1,
        3,
        -1,
        -1,
    ]
    assert not cache.null_block_is_zero()


@pytest.fixture
def state() -> ServingState:
    return ServingState(object(), PRESETS["cp2-i1"], rank=1)


def test_live_blocks_exclude_the_null_block_and_detect_change(state):
    cache = state.caches[0]
    first, bs = cache.first_block, cache.block_size
    cache.write(np.array([first * bs, 1]), np.array([5, 6]))
    live = state.live()
    assert live[0].rows.tolist() == [1] and all(len(x.rows) == 0 for x in live[1:])
    assert state.changed_blocks(live) == []
    cache.write(np.array([3]), np.array([7]))  # block 0 again: not live
    assert state.changed_blocks(live) == []
    cache.write(np.array([first * bs + 2]), kv_tag(1, np.array([9]), np.array([33])))
    (change,) = state.changed_blocks(live)
    assert change == {
        "group": 0,
        "block": first,
        "offset": 2,
        "before": "zero",
        "after": "rank 1, request 9, position 33",
    }


@pytest.mark.parametrize("name", ["default", "cp1-window", "cp8-large-ids"])
def test_every_block_the_workload_hands_out_has_a_cache_row(name):
    preset = PRESETS[name].with_overrides(num_steps=12)
    workload = generate(preset, 0)
    for g in range(len(preset.groups)):
        first, count = preset.block_id_range(g)
        ids = [
            b
            for s in workload.steps
            if s.kind == "real"
            for a in s.appends
            if not a.expect_error  # refused by contract: its ids are never held
            for b in a.block_ids[g]
        ]
        assert ids and min(ids) >= first and max(ids) < first + count


def test_serving_state_writes_every_group_through_its_own_slots(state):
    first = [(c.first_block, c.block_size) for c in state.caches]
    slots = np.array([[b * bs + 1, PAD_SLOT_ID] for b, bs in first])  # [groups, 2]
    state.write_kv(slots, np.array([4, 0]), np.array([17, 1]))
    assert state.writes == len(first) and state.writes_outside == 0
    for cache in state.caches:
        assert describe_tag(int(cache.data[1, 1])) == "rank 1, request 4, position 17"
    assert [len(x.rows) for x in state.live()] == [1] * len(first)
    assert [t.data_ptr() for t in state.kv_tensors()] == [c.data.data_ptr() for c in state.caches]


def test_the_serving_state_knows_each_live_rows_ids():
    st = ServingState(object(), PRESETS["cp1-window"], 0)
    pad = [[] for _ in st.caches[2:]]
    st.pool.admit(5, 2)
    st.note_append(5, 2, ([10, 11], [20], *pad), True)
    st.note_append(5, 2, ([12], [], *pad), False)
    st.pool.admit(6, 3)  # admitted, nothing appended yet: not re-appended
    st.note_append(4, 1, ([1], [2], *pad), True)  # row 1's request is not serving
    assert st.live_rows() == [(2, 5, [[10, 11, 12], [20], *pad])]
    st.pool.finish(5)
    st.pool.admit(7, 2)
    st.note_append(7, 2, ([30], [31], *pad), True)
    assert st.live_rows() == [(2, 7, [[30], [31], *pad])]
