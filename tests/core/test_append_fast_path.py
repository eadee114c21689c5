"""`append_block_ids`' lean path (no kernel block expansion, no redirect): same checks, atomic."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cp_blocktables import BlockTables
from cp_blocktables.contract import INT32_MAX

CPU = torch.device("cpu")


def make() -> BlockTables:
    return BlockTables([4, 8], 3, 8, [4, 2], CPU)


def staged(bt: BlockTables) -> list:
    return [
        (t._staged_write_indices[:], t._staged_write_starts[:], t._staged_write_contents[:])
        for t in bt.block_tables
    ]


@pytest.mark.parametrize(
    "ids, error",
    [
        pytest.param(([1, 2.5], [3]), ValueError, id="float"),
        pytest.param(([1], [True]), ValueError, id="bool"),
        pytest.param(([1], ["7"]), ValueError, id="str"),
        pytest.param(([1], [-1]), ValueError, id="negative"),
        pytest.param(([INT32_MAX + 1], [1]), ValueError, id="past-int32"),
        pytest.param(([1, 2, 3, 4, 5], [1]), RuntimeError, id="capacity-group-0"),
        pytest.param(([1], [1, 2, 3]), RuntimeError, id="capacity-group-1"),
    ],
)
def test_a_refused_append_stages_nothing_in_any_group(ids, error):
    bt = make()
    bt.append_block_ids(1, ([9], [8]), False)
    before, counts = staged(bt), bt.num_blocks.np.copy()
    with pytest.raises(error):
        bt.append_block_ids(1, ids, False)
    assert staged(bt) == before
    np.testing.assert_array_equal(bt.num_blocks.np, counts)


def test_capacity_counts_from_the_row_length_unless_overwriting():
    bt = make()
    bt.append_block_ids(0, ([1, 2, 3], [4]), False)
    with pytest.raises(RuntimeError, match="request 0, group 0"):
        bt.append_block_ids(0, ([5, 6], []), False)
    bt.append_block_ids(0, ([5, 6, 7, 8], [9, 10]), True)  # overwrite: from column 0
    assert bt.num_blocks.np[:, 0].tolist() == [4, 2]


def test_ids_of_every_integer_kind_are_staged_as_given():
    bt = make()
    bt.append_block_ids(np.int64(2), ((np.int32(5), 6), np.array([7, 8], dtype=np.int64)), False)
    bt.append_block_ids(2, ([9], []), False)
    bt.apply_staged_writes()
    assert bt.block_tables[0].gpu[2].tolist() == [5, 6, 9, 0]
    assert bt.block_tables[1].gpu[2].tolist() == [7, 8]
    assert bt.num_blocks.np[:, 2].tolist() == [3, 2]


@pytest.mark.parametrize("top", [9, INT32_MAX], ids=["small", "int32-max"])
def test_a_numpy_array_of_ids_is_staged_as_given(top):
    """A group's ids as a numpy array, up to the largest id an int32 table holds."""
    bt = make()
    bt.append_block_ids(0, ([1], np.array([5, top], dtype=np.int64)), False)
    bt.apply_staged_writes()
    assert bt.block_tables[1].gpu[0].tolist() == [5, top]
    assert bt.num_blocks.np[:, 0].tolist() == [1, 2]


@pytest.mark.parametrize("req_index", [True, 3, -1, 1.0, "0", 4, 2**40])
def test_bad_request_indices_are_refused(req_index):
    with pytest.raises(ValueError, match="req_index"):
        make().append_block_ids(req_index, ([1], [2]), False)


def test_redirect_and_expansion_take_the_general_path():
    bt = BlockTables([4, 8], 3, 8, [4, 2], CPU, kernel_block_sizes=[2, 8])
    bt.append_block_ids(0, ([3], [4]), False)
    bt.redirect_writes_to_null_block = True
    bt.append_block_ids(1, ([3], [4]), False)
    bt.apply_staged_writes()
    assert bt.block_tables[0].gpu[0, :2].tolist() == [6, 7]
    assert bt.block_tables[0].gpu[1, :2].tolist() == [0, 1]
    assert bt.num_blocks.np[:, 1].tolist() == [2, 1]


@pytest.mark.parametrize(
    "kernel_block_sizes, redirect",
    [
        pytest.param(None, False, id="lean"),
        pytest.param([2, 8], False, id="kernel-blocks"),
        pytest.param(None, True, id="redirect"),
    ],
)
def test_the_null_block_id_is_appended_on_every_path(pair, kernel_block_sizes, redirect):
    """Block id 0 is a legal id (docs/contract-notes.md: engines write the null block for
    skipped sliding-window blocks): the lean path and the general one (kernel blocks,
    redirect) stage it like any other id."""
    p = pair(
        block_sizes=[4, 8],
        max_num_reqs=3,
        max_num_batched_tokens=8,
        max_num_blocks_per_group=[4, 2],
        kernel_block_sizes=kernel_block_sizes,
    )
    p.bt.redirect_writes_to_null_block = p.ref.redirect_writes_to_null_block = redirect
    p.append(1, ([0, 0, 5], [0]))
    p.bt.apply_staged_writes()
    for g in range(2):
        np.testing.assert_array_equal(p.bt.block_tables[g].gpu.cpu().numpy(), p.ref.tables[g])
    np.testing.assert_array_equal(p.bt.num_blocks.np, p.ref.num_blocks)
    p.gather([1], 1)
