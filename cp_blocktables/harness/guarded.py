"""Buffers that end at an unreadable page: on the CPU an access past their end faults.

An implementation that loads one entry past a tensor the harness hands it
(`query_start_loc[num_reqs + 1]`, say, from a binary search that takes a step
after it has converged) usually computes right results: the value read is
discarded, and the memory after a torch or numpy allocation is readable. On a
GPU the same load is an out-of-bounds read. So on the CPU, under Linux, the
harness hands every input tensor over as a guarded copy: same shape, dtype,
values and contiguity, in storage whose last byte is the last byte before a
page mapped `PROT_NONE`. A read past the end is then a segmentation fault,
which kills the rank; the spawner names the rank and the signal (`spawn`).
The caller-owned `out` buffers of a gather or slot mapping are handed over
the same way, so a store one entry past one faults too (on a GPU it would
overwrite whatever the caller keeps there).

Invariant: for a tensor `g = pool.copy(t)` with `pool.active`, `g` equals `t`,
is contiguous, `g.data_ptr() + g.nbytes` is a page boundary and the page that
starts there cannot be read, until `pool.release()` hands its storage back for
reuse (the executor releases a step's inputs when the next step starts, after
the leader has checked the step's results). Storage is pooled by page count,
so a step costs a copy per input, not an `mmap`.

Not on CUDA: a read past the end of device memory does not fault reliably (the
caching allocator's blocks are larger than the tensors in them), so a CUDA
tensor is handed over as it is; so is an empty tensor (torch gives it no
storage to read at all) and any tensor where `mmap`/`mprotect` are missing
(not Linux).
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

PAGE = mmap.PAGESIZE
_PROT_NONE = 0


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()
SUPPORTED = _LIBC is not None
"""Linux with libc's `mprotect`: guarded copies can be made here."""


def guarded_storage(pages: int) -> mmap.mmap:
    """`pages` readable pages followed by one unreadable page."""
    buf = mmap.mmap(-1, (pages + 1) * PAGE)
    start = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    if _LIBC.mprotect(start + pages * PAGE, PAGE, _PROT_NONE) != 0:
        raise OSError(ctypes.get_errno(), "mprotect of a guard page failed")
    return buf


def guarded_copy(t: torch.Tensor, buf: mmap.mmap | None = None) -> torch.Tensor:
    """`t`'s values in storage that ends where an unreadable page begins.

    `buf`: storage from `guarded_storage` with room for `t`; a fresh one if None
    (it lives as long as the returned tensor does).
    """
    n = t.numel() * t.element_size()
    pages = -(-n // PAGE)
    if buf is None:
        buf = guarded_storage(pages)
    g = torch.frombuffer(buf, dtype=t.dtype, count=t.numel(), offset=pages * PAGE - n)
    g.copy_(t.reshape(-1))
    return g.view(t.shape)


def guard(t: torch.Tensor) -> torch.Tensor:
    """A guarded copy of `t` in storage of its own where one can be made, else `t`."""
    if not SUPPORTED or t.device.type != "cpu" or t.numel() == 0:
        return t
    return guarded_copy(t)


class GuardedPool:
    """Guarded copies of a rank's inputs, their storage reused by page count.

    `active`: this rank's inputs live on the CPU and the platform has `mprotect`;
    otherwise `copy` returns its argument.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.active = SUPPORTED and torch.device(device).type == "cpu"
        self._free: dict[int, list[mmap.mmap]] = {}
        self._used: list[tuple[int, mmap.mmap]] = []

    def copy(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """A guarded copy of `t` (None, a CUDA or an empty tensor: `t` itself)."""
        if t is None or not self.active or t.device.type != "cpu" or t.numel() == 0:
            return t
        pages = -(-t.numel() * t.element_size() // PAGE)
        free = self._free.get(pages)
        buf = free.pop() if free else guarded_storage(pages)
        self._used.append((pages, buf))
        return guarded_copy(t, buf)

    def release(self) -> None:
        """The copies made so far are no longer read: their storage may be reused."""
        for pages, buf in self._used:
            self._free.setdefault(pages, []).append(buf)
        self._used.clear()
