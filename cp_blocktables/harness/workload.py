"""The seeded multi-step workload every rank of a CP group replays.

`generate(preset, seed)` plays a small scheduler: it admits requests into free
rows (rows of finished requests are reused with `overwrite=True`), gives them
blocks from a per-group allocator (freed blocks go to other requests), runs
chunked prefill, decode and speculative decode with rejected drafts, frees
sliding-window blocks that fall wholly below the window, and shapes each batch
the way an engine does: shuffled batch order, dummy requests, padded token and
request counts, dummy runs and a warm-up with writes redirected to the null
block. It knows nothing about CP ranks: every rank gets the same block ids
(the harness simulates one KV cache per rank, so the same id names that
rank's own physical block).

Determinism: the output depends only on `(preset, seed)`, so every rank
generates it alone and the ranks compare `Workload.digest` before they start.
Every corner of SPEC.md section 6 that a step reaches is counted in
`Workload.corners`.

The generator is assembled from mixins: the request life cycle and the
appends' shape (`lifecycle`), the batch's shape (`batch_shape`) and the
corner counts (`corner_counts`); this module holds the steps and the loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..contract import INT32_MAX
from .batch_shape import _BatchShape
from .corner_counts import _CornerCounts
from .lifecycle import (  # noqa: F401 - Append, Finished, Release are re-exported
    Append,
    Finished,
    Release,
    _LifeCycle,
    _Request,
)
from .presets import Preset
from .step_writes import _Writes


@dataclass
class Step:
    """One engine step as the harness drives it.

    `kind` is "real" (append, apply, gather, compute), "warmup" (the same with
    `redirect_writes_to_null_block` set) or "dummy" (`get_dummy_*` only).
    Arrays: `idx_mapping` int32 `[num_reqs]` (row or -1), `uids` int64
    `[num_reqs]` (-1 for dummies), `query_start_loc` int32 `[num_reqs + 1]`,
    `positions` int64 `[>= num_tokens_padded]`, `num_computed_tokens` int32
    `[max_num_reqs]` by row when the gather is given it, else None
    (`nct_rows` holds the values either way).

    Argument paths: `gather_out` 0 (persistent tables), 1 (caller-owned
    `out`), 2 (`out` and `out_ptrs`); `slot_out` (caller-owned `out` for the
    slot mappings); `fused_read` (`gather_and_compute_slot_mappings` where the
    implementation has it). A dummy step with `profile` writes block ids and
    slots (from `profile_seed`) into the views it was handed, as a profiling
    run does, before the next real step.
    """

    index: int
    kind: str
    releases: list[Release] = field(default_factory=list)
    appends: list[Append] = field(default_factory=list)
    admitted: list[Finished] = field(default_factory=list)
    idx_mapping: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    uids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    query_start_loc: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int32))
    positions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    num_tokens_padded: int = 0
    num_reqs_padded: int = 0
    num_computed_tokens: np.ndarray | None = None
    finished: list[Finished] = field(default_factory=list)
    dummy_num_reqs: int = 0
    dummy_num_tokens: int = 0
    nct_rows: np.ndarray | None = None
    gather_out: int = 0
    slot_out: bool = False
    fused_read: bool = False
    profile: bool = False
    profile_seed: int = 0

    @property
    def num_reqs(self) -> int:
        return len(self.idx_mapping)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    def token_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Per real-or-dummy token of the batch: its row and its request uid, `[num_tokens]`."""
        counts = np.diff(self.query_start_loc.astype(np.int64))
        return (np.repeat(self.idx_mapping.astype(np.int64), counts), np.repeat(self.uids, counts))


@dataclass
class Workload:
    """The steps of one CP group's run, the corners they reach, and their digest."""

    preset: Preset
    seed: int
    steps: list[Step]
    corners: dict[str, int]
    digest: str
    unfinished: list[Finished]
    plot_uid: int | None
    num_real_tokens: int

    def missing_corners(self) -> list[str]:
        return sorted(c for c in self.preset.corners if self.corners.get(c, 0) == 0)


class _Generator(_BatchShape, _CornerCounts, _LifeCycle, _Writes):
    """The seeded scheduler: which kind each step is, what it schedules, its digest.

    Requests move through `_LifeCycle`, their appends through `_Writes`; a
    step's batch is shaped by `_BatchShape` and its corners counted by
    `_CornerCounts`.
    """

    # ------------------------------------------------------------ steps

    def run(self) -> Workload:
        steps = []
        p = self.p
        for s in range(p.num_steps):
            self.step_index = s
            if s < p.warmup_steps:
                step = self._warmup_step(s)
            elif (
                0 < s < p.num_steps - 1
                and steps[-1].kind == "real"
                and (
                    self.rng.random() < p.dummy_run_prob
                    or self._overdue("dummy_run")
                    or self._overdue("profiling_writes")
                    or self._overdue("profiled_rows_reclaimed")
                    or self._overdue("dummy_zero_reqs")
                    or self._overdue("dummy_full_tokens")
                    or self._overdue("dummy_zero_tokens")
                )
            ):
                step = self._dummy_step(s)
            else:
                step = self._real_step(s)
            self._digest(step)
            steps.append(step)
        unfinished = [
            Finished(r.uid, r.row, r.nct, r.prefix_len, r.read_from)
            for r in sorted(self.running.values(), key=lambda r: r.uid)
        ]
        return Workload(
            p,
            0,
            steps,
            dict(self.corners),
            self.hasher.hexdigest(),
            unfinished,
            self.plot_uid,
            self.real_tokens,
        )

    def _dummy_step(self, s: int) -> Step:
        self.corners["dummy_run"] += 1
        n_reqs = int(self.rng.integers(1, self.cfg.max_num_reqs + 1))
        n_tokens = self._dummy_num_tokens()
        reclaim = self._overdue("profiled_rows_reclaimed")
        profile = bool(
            self.rng.random() < self.p.profile_prob or self._overdue("profiling_writes") or reclaim
        )
        self.corners["profiling_writes"] += profile
        if profile and (self.rng.random() < 0.7 or reclaim):
            n_reqs = self.cfg.max_num_reqs  # a profiling run takes every row, as engines do
        if not reclaim and (n_tokens % 5 == 0 or self._overdue("dummy_zero_reqs")):
            n_reqs = 0  # no rows handed out: every row written before is cleared all the same
        self.corners["dummy_zero_reqs"] += n_reqs == 0
        self.profiled_rows = n_reqs if profile else 0
        self.rows_high = n_reqs  # the rows it hands out count as written (SPEC.md section 3)
        self.prev_num_tokens = self.cfg.max_num_batched_tokens
        return Step(
            index=s,
            kind="dummy",
            dummy_num_reqs=n_reqs,
            dummy_num_tokens=n_tokens,
            profile=profile,
            profile_seed=int(self.rng.integers(2**31)),
        )

    def _dummy_num_tokens(self) -> int:
        """A profiling run passes `max_num_batched_tokens`; a dummy run may pass 0."""
        top = self.cfg.max_num_batched_tokens
        n = int(self.rng.integers(1, top + 1))
        if self._overdue("dummy_full_tokens"):
            n = top
        elif self._overdue("dummy_zero_tokens"):
            n = 0
        self.corners["dummy_full_tokens"] += n == top
        self.corners["dummy_zero_tokens"] += n == 0
        return n

    def _warmup_step(self, s: int) -> Step:
        """Rows get made-up block ids while writes go to the null block; they stay free."""
        self.corners["warmup_redirect"] += 1
        rng, cfg = self.rng, self.cfg
        rows = rng.permutation(cfg.max_num_reqs)[: self.p.max_batch_reqs]
        entries, appends = [], []
        m = max((self.p.kernel_factor(g) for g in range(self.num_groups)), default=1)
        top = (2**31 - 1) // m  # every kernel id of a made-up block fits int32
        for i, row in enumerate(rows.tolist()):
            n_blocks = int(rng.integers(1, 4))
            ids = tuple(
                tuple(int(x) for x in rng.integers(1, top, n_blocks))
                for _ in range(self.num_groups)
            )
            # The first row gets each group's largest legal id: its last kernel id is 2**31 - 1.
            if i == 0 and ids:
                ids = tuple(
                    (2**31 // self.p.kernel_factor(g) - 1, *ids[g][1:]) for g in range(len(ids))
                )
                self.corners["top_block_id"] += 1
            # The second row's first id is the null block, as engines append for window
            # blocks they skip: an implementation must accept id 0 on every path.
            if i == 1 and ids:
                ids = tuple((0, *g_ids[1:]) for g_ids in ids)
                self.corners["null_block_id"] += 1
            uid = self._new_uid()
            appends.append(Append(uid, row, ids, True))
            self._advance_counts(self.row_counts, appends[-1])
            span = min((n_blocks * v for v in self.virtual), default=8)
            n = int(rng.integers(1, min(span, 8) + 1))
            entries.append((uid, row, 0, n))
            self.used_rows.add(row)
        return self._batch(Step(index=s, kind="warmup", appends=appends), entries)

    def _real_step(self, s: int) -> Step:
        step = Step(index=s, kind="real", releases=self.pending)
        self.pending = []
        self._free_window_blocks(step)
        scheduled = self._schedule(step)
        entries = []
        for req, n in scheduled:
            self._give_blocks(step, req, req.nct + n)
            entries.append((req.uid, req.row, req.nct, n))
            # int32, as engines pass it: a far start's count past 2**31 is clamped, which
            # masks nothing (such presets configure no window, `Preset.validate`).
            self.nct_rows[req.row] = min(req.nct, INT32_MAX)
        self._count_step_corners(scheduled)
        self._shape_writes(step)
        step = self._batch(step, entries)
        self.last_one = None
        self._advance(step, scheduled)
        return step

    # ------------------------------------------------------------ scheduling

    def _schedule(self, step: Step) -> list[tuple[_Request, int]]:
        """Running requests and admissions, in either order, within a token budget."""
        p, rng = self.p, self.rng
        cap = p.max_num_batched_tokens - 16
        self.whole_buffer = False
        self.last_one = None
        self.most_in_step = p.max_batch_reqs
        if p.giant_prefill and self.prev_num_tokens > p.giant_prefill:
            budget = int(rng.integers(1, 64))  # a step far smaller than the one before,
            self.most_in_step = int(rng.integers(1, 3))  # of a request or two (a short step)
        elif self._overdue("full_step") or self._overdue("full_step_one_token_last"):
            budget = p.max_num_batched_tokens  # every token: packed exactly by _pack
            self.whole_buffer = True
            if not self._overdue("full_step") and self.free_rows:
                # The last token of the buffer alone in the last entry (`_batch` puts it last).
                last_one = self._admit(step)
                self.last_one, budget = last_one.uid, budget - 1
                self.most_in_step -= 1
        elif p.fill_batches or self._overdue("full_batch") or self._overdue("writes_past_max_reqs"):
            budget = cap
        elif rng.random() < 0.3:
            budget = int(rng.integers(1, 9))
        else:
            budget = int(rng.integers(1, cap + 1))
        scheduled: list[tuple[_Request, int]] = []
        running = sorted(
            (r for r in self.running.values() if r.uid != self.last_one), key=lambda r: r.uid
        )
        if p.giant_prefill and not self.corners["giant_request_step"] and self.free_rows:
            req = self._admit(step, prompt_len=p.giant_prefill)
            scheduled.append((req, p.giant_prefill))
            budget -= p.giant_prefill
        starving = any(
            self._overdue(c)
            for c in ("request_finished", "row_reused", "block_reused", "prefix_cached_start")
        )
        if starving or rng.random() < 0.3:
            budget = self._admit_some(step, scheduled, budget)
        order = [running[i] for i in rng.permutation(len(running)).tolist()]
        order.sort(key=lambda r: r.nct < r.prompt_len)  # decodes first, as engines do
        for req in order:
            if len(scheduled) >= self.most_in_step or budget <= 0:
                break
            n = self._tokens_for(req, budget)
            if n > 0:
                scheduled.append((req, n))
                budget -= n
        budget = self._admit_some(step, scheduled, budget)
        if self.whole_buffer:
            self._pack(scheduled, budget)
        if self.last_one is not None:
            scheduled.append((last_one, 1))
        return scheduled

    def _pack(self, scheduled: list[tuple[_Request, int]], budget: int) -> None:
        """Give the budget left to prefill chunks, as a scheduler packing its token budget
        does: the step then fills the buffer to its last entry (`full_step`), unless no
        prompt had that many tokens left."""
        for i, (req, n) in enumerate(scheduled):
            left = req.prompt_len - req.nct - n
            extra = min(budget, left)
            if extra > 0:
                scheduled[i] = (req, n + extra)
                budget -= extra
                # _tokens_for counted this chunk as a chunked prefill; it may now end the prompt.
                self.corners["chunked_prefill"] -= extra == left

    def _admit_some(self, step: Step, scheduled: list, budget: int) -> int:
        p, rng = self.p, self.rng
        while (
            self.free_rows
            and len(scheduled) < self.most_in_step
            and budget > 0
            and (
                rng.random() < (0.7 if len(self.running) < p.max_batch_reqs else 0.15)
                or p.fill_batches
                or self._overdue("full_batch")
                or self._overdue("writes_past_max_reqs")
                or self.whole_buffer
            )
        ):
            # A step that packs the whole buffer admits prompts long enough to fill it.
            req = self._admit(step, min(budget, p.max_prompt_len) if self.whole_buffer else None)
            n = self._tokens_for(req, budget)
            scheduled.append((req, n))
            budget -= n
        return budget

    def _tokens_for(self, req: _Request, budget: int) -> int:
        p = self.p
        if req.nct < req.prompt_len:
            n = min(req.prompt_len - req.nct, p.max_prefill_chunk, budget)
            if n < req.prompt_len - req.nct:
                self.corners["chunked_prefill"] += 1
            return n
        k = int(self.rng.integers(0, p.spec_tokens + 1)) if p.spec_tokens else 0
        n = min(1 + k, p.max_model_len - req.nct)
        if n > budget:
            return 0
        self.corners["spec_decode" if n > 1 else "decode"] += 1
        return n

    def _digest(self, step: Step) -> None:
        h = self.hasher
        h.update(
            repr(
                (
                    step.index,
                    step.kind,
                    step.num_tokens_padded,
                    step.num_reqs_padded,
                    step.dummy_num_reqs,
                    step.dummy_num_tokens,
                    [(a.row, a.overwrite, a.block_ids, a.expect_error) for a in step.appends],
                    (step.gather_out, step.slot_out, step.fused_read),
                    (step.profile, step.profile_seed),
                )
            ).encode()
        )
        for arr in (step.idx_mapping, step.query_start_loc, step.positions):
            h.update(arr.tobytes())
        if step.num_computed_tokens is not None:
            h.update(step.num_computed_tokens.tobytes())


MAX_DRAWS = 64
"""Draws `generate` tries for one seed before it gives up on the preset's promised corners."""


def generate(preset: Preset, seed: int, reach: bool = True) -> Workload:
    """The workload of `preset` for `seed`: identical on every call, every rank, every host.

    With `reach` (the preset's full steps, corners enforced), every seed keeps
    the preset's promises: a draw that misses a promised corner (about one seed
    in twenty, for some presets one in ten) is replaced by the next draw of the
    same seed, until one reaches every corner. A soak, which takes fresh seeds
    round after round, would otherwise fail a correct implementation for a
    workload that fell short. Draw 0 is the seed's plain stream, so a seed
    whose first draw already reaches everything keeps its workload. After
    `MAX_DRAWS` misses the last draw is returned, and the run reports the
    missing corners (a preset that cannot keep its promises).
    """
    for draw in range(MAX_DRAWS if reach else 1):
        w = _Generator(preset, seed, draw).run()
        if not w.missing_corners():
            break
    w.seed = seed
    return w
