"""The request life cycle of the harness workload: admission, blocks, progress, finish.

`_LifeCycle` holds the scheduler's state (rows, running requests, one block
allocator per group) and moves requests through it: admission into a free row
(finished requests' rows are reused), blocks from the allocator as a request
grows, sliding-window blocks freed once wholly below the window, progress after
a step (speculative tokens partly rejected) and release when a request
finishes. Batch assembly lives in `batch_shape`, the calls a step's appends
become in `step_writes`, the step loop in `workload`.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .. import reference
from .presets import CORNERS, Preset

if TYPE_CHECKING:
    from .workload import Step


@dataclass(frozen=True)
class Append:
    """One `append_block_ids` call: `block_ids[g]` for every group.

    `expect_error`: the call passes some group's row capacity and must raise
    `RuntimeError` without changing anything. `ledger`: the ids become the
    request's blocks (False for ids that a later write of the same step
    replaces, and for refused calls).
    """

    uid: int
    row: int
    block_ids: tuple[tuple[int, ...], ...]
    overwrite: bool
    expect_error: bool = False
    ledger: bool = True


@dataclass(frozen=True)
class Release:
    """Blocks of group `group` that request `uid` gave back before this step's appends."""

    uid: int
    group: int
    block_ids: tuple[int, ...]
    columns: tuple[int, ...]
    reason: str  # "finished" or "window"


@dataclass(frozen=True)
class Finished:
    """A request whose KV cache is read back: `seq_len` positions, table row `row`.

    Check 5 reads positions `[read_from, seq_len)`. `read_from` is 0, or a far
    start's `prefix_len` (`Preset.far_start`): that prefix was never seeded
    into the simulated caches, and nothing of it is read.
    """

    uid: int
    row: int
    seq_len: int
    prefix_len: int
    read_from: int = 0


@dataclass
class _Request:
    uid: int
    row: int
    prompt_len: int
    target_len: int
    prefix_len: int
    nct: int
    blocks: list[list[int]]
    dead: list[set[int]]
    appended: bool = False
    read_from: int = 0  # a far start's prefix_len: positions below it are never read back


class _Allocator:
    """Free list of one group's block ids; the most recently freed id is handed out first."""

    def __init__(self, first: int, size: int) -> None:
        self.free = list(range(first + size - 1, first - 1, -1))
        self.released_by: dict[int, tuple[int, str]] = {}

    def take(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError("block pool exhausted; the preset's pool is too small")
        return [self.free.pop() for _ in range(n)]

    def give(self, ids: list[int], uid: int, reason: str) -> None:
        for b in ids:
            self.released_by[b] = (uid, reason)
        self.free.extend(ids)


class _LifeCycle:
    def __init__(self, preset: Preset, seed: int, draw: int = 0) -> None:
        self.p = preset
        entropy = [seed, _name_key(preset.name), *([draw] if draw else [])]
        self.rng = np.random.default_rng(np.random.SeedSequence(entropy))
        self.corners: Counter[str] = Counter({c: 0 for c in CORNERS})
        cfg = preset.config(0)
        self.cfg = cfg
        self.num_groups = cfg.num_kv_cache_groups
        rules = reference.ReferenceBlockTables(cfg).rules  # not the contract's helpers
        self.reach = rules.reach
        self.pass_nct = any(w > 0 for w in cfg.sliding_window_reach)
        # Window masking beside a group of one-token kernel blocks and no window: a dead bound
        # of reach 0 taken as 0 or 1 instead of -1 masks that group's entry 0.
        self.unit_block_beside_window = any(self.reach) and any(
            w == 0 and b == m for w, b, m in zip(rules.reach, rules.block_sizes, rules.m)
        )
        self.alloc = [_Allocator(*preset.block_id_range(g)) for g in range(self.num_groups)]
        self.virtual = [b * c for b, c in zip(rules.block_sizes, rules.group_cp)]
        # The first position only a virtual block reaches in a sharded group of block size 1.
        self.unit_width = min(
            (
                cfg.table_width(g)
                for g in range(self.num_groups)
                if rules.block_sizes[g] == 1 and rules.group_cp[g] > 1
            ),
            default=0,
        )
        self.free_rows = list(range(cfg.max_num_reqs))
        self.used_rows: set[int] = set()
        self.running: dict[int, _Request] = {}
        self.admissions = 0
        self.next_uid = 0
        self.pending: list[Release] = []
        self.nct_rows = np.zeros(cfg.max_num_reqs, dtype=np.int32)
        self.prev_num_tokens = 0
        self.whole_buffer = False  # this step's budget is every token of the buffer
        self.last_one: int | None = None  # uid of the one-token entry a full step ends with
        self.rows_high = 0
        self.profiled_rows = 0  # rows the last dummy run handed to a profiling pass
        self.plot_uid: int | None = None
        self.step_index = 0
        self.real_tokens = 0
        self.hasher = hashlib.sha256()
        # Each row's length in allocator blocks, as the appends so far leave it.
        self.row_counts = np.zeros((self.num_groups, cfg.max_num_reqs), dtype=np.int64)
        self.capacity = preset.max_num_blocks_per_group()

    def _admit(self, step: Step, prompt_len: int | None = None) -> _Request:
        p, rng = self.p, self.rng
        row = self.free_rows.pop(self._pick_row())
        if row in self.used_rows:
            self.corners["row_reused"] += 1
        self.used_rows.add(row)
        far_block = max(self.virtual, default=16)
        want_prefix = prompt_len is None and (
            rng.random() < p.prefix_prob
            or self._overdue("prefix_cached_start")
            or self._overdue("position_past_2_31")
            or self._overdue("unit_block_past_width")
        )
        if not self.admissions and "small_slot_beside_pad" in p.corners:
            # The first request holds every group's first block: from position 0 its
            # first step writes it, slots 1 and 2 where a group's ids start at 1.
            want_prefix = False
        short = (
            prompt_len is None
            and not want_prefix
            and (
                rng.random() < 0.4
                or self._overdue("request_finished")
                or self._overdue("row_reused")
            )
        )
        far = want_prefix and p.far_start > 0
        if far:
            prompt, target, prefix = self._far_lengths()
        else:
            prompt, target, prefix = self._lengths(prompt_len, want_prefix, short, far_block)
        g = self.num_groups
        req = _Request(
            self._new_uid(),
            row,
            prompt,
            target,
            prefix,
            prefix,
            [[] for _ in range(g)],
            [set() for _ in range(g)],
            read_from=prefix if far else 0,
        )
        self.running[req.uid] = req
        self.admissions += 1
        step.admitted.append(Finished(req.uid, row, target, prefix, req.read_from))
        if self.plot_uid is None and prefix == 0 and target >= 2 * far_block and prompt_len is None:
            self.plot_uid = req.uid
        return req

    def _lengths(
        self, prompt_len: int | None, want_prefix: bool, short: bool, far_block: int
    ) -> tuple[int, int, int]:
        """`(prompt_len, target_len, prefix_len)` of a request starting at 0, or (prefix
        cached) at least a virtual block `far_block` from it, its prefix seeded; while
        `unit_block_past_width` is overdue, at or past the width of the group of block
        size 1."""
        p, rng = self.p, self.rng
        if prompt_len is not None:
            prompt = prompt_len
            target = prompt + int(rng.integers(1, p.max_decode_len + 1))
        elif short:
            prompt = int(rng.integers(1, min(32, p.max_prompt_len) + 1))
            target = prompt + int(rng.integers(1, min(8, p.max_decode_len) + 1))
        else:
            low = min(far_block + 2, p.max_prompt_len) if want_prefix else 1
            if want_prefix and self._overdue("unit_block_past_width"):
                far_block = max(far_block, min(self.unit_width, p.max_prompt_len - 2))
                low = min(far_block + 2, p.max_prompt_len)
            prompt = int(rng.integers(low, p.max_prompt_len + 1))
            target = prompt + int(rng.integers(1, p.max_decode_len + 1))
        prefix = 0
        if want_prefix and prompt > far_block + 1:
            prefix = int(rng.integers(far_block, prompt))
            self.corners["prefix_cached_start"] += 1
        return prompt, target, prefix

    def _far_lengths(self) -> tuple[int, int, int]:
        """`(prompt_len, target_len, prefix_len)` of a request that starts far out
        (`Preset.far_start`): its prefix (unseeded) ends at or just below `far_start`,
        fewer than `max_prompt_len` of its prompt tokens lie below it and at least its
        last one at or past it, so its positions run past `far_start`."""
        p, rng = self.p, self.rng
        new = int(rng.integers(1, p.max_prompt_len + 1))
        prefix = p.far_start - int(rng.integers(0, new))
        prompt = prefix + new
        return prompt, prompt + int(rng.integers(1, p.max_decode_len + 1)), prefix

    def _pick_row(self) -> int:
        """Index into `free_rows`: often the row freed last (engines reuse rows eagerly)."""
        if self._overdue("row_reused"):
            reused = [i for i, r in enumerate(self.free_rows) if r in self.used_rows]
            if reused:
                return reused[-1]
        if self.rng.random() < 0.5:
            return len(self.free_rows) - 1
        return int(self.rng.integers(len(self.free_rows)))

    def _overdue(self, corner: str) -> bool:
        """A promised corner still unreached after a third of the run: force it."""
        if corner not in self.p.corners or self.corners[corner]:
            return False
        return self.step_index >= self.p.num_steps // 3

    def _new_uid(self) -> int:
        self.next_uid += 1
        return self.next_uid

    # ------------------------------------------------------------ blocks

    def _give_blocks(self, step: Step, req: _Request, end: int) -> None:
        new = []
        for g in range(self.num_groups):
            need = math.ceil(end / self.virtual[g]) - len(req.blocks[g])
            ids = self.alloc[g].take(max(need, 0))
            for b in ids:
                self._count_reuse(g, b, req.uid)
            req.blocks[g].extend(ids)
            new.append(tuple(ids))
        if not req.appended or any(new):
            step.appends.append(Append(req.uid, req.row, tuple(new), not req.appended))
            req.appended = True

    def _count_reuse(self, g: int, block: int, uid: int) -> None:
        prev = self.alloc[g].released_by.pop(block, None)
        if prev is None or prev[0] == uid:
            return
        self.corners["block_reused"] += 1
        if prev[1] == "window" and prev[0] in self.running:
            self.corners["window_freed_reused"] += 1

    def _free_window_blocks(self, step: Step) -> None:
        """Blocks wholly below `nct - reach` leave the request (their ids stay in its row)."""
        for req in sorted(self.running.values(), key=lambda r: r.uid):
            for g, w in enumerate(self.reach):
                if w == 0:
                    continue
                bs = self.cfg.block_sizes[g]
                cols = [
                    j
                    for j in range((req.nct - w) // bs if req.nct > w else 0)
                    if j < len(req.blocks[g]) and j not in req.dead[g]
                ]
                if not cols:
                    continue
                ids = [req.blocks[g][j] for j in cols]
                req.dead[g].update(cols)
                self.alloc[g].give(ids, req.uid, "window")
                step.releases.append(Release(req.uid, g, tuple(ids), tuple(cols), "window"))

    # ------------------------------------------------------------ progress

    def _advance(self, step: Step, scheduled: list[tuple[_Request, int]]) -> None:
        for req, n in scheduled:
            if req.nct < req.prompt_len:
                req.nct += n
            else:
                accepted = int(self.rng.integers(0, n))
                if accepted < n - 1:
                    self.corners["spec_rejected"] += 1
                req.nct += 1 + accepted
            if req.nct >= req.target_len:
                self._finish(step, req)

    def _finish(self, step: Step, req: _Request) -> None:
        self.corners["request_finished"] += 1
        step.finished.append(Finished(req.uid, req.row, req.nct, req.prefix_len, req.read_from))
        for g in range(self.num_groups):
            cols = [j for j in range(len(req.blocks[g])) if j not in req.dead[g]]
            ids = [req.blocks[g][j] for j in cols]
            self.alloc[g].give(ids, req.uid, "finished")
            self.pending.append(Release(req.uid, g, tuple(ids), tuple(cols), "finished"))
        del self.running[req.uid]
        self.free_rows.append(req.row)


def _name_key(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
