"""The core across real ranks: each process builds `BlockTables` with its own rank.

Runs on the project's pytest plugin: one process per rank, a gloo process
group, and the ranks' slot mappings all-gathered. Together the ranks must
write every token of a sharded group exactly once, at the reference's slot,
and every rank must agree on unsharded groups.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from cp_blocktables import PAD_SLOT_ID, BlockTablesConfig
from cp_blocktables.reference import ReferenceBlockTables

CONFIG = dict(
    block_sizes=[16, 8, 32],
    max_num_reqs=6,
    max_num_batched_tokens=640,
    max_num_blocks_per_group=[48, 96, 40],
    dcp_sharded=[True, True, False],
)


def _batch():
    rng = np.random.default_rng(7)
    rows = [4, 0, 2, 5]
    lens = [300, 1, 4, 200]  # chunked prefill, decode, speculative decode, prefill
    starts = [0, 250, 97, 1000]  # prefix-cached starts far from 0
    qsl = np.concatenate([[0], np.cumsum(lens)])
    positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)])
    ids = {
        r: [rng.permutation(np.arange(1, 2**20))[:m].tolist() for m in (48, 96, 40)] for r in rows
    }
    return rows, qsl, positions, ids


@pytest.mark.parametrize(
    "interleave",
    [
        pytest.param(1, marks=pytest.mark.ranks(2), id="C2-I1"),
        pytest.param(8, marks=pytest.mark.ranks(4), id="C4-I8"),
    ],
)
def test_ranks_jointly_write_each_token_once(rank, world_size, block_tables_factory, interleave):
    bt = block_tables_factory(cp_interleave=interleave, device=torch.device("cpu"), **CONFIG)
    rows, qsl, positions, ids = _batch()
    for r in rows:
        bt.append_block_ids(r, tuple(ids[r]), True)
    bt.apply_staged_writes()
    num_tokens = int(qsl[-1])
    mine = bt.compute_slot_mappings(
        torch.tensor(rows, dtype=torch.int32),
        torch.tensor(qsl, dtype=torch.int32),
        torch.tensor(positions),
        num_tokens,
    )
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine.contiguous())
    slots = torch.stack(gathered).numpy()  # [ranks, groups, tokens]

    for g, sharded in enumerate(CONFIG["dcp_sharded"]):
        writers = (slots[:, g] != PAD_SLOT_ID).sum(axis=0)
        if sharded:
            np.testing.assert_array_equal(writers, 1, err_msg=f"group {g}")
        else:
            np.testing.assert_array_equal(writers, world_size, err_msg=f"group {g}")
        for k in range(world_size):
            ref = ReferenceBlockTables(
                BlockTablesConfig(cp_size=world_size, cp_rank=k, cp_interleave=interleave, **CONFIG)
            )
            for r in rows:
                ref.append_block_ids(r, tuple(ids[r]), True)
            expected = ref.slot_mappings(rows, qsl, positions, num_tokens)
            np.testing.assert_array_equal(slots[k, g], expected[g], err_msg=f"rank {k}")
