"""The request life cycle: requests that start far out (`Preset.far_start`)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cp_blocktables.contract import INT32_MAX
from cp_blocktables.harness import presets
from cp_blocktables.harness.workload import Workload, generate

FAR = presets.PRESETS["cp2-past-2-31"]


def _admitted(w: Workload) -> list:
    return [a for s in w.steps for a in s.admitted]


def _positions_of(w: Workload, uid: int) -> np.ndarray:
    """Every position the workload maps for request `uid`, in step order."""
    out = []
    for s in w.steps:
        if s.kind == "real":
            _, uids = s.token_rows()
            out.append(s.positions[: s.num_tokens][uids == uid])
    return np.concatenate(out)


@pytest.mark.parametrize("seed", range(4))
def test_far_requests_start_below_far_start_and_run_past_it(seed):
    """A prefix-cached request starts at its unseeded prefix, just below `far_start`, and
    its positions run on from there past `far_start`; the others start at 0."""
    w = generate(FAR, seed)
    far = [a for a in _admitted(w) if a.read_from]
    assert far and len(far) < len(_admitted(w))
    for a in _admitted(w):
        pos = _positions_of(w, a.uid)
        if not a.read_from:
            assert a.prefix_len == 0 and pos[0] == 0
            continue
        assert a.read_from == a.prefix_len
        assert FAR.far_start - FAR.max_prompt_len < a.prefix_len <= FAR.far_start
        assert pos[0] == a.prefix_len and pos.max() >= FAR.far_start
        # Rejected drafts are mapped again, but no position is skipped.
        np.testing.assert_array_equal(np.unique(pos), np.arange(a.prefix_len, pos.max() + 1))
    read = [f for s in w.steps for f in s.finished] + w.unfinished
    assert {f.uid: f.read_from for f in read if f.read_from} == {
        a.uid: a.read_from for a in far if a.uid in {f.uid for f in read}
    }


def test_a_far_request_holds_its_row_from_column_0():
    """Its blocks cover every column up to its first chunk's end, as a prefix-cached
    request's do: the table row, not the simulated caches, carries the prefix."""
    w = generate(FAR, 0)
    cfg = FAR.config(0)
    virtual = [cfg.block_sizes[g] * cfg.group_cp_size(g) for g in range(cfg.num_kv_cache_groups)]
    a = next(a for a in _admitted(w) if a.read_from)
    step = next(s for s in w.steps if a in s.admitted)
    mine = [x for x in step.appends if x.uid == a.uid and x.ledger]  # not junk or refused
    held = [sum(len(x.block_ids[g]) for x in mine) for g in range(len(virtual))]
    _, uids = step.token_rows()
    end = int(step.positions[: step.num_tokens][uids == a.uid].max()) + 1
    assert held == [math.ceil(end / v) for v in virtual]


def test_num_computed_tokens_past_2_31_are_passed_clamped_to_int32():
    """`num_computed_tokens` is int32 as engines pass it; a far request's count past
    INT32_MAX is passed as INT32_MAX, which masks nothing without windows."""
    w = generate(FAR, 0)
    rows = [s.nct_rows for s in w.steps if s.kind == "real"]
    assert all(r.dtype == np.int32 for r in rows)
    assert any((r == INT32_MAX).any() for r in rows)
    assert not any(g.window for g in FAR.groups)


def test_without_far_start_no_request_skips_its_seeding():
    for name in presets.SWEEP:
        p = presets.PRESETS[name]
        if not p.far_start:
            assert not any(a.read_from for a in _admitted(generate(p, 0))), name
