"""The apply kernel: where it writes, what it reads, and what each back end compiles."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hopper import flag_divisions, hopper_ttir, needs_cuda_backend

from cp_blocktables import FusedStagedWriter, StagedWriteTensor
from cp_blocktables.kernels import staged_writes


@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("fused", [False, True], ids=["one-tensor", "fused"])
def test_the_interpreted_apply_divides_by_no_zero(fused):
    """The interpreter runs a kernel's integer operations in numpy, which warns where one
    divides by zero and goes on with 0; compiled for a GPU, the same operation is undefined
    (LLVM may take any value). So on CPU the warning is the one sign of a division that a GPU
    would get wrong. Five writes, so that the binary search over them takes both branches."""
    tensors = [StagedWriteTensor((4, 8), torch.int32, "cpu") for _ in range(2)]
    writes = [(0, 1, [1, 2, 3]), (2, 0, [4]), (3, 5, [5, 6, 7]), (1, 2, [8, 9]), (2, 4, [10])]
    expected = np.zeros((4, 8), dtype=np.int32)
    for row, start, values in writes:
        tensors[-1].stage_write(row, start, values)
        expected[row, start : start + len(values)] = values
    if fused:
        tensors[0].stage_write(1, 7, [11])
        ptrs = torch.tensor([t.gpu.data_ptr() for t in tensors], dtype=torch.uint64)
        strides = torch.tensor([t.gpu.stride(0) for t in tensors], dtype=torch.int64)
        FusedStagedWriter("cpu", max_writes=6).apply(tensors, ptrs, strides)
        assert tensors[0].gpu[1].tolist() == [0] * 7 + [11]
    else:
        tensors[-1].apply_write()
    np.testing.assert_array_equal(tensors[-1].gpu.numpy(), expected)


def _launch(dst, fused: bool, rows, starts, cu_lens, contents) -> None:
    """`apply_writes` into `dst`, or the fused launch with `dst` as its only tensor."""
    if not fused:
        staged_writes.apply_writes(dst, rows, starts, cu_lens, contents)
        return
    device = dst.device
    ptrs = torch.tensor([dst.data_ptr()], dtype=torch.uint64, device=device)
    strides = torch.tensor([dst.stride(0)], dtype=torch.int64, device=device)
    tensor_ids = torch.zeros(rows.shape[0], dtype=torch.int32, device=device)
    staged_writes.apply_fused_writes(
        device, ptrs, strides, tensor_ids, rows, starts, cu_lens, contents
    )


@pytest.mark.parametrize("fused", [False, True], ids=["one-tensor", "fused"])
def test_the_apply_reads_cu_lens_only_inside_its_bounds(torch_device, fused):
    """`cu_lens` holds `num_writes + 1` offsets, from 0: the kernel reads every bound it needs
    inside them. Through `StagedWriteTensor` the entries on either side lie outside any
    tensor, so a load of one reads whatever memory holds there and shows only where that is
    not what the right entry holds. Here `cu_lens` is a view into a tensor whose entries on
    either side are -2 and 9: a load before the first entry moves write 0 two columns right,
    one past the last sends write 1's contents to row 0."""
    i32 = lambda values: torch.tensor(values, dtype=torch.int32, device=torch_device)  # noqa: E731
    dst = torch.zeros((2, 8), dtype=torch.int32, device=torch_device)
    rows, starts, contents = i32([0, 1]), i32([1, 2]), i32([1, 2, 3, 4, 5])
    cu_lens = i32([-2, 0, 3, 5, 9])[1:-1]
    _launch(dst, fused, rows, starts, cu_lens, contents)
    assert dst.cpu().tolist() == [[0, 1, 2, 3, 0, 0, 0, 0], [0, 0, 4, 5, 0, 0, 0, 0]]


@pytest.mark.parametrize("fused", [False, True], ids=["one-tensor", "fused"])
def test_the_apply_counts_its_writes_along_the_first_dimension_of_rows(torch_device, fused):
    """The kernel reads `rows` as `[num_writes]` from its data pointer, and the launch takes
    `num_writes` from its first dimension: a `[num_writes, 1]` column of row indices (the
    same memory) applies every write. Three writes, so that counting one (its last
    dimension) would send the third's contents on from the second's, into row 0."""
    i32 = lambda values: torch.tensor(values, dtype=torch.int32, device=torch_device)  # noqa: E731
    dst = torch.zeros((3, 4), dtype=torch.int32, device=torch_device)
    rows, starts = i32([[2], [0], [1]]), i32([0, 1, 2])
    cu_lens, contents = i32([0, 2, 3, 5]), i32([1, 2, 3, 4, 5])
    _launch(dst, fused, rows, starts, cu_lens, contents)
    assert dst.cpu().tolist() == [[0, 3, 0, 0], [0, 0, 4, 5], [1, 2, 0, 0]]


@pytest.mark.parametrize("fused", [False, True], ids=["one-tensor", "fused"])
def test_the_apply_counts_its_elements_along_the_first_dimension_of_contents(torch_device, fused):
    """The kernel reads `contents` as `[num_elems]` from its data pointer, and the launch
    takes `num_elems` from its first dimension: a `[num_elems, 1]` column of values (the
    same memory) is written whole. Counting one (its last dimension) writes only the first."""
    i32 = lambda values: torch.tensor(values, dtype=torch.int32, device=torch_device)  # noqa: E731
    dst = torch.zeros((2, 4), dtype=torch.int32, device=torch_device)
    rows, starts, cu_lens = i32([1, 0]), i32([0, 1]), i32([0, 2, 5])
    contents = i32([[1], [2], [3], [4], [5]])
    _launch(dst, fused, rows, starts, cu_lens, contents)
    assert dst.cpu().tolist() == [[0, 3, 4, 5], [1, 2, 0, 0]]


def _compiled_apply_ttir(fused: bool) -> str:
    """The apply kernel's TTIR as Triton compiles it for a Hopper GPU (no GPU needed)."""
    kernel = staged_writes._apply_writes_kernel._compiled
    signature = {name: "i32" for name in kernel.arg_names}
    signature.update(
        dst="*u64" if fused else "*i32", dst_strides="*i64" if fused else "i64",
        tensor_ids="*i32", rows="*i32", starts="*i32", cu_lens="*i32", contents="*i32",
    )  # fmt: skip
    constants = dict(SEARCH_STEPS=4, FUSED=fused, TILE=1024)
    return hopper_ttir(kernel, signature, constants)


@needs_cuda_backend
@pytest.mark.parametrize("fused", [False, True], ids=["one-tensor", "fused"])
def test_the_compiled_apply_builds_and_divides_no_flags(fused):
    """What CUDA launches, built on CPU: the interpreter never compiles it. Every load mask
    must be boolean (the compiler refuses a float one), and no integer division may take a
    boolean operand: numpy gives `x // False == 0`, so a flag divided by a flag acts as `&`
    in the interpreter, while LLVM folds an i1 division to its dividend (dividing by zero is
    undefined) and drops the divisor's condition on a GPU."""
    ttir = _compiled_apply_ttir(fused)
    assert flag_divisions(ttir) == []


@pytest.mark.parametrize(
    ("device", "tile", "steps"),
    [
        pytest.param("cpu", 8, 3, id="cpu-7-elements-exact-depth"),
        pytest.param("cuda", 1024, 4, id="cuda-1024-tile-depth-rounded-to-4"),
    ],
)
def test_each_back_end_applies_with_its_own_constants(monkeypatch, device, tile, steps):
    """The apply's tile and search depth per back end, for 5 writes of 7 elements: the
    interpreter runs one program of the contents rounded up to a power of two (8) with the
    exact depth (5 writes: 3 steps); a GPU compiles 1024-element programs and a depth rounded
    up to a multiple of 4, so contents of every size share one compiled variant. Results do
    not depend on them (the launch taken is then run on CPU), so only this test sees one back
    end's constants taken for the other: the harness on CPU never launches a GPU's, and on
    CUDA the interpreter's would only cost a compile per size."""
    i32 = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    dst = torch.zeros((3, 4), dtype=torch.int32)
    rows, starts = i32([0, 2, 1, 0, 2]), i32([1, 0, 2, 0, 3])
    cu_lens, contents = i32([0, 2, 4, 5, 6, 7]), i32([1, 2, 3, 4, 5, 6, 7])
    launches = []
    monkeypatch.setattr(
        staged_writes._apply_writes_kernel,
        "launch",
        lambda *args, **kwargs: launches.append((args, kwargs)),
    )
    staged_writes.apply_fused_writes(
        torch.device(device),
        torch.tensor([dst.data_ptr()], dtype=torch.uint64),
        torch.tensor([dst.stride(0)], dtype=torch.int64),
        i32([0] * 5), rows, starts, cu_lens, contents,
    )  # fmt: skip
    monkeypatch.undo()
    ((args, kwargs),) = launches
    assert (args[1], kwargs["TILE"], kwargs["SEARCH_STEPS"]) == ((1,), tile, steps)
    staged_writes._apply_writes_kernel.launch(torch.device("cpu"), *args[1:], **kwargs)
    assert dst.tolist() == [[6, 1, 2, 0], [0, 0, 5, 0], [3, 4, 0, 7]]


def _apply(tensors: list[StagedWriteTensor], fused: bool) -> None:
    """Apply the staged writes of `tensors` (one alone, or all through a fused writer)."""
    if not fused:
        (t,) = tensors
        t.apply_write()
        return
    device = tensors[0].device
    ptrs = torch.tensor([t.gpu.data_ptr() for t in tensors], dtype=torch.uint64, device=device)
    strides = torch.tensor([t.gpu.stride(0) for t in tensors], dtype=torch.int64, device=device)
    FusedStagedWriter(device, max_writes=8).apply(tensors, ptrs, strides)


@pytest.mark.parametrize("fused", [False, True], ids=["one-tensor", "fused"])
@pytest.mark.parametrize(
    "shape, view, write, expected",
    [
        pytest.param(
            (4,), lambda base: base[::2], (1, 0, [7]), [0, 0, 7, 0, 0, 0, 0, 0],
            id="1d-every-second-element",
        ),
        pytest.param(
            (3,), lambda base: base[2::3], (2, 0, [9]),
            [0, 0, 0, 0, 0, 0, 0, 0, 9], id="1d-stride-3-from-2",
        ),
        pytest.param(
            (2, 3), lambda base: base.view(2, 4)[:, 1:], (1, 1, [5, 6]),
            [0, 0, 0, 0, 0, 0, 5, 6], id="2d-rows-of-a-wider-pitch",
        ),
        pytest.param(
            (2, 3), lambda base: base.view(3, 4), (1, 1, [5, 6]),
            [0, 0, 0, 0, 0, 5, 6, 0, 0, 0, 0, 0], id="2d-more-and-wider-rows",
        ),
        pytest.param(
            (2, 2, 3), lambda base: base.view(2, 9)[:, 3:].view(2, 2, 3), (1, 1, [5, 6]),
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5, 6, 0, 0, 0],
            id="3d-rows-of-a-wider-pitch",
        ),
        pytest.param(
            (3, 1), lambda base: base.view(1, 3).t(), (2, 0, [9]), [0, 0, 9],
            id="2d-one-column-of-a-transposed-row",
        ),
    ],
)  # fmt: skip
def test_a_replaced_gpu_tensor_is_written_through_its_strides(
    torch_device, fused, shape, view, write, expected
):
    """A `.gpu` replaced by a view of another tensor (as an engine reallocating its tables
    does): every write lands at its element of the view, whatever the view's row stride, and
    nothing else of the base tensor changes. A 1-D tensor holds one element a row, so its
    stride is its row stride; a 3-D one holds a row in its last two dimensions, which must be
    contiguous together. A `.gpu` larger than the shape it was built with (more rows, wider
    rows) holds every write checked against that shape, and is taken as it is."""
    t = StagedWriteTensor(shape, torch.int32, torch_device)
    base = torch.zeros(len(expected), dtype=torch.int32, device=torch_device)
    t.gpu = view(base)
    t.stage_write(*write)
    _apply([t], fused)
    assert base.cpu().tolist() == expected


@pytest.mark.parametrize("fused", [False, True], ids=["one-tensor", "fused"])
def test_rows_of_more_than_256_elements_are_written(torch_device, fused):
    """A 3-D tensor holds a row in its last two dimensions; here 600 elements, so the strides
    the contiguity check compares are ints above 256, distinct objects: it must compare
    values."""
    t = StagedWriteTensor((2, 2, 300), torch.int32, torch_device)
    t.stage_write(1, 299, [5, 6])
    _apply([t], fused)
    assert t.gpu[1].flatten()[298:302].tolist() == [0, 5, 6, 0]
    assert int(t.gpu.abs().sum()) == 11


@pytest.mark.parametrize("fused", [False, True], ids=["one-tensor", "fused"])
@pytest.mark.parametrize(
    "view, message",
    [
        pytest.param(
            lambda t: t.gpu.new_zeros(4, 3).t(), "elements of a row must be contiguous",
            id="transposed-rows",
        ),
        pytest.param(lambda t: t.gpu[:2], "smaller than", id="fewer-rows"),
        pytest.param(lambda t: t.gpu[:, :2], "smaller than", id="narrower-rows"),
        pytest.param(lambda t: t.gpu.flatten(), "smaller than", id="one-dimension-fewer"),
        pytest.param(
            lambda t: t.gpu.new_zeros(0, 3).t(), "elements of a row must be contiguous",
            id="empty-transposed-rows",
        ),
        pytest.param(
            lambda t: t.gpu.new_zeros(12).as_strided((3, 4), (4, 0)),
            "elements of a row must be contiguous", id="column-stride-0",
        ),
    ],
)  # fmt: skip
def test_a_replaced_gpu_tensor_the_kernel_cannot_address_is_refused(
    torch_device, fused, view, message
):
    """Writes are checked against the shape a tensor was built with, and the kernel writes
    each row's elements contiguously: a `.gpu` with fewer rows, narrower rows or scattered
    elements would take writes outside itself (a row of column stride 0 holds one element
    however wide it reads, and the kernel would write its other columns into the next
    elements of the storage). Refused with `ValueError`, every write still staged and
    nothing written."""
    t = StagedWriteTensor((3, 4), torch.int32, torch_device)
    t.gpu = view(t)
    before = t.gpu.clone()
    t.stage_write(2, 1, [5, 6, 7])
    with pytest.raises(ValueError, match=message):
        _apply([t], fused)
    assert torch.equal(t.gpu, before)
    assert t._staged_write_cu_lens == [3]


@pytest.mark.parametrize("fused", [False, True], ids=["one-tensor", "fused"])
@pytest.mark.parametrize(
    "shape, view, write",
    [
        pytest.param((3, 1), lambda t: t.gpu.flatten(), (2, 0, [9]), id="one-column-as-1d"),
        pytest.param((2, 2, 3), lambda t: t.gpu.view(2, 6), (1, 1, [5, 6]), id="3d-as-2d"),
    ],
)
def test_a_replaced_gpu_tensor_of_fewer_dimensions_is_refused(
    torch_device, fused, shape, view, write
):
    """A `.gpu` keeps the number of dimensions it was built with, even where the rows of one
    with fewer would hold every write (one column as a 1-D tensor, a 3-D tensor's rows as 2-D
    ones): refused with `ValueError`, every write still staged and nothing written."""
    _assert_refused_as_staged(
        StagedWriteTensor(shape, torch.int32, torch_device), view, write, fused
    )


@pytest.mark.parametrize("fused", [False, True], ids=["one-tensor", "fused"])
@pytest.mark.parametrize(
    "shape, view, write",
    [
        pytest.param((3,), lambda t: t.gpu.view(3, 1), (2, 0, [9]), id="1d-as-one-column"),
        pytest.param(
            (3, 4), lambda t: t.gpu.view(3, 4, 1), (2, 1, [5, 6, 7]), id="2d-with-a-trailing-1"
        ),
        pytest.param(
            (3, 4), lambda t: t.gpu.view(3, 2, 2), (2, 1, [5, 6, 7]), id="2d-rows-split-in-two"
        ),
    ],
)
def test_a_replaced_gpu_tensor_of_more_dimensions_is_refused(
    torch_device, fused, shape, view, write
):
    """The converse of the test before: a `.gpu` of more dimensions than it was built with is
    refused too, even where its rows are contiguous and hold every write (a 1-D tensor as one
    column, a 2-D one with a trailing dimension of 1 or its rows split in two): `ValueError`,
    every write still staged and nothing written."""
    _assert_refused_as_staged(
        StagedWriteTensor(shape, torch.int32, torch_device), view, write, fused
    )


def _assert_refused_as_staged(t: StagedWriteTensor, view, write, fused: bool) -> None:
    """`t.gpu` replaced by `view(t)` and `write` staged: the apply raises `ValueError`,
    writes nothing and keeps the write staged."""
    t.gpu = view(t)
    t.stage_write(*write)
    with pytest.raises(ValueError, match="smaller than"):
        _apply([t], fused)
    assert not t.gpu.any()
    assert t._staged_write_cu_lens == [len(write[2])]
