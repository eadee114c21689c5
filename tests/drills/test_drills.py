"""The null-block drill: passes on a right implementation, at one size and across a resize,
and fails every wrong one, each run in one world of the plugin's ranks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cp_blocktables.contract import NULL_BLOCK_ID
from cp_blocktables.drills.driver import run_drill_in_process_group
from cp_blocktables.drills.options import DrillOptions, plan
from cp_blocktables.drills.warmup_steps import warmup_steps
from cp_blocktables.harness.impl_loader import DEFAULT_IMPL
from cp_blocktables.harness.presets import PRESETS
from tests.wrong_impls.catalogue import CATALOGUE
from tests.wrong_impls.drill_catalogue import DRILL_CATALOGUE

STAND_IN = "tests.wrong_impls.stand_in:StandInBlockTables"
STAGES = ["serve 1", "warm-up", "serve 2"]


def drill(tmp_path, name: str, **kwargs) -> tuple[int, dict | None]:
    """Run the drill in this rank's process group; rank 0 also returns the JSON report."""
    import torch.distributed as dist

    path = tmp_path / f"{name}.json"
    opts = DrillOptions(report_path=str(path), quiet=True, **kwargs)
    code = run_drill_in_process_group(opts)
    return code, json.loads(path.read_text()) if dist.get_rank() == 0 else None


@pytest.mark.long
@pytest.mark.ranks(4, timeout=300)
def test_our_implementation_passes_the_drill_with_kernel_blocks(rank, tmp_path):
    """`kbs-cp1`: an id appended after the warm-up reads back as its first kernel id `b*m`,
    and the second instance the drill builds takes the preset's kernel block sizes."""
    code, _ = drill(tmp_path, "ours-kbs", impls=[DEFAULT_IMPL], presets=["kbs-cp1"], steps=6)
    assert code == 0


@pytest.mark.ranks(4, timeout=300)
def test_our_implementation_passes_the_drill(rank, tmp_path):
    code, report = drill(tmp_path, "ours", impls=[DEFAULT_IMPL], presets=["default"], steps=6)
    assert code == 0
    if report is None:
        return
    records = report["records"]
    assert [r["stage"] for r in records] == STAGES
    assert all(r["failures"] == [] and r["steps"] > 0 for r in records)
    warm = records[1]
    assert warm["steps"] == 3 and warm["tokens"] > 0
    assert "drain them first" in warm["refusal"]
    assert "24 warm-up rows" in warm["summary"]
    assert report["implementations"][DEFAULT_IMPL]["passed"]


@pytest.mark.ranks(4, timeout=300)
def test_the_drill_passes_while_the_world_shrinks_and_grows(rank, tmp_path):
    code, report = drill(
        tmp_path, "resize", impls=[DEFAULT_IMPL], presets=["cp2-i1"], sizes=[4, 2, 4], steps=4
    )
    assert code == 0
    if report is None:
        return
    runs = {}
    for r in report["records"]:
        assert r["failures"] == [], r
        runs.setdefault((r["era"], r["size"], r["cp_group"]), []).append(r)
    assert sorted(runs) == [(0, 4, 0), (0, 4, 1), (1, 2, 0), (2, 4, 0), (2, 4, 1)]
    assert all([r["stage"] for r in rs] == STAGES for rs in runs.values())
    kept = {key: rs[0]["kept_state"] for key, rs in runs.items()}
    assert kept == {
        (0, 4, 0): False,
        (0, 4, 1): False,
        (1, 2, 0): True,
        (2, 4, 0): True,
        (2, 4, 1): False,
    }
    assert report["sizes"] == [4, 2, 4]


# Size regimes (a request past 8192 tokens, rows past 2048 columns, gathers of 20 such rows)
# take the harness's `large-steps` preset, too slow for a drill on four interpreted ranks;
# token buffers of 1,000 and 4,001 are probed on `groups-1`, gathers of 257 rows of 2,049
# columns on `groups-6`, one request filling a buffer of 64 or 128 tokens on presets of
# such buffers (`cp2-past-2-31` first); `verify` catches them.
SIZE_REGIMES = {
    "tokens_past_tile_dropped",
    "wide_rows_truncated",
    "tail_clear_capped",
    "ours_gather_first_program_rows",
    "ours_short_steps_cut_in_mid_buffers",
    "ours_gather_rows_by_batch",
    "ours_full_buffer_loses_its_last_token",
}
# Missed integrity faults are probed where a preset turns the checks on (`cp2-i1`), none of
# the drill's presets; `verify` catches them.
INTEGRITY = {
    "ours_integrity_never_on",
    "ours_integrity_trusts_device_counts",
    "ours_integrity_names_matching_groups",
    "ours_integrity_names_cut_rows",
    "ours_integrity_null_block_one_slot_long",
    "ours_integrity_names_slots_below_none",
    "ours_integrity_names_every_row_stale",
    "ours_integrity_entry_by_parity",
    "ours_integrity_names_dummy_rows",
    "ours_integrity_stale_cancels",
    "ours_integrity_names_sorted_neighbours",
    "ours_integrity_counts_only_larger_entries",
}
# A CP size or a kernel-block ratio that is no power of two takes the sweep's
# `cp3-no-power-of-two`, exactly two groups its `cp2-past-2-31`, 257 groups and a group of
# one-token blocks beside windows `groups-6`, a sharded group of block size 1
# `cp2-unit-blocks` (its probe of one-token blocks past 2**31 too), positions past 2**30 on
# the int32 path `cp2-below-2-31`, sizes one below a power of two `cp3-all-ones`; `verify`
# catches them.
LAYOUTS = {
    "cp_modulo_as_mask",
    "ours_two_groups_unfused",
    "ours_lengths_by_identity",
    "ours_span_by_power",
    "ours_out_list_by_identity",
    "ours_kernel_ids_by_or",
    "ours_unit_block_masked_unwindowed",
    "ours_int32_path_below_2_30",
    "ours_powers_of_two_by_all_ones",
    "ours_unit_block_span_without_cp",
}
DRILLED = {
    n: entry for n, entry in CATALOGUE.items() if n not in SIZE_REGIMES | INTEGRITY | LAYOUTS
}


@pytest.mark.long
@pytest.mark.ranks(4, timeout=600)
def test_every_wrong_implementation_fails_the_drill(rank, tmp_path):
    """The harness catalogue on the presets that catch all of it; the drill catalogue and the
    correct stand-in on a preset with no harness warm-up step, so that the drill's own checks
    must catch the redirect bugs."""
    harness_specs = [spec for spec, _ in DRILLED.values()]
    code_a, a = drill(
        tmp_path,
        "harness",
        impls=harness_specs,
        presets=["cp1-window", "default", "kbs-cp1"],
        fail_fast=True,
    )
    drill_specs = [STAND_IN, *(spec for spec, _ in DRILL_CATALOGUE.values())]
    code_b, b = drill(tmp_path, "drill", impls=drill_specs, presets=["cp2-i1"], steps=8)
    assert (code_a, code_b) == (1, 1)
    if a is None:
        return
    verdicts = {**a["implementations"], **b["implementations"]}
    assert verdicts[STAND_IN]["passed"], verdicts[STAND_IN]
    missed = {
        name: verdicts[spec]
        for name, (spec, check) in {**DRILLED, **DRILL_CATALOGUE}.items()
        if verdicts[spec]["passed"] or str(check) not in verdicts[spec]["failed_checks"]
    }
    assert missed == {}, f"not caught by the check they break: {missed}"
    for spec, _ in DRILL_CATALOGUE.values():
        assert verdicts[spec]["failed_stage"] == "warm-up", verdicts[spec]


# ---------------------------------------------------------------- no process group needed


@pytest.mark.parametrize("name", ["default", "cp1-window", "cp8-large-ids"])
def test_warmup_steps_cover_every_row_with_ids_of_live_blocks(name):
    preset = PRESETS[name]
    cfg = preset.config(0)
    recent = [
        list(range(preset.block_id_range(g)[0], preset.block_id_range(g)[0] + 40))
        for g in range(len(preset.groups))
    ]
    steps = warmup_steps(preset, 3, recent)
    assert [s.kind for s in steps] == ["warmup"] * 3
    assert sorted(a.row for a in steps[0].appends) == list(range(cfg.max_num_reqs))
    assert -1 in steps[1].idx_mapping and steps[1].num_reqs_padded > steps[1].num_reqs
    for s in steps:
        assert all(a.overwrite for a in s.appends)
        for a in s.appends:
            for g, ids in enumerate(a.block_ids):
                assert set(ids) <= set(recent[g]) and NULL_BLOCK_ID not in ids
        assert s.num_tokens <= s.num_tokens_padded <= cfg.max_num_batched_tokens
        assert len(s.positions) >= s.num_tokens_padded
        rows, _ = s.token_rows()
        for t in np.flatnonzero(rows >= 0):
            blocks = next(a.block_ids for a in s.appends if a.row == rows[t])
            for g, ids in enumerate(blocks):
                assert s.positions[t] < len(ids) * cfg.block_sizes[g] * cfg.group_cp_size(g)
    windowed = any(g.window for g in preset.groups)
    assert (steps[0].num_computed_tokens is not None) == windowed


def test_warmup_steps_without_live_ids_stay_in_each_group_range():
    preset = PRESETS["cp2-i1"]
    for s in warmup_steps(preset, 0, []):
        for a in s.appends:
            for g, ids in enumerate(a.block_ids):
                first, count = preset.block_id_range(g)
                assert all(first <= b < first + count for b in ids)


def test_plan_applies_overrides():
    opts = DrillOptions(impls=[DEFAULT_IMPL], presets=["cp2-i1"], steps=3, cp_interleave=2)
    (p,) = plan(opts, 4)
    assert (p.num_steps, p.cp_interleave, p.cp_size) == (3, 2, 2)
