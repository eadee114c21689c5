"""The batches of a null-block warm-up on live state: made-up requests naming live blocks.

`warmup_steps` builds them as harness `Step`s (kind "warmup"), so that the
harness's `GroupChecker` checks them as warm-up steps: every gathered id 0,
every slot in block 0.
"""

from __future__ import annotations

import numpy as np

from ..harness import presets
from ..harness.workload import Append, Step, Workload
from .serving import WARMUP_UID_BASE


def warmup_steps(preset: presets.Preset, seed: int, recent_ids: list[list[int]]) -> list[Step]:
    """Three warm-up batches: every row, then a third of them (with a dummy and padding), then
    another third. Each request appends ids from `recent_ids[g]` (live blocks) or, when those
    run out, from the group's id range; tokens sit anywhere in the blocks appended.
    """
    cfg = preset.config(0)
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5EED]))
    groups = range(cfg.num_kv_cache_groups)
    virtual = min((cfg.block_sizes[g] * cfg.group_cp_size(g) for g in groups), default=1)
    most = min([3, *cfg.max_num_blocks_per_group])
    rows = rng.permutation(cfg.max_num_reqs).tolist()
    third = max(1, len(rows) // 3)
    batches = [rows, rows[:third], rows[third : 2 * third] or rows[:1]]
    window = any(w > 0 for w in cfg.sliding_window_reach)
    steps, uid = [], WARMUP_UID_BASE
    for index, batch in enumerate(batches):
        per = max(1, min(8, cfg.max_num_batched_tokens // (len(batch) + 2)))
        entries, appends = [], []
        nct = np.zeros(cfg.max_num_reqs, dtype=np.int32)
        for row in batch:
            uid += 1
            n_blocks = int(rng.integers(1, most + 1))
            ids = tuple(tuple(pick_ids(preset, g, n_blocks, recent_ids, rng)) for g in groups)
            span = n_blocks * virtual
            n = int(rng.integers(1, min(per, span) + 1))
            start = int(rng.integers(0, span - n + 1))
            appends.append(Append(uid, row, ids, True))
            entries.append((uid, row, start, n))
            nct[row] = start
        if index == 1 and len(entries) < cfg.max_num_reqs:
            entries.insert(int(rng.integers(len(entries) + 1)), (-1, -1, 0, 2))
        steps.append(_warmup_step(index, appends, entries, nct if window else None, cfg))
    return steps


def pick_ids(preset, g: int, n: int, recent_ids: list[list[int]], rng) -> list[int]:
    pool = recent_ids[g] if g < len(recent_ids) else []
    if len(pool) >= n:
        return [int(x) for x in rng.choice(pool, n, replace=False)]
    first, count = preset.block_id_range(g)
    return [int(x) for x in rng.integers(first, first + count, n)]


def _warmup_step(index: int, appends: list[Append], entries: list, nct, cfg) -> Step:
    counts = [e[3] for e in entries]
    qsl = np.zeros(len(entries) + 1, dtype=np.int32)
    qsl[1:] = np.cumsum(counts)
    num_tokens = int(qsl[-1])
    padded = min(cfg.max_num_batched_tokens, -(-num_tokens // 8) * 8)
    positions = np.concatenate(
        [np.arange(e[2], e[2] + e[3], dtype=np.int64) for e in entries]
        + [np.zeros(padded - num_tokens, dtype=np.int64)]
    )
    return Step(
        index=index,
        kind="warmup",
        appends=appends,
        idx_mapping=np.array([e[1] for e in entries], dtype=np.int32),
        uids=np.array([e[0] for e in entries], dtype=np.int64),
        query_start_loc=qsl,
        positions=positions,
        num_tokens_padded=padded,
        num_reqs_padded=min(cfg.max_num_reqs, len(entries) + (index == 1)),
        num_computed_tokens=nct,
    )


def workload_of(preset: presets.Preset, steps: list[Step]) -> Workload:
    """Steps made here, as a workload the harness's preset run and checker accept."""
    return Workload(preset, 0, steps, {}, "", [], None, 0)
