"""Host-to-device buffers: UVA pools, UVA-backed tensors and staged writes.

On CUDA, small per-step inputs reach kernels through pinned host memory that
the GPU reads directly (unified virtual addressing): publishing is a host
memcpy, with no copy kernel and no synchronisation. Because a kernel may
still be reading step N's buffer while the host prepares step N+1, buffers
rotate round-robin (`max_concurrency`).

On CPU (Triton's interpreter) the same classes hand out plain host tensors.

Each class takes an optional `device` (an addition to the contract's
signatures): `None` means CUDA when it is available, else CPU. `BlockTables`
passes its own device, so a CPU instance on a GPU machine stays on the host.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch
import triton

from . import kernels

_STAGED_DTYPES = (torch.int32, torch.int64, torch.float32)


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


def _shape(size: int | Sequence[int]) -> tuple[int, ...]:
    return (size,) if isinstance(size, int) else tuple(size)


class UvaBufferPool:
    """Round-robin pool of `max_concurrency` host buffers with device aliases.

    `copy_to_uva(x)` writes `x` into the next buffer and returns the device
    view of its first `len(x)` rows. A buffer asked for more rows than it has
    is replaced by one whose first dimension is the next power of two; only the
    buffer being written is replaced, so buffers still in flight stay valid.
    """

    def __init__(
        self,
        size: int | Sequence[int],
        dtype: torch.dtype,
        max_concurrency: int = 2,
        device: torch.device | str | None = None,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.size = _shape(size)
        self.dtype = dtype
        self.max_concurrency = max_concurrency
        self.device = _resolve_device(device)
        self._buffers = [_HostBuffer(self.size, dtype, self.device) for _ in range(max_concurrency)]
        self._next = 0

    def _take(self, rows: int) -> _HostBuffer:
        i = self._next
        self._next = (i + 1) % self.max_concurrency
        buf = self._buffers[i]
        if rows > buf.cpu.shape[0]:
            shape = (triton.next_power_of_2(rows), *self.size[1:])
            buf = self._buffers[i] = _HostBuffer(shape, self.dtype, self.device)
        return buf

    def copy_to_uva(self, x: torch.Tensor | np.ndarray | Sequence) -> torch.Tensor:
        """Publish `x` (rows along the first dimension); returns the device view."""
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
        self.dtype = dtype
        self.cpu = torch.zeros(_shape(size), dtype=dtype)
        self.np = self.cpu.numpy()
        self.pool = UvaBufferPool(size, dtype, max_concurrency, device)
        self.gpu = self.pool.copy_to_uva(self.np)

    def copy_to_uva(self, n: int | None = None) -> torch.Tensor:
        self.gpu = self.pool.copy_to_uva(self.np if n is None else self.np[:n])
        return self.gpu


def _drop_overwritten(
    keys: Sequence, starts: Sequence[int], cu_lens: Sequence[int]
) -> list[tuple[int, int, int, int]] | None:
    """Resolve overlapping staged writes so that the latest write of an element wins.

    Staged writes are applied in parallel, so two writes that touch the same
    element must not both reach the kernel. Returns `None` when every key is
    written once (the common case); otherwise the surviving pieces as
    `(write, start, content_lo, content_hi)`, in staging order.
    """
    if len(set(keys)) == len(keys):
        return None
    covered: dict = {}
    pieces = []
    for w in range(len(keys) - 1, -1, -1):
        c_lo = cu_lens[w - 1] if w else 0
        s = starts[w]
        e = s + cu_lens[w] - c_lo
        segments = [(s, e)]
        for a, b in covered.get(keys[w], ()):
            segments = [
                seg
                for x, y in segments
                for seg in ((x, min(y, a)), (max(x, b), y))
                if seg[0] < seg[1]
            ]
        pieces.extend((w, x, c_lo + x - s, c_lo + y - s) for x, y in reversed(segments))
        covered.setdefault(keys[w], []).append((s, e))
    pieces.reverse()
    return pieces


class _StagedBatch:
    """Flat staged writes of one apply, after overlap resolution."""

    def __init__(self, rows, starts, contents, cu_lens, tensor_ids=None) -> None:
        keys = rows if tensor_ids is None else list(zip(tensor_ids, rows))
        pieces = _drop_overwritten(keys, starts, cu_lens)
        if pieces is not None:
            rows = [rows[w] for w, *_ in pieces]
            if tensor_ids is not None:
                tensor_ids = [tensor_ids[w] for w, *_ in pieces]
            starts = [s for _, s, _, _ in pieces]
            contents = [v for _, _, lo, hi in pieces for v in contents[lo:hi]]
            cu_lens = np.cumsum([hi - lo for *_, lo, hi in pieces]).tolist()
        self.rows, self.starts, self.contents = rows, starts, contents
        self.cu_lens, self.tensor_ids = cu_lens, tensor_ids


class _WriteBuffers:
    """The UVA pools that carry one apply's staged writes to the kernel."""

    def __init__(
        self, capacity: int, dtype: torch.dtype, max_concurrency: int, device: torch.device
    ) -> None:
        pool = lambda n, dt: UvaBufferPool(max(n, 1), dt, max_concurrency, device)  # noqa: E731
        self.tensor_ids = pool(capacity, torch.int32)
        self.rows = pool(capacity, torch.int32)
        self.starts = pool(capacity, torch.int32)
        self.cu_lens = pool(capacity, torch.int32)
        self.contents = pool(triton.next_power_of_2(max(capacity, 1)), dtype)

    def publish(self, batch: _StagedBatch) -> tuple[torch.Tensor, ...]:
        return (
            self.rows.copy_to_uva(batch.rows),
            self.starts.copy_to_uva(batch.starts),
            self.cu_lens.copy_to_uva(batch.cu_lens),
            self.contents.copy_to_uva(batch.contents),
        )


class StagedWriteTensor:
    """A device tensor whose updates are staged on the host and applied in one launch.

    `stage_write(index, start, values)` queues `values` for row `index` from
    column `start`; `apply_write()` publishes every queued write through UVA
    buffers and applies them all with one kernel launch, then clears the queue.
    If writes overlap, the one staged last wins. Supported dtypes: int32,
    int64, float32.
    """

    def __init__(
        self,
        size: int | Sequence[int],
        dtype: torch.dtype,
        device: torch.device | str,
        max_concurrency: int = 2,
    ) -> None:
        if dtype not in _STAGED_DTYPES:
            raise ValueError(f"StagedWriteTensor supports dtypes {_STAGED_DTYPES}, got {dtype}")
        self.device = torch.device(device)
        self.dtype = dtype
        self.gpu = torch.zeros(_shape(size), dtype=dtype, device=self.device)
        self.num_rows = self.gpu.shape[0]
        self._buffers = _WriteBuffers(self.num_rows, dtype, max_concurrency, self.device)
        self._staged_write_indices: list[int] = []
        self._staged_write_starts: list[int] = []
        self._staged_write_contents: list[int | float] = []
        self._staged_write_cu_lens: list[int] = []

    def stage_write(self, index: int, start: int, values: Iterable[int | float]) -> None:
        """Queue `values` for `gpu[index, start:start + len(values)]` (no-op when empty)."""
        if not 0 <= index < self.num_rows or start < 0:
            raise IndexError(
                f"staged write at row {index}, column {start} is outside {tuple(self.gpu.shape)}"
            )
        contents = self._staged_write_contents
        n = len(contents)
        contents.extend(values)
        end = len(contents)
        if end != n:
            self._staged_write_indices.append(index)
            self._staged_write_starts.append(start)
            self._staged_write_cu_lens.append(end)

    def stage_write_elem(self, index: int, value: int | float) -> None:
        """Queue one element: `gpu[index] = value` for a 1-D tensor, `gpu[index, 0]` else."""
        self.stage_write(index, 0, (value,))

    def clear_staged_writes(self) -> None:
        self._staged_write_indices.clear()
        self._staged_write_starts.clear()
        self._staged_write_contents.clear()
        self._staged_write_cu_lens.clear()

    def apply_write(self) -> None:
        """Apply every staged write with one kernel launch, then clear them."""
        if not self._staged_write_indices:
            return
        batch = _StagedBatch(
            self._staged_write_indices,
            self._staged_write_starts,
            self._staged_write_contents,
            self._staged_write_cu_lens,
        )
        kernels.apply_writes(self.gpu, *self._buffers.publish(batch))
        self.clear_staged_writes()


class FusedStagedWriter:
    """Applies the staged writes of many `StagedWriteTensor`s with one launch.

    The destination tensors must share one dtype. `output_ptrs` (uint64) and
    `output_strides` (int64) are device tensors holding each destination's
    data pointer and row stride, in the order of `tensors`; keeping them
    persistent avoids a host-to-device copy per step.
    """

    def __init__(
        self, device: torch.device | str, max_writes: int, max_concurrency: int = 2
    ) -> None:
        self.device = torch.device(device)
        self.max_writes = max_writes
        self.max_concurrency = max_concurrency
        self._buffers: dict[torch.dtype, _WriteBuffers] = {}

    def apply(
        self,
        tensors: Sequence[StagedWriteTensor],
        output_ptrs: torch.Tensor,
        output_strides: torch.Tensor,
    ) -> None:
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) > 1:
            raise ValueError(f"FusedStagedWriter needs one dtype, got {sorted(map(str, dtypes))}")
        tensor_ids: list[int] = []
        rows: list[int] = []
        starts: list[int] = []
        contents: list = []
        cu_lens: list[int] = []
        for i, t in enumerate(tensors):
            if not t._staged_write_indices:
                continue
            offset = len(contents)
            tensor_ids.extend([i] * len(t._staged_write_indices))
            rows.extend(t._staged_write_indices)
            starts.extend(t._staged_write_starts)
            contents.extend(t._staged_write_contents)
            cu_lens.extend(end + offset for end in t._staged_write_cu_lens)
        if not rows:
            return
        (dtype,) = dtypes
        buffers = self._buffers.get(dtype)
        if buffers is None:
            buffers = self._buffers[dtype] = _WriteBuffers(
                self.max_writes, dtype, self.max_concurrency, self.device
            )
        batch = _StagedBatch(rows, starts, contents, cu_lens, tensor_ids)
        ids = buffers.tensor_ids.copy_to_uva(batch.tensor_ids)
        kernels.apply_fused_writes(
            self.device, output_ptrs, output_strides, ids, *buffers.publish(batch)
        )
        for t in tensors:
            t.clear_staged_writes()
