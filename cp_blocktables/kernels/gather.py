"""Gathering the batch's rows of every group's table into the forward-pass tables.

`gather_rows` is the work of one program; the gather kernel and the fused
read kernel (`fused_reads`) both call it.
"""

from __future__ import annotations

import torch
import triton.language as tl

from .._jit import dual_device_fn, dual_jit
from . import _common
from ._common import cdiv, next_power_of_2


@dual_device_fn
def gather_rows(
    row_block,  # which ROWS destination rows this program fills
    g,  # the group
    idx_mapping,  # [num_reqs] row of each batch entry, -1 for a dummy
    num_reqs,
    num_rows,  # rows [0, num_rows) of the destination are written
    max_num_reqs,
    src_ptrs,  # uint64 [num_groups] persistent block tables
    src_strides,  # int64 [num_groups]
    dst_ptrs,  # uint64 [num_groups] forward-pass tables
    dst_strides,  # int64 [num_groups]
    widths,  # int32 [num_groups] columns of each table
    num_blocks,  # int32 [num_groups, max_num_reqs]
    num_blocks_stride,
    block_sizes,  # int64 [num_groups] kernel block sizes (the tables' unit)
    reaches,  # int64 [num_groups] sliding-window reach, 0 = no masking
    num_computed_tokens,  # [max_num_reqs] (MASK_WINDOW only)
    MAX_WIDTH: tl.constexpr,  # columns of the widest table
    MASK_WINDOW: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    """Fill destination rows `[row_block * ROWS, +ROWS)` of group `g`, COLS columns at a time."""
    b = row_block * ROWS + tl.arange(0, ROWS)  # [ROWS] batch rows
    in_batch = b < num_reqs
    r = tl.load(idx_mapping + b, mask=in_batch, other=-1).to(tl.int64)
    real = in_batch & (r >= 0) & (r < max_num_reqs)
    width = tl.load(widths + g)
    n = tl.load(num_blocks + g * num_blocks_stride + r, mask=real, other=0)
    n = tl.minimum(n, width)
    # A real row copies its n entries; a dummy or padding row is zeroed in full.
    row_len = tl.where(real, n, tl.where(b < num_rows, width, 0))
    src = tl.load(src_ptrs + g).to(tl.pointer_type(tl.int32))
    dst = tl.load(dst_ptrs + g).to(tl.pointer_type(tl.int32))
    src_stride = tl.load(src_strides + g)
    dst_stride = tl.load(dst_strides + g)
    if MASK_WINDOW:
        block_size = tl.load(block_sizes + g)
        reach = tl.load(reaches + g)
        computed = tl.load(num_computed_tokens + r, mask=real, other=0)
        # Entry j is dead when (j + 1) * block_size <= computed - reach.
        live_from = tl.where(reach > 0, computed.to(tl.int64) - reach, -1)
    for c0 in range(0, MAX_WIDTH, COLS):
        cols = c0 + tl.arange(0, COLS)  # [COLS]
        m = cols[None, :] < row_len[:, None]  # [ROWS, COLS]
        v = tl.load(src + r[:, None] * src_stride + cols[None, :], mask=m & real[:, None], other=0)
        if MASK_WINDOW:
            dead = (cols[None, :] + 1).to(tl.int64) * block_size <= live_from[:, None]
            v = tl.where(dead, 0, v)
        tl.store(dst + b[:, None].to(tl.int64) * dst_stride + cols[None, :], v, mask=m)


@dual_jit(do_not_specialize=("num_reqs", "num_rows"))
def _gather_block_tables_kernel(
    idx_mapping,
    num_reqs,
    num_rows,
    max_num_reqs,
    src_ptrs,
    src_strides,
    dst_ptrs,
    dst_strides,
    widths,
    num_blocks,
    num_blocks_stride,
    block_sizes,
    reaches,
    num_computed_tokens,
    MAX_WIDTH: tl.constexpr,
    MASK_WINDOW: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    gather_rows(
        tl.program_id(0),
        tl.program_id(1),
        idx_mapping,
        num_reqs,
        num_rows,
        max_num_reqs,
        src_ptrs,
        src_strides,
        dst_ptrs,
        dst_strides,
        widths,
        num_blocks,
        num_blocks_stride,
        block_sizes,
        reaches,
        num_computed_tokens,
        MAX_WIDTH,
        MASK_WINDOW,
        ROWS,
        COLS,
    )


_GATHER_META: dict[tuple, tuple[int, dict]] = {}
"""`(rows per program, constexprs)` per launch shape: computed once, not on every call."""


def _gather_meta(
    on_host: bool, max_width: int, mask_window: bool, num_rows: int
) -> tuple[int, dict]:
    """Programs of ROWS x COLS entries: 2048 (at most 512 columns) on a GPU; on CPU (the
    interpreter) up to `HOST_TILE`, and no more rows than the launch writes."""
    row_cap = next_power_of_2(num_rows) if on_host else 0  # 0: no cap (and one key)
    key = (on_host, max_width, mask_window, row_cap)
    found = _GATHER_META.get(key)
    if found is None:
        budget, max_cols = (_common.HOST_TILE,) * 2 if on_host else (2048, 512)
        cols = min(next_power_of_2(max_width), max_cols)
        rows = max(1, min(budget // cols, row_cap or budget))
        meta = dict(MAX_WIDTH=max_width, MASK_WINDOW=mask_window, ROWS=rows, COLS=cols)
        found = _GATHER_META[key] = (rows, meta)
    return found


def gather_launch_args(
    idx_mapping: torch.Tensor,
    num_rows: int,
    max_num_reqs: int,
    src_ptrs: torch.Tensor,
    src_strides: torch.Tensor,
    dst_ptrs: torch.Tensor,
    dst_strides: torch.Tensor,
    widths: torch.Tensor,
    max_width: int,
    num_blocks: torch.Tensor,
    block_sizes: torch.Tensor,
    reaches: torch.Tensor,
    num_computed_tokens: torch.Tensor | None,
) -> tuple[tuple[int, int], tuple, dict]:
    """`(grid, args, constexprs)` of a gather: grid `(row blocks, num_groups)`."""
    num_groups = src_ptrs.shape[0]
    mask_window = num_computed_tokens is not None
    rows, meta = _gather_meta(idx_mapping.is_cpu, max_width, mask_window, num_rows)
    args = (
        idx_mapping,
        idx_mapping.shape[0],
        num_rows,
        max_num_reqs,
        src_ptrs,
        src_strides,
        dst_ptrs,
        dst_strides,
        widths,
        num_blocks,
        num_blocks.stride(0),
        block_sizes,
        reaches,
        num_computed_tokens if mask_window else idx_mapping,
    )
    return (cdiv(num_rows, rows), num_groups), args, meta


def gather_block_tables(
    idx_mapping: torch.Tensor,
    num_rows: int,
    max_num_reqs: int,
    src_ptrs: torch.Tensor,
    src_strides: torch.Tensor,
    dst_ptrs: torch.Tensor,
    dst_strides: torch.Tensor,
    widths: torch.Tensor,
    max_width: int,
    num_blocks: torch.Tensor,
    block_sizes: torch.Tensor,
    reaches: torch.Tensor,
    num_computed_tokens: torch.Tensor | None,
) -> None:
    """Copy row `idx_mapping[b]` of every group's table into row `b` of its destination.

    Rows of dummy entries and rows `[num_reqs, num_rows)` become zero over the
    table's width. With `num_computed_tokens`, entries wholly below a group's
    sliding window become the null block (`block_sizes` are the tables' unit:
    kernel block sizes).
    """
    grid, args, meta = gather_launch_args(
        idx_mapping,
        num_rows,
        max_num_reqs,
        src_ptrs,
        src_strides,
        dst_ptrs,
        dst_strides,
        widths,
        max_width,
        num_blocks,
        block_sizes,
        reaches,
        num_computed_tokens,
    )
    # grid: (cdiv(num_rows, ROWS), num_groups); one program fills ROWS
    # destination rows of one group, COLS columns at a time.
    _gather_block_tables_kernel.launch(idx_mapping.device, grid, *args, **meta)
