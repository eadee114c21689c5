"""The independent reference: SPEC.md sections 2 and 3 in plain numpy.

Everything the tests and the harness expect comes from here. It is written
straight from the formulas, one token at a time where that is clearest, and
never calls the Triton kernels or `BlockTables`.

Formulas (section 2), for a DCP-sharded group under `C > 1`, block size `bs`,
interleave `I`, virtual block `V = bs * C`, `o = p mod V`:

    owner(p)  = (o // I) mod C
    local(p)  = (o // (I*C)) * I + (o mod I)          # always < bs
    slot_k(p) = table[r][p // V] * bs + local(p)      if owner(p) == k else PAD

Unsharded group or `C == 1`: `slot(p) = table[r][p // bs] * bs + p mod bs` on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .contract import NULL_BLOCK_ID, PAD_SLOT_ID, BlockTablesConfig

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
    """How many positions `< seq_len` rank `cp_rank` owns."""
    span = cp_size * interleave
    rem = seq_len % span - cp_rank * interleave
    return (seq_len // span) * interleave + min(max(rem, 0), interleave)


def owned_positions(
    seq_len: int, cp_rank: int, cp_size: int, interleave: int, block_size: int
) -> np.ndarray:
    """The positions `< seq_len` that `cp_rank` owns, ascending (by brute force)."""
    p = np.arange(seq_len, dtype=np.int64)
    return p[owner(p, cp_size, interleave, block_size) == cp_rank]


def slots_for_positions(
    table_row: np.ndarray,
    positions: np.ndarray,
    block_size: int,
    cp_size: int,
    cp_rank: int,
    interleave: int,
) -> np.ndarray:
    """Section 2's write slot of each position for one request on one rank.

    Pass `cp_size=1` for an unsharded group. Positions whose table column lies
    outside `table_row` are an error: the contract forbids them.
    """
    p = np.asarray(positions, dtype=np.int64)
    virtual = block_size * cp_size
    cols = p // virtual
    if p.size and (p.min() < 0 or cols.max() >= len(table_row)):
        raise IndexError("position outside the request's block-table row")
    blocks = np.asarray(table_row, dtype=np.int64)[cols]
    if cp_size == 1:
        return blocks * block_size + p % block_size
    slots = blocks * block_size + local_offset(p, cp_size, interleave, block_size)
    mine = owner(p, cp_size, interleave, block_size) == cp_rank
    return np.where(mine, slots, PAD_SLOT_ID).astype(np.int64)


def read_slots(table_row: np.ndarray, num_local: int, block_size: int) -> np.ndarray:
    """The read path: slot of the `q`-th local token, `q < num_local`, on its rank."""
    q = np.arange(num_local, dtype=np.int64)
    return np.asarray(table_row, dtype=np.int64)[q // block_size] * block_size + q % block_size


# ---------------------------------------------------------------- section 3


class ReferenceBlockTables:
    """Host model of `BlockTables`: its tables, counts, and expected outputs.

    Appends change the model at once (there is no staging to model). Outputs
    are returned with a `defined` mask where the contract leaves entries open:
    a real row's entries past its block count are never read.
    """

    redirect_writes_to_null_block = False

    def __init__(self, config: BlockTablesConfig) -> None:
        self.config = config
        g = config.num_kv_cache_groups
        self.tables = [
            np.zeros((config.max_num_reqs, m), dtype=np.int64)
            for m in config.max_num_blocks_per_group
        ]
        self.num_blocks = np.zeros((g, config.max_num_reqs), dtype=np.int64)

    def append_block_ids(
        self, req_index: int, new_block_ids: Sequence[Sequence[int]], overwrite: bool
    ) -> None:
        cfg = self.config
        if not 0 <= req_index < cfg.max_num_reqs:
            raise ValueError(f"req_index {req_index} outside [0, {cfg.max_num_reqs})")
        starts = [
            0 if overwrite else int(self.num_blocks[g, req_index])
            for g in range(cfg.num_kv_cache_groups)
        ]
        for g, ids in enumerate(new_block_ids):
            end = starts[g] + len(ids)
            if end > cfg.max_num_blocks_per_group[g]:
                raise RuntimeError(
                    f"request {req_index} group {g}: end {end} > capacity "
                    f"{cfg.max_num_blocks_per_group[g]}"
                )
        for g, ids in enumerate(new_block_ids):
            ids = [NULL_BLOCK_ID] * len(ids) if self.redirect_writes_to_null_block else ids
            self.tables[g][req_index, starts[g] : starts[g] + len(ids)] = ids
            self.num_blocks[g, req_index] = starts[g] + len(ids)

    def slot_mappings(
        self,
        idx_mapping: np.ndarray,
        query_start_loc: np.ndarray,
        positions: np.ndarray,
        out_len: int,
    ) -> np.ndarray:
        """Expected `[groups, out_len]` slot mapping (every entry defined)."""
        cfg = self.config
        idx_mapping = np.asarray(idx_mapping, dtype=np.int64)
        qsl = np.asarray(query_start_loc, dtype=np.int64)
        out = np.full((cfg.num_kv_cache_groups, out_len), PAD_SLOT_ID, dtype=np.int64)
        for g in range(cfg.num_kv_cache_groups):
            if not cfg.slot_mapping_enabled[g]:
                continue
            c = cfg.group_cp_size(g)
            k = cfg.cp_rank if c > 1 else 0
            for b, r in enumerate(idx_mapping):
                if r < 0:
                    continue
                lo, hi = qsl[b], qsl[b + 1]
                out[g, lo:hi] = slots_for_positions(
                    self.tables[g][r], positions[lo:hi], cfg.block_sizes[g], c, k, cfg.cp_interleave
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
        """
        cfg = self.config
        reach = cfg.effective_sliding_window_reach()
        out = []
        for g in range(cfg.num_kv_cache_groups):
            width = cfg.max_num_blocks_per_group[g]
            values = np.zeros((num_rows, width), dtype=np.int64)
            defined = np.ones((num_rows, width), dtype=bool)
            for b, r in enumerate(idx_mapping):
                if r < 0:
                    continue
                n = int(self.num_blocks[g, r])
                row = self.tables[g][r, :n].copy()
                if num_computed_tokens is not None and reach[g] > 0:
                    live_from = int(num_computed_tokens[r]) - reach[g]
                    j = np.arange(n)
                    row[(j + 1) * cfg.block_sizes[g] <= live_from] = NULL_BLOCK_ID
                values[b, :n] = row
                defined[b, n:] = False
            out.append((values, defined))
        return out
