"""The independent reference: SPEC.md sections 2, 3 and 8.1 in plain numpy.

Everything the tests and the harness expect comes from here. It is written
straight from the formulas, one token at a time where that is clearest, and
never calls the Triton kernels, `BlockTables`, or the config's derived helpers:
every rule (which ranks share a group, which reaches mask, the kernel block
size) is derived below from the raw constructor arguments, so that a wrong
shared helper cannot move implementation and expectation together.

Formulas (section 2), for a DCP-sharded group under `C > 1`, block size `bs`,
interleave `I`, virtual block `V = bs * C`, `o = p mod V`:

    owner(p)  = (o // I) mod C
    local(p)  = (o // (I*C)) * I + (o mod I)          # always < bs
    slot_k(p) = table[r][p // V] * bs + local(p)      if owner(p) == k else PAD

Unsharded group or `C == 1`: `slot(p) = table[r][p // bs] * bs + p mod bs` on every rank.

Kernel blocks (section 8.1): the allocator's block of `B` tokens is `m = B // K`
kernel blocks of `K` tokens; allocator id `b` is kernel ids `b*m .. b*m+m-1`.
Tables hold kernel ids, counts are in kernel blocks, and every formula above
runs with `bs = K`. The `block_size` argument of the functions below is that
`bs`: the kernel block size (equal to the allocator's when `K == B`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .contract import NULL_BLOCK_ID, PAD_SLOT_ID

# ---------------------------------------------------------------- section 2


def owner(positions: np.ndarray | int, cp_size: int, interleave: int, block_size: int):
    """The rank that owns each position of a sharded group."""
    o = np.asarray(positions, dtype=np.int64) % (block_size * cp_size)
    return (o // interleave) % cp_size


def local_offset(positions: np.ndarray | int, cp_size: int, interleave: int, block_size: int):
    """The offset inside the owner's physical block (always `< block_size`)."""
    o = np.asarray(positions, dtype=np.int64) % (block_size * cp_size)
    return (o // (interleave * cp_size)) * interleave + (o % interleave)


def local_len(seq_len: int, cp_rank: int, cp_size: int, interleave: int) -> int:
    """How many positions `< seq_len` rank `cp_rank` owns (independent of block sizes)."""
    span = cp_size * interleave
    rem = seq_len % span - cp_rank * interleave
    return (seq_len // span) * interleave + min(max(rem, 0), interleave)


def owned_positions(
    seq_len: int, cp_rank: int, cp_size: int, interleave: int, block_size: int, start: int = 0
) -> np.ndarray:
    """The positions in `[start, seq_len)` that `cp_rank` owns, ascending (by brute force).

    `start` lets a caller look at a request's last positions alone, without an
    array as long as the request (a request may start past 2**31).
    """
    p = np.arange(start, seq_len, dtype=np.int64)
    return p[owner(p, cp_size, interleave, block_size) == cp_rank]


def expand_block_ids(block_ids: Sequence[int] | np.ndarray, m: int) -> np.ndarray:
    """Allocator ids to kernel ids: id `b` becomes `b*m, b*m+1, ..., b*m+m-1`, in order."""
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    return (ids[:, None] * m + np.arange(m, dtype=np.int64)[None, :]).reshape(-1)


def _kernel_row(
    table_row: Sequence[int] | np.ndarray, block_size: int, kernel_block_size: int | None
) -> tuple[np.ndarray, int]:
    """`(row of kernel ids, bs)`: expands an allocator row when `kernel_block_size` is given."""
    row = np.asarray(table_row, dtype=np.int64)
    if kernel_block_size is None or kernel_block_size == block_size:
        return row, block_size
    if kernel_block_size < 1 or block_size % kernel_block_size:
        raise ValueError(f"kernel block size {kernel_block_size} does not divide {block_size}")
    return expand_block_ids(row, block_size // kernel_block_size), kernel_block_size


def slots_for_positions(
    table_row: np.ndarray,
    positions: np.ndarray,
    block_size: int,
    cp_size: int,
    cp_rank: int,
    interleave: int,
    kernel_block_size: int | None = None,
) -> np.ndarray:
    """Section 2's write slot of each position for one request on one rank.

    Pass `cp_size=1` for an unsharded group. `table_row` holds blocks of
    `block_size` tokens; with `kernel_block_size` it holds allocator ids of
    `block_size` tokens, expanded here into kernel ids of `kernel_block_size`
    (section 8.1). Positions whose table column lies outside the row are an
    error: the contract forbids them.
    """
    row, bs = _kernel_row(table_row, block_size, kernel_block_size)
    p = np.asarray(positions, dtype=np.int64)
    virtual = bs * cp_size
    cols = p // virtual
    if p.size and (p.min() < 0 or cols.max() >= len(row)):
        raise IndexError("position outside the request's block-table row")
    blocks = row[cols]
    if cp_size == 1:
        return blocks * bs + p % bs
    slots = blocks * bs + local_offset(p, cp_size, interleave, bs)
    mine = owner(p, cp_size, interleave, bs) == cp_rank
    return np.where(mine, slots, PAD_SLOT_ID).astype(np.int64)


def read_slots(
    table_row: np.ndarray,
    num_local: int,
    block_size: int,
    kernel_block_size: int | None = None,
    first: int = 0,
) -> np.ndarray:
    """The read path: slot of the `q`-th local token, `first <= q < num_local`, on its rank.

    `kernel_block_size` as in `slots_for_positions`; `[num_local - first]`.
    """
    row, bs = _kernel_row(table_row, block_size, kernel_block_size)
    q = np.arange(first, num_local, dtype=np.int64)
    return row[q // bs] * bs + q % bs


# ---------------------------------------------------------------- rules from raw arguments


class _Rules:
    """Per-group rules read from the raw constructor arguments (defaults filled here).

    Deliberately independent of `BlockTablesConfig`'s helpers: a sharded group
    spreads over `cp_size` ranks, an unsharded one over 1; every reach is 0
    under `cp_size > 1`; the kernel block size defaults to the block size.
    """

    def __init__(self, config: object) -> None:
        block_sizes = [int(b) for b in config.block_sizes]
        n = len(block_sizes)
        cp_size = int(config.cp_size)
        sharded = _or_default(getattr(config, "dcp_sharded", None), [True] * n)
        reach = _or_default(getattr(config, "sliding_window_reach", None), [0] * n)
        kernel = _or_default(getattr(config, "kernel_block_sizes", None), block_sizes)
        self.num_groups = n
        self.max_num_reqs = int(config.max_num_reqs)
        self.cp_rank = int(config.cp_rank)
        self.interleave = int(config.cp_interleave)
        self.enabled = _or_default(getattr(config, "slot_mapping_enabled", None), [True] * n)
        self.block_sizes = block_sizes
        self.kernel_block_sizes = [int(k) for k in kernel]
        self.m = [b // k for b, k in zip(block_sizes, self.kernel_block_sizes)]
        self.group_cp = [cp_size if bool(s) else 1 for s in sharded]
        self.reach = [0 if cp_size > 1 else int(w) for w in reach]
        # Columns of each table, in kernel blocks.
        self.width = [int(c) * m for c, m in zip(config.max_num_blocks_per_group, self.m)]


def _or_default(values: Sequence | None, default: list) -> list:
    return list(default) if values is None else list(values)


# ---------------------------------------------------------------- section 3


class ReferenceBlockTables:
    """Host model of `BlockTables`: its tables, counts, and expected outputs.

    `tables[g]` `[max_num_reqs, max_num_blocks_per_group[g] * m]` holds kernel
    block ids and `num_blocks` `[groups, max_num_reqs]` counts kernel blocks
    (section 8.1; `m == 1` without kernel block sizes). Appends change the
    model at once (there is no staging to model). Outputs are returned with a
    `defined` mask where the contract leaves entries open: a real row's entries
    past its block count are never read.

    `config` is a `BlockTablesConfig` or any object with its constructor
    arguments as attributes; only those raw arguments are read.
    """

    redirect_writes_to_null_block = False

    def __init__(self, config: object) -> None:
        self.config = config
        self.rules = rules = _Rules(config)
        self.tables = [np.zeros((rules.max_num_reqs, w), dtype=np.int64) for w in rules.width]
        self.num_blocks = np.zeros((rules.num_groups, rules.max_num_reqs), dtype=np.int64)

    def append_block_ids(
        self, req_index: int, new_block_ids: Sequence[Sequence[int]], overwrite: bool
    ) -> None:
        """Expand allocator ids into kernel ids and write them; all groups or none."""
        rules = self.rules
        if not 0 <= req_index < rules.max_num_reqs:
            raise ValueError(f"req_index {req_index} outside [0, {rules.max_num_reqs})")
        rows = []
        for g, ids in enumerate(new_block_ids):
            ids = [NULL_BLOCK_ID] * len(ids) if self.redirect_writes_to_null_block else ids
            row = expand_block_ids(ids, rules.m[g])
            start = 0 if overwrite else int(self.num_blocks[g, req_index])
            end = start + len(row)
            if end > rules.width[g]:
                raise RuntimeError(
                    f"request {req_index} group {g}: end {end} > capacity {rules.width[g]}"
                )
            rows.append((start, row))
        for g, (start, row) in enumerate(rows):
            self.tables[g][req_index, start : start + len(row)] = row
            self.num_blocks[g, req_index] = start + len(row)

    def slot_mappings(
        self,
        idx_mapping: np.ndarray,
        query_start_loc: np.ndarray,
        positions: np.ndarray,
        out_len: int,
    ) -> np.ndarray:
        """Expected `[groups, out_len]` slot mapping (every entry defined)."""
        rules = self.rules
        idx_mapping = np.asarray(idx_mapping, dtype=np.int64)
        qsl = np.asarray(query_start_loc, dtype=np.int64)
        out = np.full((rules.num_groups, out_len), PAD_SLOT_ID, dtype=np.int64)
        for g in range(rules.num_groups):
            if not rules.enabled[g]:
                continue
            c = rules.group_cp[g]
            k = rules.cp_rank if c > 1 else 0
            for b, r in enumerate(idx_mapping):
                if r < 0:
                    continue
                lo, hi = qsl[b], qsl[b + 1]
                out[g, lo:hi] = slots_for_positions(
                    self.tables[g][r],
                    positions[lo:hi],
                    rules.kernel_block_sizes[g],
                    c,
                    k,
                    rules.interleave,
                )
        return out

    def gathered_block_tables(
        self,
        idx_mapping: np.ndarray,
        num_rows: int,
        num_computed_tokens: np.ndarray | None = None,
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Expected forward-pass tables, rows `[0, num_rows)`, as `(values, defined)` per group.

        `num_rows` is the number of rows the call must leave right: `num_reqs_padded`,
        or for the persistent tables the larger of that and the rows written before.
        Masking works per kernel-block column: entry `j` is dead when
        `(j + 1) * K <= num_computed_tokens[r] - reach`.
        """
        rules = self.rules
        out = []
        for g in range(rules.num_groups):
            width = rules.width[g]
            values = np.zeros((num_rows, width), dtype=np.int64)
            defined = np.ones((num_rows, width), dtype=bool)
            for b, r in enumerate(idx_mapping):
                if r < 0:
                    continue
                n = int(self.num_blocks[g, r])
                row = self.tables[g][r, :n].copy()
                if num_computed_tokens is not None and rules.reach[g] > 0:
                    live_from = int(num_computed_tokens[r]) - rules.reach[g]
                    j = np.arange(n)
                    row[(j + 1) * rules.kernel_block_sizes[g] <= live_from] = NULL_BLOCK_ID
                values[b, :n] = row
                defined[b, n:] = False
            out.append((values, defined))
        return out
