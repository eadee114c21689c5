"""The seeded workload: deterministic, within the contract's limits, and reaching its corners."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from cp_blocktables import BlockTables
from cp_blocktables.contract import INT32_MAX, NULL_BLOCK_ID, PAD_SLOT_ID
from cp_blocktables.harness import presets
from cp_blocktables.harness.preset_extras import MUTATION_PRESETS
from cp_blocktables.harness.preset_spec import GroupSpec
from cp_blocktables.harness.workload import _Generator, generate
from cp_blocktables.reference import ReferenceBlockTables

PRESET_NAMES = list(presets.PRESETS)
SEEDS = [0, 1, 7]


@pytest.fixture(scope="module", params=PRESET_NAMES)
def preset(request) -> presets.Preset:
    return presets.PRESETS[request.param]


def test_same_seed_gives_the_same_workload(preset):
    a, b = generate(preset, 3), generate(preset, 3)
    assert a.digest == b.digest
    assert [s.positions.tolist() for s in a.steps] == [s.positions.tolist() for s in b.steps]


def test_other_seed_gives_another_workload(preset):
    assert generate(preset, 0).digest != generate(preset, 1).digest


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed{s}")
def test_every_promised_corner_is_reached(preset, seed):
    w = generate(preset, seed)
    assert w.missing_corners() == [], f"{preset.name} seed {seed} misses {w.missing_corners()}"


# (preset, seed) whose first draw misses a promised corner: a soak's fresh seeds hit such
# seeds within rounds, and a correct implementation must not fail for them.
SHORT_FIRST_DRAWS = [("kbs-cp1", 14), ("groups-1", 11), ("cp4-interleave", 7), ("mutation-odd", 7)]


@pytest.mark.parametrize(
    ("name", "seed"), SHORT_FIRST_DRAWS, ids=[f"{n}-seed{s}" for n, s in SHORT_FIRST_DRAWS]
)
def test_a_seed_whose_first_draw_falls_short_still_keeps_every_promise(name, seed):
    preset = presets.PRESETS[name]
    assert _Generator(preset, seed, 0).run().missing_corners() != []  # the case is real
    w = generate(preset, seed)
    assert w.missing_corners() == [] and w.seed == seed
    assert w.digest == generate(preset, seed).digest  # still one workload per seed


def test_a_first_draw_that_reaches_everything_is_kept():
    preset = presets.PRESETS["cp2-i1"]
    assert _Generator(preset, 1, 0).run().missing_corners() == []  # the case is real
    assert generate(preset, 1).digest == _Generator(preset, 1, 0).run().digest


def test_without_reach_one_draw_is_taken_as_it_falls():
    preset = presets.PRESETS["kbs-cp1"]
    w = generate(preset, 14, reach=False)
    assert w.digest == _Generator(preset, 14, 0).run().digest
    assert w.missing_corners() == ["window_boundary"]


@pytest.mark.parametrize("seed_block", range(4), ids=lambda b: f"seeds{8 + 8 * b}-{15 + 8 * b}")
def test_fresh_seeds_keep_every_promise(preset, seed_block):
    """What a soak relies on: any seed, not only the few the sweep uses."""
    for seed in range(8 + 8 * seed_block, 16 + 8 * seed_block):
        missing = generate(preset, seed).missing_corners()
        assert missing == [], f"{preset.name} seed {seed} misses {missing}"


def test_sweep_covers_every_cp_size_and_interleave_range():
    sweep = presets.resolve(["sweep"])
    assert {p.cp_size for p in sweep} >= {1, 2, 4, 8}
    promised = set().union(*(p.corners for p in sweep))
    assert promised == set(presets.CORNERS)


def _shape_ok(step, cfg) -> None:
    assert step.num_tokens <= step.num_tokens_padded <= cfg.max_num_batched_tokens
    assert step.num_reqs <= step.num_reqs_padded <= cfg.max_num_reqs
    assert len(step.positions) >= step.num_tokens_padded
    assert step.query_start_loc[0] == 0 and (np.diff(step.query_start_loc) >= 0).all()
    assert step.idx_mapping.dtype == np.int32 and step.query_start_loc.dtype == np.int32
    rows = step.idx_mapping[step.idx_mapping >= 0]
    assert len(set(rows.tolist())) == len(rows), "a row appears twice in one batch"


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed{s}")
def test_steps_respect_the_contract(preset, seed):
    """Shapes, capacities, block ids, positions inside the table, no block held twice."""
    cfg = preset.config(0)
    widths = cfg.max_num_blocks_per_group
    held: list[dict[int, int]] = [{} for _ in widths]
    blocks: dict[int, list[list[int]]] = {}
    for step in generate(preset, seed).steps:
        if step.kind == "dummy":
            continue
        _shape_ok(step, cfg)
        for rel in step.releases:
            for b in rel.block_ids:
                assert held[rel.group].pop(b) == rel.uid
        for a in step.appends:
            if step.kind == "warmup" or not a.ledger:
                continue
            if a.overwrite:
                blocks[a.uid] = [[] for _ in widths]
            for g, ids in enumerate(a.block_ids):
                for b in ids:
                    assert NULL_BLOCK_ID < b <= INT32_MAX
                    assert b not in held[g], f"block {b} of group {g} handed out twice"
                    held[g][b] = a.uid
                blocks[a.uid][g].extend(ids)
                assert len(blocks[a.uid][g]) <= widths[g]
        if step.kind == "real":
            _positions_covered(step, cfg, blocks)


def _positions_covered(step, cfg, blocks) -> None:
    rows, uids = step.token_rows()
    for t in np.flatnonzero(uids >= 0).tolist():
        p = int(step.positions[t])
        for g in range(cfg.num_kv_cache_groups):
            virtual = cfg.block_sizes[g] * cfg.group_cp_size(g)
            assert p // virtual < len(blocks[int(uids[t])][g]), "position past the request's blocks"


def test_window_frees_only_blocks_wholly_below_the_window():
    p = presets.PRESETS["cp1-window"]
    cfg = p.config(0)
    reach = cfg.effective_sliding_window_reach()
    freed = 0
    for step in generate(p, 0).steps:
        for rel in step.releases:
            if rel.reason != "window":
                continue
            freed += len(rel.columns)
            batch = np.flatnonzero(step.uids == rel.uid)
            if batch.size == 0:  # not scheduled this step: its blocks are not gathered
                continue
            nct = int(step.nct_rows[step.idx_mapping[batch[0]]])
            for j in rel.columns:
                assert (j + 1) * cfg.block_sizes[rel.group] <= nct - reach[rel.group]
    assert freed > 0


def test_no_window_frees_under_cp():
    p = presets.PRESETS["default"]
    assert any(g.window for g in p.groups) and p.cp_size > 1
    releases = [r for s in generate(p, 0).steps for r in s.releases]
    assert releases and all(r.reason == "finished" for r in releases)


def test_large_id_presets_pass_2_31():
    for name in ("cp1-window", "cp8-large-ids"):
        p = presets.PRESETS[name]
        biggest = p.block_id_base * min(p.block_sizes)
        assert biggest >= 2**31, name
        assert generate(p, 0).corners["slot_past_2_31"] > 0


@pytest.mark.parametrize(
    "name", [n for n, p in presets.PRESETS.items() if "null_block_id" in p.corners]
)
def test_a_warmup_appends_the_null_block_and_the_top_id(name):
    """The warm-up's first row starts with each group's largest legal id, its second with
    the null block's id 0 (`top_block_id`, `null_block_id`): both must be accepted."""
    p = presets.PRESETS[name]
    w = generate(p, 0)
    warmup = next(s for s in w.steps if s.kind == "warmup")
    first, second = warmup.appends[:2]
    assert [ids[0] for ids in first.block_ids] == [
        2**31 // p.kernel_factor(g) - 1 for g in range(len(p.groups))
    ]
    assert [ids[0] for ids in second.block_ids] == [NULL_BLOCK_ID] * len(p.groups)
    assert w.corners["null_block_id"] == w.corners["top_block_id"] > 0


def _int32_positions(preset: presets.Preset) -> bool:
    """Whether the project's slot mapping computes `preset`'s positions in int32 (`POS32`)."""
    cfg = preset.config(0)
    kwargs = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init}
    bt = BlockTables(device=torch.device("cpu"), **kwargs)
    return bt._slot_plan.pick.__self__.tile_meta["POS32"]


@pytest.mark.parametrize("name", [*presets.SWEEP, *(p.name for p in MUTATION_PRESETS)])
def test_span_corner_is_counted_where_the_kernels_leave_int32_positions(name):
    """`span_past_2_31` is counted, and promised, exactly by the presets whose tables make
    the slot mapping compute positions in int64 (the sweep's two, `preset_span`, promise
    every corner)."""
    p = presets.PRESETS[name]
    int64 = not _int32_positions(p)
    assert (generate(p, 0).corners["span_past_2_31"] > 0) == int64
    assert ("span_past_2_31" in p.corners) == int64


_NEAR = 2**31 - 2**20  # a max_model_len whose tables of 2**20-token blocks stop short of 2**31
# (id, cp size, groups, max_model_len, groups whose own table spans >= 2**31, POS32)
SPAN_CASES = [
    ("cp-factor-makes-it", 2, (GroupSpec(2**20),), 2**31, 1, False),
    ("kernel-blocks", 1, (GroupSpec(2**21, kernel_block_size=2**19),), 2**31, 1, False),
    ("just-short", 1, (GroupSpec(2**20),), _NEAR, 0, True),
    ("one-wide-one-short", 1, (GroupSpec(2**21), GroupSpec(2**20)), _NEAR, 1, False),
    ("two-wide", 2, (GroupSpec(2**20), GroupSpec(2**21, sharded=False)), 2**31, 2, False),
    # The kernels take the int64 path, but no token is mapped through the wide table.
    ("wide-disabled", 1, (GroupSpec(2**21, enabled=False), GroupSpec(2**20)), _NEAR, 0, False),
]


@pytest.mark.parametrize(
    ("cp", "groups", "model_len", "wide", "pos32"),
    [c[1:] for c in SPAN_CASES],
    ids=[c[0] for c in SPAN_CASES],
)
def test_span_corner_counts_each_token_mapped_in_a_table_spanning_2_31(
    cp, groups, model_len, wide, pos32
):
    """A table's span is counted as the kernels' layout computes it: columns in kernel
    blocks, times the kernel block size, times the group's CP size."""
    p = dataclasses.replace(
        presets.PRESETS["cp8-span-2-31"],
        groups=groups,
        cp_size=cp,
        max_model_len=model_len,
        num_steps=6,
        corners=frozenset(),
    )
    p.validate()
    assert _int32_positions(p) == pos32
    w = generate(p, 0)
    assert w.num_real_tokens > 0
    assert w.corners["span_past_2_31"] == wide * w.num_real_tokens


def _small_slots_beside_pad(preset: presets.Preset, workload) -> int:
    """`small_slot_beside_pad` recounted from the steps alone: each rank's tables rebuilt
    from the appends by the reference, its slot mapping of every real step, and each
    token `t < 2` without a slot where a live slot (past the null block) equals `2 - t`."""
    refs = [ReferenceBlockTables(preset.config(k)) for k in range(preset.cp_size)]
    count = 0
    for step in workload.steps:
        if step.kind == "dummy":
            continue
        for ref in refs:
            ref.redirect_writes_to_null_block = step.kind == "warmup"
            for a in step.appends:
                if not a.expect_error:
                    ref.append_block_ids(a.row, a.block_ids, a.overwrite)
        if step.kind == "warmup":
            continue
        for g, size in enumerate(preset.block_sizes):
            for ref in refs[: preset.group_cp_size(g)]:
                qsl, n = step.query_start_loc, step.num_tokens
                row = ref.slot_mappings(step.idx_mapping, qsl, step.positions, n)[g]
                live = row[row >= size]
                count += sum(
                    bool(row[t] == PAD_SLOT_ID and (live == 2 - t).any()) for t in range(min(2, n))
                )
    return count


# (id, the group added to cp2-i1's first four, whether the corner is reached)
SMALL_SLOT_CASES = [
    ("cp2-i1-as-is", None, True),
    ("block-size-1-ids-from-1", GroupSpec(1, first_block_id=1), True),
    ("block-size-2-ids-far-above", GroupSpec(2), False),
    ("block-size-3-ids-from-1", GroupSpec(3, first_block_id=1), False),
    ("disabled", GroupSpec(2, enabled=False, first_block_id=1), False),
]


@pytest.mark.parametrize(
    ("group", "reached"), [c[1:] for c in SMALL_SLOT_CASES], ids=[c[0] for c in SMALL_SLOT_CASES]
)
@pytest.mark.parametrize("seed", [0, 1])
def test_small_slot_corner_counts_what_the_reference_writes(group, reached, seed):
    """Slots 1 and 2 exist only in a group of block size 1 or 2 whose ids start at 1; the
    corner counts, per rank, a token 0 or 1 without a slot beside live slot 2 or 1."""
    p = presets.PRESETS["cp2-i1"]
    if group is not None:
        p = dataclasses.replace(p, groups=(*p.groups[:4], group))
        p.validate()
    w = generate(p, seed, reach=False)
    assert w.corners["small_slot_beside_pad"] == _small_slots_beside_pad(p, w)
    assert (w.corners["small_slot_beside_pad"] > 0) == reached


def test_bench_preset_fills_64k_tokens_per_step():
    w = generate(presets.PRESETS["bench-64k"], 0)
    assert min(s.num_tokens for s in w.steps) >= 60_000


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_batch_reqs": 99}, "max_batch_reqs"),
        ({"max_model_len": 64}, "max_model_len"),
        ({"block_id_base": 2**31 - 5}, "block ids"),
        ({"groups": (GroupSpec(2, first_block_id=2**31 - 8),)}, "block ids of group 0"),
        (
            {"block_id_base": 10, "groups": (GroupSpec(8), GroupSpec(2, first_block_id=12))},
            "groups 0 and 1",
        ),
        ({"corners": frozenset({"nope"})}, "unknown"),
        ({"far_start": 2**31}, "far_start 2147483648 plus the longest request"),
    ],
    ids=[
        "batch",
        "model_len",
        "ids",
        "group-ids",
        "ids-overlap",
        "corner",
        "far-start-past-model-len",
    ],
)
def test_bad_preset_is_refused(overrides, message):
    import dataclasses

    bad = dataclasses.replace(presets.PRESETS["cp2-i1"], **overrides)
    with pytest.raises(ValueError, match=message):
        bad.validate()


def test_far_start_with_a_window_is_refused():
    """`num_computed_tokens` is int32: a far start's count is clamped, which a window reads."""
    p = presets.PRESETS["cp1-window"]
    assert any(g.window for g in p.groups)
    bad = dataclasses.replace(p, far_start=1)
    with pytest.raises(ValueError, match="far_start with a sliding window"):
        bad.validate()


def test_resolve_expands_aliases_and_refuses_unknown_names():
    assert [p.name for p in presets.resolve(["sweep"])] == list(presets.SWEEP)
    assert [p.name for p in presets.resolve(["default", "default"])] == ["default"]
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        presets.resolve(["nope"])


def test_table_width_covers_the_longest_request(preset):
    for g, w in enumerate(preset.max_num_blocks_per_group()):
        virtual = preset.block_sizes[g] * preset.group_cp_size(g)
        assert w == math.ceil(preset.max_model_len / virtual)


@pytest.mark.parametrize("name", ["mutation", "default", "cp2-i1"])
def test_dummy_runs_pass_the_whole_token_budget_and_none(name):
    """A profiling run passes `max_num_batched_tokens` to `get_dummy_slot_mappings`, and a
    dummy run may pass 0: both ends are reached, and the corners count exactly those runs."""
    p = presets.PRESETS[name]
    w = generate(p, 0)
    top = p.config(0).max_num_batched_tokens
    counts = [s.dummy_num_tokens for s in w.steps if s.kind == "dummy"]
    assert all(0 <= n <= top for n in counts)
    assert w.corners["dummy_full_tokens"] == counts.count(top) > 0
    assert w.corners["dummy_zero_tokens"] == counts.count(0) > 0
