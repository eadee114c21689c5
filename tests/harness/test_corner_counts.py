"""Corner counts past 2**31: `position_past_2_31` and `past_2_31_by_cp`."""

from __future__ import annotations

import dataclasses

import pytest

from cp_blocktables.harness import presets
from cp_blocktables.harness.preset_spec import GroupSpec
from cp_blocktables.harness.workload import Workload, generate

FAR = presets.PRESETS["cp2-past-2-31"]


def _tokens_past_2_31(w: Workload) -> int:
    """Real tokens at positions >= 2**31, counted from the steps themselves."""
    n = 0
    for s in w.steps:
        if s.kind == "real":
            _, uids = s.token_rows()
            n += int((s.positions[: s.num_tokens][uids >= 0] >= 2**31).sum())
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
    assert w.corners["position_past_2_31"] == _tokens_past_2_31(w) > 0
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
    assert w.corners["position_past_2_31"] == _tokens_past_2_31(w) > 0
    assert w.corners["past_2_31_by_cp"] == 0


def test_only_far_presets_count_or_promise_positions_past_2_31():
    for name, p in presets.PRESETS.items():
        far = bool(p.far_start)
        assert ("position_past_2_31" in p.corners) == far, name
        if not p.far_start:
            assert generate(p, 0, reach=False).corners["position_past_2_31"] == 0, name
    assert "cp2-past-2-31" in presets.SWEEP


def test_far_steps_pass_no_position_past_max_model_len():
    for seed in range(4):
        w = generate(FAR, seed)
        for s in w.steps:
            if s.kind == "real":
                _, uids = s.token_rows()
                assert (s.positions[: s.num_tokens][uids >= 0] < FAR.max_model_len).all()
