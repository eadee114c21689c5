"""UVA pools and UVA-backed tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cp_blocktables import UvaBackedTensor, UvaBufferPool
from cp_blocktables.buffers import _HostBuffer, uva_view


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
        pytest.param((2, 3), 4, (4, 3), id="rows-a-power-of-two-grow-to-itself"),
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
        pytest.param("meta", [], id="other-device-keeps-no-marks"),
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
    device running behind the host and keeps no marks, nor does a pool for any other device
    (`meta`, whose name sorts after `cuda`; SPEC.md 5 names only CUDA and CPU): its buffers
    are host buffers, as a CPU pool's, and only a CUDA pool records CUDA events."""
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


@pytest.mark.parametrize("kind", ["array", "tensor"])
def test_a_one_dimensional_pool_publishes_arrays_and_tensors(torch_device, kind):
    """SPEC.md 4: a pool whose `size` is an int has rows of shape (); an array or tensor of
    such rows is published, not refused as rows of another shape."""
    pool = UvaBufferPool(4, torch.int64, device=torch_device)
    rows = np.arange(3) if kind == "array" else torch.arange(3)
    assert pool.copy_to_uva(rows).tolist() == [0, 1, 2]


def test_a_one_dimensional_uva_backed_tensor_publishes(torch_device):
    t = UvaBackedTensor(3, torch.int32, device=torch_device)
    t.np[:] = [4, 5, 6]
    t.copy_to_uva()
    assert t.gpu.tolist() == [4, 5, 6]


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
