"""What one rank of a serving engine keeps between steps: requests, block tables, KV caches.

The null-block drill needs something a warm-up could damage, so each rank
keeps a small model of an engine's state:

- `RequestPool`: which rows of the block tables hold a serving request, which
  hold a warm-up request, which are free. A warm-up may only start when no
  serving request is left (`null_block_warmup` checks it).
- `KVCache`: one group's KV cache, a real int64 tensor written through the
  slot mappings the implementation under test produced. Every slot gets a
  value (`kv_tag`) that names the rank, the request and the position that
  wrote it, so a damaged block says who damaged it.
- `ServingState`: the implementation instance, its pool and its caches, and
  the block ids each row was given since its last `overwrite=True` append
  (from the workload, never read back from the implementation): what a
  wake-up after sleep re-appends.

Block ids: the harness's workload gives group `g` the ids
`[base + g * pool, base + (g + 1) * pool)` (`base` = the preset's
`block_id_base`, `pool` = its `block_pool_size()`), or `pool` ids from the
group's own `first_block_id`, plus the null block 0 (`Preset.block_id_range`).
A cache holds exactly those: row 0 is the null block, row `1 + i` is block
`first_block + i`, so presets whose ids pass 2**31 still fit in memory.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from ..contract import NULL_BLOCK_ID, PAD_SLOT_ID
from ..harness.presets import Preset

_RANK_SHIFT = 56
_UID_SHIFT = 24
_FIELD = (1 << 32) - 1
_POSITION = (1 << _UID_SHIFT) - 1
JUNK_UID = 0
"""Request id of tokens that belong to no request (dummy entries, padding); real ones start at 1."""
WARMUP_UID_BASE = 1 << 30
"""Warm-up requests get ids from here up; the workload's serving requests stay far below."""


def kv_tag(rank: int, uids: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The value a token writes into its slot: rank + 1, request and position, never 0.

    Positions are stored modulo 2**24 (ample for the presets; the tag only names the writer).
    """
    uids = np.asarray(uids, dtype=np.int64) & _FIELD
    positions = np.asarray(positions, dtype=np.int64) & _POSITION
    return ((rank + 1) << _RANK_SHIFT) | (uids << _UID_SHIFT) | positions


def describe_tag(value: int) -> str:
    """`kv_tag`'s value in words."""
    if value == 0:
        return "zero"
    rank = (value >> _RANK_SHIFT) - 1
    uid = (value >> _UID_SHIFT) & _FIELD
    pos = value & _POSITION
    if uid == JUNK_UID:
        who = "no request"
    elif uid >= WARMUP_UID_BASE:
        who = f"warm-up request {uid - WARMUP_UID_BASE}"
    else:
        who = f"request {uid}"
    return f"rank {rank}, {who}, position {pos}"


class RequestPool:
    """Rows of the block tables: serving requests, warm-up requests, free rows.

    Serving requests are admitted into a named row (the scheduler picked it)
    and finish by id. Warm-up requests exist only while the pool is open for
    a warm-up (`open_for_warmup`); `close_warmup` puts the pool back exactly
    as `open_for_warmup` found it, whatever happened in between.
    """

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self._serving: dict[int, int] = {}  # row -> request id
        self._warmup: dict[int, int] = {}  # row -> warm-up request id
        self._open = 0

    def admit(self, uid: int, row: int) -> None:
        if self._open:
            raise RuntimeError(f"request {uid}: no serving request may start during a warm-up")
        self._take(row, uid)
        self._serving[row] = uid

    def finish(self, uid: int) -> int:
        """Release the row of serving request `uid`; returns the row."""
        for row, held in self._serving.items():
            if held == uid:
                del self._serving[row]
                return row
        raise KeyError(f"request {uid} is not in the pool")

    def drain(self) -> list[int]:
        """Finish every serving request (an engine stops admitting and lets them go)."""
        uids = list(self._serving.values())
        self._serving.clear()
        return uids

    def serving(self) -> dict[int, int]:
        """Row -> request id of every serving request."""
        return dict(self._serving)

    def free_rows(self) -> list[int]:
        return [r for r in range(self.num_rows) if r not in self._serving and r not in self._warmup]

    def open_for_warmup(self) -> tuple:
        """Let warm-up requests take any free row; returns what `close_warmup` restores."""
        saved = self.snapshot()
        self._open += 1
        return saved

    def admit_warmup(self, uid: int, row: int) -> None:
        if not self._open:
            raise RuntimeError(f"warm-up request {uid}: the pool is not open for a warm-up")
        self._take(row, uid)
        self._warmup[row] = uid

    def release_warmup(self, row: int) -> None:
        self._warmup.pop(row, None)

    def close_warmup(self, saved: tuple) -> None:
        """Remove the warm-up requests admitted since `saved` and restore the pool."""
        serving, warmup, opened = saved
        self._serving = dict(serving)
        self._warmup = dict(warmup)
        self._open = opened

    def snapshot(self) -> tuple:
        """Everything that defines the pool, comparable with `==`."""
        return (
            tuple(sorted(self._serving.items())),
            tuple(sorted(self._warmup.items())),
            self._open,
        )

    def _take(self, row: int, uid: int) -> None:
        if not 0 <= row < self.num_rows:
            raise ValueError(f"request {uid}: row {row} outside [0, {self.num_rows})")
        holder = self._serving.get(row, self._warmup.get(row))
        if holder is not None:
            raise RuntimeError(f"request {uid}: row {row} is held by request {holder}")


@dataclass(frozen=True)
class LiveBlocks:
    """The blocks of one cache that held data at one moment, and their bytes.

    `rows` int64 `[n]` (cache rows, never the null block's), `data` int64 `[n, block_size]`.
    """

    rows: np.ndarray
    data: np.ndarray

    def digest(self) -> str:
        h = hashlib.sha256(self.rows.tobytes())
        h.update(self.data.tobytes())
        return h.hexdigest()[:16]


class KVCache:
    """One group's KV cache on one rank: `data` int64 `[1 + num_blocks, block_size]`.

    Row 0 is the null block; row `1 + i` is block `first_block + i`. A slot
    `s` lives at row `rows_for(s // block_size)`, column `s % block_size`.
    """

    def __init__(self, block_size: int, first_block: int, num_blocks: int) -> None:
        self.block_size = block_size
        self.first_block = first_block
        self.num_blocks = num_blocks
        self.data = torch.zeros((1 + num_blocks, block_size), dtype=torch.int64)
        self._written = np.zeros(1 + num_blocks, dtype=bool)  # [1 + num_blocks]

    def block_of_row(self, row: int) -> int:
        return NULL_BLOCK_ID if row == 0 else self.first_block + row - 1

    def rows_for(self, blocks: np.ndarray) -> np.ndarray:
        """Cache row of each block id; -1 for ids this cache does not hold."""
        blocks = np.asarray(blocks, dtype=np.int64)
        rows = blocks - self.first_block + 1
        inside = (rows >= 1) & (rows <= self.num_blocks)
        return np.where(blocks == NULL_BLOCK_ID, 0, np.where(inside, rows, -1))

    def write(self, slots: np.ndarray, values: np.ndarray) -> int:
        """Write `values` at `slots`, skipping PAD; returns how many slots lay outside the cache."""
        slots = np.asarray(slots, dtype=np.int64)
        keep = slots != PAD_SLOT_ID
        slots, values = slots[keep], np.asarray(values, dtype=np.int64)[keep]
        rows = self.rows_for(slots // self.block_size)
        inside = rows >= 0
        rows, cols = rows[inside], slots[inside] % self.block_size
        self.data[torch.from_numpy(rows), torch.from_numpy(cols)] = torch.from_numpy(values[inside])
        self._written[rows] = True
        return int((~inside).sum())

    def live(self) -> LiveBlocks:
        """Every non-null block that has been written (it may hold a cached prefix)."""
        rows = np.flatnonzero(self._written[1:]) + 1
        return LiveBlocks(rows, self.data[torch.from_numpy(rows)].numpy().copy())

    def null_block_is_zero(self) -> bool:
        return not bool(self.data[0].any())


class ServingState:
    """One rank's engine state for one preset: the implementation, its pool and its caches."""

    def __init__(self, impl: object, preset: Preset, rank: int) -> None:
        self.impl = impl
        self.preset = preset
        self.rank = rank
        cfg = preset.config(0)
        self.pool = RequestPool(cfg.max_num_reqs)
        self.caches = [
            KVCache(bs, *preset.block_id_range(g)) for g, bs in enumerate(cfg.block_sizes)
        ]
        self.writes = 0
        self.writes_outside = 0
        self._row_ids: dict[int, tuple[int, list[list[int]]]] = {}  # row -> (uid, ids per group)

    def note_append(self, uid: int, row: int, block_ids, overwrite: bool) -> None:
        """Record a serving request's append (as given: a real step is never redirected)."""
        held = self._row_ids.get(row)
        if overwrite or held is None or held[0] != uid:
            held = (uid, [[] for _ in self.caches])
            self._row_ids[row] = held
        for g, ids in enumerate(block_ids):
            held[1][g].extend(int(b) for b in ids)

    def live_rows(self) -> list[tuple[int, int, list[list[int]]]]:
        """`(row, uid, ids per group)` of every serving request that holds blocks, by row."""
        out = []
        for row, uid in sorted(self.pool.serving().items()):
            held = self._row_ids.get(row)
            if held is not None and held[0] == uid:
                out.append((row, uid, [list(ids) for ids in held[1]]))
        return out

    def kv_tensors(self) -> list[torch.Tensor]:
        """Each group's cache tensor, block 0 first: what a warm-up zeroes."""
        return [c.data for c in self.caches]

    def write_kv(self, slots: np.ndarray, uids: np.ndarray, positions: np.ndarray) -> None:
        """Write one step's tokens through `slots` `[groups, n]`; `uids`, `positions` `[n]`."""
        tags = kv_tag(self.rank, uids, positions)
        for g, cache in enumerate(self.caches):
            self.writes += int((slots[g] != PAD_SLOT_ID).sum())
            self.writes_outside += cache.write(slots[g], tags)

    def live(self) -> list[LiveBlocks]:
        return [c.live() for c in self.caches]

    def changed_blocks(self, before: list[LiveBlocks], limit: int = 4) -> list[dict]:
        """Blocks of `before` whose bytes differ now: group, block, first changed offset, values."""
        found = []
        for g, (cache, old) in enumerate(zip(self.caches, before)):
            if not len(old.rows):
                continue
            now = cache.data[torch.from_numpy(old.rows)].numpy()
            for i in np.flatnonzero((now != old.data).any(axis=1))[:limit].tolist():
                col = int(np.flatnonzero(now[i] != old.data[i])[0])
                found.append(
                    {
                        "group": g,
                        "block": cache.block_of_row(int(old.rows[i])),
                        "offset": col,
                        "before": describe_tag(int(old.data[i, col])),
                        "after": describe_tag(int(now[i, col])),
                    }
                )
        return found
