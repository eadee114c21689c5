"""A plain-PyTorch rival of `BlockTables`' three kernels: the same semantics, no Triton.

The kernel benchmark times it beside the Triton kernels so that their speed-up
is measured against a fair competitor, and tests hold it to
`cp_blocktables.reference`. Every device step is a vectorized tensor operation:
loops run over KV-cache groups only, never over tokens or requests, and no call
waits for the device. Staged writes are flattened on the host with numpy (one
element index per block id) and uploaded in one copy, then applied with one
`index_put_` per group.

The rival holds the same state as `BlockTables`: the per-group tables, the
`[groups, max_num_reqs]` block counts on the device, and the validated config.
Where the contract leaves entries open (a real row's entries past its block
count), the rival's gather writes 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..contract import NULL_BLOCK_ID, PAD_SLOT_ID, BlockTablesConfig


class _StagedWrites:
    """One group's queued writes, as flat host lists."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.starts: list[int] = []
        self.lens: list[int] = []
        self.contents: list[int] = []

    def add(self, row: int, start: int, ids: Sequence[int]) -> None:
        if not ids:
            return
        self.rows.append(row)
        self.starts.append(start)
        self.lens.append(len(ids))
        self.contents.extend(ids)

    def flatten(self, row_stride: int) -> np.ndarray:
        """`[2, num_elems]` int64: flat destination index and value, the last write winning."""
        rows = np.asarray(self.rows, dtype=np.int64)
        starts = np.asarray(self.starts, dtype=np.int64)
        lens = np.asarray(self.lens, dtype=np.int64)
        num_elems = int(lens.sum())
        begin = np.cumsum(lens) - lens
        flat = np.repeat(rows * row_stride + starts - begin, lens) + np.arange(num_elems)
        values = np.asarray(self.contents, dtype=np.int64)
        if len(set(self.rows)) < len(self.rows):
            # Writes to one row may overlap: keep each index's last element.
            _, last_from_end = np.unique(flat[::-1], return_index=True)
            keep = np.sort(num_elems - 1 - last_from_end)
            flat, values = flat[keep], values[keep]
        return np.stack([flat, values])

    def clear(self) -> None:
        self.rows.clear()
        self.starts.clear()
        self.lens.clear()
        self.contents.clear()


class TorchBlockTables:
    """`BlockTables`' kernels written as plain PyTorch tensor operations.

    `tables[g]` is group `g`'s contiguous int32 `[max_num_reqs, width_g]` table
    and `num_blocks` the int32 `[groups, max_num_reqs]` block counts, both on one
    device; the rival reads and updates them in place, so it can share a
    `BlockTables`' tables (`[t.gpu for t in bt.block_tables]`, `bt.num_blocks.gpu`).
    """

    redirect_writes_to_null_block: bool = False

    def __init__(
        self,
        config: BlockTablesConfig,
        tables: Sequence[torch.Tensor],
        num_blocks: torch.Tensor,
    ) -> None:
        num_groups = config.num_kv_cache_groups
        if len(tables) != num_groups:
            raise ValueError(f"tables has {len(tables)} entries for {num_groups} KV-cache groups")
        for g, t in enumerate(tables):
            shape = (config.max_num_reqs, config.max_num_blocks_per_group[g])
            if t.dtype != torch.int32 or tuple(t.shape) != shape or not t.is_contiguous():
                raise ValueError(
                    f"tables[{g}] must be a contiguous int32 {shape} tensor, got "
                    f"{t.dtype} {tuple(t.shape)}"
                )
        if num_blocks.dtype != torch.int32 or tuple(num_blocks.shape) != (
            num_groups,
            config.max_num_reqs,
        ):
            raise ValueError(
                f"num_blocks must be int32 [{num_groups}, {config.max_num_reqs}], got "
                f"{num_blocks.dtype} {tuple(num_blocks.shape)}"
            )
        self.config = config
        self.tables = list(tables)
        self.num_blocks = num_blocks
        self.device = num_blocks.device
        self._num_blocks_host = num_blocks.cpu().numpy().copy()  # [groups, max_num_reqs]
        self._staged = [_StagedWrites() for _ in range(num_groups)]
        self._iota = torch.arange(0, dtype=torch.int64, device=self.device)
        # 0-dim fill values: `torch.where(..., out=)` takes tensors only.
        self._pad = torch.tensor(PAD_SLOT_ID, dtype=torch.int64, device=self.device)
        self._null = torch.tensor(NULL_BLOCK_ID, dtype=torch.int32, device=self.device)

    def _arange(self, n: int) -> torch.Tensor:
        """`[n]` int64 `0..n-1`, cut from a cached, grown-on-demand range."""
        if self._iota.shape[0] < n:
            self._iota = torch.arange(n, dtype=torch.int64, device=self.device)
        return self._iota[:n]

    def _staging(self, host: np.ndarray) -> torch.Tensor:
        """`host` as a tensor a device copy can read asynchronously (pinned on CUDA)."""
        t = torch.from_numpy(host)
        return t.pin_memory() if self.device.type == "cuda" else t

    # ------------------------------------------------------------ slot mappings

    def compute_slot_mappings(
        self,
        idx_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        positions: torch.Tensor,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Fill all of `out` `[groups, out_len]` (int64): SPEC.md section 2 or `PAD_SLOT_ID`."""
        cfg = self.config
        num_reqs, num_positions = idx_mapping.shape[0], positions.shape[0]
        out_len = out.shape[1]
        if num_reqs == 0 or num_positions == 0:
            return out.fill_(PAD_SLOT_ID)
        t = self._arange(out_len)  # [out_len] token index
        qsl = query_start_loc.to(torch.int64)
        real = (t < qsl[num_reqs]) & (t < num_positions)
        b = torch.searchsorted(qsl[1:], t, right=True).clamp_(max=num_reqs - 1)  # [out_len]
        r = idx_mapping.to(torch.int64)[b]
        if num_positions >= out_len:
            p = positions[:out_len].to(torch.int64)
        else:
            tail = t.new_zeros(out_len - num_positions)
            p = torch.cat([positions.to(torch.int64), tail])
        owned = real & (r >= 0) & (r < cfg.max_num_reqs) & (p >= 0)
        r = torch.where(owned, r, 0)
        p = torch.where(owned, p, 0)
        interleave = cfg.cp_interleave
        for g, table in enumerate(self.tables):
            if not cfg.slot_mapping_enabled[g]:
                out[g].fill_(PAD_SLOT_ID)
                continue
            bs, cp = cfg.block_sizes[g], cfg.group_cp_size(g)
            col = p // (bs * cp)
            local = p - col * (bs * cp)
            width = table.shape[1]
            ok = owned & (col < width)
            if cp > 1:
                ok &= (local // interleave) % cp == cfg.cp_rank
                local = (local // (interleave * cp)) * interleave + local % interleave
            block = table[r, col.clamp_(max=width - 1)].to(torch.int64)  # [out_len]
            torch.where(ok, block * bs + local, self._pad, out=out[g])
        return out

    # ------------------------------------------------------------ gather

    def gather_block_tables(
        self,
        idx_mapping: torch.Tensor,
        num_rows: int,
        out: Sequence[torch.Tensor],
        num_computed_tokens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """Copy row `idx_mapping[b]` of each table into row `b` of `out[g]`; zero rows up to
        `num_rows`; mask entries wholly below a sliding window. Returns `[:num_rows]` views."""
        cfg = self.config
        num_reqs = idx_mapping.shape[0]
        r = idx_mapping.to(torch.int64)
        real = (r >= 0) & (r < cfg.max_num_reqs)  # [num_reqs]
        r = torch.where(real, r, 0)
        reach = cfg.effective_sliding_window_reach()
        for g, (table, dst) in enumerate(zip(self.tables, out)):
            width = table.shape[1]
            cols = self._arange(width)  # [width]
            n = self.num_blocks[g][r]  # [num_reqs]
            keep = (cols[None, :] < n[:, None]) & real[:, None]  # [num_reqs, width]
            if num_computed_tokens is not None and reach[g] > 0:
                live_from = num_computed_tokens[r].to(torch.int64) - reach[g]  # [num_reqs]
                keep &= (cols[None, :] + 1) * cfg.block_sizes[g] > live_from[:, None]
            torch.where(keep, table[r], self._null, out=dst[:num_reqs, :width])
            dst[num_reqs:num_rows, :width].zero_()
        return tuple(t[:num_rows] for t in out)

    # ------------------------------------------------------------ staged writes

    def append_block_ids(
        self, req_index: int, new_block_ids: Sequence[Sequence[int]], overwrite: bool
    ) -> None:
        """Queue `new_block_ids[g]` at column 0 (overwrite) or after the row's blocks.

        Raises `RuntimeError` and queues nothing if any group would pass its capacity.
        """
        cfg = self.config
        counts = self._num_blocks_host[:, req_index]
        starts = [0 if overwrite else int(c) for c in counts]
        for g, ids in enumerate(new_block_ids):
            end = starts[g] + len(ids)
            if end > cfg.max_num_blocks_per_group[g]:
                raise RuntimeError(
                    f"request {req_index}, group {g}: blocks would end at {end}, past the "
                    f"row capacity {cfg.max_num_blocks_per_group[g]}"
                )
        for g, ids in enumerate(new_block_ids):
            if self.redirect_writes_to_null_block:
                ids = [NULL_BLOCK_ID] * len(ids)
            self._staged[g].add(req_index, starts[g], ids)
            counts[g] = starts[g] + len(ids)

    def apply_staged_writes(self) -> None:
        """One upload of every queued write, one `index_put_` per group, then the counts."""
        flats = [
            (g, s.flatten(self.tables[g].stride(0))) for g, s in enumerate(self._staged) if s.rows
        ]
        if flats:
            writes = self._staging(np.concatenate([f for _, f in flats], axis=1))  # [2, elems]
            writes = writes.to(self.device, non_blocking=True)
            lo = 0
            for g, f in flats:
                hi = lo + f.shape[1]
                table = self.tables[g]
                table.view(-1).index_put_((writes[0, lo:hi],), writes[1, lo:hi].to(table.dtype))
                lo = hi
        for s in self._staged:
            s.clear()
        self.num_blocks.copy_(self._staging(self._num_blocks_host), non_blocking=True)
