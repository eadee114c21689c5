"""Slot mappings: the KV-cache slot every token writes on this rank (SPEC.md section 2).

The kernel runs one of two program layouts (`slot_programs`): by tile, or by
request for steps of many short requests. `by_request` picks one per call on
the host, from sizes the host already has (no device data, no sync); both
write the same slots into every entry of the buffer.
"""

from __future__ import annotations

import torch
import triton.language as tl

from .._jit import dual_jit
from ..contract import PAD_SLOT_ID
from ._common import cdiv, host_tile, is_pow2, on_cpu, search_steps
from .layout import GroupLayout
from .slot_programs import slot_program

SMALL_BATCH_TOKENS = 8192
"""The most padded tokens of a step mapped by request; a request program reaches this far."""
SHORT_REQUEST_TOKENS = 64
"""The most padded tokens per batch entry, on average, of a step mapped by request."""
INTERPRETED_REQUEST_PROGRAMS = 8
"""On CPU, the most request programs (batch entries x groups) of a step mapped by request."""


def by_request(num_reqs: int, num_tokens_padded: int, most_reqs: int) -> bool:
    """Whether a step is mapped by request, else by tile.

    By request when the step has at most SMALL_BATCH_TOKENS padded tokens and
    at most SHORT_REQUEST_TOKENS of them per batch entry on average: many
    short requests, where a tile spans many entries and its searches are deep,
    while a request program needs one REQ_TILE step, or a few. The first bound
    also keeps every request within a request program's reach. Few, long
    requests (a lone prefill chunk) stay by tile, which spreads one request
    over many programs where a request program would walk it step by step.
    `most_reqs` (`_SlotLaunch`) bounds the batch entries on CPU.
    """
    return (
        num_reqs <= most_reqs
        and num_tokens_padded <= SMALL_BATCH_TOKENS
        and num_tokens_padded <= SHORT_REQUEST_TOKENS * num_reqs
    )


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
    BY_REQUEST: tl.constexpr,
    REQ_TILE: tl.constexpr,
    REQ_TILES: tl.constexpr,
):
    slot_program(
        tl.program_id(0), idx_mapping, num_reqs, max_num_reqs, query_start_loc, positions,
        num_positions, table_ptrs, group_params, cp_rank, cp_interleave, interleave_shift, out,
        out_stride, out_len, NUM_GROUPS, SEARCH_STEPS, POS32, POW2, PAD_ID, TILE, BY_REQUEST,
        REQ_TILE, REQ_TILES,
    )  # fmt: skip


class _SlotLaunch:
    """What a slot mapping into one buffer shape launches, in either layout; built once
    per launch shape (`_slot_launch`), not on every call."""

    def __init__(
        self, on_host: bool, num_groups: int, out_len: int, layout: GroupLayout,
        cp_interleave: int, max_num_reqs: int,
    ) -> None:  # fmt: skip
        device = torch.device("cpu" if on_host else "cuda")
        tile, warps = _slot_mapping_tile(device, out_len)
        req_tile, req_tiles = _request_tile(device, out_len)
        cover = req_tile * req_tiles
        # A tail program's tile must lie wholly below or wholly past a request program's
        # reach: where the tile layout's tile (up to HOST_TILE on CPU) passes the reach, the
        # request layout's tail programs take the largest power of two dividing it.
        tail = tile if cover >= out_len or cover % tile == 0 else min(tile, cover & -cover)
        self.num_groups = num_groups
        self.tiles = cdiv(out_len, tile) if num_groups else 0  # programs by tile; 0: no launch
        self.tail_tiles = cdiv(out_len, tail) if num_groups else 0  # tail programs by request
        # The interpreter pays per program instance: few request programs on CPU.
        self.most_reqs = (
            max(1, INTERPRETED_REQUEST_PROGRAMS // max(num_groups, 1)) if on_host else max_num_reqs
        )
        self.tile_meta = dict(
            NUM_GROUPS=num_groups,
            SEARCH_STEPS=search_steps(max_num_reqs, exact=on_host),
            POS32=layout.max_span < 2**31,
            POW2=layout.pow2 and is_pow2(cp_interleave),
            PAD_ID=PAD_SLOT_ID,
            TILE=tile,
            BY_REQUEST=False,
            REQ_TILE=1,  # unused by tile: fixed, so that they add no compiled variants
            REQ_TILES=1,
            num_warps=warps,
        )
        self.request_meta = {
            **self.tile_meta, "BY_REQUEST": True, "REQ_TILE": req_tile, "REQ_TILES": req_tiles,
            "TILE": tail,
        }  # fmt: skip

    def pick(self, num_reqs: int, num_tokens_padded: int) -> tuple[int, dict]:
        """`(programs, constexprs)` of one call, in the layout `by_request` picks."""
        if self.tiles and by_request(num_reqs, num_tokens_padded, self.most_reqs):
            return self.tail_tiles + num_reqs * self.num_groups, self.request_meta
        return self.tiles, self.tile_meta


_SLOT_LAUNCHES: dict[tuple, _SlotLaunch] = {}


def _slot_launch(
    on_host: bool, num_groups: int, out_len: int, layout: GroupLayout, cp_interleave: int,
    max_num_reqs: int,
) -> _SlotLaunch:  # fmt: skip
    key = (on_host, num_groups, out_len, layout.pow2, layout.max_span, cp_interleave, max_num_reqs)
    found = _SLOT_LAUNCHES.get(key)
    if found is None:
        found = _SLOT_LAUNCHES[key] = _SlotLaunch(
            on_host, num_groups, out_len, layout, cp_interleave, max_num_reqs
        )
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
    num_tokens_padded: int,
) -> tuple[int, tuple, dict]:
    """`(programs, args, constexprs)` of a slot mapping, in the layout `by_request` picks."""
    num_groups, out_len = out.shape
    num_reqs = idx_mapping.shape[0]
    launch = _slot_launch(out.is_cpu, num_groups, out_len, layout, cp_interleave, max_num_reqs)
    programs, meta = launch.pick(num_reqs, num_tokens_padded)
    args = (
        idx_mapping,
        num_reqs,
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

    Everything but the batch is bound here, the constants of both layouts
    included: per call only `idx_mapping`, `query_start_loc`, `positions`,
    their sizes and the layout's choice reach the launch. Same kernel, same
    arguments as `compute_slot_mappings`.
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
        self.pick = _slot_launch(
            out.is_cpu, num_groups, out_len, layout, cp_interleave, max_num_reqs
        ).pick
        self.device = out.device
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

    def layout(self, num_reqs: int, num_tokens_padded: int) -> str:
        """`"request"` or `"tile"`: the layout a call with these sizes runs (for reports)."""
        return "request" if self.pick(num_reqs, num_tokens_padded)[1]["BY_REQUEST"] else "tile"

    def launch(
        self,
        idx_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        num_tokens_padded: int,
    ) -> None:
        num_reqs = idx_mapping.shape[0]
        # grid by tile: (cdiv(out_len, TILE),), one program per TILE tokens of the
        # buffer, every group. By request: (num_reqs * num_groups + cdiv(out_len,
        # TILE),), one program per batch entry and group, then the tile programs
        # that pad the tail.
        programs, meta = self.pick(num_reqs, num_tokens_padded)
        _compute_slot_mappings_kernel.launch(
            self.device,
            (programs,),
            idx_mapping,
            num_reqs,
            self.max_num_reqs,
            query_start_loc,
            positions,
            positions.shape[0],
            *self.tail,
            **meta,
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
    num_tokens_padded: int,
) -> None:
    """Fill every entry of `out` `[num_groups, out_len]`: SPEC.md section 2 or `PAD_SLOT_ID`.

    `num_tokens_padded` (at least the batch's tokens) only picks the layout.
    Index arithmetic runs in int32 when every table spans fewer than 2**31
    positions, and in shifts and masks when every size is a power of two:
    int64 division is emulated on GPUs and dominated the kernel's time.
    """
    programs, args, meta = slot_mapping_launch_args(
        idx_mapping, query_start_loc, positions, max_num_reqs, layout, cp_rank, cp_interleave,
        out, num_tokens_padded,
    )  # fmt: skip
    # grid by tile: (cdiv(out_len, TILE),), one program maps TILE tokens of the
    # buffer for every group, finding each token's batch entry by binary search.
    # grid by request: (num_reqs * num_groups + cdiv(out_len, TILE),), one
    # program maps one batch entry in one group, then tile programs pad the tail.
    _compute_slot_mappings_kernel.launch(out.device, (programs,), *args, **meta)


def _request_tile(device: torch.device, out_len: int) -> tuple[int, int]:
    """`(REQ_TILE, REQ_TILES)`: tokens per step of a request program's loop, and
    its steps, enough to reach `min(out_len, SMALL_BATCH_TOKENS)` tokens.

    On GPUs 1024-token steps (the rival's tile): a request of up to 8192
    tokens takes at most 8. On CPU 32-token steps, so that small steps, such
    as the harness's, reach the loop past its first step.
    """
    step = 32 if on_cpu(device) else 1024
    return step, cdiv(min(out_len, SMALL_BATCH_TOKENS), step)


def _slot_mapping_tile(device: torch.device, out_len: int) -> tuple[int, int]:
    """Tokens per tile program and warps: few, large programs on CPU.

    On an H200 at 4M tokens, 512 tokens on 4 warps beat 1024 on 4 by 6-14%
    and 2048-8192 (4-16 warps) by 20-50%.
    """
    if on_cpu(device):
        return host_tile(out_len), 4
    return 512, 4
