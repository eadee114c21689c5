"""Slot mappings: the KV-cache slot every token writes on this rank (SPEC.md section 2).

`map_slots` is the work of one program; the slot-mapping kernel and the
fused read kernel (`fused_reads`) both call it.
"""

from __future__ import annotations

import torch
import triton.language as tl

from .._jit import dual_device_fn, dual_jit
from ..contract import PAD_SLOT_ID
from ._common import cdiv, host_tile, is_pow2, on_cpu, search_steps
from .layout import GroupLayout


@dual_device_fn
def map_slots(
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


@dual_jit(do_not_specialize=("num_reqs", "num_positions"))
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
    map_slots(
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


_SLOT_META: dict[tuple, tuple[int, dict]] = {}
"""`(programs, constexprs)` per launch shape: computed once, not on every call."""


def _slot_mapping_meta(
    on_host: bool, num_groups: int, out_len: int, layout: GroupLayout, cp_interleave: int,
    max_num_reqs: int,
) -> tuple[int, dict]:  # fmt: skip
    key = (on_host, num_groups, out_len, layout.pow2, layout.max_span, cp_interleave, max_num_reqs)
    found = _SLOT_META.get(key)
    if found is None:
        tile, warps = _slot_mapping_tile(torch.device("cpu" if on_host else "cuda"), out_len)
        meta = dict(
            NUM_GROUPS=num_groups,
            SEARCH_STEPS=search_steps(max_num_reqs, exact=on_host),
            POS32=layout.max_span < 2**31,
            POW2=layout.pow2 and is_pow2(cp_interleave),
            PAD_ID=PAD_SLOT_ID,
            TILE=tile,
            num_warps=warps,
        )
        found = _SLOT_META[key] = ((cdiv(out_len, tile) if num_groups else 0), meta)
    return found


def slot_mapping_launch_args(
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
    programs, meta = _slot_mapping_meta(
        out.is_cpu, num_groups, out_len, layout, cp_interleave, max_num_reqs
    )
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
    return programs, args, meta


class SlotMappingPlan:
    """A slot mapping into one fixed output buffer, prepared once (per layout build).

    Everything but the batch is bound here: per call only `idx_mapping`,
    `query_start_loc`, `positions` and their sizes reach the launch. Same
    kernel, same arguments as `compute_slot_mappings`.
    """

    def __init__(
        self,
        layout: GroupLayout,
        max_num_reqs: int,
        cp_rank: int,
        cp_interleave: int,
        out: torch.Tensor,
    ) -> None:
        num_groups, out_len = out.shape
        programs, self.meta = _slot_mapping_meta(
            out.is_cpu, num_groups, out_len, layout, cp_interleave, max_num_reqs
        )
        self.device = out.device
        self.grid = (programs,)
        self.max_num_reqs = max_num_reqs
        self.tail = (
            layout.table_ptrs,
            layout.params,
            cp_rank,
            cp_interleave,
            cp_interleave.bit_length() - 1,
            out,
            out.stride(0),
            out_len,
        )

    def launch(
        self, idx_mapping: torch.Tensor, query_start_loc: torch.Tensor, positions: torch.Tensor
    ) -> None:
        _compute_slot_mappings_kernel.launch(
            self.device,
            self.grid,
            idx_mapping,
            idx_mapping.shape[0],
            self.max_num_reqs,
            query_start_loc,
            positions,
            positions.shape[0],
            *self.tail,
            **self.meta,
        )


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
    programs, args, meta = slot_mapping_launch_args(
        idx_mapping, query_start_loc, positions, max_num_reqs, layout, cp_rank, cp_interleave, out
    )
    # grid: (cdiv(out_len, TILE),); one program maps TILE tokens of the buffer
    # for every group, finding each token's batch entry by binary search.
    _compute_slot_mappings_kernel.launch(out.device, (programs,), *args, **meta)


def _slot_mapping_tile(device: torch.device, out_len: int) -> tuple[int, int]:
    """Tokens per program and warps: few, large programs on CPU.

    On an H200 at 4M tokens, 512 tokens on 4 warps beat 1024 on 4 by 6-14%
    and 2048-8192 (4-16 warps) by 20-50%.
    """
    if on_cpu(device):
        return host_tile(out_len), 4
    return 512, 4
