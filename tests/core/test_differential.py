"""Seeded randomized differential tests of every kernel against the numpy reference.

Each seed draws a configuration (groups, block sizes, CP layout, flags) and a
few steps of appends, gathers and slot mappings; every output is compared in
full with `cp_blocktables.reference`. A failing case names its seed in the id
and in the assertion message: rerun it with `-k "seed-N"`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cp_blocktables import NULL_BLOCK_ID

SEEDS = range(24)


def random_config(rng: np.random.Generator) -> dict:
    num_groups = int(rng.integers(1, 5))
    cp_size = int(rng.choice([1, 1, 2, 3, 4, 8]))
    block_sizes = [int(rng.choice([1, 2, 4, 8, 12, 16, 64])) for _ in range(num_groups)]
    sharded = [bool(rng.random() < 0.7) for _ in range(num_groups)]
    # The interleave must divide every sharded group's block size.
    limit = min([bs for bs, s in zip(block_sizes, sharded) if s] or [16])
    interleave = int(rng.choice([i for i in (1, 2, 3, 4, 8, 16, 64) if limit % i == 0]))
    return dict(
        block_sizes=block_sizes,
        max_num_reqs=int(rng.integers(1, 9)),
        max_num_batched_tokens=int(rng.choice([16, 200, 1500])),
        max_num_blocks_per_group=[int(rng.integers(1, 40)) for _ in range(num_groups)],
        cp_size=cp_size,
        cp_rank=int(rng.integers(cp_size)),
        cp_interleave=interleave,
        slot_mapping_enabled=[bool(rng.random() < 0.85) for _ in range(num_groups)],
        dcp_sharded=sharded,
        sliding_window_reach=[int(rng.choice([0, 3, 17, 64])) for _ in range(num_groups)],
    )


def random_batch(rng, p, cfg: dict):
    """A batch of distinct rows (and dummies) with positions inside every enabled group's rows."""
    bt = p.bt
    num_reqs = int(rng.integers(0, cfg["max_num_reqs"] + 1))
    rows = rng.permutation(cfg["max_num_reqs"])[:num_reqs]
    idx = np.where(rng.random(num_reqs) < 0.2, -1, rows)
    budget = cfg["max_num_batched_tokens"]
    lens = rng.integers(0, max(1, budget // max(1, num_reqs)) + 1, size=num_reqs)
    lens = np.minimum(lens, np.maximum(budget - np.cumsum(lens) + lens, 0))
    qsl = np.concatenate([[0], np.cumsum(lens)])
    positions = []
    for b, r in enumerate(idx):
        # Highest position any enabled group's appended blocks cover for this row.
        if r < 0:
            positions.append(rng.integers(0, 1000, size=lens[b]))
            continue
        span = min(
            [
                int(p.ref.num_blocks[g, r])
                * cfg["block_sizes"][g]
                * (cfg["cp_size"] if cfg["dcp_sharded"][g] else 1)
                for g in range(bt.num_kv_cache_groups)
                if cfg["slot_mapping_enabled"][g]
            ]
            or [1000]
        )
        positions.append(
            rng.integers(0, max(span, 1), size=lens[b]) if span else np.zeros(0, dtype=np.int64)
        )
        if span == 0:
            lens[b] = 0
    qsl = np.concatenate([[0], np.cumsum(lens)])
    positions = np.concatenate(positions + [np.zeros(0)]).astype(np.int64)
    return idx.astype(np.int32), qsl.astype(np.int32), positions


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed-{s}")
def test_random_steps_match_reference(pair, torch_device, seed):
    rng = np.random.default_rng(seed)
    cfg = random_config(rng)
    p = pair(**cfg)
    bt, ref = p.bt, p.ref
    rows_written = 0
    for step in range(4):
        where = f"seed {seed}, step {step}, config {cfg}"
        for r in range(cfg["max_num_reqs"]):
            if rng.random() < 0.5:
                continue
            overwrite = bool(rng.random() < 0.3)
            ids = []
            for g, cap in enumerate(cfg["max_num_blocks_per_group"]):
                room = cap - (0 if overwrite else int(ref.num_blocks[g, r]))
                n = int(rng.integers(0, room + 1))
                ids.append([int(x) for x in rng.integers(1, 2**31 - 1, size=n)])
            p.append(r, tuple(ids), overwrite)
        bt.apply_staged_writes()
        for g in range(bt.num_kv_cache_groups):
            np.testing.assert_array_equal(
                bt.block_tables[g].gpu.cpu().numpy(), ref.tables[g], err_msg=where
            )
        np.testing.assert_array_equal(
            bt.num_blocks.gpu.cpu().numpy(), ref.num_blocks, err_msg=where
        )

        idx, qsl, positions = random_batch(rng, p, cfg)
        num_tokens = int(qsl[-1])
        padded = int(rng.integers(num_tokens, cfg["max_num_batched_tokens"] + 1))
        p.slots(idx, qsl, positions, padded)

        # Computed-token counts near some group's window boundary, where an
        # off-by-one in the masking shows.
        g = rng.integers(len(cfg["block_sizes"]), size=cfg["max_num_reqs"])
        bs = np.asarray(cfg["block_sizes"])[g]
        reach = np.asarray(cfg["sliding_window_reach"])[g]
        nct = reach + bs * rng.integers(0, 12, size=g.size) + rng.integers(-1, 2, size=g.size)
        nct = np.maximum(nct, 0).astype(np.int32)
        use_nct = bool(rng.random() < 0.7)
        num_reqs_padded = int(rng.integers(len(idx), cfg["max_num_reqs"] + 1))
        num_rows = max(num_reqs_padded, rows_written)
        rows_written = num_reqs_padded
        out = p.gather(
            idx, num_reqs_padded, num_rows=num_rows, num_computed_tokens=nct if use_nct else None
        )
        assert all(len(t) == num_reqs_padded for t in out), where

        if rng.random() < 0.2:
            bt.get_dummy_block_tables(int(rng.integers(0, cfg["max_num_reqs"] + 1)))
            rows_written = 0
            for t in bt.input_block_tables:
                assert not t.any(), where


def test_sliding_window_never_names_a_freed_block(pair):
    """Blocks below the window are handed to another request; the gather must not show them."""
    p = pair(
        block_sizes=[4],
        max_num_reqs=2,
        max_num_batched_tokens=8,
        max_num_blocks_per_group=[16],
        sliding_window_reach=[8],
    )
    p.append(0, (list(range(1, 11)),))  # 40 tokens of request 0 in blocks 1..10
    p.bt.apply_staged_writes()
    computed = 40
    # Blocks j with (j + 1) * 4 <= 40 - 8 are dead: j < 8, ids 1..8, now freed.
    freed = {1 + j for j in range(10) if (j + 1) * 4 <= computed - 8}
    p.append(1, (sorted(freed),))
    p.bt.apply_staged_writes()
    out = p.gather([0, 1], 2, num_computed_tokens=[computed, 0])
    live = set(out[0][0, :10].tolist()) - {NULL_BLOCK_ID}
    assert not live & freed
    assert live == {9, 10}


def test_cuda_and_cpu_agree_in_one_process(pair):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: compares the compiled kernels with the interpreted ones")
    kwargs = dict(
        block_sizes=[16, 8],
        max_num_reqs=4,
        max_num_batched_tokens=64,
        max_num_blocks_per_group=[8, 8],
        cp_size=2,
        cp_rank=1,
        cp_interleave=4,
    )
    pairs = [pair(on=d, **kwargs) for d in ("cpu", "cuda")]
    results = []
    for p in pairs:
        p.append(2, ([3, 4, 5], [6, 7]))
        p.bt.apply_staged_writes()
        results.append(p.slots([2, -1], [0, 40, 41], list(range(40)) + [0], 48))
    np.testing.assert_array_equal(results[0], results[1])
