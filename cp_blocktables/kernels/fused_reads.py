"""A step's two reads, the gather and the slot mapping, in one launch (SPEC.md 8.2)."""

from __future__ import annotations

import torch
import triton.language as tl

from .._jit import dual_jit
from .gather import gather_launch_args, gather_rows
from .layout import GroupLayout
from .slot_mappings import slot_mapping_launch_args
from .slot_programs import slot_program


@dual_jit(
    do_not_specialize=(
        "num_reqs", "num_rows", "s_num_reqs", "num_positions", "gather_programs"
    )
)  # fmt: skip
def _gather_and_slot_mappings_kernel(
    # the gather's arguments (see gather_rows)
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
    # the slot mapping's arguments (see slot_program); idx_mapping, num_reqs and
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
    BY_REQUEST: tl.constexpr,
    REQ_TILE: tl.constexpr,
    REQ_TILES: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < gather_programs:
        gather_rows(
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
        slot_program(
            pid - gather_programs, s_idx_mapping, s_num_reqs, s_max_num_reqs, query_start_loc,
            positions, num_positions, table_ptrs, group_params, cp_rank, cp_interleave,
            interleave_shift, out, out_stride, out_len, NUM_GROUPS, SEARCH_STEPS, POS32, POW2,
            PAD_ID, TILE, BY_REQUEST, REQ_TILE, REQ_TILES,
        )  # fmt: skip


_FUSED_META: dict[tuple[int, int], dict] = {}
"""The two launchers' constexprs merged, once per pair of (cached) constexpr dicts."""


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
    num_tokens_padded: int,
) -> None:
    """`gather_block_tables` and `compute_slot_mappings` in one launch.

    The two jobs touch disjoint memory (the gather writes the forward-pass
    tables, the slot mapping reads the persistent ones and writes `out`), so
    their programs may run in any order.
    """
    (row_blocks, num_groups), g_args, g_meta = gather_launch_args(
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
    slot_programs, s_args, s_meta = slot_mapping_launch_args(
        idx_mapping, query_start_loc, positions, max_num_reqs, layout, cp_rank, cp_interleave,
        out, num_tokens_padded,
    )  # fmt: skip
    gather_programs = row_blocks * num_groups
    # grid: (gather_programs + slot_programs,); program q < gather_programs
    # fills ROWS destination rows of group q % num_groups (row block
    # q // num_groups); program gather_programs + i is program i of the slot
    # mapping in the layout `slot_mapping_launch_args` picked: by tile, it maps
    # tokens [i * TILE, (i + 1) * TILE) of `out` for every group; by request,
    # i < num_reqs * num_groups maps batch entry i // num_groups in group
    # i % num_groups and the tile programs after those pad the tail.
    key = (id(g_meta), id(s_meta))  # both are cached per launch shape, so ids are stable
    meta = _FUSED_META.get(key)
    if meta is None:
        meta = _FUSED_META[key] = {**g_meta, **s_meta}
    _gather_and_slot_mappings_kernel.launch(
        out.device, (gather_programs + slot_programs,), *g_args, *s_args, gather_programs, **meta
    )
