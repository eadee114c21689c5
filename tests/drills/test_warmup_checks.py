"""The drill's own look at staged warm-up writes: the null block, in kernel blocks too."""

from __future__ import annotations

import pytest
import torch

from cp_blocktables import BlockTables
from cp_blocktables.drills.warmup_checks import staged_not_null


@pytest.mark.parametrize(
    ("kernel", "ids", "bad"),
    [
        pytest.param([16, 8], ([5], [6]), [], id="m1-redirected"),
        pytest.param([4, 8], ([5, 7], [6]), [], id="m4-redirected"),
        pytest.param([4, 8], None, [0, 1], id="real-ids-staged"),
    ],
)
def test_staged_warmup_writes_must_be_the_null_blocks_kernel_blocks(kernel, ids, bad):
    bt = BlockTables([16, 8], 4, 64, [4, 4], torch.device("cpu"), kernel_block_sizes=kernel)
    bt.redirect_writes_to_null_block = ids is not None
    bt.append_block_ids(1, ids or ([5], [6]), True)
    assert sorted({f["group"] for f in staged_not_null(bt, rank=0)}) == bad
