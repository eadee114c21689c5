"""Staged writes: edits queued on the host, applied by one kernel launch a step.

An engine changes a few rows of its persistent tables every step. Rather
than one small copy per edit, `StagedWriteTensor` queues each edit on the
host and `apply_write()` publishes them all through UVA pools
(`buffers.py`) to one launch of the apply kernel; `FusedStagedWriter` does
the same for the edits of many tensors at once. Writes staged later win
where they overlap: the host resolves overlaps first, because the kernel
writes every element in parallel.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from . import guards, kernels
from .buffers import UvaBufferPool, _check_common

_STAGED_DTYPES = (torch.int32, torch.int64, torch.float32)


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
        all parts from a leading 0 (one entry more than there are writes; the
        0 is written every time, since a buffer's memory may have been
        scribbled over meanwhile, as across a sleep). Filling slices avoids
        concatenating Python lists.
        """
        num_writes = sum(len(w[0]) for _, w in parts)
        num_elems = sum(len(w[2]) for _, w in parts)
        ids, rows, starts = (
            pool._take(num_writes) for pool in (self.tensor_ids, self.rows, self.starts)
        )
        cu_lens = self.cu_lens._take(num_writes + 1)
        cu_lens.np[0] = 0
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
