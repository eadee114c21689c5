"""Applying staged writes: every queued write of one or many tensors in one launch."""

from __future__ import annotations

import torch
import triton.language as tl

from .._jit import dual_jit
from ._common import cdiv, host_tile, on_cpu, search_steps


@dual_jit(do_not_specialize=("num_writes", "num_elems"))
def _apply_writes_kernel(
    dst,  # FUSED: uint64 [num_tensors] data pointers; else the destination tensor
    dst_strides,  # FUSED: int64 [num_tensors] row strides; else the row stride
    tensor_ids,  # int32 [num_writes] (FUSED only)
    rows,  # int32 [num_writes]
    starts,  # int32 [num_writes]
    cu_lens,  # int32 [num_writes + 1] where each write's contents begin; then num_elems
    contents,  # [num_elems]
    num_writes,
    num_elems,
    SEARCH_STEPS: tl.constexpr,
    FUSED: tl.constexpr,
    TILE: tl.constexpr,
):
    e = tl.program_id(0) * TILE + tl.arange(0, TILE)  # [TILE] content element
    live = e < num_elems
    # Binary search: the write w with cu_lens[w] <= e < cu_lens[w + 1].
    lo = tl.full([TILE], 0, dtype=tl.int32)
    hi = lo + num_writes
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        active = lo < hi
        end = tl.load(cu_lens + mid + 1, mask=live & active, other=0)
        right = end <= e
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & (right == 0), mid, hi)
    w = lo
    begin = tl.load(cu_lens + w, mask=live, other=0)
    row = tl.load(rows + w, mask=live, other=0).to(tl.int64)
    col = tl.load(starts + w, mask=live, other=0).to(tl.int64) + (e - begin)
    value = tl.load(contents + e, mask=live)
    if FUSED:
        t = tl.load(tensor_ids + w, mask=live, other=0)
        base = tl.load(dst + t, mask=live, other=0).to(tl.pointer_type(contents.dtype.element_ty))
        stride = tl.load(dst_strides + t, mask=live, other=0)
        tl.store(base + row * stride + col, value, mask=live)
    else:
        tl.store(dst + row * dst_strides + col, value, mask=live)


def apply_writes(
    dst: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    cu_lens: torch.Tensor,
    contents: torch.Tensor,
) -> None:
    """Write `contents[cu_lens[w]:cu_lens[w+1]]` at `dst[rows[w], starts[w]:]` for every w.

    `cu_lens` holds `num_writes + 1` running offsets from 0, as a varlen
    kernel's cumulative lengths: both bounds of every write lie inside it, so
    no program reads an entry before the buffer for the first write's start.
    Writes must not overlap (callers resolve overlaps on the host first). Each
    row's elements must be contiguous (`guards.check_write_target`); rows may
    lie at any pitch, and a 1-D `dst` (one element a row) may have any stride.
    """
    _launch_apply(
        dst.device, dst, dst.stride(0), rows, rows, starts, cu_lens, contents, fused=False
    )


def apply_fused_writes(
    device: torch.device,
    dst_ptrs: torch.Tensor,
    dst_strides: torch.Tensor,
    tensor_ids: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    cu_lens: torch.Tensor,
    contents: torch.Tensor,
) -> None:
    """`apply_writes` for many destination tensors of one dtype, in one launch:
    write `w` goes to the tensor whose data pointer is `dst_ptrs[tensor_ids[w]]`."""
    _launch_apply(
        device, dst_ptrs, dst_strides, tensor_ids, rows, starts, cu_lens, contents, fused=True
    )


def _launch_apply(
    device, dst, dst_strides, tensor_ids, rows, starts, cu_lens, contents, fused: bool
) -> None:
    num_writes, num_elems = rows.shape[0], contents.shape[0]
    on_host = on_cpu(device)
    tile = host_tile(num_elems) if on_host else 1024
    # grid: (cdiv(num_elems, TILE),); one program writes TILE content elements,
    # each finding its write by binary search over cu_lens (and, fused, its
    # destination's pointer and stride).
    _apply_writes_kernel.launch(
        device,
        (cdiv(num_elems, tile),),
        dst,
        dst_strides,
        tensor_ids,
        rows,
        starts,
        cu_lens,
        contents,
        num_writes,
        num_elems,
        SEARCH_STEPS=search_steps(num_writes, exact=on_host),
        FUSED=fused,
        TILE=tile,
    )
