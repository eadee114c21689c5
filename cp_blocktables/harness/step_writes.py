"""How a step's appends reach `append_block_ids`: split, preceded, refused.

`_Writes` turns the appends the life cycle gave a step into the calls an
engine makes: a row written twice (split appends, a junk append before an
overwrite, one that fills the row where the overwrite cuts it), more writes
than there are requests, and over-capacity appends that must raise and
change nothing. It keeps each row's length as the calls leave it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .lifecycle import Append, _Request

if TYPE_CHECKING:
    from .workload import Step


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
        groups = range(g_count)
        force_split = "writes_past_max_reqs" in p.corners and not c["writes_past_max_reqs"]
        out: list[Append] = []
        for a in step.appends:
            # per group: a junk append before `a` may fill the row (computed once)
            spill = [a.overwrite and self._spill_would_show(a, g, step, out) for g in groups]
            if a.overwrite and (
                rng.random() < p.multi_write_prob
                or self._overdue("append_then_overwrite")
                or any(spill)
            ):
                junk = self._junk_append(a, spill)
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

    def _junk_append(self, a: Append, spill: list[bool]) -> Append | None:
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
            if spill[g]:
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
