"""Multi-rank tests with the cp_blocktables pytest plugin: a complete, runnable example.

Run it with

    pytest docs/examples/test_example_multirank.py -p cp_blocktables.pytest_plugin

Each `@pytest.mark.ranks(N)` test body runs once on every one of N ranks, in processes
that already share a torch.distributed process group (gloo on CPU).
"""

import numpy as np
import pytest
import torch
import torch.distributed as dist

from cp_blocktables import PAD_SLOT_ID
from cp_blocktables.reference import owner, slots_for_positions

BLOCK_SIZE = 16


@pytest.mark.ranks(4)
def test_all_reduce_sums_the_ranks(rank, world_size, device):
    value = torch.tensor([rank], device=device)  # [1]
    dist.all_reduce(value)
    assert value.item() == sum(range(world_size))


@pytest.mark.parametrize(
    "interleave",
    [
        pytest.param(1, marks=pytest.mark.ranks(2), id="2-ranks-interleave-1"),
        pytest.param(4, marks=pytest.mark.ranks(4), id="4-ranks-interleave-4"),
    ],
)
def test_every_token_is_written_by_exactly_its_owner(
    rank, world_size, device, interleave, block_tables_factory
):
    # Every rank builds the same request; BlockTables knows its own cp_rank.
    tables = block_tables_factory(
        block_sizes=[BLOCK_SIZE],
        max_num_reqs=4,
        max_num_batched_tokens=64,
        max_num_blocks_per_group=[8],
        cp_interleave=interleave,
    )
    block_ids = [3, 9, 4, 12, 7]  # this rank's physical block for each virtual block
    tables.append_block_ids(0, (block_ids,), overwrite=True)
    tables.apply_staged_writes()

    positions = np.arange(100, 140)  # a prefix-cached request: 40 tokens from position 100
    slots = tables.compute_slot_mappings(
        torch.tensor([0], dtype=torch.int32, device=device),  # idx_mapping [num_reqs]
        torch.tensor([0, len(positions)], dtype=torch.int32, device=device),  # query_start_loc
        torch.tensor(positions, dtype=torch.int64, device=device),  # positions [num_tokens]
        len(positions),
    )  # [num_groups, num_tokens]

    gathered = [torch.empty_like(slots) for _ in range(world_size)]
    dist.all_gather(gathered, slots)
    per_rank = np.stack([g[0].cpu().numpy() for g in gathered])  # [world_size, num_tokens]

    writers = (per_rank != PAD_SLOT_ID).sum(axis=0)
    assert (writers == 1).all(), f"tokens written by {writers.tolist()} ranks"
    owners = owner(positions, world_size, interleave, BLOCK_SIZE)
    assert (per_rank.argmax(axis=0) == owners).all()
    expected = slots_for_positions(
        np.array(block_ids), positions, BLOCK_SIZE, world_size, rank, interleave
    )
    np.testing.assert_array_equal(per_rank[rank], expected)


@pytest.mark.ranks(2, timeout=60)
def test_ranks_agree_on_a_seeded_draw(rank, world_size):
    # Every rank is seeded alike before the test (--ranks-seed), so draws agree.
    draw = torch.randint(0, 1000, (8,))  # [8]
    everyone = [torch.empty_like(draw) for _ in range(world_size)]
    dist.all_gather(everyone, draw)
    assert all(torch.equal(draw, other) for other in everyone)
