"""`InputChecks`, the call-input checks of `BlockTables` (docs/bad-input.md).

On a CUDA device, run without a GPU: `InputChecks` allocates nothing, so one
built for `cuda` (no index: any CUDA device matches) or `cuda:1` can be handed
host tensors here: the device rule that a CUDA `BlockTables` applies to its
inputs and caller-owned outputs refuses every one of them with a `ValueError`
naming the argument, on the fast path and on the slow one alike.
"""

from __future__ import annotations

import pytest
import torch

from cp_blocktables import BlockTablesConfig
from cp_blocktables._inputs import InputChecks

CONFIG = BlockTablesConfig([16, 32], 4, 64, [8, 4])


@pytest.fixture(params=["cuda", "cuda:1"])
def cuda_checks(request) -> InputChecks:
    return InputChecks(CONFIG, torch.device(request.param))


HOST = {
    "idx_mapping": lambda c: c.index_tensor("idx_mapping", torch.tensor([0, 1], dtype=torch.int32)),
    "positions": lambda c: c.index_tensor("positions", torch.arange(3)),
    "out-tables": lambda c: c.out_tables(
        [torch.zeros((4, 8), dtype=torch.int32), torch.zeros((4, 4), dtype=torch.int32)], 4
    ),
    "out-slots": lambda c: c.out_slots(torch.zeros((2, 64), dtype=torch.int64)),
}


@pytest.mark.parametrize("call", HOST.values(), ids=HOST.keys())
def test_host_tensors_are_refused_by_a_cuda_instance(cuda_checks, call):
    with pytest.raises(ValueError, match="cpu"):
        call(cuda_checks)


def test_no_host_tensor_is_on_a_cuda_device(cuda_checks):
    assert not cuda_checks.on_my_device(torch.zeros(1, dtype=torch.int32))


def reporting_device(index: int) -> torch.Tensor:
    """A host tensor whose `get_device()` reports `index`, as a tensor on `cuda:index` does."""
    t = torch.zeros(2, dtype=torch.int32)
    t.get_device = lambda: index
    return t


@pytest.mark.parametrize("index", [0, 1, 3], ids=lambda i: f"cuda:{i}")
def test_a_bare_cuda_instance_takes_tensors_on_every_cuda_device(index):
    """`cuda` names the current device, which the caller sets: every CUDA index is ours."""
    assert InputChecks(CONFIG, torch.device("cuda")).on_my_device(reporting_device(index))
