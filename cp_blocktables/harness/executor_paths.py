"""The executor's optional-argument paths and a profiling run's writes (SPEC.md 7, 8.2).

`_ArgumentPaths` (a mixin of `executor._Executor`) makes the caller-owned
buffers a step's gather and slot mapping write into, filled with sentinels
so that entries left untouched show, and runs the fused read
(`gather_and_compute_slot_mappings`) beside the two plain calls, which must
agree. `profile_junk` is what a profiling run writes into the views a dummy
run handed out; the leader's checks replay it.
"""

from __future__ import annotations

import numpy as np
import torch

from .violations import Violation
from .workload import Step

TABLE_SENTINEL = 0x3C3C3C3C
"""What the harness fills caller-owned tables with: rows a gather must not touch keep it."""

SLOT_SENTINEL = -0x3C3C3C3C
"""What the harness fills a caller-owned slot buffer with: every entry must be overwritten."""


def profile_junk(step: Step, widths: list[int], num_groups: int):
    """Block ids and slots a profiling run writes into the views a dummy run handed out.

    `(tables, slots)`: per group `[dummy_num_reqs, width]` (a random prefix of each row
    filled with ids, the rest zero) and `[groups, dummy_num_tokens]`. Deterministic in
    the step, so the leader knows what every rank wrote.
    """
    rng = np.random.default_rng(step.profile_seed)
    n = step.dummy_num_reqs
    tables = []
    for w in widths:
        t = np.zeros((n, w), dtype=np.int64)
        cols = rng.integers(1, w + 1, n)
        ids = rng.integers(1, 2**31 - 1, (n, w))
        t[np.arange(w)[None, :] < cols[:, None]] = ids[np.arange(w)[None, :] < cols[:, None]]
        tables.append(t)
    slots = rng.integers(0, 2**40, (num_groups, step.dummy_num_tokens))
    return tables, slots


class _ArgumentPaths:
    """Caller-owned buffers and the fused read; needs `_Executor`'s state and `_RankChecks`."""

    def _fused(self, step: Step, idx, qsl, pos, nct) -> list[Violation]:
        """SPEC.md 8.2 on the persistent buffers, then the two calls into caller-owned buffers:
        the leader checks the first against the reference, and here both must agree."""
        impl, nrp, ntp = self.impl, step.num_reqs_padded, step.num_tokens_padded
        tables, slots = impl.gather_and_compute_slot_mappings(
            idx, nrp, qsl, pos, ntp, num_computed_tokens=nct
        )
        found = self._check_views(step.index, tables, nrp, False)
        found += self._check_slot_view(step.index, slots, ntp, False)
        if found:
            return found
        out, slot_out = self._caller_tables(), self._caller_slots()
        two = impl.gather_block_tables(idx, nrp, out=out, num_computed_tokens=nct)
        impl.compute_slot_mappings(idx, qsl, pos, ntp, out=slot_out)
        for g, (a, b) in enumerate(zip(tables, two, strict=True)):
            if not torch.equal(self._defined(step, g, a), self._defined(step, g, b)):
                found.append(
                    Violation(
                        6,
                        "gather_and_compute_slot_mappings returned other tables than "
                        "gather_block_tables",
                        step.index,
                        g,
                    )
                )
        if not torch.equal(slots.to(torch.int64), slot_out[:, :ntp].to(torch.int64)):
            found.append(
                Violation(
                    3,
                    "gather_and_compute_slot_mappings returned other slots than "
                    "compute_slot_mappings",
                    step.index,
                )
            )
        return found

    def _defined(self, step: Step, g: int, t: torch.Tensor) -> torch.Tensor:
        """Table rows with entries past each real row's count zeroed (those are never read)."""
        a = t.to(torch.int64).cpu().clone()
        for b, r in enumerate(step.idx_mapping.tolist()):
            if r >= 0:
                a[b, int(self.num_blocks[g, r]) :] = 0
        return a

    def _caller_tables(self) -> list[torch.Tensor]:
        """Sentinel tables handed over as a gather's `out`: guarded copies on the CPU, so a
        write past a table's end faults (`guarded`)."""
        return [self.guard.copy(t) for t in self._sentinel_tables()]

    def _caller_slots(self) -> torch.Tensor:
        """A sentinel slot buffer handed over as `out`, guarded as `_caller_tables`."""
        return self.guard.copy(self._sentinel_slots())

    def _sentinel_tables(self) -> list[torch.Tensor]:
        return [
            torch.full((self.max_reqs, w), TABLE_SENTINEL, dtype=torch.int32, device=self.device)
            for w in self.widths
        ]

    def _sentinel_slots(self) -> torch.Tensor:
        shape = (self.num_groups, self.max_tokens)
        return torch.full(shape, SLOT_SENTINEL, dtype=torch.int64, device=self.device)
