"""How the harness workload shapes one step's batch, as an engine does.

`_BatchShape` orders the scheduled requests (shuffled or by row), inserts
dummy requests (their positions junk or zeros), pads the token and request
counts, fills the positions past the last real token with garbage or zeros,
and picks the step's optional
argument paths (`num_computed_tokens` or not, caller-owned outputs, the fused
read). A mixin of the workload generator (`workload._Generator`): it reads the
generator's preset, rng and state, and counts the corners it reaches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .workload import Step

_GARBAGE = 2**40
"""Upper bound of the junk written where the contract says a value is never read."""


class _BatchShape:
    def _batch(self, step: Step, entries: list[tuple[int, int, int, int]]) -> Step:
        """Order, dummies and padding; fills the step's arrays. Entries: (uid, row, start, n)."""
        p, rng, cfg = self.p, self.rng, self.cfg
        if rng.random() < p.shuffle_prob:
            entries = [entries[i] for i in rng.permutation(len(entries)).tolist()]
        else:
            entries = sorted(entries, key=lambda e: e[1])
        entries.sort(key=lambda e: e[0] == self.last_one)  # stable: only that one moves last
        dummies = rng.random() < p.dummy_req_prob or self._overdue("dummy_request")
        if step.kind == "real" and dummies:
            for _ in range(int(rng.integers(1, 3))):
                if len(entries) < cfg.max_num_reqs:
                    at = int(rng.integers(len(entries) + 1))
                    n = int(rng.integers(0, 4))
                    # A step given the whole buffer has no token to spare for dummies.
                    entries.insert(at, (-1, -1, 0, 0 if self.whole_buffer else n))
                    self.corners["dummy_request"] += 1
        counts = [e[3] for e in entries]
        qsl = np.zeros(len(entries) + 1, dtype=np.int32)
        qsl[1:] = np.cumsum(counts)
        num_tokens = int(qsl[-1])
        pos_parts = [
            np.arange(e[2], e[2] + e[3], dtype=np.int64)
            if e[0] >= 0
            else self._dummy_positions(step, e[3])
            for e in entries
        ]
        ntp = num_tokens
        if rng.random() < p.pad_prob:
            ntp = min(cfg.max_num_batched_tokens, (num_tokens // 8 + 1) * 8)
        nrp = len(entries)
        if rng.random() < p.pad_prob:
            nrp = min(cfg.max_num_reqs, nrp + int(rng.integers(1, 4)))
        length = cfg.max_num_batched_tokens if rng.random() < 0.3 else ntp
        tail = (
            rng.integers(0, _GARBAGE, length - num_tokens)
            if rng.random() < 0.5
            else np.zeros(length - num_tokens, dtype=np.int64)
        )
        step.positions = np.concatenate([*pos_parts, tail]).astype(np.int64)
        step.idx_mapping = np.array([e[1] for e in entries], dtype=np.int32)
        step.uids = np.array([e[0] for e in entries], dtype=np.int64)
        step.query_start_loc = qsl
        step.num_tokens_padded = ntp
        step.num_reqs_padded = nrp
        step.nct_rows = self.nct_rows.copy()
        self._choose_paths(step)
        self._count_shape_corners(step, tail)
        return step

    def _dummy_positions(self, step: Step, n: int) -> np.ndarray:
        """A dummy request's positions: junk, or zeros (as an engine's padding leaves
        them) on every other step and until some dummy token had them. Position 0 lies in
        every table, so an implementation that lets a dummy token through reads the row
        before the table and writes a slot there, where junk past every table's span
        maps to PAD anyway. The junk is drawn either way: the other draws do not move."""
        junk = self.rng.integers(0, _GARBAGE, n)
        if step.index % 2 and self.corners["dummy_token_in_table"]:
            return junk
        self.corners["dummy_token_in_table"] += n
        return np.zeros(n, dtype=np.int64)

    def _choose_paths(self, step: Step) -> None:
        """Which optional arguments this step's gather and slot mapping get."""
        p, rng, c = self.p, self.rng, self.corners
        nct = rng.random() < (p.nct_prob if self.pass_nct else 0.3)
        if self._overdue("nct_absent"):
            nct = False
        elif self._overdue("nct_present"):
            nct = True
        step.num_computed_tokens = step.nct_rows.copy() if nct else None
        c["nct_present" if nct else "nct_absent"] += 1
        c["unit_block_beside_window"] += nct and self.unit_block_beside_window
        if rng.random() < p.fused_read_prob or self._overdue("fused_read"):
            step.fused_read = True
            c["fused_read"] += 1
            return
        if rng.random() < p.out_prob or self._overdue("gather_out"):
            step.gather_out = 1
        if rng.random() < p.out_prob or self._overdue("gather_out_ptrs"):
            step.gather_out = 2
        if rng.random() < p.out_prob or self._overdue("slot_out"):
            step.slot_out = True
        c["gather_out"] += step.gather_out == 1
        c["gather_out_ptrs"] += step.gather_out == 2
        c["slot_out"] += step.slot_out
