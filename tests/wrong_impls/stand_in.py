"""A correct, plain-torch `BlockTables` with one overridable hook per rule of the contract.

It exists so that the wrong implementations of `catalogue` differ from a
known-good one in exactly one place. It shares nothing with
`cp_blocktables.reference` except the validated config; its own formulas
are written here from SPEC.md section 2 directly.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch

from cp_blocktables.contract import NULL_BLOCK_ID, PAD_SLOT_ID, BlockTablesConfig


class StandInBlockTables:
    """SPEC.md section 3's surface, on host tensors, one hook per rule."""

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
        kernel_block_sizes: list[int] | None = None,
    ) -> None:
        cfg = BlockTablesConfig(
            block_sizes, max_num_reqs, max_num_batched_tokens, max_num_blocks_per_group,
            cp_size, cp_rank, cp_interleave, slot_mapping_enabled, dcp_sharded,
            sliding_window_reach, kernel_block_sizes,
        )  # fmt: skip
        self.cfg = cfg
        self.device = torch.device(device)
        self.alloc_block_sizes = list(block_sizes)
        self.kernel_block_sizes = list(cfg.kernel_block_sizes)
        self.m = [b // k for b, k in zip(block_sizes, self.kernel_block_sizes, strict=True)]
        self.block_sizes = self.kernel_block_sizes  # every formula of section 2 uses K
        self.max_num_reqs = cfg.max_num_reqs
        self.max_num_batched_tokens = cfg.max_num_batched_tokens
        self.cp_size, self.cp_rank, self.cp_interleave = cp_size, cp_rank, cp_interleave
        self.num_kv_cache_groups = cfg.num_kv_cache_groups
        g = self.num_kv_cache_groups
        self.tables = [
            torch.zeros((max_num_reqs, w * m), dtype=torch.int32)
            for w, m in zip(max_num_blocks_per_group, self.m, strict=True)
        ]
        self.counts = np.zeros((g, max_num_reqs), dtype=np.int64)
        self.staged: list[tuple[int, int, int, list[int]]] = []
        self.input_block_tables = [torch.zeros_like(t) for t in self.tables]
        self.slot_mappings = torch.full((g, max_num_batched_tokens), PAD_SLOT_ID, dtype=torch.int64)
        self.rows_written = 0

    # ------------------------------------------------------------ hooks

    def _start(self, g: int, row: int, overwrite: bool) -> int:
        return 0 if overwrite else int(self.counts[g, row])

    def _staged_ids(self, ids: list[int]) -> list[int]:
        return [NULL_BLOCK_ID] * len(ids) if self.redirect_writes_to_null_block else list(ids)

    def _expand(self, g: int, ids: list[int]) -> list[int]:
        m = self.m[g]
        return [b * m + i for b in ids for i in range(m)]

    def _capacity_ok(self, g: int, start: int, ids: list[int]) -> bool:
        return start + len(ids) * self.m[g] <= self.tables[g].shape[1]

    def _dummy_rows_written(self, num_reqs: int) -> int:
        return num_reqs

    def _apply(self, g: int, row: int, start: int, ids: list[int]) -> None:
        self.tables[g][row, start : start + len(ids)] = torch.tensor(ids, dtype=torch.int32)

    def _gather_source_row(self, entry: int) -> int | None:
        return None if entry < 0 else entry

    def _rows_to_zero(self, num_reqs_padded: int) -> int:
        return max(num_reqs_padded, self.rows_written)

    def _reach(self) -> list[int]:
        return self.cfg.effective_sliding_window_reach()

    def _masked(self, g: int, nct: int, num: int) -> torch.Tensor:
        reach, bs = self._reach()[g], self.block_sizes[g]
        j = torch.arange(num)
        return (j + 1) * bs <= nct - reach

    def _group_cp(self, g: int) -> int:
        return self.cfg.group_cp_size(g)

    def _enabled(self, g: int) -> bool:
        return self.cfg.slot_mapping_enabled[g]

    def _owner(self, o: torch.Tensor, c: int, i: int) -> torch.Tensor:
        return (o // i) % c

    def _local(self, o: torch.Tensor, c: int, i: int) -> torch.Tensor:
        return (o // (i * c)) * i + o % i

    def _column(self, pos: torch.Tensor, bs: int, c: int) -> torch.Tensor:
        return pos // (bs * c)

    def _token_positions(self, positions: torch.Tensor, qsl: torch.Tensor, batch: torch.Tensor):
        return positions[: batch.shape[0]].long()

    def _token_rows(self, idx: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        return idx[batch]

    def _writes(self, rows: torch.Tensor) -> torch.Tensor:
        return rows >= 0

    def _non_owner_value(self, slot: torch.Tensor) -> torch.Tensor | int:
        return PAD_SLOT_ID

    def _store_slots(self, slots: torch.Tensor) -> torch.Tensor:
        return slots

    def _clear_slot_buffer(self, buf: torch.Tensor, num_tokens: int) -> None:
        buf.fill_(PAD_SLOT_ID)

    def _dummy_tables(self, num_reqs: int) -> None:
        for t in self.input_block_tables:
            t[: max(num_reqs, self.rows_written)].zero_()

    # ------------------------------------------------------------ surface

    def append_block_ids(self, req_index: int, new_block_ids, overwrite: bool) -> None:
        starts = [self._start(g, req_index, overwrite) for g in range(self.num_kv_cache_groups)]
        for g, ids in enumerate(new_block_ids):
            if not self._capacity_ok(g, starts[g], list(ids)):
                raise RuntimeError(f"request {req_index} group {g}: past capacity")
        for g, ids in enumerate(new_block_ids):
            kernel_ids = self._expand(g, self._staged_ids(list(ids)))
            self.staged.append((g, req_index, starts[g], kernel_ids))
            self.counts[g, req_index] = starts[g] + len(kernel_ids)

    def apply_staged_writes(self) -> None:
        for g, row, start, ids in self.staged:
            if ids:
                self._apply(g, row, start, ids)
        self.staged.clear()

    def gather_block_tables(
        self, idx_mapping, num_reqs_padded, out=None, out_ptrs=None, num_computed_tokens=None
    ):
        dst = self.input_block_tables if out is None else list(out)
        idx = idx_mapping.cpu().tolist()
        nct = None if num_computed_tokens is None else num_computed_tokens.cpu().tolist()
        rows = self._rows_to_zero(num_reqs_padded) if out is None else num_reqs_padded
        for g, t in enumerate(dst):
            for b, entry in enumerate(idx):
                r = self._gather_source_row(entry)
                if r is None:
                    t[b].zero_()
                    continue
                n = int(self.counts[g, r])
                row = self.tables[g][r, :n].clone()
                if nct is not None and self._reach()[g] > 0:
                    row[self._masked(g, int(nct[r]), n)] = NULL_BLOCK_ID
                t[b, :n] = row
            t[len(idx) : rows].zero_()
        if out is None:
            self.rows_written = num_reqs_padded
        return tuple(t[:num_reqs_padded] for t in dst)

    def get_dummy_block_tables(self, num_reqs: int):
        self._dummy_tables(num_reqs)
        self.rows_written = self._dummy_rows_written(num_reqs)
        return tuple(t[:num_reqs] for t in self.input_block_tables)

    def compute_slot_mappings(
        self, idx_mapping, query_start_loc, positions, num_tokens_padded, out=None
    ):
        buf = self.slot_mappings if out is None else out
        idx = idx_mapping.cpu().long()
        qsl = query_start_loc.cpu().long()
        num_tokens = int(qsl[-1])
        batch = torch.repeat_interleave(torch.arange(len(idx)), qsl[1:] - qsl[:-1])
        rows = self._token_rows(idx, batch)
        real = self._writes(rows)
        pos = torch.where(real, self._token_positions(positions.cpu(), qsl, batch), 0)
        self._clear_slot_buffer(buf, num_tokens)
        for g in range(self.num_kv_cache_groups):
            if not self._enabled(g):
                continue
            bs, c, i = self.block_sizes[g], self._group_cp(g), self.cp_interleave
            col = self._column(pos, bs, c).clamp(max=self.tables[g].shape[1] - 1)
            block = self.tables[g][rows.clamp(min=0), col].long()
            if c == 1:
                slot = block * bs + pos % bs
            else:
                o = pos % (bs * c)
                mine = self._owner(o, c, i) == self.cp_rank
                slot = block * bs + self._local(o, c, i)
                slot = torch.where(mine, slot, self._non_owner_value(slot))
            buf[g, :num_tokens] = self._store_slots(torch.where(real, slot, PAD_SLOT_ID))
        return buf[:, :num_tokens_padded]

    def get_dummy_slot_mappings(self, num_tokens: int):
        self.slot_mappings.fill_(PAD_SLOT_ID)
        return self.slot_mappings[:, :num_tokens]


class StandInFusedRead(StandInBlockTables):
    """The stand-in with SPEC.md 8.2's one-call read (here: the two calls, in order)."""

    def gather_and_compute_slot_mappings(
        self,
        idx_mapping,
        num_reqs_padded,
        query_start_loc,
        positions,
        num_tokens_padded,
        num_computed_tokens=None,
    ):
        tables = self.gather_block_tables(
            idx_mapping, num_reqs_padded, num_computed_tokens=num_computed_tokens
        )
        return tables, self.compute_slot_mappings(
            idx_mapping, query_start_loc, positions, num_tokens_padded
        )


def seed_shaped(
    block_sizes,
    max_num_reqs,
    max_num_batched_tokens,
    max_num_blocks_per_group,
    device,
    cp_size=1,
    cp_rank=0,
    cp_interleave=1,
    slot_mapping_enabled=None,
    dcp_sharded=None,
    sliding_window_reach=None,
):
    """A factory of the seed's shape (no kernel_block_sizes): kernel-block presets are skipped."""
    return StandInBlockTables(
        block_sizes, max_num_reqs, max_num_batched_tokens, max_num_blocks_per_group, device,
        cp_size, cp_rank, cp_interleave, slot_mapping_enabled, dcp_sharded, sliding_window_reach,
    )  # fmt: skip


STAND_IN_SIGNATURE = inspect.signature(StandInBlockTables)
"""For subclasses that forward `*args, **kwargs`: the harness reads the declared keywords to
learn what an implementation supports, so they declare the stand-in's."""
