"""UVA pools, UVA-backed tensors, staged writes and the fused writer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cp_blocktables import FusedStagedWriter, StagedWriteTensor, UvaBackedTensor, UvaBufferPool
from cp_blocktables._jit import launch_counts
from cp_blocktables.buffers import _HostBuffer, _resolved_writes, uva_view


def test_pool_round_robin_keeps_earlier_buffers(torch_device):
    pool = UvaBufferPool(4, torch.int32, max_concurrency=2, device=torch_device)
    a = pool.copy_to_uva([1, 2])
    b = pool.copy_to_uva([3, 4, 5])
    assert a.data_ptr() != b.data_ptr()
    assert a.tolist() == [1, 2] and b.tolist() == [3, 4, 5]
    c = pool.copy_to_uva([6])
    assert c.data_ptr() == a.data_ptr()
    assert b.tolist() == [3, 4, 5]


@pytest.mark.parametrize("max_concurrency", [1, 2, 3, 4], ids=["one", "two", "three", "four"])
def test_pool_rotates_through_every_buffer(torch_device, max_concurrency):
    """SPEC.md 4: round-robin over `max_concurrency` buffers: each view stays intact for
    `max_concurrency - 1` more publishes, and the next publish reuses the oldest buffer."""
    pool = UvaBufferPool(4, torch.int32, max_concurrency=max_concurrency, device=torch_device)
    views = [pool.copy_to_uva([k, k]) for k in range(max_concurrency)]
    assert len({v.data_ptr() for v in views}) == max_concurrency
    assert [v.tolist() for v in views] == [[k, k] for k in range(max_concurrency)]
    assert pool.copy_to_uva([9]).data_ptr() == views[0].data_ptr()


@pytest.mark.parametrize(
    "size, rows, grown",
    [
        pytest.param((2, 3), 5, (8, 3), id="rows-past-every-dimension"),
        pytest.param((2, 4), 3, (4, 4), id="rows-past-the-first-dimension-only"),
    ],
)
def test_pool_grows_to_next_power_of_two(torch_device, size, rows, grown):
    """SPEC.md 4: a buffer asked for more rows grows its first dimension, whatever the rest."""
    pool = UvaBufferPool(size, torch.int64, max_concurrency=1, device=torch_device)
    x = np.arange(rows * size[1]).reshape(rows, size[1])
    v = pool.copy_to_uva(x)
    assert v.shape == x.shape
    assert pool._buffers[0].cpu.shape == grown
    np.testing.assert_array_equal(v.cpu().numpy(), x)


class _StandInEvent:
    """`torch.cuda.Event` on the host: `done` says whether the work it marks has run."""

    def __init__(self, log: list) -> None:
        self.log, self.done = log, False

    def record(self, stream: object) -> None:
        self.log.append(("record", self))
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.log.append(("synchronize", self))
        self.done = True


@pytest.fixture
def stand_in_events(monkeypatch) -> list:
    """CUDA events and streams replaced by host stand-ins; returns their log."""
    log: list = []
    monkeypatch.setattr(torch.cuda, "Event", lambda: _StandInEvent(log))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    return log


@pytest.mark.parametrize(
    "readers_done, waits",
    [
        pytest.param(False, True, id="readers-pending-waits"),
        pytest.param(True, False, id="readers-done-goes-on"),
    ],
)
def test_pool_reuses_a_buffer_only_after_its_readers(stand_in_events, readers_done, waits):
    """The CUDA path's bookkeeping, run on the host with stand-in events (the GPU test is
    `test_cuda.py::test_a_buffer_is_never_reused_while_the_device_may_read_it`): handing
    out the next buffer marks where the last one's readers end, and reusing a buffer
    waits for that mark unless it has passed (SPEC.md 4)."""
    pool = UvaBufferPool(4, torch.int32, max_concurrency=2, device="cpu")
    pool._on_cuda = True
    first = pool.copy_to_uva([1])  # no buffer was handed out before: nothing to mark
    assert stand_in_events == []
    pool.copy_to_uva([2])
    ((what, mark),) = stand_in_events  # the first buffer's readers end here
    assert what == "record"
    mark.done = readers_done
    third = pool.copy_to_uva([3])
    assert third.data_ptr() == first.data_ptr()
    waited = [event for what, event in stand_in_events if what == "synchronize"]
    assert waited == ([mark] if waits else [])


class _HostArray:
    """numpy's array interface over the memory a CUDA array interface names."""

    def __init__(self, cai: dict) -> None:
        self.__array_interface__ = {**cai, "version": 3}


@pytest.fixture
def host_uva(monkeypatch) -> list:
    """Unified addressing on the host; returns every CUDA array interface torch was given.

    A non-empty host tensor counts as pinned (an empty allocation never is), and
    `torch.as_tensor` reads a `__cuda_array_interface__` as torch does on CUDA: it refuses
    the read-only flag (`TypeError`), ignores `version`, and names the very memory given,
    here through numpy's array interface instead of a device pointer.
    """
    given: list = []
    as_tensor = torch.as_tensor

    def reading_cuda_arrays(data, dtype=None, device=None):
        cai = getattr(data, "__cuda_array_interface__", None)
        if cai is None:
            return as_tensor(data, dtype=dtype, device=device)
        given.append(cai)
        if cai["data"][1]:
            raise TypeError("the read only flag is not supported, should always be False")
        return torch.from_numpy(np.asarray(_HostArray(cai)))

    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, device=None: self.numel() > 0)
    monkeypatch.setattr(torch, "as_tensor", reading_cuda_arrays)
    return given


@pytest.mark.parametrize("shape", [(1, 1), (0, 4), (2, 3)], ids=["one-element", "empty", "small"])
def test_a_uva_view_is_the_pinned_buffer_itself(host_uva, shape):
    """The CUDA path of `uva_view`, run on the host with torch's reading of the CUDA array
    interface stood in (the GPU test is
    `test_cuda.py::test_uva_views_of_any_size_alias_their_host_buffer`): a non-empty pinned
    buffer is named, not copied, so a host write reaches the view (SPEC.md 4: a zero-copy
    device view of pinned host memory); an empty one has nothing to name and still gives
    a view of its shape."""
    host = torch.full(shape, 7, dtype=torch.int32)
    view = uva_view(host, torch.device("cpu"))
    assert tuple(view.shape) == shape and view.dtype == torch.int32
    if host.numel():
        assert len(host_uva) == 1 and view.data_ptr() == host.data_ptr()
        host.fill_(9)
        assert int(view.sum()) == 9 * host.numel()
    else:
        assert host_uva == []


@pytest.fixture
def stand_in_pinning(monkeypatch) -> list:
    """`torch.zeros(..., pin_memory=...)` allocates unpinned host memory (pinning needs a
    GPU); returns the `pin_memory` flag of every call."""
    pinned: list = []
    zeros = torch.zeros

    def zeros_recording_pinning(*args, pin_memory=False, **kwargs):
        pinned.append(pin_memory)
        return zeros(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros", zeros_recording_pinning)
    return pinned


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_a_host_buffer_is_pinned_and_aliased_on_cuda_only(host_uva, stand_in_pinning, device_type):
    """`_HostBuffer` run on the host with pinning and torch's reading of the CUDA array
    interface stood in (the GPU test is
    `test_cuda.py::test_view_address_is_the_pinned_buffers_device_address`): for a CUDA
    device the host buffer is pinned and `.dev` is its UVA view, the same memory (SPEC.md 4:
    a zero-copy device view of pinned host memory); for the CPU `.dev` is the host buffer."""
    buf = _HostBuffer((2, 3), torch.int32, torch.device(device_type))
    on_cuda = device_type == "cuda"
    assert stand_in_pinning == [on_cuda]
    assert (buf.dev is buf.cpu) != on_cuda
    assert len(host_uva) == int(on_cuda) and buf.dev.data_ptr() == buf.cpu.data_ptr()


@pytest.mark.parametrize(
    "device_type, bookkeeping",
    [
        pytest.param("cpu", [], id="cpu-keeps-no-marks"),
        pytest.param("cuda", ["record", "record", "synchronize"], id="cuda-marks-and-waits"),
    ],
)
def test_a_pool_for_a_cuda_device_waits_for_its_readers(
    host_uva, stand_in_pinning, stand_in_events, device_type, bookkeeping
):
    """A pool built for a CUDA device takes the reader bookkeeping of
    `test_pool_reuses_a_buffer_only_after_its_readers` by itself (pinning, UVA views and
    events stood in on the host; the GPU test is
    `test_cuda.py::test_a_buffer_is_never_reused_while_the_device_may_read_it`): handing out
    the second and third buffers marks where the last one's readers end, and the third
    publish, back on the first buffer, waits for its mark (SPEC.md 4). A CPU pool has no
    device running behind the host and keeps no marks."""
    pool = UvaBufferPool(4, torch.int32, max_concurrency=2, device=device_type)
    views = [pool.copy_to_uva([k]) for k in range(3)]
    assert [what for what, _ in stand_in_events] == bookkeeping
    assert views[2].data_ptr() == views[0].data_ptr() and views[2].tolist() == [2]


def test_a_pool_keeps_two_snapshots_by_default(torch_device):
    """SPEC.md 4: `UvaBufferPool(size, dtype, max_concurrency=2)`: a view stays intact for
    one more publish (`UvaBackedTensor` passes its own count; this is the pool's default)."""
    pool = UvaBufferPool(4, torch.int32, device=torch_device)
    first = pool.copy_to_uva([1, 2])
    second = pool.copy_to_uva([3, 4])
    assert first.tolist() == [1, 2] and second.tolist() == [3, 4]
    assert pool.copy_to_uva([5, 6]).data_ptr() == first.data_ptr()


def test_pool_copy_to_gpu_is_a_device_copy(torch_device):
    pool = UvaBufferPool(4, torch.float32, device=torch_device)
    out = torch.zeros(3, device=torch_device)
    pool.copy_to_gpu([1.5, 2.5, 3.5], out=out)
    assert out.tolist() == [1.5, 2.5, 3.5]
    fresh = pool.copy_to_gpu([7.0])
    assert fresh.device.type == torch_device.type and fresh.tolist() == [7.0]


def test_uva_backed_tensor_publishes_snapshots(torch_device):
    t = UvaBackedTensor((2, 3), torch.int32, device=torch_device)
    t.np[1, 2] = 5
    assert t.gpu[1, 2].item() == 0, "host edits stay private until published"
    first = t.copy_to_uva()
    t.np[1, 2] = 6
    second = t.copy_to_uva()
    assert first[1, 2].item() == 5 and second[1, 2].item() == 6
    assert t.copy_to_uva(1).shape == (1, 3)


def test_uva_backed_tensor_rotates_two_snapshots_by_default(torch_device):
    """As `UvaBufferPool`'s default (SPEC.md 4): a snapshot stays intact for one more publish."""
    t = UvaBackedTensor((2, 3), torch.int32, device=torch_device)
    assert t.pool.max_concurrency == 2
    initial = t.gpu.data_ptr()
    first = t.copy_to_uva()
    assert first.data_ptr() != initial
    assert t.copy_to_uva().data_ptr() == initial


def test_a_pool_without_a_device_takes_the_gpu_when_there_is_one():
    """`device=None`: a CUDA device where one is visible, else the CPU (the helper's default;
    `BlockTables` always passes its own)."""
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert UvaBufferPool(4, torch.int32).device.type == want
    assert UvaBackedTensor((2, 3), torch.int32).gpu.device.type == want


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
