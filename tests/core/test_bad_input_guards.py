"""Guards of raw pointers, strides, rows and staged values: `ValueError`, never a crash.

Every refused call is asserted to leave its state as it was: staged writes
stay staged, tables and outputs keep their contents.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cp_blocktables import (
    BlockTables,
    FusedStagedWriter,
    StagedWriteTensor,
    UvaBackedTensor,
    UvaBufferPool,
    guards,
)
from cp_blocktables.guards import OutOfRangeError

GOOD = dict(block_sizes=[16, 32], max_num_reqs=4, max_num_batched_tokens=64,
            max_num_blocks_per_group=[8, 4])  # fmt: skip


def staged(t: StagedWriteTensor) -> tuple:
    return (
        list(t._staged_write_indices),
        list(t._staged_write_starts),
        list(t._staged_write_contents),
        list(t._staged_write_cu_lens),
    )


def layout(tensors, device):
    ptrs = torch.tensor([t.gpu.data_ptr() for t in tensors], dtype=torch.uint64, device=device)
    strides = torch.tensor([t.gpu.stride(0) for t in tensors], dtype=torch.int64, device=device)
    return ptrs, strides


def _in_a_child(script: str) -> str:
    """Run `script` in a fresh interpreter and return what it printed: a crash there
    (a segmentation fault) fails the calling test, not pytest."""
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"child died with {proc.returncode}: {proc.stderr[-2000:]}"
    return proc.stdout


# ---------------------------------------------------------------- FusedStagedWriter


def test_uninitialised_pointers_raise_instead_of_crashing():
    """The issue's repro, in a child process: a segmentation fault fails the test, not pytest."""
    script = textwrap.dedent(
        """
        import torch
        from cp_blocktables import FusedStagedWriter, StagedWriteTensor
        tensors = [StagedWriteTensor((4, 8), torch.int32, "cpu") for _ in range(3)]
        for t in tensors:
            t.stage_write(1, 2, [7, 8, 9])
        writer = FusedStagedWriter("cpu", max_writes=12)
        try:
            writer.apply(tensors, torch.empty(3, dtype=torch.uint64),
                         torch.tensor([8, 8, 8]))
        except ValueError as e:
            print("ValueError:", e)
        assert all(t._staged_write_indices == [1] for t in tensors), "writes were dropped"
        assert all(int(t.gpu.abs().sum()) == 0 for t in tensors), "something was written"
        """
    )
    out = _in_a_child(script)
    assert "ValueError: output_ptrs[0] = 0x" in out
    assert "but tensors[0].gpu.data_ptr() is 0x" in out
    assert "(uninitialised or stale?)" in out


@pytest.mark.parametrize(
    "case, match",
    [
        ("wrong-stride", r"output_strides\[1\] = 4 but tensors\[1\].gpu.stride\(0\) is 8"),
        ("swapped-ptrs", r"output_ptrs\[0\] = 0x[0-9a-f]+ but tensors\[0\].gpu.data_ptr\(\)"),
        ("short-ptrs", r"output_ptrs must be a 1-D uint64 or int64 tensor of 2 entries"),
        ("long-ptrs", r"output_ptrs must be a 1-D uint64 .* of 2 entries .* of shape \(3,\)"),
        ("long-strides", r"output_strides must be a 1-D .* of 2 entries .* of shape \(3,\)"),
        ("0-d-ptrs", r"output_ptrs must be a 1-D uint64 .* got torch.uint64 of shape \(\)"),
        ("2-d-ptrs", r"output_ptrs must be a 1-D uint64 .* got torch.uint64 of shape \(2, 1\)"),
        ("2-d-strides", r"output_strides must be a 1-D .* got torch.int64 of shape \(2, 1\)"),
        ("float-ptrs", r"output_ptrs must be a 1-D uint64 or int64 tensor .* got torch.float64"),
        ("not-a-tensor", r"output_ptrs must be a torch.Tensor, got list"),
        ("not-staged", r"tensors\[1\] must be a StagedWriteTensor, got Tensor"),
    ],
)
def test_fused_writer_refuses_bad_layouts_and_keeps_writes(torch_device, case, match):
    tensors = [StagedWriteTensor((3, 8), torch.int32, torch_device) for _ in range(2)]
    ptrs, strides = layout(tensors, torch_device)
    for t in tensors:
        t.stage_write(2, 0, [5, 6])
    args = [list(tensors), ptrs, strides]
    if case == "wrong-stride":
        args[2] = torch.tensor([8, 4], device=torch_device)
    elif case == "swapped-ptrs":
        args[1] = layout(tensors[::-1], torch_device)[0]
    elif case == "short-ptrs":
        args[1] = ptrs[:1]
    elif case == "long-ptrs":  # the right two addresses, then one more
        args[1] = torch.cat([ptrs, ptrs[:1]])
    elif case == "long-strides":
        args[2] = torch.cat([strides, strides[:1]])
    elif case == "0-d-ptrs":
        args[1] = ptrs[0]
    elif case == "2-d-ptrs":  # one row per tensor: as many entries, one dimension too many
        args[1] = ptrs[:, None]
    elif case == "2-d-strides":
        args[2] = strides[:, None]
    elif case == "float-ptrs":
        args[1] = torch.zeros(2, dtype=torch.float64, device=torch_device)
    elif case == "not-a-tensor":
        args[1] = [t.gpu.data_ptr() for t in tensors]
    elif case == "not-staged":
        args[0] = [tensors[0], tensors[1].gpu]
    before = [staged(t) for t in tensors]
    with pytest.raises(ValueError, match=match):
        FusedStagedWriter(torch_device, 4).apply(*args)
    assert [staged(t) for t in tensors] == before
    assert all(int(t.gpu.abs().sum()) == 0 for t in tensors)
    FusedStagedWriter(torch_device, 4).apply(tensors, ptrs, strides)  # the right layout
    assert all(t.gpu[2, :2].tolist() == [5, 6] for t in tensors)


def test_pointers_corrupted_after_a_good_apply_are_caught(torch_device):
    tensors = [StagedWriteTensor((2, 4), torch.int64, torch_device) for _ in range(2)]
    ptrs, strides = layout(tensors, torch_device)
    writer = FusedStagedWriter(torch_device, 4)
    tensors[0].stage_write(0, 0, [1])
    writer.apply(tensors, ptrs, strides)  # verified (and, on CUDA, remembered)
    ptrs[1] = 0  # an in-place write bumps the version: verified again
    tensors[1].stage_write(1, 3, [2])
    with pytest.raises(ValueError, match=r"output_ptrs\[1\] = 0x0 but"):
        writer.apply(tensors, ptrs, strides)
    assert tensors[1]._staged_write_indices == [1]


def test_reallocated_tables_without_new_pointers_are_refused(torch_device):
    bt = BlockTables(device=torch_device, **GOOD)
    bt.append_block_ids(0, ([1], [2]), False)
    bt.apply_staged_writes()
    old = bt.block_tables[0].gpu
    bt.block_tables[0].gpu = old.clone()  # forgot init_block_table_layout_tensors()
    bt.append_block_ids(1, ([3], [4]), False)
    counts = bt.num_blocks.gpu.clone()
    with pytest.raises(ValueError, match=r"output_ptrs\[0\] = .* but tensors\[0\].gpu"):
        bt.apply_staged_writes()
    assert torch.equal(bt.num_blocks.gpu, counts)  # nothing published
    assert bt.block_tables[0]._staged_write_indices == [1]
    bt.init_block_table_layout_tensors()
    bt.apply_staged_writes()
    assert bt.block_tables[0].gpu[:2, 0].tolist() == [1, 3]
    del old


def test_fused_writer_refuses_a_negative_capacity():
    with pytest.raises(ValueError, match="max_writes must be an int >= 0, got -1"):
        FusedStagedWriter("cpu", -1)


# ---------------------------------------------------------------- stage_write


@pytest.mark.parametrize(
    "shape, dtype, args, error, match",
    [
        ((3, 4), torch.int32, (3, 0, [1]), OutOfRangeError, r"row 3, columns \[0, 1\) is outside"),
        ((3, 4), torch.int32, (-1, 0, [1]), OutOfRangeError, "row -1"),
        ((3, 4), torch.int32, (0, -1, [1]), OutOfRangeError, r"columns \[-1, 0\)"),
        ((3, 4), torch.int32, (0, 2, [1, 2, 3]), OutOfRangeError, r"columns \[2, 5\) is outside"),
        ((3, 4), torch.int32, (0, 5, []), OutOfRangeError, r"columns \[5, 5\)"),
        ((6,), torch.int64, (2, 1, [1]), OutOfRangeError, r"row 2, columns \[1, 2\)"),
        ((3, 4), torch.int32, (True, 0, [1]), OutOfRangeError, "must be ints, got True"),
        ((3, 4), torch.int32, (0, 1.0, [1]), OutOfRangeError, "must be ints, got 0, 1.0"),
        ((3, 4), torch.int32, (0, 0, [1, 2**31]), ValueError, "2147483648 does not fit"),
        ((3, 4), torch.int32, (0, 0, [-(2**31) - 1]), ValueError, "does not fit torch.int32"),
        ((3, 4), torch.int64, (0, 0, [2**63]), ValueError, "does not fit torch.int64"),
        ((3, 4), torch.int32, (0, 0, [1, 2.5]), ValueError, "2.5 is not an int"),
        ((3, 4), torch.int32, (0, 0, [True]), ValueError, "True is not an int"),
        ((3, 4), torch.int64, (0, 0, ["7"]), ValueError, "'7' is not an int"),
        ((3, 4), torch.float32, (0, 0, [1e39]), ValueError, r"1e\+39 overflows torch.float32"),
        ((3, 4), torch.float32, (0, 0, ["x"]), ValueError, "'x' is not a number"),
    ],
)
def test_stage_write_refuses_and_stages_nothing(torch_device, shape, dtype, args, error, match):
    t = StagedWriteTensor(shape, dtype, torch_device)
    t.stage_write_elem(1, 3)
    before = staged(t)
    with pytest.raises(error, match=match) as e:
        t.stage_write(*args)
    assert isinstance(e.value, ValueError)
    assert staged(t) == before
    t.apply_write()
    assert float(t.gpu.abs().sum()) == 3


def test_stage_write_accepts_what_fits(torch_device):
    t = StagedWriteTensor((2, 4), torch.float32, torch_device)
    t.stage_write(0, 0, [float("inf"), -1, np.float32(2.5), np.int64(4)])
    t.stage_write(1, 3, iter([7]))  # any iterable, consumed once
    t.apply_write()
    assert t.gpu.cpu().tolist() == [[float("inf"), -1.0, 2.5, 4.0], [0, 0, 0, 7.0]]
    u = StagedWriteTensor((1, 2), torch.int32, torch_device)
    u.stage_write(0, 0, [np.int32(-(2**31)), 2**31 - 1])
    u.apply_write()
    assert u.gpu.cpu().tolist() == [[-(2**31), 2**31 - 1]]


@pytest.mark.parametrize(
    "rows, index",
    [
        pytest.param(3, 4, id="two-past-the-end"),
        pytest.param(3, 100, id="far-past-the-end"),
        pytest.param(300, 300, id="one-past-a-tall-tensor"),
    ],
)
def test_stage_write_refuses_every_row_past_the_end(torch_device, rows, index):
    """Not only the first row past the end: every row from `rows` on is outside the tensor
    (row numbers above 256 are distinct int objects, so the check must compare values)."""
    t = StagedWriteTensor((rows, 2), torch.int32, torch_device)
    match = rf"staged write at row {index}, columns \[0, 1\) is outside \({rows}, 2\)"
    with pytest.raises(OutOfRangeError, match=match):
        t.stage_write(index, 0, [5])
    assert staged(t) == ([], [], [], [])


@pytest.mark.parametrize(
    "dtype, lo, hi",
    [
        pytest.param(torch.int32, -(2**31), 2**31 - 1, id="int32"),
        pytest.param(torch.int64, -(2**63), 2**63 - 1, id="int64"),
    ],
)
def test_stage_write_accepts_every_value_of_an_int_dtype(torch_device, dtype, lo, hi):
    """Both extremes of the tensor's own dtype are staged and applied exactly."""
    t = StagedWriteTensor((1, 4), dtype, torch_device)
    t.stage_write(0, 0, [lo, -1, 0, hi])
    t.apply_write()
    assert t.gpu.cpu().tolist() == [[lo, -1, 0, hi]]


@pytest.mark.parametrize(
    "dtype, values, message",
    [
        pytest.param(
            torch.int32, [7, -(2**31) - 1],
            "row 0: -2147483649 does not fit torch.int32 [-2147483648, 2147483647]",
            id="int32-low-beside-a-fit",
        ),
        pytest.param(
            torch.int64, [-(2**63) - 1],
            "row 0: -9223372036854775809 does not fit torch.int64 "
            "[-9223372036854775808, 9223372036854775807]",
            id="int64-below-min",
        ),
        pytest.param(
            torch.int32, [-(2**31), 2**31],
            "row 0: 2147483648 does not fit torch.int32 [-2147483648, 2147483647]",
            id="int32-high-beside-the-min",
        ),
    ],
)  # fmt: skip
def test_stage_write_names_the_value_that_does_not_fit(torch_device, dtype, values, message):
    """The message names the offending value (not a neighbour that fits, not the dtype's
    own minimum) and the dtype's range, as docs/bad-input.md shows it."""
    t = StagedWriteTensor((2, 4), dtype, torch_device)
    with pytest.raises(ValueError, match=re.escape(message)):
        t.stage_write(0, 0, values)
    assert staged(t) == ([], [], [], [])


def test_stage_write_accepts_the_float32_extremes(torch_device):
    """The largest finite float32 and its negative fit a float32 tensor: only what lies
    beyond them overflows."""
    big = float(np.finfo(np.float32).max)
    t = StagedWriteTensor((1, 3), torch.float32, torch_device)
    t.stage_write(0, 0, [-big, 0.0, big])
    t.apply_write()
    assert t.gpu.cpu().tolist() == [[-big, 0.0, big]]


# ---------------------------------------------------------------- pools and UVA tensors


@pytest.mark.parametrize(
    "size, kwargs, match",
    [
        (-1, {}, r"size must be an int >= 0 or a non-empty list of them, got -1"),
        ((2, -3), {}, r"got \(2, -3\)"),
        ((), {}, r"got \(\)"),
        (2.0, {}, "got 2.0"),
        (4, dict(max_concurrency=0), "max_concurrency must be an int >= 1, got 0"),
        (4, dict(max_concurrency="2"), "max_concurrency must be an int >= 1, got '2'"),
        (4, dict(dtype="int32"), "dtype must be a torch.dtype, got 'int32'"),
    ],
)
@pytest.mark.parametrize("cls", [UvaBufferPool, UvaBackedTensor])
def test_pool_and_uva_tensor_sizes(cls, size, kwargs, match):
    kwargs = dict(dtype=torch.int32) | kwargs
    with pytest.raises(ValueError, match=match):
        cls(size, kwargs.pop("dtype"), device="cpu", **kwargs)


def test_pool_refuses_rows_of_the_wrong_shape():
    pool = UvaBufferPool((4, 3), torch.int64, device="cpu")
    with pytest.raises(ValueError, match=r"rows of shape \(2,\) for a pool of rows \(3,\)"):
        pool.copy_to_uva(np.zeros((2, 2), dtype=np.int64))
    assert pool.copy_to_uva(torch.ones((2, 3), dtype=torch.int64)).sum() == 6


@pytest.mark.parametrize("kind", ["array", "tensor"])
@pytest.mark.parametrize(
    ("shape", "rows"),
    [
        pytest.param((2, 2), r"\(2,\)", id="narrower"),
        pytest.param((2, 4), r"\(4,\)", id="wider"),
        pytest.param((2, 3, 1), r"\(3, 1\)", id="deeper"),
        pytest.param((2,), r"\(\)", id="flatter"),
    ],
)
def test_pool_refuses_rows_of_any_other_shape(shape, rows, kind):
    """Rows wider or deeper than the pool's are refused by the pool's own message, as
    narrower ones are, not left to numpy's or torch's broadcasting error."""
    pool = UvaBufferPool((4, 3), torch.int64, device="cpu")
    zeros = np.zeros if kind == "array" else torch.zeros
    x = zeros(shape, dtype=np.int64 if kind == "array" else torch.int64)
    with pytest.raises(ValueError, match=rf"^copy_to_uva: rows of shape {rows} for a pool of rows"):
        pool.copy_to_uva(x)


@pytest.mark.parametrize("n", [-1, 5, 1.5])
def test_uva_tensor_publish_count_must_be_a_row_count(n):
    t = UvaBackedTensor((4, 2), torch.int32, device="cpu")
    t.np[:] = 7
    gpu = t.gpu
    with pytest.raises(ValueError, match=rf"n must be None or in \[0, 4\], got {n}"):
        t.copy_to_uva(n)
    assert t.gpu is gpu


def test_uva_tensor_publishes_zero_rows():
    t = UvaBackedTensor((4, 2), torch.int32, device="cpu")
    t.np[:] = 7
    t.copy_to_uva(0)  # a legal count: nothing published, no error
    t.copy_to_uva(4)
    assert t.gpu.tolist() == [[7, 7]] * 4


# ---------------------------------------------------------------- BlockTables


def _bt_with_rows(device) -> BlockTables:
    bt = BlockTables(device=device, **GOOD)
    bt.append_block_ids(0, ([1, 2], [3]), False)
    bt.append_block_ids(2, ([4], [5, 6]), False)
    bt.apply_staged_writes()
    return bt


@pytest.mark.parametrize(
    "case", ["uninitialised", "stale", "short", "long", "2-d", "overlapping-rows"]
)
def test_gather_refuses_out_ptrs_not_naming_out(torch_device, case):
    bt = _bt_with_rows(torch_device)
    out = [torch.full((4, w), 9, dtype=torch.int32, device=torch_device) for w in (8, 4)]
    ptrs = torch.tensor([t.data_ptr() for t in out], dtype=torch.uint64, device=torch_device)
    match = r"out_ptrs\[0\] = 0x[0-9a-f]+ but out\[0\].data_ptr\(\) is 0x"
    if case == "uninitialised":
        ptrs = torch.empty(2, dtype=torch.uint64, device=torch_device)
    elif case == "stale":
        ptrs[0] = bt.input_block_tables[0].data_ptr()
    elif case == "short":
        ptrs, match = ptrs[1:], "out_ptrs must be a 1-D uint64 or int64 tensor of 2 entries"
    elif case == "long":  # both addresses right, then one more
        ptrs = torch.cat([ptrs, ptrs[:1]])
        match = r"out_ptrs must be a 1-D .* of 2 entries .* of shape \(3,\)"
    elif case == "2-d":  # a row per group: as many entries, one dimension too many
        ptrs, match = ptrs[:, None], r"out_ptrs must be a 1-D .* of shape \(2, 1\)"
    else:
        out[1] = torch.full((1, 4), 9, dtype=torch.int32, device=torch_device).expand(4, 4)
        match = r"out\[1\] has row stride 0 for 4 columns: its rows overlap"
    persistent = [t.clone() for t in bt.input_block_tables]
    idx = torch.tensor([2, 0], dtype=torch.int32, device=torch_device)
    with pytest.raises(ValueError, match=match):
        bt.gather_block_tables(idx, 2, out=out, out_ptrs=ptrs)
    assert all(int((t != 9).sum()) == 0 for t in out)
    assert all(torch.equal(a, b) for a, b in zip(persistent, bt.input_block_tables))
    good = [torch.zeros((4, w), dtype=torch.int32, device=torch_device) for w in (8, 4)]
    ptrs = torch.tensor([t.data_ptr() for t in good], dtype=torch.uint64, device=torch_device)
    got = bt.gather_block_tables(idx, 2, out=good, out_ptrs=ptrs)
    assert got[1][0, :2].tolist() == [5, 6]


@pytest.mark.parametrize("group", [0, 1], ids=["first-group", "second-group"])
@pytest.mark.parametrize("with_ptrs", [False, True], ids=["no-out-ptrs", "out-ptrs-naming-out"])
def test_gather_refuses_an_out_with_overlapping_rows(torch_device, group, with_ptrs):
    """A gather `out` whose rows overlap (expanded from one row) is refused for itself
    (docs/bad-input.md), with or without an `out_ptrs` that names it correctly: nothing
    else about the call is wrong, and no row of `out` or of the persistent tables is written."""
    bt = _bt_with_rows(torch_device)
    out = [torch.full((4, w), 9, dtype=torch.int32, device=torch_device) for w in (8, 4)]
    base = torch.full((1, out[group].shape[1]), 9, dtype=torch.int32, device=torch_device)
    out[group] = base.expand(4, -1)
    ptrs = None
    if with_ptrs:
        ptrs = torch.tensor([t.data_ptr() for t in out], dtype=torch.uint64, device=torch_device)
    persistent = [t.clone() for t in bt.input_block_tables]
    idx = torch.tensor([2, 0], dtype=torch.int32, device=torch_device)
    match = rf"out\[{group}\] has row stride 0 for {base.shape[1]} columns: its rows overlap"
    with pytest.raises(ValueError, match=match):
        bt.gather_block_tables(idx, 2, out=out, out_ptrs=ptrs)
    assert int((base != 9).sum()) == 0
    assert all(int((t != 9).sum()) == 0 for t in out)
    assert all(torch.equal(a, b) for a, b in zip(persistent, bt.input_block_tables))


def test_gather_refuses_an_out_list_of_the_wrong_length(torch_device):
    bt = _bt_with_rows(torch_device)
    idx = torch.tensor([2, 0], dtype=torch.int32, device=torch_device)
    for n in (1, 3):
        out = [torch.full((4, 8), 9, dtype=torch.int32, device=torch_device) for _ in range(n)]
        with pytest.raises(ValueError, match=rf"out has {n} tables for 2 groups"):
            bt.gather_block_tables(idx, 2, out=out)
        assert all(int((t != 9).sum()) == 0 for t in out)


@pytest.mark.parametrize(
    "case", ["1-d", "3-d", "too-short", "too-narrow", "column-stride-2", "column-stride-0"]
)
def test_gather_refuses_an_out_table_of_the_wrong_shape_or_stride(torch_device, case):
    """`out[1]` wrong in one property alone, rows disjoint: 1-D (8 entries), 3-D
    (`[4, 4, 1]`), 1 of the 2 rows gathered, 3 of the group's 4 columns, every other column
    of a wider table, or one entry a row seen as 4 columns (column stride 0, row stride 8).
    Refused, and nothing is written, not even past the view into the table it was cut from
    (docs/contract-notes.md)."""
    bt = _bt_with_rows(torch_device)
    base = torch.full((4, 8), 9, dtype=torch.int32, device=torch_device)
    wrong = {
        "1-d": base[0].clone(),
        "3-d": base[:, :4].reshape(4, 4, 1).clone(),
        "too-short": base[:1, :4],
        "too-narrow": base[:, :3],
        "column-stride-2": base[:, ::2],
        "column-stride-0": base.as_strided((4, 4), (8, 0)),
    }[case]
    out = [torch.full((4, 8), 9, dtype=torch.int32, device=torch_device), wrong]
    idx = torch.tensor([2, 0], dtype=torch.int32, device=torch_device)
    with pytest.raises(ValueError, match=r"out\[1\] must be an int32 \[>= 2, >= 4\] tensor"):
        bt.gather_block_tables(idx, 2, out=out)
    assert all(int((t != 9).sum()) == 0 for t in (base, *out))


@pytest.mark.parametrize("extra", [1, 8], ids=["1-more-column", "8-more-columns"])
def test_gather_takes_out_tables_wider_than_their_group(torch_device, extra):
    """An `out` table is asked for at least the group's width (docs/contract-notes.md):
    a wider one is taken, its real rows get their entries, its padding row is zeroed over
    the group's width, and the columns past it, like the rows past the padding, keep what
    they held."""
    bt = _bt_with_rows(torch_device)
    out = [torch.full((4, w + extra), 9, dtype=torch.int32, device=torch_device) for w in (8, 4)]
    idx = torch.tensor([2, 0], dtype=torch.int32, device=torch_device)
    got = bt.gather_block_tables(idx, 3, out=out)
    assert all(g.data_ptr() == o.data_ptr() for g, o in zip(got, out))
    g0, g1 = (t.cpu() for t in out)
    assert g0[0, :2].tolist() == [4, 9] and g0[1, :3].tolist() == [1, 2, 9]
    assert g1[0, :3].tolist() == [5, 6, 9] and g1[1, :2].tolist() == [3, 9]
    for t, w in ((g0, 8), (g1, 4)):
        assert t[2].tolist() == [0] * w + [9] * extra
        assert t[3].tolist() == [9] * (w + extra)
        assert int((t[:2, w:] != 9).sum()) == 0


def test_pointer_errors_print_the_exact_address():
    bt = _bt_with_rows("cpu")
    out = [torch.zeros((4, w), dtype=torch.int32) for w in (8, 4)]
    ptrs = torch.tensor([t.data_ptr() for t in out], dtype=torch.uint64)
    ptrs[0] = out[0].data_ptr() + 1  # odd: every bit of the address shows in the message
    idx = torch.tensor([2, 0], dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"out_ptrs\[0\] = {out[0].data_ptr() + 1:#x} but"):
        bt.gather_block_tables(idx, 2, out=out, out_ptrs=ptrs)


@pytest.mark.parametrize("dtype", [torch.uint64, torch.int64], ids=["uint64", "int64"])
def test_pointer_errors_print_a_high_address_unsigned(dtype):
    """An address with its top bit set (an int64 view below 0) prints as the uint64 it is."""
    bt = _bt_with_rows("cpu")
    out = [torch.zeros((4, w), dtype=torch.int32) for w in (8, 4)]
    ptrs = torch.tensor([-15, out[1].data_ptr()], dtype=torch.int64).view(dtype)
    idx = torch.tensor([2, 0], dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"out_ptrs\[0\] = {2**64 - 15:#x} but out\[0\]"):
        bt.gather_block_tables(idx, 2, out=out, out_ptrs=ptrs)


def test_cpu_pointers_are_checked_on_every_call_even_when_rewritten_in_place():
    """On CPU nothing is cached: a write through numpy does not bump the tensor's version."""
    bt = _bt_with_rows("cpu")
    out = [torch.zeros((4, w), dtype=torch.int32) for w in (8, 4)]
    ptrs = torch.tensor([t.data_ptr() for t in out], dtype=torch.uint64)
    idx = torch.tensor([2, 0], dtype=torch.int32)
    bt.gather_block_tables(idx, 2, out=out, out_ptrs=ptrs)
    ptrs.numpy()[0] = bt.input_block_tables[0].data_ptr()  # same tensor, same _version
    with pytest.raises(ValueError, match=r"out_ptrs\[0\] = 0x[0-9a-f]+ but out\[0\]"):
        bt.gather_block_tables(idx, 2, out=out, out_ptrs=ptrs)


class _CudaLooking(torch.Tensor):
    """A host tensor that reports a CUDA device: the CUDA cache of verified pointer tensors
    runs without a GPU (the values are read as on CUDA, through `tolist`)."""

    @property
    def device(self) -> torch.device:
        return torch.device("cuda")


class _CudaLookingReads(_CudaLooking):
    """A `_CudaLooking` tensor that counts its host reads (`tolist`, as the guard reads it)."""

    reads = 0

    def tolist(self):
        type(self).reads += 1
        return super().tolist()


@pytest.mark.parametrize("dtype", [torch.uint64, torch.int64], ids=["uint64", "int64"])
def test_the_cuda_pointer_cache_does_not_read_a_verified_tensor_again(monkeypatch, dtype):
    """The module doc of `guards`: a verified CUDA pointer tensor, unchanged and naming the
    same destinations, is remembered and not read again (on CUDA a host read synchronises).
    tests/core/test_cuda.py::test_verified_address_tensors_are_not_read_again holds the same
    on a real CUDA tensor."""
    monkeypatch.setattr(guards, "_verified", {})
    monkeypatch.setattr(_CudaLookingReads, "reads", 0)
    cuda = torch.device("cuda")
    want = [0x1000, 0x2000]
    t = torch.tensor(want, dtype=torch.int64).view(dtype).as_subclass(_CudaLookingReads)
    guards.check_address_tensor(t, want, "ptrs", "want[{i}]", cuda)  # read and remembered
    assert _CudaLookingReads.reads == 1
    for _ in range(3):
        guards.check_address_tensor(t, want, "ptrs", "want[{i}]", cuda)
    assert _CudaLookingReads.reads == 1


@pytest.mark.parametrize(
    ("count", "sizes_after", "first_read_again"),
    [
        pytest.param(64, 64, False, id="64-tensors-all-remembered"),
        pytest.param(65, 1, True, id="the-65th-starts-afresh"),
    ],
)
def test_the_cuda_pointer_cache_holds_64_tensors(monkeypatch, count, sizes_after, first_read_again):
    """The module doc of `guards`: verified CUDA pointer tensors are remembered, up to 64 of
    them (`_CACHE_LIMIT`). 64 tensors verified once are all remembered, so checking the first
    again reads nothing; the 65th clears the cache before it is stored, so the first is
    read again. (tests/core/test_cuda.py holds the same on real CUDA tensors.)"""
    monkeypatch.setattr(guards, "_verified", {})
    cuda = torch.device("cuda")
    tensors = [
        torch.tensor([i, i + 1], dtype=torch.int64).as_subclass(_CudaLookingReads)
        for i in range(count)
    ]
    for i, t in enumerate(tensors):
        guards.check_address_tensor(t, [i, i + 1], "ptrs", "want[{i}]", cuda)
    assert len(guards._verified) == sizes_after
    monkeypatch.setattr(_CudaLookingReads, "reads", 0)
    guards.check_address_tensor(tensors[0], [0, 1], "ptrs", "want[{i}]", cuda)
    assert _CudaLookingReads.reads == int(first_read_again)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("rewritten-in-place", r"ptrs\[1\] = 0x3000 but want\[1\] is 0x2000"),
        ("destinations-moved", r"ptrs\[1\] = 0x2000 but want\[1\] is 0x3000"),
        ("destinations-moved-down", r"ptrs\[1\] = 0x2000 but want\[1\] is 0x800"),
    ],
    ids=["rewritten-in-place", "destinations-moved", "destinations-moved-down"],
)
def test_the_cuda_pointer_cache_reads_a_tensor_again_once_it_or_its_destinations_change(
    monkeypatch, change, message
):
    """The module doc of `guards`: a verified CUDA pointer tensor is trusted only while its
    `_version` and the values it must hold are those it was checked with; written in place
    through torch, or with its destinations moved (to higher or to lower addresses: the
    remembered values must equal the new ones, not merely sort above or below them), it is
    read again and refused if wrong.
    (tests/core/test_cuda.py holds the same on a real CUDA tensor.)"""
    monkeypatch.setattr(guards, "_verified", {})
    cuda = torch.device("cuda")
    want = [0x1000, 0x2000]
    t = torch.tensor(want, dtype=torch.int64).as_subclass(_CudaLooking)
    guards.check_address_tensor(t, want, "ptrs", "want[{i}]", cuda)  # read and remembered
    assert len(guards._verified) == 1
    if change == "rewritten-in-place":
        t[1] = 0x3000
    elif change == "destinations-moved":
        want = [0x1000, 0x3000]
    else:  # the remembered values sort above the new ones
        want = [0x1000, 0x800]
    with pytest.raises(ValueError, match=message):
        guards.check_address_tensor(t, want, "ptrs", "want[{i}]", cuda)


def test_host_pointer_checks_leave_the_cuda_pointer_cache_alone(monkeypatch):
    """Only CUDA pointer tensors are remembered (on CPU a read costs no synchronisation):
    checking more host tensors than the cache holds, as a CPU `BlockTables` beside a CUDA
    one in the same process does (SPEC.md 5), evicts no verified CUDA tensor, which is
    still not read again. (tests/core/test_cuda.py holds the same on a real CUDA tensor.)"""
    monkeypatch.setattr(guards, "_verified", {})
    monkeypatch.setattr(_CudaLookingReads, "reads", 0)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    want = [0x1000, 0x2000]
    t = torch.tensor(want, dtype=torch.int64).as_subclass(_CudaLookingReads)
    guards.check_address_tensor(t, want, "ptrs", "want[{i}]", cuda)  # read and remembered
    host = [torch.tensor([i, i + 1], dtype=torch.int64) for i in range(guards._CACHE_LIMIT)]
    for i, h in enumerate(host):
        guards.check_address_tensor(h, [i, i + 1], "ptrs", "want[{i}]", cpu)
    guards.check_address_tensor(t, want, "ptrs", "want[{i}]", cuda)
    assert _CudaLookingReads.reads == 1


@pytest.mark.parametrize("device_type", ["meta", "xpu"])
def test_pointer_checks_on_another_device_type_leave_the_cuda_pointer_cache_alone(
    monkeypatch, device_type
):
    """Only CUDA pointer tensors are remembered, not those of a device type that sorts after
    `cuda`: checking more of them than the cache holds evicts no verified CUDA tensor, which
    is still not read again. Host tensors that report `device_type` play that device's."""
    monkeypatch.setattr(guards, "_verified", {})
    monkeypatch.setattr(_CudaLookingReads, "reads", 0)
    cuda, other = torch.device("cuda"), torch.device(device_type)
    looking = type("_OtherLooking", (torch.Tensor,), {"device": property(lambda _: other)})
    want = [0x1000, 0x2000]
    t = torch.tensor(want, dtype=torch.int64).as_subclass(_CudaLookingReads)
    guards.check_address_tensor(t, want, "ptrs", "want[{i}]", cuda)  # read and remembered
    tensors = [
        torch.tensor([i, i + 1], dtype=torch.int64).as_subclass(looking)
        for i in range(guards._CACHE_LIMIT)
    ]
    for i, h in enumerate(tensors):
        guards.check_address_tensor(h, [i, i + 1], "ptrs", "want[{i}]", other)
    assert list(guards._verified) == [id(t)]
    guards.check_address_tensor(t, want, "ptrs", "want[{i}]", cuda)
    assert _CudaLookingReads.reads == 1


def test_slot_mappings_refuse_an_out_with_overlapping_rows(torch_device):
    bt = _bt_with_rows(torch_device)
    out = torch.full((1, 64), 9, dtype=torch.int64, device=torch_device).expand(2, 64)
    d = torch_device
    with pytest.raises(ValueError, match=r"out has row stride 0 for 64 columns"):
        bt.compute_slot_mappings(
            torch.tensor([0], device=d), torch.tensor([0, 1], device=d),
            torch.tensor([0], device=d), 1, out=out,
        )  # fmt: skip
    assert int((out != 9).sum()) == 0


@pytest.mark.parametrize(
    "case",
    [
        "int32",
        "one-row-for-two-groups",
        "column-stride-2",
        "column-stride-0",
        "1-d-of-two-entries",
        "3-d-of-one-column-each",
    ],
)
def test_slot_mappings_refuse_an_out_of_the_wrong_dtype_shape_or_stride(torch_device, case):
    """A slot-mapping `out` wrong in one property alone, rows disjoint: int32, one row for
    two groups, every other column of a wider buffer, one entry a row seen as 64 columns
    (column stride 0, row stride 128), 1-D with one entry per group, or 3-D, the `[2, 64]`
    view with a trailing dimension of one (its column stride 1, as a 2-D `out`'s)
    (docs/contract-notes.md: int64 `[num_groups, n]`, unit column stride). Refused, and
    nothing is written, not even into the buffer it was cut from."""
    bt = _bt_with_rows(torch_device)
    base = torch.full((2, 128), 9, dtype=torch.int64, device=torch_device)
    wrong = {
        "int32": base[:, :64].to(torch.int32),
        "one-row-for-two-groups": base[:1, :64],
        "column-stride-2": base[:, ::2],
        "column-stride-0": base.as_strided((2, 64), (128, 0)),
        "1-d-of-two-entries": base[0, :2],
        "3-d-of-one-column-each": base[:, :64, None],
    }[case]
    d = torch_device
    with pytest.raises(ValueError, match=r"out must be an int64 \[2, n\] tensor with unit column"):
        bt.compute_slot_mappings(
            torch.tensor([0], device=d), torch.tensor([0, 1], device=d),
            torch.tensor([0], device=d), 1, out=wrong,
        )  # fmt: skip
    assert int((base != 9).sum()) == 0 and int((wrong != 9).sum()) == 0


@pytest.mark.parametrize("rows", [3, 8], ids=lambda n: f"{n}-rows-for-two-groups")
def test_slot_mappings_refuse_an_out_with_more_rows_than_groups(torch_device, rows):
    """A slot-mapping `out` of more rows than groups (docs/contract-notes.md: int64
    `[num_groups, n]`) is refused and nothing is written. Taken, the launch would map
    `out.shape[0]` groups and read the layout of groups that do not exist, past its
    buffers (a segmentation fault in the interpreter): hence a child process."""
    script = textwrap.dedent(
        f"""
        import torch
        from cp_blocktables import BlockTables
        d = torch.device({str(torch_device)!r})
        bt = BlockTables(device=d, **{GOOD!r})
        bt.append_block_ids(0, ([1, 2], [3]), False)
        bt.apply_staged_writes()
        base = torch.full(({rows}, 128), 9, dtype=torch.int64, device=d)
        try:
            bt.compute_slot_mappings(
                torch.tensor([0], device=d), torch.tensor([0, 1], device=d),
                torch.tensor([0], device=d), 1, out=base[:, :64],
            )
            print("accepted")
        except ValueError as e:
            print("ValueError:", e)
        print("written:", int((base != 9).sum()))
        """
    )
    on = torch.empty(0, device=torch_device).device  # a tensor's: `cuda:0` for `cuda`
    assert _in_a_child(script).splitlines() == [
        f"ValueError: out must be an int64 [2, n] tensor with unit column stride on "
        f"{torch_device}, got torch.int64 ({rows}, 64) on {on}",
        "written: 0",
    ]


def test_one_row_outputs_are_accepted_whatever_their_row_stride(torch_device):
    """A single row cannot overlap another: a transposed column (row stride 1, contiguous
    to torch) is a valid one-row destination."""
    bt = _bt_with_rows(torch_device)
    out = [torch.zeros((w, 1), dtype=torch.int32, device=torch_device).t() for w in (8, 4)]
    assert out[0].stride() == (1, 1) and out[0].is_contiguous()
    got = bt.gather_block_tables(torch.tensor([2], device=torch_device), 1, out=out)
    assert [g[0, :2].tolist() for g in got] == [[4, 0], [5, 6]]
    assert all(g.data_ptr() == o.data_ptr() for g, o in zip(got, out))


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(
            lambda w, d: torch.zeros((1, w), dtype=torch.int32, device=d).expand(0, w),
            id="expanded",
        ),
        pytest.param(
            lambda w, d: torch.empty_strided((0, w), (1, 1), dtype=torch.int32, device=d),
            id="row-stride-1",
        ),
    ],
)
def test_zero_row_outputs_are_accepted_whatever_their_row_stride(torch_device, make):
    """No rows, none to overlap: an empty batch gathers into a zero-row `out` whose row
    stride is below its width (an expanded or strided empty view) without a refusal."""
    bt = _bt_with_rows(torch_device)
    out = [make(w, torch_device) for w in (8, 4)]
    assert all(o.shape[0] == 0 and o.stride(0) < o.shape[1] for o in out)
    idx = torch.zeros(0, dtype=torch.int32, device=torch_device)
    got = bt.gather_block_tables(idx, 0, out=out)
    assert [tuple(g.shape) for g in got] == [(0, 8), (0, 4)]


@pytest.mark.parametrize(
    "which, make, match",
    [
        ("table", lambda t: t.to(torch.int64), r"block_tables\[0\].gpu must be an int32"),
        ("table", lambda t: t[:2], r"block_tables\[0\].gpu must be an int32 \[>= 4, n\]"),
        ("table", lambda t: t.t(), r"block_tables\[0\].gpu must be an int32 .* unit column"),
        pytest.param(
            "table",
            lambda t: t[:, 0],
            r"block_tables\[0\].gpu must be an int32 .* \(4,\) on",
            id="table-1-d",
        ),
        pytest.param(
            "table",
            lambda t: t.unsqueeze(-1),
            r"block_tables\[0\].gpu must be an int32 .* \(4, 8, 1\) on",
            id="table-3-d",
        ),
        pytest.param(
            "input",
            lambda t: t.unsqueeze(-1),
            r"input_block_tables\[0\] must be an int32 .* \(4, 8, 1\) on",
            id="input-3-d",
        ),
        pytest.param(
            "table",
            lambda t: t[:, :1].expand(-1, 8),
            r"block_tables\[0\].gpu must be an int32 .* unit column",
            id="table-column-stride-0",
        ),
        pytest.param(
            "input",
            lambda t: t[:, :3],
            r"input_block_tables\[0\] has 3 columns, fewer than block_tables\[0\]\.gpu's 8$",
            id="input-narrower",
        ),
        ("input", lambda t: t[:1].expand(4, 8), r"input_block_tables\[0\] has row stride 0"),
    ],
)
def test_layout_rebuild_refuses_tables_kernels_cannot_use(torch_device, which, make, match):
    bt = _bt_with_rows(torch_device)
    ptrs = bt.block_table_ptrs
    if which == "table":
        bt.block_tables[0].gpu = make(bt.block_tables[0].gpu)
    else:
        bt.input_block_tables[0] = make(bt.input_block_tables[0])
    with pytest.raises(ValueError, match=match):
        bt.init_block_table_layout_tensors()
    assert bt.block_table_ptrs is ptrs  # nothing rebuilt


@pytest.mark.parametrize("extra", [1, 8], ids=lambda n: f"{n}-more-columns")
def test_layout_rebuild_takes_a_forward_pass_table_wider_than_its_table(torch_device, extra):
    """Only a narrower forward-pass table is refused (docs/bad-input.md): a wider one holds
    every column the kernels write, and the gather fills its table's columns as before."""
    bt = _bt_with_rows(torch_device)
    wide = torch.full((4, 8 + extra), 9, dtype=torch.int32, device=torch_device)
    bt.input_block_tables[0] = wide
    bt.init_block_table_layout_tensors()
    assert int(bt.input_block_table_ptrs[0]) == wide.data_ptr()
    bt.gather_block_tables(torch.tensor([2, 0], dtype=torch.int32, device=torch_device), 2)
    assert wide[:2, :8].tolist() == [[4] + [0] * 7, [1, 2] + [0] * 6]


def _tables(d: str, meta_group: int | None = None) -> list[torch.Tensor]:
    """Gather `out` tables for `_bt_with_rows`, one of them on `meta` if asked."""
    return [
        torch.zeros((4, w), dtype=torch.int32, device="meta" if g == meta_group else d)
        for g, w in enumerate((8, 4))
    ]


def _idx(d: str) -> torch.Tensor:
    return torch.tensor([2, 0], dtype=torch.int32, device=d)


# Each case: (a call on `_bt_with_rows` of device d, the refusal it must raise).
ON_META = {
    "out-ptrs": (
        lambda bt, d: bt.gather_block_tables(
            _idx(d), 2, out=_tables(d), out_ptrs=torch.zeros(2, dtype=torch.uint64, device="meta")
        ),
        r"out_ptrs is on meta; the kernel runs on {d}",
    ),
    "out-table": (
        lambda bt, d: bt.gather_block_tables(_idx(d), 2, out=_tables(d, meta_group=1)),
        r"out\[1\] must be .* on {d}, got torch.int32 \(4, 4\) on meta",
    ),
    "idx-mapping": (
        lambda bt, d: bt.gather_block_tables(_idx("meta"), 2),
        r"idx_mapping is on meta, BlockTables on {d}",
    ),
    "num-computed-tokens": (
        lambda bt, d: bt.gather_block_tables(
            _idx(d), 2, num_computed_tokens=torch.zeros(4, dtype=torch.int32, device="meta")
        ),
        r"num_computed_tokens is on meta, BlockTables on {d}",
    ),
    "slot-mapping-out": (
        lambda bt, d: bt.compute_slot_mappings(
            torch.tensor([0], device=d),
            torch.tensor([0, 1], device=d),
            torch.tensor([0], device=d),
            1,
            out=torch.zeros((2, 64), dtype=torch.int64, device="meta"),
        ),  # fmt: skip
        r"out must be .* on {d}, got .* on meta",
    ),
}


@pytest.mark.parametrize(("call", "message"), ON_META.values(), ids=ON_META.keys())
def test_tensors_on_another_device_are_refused(torch_device, call, message):
    """A tensor on another device than the `BlockTables` (here `meta`, which every machine
    has) is refused with the device named, whether or not that device has an index. A
    `meta` tensor reports the device index -1, as a CPU tensor does: a CPU instance took a
    `meta` out table for its own and handed its null address to the kernel."""
    bt = _bt_with_rows(torch_device)
    tables = [t.clone() for t in bt.input_block_tables]
    with pytest.raises(ValueError, match=message.format(d=torch_device)):
        call(bt, torch_device)
    assert all(torch.equal(a, b) for a, b in zip(tables, bt.input_block_tables))


def test_a_layout_table_on_another_device_is_refused(torch_device):
    """A forward-pass table replaced by one on `meta` is refused before anything is rebuilt."""
    bt = _bt_with_rows(torch_device)
    ptrs = bt.block_table_ptrs
    bt.input_block_tables[0] = bt.input_block_tables[0].to("meta")
    match = rf"input_block_tables\[0\] .* on {torch_device}, got torch.int32 \(4, 8\) on meta"
    with pytest.raises(ValueError, match=match):
        bt.init_block_table_layout_tensors()
    assert bt.block_table_ptrs is ptrs  # nothing rebuilt


@pytest.mark.parametrize(
    "device, tensor_on, same",
    [
        pytest.param("cuda", "cuda:0", True, id="cuda-takes-cuda:0"),
        pytest.param("cuda", "cuda:1", True, id="cuda-takes-cuda:1"),
        pytest.param("cuda:1", "cuda:1", True, id="cuda:1-takes-cuda:1"),
        pytest.param("cuda:1", "cuda:0", False, id="cuda:1-refuses-cuda:0"),
        pytest.param("cuda:1", "cuda:3", False, id="cuda:1-refuses-cuda:3"),
        pytest.param("cuda", "cpu", False, id="cuda-refuses-cpu"),
        pytest.param("cpu", "cpu", True, id="cpu-takes-cpu"),
        pytest.param("cpu:0", "cpu", True, id="cpu:0-takes-cpu"),
        pytest.param("cpu:0", "cuda:0", False, id="cpu:0-refuses-cuda:0"),
        pytest.param("cpu", "cuda:0", False, id="cpu-refuses-cuda:0"),
    ],
)
def test_the_device_rule_of_the_guards(device, tensor_on, same):
    """`cuda` without an index takes a tensor on any CUDA device (the caller set the current
    one), `cuda:i` only those on `cuda:i`, refusing lower and higher indices alike. A
    stand-in holding only `.device` plays the CUDA tensor, so the rule that a GPU run applies
    to every table is checked on any machine."""
    t = SimpleNamespace(device=torch.device(tensor_on))
    assert guards.same_device(t, torch.device(device)) is same


def test_the_device_rule_compares_device_types_for_equality():
    """A device type is the same or another, not earlier or later: with torch's extension
    backend renamed `aaa` (a type that sorts before `cpu`), in a child process because the
    rename cannot be undone, `cpu` refuses a tensor on `aaa` and `aaa` a host tensor."""
    script = textwrap.dedent(
        """
        from types import SimpleNamespace
        import torch
        from cp_blocktables import guards
        torch.utils.rename_privateuse1_backend("aaa")
        cases = {
            "cpu-refuses-aaa": ("cpu", "aaa", False),
            "aaa-refuses-cpu": ("aaa", "cpu", False),
            "aaa-takes-aaa": ("aaa", "aaa", True),
        }
        for case, (device, tensor_on, same) in cases.items():
            t = SimpleNamespace(device=torch.device(tensor_on))
            got = guards.same_device(t, torch.device(device))
            print(case, "ok" if got is same else f"got {got}")
        """
    )
    assert _in_a_child(script).split("\n")[:3] == [
        "cpu-refuses-aaa ok",
        "aaa-refuses-cpu ok",
        "aaa-takes-aaa ok",
    ]


def test_a_cpu_device_with_an_index_builds_and_maps():
    """`torch.device("cpu:0")` names the host as `cpu` does; its tensors report `cpu`, so the
    guards must not refuse the tables built on it."""
    bt = BlockTables([4], 2, 8, [4], torch.device("cpu:0"))
    bt.append_block_ids(1, ([7, 9],), True)
    bt.apply_staged_writes()
    (table,) = bt.gather_block_tables(torch.tensor([1], dtype=torch.int32), 1)
    assert table[0, :2].tolist() == [7, 9]
    slots = bt.compute_slot_mappings(
        torch.tensor([1], dtype=torch.int32),
        torch.tensor([0, 2], dtype=torch.int32),
        torch.tensor([1, 5], dtype=torch.int64),
        2,
    )
    assert slots[0].tolist() == [7 * 4 + 1, 9 * 4 + 1]
