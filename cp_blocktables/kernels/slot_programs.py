"""The programs of a slot mapping (SPEC.md section 2), in two layouts.

Both fill every entry of the output buffer with the same slots; the slot
mapping kernel and the fused read kernel (`fused_reads`) run either through
`slot_program`:

- by tile (`map_slots`): program `i` maps tokens `[i * TILE, +TILE)` of the
  buffer for every group, finding each token's batch entry by binary search
  over `query_start_loc`. Parallel over tokens whatever the requests'
  lengths, which large batches and long requests need; when a tile spans
  many requests its searches cost about 24 dependent loads before the first
  store.
- by request (`map_request_slots`): program `(b, g)` maps batch entry `b`'s
  tokens in group `g`, REQ_TILE at a time, from `qsl[b]`, `qsl[b + 1]` and
  `idx_mapping[b]`, loaded side by side: three dependent loads (bounds,
  positions, table) before its first store. Tile programs after them pad the
  tail `[num_tokens, out_len)`. What batches of many short requests need.

Both compute slots through `token_positions` and `group_slots`, the arithmetic
of section 2, so they cannot drift apart. The host picks the layout
(`slot_mappings.by_request`).
"""

from __future__ import annotations

import triton.language as tl

from .._jit import dual_device_fn


@dual_device_fn
def token_positions(
    t,  # [N] token indices
    real,  # [N] tokens of a batch entry with a position to read
    r,  # [N] int64 row of each token's request, -1 for a dummy
    positions,  # [num_positions]
    max_num_reqs,
    POS32: tl.constexpr,
):
    """`(p, in_range)`: each token's position (int32 under POS32, else int64) and
    whether it is a real request's token whose position may lie in a table."""
    owned = real & (r >= 0) & (r < max_num_reqs)
    p = tl.load(positions + t, mask=real, other=0).to(tl.int64)
    # A position past 2**31 lies outside every table when POS32 holds.
    in_range = owned & (p >= 0) & (p < (2**31 if POS32 else 2**62))
    if POS32:
        p = tl.where(in_range, p, 0).to(tl.int32)
    return p, in_range


@dual_device_fn
def group_slots(
    g,  # the group
    p,  # [N] positions, from token_positions
    r,  # [N] int64 rows
    in_range,  # [N] from token_positions
    table_ptrs,  # uint64 [num_groups] persistent block tables
    group_params,  # int64 [num_groups, 6], see GroupLayout
    cp_rank,
    cp_interleave,
    interleave_shift,
    POW2: tl.constexpr,  # block sizes, CP sizes and interleave are powers of two
    PAD_ID: tl.constexpr,
):
    """[N] int64: each token's slot in group `g` (SPEC.md section 2), or PAD_ID."""
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
    return tl.where(ok, slot, PAD_ID)


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
    """The tile layout: write tokens `[tile_index * TILE, +TILE)` of `out` for every group."""
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
    p, in_range = token_positions(t, real, r, positions, max_num_reqs, POS32)
    # A run-time loop: unrolled, a model of hundreds of groups compiles for minutes.
    for g in range(NUM_GROUPS):
        slot = group_slots(
            g, p, r, in_range, table_ptrs, group_params, cp_rank, cp_interleave,
            interleave_shift, POW2, PAD_ID,
        )  # fmt: skip
        tl.store(out + g * out_stride + t, slot, mask=t < out_len)


@dual_device_fn
def map_request_slots(
    q,  # the program: a request program, or a tail program past them
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
    POS32: tl.constexpr,
    POW2: tl.constexpr,
    PAD_ID: tl.constexpr,
    TILE: tl.constexpr,  # tokens of a tail program (the tile layout's TILE)
    REQ_TILE: tl.constexpr,  # tokens a request program maps per step
    REQ_TILES: tl.constexpr,  # its steps; it covers tokens below REQ_TILE * REQ_TILES
):
    """The request layout: program `q` of `num_reqs * NUM_GROUPS` request programs,
    then `cdiv(out_len, TILE)` tail programs.

    Request program `q` maps batch entry `q // NUM_GROUPS` in group
    `q % NUM_GROUPS`: its tokens below COVER = REQ_TILE * REQ_TILES, which are
    all of them whenever the batch has at most COVER tokens (`by_request`
    sees to that). Tail program `i` writes PAD_ID over the tokens of
    `[i * TILE, +TILE)` past the batch, for every group; a tile at or past
    COVER that still holds batch tokens (a batch larger than its
    `num_tokens_padded` said) is mapped by `map_slots` instead, so the request
    layout equals the tile layout for every input. COVER is at least `out_len`
    or a multiple of TILE: no tail tile straddles it.
    """
    cover = REQ_TILE * REQ_TILES
    request_programs = num_reqs * NUM_GROUPS
    if q < request_programs:
        b = q // NUM_GROUPS
        g = q % NUM_GROUPS
        # Three independent loads. Entry 0 starts at token 0 whatever qsl[0]
        # holds, as the tile layout's search has it.
        start = tl.load(query_start_loc + b, mask=b > 0, other=0)
        end = tl.minimum(tl.load(query_start_loc + b + 1), cover)
        r = tl.full([REQ_TILE], 0, tl.int64) + tl.load(idx_mapping + b).to(tl.int64)
        # A constant bound (some Triton interpreters cannot loop over a loaded scalar).
        for i in range(REQ_TILES):
            t0 = start + i * REQ_TILE
            if t0 < end:
                t = t0 + tl.arange(0, REQ_TILE)  # [REQ_TILE] token index
                mine = (t >= 0) & (t < end)
                real = mine & (t < num_positions)
                p, in_range = token_positions(t, real, r, positions, max_num_reqs, POS32)
                slot = group_slots(
                    g, p, r, in_range, table_ptrs, group_params, cp_rank, cp_interleave,
                    interleave_shift, POW2, PAD_ID,
                )  # fmt: skip
                tl.store(out + g * out_stride + t, slot, mask=mine & (t < out_len))
    else:
        tile_index = q - request_programs
        t0 = tile_index * TILE
        num_tokens = tl.load(query_start_loc + num_reqs)
        num_tokens = tl.where(num_reqs > 0, num_tokens, 0)  # no entries: every token pads
        # Scalar flags enter as integers (see group_slots).
        past_cover = tl.where(t0 >= cover, 1, 0) * tl.where(t0 < num_tokens, 1, 0)
        if past_cover != 0:
            map_slots(
                tile_index, idx_mapping, num_reqs, max_num_reqs, query_start_loc, positions,
                num_positions, table_ptrs, group_params, cp_rank, cp_interleave,
                interleave_shift, out, out_stride, out_len, NUM_GROUPS, SEARCH_STEPS, POS32,
                POW2, PAD_ID, TILE,
            )  # fmt: skip
        else:
            t = t0 + tl.arange(0, TILE)  # [TILE]
            pad = (t >= num_tokens) & (t < out_len)
            for g in range(NUM_GROUPS):
                tl.store(out + g * out_stride + t, tl.full([TILE], PAD_ID, tl.int64), mask=pad)


@dual_device_fn
def slot_program(
    q,
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
    BY_REQUEST: tl.constexpr,  # the request layout, else the tile layout
    REQ_TILE: tl.constexpr,
    REQ_TILES: tl.constexpr,
):
    """Program `q` of a slot mapping, in the layout BY_REQUEST names."""
    if BY_REQUEST:
        map_request_slots(
            q, idx_mapping, num_reqs, max_num_reqs, query_start_loc, positions, num_positions,
            table_ptrs, group_params, cp_rank, cp_interleave, interleave_shift, out,
            out_stride, out_len, NUM_GROUPS, SEARCH_STEPS, POS32, POW2, PAD_ID, TILE,
            REQ_TILE, REQ_TILES,
        )  # fmt: skip
    else:
        map_slots(
            q, idx_mapping, num_reqs, max_num_reqs, query_start_loc, positions, num_positions,
            table_ptrs, group_params, cp_rank, cp_interleave, interleave_shift, out,
            out_stride, out_len, NUM_GROUPS, SEARCH_STEPS, POS32, POW2, PAD_ID, TILE,
        )  # fmt: skip
