"""A slow, correct `BlockTables` in plain Python: lists of lists, one token at a time.

Why it exists: the harness must not reject a correct implementation merely
because it is built differently from ours (no Triton, no staged-write
buffers, no layout tensors, no device-side counts). This one keeps every
table row as a Python list, models staging as a snapshot taken by
`apply_staged_writes`, and computes every slot with integer arithmetic in a
loop, straight from SPEC.md section 2. It imports nothing from
`cp_blocktables`, not even the validated config.

Invariants:

* `_host[g][r]` is row `r` of group `g` as appended so far (its length is the
  row's block count; host truth advances at once); `_device[g][r]` is the
  copy that `apply_staged_writes` last published and that every read uses.
* `_dirty` is the number of persistent forward-pass rows that may hold ids:
  the last persistent gather's `num_reqs_padded`, or the `num_reqs` of the
  last `get_dummy_block_tables` (a profiling run may fill those rows).
"""

from __future__ import annotations

import torch

PAD = -1
NULL = 0


def _int_list(name: str, values, n: int, minimum: int) -> list[int]:
    if not isinstance(values, (list, tuple)) or len(values) != n:
        raise ValueError(f"{name} must be a list of {n} ints")
    if any(isinstance(v, bool) or not isinstance(v, int) or v < minimum for v in values):
        raise ValueError(f"{name} entries must be ints >= {minimum}")
    return list(values)


def _bool_list(name: str, values, n: int) -> list[bool]:
    if values is None:
        return [True] * n
    if not isinstance(values, (list, tuple)) or len(values) != n:
        raise ValueError(f"{name} must be a list of {n} bools")
    if not all(isinstance(v, bool) for v in values):
        raise ValueError(f"{name} entries must be bools")
    return list(values)


class BlockTables:
    """SPEC.md section 3 with Python lists; tensors only where callers read them."""

    redirect_writes_to_null_block = False

    def __init__(
        self,
        block_sizes: list[int],
        max_num_reqs: int,
        max_num_batched_tokens: int,
        max_num_blocks_per_group: list[int],
        device: torch.device,
        cp_size: int = 1,
        cp_rank: int = 0,
        cp_interleave: int = 1,
        slot_mapping_enabled: list[bool] | None = None,
        dcp_sharded: list[bool] | None = None,
        sliding_window_reach: list[int] | None = None,
    ) -> None:
        if not isinstance(block_sizes, (list, tuple)):
            raise ValueError("block_sizes must be a list")
        n = len(block_sizes)
        self.block_sizes = _int_list("block_sizes", block_sizes, n, 1)
        self.max_blocks = _int_list("max_num_blocks_per_group", max_num_blocks_per_group, n, 1)
        for name, v, lo in (
            ("max_num_reqs", max_num_reqs, 1),
            ("max_num_batched_tokens", max_num_batched_tokens, 1),
            ("cp_size", cp_size, 1),
            ("cp_rank", cp_rank, 0),
            ("cp_interleave", cp_interleave, 1),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
        if cp_rank >= cp_size:
            raise ValueError(f"cp_rank {cp_rank} must be < cp_size {cp_size}")
        self.enabled = _bool_list("slot_mapping_enabled", slot_mapping_enabled, n)
        self.sharded = _bool_list("dcp_sharded", dcp_sharded, n)
        reach = [0] * n if sliding_window_reach is None else sliding_window_reach
        reach = _int_list("sliding_window_reach", reach, n, 0)
        for g in range(n):
            if cp_size > 1 and self.sharded[g] and self.block_sizes[g] % cp_interleave:
                raise ValueError(f"cp_interleave does not divide block_sizes[{g}]")
        self.device = torch.device(device)
        self.max_num_reqs = max_num_reqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.cp_size, self.cp_rank, self.cp_interleave = cp_size, cp_rank, cp_interleave
        self.num_kv_cache_groups = n
        self.reach = [0] * n if cp_size > 1 else reach
        self._host = [[[] for _ in range(max_num_reqs)] for _ in range(n)]
        self._device = [[[] for _ in range(max_num_reqs)] for _ in range(n)]
        self._dirty = 0
        self.input_block_tables = [
            torch.zeros((max_num_reqs, m), dtype=torch.int32, device=self.device)
            for m in self.max_blocks
        ]
        self.slot_mappings = torch.full(
            (n, max_num_batched_tokens), PAD, dtype=torch.int64, device=self.device
        )

    # ------------------------------------------------------------ writes

    def append_block_ids(self, req_index: int, new_block_ids: tuple, overwrite: bool) -> None:
        new_rows = []
        for g, ids in enumerate(new_block_ids):
            kept = [] if overwrite else self._host[g][req_index]
            row = kept + [NULL if self.redirect_writes_to_null_block else int(x) for x in ids]
            if len(row) > self.max_blocks[g]:
                raise RuntimeError(
                    f"request {req_index}, group {g}: blocks would end at {len(row)}, "
                    f"past the capacity {self.max_blocks[g]}"
                )
            new_rows.append(row)
        for g, row in enumerate(new_rows):
            self._host[g][req_index] = row

    def apply_staged_writes(self) -> None:
        self._device = [[list(row) for row in rows] for rows in self._host]

    # ------------------------------------------------------------ gather

    def _gathered_row(self, g: int, r: int, computed: int | None) -> list[int]:
        row = list(self._device[g][r])
        w, bs = self.reach[g], self.block_sizes[g]
        if computed is not None and w > 0:
            row = [NULL if (j + 1) * bs <= computed - w else b for j, b in enumerate(row)]
        return row

    def gather_block_tables(
        self, idx_mapping, num_reqs_padded, out=None, out_ptrs=None, num_computed_tokens=None
    ):
        rows = [int(x) for x in idx_mapping.tolist()]
        nct = None if num_computed_tokens is None else num_computed_tokens.tolist()
        if out is None:
            dst = self.input_block_tables
            num_rows = max(num_reqs_padded, self._dirty)
            self._dirty = num_reqs_padded
        else:
            dst = list(out)
            num_rows = num_reqs_padded
        for g, table in enumerate(dst):
            for b in range(num_rows):
                r = rows[b] if b < len(rows) else -1
                if r < 0:
                    table[b].zero_()
                    continue
                values = self._gathered_row(g, r, None if nct is None else int(nct[r]))
                if values:
                    table[b, : len(values)] = torch.tensor(values, dtype=torch.int32)
        return tuple(t[:num_reqs_padded] for t in dst)

    def get_dummy_block_tables(self, num_reqs: int):
        for t in self.input_block_tables:
            t[: max(num_reqs, self._dirty)].zero_()
        self._dirty = num_reqs
        return tuple(t[:num_reqs] for t in self.input_block_tables)

    # ------------------------------------------------------------ slot mappings

    def _slot(self, g: int, r: int, p: int) -> int:
        bs, i = self.block_sizes[g], self.cp_interleave
        c = self.cp_size if self.sharded[g] else 1
        row = self._device[g][r]
        if c == 1:
            return row[p // bs] * bs + p % bs
        virtual = bs * c
        o = p % virtual
        if (o // i) % c != self.cp_rank:
            return PAD
        return row[p // virtual] * bs + (o // (i * c)) * i + o % i

    def compute_slot_mappings(
        self, idx_mapping, query_start_loc, positions, num_tokens_padded, out=None
    ):
        buf = self.slot_mappings if out is None else out
        rows = [int(x) for x in idx_mapping.tolist()]
        qsl = [int(x) for x in query_start_loc.tolist()]
        pos = positions[: qsl[-1]].tolist() if rows else []
        values = [[PAD] * buf.shape[1] for _ in range(self.num_kv_cache_groups)]
        for b, r in enumerate(rows):
            if r < 0:
                continue
            for t in range(qsl[b], qsl[b + 1]):
                for g in range(self.num_kv_cache_groups):
                    if self.enabled[g]:
                        values[g][t] = self._slot(g, r, int(pos[t]))
        if values:
            buf.copy_(torch.tensor(values, dtype=torch.int64))
        return buf[:, :num_tokens_padded]

    def get_dummy_slot_mappings(self, num_tokens: int):
        self.slot_mappings.fill_(PAD)
        return self.slot_mappings[:, :num_tokens]
