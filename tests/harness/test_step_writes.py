"""The calls a step's appends become: a junk append filling the row an overwrite cuts."""

from __future__ import annotations

import numpy as np
import pytest

from cp_blocktables.harness import presets
from cp_blocktables.harness.workload import Workload, generate


def _cut_full_appends(w: Workload) -> int:
    """Group writes of `w` that fill their row up to its capacity and that the next write
    of the step, an overwrite of the row, cuts inside, behind another write to the group
    in the step, while the next row holds blocks that a later batch reads before anything
    overwrites them: where a wrong offset into the cut write spills, and shows."""
    p = w.preset
    cap = p.max_num_blocks_per_group()
    counts = np.zeros((len(cap), p.max_num_reqs), dtype=np.int64)
    found = 0
    for k, s in enumerate(w.steps):
        writes = [a for a in s.appends if not a.expect_error]
        for i, a in enumerate(writes):
            after = writes[i + 1] if i + 1 < len(writes) else None
            for g, ids in enumerate(a.block_ids):
                start, nxt = int(counts[g, a.row]), a.row + 1
                found += (
                    not a.ledger
                    and after is not None
                    and after.overwrite
                    and after.row == a.row
                    and start + len(ids) == cap[g]
                    and start < len(after.block_ids[g]) < cap[g]
                    and any(x.block_ids[g] for x in writes[:i])
                    and nxt < p.max_num_reqs
                    and counts[g, nxt] > 0
                    and _read_before_overwritten(w.steps[k:], nxt)
                )
                counts[g, a.row] = (0 if a.overwrite else start) + len(ids)
    return found


def _read_before_overwritten(steps: list, row: int) -> bool:
    for s in steps:
        if any(a.row == row and a.overwrite for a in s.appends):
            return False
        if s.kind == "real" and row in s.idx_mapping.tolist():
            return True
    return False


@pytest.mark.parametrize("name", ["cp8-large-ids", "cp8-span-2-31"])
def test_an_overwrite_cuts_an_append_that_fills_the_row(name):
    """The corner `overwrite_cuts_full_append`, counted as the generator counts it, holds
    what its name promises, in steps replayed here from the appends alone."""
    w = generate(presets.PRESETS[name], 0)
    assert "overwrite_cuts_full_append" in w.preset.corners
    assert _cut_full_appends(w) == w.corners["overwrite_cuts_full_append"] > 0
