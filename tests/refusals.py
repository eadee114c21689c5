"""What the refused-call tests share: a small instance with one applied row, and a snapshot
of everything a refused call must leave as it was (SPEC.md 7: bad input changes nothing)."""

from __future__ import annotations

import numpy as np
import torch

from cp_blocktables import BlockTables

GOOD = dict(
    block_sizes=[16, 32],
    max_num_reqs=4,
    max_num_batched_tokens=64,
    max_num_blocks_per_group=[8, 4],
    device="cpu",
)
I32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
I64 = lambda *v: torch.tensor(v, dtype=torch.int64)  # noqa: E731


def with_one_row() -> BlockTables:
    """`GOOD`, with row 1 holding blocks 5, 6 and 7, applied."""
    t = BlockTables(**GOOD)
    t.append_block_ids(1, ([5, 6], [7]), False)
    t.apply_staged_writes()
    return t


def state(t: BlockTables) -> tuple:
    """Tables, forward-pass tables, slot mappings, counts and staged writes, copied."""
    return (
        [x.gpu.clone() for x in t.block_tables]
        + [x.clone() for x in t.input_block_tables]
        + [t.slot_mappings.clone()],
        t.num_blocks.np.copy(),
        [list(x._staged_write_contents) for x in t.block_tables],
    )


def assert_same(a: tuple, b: tuple) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True))
    np.testing.assert_array_equal(a[1], b[1])
    assert a[2] == b[2]
