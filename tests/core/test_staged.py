"""Staged writes and the fused writer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cp_blocktables import FusedStagedWriter, StagedWriteTensor
from cp_blocktables._jit import launch_counts
from cp_blocktables.staged import _resolved_writes


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32], ids=str)
def test_staged_writes_apply_in_one_launch(torch_device, dtype):
    t = StagedWriteTensor((3, 5), dtype, torch_device)
    t.stage_write(0, 1, [1, 2, 3])
    t.stage_write(2, 0, [4])
    t.stage_write(1, 4, [])
    t.stage_write_elem(1, 9)
    before = launch_counts["_apply_writes_kernel"]
    t.apply_write()
    assert launch_counts["_apply_writes_kernel"] == before + 1
    expected = [[0, 1, 2, 3, 0], [9, 0, 0, 0, 0], [4, 0, 0, 0, 0]]
    assert t.gpu.cpu().tolist() == expected
    assert not (
        t._staged_write_indices
        or t._staged_write_contents
        or t._staged_write_starts
        or t._staged_write_cu_lens
    )


@pytest.mark.parametrize("staged_before", [0, 300], ids=["nothing-before", "300-elements-before"])
def test_an_empty_write_stages_nothing(torch_device, staged_before):
    """`stage_write` of no values leaves SPEC.md 4's staged lists as they were, also behind
    more elements than Python keeps one int object for; with nothing else staged,
    `apply_write` then launches nothing (docs/contract-notes.md: nothing staged, no launch)."""
    t = StagedWriteTensor((2, 400), torch.int32, torch_device)
    if staged_before:
        t.stage_write(0, 0, range(staged_before))
    lists = (
        t._staged_write_indices,
        t._staged_write_starts,
        t._staged_write_contents,
        t._staged_write_cu_lens,
    )
    before = [list(x) for x in lists]
    t.stage_write(1, 5, [])
    assert [list(x) for x in lists] == before
    launches = launch_counts["_apply_writes_kernel"]
    t.apply_write()
    assert launch_counts["_apply_writes_kernel"] == launches + (1 if staged_before else 0)
    assert t.gpu[0, :staged_before].tolist() == list(range(staged_before))


def test_staged_write_elem_on_1d(torch_device):
    t = StagedWriteTensor(6, torch.int64, torch_device)
    t.stage_write_elem(4, 2**40)
    t.stage_write_elem(0, -3)
    t.apply_write()
    assert t.gpu.cpu().tolist() == [-3, 0, 0, 0, 2**40, 0]


def test_overlapping_staged_writes_last_wins(torch_device):
    t = StagedWriteTensor((2, 8), torch.int32, torch_device)
    t.stage_write(0, 0, [1, 1, 1, 1, 1, 1])
    t.stage_write(1, 0, [5, 5])
    t.stage_write(0, 2, [2, 2])
    t.stage_write(0, 5, [3, 3, 3])
    t.stage_write(0, 3, [4])
    t.apply_write()
    assert t.gpu[0].cpu().tolist() == [1, 1, 2, 4, 1, 3, 3, 3]
    assert t.gpu[1].cpu().tolist() == [5, 5, 0, 0, 0, 0, 0, 0]


def test_overlapping_writes_reach_the_kernel_disjoint():
    """The apply kernel stores all writes of a launch in parallel, and on a GPU stores that
    collide land in no defined order (the interpreter happens to keep staging order), so
    the host hands it every element once, with the value of the write staged last
    (SPEC.md 4): the overwritten parts of earlier writes are dropped before the launch."""
    t = StagedWriteTensor((2, 8), torch.int32, "cpu")
    t.stage_write(0, 0, [1, 1, 1, 1, 1, 1])
    t.stage_write(1, 0, [5, 5])
    t.stage_write(0, 2, [2, 2])
    t.stage_write(0, 5, [3, 3, 3])
    t.stage_write(0, 3, [4])
    rows, starts, contents, cu_lens = _resolved_writes(t)
    elements = [
        (r, s + i, v)
        for r, s, lo, hi in zip(rows, starts, [0, *cu_lens[:-1]], cu_lens)
        for i, v in enumerate(contents[lo:hi])
    ]
    assert len({(r, c) for r, c, _ in elements}) == len(elements)
    assert sorted(elements) == [
        *((0, c, v) for c, v in enumerate([1, 1, 2, 4, 1, 3, 3, 3])),
        (1, 0, 5),
        (1, 1, 5),
    ]


def test_clear_staged_writes(torch_device):
    t = StagedWriteTensor((2, 2), torch.int32, torch_device)
    t.stage_write(0, 0, [1])
    t.clear_staged_writes()
    t.apply_write()
    assert t.gpu.abs().sum().item() == 0


def test_staged_write_refuses_other_dtypes():
    with pytest.raises(ValueError, match="dtypes"):
        StagedWriteTensor((2, 2), torch.float16, "cpu")


def test_staged_write_outside_tensor_is_refused():
    t = StagedWriteTensor((2, 2), torch.int32, "cpu")
    with pytest.raises(IndexError, match="row 2"):
        t.stage_write(2, 0, [1])
    assert not t._staged_write_indices


def test_many_writes_grow_buffers(torch_device):
    t = StagedWriteTensor((4, 600), torch.int32, torch_device)
    for i in range(600):
        t.stage_write_elem(i % 4, i)  # every row overwritten many times: last wins
    t.stage_write(3, 10, list(range(500)))
    t.apply_write()
    got = t.gpu.cpu().numpy()
    assert got[0, 0] == 596 and got[1, 0] == 597 and got[2, 0] == 598 and got[3, 0] == 599
    np.testing.assert_array_equal(got[3, 10:510], np.arange(500))


def test_fused_writer_one_launch_for_all_tensors(torch_device):
    tensors = [StagedWriteTensor((3, w), torch.int32, torch_device) for w in (2, 4, 8)]
    ptrs = torch.tensor(
        [t.gpu.data_ptr() for t in tensors], dtype=torch.uint64, device=torch_device
    )
    strides = torch.tensor(
        [t.gpu.stride(0) for t in tensors], dtype=torch.int64, device=torch_device
    )
    tensors[0].stage_write(2, 0, [1, 2])
    tensors[2].stage_write(0, 5, [3, 4, 5])
    tensors[2].stage_write(0, 6, [6])
    writer = FusedStagedWriter(torch_device, max_writes=2)
    before = sum(launch_counts.values())
    writer.apply(tensors, ptrs, strides)
    assert sum(launch_counts.values()) == before + 1
    assert tensors[0].gpu[2].tolist() == [1, 2]
    assert tensors[1].gpu.abs().sum().item() == 0
    assert tensors[2].gpu[0].tolist() == [0, 0, 0, 0, 0, 3, 6, 5]
    assert all(not t._staged_write_indices for t in tensors)


def test_fused_writer_over_no_tensors_applies_nothing(torch_device):
    """SPEC.md 4: `apply` applies every staged write of every tensor given; given none, there
    is nothing to apply: no error and no launch (as with tensors that have nothing staged)."""
    none_i64 = torch.zeros(0, dtype=torch.int64, device=torch_device)
    before = sum(launch_counts.values())
    FusedStagedWriter(torch_device, max_writes=0).apply([], none_i64.to(torch.uint64), none_i64)
    assert sum(launch_counts.values()) == before


def test_fused_writer_refuses_mixed_dtypes():
    tensors = [StagedWriteTensor(2, torch.int32, "cpu"), StagedWriteTensor(2, torch.int64, "cpu")]
    with pytest.raises(ValueError, match="one dtype"):
        FusedStagedWriter("cpu", 4).apply(
            tensors, torch.zeros(2, dtype=torch.uint64), torch.zeros(2, dtype=torch.int64)
        )


def _write_pools(owner) -> list:
    """Every pool of a `StagedWriteTensor`'s or `FusedStagedWriter`'s write buffers."""
    groups = owner._buffers.values() if isinstance(owner._buffers, dict) else [owner._buffers]
    return [
        pool for b in groups for pool in (b.tensor_ids, b.rows, b.starts, b.cu_lens, b.contents)
    ]


@pytest.mark.parametrize(
    ("size", "rows"),
    [
        pytest.param(6, 6, id="1-d"),
        pytest.param((3, 8), 3, id="fewer-rows-than-columns"),
        pytest.param((5, 2), 5, id="more-rows-than-columns"),
        pytest.param((4, 0), 4, id="no-columns"),
    ],
)
def test_num_rows_is_the_first_dimension_and_sizes_the_write_pools(torch_device, size, rows):
    """`num_rows` is the number of rows a staged write may name (`gpu.shape[0]`, whatever
    the width), and the tensor's write pools start with room for one write per row: `rows`,
    `starts` and `tensor_ids` of `rows` entries, `cu_lens` of one more, the contents pool
    the next power of two (pools grow when asked for more, so this is the starting size)."""
    t = StagedWriteTensor(size, torch.int32, torch_device)
    assert t.num_rows == rows
    contents = 1 << (rows - 1).bit_length()
    expected = [(rows,), (rows,), (rows,), (rows + 1,), (contents,)]
    assert [pool.size for pool in _write_pools(t)] == expected


def test_fused_writer_rotates_two_staging_buffers_by_default(torch_device):
    """`max_concurrency` is the project's extension of SPEC.md 4's `FusedStagedWriter(device,
    max_writes)`, defaulting to 2 as `UvaBufferPool` does (`BlockTables` builds its writer
    with the default): an apply's staging buffers stay intact for one more apply, and the
    third apply reuses the first one's."""
    tensors = [StagedWriteTensor((3, 4), torch.int32, torch_device) for _ in range(2)]
    ptrs = torch.tensor([t.gpu.data_ptr() for t in tensors], dtype=torch.uint64)
    strides = torch.tensor([t.gpu.stride(0) for t in tensors], dtype=torch.int64)
    ptrs, strides = ptrs.to(torch_device), strides.to(torch_device)
    writer = FusedStagedWriter(torch_device, max_writes=4)
    assert writer.max_concurrency == 2
    for row in range(3):
        tensors[1].stage_write(row, 0, [row + 1])
        writer.apply(tensors, ptrs, strides)
    assert tensors[1].gpu[:, 0].tolist() == [1, 2, 3]
    pools = _write_pools(writer)
    assert all(len(pool._buffers) == 2 for pool in pools)
    rows = writer._buffers[torch.int32].rows._buffers
    assert [int(b.np[0]) for b in rows] == [2, 1]  # the third apply's row 2 over the first's 0


@pytest.mark.parametrize("fused", [False, True], ids=["one-tensor", "fused"])
def test_garbage_in_the_write_buffers_is_harmless(torch_device, fused):
    """docs/contract-notes.md (wake-up): the staging pools are rewritten before each use, so
    garbage in their host memory is harmless. That includes the leading 0 of `cu_lens`,
    which no write's offsets cover: `publish` writes it every time. Between two applies
    every buffer of every pool is filled with -2; the second apply must still write its
    values where they were staged (with `cu_lens[0] = -2` they would land 2 columns on)."""
    tensors = [StagedWriteTensor((3, 8), torch.int32, torch_device) for _ in range(2)]
    if fused:
        owner = FusedStagedWriter(torch_device, max_writes=4)
        ptrs = torch.tensor([t.gpu.data_ptr() for t in tensors], dtype=torch.uint64)
        strides = torch.tensor([t.gpu.stride(0) for t in tensors], dtype=torch.int64)
        ptrs, strides = ptrs.to(torch_device), strides.to(torch_device)

        def apply():
            owner.apply(tensors, ptrs, strides)
    else:
        owner = tensors[0]
        apply = owner.apply_write
    tensors[0].stage_write(0, 0, [1])
    apply()
    assert tensors[0].gpu[0, 0].item() == 1  # read back: the apply has run
    for pool in _write_pools(owner):
        for buf in pool._buffers:
            buf.cpu.fill_(-2)
    tensors[0].stage_write(1, 2, [5, 6])
    tensors[0].stage_write(2, 0, [7])
    if fused:
        tensors[1].stage_write(0, 3, [8, 9])
    apply()
    assert tensors[0].gpu.cpu().tolist() == [
        [1, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 5, 6, 0, 0, 0, 0],
        [7, 0, 0, 0, 0, 0, 0, 0],
    ]
    expected_1 = [[0, 0, 0, 8, 9, 0, 0, 0], [0] * 8, [0] * 8] if fused else [[0] * 8] * 3
    assert tensors[1].gpu.cpu().tolist() == expected_1
