"""`InputChecks`, the call-input checks of `BlockTables` (docs/bad-input.md).

On a CUDA device, run without a GPU: `InputChecks` allocates nothing, so one
built for `cuda` (no index: any CUDA device matches) or `cuda:1` can be handed
host tensors here: the device rule that a CUDA `BlockTables` applies to its
inputs and caller-owned outputs refuses every one of them with a `ValueError`
naming the argument, on the fast path and on the slow one alike.

On CPU, through `BlockTables`: refusals the contract tests do not reach, each
naming the fault as docs/bad-input.md shows and changing nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from refusals import GOOD, I32, I64, assert_same, state, with_one_row

from cp_blocktables import BlockTables, BlockTablesConfig
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


@pytest.mark.parametrize("name", ["idx_mapping", "positions"])
@pytest.mark.parametrize("index", [0, 1, 3], ids=lambda i: f"cuda:{i}")
def test_a_bare_cuda_instance_takes_index_tensors_on_every_cuda_device(index, name):
    """`index_tensor` of a `cuda` instance takes a tensor on any CUDA index and returns its
    length, whether the fast path or the slow one accepts it."""
    checks = InputChecks(CONFIG, torch.device("cuda"))
    assert checks.index_tensor(name, reporting_device(index)) == 2


@pytest.mark.parametrize(
    ("device", "index"),
    [("cuda:1", 0), ("cuda:1", 3), ("cpu", 0)],
    ids=["cuda:1-given-cuda:0", "cuda:1-given-cuda:3", "cpu-given-cuda:0"],
)
def test_an_indexed_instance_refuses_tensors_of_another_cuda_device(device, index):
    """Only a bare `cuda` takes every CUDA index; `cuda:1` and `cpu` refuse the others."""
    checks = InputChecks(CONFIG, torch.device(device))
    with pytest.raises(ValueError, match=f"positions is on .*, BlockTables on {device}$"):
        checks.index_tensor("positions", reporting_device(index))


class _OnCuda(torch.Tensor):
    """A host tensor that is no host tensor to the device rule (`is_cpu` false)."""

    is_cpu = False


def on_cuda(t: torch.Tensor, index: int) -> torch.Tensor:
    """`t` as a tensor on `cuda:index` looks to `InputChecks`: `get_device()` and `is_cpu`."""
    t = t.as_subclass(_OnCuda)
    t.get_device = lambda: index
    return t


OWN_DEVICE = {
    "on-my-device": lambda c, i: c.on_my_device(on_cuda(torch.zeros(2, dtype=torch.int32), i)),
    "out-tables": lambda c, i: c.out_tables(
        [on_cuda(torch.zeros((4, w), dtype=torch.int32), i) for w in (8, 4)], 4
    ),
    "out-slots": lambda c, i: (
        c.out_slots(on_cuda(torch.zeros((2, 64), dtype=torch.int64), i)) is not None
    ),
}


@pytest.mark.parametrize("call", OWN_DEVICE.values(), ids=OWN_DEVICE.keys())
@pytest.mark.parametrize("index", [0, 1, 3], ids=lambda i: f"cuda:{i}")
def test_an_indexed_instance_takes_tensors_on_its_own_device(index, call):
    """A `cuda:N` instance takes a CUDA tensor of its own `N`, whatever `N` (the harness's
    rank 0 is `cuda:0`, its rank 1 under NCCL `cuda:1`), caller-owned `out` tables and slot
    buffers too: index 0 is a CUDA index like any other, not the host's -1."""
    assert call(InputChecks(CONFIG, torch.device("cuda", index)), index)


# ---------------------------------------------------------------- on CPU, through BlockTables


@pytest.fixture
def bt() -> BlockTables:
    return with_one_row()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        pytest.param(
            lambda t: t.append_block_ids(0, ([1], [2], [3]), False),
            r"new_block_ids has 3 entries for 2 KV-cache groups",
            id="more-id-lists-than-groups",
        ),
        pytest.param(
            lambda t: t.gather_block_tables(torch.tensor([[1]], dtype=torch.int32), 1),
            r"idx_mapping must be a 1-D int32 or int64 tensor, got torch.int32 of shape \(1, 1\)",
            id="2-d-idx",
        ),
        pytest.param(
            lambda t: t.compute_slot_mappings(I32(1), I32(0, 1), I64(0, 1).reshape(1, 2), 1),
            r"positions must be a 1-D int32 or int64 tensor, got torch.int64 of shape \(1, 2\)",
            id="2-d-positions",
        ),
        pytest.param(
            lambda t: t.gather_block_tables(I32(1, 0, 0, 0)[::2], 2),
            r"idx_mapping must be contiguous$",
            id="strided-idx",
        ),
        pytest.param(
            lambda t: t.compute_slot_mappings(I32(1), I32(0, 0, 2, 2)[::2], I64(0, 1), 2),
            r"query_start_loc must be contiguous$",
            id="strided-query-start-loc",
        ),
        pytest.param(
            lambda t: t.gather_block_tables([1], 1),
            r"idx_mapping must be a torch.Tensor, got list$",
            id="list-idx",
        ),
        pytest.param(
            lambda t: t.compute_slot_mappings(I32(1), I32(0, 1), None, 1),
            r"positions must be a torch.Tensor, got NoneType$",
            id="none-positions",
        ),
        pytest.param(
            lambda t: t.gather_block_tables(I32(1, 4, -2), 3),
            r"idx_mapping\[1\] = 4 is neither -1 \(dummy\) nor a row in \[0, 4\)",
            id="first-of-two-bad-rows",
        ),
    ],
)
def test_refusals_name_the_fault_and_change_nothing(bt, call, message):
    before = state(bt)
    with pytest.raises(ValueError, match=message):
        call(bt)
    assert_same(before, state(bt))


def test_a_long_query_start_loc_is_named_by_its_first_16_entries():
    bt = BlockTables(**{**GOOD, "max_num_reqs": 20})
    qsl = I32(*range(20), 0)  # 20 requests of one token, then back to 0
    with pytest.raises(ValueError, match=r"never decrease, got \[0, 1, 2, .*, 14, 15\]$"):
        bt.compute_slot_mappings(I32(*[-1] * 20), qsl, I64(*range(19)), 19)


def test_a_numpy_row_is_taken_with_any_number_of_groups():
    """257 groups: a group count past CPython's shared small ints (`is` is not `==` there)."""
    n = 257
    bt = BlockTables([1] * n, 2, 8, [1] * n, "cpu")
    bt.append_block_ids(np.int64(1), tuple([g + 1] for g in range(n)), False)
    assert bt.num_blocks.np[:, 1].tolist() == [1] * n
    assert [t._staged_write_contents for t in bt.block_tables] == [[g + 1] for g in range(n)]


@pytest.mark.parametrize(
    ("position", "validate", "slot"),
    [
        pytest.param(2**62 - 1, True, 3 * 2**61 - 1, id="last-below-2**62-maps"),
        pytest.param(2**62, False, -1, id="2**62-unchecked-pads"),
        pytest.param(2**62, True, None, id="2**62-refused"),
        pytest.param(2**62 + 1, True, None, id="past-2**62-refused"),
    ],
)
def test_positions_are_bounded_by_2_62_in_a_table_that_spans_more(position, validate, slot):
    """Blocks of 2**61 tokens in four columns span 2**63 positions, past the slot arithmetic's
    int64 bound for positions: 2**62 - 1 maps (block 2 of row 0, ids 1 to 4); 2**62 maps to
    PAD unchecked, as a position outside a table does, and checked it and every position past
    it are refused by name, changing nothing."""
    bt = BlockTables([2**61], 2, 8, [4], torch.device("cpu"))
    bt.validate_inputs = validate
    bt.append_block_ids(0, ([1, 2, 3, 4],), True)
    bt.apply_staged_writes()
    args = (I32(0), I32(0, 1), I64(position), 1)
    if slot is not None:
        assert bt.compute_slot_mappings(*args)[0, :1].tolist() == [slot]
        return
    before = state(bt)
    with pytest.raises(ValueError, match=rf"positions must be below 2\*\*62, got {position}$"):
        bt.compute_slot_mappings(*args)
    assert_same(before, state(bt))
