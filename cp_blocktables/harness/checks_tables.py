"""Check 6 of SPEC.md section 6: the gathered block tables."""

from __future__ import annotations

import numpy as np

from ..contract import NULL_BLOCK_ID, PAD_SLOT_ID
from .violations import _PER_STEP_REPORTS, Violation, _slot
from .workload import Step


class _TableChecks:
    """Check 6 of `GroupChecker` (state lives there)."""

    def _check_tables(self, step: Step, tables: list[np.ndarray]) -> list[Violation]:
        num_rows = tables[0].shape[1] if tables else 0
        expected = self.refs[0].gathered_block_tables(
            step.idx_mapping, num_rows, step.num_computed_tokens
        )
        limit = max(step.num_reqs_padded, self.rows_high)
        self.rows_high = step.num_reqs_padded
        found = []
        for g in range(self.num_groups):
            values, defined = expected[g]
            defined = defined.copy()
            defined[limit:] = False
            bad = (tables[g] != values[None]) & defined[None]  # [cp, rows, width]
            if not bad.any():
                continue
            raw = self.refs[0].gathered_block_tables(step.idx_mapping, num_rows, None)[g][0]
            for k, b, j in np.argwhere(bad)[:_PER_STEP_REPORTS].tolist():
                found.append(self._table_violation(step, g, k, b, j, values, raw, tables[g][k]))
        return found

    def _table_violation(
        self,
        step: Step,
        g: int,
        k: int,
        b: int,
        j: int,
        values: np.ndarray,
        unmasked: np.ndarray,
        actual: np.ndarray,
    ) -> Violation:
        v = Violation(
            6,
            "",
            step.index,
            g,
            rank=k,
            expected=f"entry {j} = {int(values[b, j])}",
            actual=f"entry {j} = {int(actual[b, j])}",
        )
        if b >= step.num_reqs_padded:
            v.what = f"row {b} left by a larger batch is not zero"
        elif b >= step.num_reqs:
            v.what = f"padding row {b} is not zero"
        elif step.idx_mapping[b] < 0:
            v.what = f"dummy row {b} is not zero"
        else:
            v.row, v.request = int(step.idx_mapping[b]), int(step.uids[b])
            if values[b, j] == NULL_BLOCK_ID and unmasked[b, j] != NULL_BLOCK_ID:
                w, bs = self.reach[g], self.block_sizes[g]
                nct = int(step.num_computed_tokens[v.row])
                v.what = (
                    f"sliding-window masking: block {int(unmasked[b, j])} lies wholly below "
                    f"the window ((j+1)*bs = {(j + 1) * bs} <= num_computed_tokens {nct} - "
                    f"reach {w}) and may be freed"
                )
            else:
                v.what = f"batch row {b} is not a copy of table row {v.row}"
        return v

    def _check_dummy(
        self, step: Step, slots: np.ndarray, tables: list[np.ndarray]
    ) -> list[Violation]:
        found = []
        for k, g, t in np.argwhere(slots != PAD_SLOT_ID)[:_PER_STEP_REPORTS].tolist():
            found.append(
                Violation(
                    3,
                    "get_dummy_slot_mappings left a non-PAD entry",
                    step.index,
                    g,
                    token=t,
                    rank=k,
                    expected="PAD_SLOT_ID",
                    actual=_slot(int(slots[k, g, t])),
                )
            )
        limit = max(step.dummy_num_reqs, self.rows_high)
        self.rows_high = 0
        for g in range(self.num_groups):
            bad = tables[g][:, :limit] != 0
            for k, b, j in np.argwhere(bad)[:_PER_STEP_REPORTS].tolist():
                found.append(
                    Violation(
                        6,
                        f"get_dummy_block_tables left row {b} non-zero (it may hold stale ids)",
                        step.index,
                        g,
                        rank=k,
                        expected=f"entry {j} = 0",
                        actual=f"entry {j} = {int(tables[g][k, b, j])}",
                    )
                )
        return found
