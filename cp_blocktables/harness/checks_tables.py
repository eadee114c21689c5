"""Check 6 of SPEC.md section 6: the gathered block tables, the whole persistent tables.

The leader keeps a model of every rank's persistent `input_block_tables` (the
same on every rank): per group the expected value of each entry and whether
the contract defines it. A gather into the persistent tables defines rows
`[0, max(num_reqs_padded, rows the previous call wrote))` (copied rows up to
their block count, dummy, padding and stale rows zero); `get_dummy_block_tables`
zeroes `[0, max(num_reqs, rows written before))` and hands out `[0, num_reqs)`,
which then count as written; what a profiling run writes into them is
modelled too. After every step the whole persistent tables must equal the
model wherever it is defined: rows left by a larger batch, rows a dummy run
handed out, and rows a gather into caller-owned tensors must not touch.
A gather into caller-owned `out` is checked on `out` (rows `[0,
num_reqs_padded)` by the rule, rows past them untouched).
"""

from __future__ import annotations

import numpy as np

from ..contract import NULL_BLOCK_ID, PAD_SLOT_ID
from .executor import TABLE_SENTINEL, profile_junk
from .violations import _PER_STEP_REPORTS, Violation, _slot
from .workload import Step


class _TableChecks:
    """Check 6 of `GroupChecker` (state lives there)."""

    def _init_table_model(self, cfg) -> None:
        self.table_values = []
        self.table_defined = []
        self.widths = [cfg.table_width(g) for g in range(cfg.num_kv_cache_groups)]
        for w in self.widths:
            self.table_values.append(np.zeros((cfg.max_num_reqs, w), dtype=np.int64))
            self.table_defined.append(np.zeros((cfg.max_num_reqs, w), dtype=bool))
        self.rows_written = 0  # rows of the persistent tables the last call wrote

    def _check_tables(
        self, step: Step, tables: list[np.ndarray], out: list[np.ndarray] | None = None
    ) -> list[Violation]:
        nrp = step.num_reqs_padded
        found = []
        if out is not None:
            expected = self.refs[0].gathered_block_tables(
                step.idx_mapping, nrp, step.num_computed_tokens
            )
            for g in range(self.num_groups):
                values, defined = expected[g]
                found += self._compare(step, g, out[g][:, :nrp], values, defined, nrp, "out")
                left = out[g][:, nrp:] != TABLE_SENTINEL
                for k, b, j in np.argwhere(left)[:_PER_STEP_REPORTS].tolist():
                    found.append(
                        Violation(
                            6,
                            f"gather into the caller's out wrote row {b + nrp} past "
                            f"num_reqs_padded {nrp}",
                            step.index,
                            g,
                            rank=k,
                            expected=f"entry {j} untouched",
                            actual=f"entry {j} = {int(out[g][k, b + nrp, j])}",
                        )
                    )
            return found + self._check_model(step, tables, "gather_block_tables(out=...)")
        num_rows = max(nrp, self.rows_written)
        expected = self.refs[0].gathered_block_tables(
            step.idx_mapping, num_rows, step.num_computed_tokens
        )
        for g in range(self.num_groups):
            values, defined = expected[g]
            self.table_values[g][:num_rows] = values
            self.table_defined[g][:num_rows] = defined
        self.rows_written = nrp
        return self._check_model(step, tables, None, num_rows)

    def _check_model(
        self, step: Step, tables: list[np.ndarray], call: str | None, num_rows: int = 0
    ) -> list[Violation]:
        found = []
        for g in range(self.num_groups):
            values, defined = self.table_values[g], self.table_defined[g]
            found += self._compare(step, g, tables[g], values, defined, num_rows, call)
        return found

    def _compare(
        self,
        step: Step,
        g: int,
        actual: np.ndarray,
        values: np.ndarray,
        defined: np.ndarray,
        num_rows: int,
        call: str | None,
    ) -> list[Violation]:
        bad = (actual != values[None]) & defined[None]  # [cp, rows, width]
        if not bad.any():
            return []
        found = []
        for k, b, j in np.argwhere(bad)[:_PER_STEP_REPORTS].tolist():
            found.append(self._table_violation(step, g, k, b, j, values, actual[k], num_rows, call))
        return found

    def _table_violation(
        self,
        step: Step,
        g: int,
        k: int,
        b: int,
        j: int,
        values: np.ndarray,
        actual: np.ndarray,
        num_rows: int,
        call: str | None,
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
        where = "" if call in (None, "out") else " of the persistent tables"
        if step.kind == "dummy":
            v.what = (
                f"row {b}{where}: a profiling run's ids (written into the views "
                f"get_dummy_block_tables handed out) are not what the tables hold"
                if b < step.dummy_num_reqs and step.profile
                else f"get_dummy_block_tables left row {b} non-zero (it may hold stale ids)"
            )
        elif call not in (None, "out"):
            v.what = f"{call} changed row {b} of the persistent input_block_tables"
        elif b >= step.num_reqs_padded:
            v.what = (
                f"row {b} left by a larger batch (or handed out by a dummy run) is not zero"
                if b < num_rows
                else f"row {b}, outside this gather, changed"
            )
        elif b >= step.num_reqs:
            v.what = f"padding row {b} is not zero"
        elif step.idx_mapping[b] < 0:
            v.what = f"dummy row {b} is not zero"
        else:
            v.row, v.request = int(step.idx_mapping[b]), int(step.uids[b])
            rows = len(step.idx_mapping)
            unmasked = self.refs[0].gathered_block_tables(step.idx_mapping, rows, None)[g][0]
            if values[b, j] == NULL_BLOCK_ID and unmasked[b, j] != NULL_BLOCK_ID:
                w, bs = self.reach[g], self.kernel_sizes[g]
                nct = int(step.num_computed_tokens[v.row])
                v.what = (
                    f"sliding-window masking: block {int(unmasked[b, j])} lies wholly below "
                    f"the window ((j+1)*bs = {(j + 1) * bs} <= num_computed_tokens {nct} - "
                    f"reach {w}) and may be freed"
                )
            else:
                v.what = f"batch row {b} is not a copy of table row {v.row}"
        if call == "out":
            v.what += " (gather into the caller's out)"
        return v

    def _check_dummy(
        self, step: Step, slots: np.ndarray, tables: list[np.ndarray]
    ) -> list[Violation]:
        n = step.dummy_num_reqs
        rows = max(n, self.rows_written)
        junk_tables, junk_slots = profile_junk(step, self.widths, self.num_groups)
        for g in range(self.num_groups):
            self.table_values[g][:rows] = 0
            self.table_defined[g][:rows] = True
            if step.profile:
                self.table_values[g][:n] = junk_tables[g]
        self.rows_written = n  # handed out: they count as written (SPEC.md section 3)
        model = np.full(slots.shape, PAD_SLOT_ID, dtype=np.int64)
        if step.profile:
            model[:, :, : step.dummy_num_tokens] = junk_slots[None]
        self.slot_model = model
        found = []
        for k, g, t in np.argwhere(slots != model)[:_PER_STEP_REPORTS].tolist():
            found.append(
                Violation(
                    3,
                    "get_dummy_slot_mappings left a non-PAD entry"
                    if t >= step.dummy_num_tokens or not step.profile
                    else "a profiling run's slots (written into the view "
                    "get_dummy_slot_mappings handed out) are not in slot_mappings",
                    step.index,
                    g,
                    token=t,
                    rank=k,
                    expected=_slot(int(model[k, g, t])),
                    actual=_slot(int(slots[k, g, t])),
                )
            )
        return found + self._check_model(step, tables, None, rows)
