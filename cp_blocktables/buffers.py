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

from . import guards, kernels

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


_Writes = tuple[list[int], list[int], list, list[int]]  # rows, starts, contents, cu_lens


def _resolved_writes(t: StagedWriteTensor) -> _Writes:
    """`t`'s staged writes with every overwritten element dropped."""
    rows, starts = t._staged_write_indices, t._staged_write_starts
    contents, cu_lens = t._staged_write_contents, t._staged_write_cu_lens
    pieces = _drop_overwritten(rows, starts, cu_lens)
    if pieces is None:
        return rows, starts, contents, cu_lens
    return (
        [rows[w] for w, *_ in pieces],
        [s for _, s, _, _ in pieces],
        [v for _, _, lo, hi in pieces for v in contents[lo:hi]],
        np.cumsum([hi - lo for *_, lo, hi in pieces]).tolist(),
    )


class _WriteBuffers:
    """The UVA pools that carry one apply's staged writes to the kernel."""

    def __init__(
        self, capacity: int, dtype: torch.dtype, max_concurrency: int, device: torch.device
    ) -> None:
        pool = lambda n, dt: UvaBufferPool(max(n, 1), dt, max_concurrency, device)  # noqa: E731
        self.tensor_ids = pool(capacity, torch.int32)
        self.rows = pool(capacity, torch.int32)
        self.starts = pool(capacity, torch.int32)
        self.cu_lens = pool(capacity + 1, torch.int32)
        self.contents = pool(kernels.next_power_of_2(max(capacity, 1)), dtype)

    def publish(self, parts: list[tuple[int, _Writes]]) -> tuple[torch.Tensor, ...]:
        """Write every part's lists straight into the next buffers.

        `parts` holds `(tensor_index, writes)`; returns device views of
        `(tensor_ids, rows, starts, cu_lens, contents)`, `cu_lens` running over
        all parts from a leading 0 (one entry more than there are writes: a
        buffer is allocated zeroed and its entry 0 is never written). Filling
        slices avoids concatenating Python lists.
        """
        num_writes = sum(len(w[0]) for _, w in parts)
        num_elems = sum(len(w[2]) for _, w in parts)
        ids, rows, starts = (
            pool._take(num_writes) for pool in (self.tensor_ids, self.rows, self.starts)
        )
        cu_lens = self.cu_lens._take(num_writes + 1)
        contents = self.contents._take(num_elems)
        w = e = 0
        for index, (r, s, c, cu) in parts:
            n, m = len(r), len(c)
            ids.np[w : w + n] = index
            rows.np[w : w + n] = r
            starts.np[w : w + n] = s
            cu_lens.np[w + 1 : w + n + 1] = cu
            if e:
                cu_lens.np[w + 1 : w + n + 1] += e
            contents.np[e : e + m] = c
            w, e = w + n, e + m
        return tuple(
            b.dev[:n]
            for b, n in ((ids, w), (rows, w), (starts, w), (cu_lens, w + 1), (contents, e))
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
        self.gpu = torch.zeros(guards.check_size(size), dtype=dtype, device=self.device)
        self.num_rows = self.gpu.shape[0]
        self._shape = tuple(self.gpu.shape)
        self._buffers = _WriteBuffers(self.num_rows, dtype, max_concurrency, self.device)
        self._staged_write_indices: list[int] = []
        self._staged_write_starts: list[int] = []
        self._staged_write_contents: list[int | float] = []
        self._staged_write_cu_lens: list[int] = []

    def stage_write(self, index: int, start: int, values: Iterable[int | float]) -> None:
        """Queue `values` for `gpu[index, start:start + len(values)]` (no-op when empty).

        A place outside the tensor (`guards.OutOfRangeError`) or a value that does
        not fit the dtype (`ValueError`) is refused and nothing is staged.
        """
        values = guards.check_staged_write(index, start, values, self._shape, self.dtype)
        contents = self._staged_write_contents
        n = len(contents)
        contents.extend(values)
        end = len(contents)
        if end != n:
            self._staged_write_indices.append(index)
            self._staged_write_starts.append(start)
            self._staged_write_cu_lens.append(end)

    def _stage_checked(self, index: int, start: int, values: Sequence[int | float]) -> None:
        """`stage_write` for a caller that has checked place and values itself
        (`BlockTables.append_block_ids`) and passes them non-empty: no second walk."""
        contents = self._staged_write_contents
        contents.extend(values)
        self._staged_write_indices.append(index)
        self._staged_write_starts.append(start)
        self._staged_write_cu_lens.append(len(contents))

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
        guards.check_write_target(self.gpu, self._shape, "gpu")
        _, *writes = self._buffers.publish([(0, _resolved_writes(self))])
        kernels.apply_writes(self.gpu, *writes)
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
        if not guards._is_int(max_writes) or max_writes < 0:
            raise ValueError(f"max_writes must be an int >= 0, got {max_writes!r}")
        _check_common(torch.int32, max_concurrency)
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
        """Apply every staged write of `tensors` in one launch, then clear them.

        `output_ptrs[i]` and `output_strides[i]` must be `tensors[i].gpu`'s
        `data_ptr()` and `stride(0)`: the kernel writes through them. Anything
        else is a `ValueError` and every write stays staged.
        """
        self._check_destinations(tensors, output_ptrs, output_strides)
        dtypes = {t.dtype for t in tensors}
        parts = [(i, _resolved_writes(t)) for i, t in enumerate(tensors) if t._staged_write_indices]
        if not parts:
            return
        (dtype,) = dtypes
        buffers = self._buffers.get(dtype)
        if buffers is None:
            buffers = self._buffers[dtype] = _WriteBuffers(
                self.max_writes, dtype, self.max_concurrency, self.device
            )
        kernels.apply_fused_writes(
            self.device, output_ptrs, output_strides, *buffers.publish(parts)
        )
        for t in tensors:
            t.clear_staged_writes()

    def _check_destinations(
        self, tensors: Sequence[StagedWriteTensor], ptrs: torch.Tensor, strides: torch.Tensor
    ) -> None:
        """Every destination on this writer's device, named by `ptrs` and `strides`."""
        for i, t in enumerate(tensors):
            if not isinstance(t, StagedWriteTensor):
                raise ValueError(
                    f"tensors[{i}] must be a StagedWriteTensor, got {type(t).__name__}"
                )
            if not guards.same_device(t.gpu, self.device):
                raise ValueError(f"tensors[{i}] is on {t.gpu.device}, the writer on {self.device}")
            guards.check_write_target(t.gpu, t._shape, f"tensors[{i}].gpu")
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) > 1:
            raise ValueError(f"FusedStagedWriter needs one dtype, got {sorted(map(str, dtypes))}")
        guards.check_address_tensor(
            ptrs, [t.gpu.data_ptr() for t in tensors], "output_ptrs",
            "tensors[{i}].gpu.data_ptr()", self.device,
        )  # fmt: skip
        guards.check_address_tensor(
            strides, [t.gpu.stride(0) for t in tensors], "output_strides",
            "tensors[{i}].gpu.stride(0)", self.device, fmt="d",
        )  # fmt: skip
