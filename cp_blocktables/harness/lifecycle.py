"""The request life cycle of the harness workload: admission, blocks, progress, finish.

`_LifeCycle` holds the scheduler's state (rows, running requests, one block
allocator per group) and moves requests through it: admission into a free row
(finished requests' rows are reused), blocks from the allocator as a request
grows, sliding-window blocks freed once wholly below the window, progress after
a step (speculative tokens partly rejected) and release when a request
finishes. Batch assembly lives in `batch_shape`, the step loop in `workload`.
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
        self.alloc = [_Allocator(*preset.block_id_range(g)) for g in range(self.num_groups)]
        self.virtual = [b * c for b, c in zip(rules.block_sizes, rules.group_cp)]
        self.free_rows = list(range(cfg.max_num_reqs))
        self.used_rows: set[int] = set()
        self.running: dict[int, _Request] = {}
        self.admissions = 0
        self.next_uid = 0
        self.pending: list[Release] = []
        self.nct_rows = np.zeros(cfg.max_num_reqs, dtype=np.int32)
        self.prev_num_tokens = 0
        self.whole_buffer = False  # this step's budget is every token of the buffer
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
        cached) at least a virtual block `far_block` from it, its prefix seeded."""
        p, rng = self.p, self.rng
        if prompt_len is not None:
            prompt = prompt_len
            target = prompt + int(rng.integers(1, p.max_decode_len + 1))
        elif short:
            prompt = int(rng.integers(1, min(32, p.max_prompt_len) + 1))
            target = prompt + int(rng.integers(1, min(8, p.max_decode_len) + 1))
        else:
            low = min(far_block + 2, p.max_prompt_len) if want_prefix else 1
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


class _Writes:
    """How a step's appends reach `append_block_ids`: split, preceded, refused.

    Engines stage several writes to one row in one step (a new request's blocks
    and then its first decode block; a preempted request's append before the
    row is overwritten) and more writes than there are requests; they also try
    appends that do not fit, which must raise and change nothing.
    """

    def _shape_writes(self, step: Step) -> None:
        p, rng, c = self.p, self.rng, self.corners
        g_count = self.num_groups
        if not g_count:
            return
        force_split = "writes_past_max_reqs" in p.corners and not c["writes_past_max_reqs"]
        out: list[Append] = []
        for a in step.appends:
            if a.overwrite and (
                rng.random() < p.multi_write_prob
                or self._overdue("append_then_overwrite")
                or any(self._spill_would_show(a, g, step, out) for g in range(g_count))
            ):
                junk = self._junk_append(a, step, out)
                if junk is not None:
                    out.append(junk)
                    c["append_then_overwrite"] += 1
            splittable = any(len(ids) >= 2 for ids in a.block_ids)
            if splittable and (
                force_split
                or rng.random() < p.multi_write_prob
                or self._overdue("two_appends_one_row")
            ):
                cut = [
                    int(rng.integers(1, len(ids))) if len(ids) >= 2 else 0 for ids in a.block_ids
                ]
                first = tuple(ids[:k] for ids, k in zip(a.block_ids, cut, strict=True))
                second = tuple(ids[k:] for ids, k in zip(a.block_ids, cut, strict=True))
                out.append(Append(a.uid, a.row, first, a.overwrite))
                out.append(Append(a.uid, a.row, second, False))
                c["two_appends_one_row"] += 1
            else:
                out.append(a)
        counts = self.row_counts.copy()
        if self.running and (rng.random() < p.overflow_prob or self._overdue("overflow_refused")):
            at = int(rng.integers(len(out) + 1))
            for a in out[:at]:
                self._advance_counts(counts, a)
            req = sorted(self.running.values(), key=lambda r: r.uid)
            target = req[int(rng.integers(len(req)))]
            out.insert(at, self._overflow_append(target, counts))
            c["overflow_refused"] += 1
            counts = self.row_counts.copy()
        for a in out:
            self._advance_counts(counts, a)
        self.row_counts = counts
        writes = sum(1 for a in out if not a.expect_error and any(a.block_ids))
        c["writes_past_max_reqs"] += writes > self.cfg.max_num_reqs
        step.appends = out

    def _advance_counts(self, counts: np.ndarray, a: Append) -> None:
        if a.expect_error:
            return
        for g, ids in enumerate(a.block_ids):
            counts[g, a.row] = (0 if a.overwrite else counts[g, a.row]) + len(ids)

    def _junk_append(self, a: Append, step: Step, staged: list[Append]) -> Append | None:
        """Ids appended to the row just before `a` overwrites it (`a` must win).

        Up to three ids; but where `a` ends inside the row's free room, behind
        other writes to the group in this step, and the next row holds a running
        request's blocks, the junk fills the room up to the row's capacity. Only
        its tail past `a` then survives, at an offset into both the row and the
        step's staged ids: a wrong offset there spills into the next row.
        """
        junk = []
        for g, ids in enumerate(a.block_ids):
            room = self.capacity[g] - int(self.row_counts[g, a.row])
            if self._spill_would_show(a, g, step, staged):
                self.corners["overwrite_cuts_full_append"] += 1
                junk.append(tuple(reversed((ids * room)[:room])))
                continue
            k = max(min(len(ids), room, 3), 0)
            junk.append(tuple(reversed(ids[:k])))
        if not any(junk):
            return None
        return Append(a.uid, a.row, tuple(junk), False, ledger=False)

    def _spill_would_show(self, a: Append, g: int, step: Step, staged: list[Append]) -> bool:
        """Group `g` can take a junk append up to capacity that `a` cuts, and the
        next row is a running request's that no write of this step overwrites."""
        old, n = int(self.row_counts[g, a.row]), len(a.block_ids[g])
        nxt = a.row + 1
        return (
            old < n < self.capacity[g]
            and any(w.block_ids[g] for w in staged)
            and nxt < self.cfg.max_num_reqs
            and self.row_counts[g, nxt] > 0
            and any(r.row == nxt for r in self.running.values())
            and not any(w.row == nxt and w.overwrite for w in step.appends)
        )

    def _overflow_append(self, req: _Request, counts: np.ndarray) -> Append:
        """An append that passes one group's capacity (others would fit): must raise."""
        bad = int(self.rng.integers(self.num_groups))
        ids = []
        for g in range(self.num_groups):
            room = self.capacity[g] - int(counts[g, req.row])
            n = room + 1 if g == bad else min(1, room)
            ids.append(tuple([self.p.block_id_base] * n))
        return Append(req.uid, req.row, tuple(ids), False, expect_error=True, ledger=False)
