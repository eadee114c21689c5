"""Host-to-device buffers: UVA pools and UVA-backed tensors.

On CUDA, small per-step inputs reach kernels through pinned host memory that
the GPU reads directly (unified virtual addressing): publishing is a host
memcpy, with no copy kernel and no synchronisation. Because a kernel may
still be reading step N's buffer while the host prepares step N+1, buffers
rotate round-robin (`max_concurrency`).

On CPU (Triton's interpreter) the same classes hand out plain host tensors.

Staged writes (`staged.py`) reach their kernel through these pools. Each
class takes an optional `device` (an addition to the contract's signatures):
`None` means CUDA when it is available, else CPU. `BlockTables` passes its
own device, so a CPU instance on a GPU machine stays on the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from . import guards, kernels


def _resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class _CudaArrayView:
    """Names a pinned host buffer through `__cuda_array_interface__` (keeps it alive)."""

    def __init__(self, host: torch.Tensor) -> None:
        self._host = host
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": host.numpy().dtype.str,
            "data": (host.data_ptr(), False),
            "strides": None,
            "version": 2,
        }


def uva_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor aliasing pinned `host` memory: same address, no copy.

    Under unified addressing a pinned allocation's device address equals its
    host address, so the view's `data_ptr()` is the host buffer's.
    """
    if host.numel() == 0:  # nothing to alias: an empty allocation is never pinned
        return torch.empty(host.shape, dtype=host.dtype, device=device)
    assert host.is_pinned() and host.is_contiguous()
    return torch.as_tensor(_CudaArrayView(host), device=device)


class _HostBuffer:
    """One host buffer (`.cpu`, `.np`) and its device-side alias (`.dev`)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        on_cuda = device.type == "cuda"
        self.cpu = torch.zeros(shape, dtype=dtype, pin_memory=on_cuda)
        self.np = self.cpu.numpy()
        self.dev = uva_view(self.cpu, device) if on_cuda else self.cpu


def _check_common(dtype: object, max_concurrency: object) -> None:
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must be a torch.dtype, got {dtype!r}")
    if not guards._is_int(max_concurrency) or max_concurrency < 1:
        raise ValueError(f"max_concurrency must be an int >= 1, got {max_concurrency!r}")


class UvaBufferPool:
    """Round-robin pool of `max_concurrency` host buffers with device aliases.

    `copy_to_uva(x)` writes `x` into the next buffer and returns the device
    view of its first `len(x)` rows. A buffer asked for more rows than it has
    is replaced by one whose first dimension is the next power of two; only the
    buffer being written is replaced, so buffers still in flight stay valid.

    On CUDA a buffer is never written while the device may still read it:
    handing out the next buffer records an event on the current stream behind
    every kernel enqueued so far (the previous buffer's readers), and reusing
    a buffer first waits for its event. The wait costs nothing unless the host
    runs more than `max_concurrency` publishes ahead of the device.
    """

    def __init__(
        self,
        size: int | Sequence[int],
        dtype: torch.dtype,
        max_concurrency: int = 2,
        device: torch.device | str | None = None,
    ) -> None:
        _check_common(dtype, max_concurrency)
        self.size = guards.check_size(size)
        self.dtype = dtype
        self.max_concurrency = max_concurrency
        self.device = _resolve_device(device)
        self._buffers = [_HostBuffer(self.size, dtype, self.device) for _ in range(max_concurrency)]
        self._next = 0
        self._on_cuda = self.device.type == "cuda"
        self._read_by: list = [None] * max_concurrency  # per buffer: event after its readers
        self._last: int | None = None  # the buffer handed out last

    def _take(self, rows: int) -> _HostBuffer:
        i = self._next
        self._next = (i + 1) % self.max_concurrency
        if self._on_cuda:
            self._wait_for_readers(i)
        buf = self._buffers[i]
        if rows > buf.cpu.shape[0]:
            shape = (kernels.next_power_of_2(rows), *self.size[1:])
            buf = self._buffers[i] = _HostBuffer(shape, self.dtype, self.device)
        return buf

    def _wait_for_readers(self, i: int) -> None:
        """Mark where the last buffer's readers end; wait until buffer `i`'s have run."""
        last = self._last
        if last is not None:
            event = self._read_by[last]
            if event is None:
                event = self._read_by[last] = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        event = self._read_by[i]
        if event is not None and not event.query():
            event.synchronize()
        self._last = i

    def copy_to_uva(self, x: torch.Tensor | np.ndarray | Sequence) -> torch.Tensor:
        """Publish `x` (rows along the first dimension); returns the device view."""
        shape = getattr(x, "shape", None)
        if shape is not None and tuple(shape[1:]) != self.size[1:]:
            raise ValueError(
                f"copy_to_uva: rows of shape {tuple(shape[1:])} for a pool of rows {self.size[1:]}"
            )
        n = len(x)
        buf = self._take(n)
        if isinstance(x, torch.Tensor):
            buf.cpu[:n].copy_(x)
        else:
            buf.np[:n] = x
        return buf.dev[:n]

    def copy_to_gpu(
        self, x: torch.Tensor | np.ndarray | Sequence, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Publish `x` and copy it into device memory (`out`, or a new tensor)."""
        view = self.copy_to_uva(x)
        if out is None:
            return view.clone()
        return out.copy_(view, non_blocking=True)


class UvaBackedTensor:
    """A host tensor (`.cpu`, `.np`: the truth) published to the device as `.gpu`.

    `copy_to_uva(n=None)` snapshots the first `n` rows (all by default) into
    the pool and makes `.gpu` that snapshot; later host edits do not reach
    `.gpu` until the next publish, and earlier snapshots stay intact for
    `max_concurrency - 1` more publishes.
    """

    def __init__(
        self,
        size: int | Sequence[int],
        dtype: torch.dtype,
        max_concurrency: int = 2,
        device: torch.device | str | None = None,
    ) -> None:
        _check_common(dtype, max_concurrency)
        self.dtype = dtype
        self.cpu = torch.zeros(guards.check_size(size), dtype=dtype)
        self.np = self.cpu.numpy()
        self.pool = UvaBufferPool(size, dtype, max_concurrency, device)
        self.gpu = self.pool.copy_to_uva(self.np)

    def copy_to_uva(self, n: int | None = None) -> torch.Tensor:
        """Publish rows `[0, n)` (all when `n` is None) as the new `.gpu`."""
        if n is not None and not (guards._is_int(n) and 0 <= n <= self.np.shape[0]):
            raise ValueError(
                f"copy_to_uva: n must be None or in [0, {self.np.shape[0]}], got {n!r}"
            )
        self.gpu = self.pool.copy_to_uva(self.np if n is None else self.np[:n])
        return self.gpu
