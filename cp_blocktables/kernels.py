"""The Triton kernels, each beside the function that launches it.

All three run on CUDA (compiled) and on CPU (Triton's interpreter) through
`dual_jit`. They call only Triton builtins: `triton.language` helpers that are
themselves `@triton.jit` functions (`tl.zeros`, `tl.max`, `tl.sum`, ...) are
compiled or interpreted once, when Triton is imported, so they cannot serve
both back ends. Launchers pick the back end from the tensors' device and a tile
shape that suits it (large tiles on CPU, where each program instance costs
Python-level work; GPU-sized tiles on CUDA).

Per-group data reaches the kernels as small device tensors (`ptrs`, `strides`,
`widths`, ...) so that one launch serves every KV-cache group; a table's data
pointer is loaded and cast to a typed pointer inside the kernel.

Memory safety holds even for inputs the contract forbids: rows outside
`[0, max_num_reqs)` act as dummy requests, positions outside a table's width
write `PAD_SLOT_ID`, and no index is dereferenced past a buffer's bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl

from ._jit import dual_device_fn, dual_jit
from .contract import PAD_SLOT_ID


def _on_cpu(device: torch.device) -> bool:
    return device.type == "cpu"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1). Plain Python: Triton's helper
    of the same name costs microseconds a call on the launch path."""
    return 1 << max(n - 1, 0).bit_length()


def _search_steps(n: int) -> int:
    """Binary-search iterations for `n` segments, rounded up to a multiple of 4.

    Loop bounds are compile-time constants (some Triton interpreters cannot
    loop over a runtime scalar); rounding keeps the number of variants small.
    """
    return -(-n.bit_length() // 4) * 4


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def refill(dst: torch.Tensor | None, host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host`'s values on `device`: written into `dst` when it fits, else a new tensor.

    Writing in place keeps the address that captured CUDA graphs hold, so a
    rebuild after sleep mode (or a reallocation) refreshes what they read.
    uint64 is copied through an int64 view (same bits; fewer ops support uint64).
    """
    if (
        dst is None
        or dst.shape != host.shape
        or dst.dtype != host.dtype
        or dst.device.type != device.type
        or not dst.is_contiguous()
    ):
        return host.to(device)
    if host.dtype == torch.uint64:
        dst.view(torch.int64).copy_(host.view(torch.int64))
    else:
        dst.copy_(host)
    return dst


@dataclass
class GroupLayout:
    """Per-group kernel inputs of the slot mapping, built from host-side config.

    `params` is int64 `[num_groups, 6]`: block size, CP size of the group (1
    when unsharded), usable columns (0 when slot mapping is disabled), row
    stride of the persistent table, log2 of the block size and of the CP size
    (-1 when not a power of two). Block sizes here are the tables' unit: the
    kernel block sizes.
    """

    table_ptrs: torch.Tensor  # uint64 [num_groups]
    params: torch.Tensor  # int64 [num_groups, 6]
    max_span: int  # most positions one table row covers
    pow2: bool  # every block size and group CP size is a power of two

    @classmethod
    def build(
        cls,
        tables: list[torch.Tensor],
        table_ptrs: torch.Tensor,
        block_sizes: list[int],
        group_cp_sizes: list[int],
        enabled: list[bool],
        device: torch.device,
        params_out: torch.Tensor | None = None,
    ) -> GroupLayout:
        """`params_out`: the previous layout's params, rewritten in place when it fits."""
        log2 = lambda n: n.bit_length() - 1 if _is_pow2(n) else -1  # noqa: E731
        rows = [
            [bs, cp, t.shape[1] if on else 0, t.stride(0), log2(bs), log2(cp)]
            for t, bs, cp, on in zip(tables, block_sizes, group_cp_sizes, enabled)
        ]
        host = torch.tensor(rows, dtype=torch.int64).reshape(-1, 6)  # [num_groups, 6]
        return cls(
            table_ptrs=table_ptrs,
            params=refill(params_out, host, device),
            max_span=max(
                (t.shape[1] * bs * cp for t, bs, cp in zip(tables, block_sizes, group_cp_sizes)),
                default=0,
            ),
            pow2=all(_is_pow2(n) for n in block_sizes + group_cp_sizes),
        )


# ---------------------------------------------------------------- staged writes


@dual_jit
def _apply_writes_kernel(
    dst,  # FUSED: uint64 [num_tensors] data pointers; else the destination tensor
    dst_strides,  # FUSED: int64 [num_tensors] row strides; else the row stride
    tensor_ids,  # int32 [num_writes] (FUSED only)
    rows,  # int32 [num_writes]
    starts,  # int32 [num_writes]
    cu_lens,  # int32 [num_writes] end of each write's contents
    contents,  # [num_elems]
    num_writes,
    num_elems,
    SEARCH_STEPS: tl.constexpr,
    FUSED: tl.constexpr,
    TILE: tl.constexpr,
):
    e = tl.program_id(0) * TILE + tl.arange(0, TILE)  # [TILE] content element
    live = e < num_elems
    # Binary search: the write w with cu_lens[w - 1] <= e < cu_lens[w].
    lo = tl.full([TILE], 0, dtype=tl.int32)
    hi = lo + num_writes
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        active = lo < hi
        end = tl.load(cu_lens + mid, mask=live & active, other=0)
        right = end <= e
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & (right == 0), mid, hi)
    w = lo
    begin = tl.load(cu_lens + w - 1, mask=live & (w > 0), other=0)
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
    """Write `contents[cu_lens[w-1]:cu_lens[w]]` at `dst[rows[w], starts[w]:]` for every w.

    Writes must not overlap (callers resolve overlaps on the host first).
    """
    stride = dst.stride(0) if dst.dim() > 1 else 1
    _launch_apply(dst.device, dst, stride, rows, rows, starts, cu_lens, contents, fused=False)


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
    tile = 8192 if _on_cpu(device) else 1024
    # grid: (cdiv(num_elems, TILE),); one program writes TILE content elements,
    # each finding its write by binary search over cu_lens (and, fused, its
    # destination's pointer and stride).
    _apply_writes_kernel.launch(
        device,
        (_cdiv(num_elems, tile),),
        dst,
        dst_strides,
        tensor_ids,
        rows,
        starts,
        cu_lens,
        contents,
        num_writes,
        num_elems,
        SEARCH_STEPS=_search_steps(num_writes),
        FUSED=fused,
        TILE=tile,
    )


# ---------------------------------------------------------------- gather


@dual_device_fn
def _gather_rows(
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


@dual_jit
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
    _gather_rows(
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


def _gather_launch(
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
    budget, max_cols = (16384, 4096) if _on_cpu(idx_mapping.device) else (2048, 512)
    cols = min(next_power_of_2(max_width), max_cols)
    rows = max(1, budget // cols)
    mask_window = num_computed_tokens is not None
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
    meta = dict(MAX_WIDTH=max_width, MASK_WINDOW=mask_window, ROWS=rows, COLS=cols)
    return (_cdiv(num_rows, rows), num_groups), args, meta


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
    grid, args, meta = _gather_launch(
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


# ---------------------------------------------------------------- slot mappings


@dual_device_fn
def _map_slots(
    tile_index,  # which TILE tokens of the output buffer this program maps
    idx_mapping,  # [num_reqs]
    num_reqs,
    max_num_reqs,
    query_start_loc,  # [num_reqs + 1]
    positions,  # [num_positions]
    num_positions,
    table_ptrs,  # uint64 [num_groups] persistent block tables
    group_params,  # int64 [num_groups, 6], see GroupLayout
    cp_rank,
    cp_interleave,
    interleave_shift,
    out,  # int64 [num_groups, out_len]
    out_stride,
    out_len,
    NUM_GROUPS: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    POS32: tl.constexpr,  # every table spans < 2**31 positions: index math in int32
    POW2: tl.constexpr,  # block sizes, CP sizes and interleave are powers of two
    PAD_ID: tl.constexpr,
    TILE: tl.constexpr,
):
    """Write tokens `[tile_index * TILE, +TILE)` of `out` for every group."""
    t0 = tile_index * TILE
    t = t0 + tl.arange(0, TILE)  # [TILE] token index
    # Batch entry of the tile's first and last token, by scalar binary search:
    # the entry b with qsl[b] <= t < qsl[b + 1], or num_reqs past the batch.
    first = tl.full([], 0, dtype=tl.int32)
    last = first + num_reqs
    hi0 = first + num_reqs
    lo1 = first
    for _ in range(SEARCH_STEPS):
        mid0 = (first + hi0) // 2
        go0 = (first < hi0) & (tl.load(query_start_loc + mid0 + 1, mask=first < hi0) <= t0)
        hi0 = tl.where((first < hi0) & (go0 == 0), mid0, hi0)
        first = tl.where(go0, mid0 + 1, first)
        mid1 = (lo1 + last) // 2
        go1 = (lo1 < last) & (tl.load(query_start_loc + mid1 + 1, mask=lo1 < last) <= t0 + TILE - 1)
        last = tl.where((lo1 < last) & (go1 == 0), mid1, last)
        lo1 = tl.where(go1, mid1 + 1, lo1)
    b = tl.full([TILE], 0, dtype=tl.int32) + first
    if last > first:
        # The tile spans several entries: search each token within [first, last].
        lo = b
        hi = b - first + last
        for _ in range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            active = lo < hi
            end = tl.load(query_start_loc + mid + 1, mask=active, other=0)
            right = end <= t
            lo = tl.where(active & right, mid + 1, lo)
            hi = tl.where(active & (right == 0), mid, hi)
        b = lo
    real = (b < num_reqs) & (t < num_positions)
    r = tl.load(idx_mapping + b, mask=real, other=-1).to(tl.int64)
    owned = real & (r >= 0) & (r < max_num_reqs)
    p = tl.load(positions + t, mask=real, other=0).to(tl.int64)
    # A position past 2**31 lies outside every table when POS32 holds.
    in_range = owned & (p >= 0) & (p < (2**31 if POS32 else 2**62))
    if POS32:
        p = tl.where(in_range, p, 0).to(tl.int32)
    for g in tl.static_range(NUM_GROUPS):
        params = group_params + g * 6
        block_size = tl.load(params + 0).to(p.dtype)
        cp = tl.load(params + 1).to(p.dtype)
        limit = tl.load(params + 2)  # table columns; 0 when the group is disabled
        # An unsharded group (cp == 1) has owner 0 and local offset o on every rank.
        # Scalar flags enter as integers: Triton's interpreter mis-types
        # `scalar_bool | block_bool`.
        rank = tl.where(cp == 1, 0, cp_rank)
        if POW2:
            block_shift = tl.load(params + 4).to(p.dtype)
            cp_shift = tl.load(params + 5).to(p.dtype)
            col = p >> (block_shift + cp_shift)
            o = p & ((block_size << cp_shift) - 1)
            mine = ((o >> interleave_shift) & (cp - 1)) == rank
            local = ((o >> (interleave_shift + cp_shift)) << interleave_shift) | (
                o & (cp_interleave - 1)
            )
        else:
            virtual = block_size * cp
            col = p // virtual
            o = p - col * virtual
            mine = (o // cp_interleave) % cp == rank
            local = (o // (cp_interleave * cp)) * cp_interleave + o % cp_interleave
        ok = in_range & mine & (col < limit)
        table = tl.load(table_ptrs + g).to(tl.pointer_type(tl.int32))
        block = tl.load(table + r * tl.load(params + 3) + col, mask=ok, other=0)
        slot = block.to(tl.int64) * block_size.to(tl.int64) + local.to(tl.int64)
        slot = tl.where(ok, slot, PAD_ID)
        tl.store(out + g * out_stride + t, slot, mask=t < out_len)


@dual_jit
def _compute_slot_mappings_kernel(
    idx_mapping,
    num_reqs,
    max_num_reqs,
    query_start_loc,
    positions,
    num_positions,
    table_ptrs,
    group_params,
    cp_rank,
    cp_interleave,
    interleave_shift,
    out,
    out_stride,
    out_len,
    NUM_GROUPS: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    POS32: tl.constexpr,
    POW2: tl.constexpr,
    PAD_ID: tl.constexpr,
    TILE: tl.constexpr,
):
    _map_slots(
        tl.program_id(0),
        idx_mapping,
        num_reqs,
        max_num_reqs,
        query_start_loc,
        positions,
        num_positions,
        table_ptrs,
        group_params,
        cp_rank,
        cp_interleave,
        interleave_shift,
        out,
        out_stride,
        out_len,
        NUM_GROUPS,
        SEARCH_STEPS,
        POS32,
        POW2,
        PAD_ID,
        TILE,
    )


def _slots_launch(
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    max_num_reqs: int,
    layout: GroupLayout,
    cp_rank: int,
    cp_interleave: int,
    out: torch.Tensor,
) -> tuple[int, tuple, dict]:
    """`(programs, args, constexprs)` of a slot mapping: one program per TILE tokens."""
    num_groups, out_len = out.shape
    tile, warps = _slot_mapping_tile(out.device, out_len)
    pow2 = layout.pow2 and _is_pow2(cp_interleave)
    args = (
        idx_mapping,
        idx_mapping.shape[0],
        max_num_reqs,
        query_start_loc,
        positions,
        positions.shape[0],
        layout.table_ptrs,
        layout.params,
        cp_rank,
        cp_interleave,
        cp_interleave.bit_length() - 1,
        out,
        out.stride(0),
        out_len,
    )
    meta = dict(
        NUM_GROUPS=num_groups,
        SEARCH_STEPS=_search_steps(max_num_reqs),
        POS32=layout.max_span < 2**31,
        POW2=pow2,
        PAD_ID=PAD_SLOT_ID,
        TILE=tile,
        num_warps=warps,
    )
    return (_cdiv(out_len, tile) if num_groups else 0), args, meta


def compute_slot_mappings(
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    max_num_reqs: int,
    layout: GroupLayout,
    cp_rank: int,
    cp_interleave: int,
    out: torch.Tensor,
) -> None:
    """Fill every entry of `out` `[num_groups, out_len]`: SPEC.md section 2 or `PAD_SLOT_ID`.

    Index arithmetic runs in int32 when every table spans fewer than 2**31
    positions, and in shifts and masks when every size is a power of two:
    int64 division is emulated on GPUs and dominated the kernel's time.
    """
    programs, args, meta = _slots_launch(
        idx_mapping, query_start_loc, positions, max_num_reqs, layout, cp_rank, cp_interleave, out
    )
    # grid: (cdiv(out_len, TILE),); one program maps TILE tokens of the buffer
    # for every group, finding each token's batch entry by binary search.
    _compute_slot_mappings_kernel.launch(out.device, (programs,), *args, **meta)


# ---------------------------------------------------------------- both reads, one launch


@dual_jit
def _gather_and_slot_mappings_kernel(
    # the gather's arguments (see _gather_rows)
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
    # the slot mapping's arguments (see _map_slots); idx_mapping, num_reqs and
    # max_num_reqs are the gather's
    s_idx_mapping,
    s_num_reqs,
    s_max_num_reqs,
    query_start_loc,
    positions,
    num_positions,
    table_ptrs,
    group_params,
    cp_rank,
    cp_interleave,
    interleave_shift,
    out,
    out_stride,
    out_len,
    gather_programs,  # programs [0, gather_programs) gather, the rest map slots
    MAX_WIDTH: tl.constexpr,
    MASK_WINDOW: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    POS32: tl.constexpr,
    POW2: tl.constexpr,
    PAD_ID: tl.constexpr,
    TILE: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < gather_programs:
        _gather_rows(
            pid // NUM_GROUPS,
            pid % NUM_GROUPS,
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
    else:
        _map_slots(
            pid - gather_programs,
            s_idx_mapping,
            s_num_reqs,
            s_max_num_reqs,
            query_start_loc,
            positions,
            num_positions,
            table_ptrs,
            group_params,
            cp_rank,
            cp_interleave,
            interleave_shift,
            out,
            out_stride,
            out_len,
            NUM_GROUPS,
            SEARCH_STEPS,
            POS32,
            POW2,
            PAD_ID,
            TILE,
        )


def gather_and_compute_slot_mappings(
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
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    layout: GroupLayout,
    cp_rank: int,
    cp_interleave: int,
    out: torch.Tensor,
) -> None:
    """`gather_block_tables` and `compute_slot_mappings` in one launch.

    The two jobs touch disjoint memory (the gather writes the forward-pass
    tables, the slot mapping reads the persistent ones and writes `out`), so
    their programs may run in any order.
    """
    (row_blocks, num_groups), g_args, g_meta = _gather_launch(
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
    slot_programs, s_args, s_meta = _slots_launch(
        idx_mapping, query_start_loc, positions, max_num_reqs, layout, cp_rank, cp_interleave, out
    )
    gather_programs = row_blocks * num_groups
    # grid: (gather_programs + slot_programs,); program q < gather_programs
    # fills ROWS destination rows of group q % num_groups (row block
    # q // num_groups); program gather_programs + i maps tokens
    # [i * TILE, (i + 1) * TILE) of `out` for every group.
    _gather_and_slot_mappings_kernel.launch(
        out.device,
        (gather_programs + slot_programs,),
        *g_args,
        *s_args,
        gather_programs,
        **g_meta,
        **s_meta,
    )


def _slot_mapping_tile(device: torch.device, out_len: int) -> tuple[int, int]:
    """Tokens per program and warps: few, large programs on CPU.

    On an H200 at 4M tokens, 512 tokens on 4 warps beat 1024 on 4 by 6-14%
    and 2048-8192 (4-16 warps) by 20-50%.
    """
    if _on_cpu(device):
        return 8192, 4
    return 512, 4
