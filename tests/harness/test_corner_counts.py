"""Corner counts: positions past 2**31, block size 1 under CP, gathers of many wide rows."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cp_blocktables.harness import presets
from cp_blocktables.harness.preset_spec import GroupSpec
from cp_blocktables.harness.workload import Workload, generate

FAR = presets.PRESETS["cp2-past-2-31"]
BELOW = presets.PRESETS["cp2-below-2-31"]


def _tokens_past(w: Workload, bound: int = 2**31) -> int:
    """Real tokens at positions >= `bound`, counted from the steps themselves."""
    n = 0
    for s in w.steps:
        if s.kind == "real":
            _, uids = s.token_rows()
            n += int((s.positions[: s.num_tokens][uids >= 0] >= bound).sum())
    return n


def _bare_and_full_spans(p: presets.Preset) -> tuple[int, int]:
    """The widest table's positions without and with its CP factor (columns in kernel
    blocks times the kernel block size, as the kernels' layout counts them)."""
    cfg = p.config(0)
    groups = range(cfg.num_kv_cache_groups)
    bare = [cfg.table_width(g) * cfg.kernel_block_sizes[g] for g in groups]
    return max(bare), max(b * cfg.group_cp_size(g) for g, b in zip(groups, bare))


@pytest.mark.parametrize("seed", range(4))
def test_position_past_2_31_counts_each_real_token_there(seed):
    w = generate(FAR, seed)
    assert w.corners["position_past_2_31"] == _tokens_past(w) > 0
    assert w.corners["past_2_31_by_cp"] == w.corners["position_past_2_31"]


def test_the_far_preset_spans_2_31_only_with_its_cp_factor():
    """So a span computed without the CP factor takes the int32 path, which maps every
    position past 2**31 to PAD."""
    bare, full = _bare_and_full_spans(FAR)
    assert bare + FAR.cp_size < 2**31 <= full
    assert all(g.sharded for g in FAR.groups)


def test_an_unsharded_table_spanning_2_31_alone_is_not_by_cp():
    """An unsharded group needs a table spanning every position on its own."""
    p = dataclasses.replace(
        FAR, groups=(*FAR.groups, GroupSpec(2**21, sharded=False)), corners=frozenset()
    )
    p.validate()
    assert _bare_and_full_spans(p)[0] >= 2**31
    w = generate(p, 0)
    assert w.corners["position_past_2_31"] == _tokens_past(w) > 0
    assert w.corners["past_2_31_by_cp"] == 0


def test_only_far_presets_count_or_promise_positions_past_2_30():
    far_corners = {"position_past_2_31", "past_2_30_int32"}
    for name, p in presets.PRESETS.items():
        assert bool(far_corners & p.corners) == bool(p.far_start), name
        if not p.far_start:
            c = generate(p, 0, reach=False).corners
            assert c["position_past_2_31"] == c["past_2_30_int32"] == 0, name
    assert {"cp2-past-2-31", "cp2-below-2-31"} <= set(presets.SWEEP)


@pytest.mark.parametrize("seed", range(4))
def test_past_2_30_int32_counts_each_real_token_from_2_30_on(seed):
    w = generate(BELOW, seed)
    assert w.corners["past_2_30_int32"] == _tokens_past(w, 2**30) > 0
    assert w.corners["position_past_2_31"] == 0


def test_the_below_preset_spans_just_under_2_31():
    """So a slot mapping may take the int32 path, and must still map positions up to the
    span, past 2**30."""
    _, full = _bare_and_full_spans(BELOW)
    assert BELOW.far_start > 2**30
    assert BELOW.max_model_len <= full < 2**31


def test_tokens_past_2_30_in_tables_spanning_2_31_are_not_on_the_int32_path():
    w = generate(FAR, 0)
    assert _tokens_past(w, 2**30) > 0
    assert w.corners["past_2_30_int32"] == 0


def test_far_steps_pass_no_position_past_max_model_len():
    for seed in range(4):
        w = generate(FAR, seed)
        for s in w.steps:
            if s.kind == "real":
                _, uids = s.token_rows()
                assert (s.positions[: s.num_tokens][uids >= 0] < FAR.max_model_len).all()


# ------------------------------------------------- block size 1 under CP, gathers of many rows

UNIT = presets.PRESETS["cp2-unit-blocks"]
LARGE = presets.PRESETS["large-steps"]


def _tokens_past_unit_width(w: Workload, p: presets.Preset) -> int:
    """Real tokens at positions at or past the width of each sharded group of block size 1,
    counted from the steps themselves."""
    cfg = p.config(0)
    widths = [
        cfg.table_width(g)
        for g, spec in enumerate(p.groups)
        if spec.block_size == 1 and spec.sharded and spec.enabled
    ]
    n = 0
    for s in w.steps:
        if s.kind == "real":
            _, uids = s.token_rows()
            pos = s.positions[: s.num_tokens][uids >= 0]
            n += sum(int((pos >= width).sum()) for width in widths)
    return n


@pytest.mark.parametrize("seed", range(3))
def test_unit_block_past_width_counts_each_token_only_the_virtual_block_reaches(seed):
    w = generate(UNIT, seed)
    assert w.corners["unit_block_past_width"] == _tokens_past_unit_width(w, UNIT) > 0


@pytest.mark.parametrize(
    "group",
    [GroupSpec(1, sharded=False), GroupSpec(2), GroupSpec(1, enabled=False)],
    ids=["unsharded", "block-size-2", "disabled"],
)
def test_only_a_sharded_group_of_block_size_1_counts_past_its_width(group):
    """Past an unsharded group's width lies past its table; a block of 2 slots or more
    tells the product from the power at CP 2; a disabled group maps nothing."""
    p = dataclasses.replace(UNIT, groups=(group, *UNIT.groups[1:]), corners=frozenset())
    assert generate(p, 0).corners["unit_block_past_width"] == 0


@pytest.mark.parametrize("seed", range(3))
def test_wide_gather_counts_each_step_of_more_than_16_rows_of_wide_tables(seed):
    w = generate(LARGE, seed)
    cfg = LARGE.config(0)
    assert max(cfg.table_width(g) for g in range(len(LARGE.groups))) > 2048
    wide = sum(s.num_reqs_padded > 16 for s in w.steps)
    assert w.corners["wide_gather"] == wide > 0


def test_a_gather_of_16_rows_is_not_wide():
    """16 rows of 4,096 columns fill one program of the interpreter's 65,536 entries."""
    p = dataclasses.replace(LARGE, max_num_reqs=16, max_batch_reqs=16, corners=frozenset())
    assert generate(p, 0).corners["wide_gather"] == 0


ALL_ONES = presets.PRESETS["cp3-all-ones"]


def _all_ones(p: presets.Preset) -> bool:
    """Every kernel block size, group CP size and the interleave is one below a power of two."""
    cfg = p.config(0)
    groups = range(cfg.num_kv_cache_groups)
    sizes = [*cfg.kernel_block_sizes, *(cfg.group_cp_size(g) for g in groups), p.cp_interleave]
    return bool(cfg.num_kv_cache_groups) and all((x + 1) & x == 0 for x in sizes) and max(sizes) > 1


@pytest.mark.parametrize("seed", range(4))
def test_all_ones_sizes_counts_every_real_token_of_such_a_layout(seed):
    w = generate(ALL_ONES, seed)
    real = sum(int((s.token_rows()[1] >= 0).sum()) for s in w.steps if s.kind == "real")
    assert w.corners["all_ones_sizes"] == real > 0


def test_only_the_all_ones_preset_has_such_a_layout_and_promises_it():
    for name, p in presets.PRESETS.items():
        assert _all_ones(p) == (name == "cp3-all-ones") == ("all_ones_sizes" in p.corners), name
        if not _all_ones(p):
            assert generate(p, 0, reach=False).corners["all_ones_sizes"] == 0, name
    assert "cp3-all-ones" in presets.SWEEP


@pytest.mark.parametrize("name", ["groups-1", "kbs-cp4"])
def test_a_full_step_can_end_with_its_last_token_alone(name):
    """Counted where the buffer is full and its last token is the whole last entry, which the
    generator then moves to the end of the batch."""
    p = presets.PRESETS[name]
    w = generate(p, 0)
    found = 0
    for s in w.steps:
        if s.kind != "real" or s.num_tokens != p.max_num_batched_tokens:
            continue
        counts = np.diff(s.query_start_loc)
        last = np.flatnonzero(counts)[-1]  # a dummy of no tokens may follow
        found += bool(counts[last] == 1 and s.uids[last] >= 0)
    assert w.corners["full_step_one_token_last"] == found > 0
