"""A gather of more rows than one program holds: 2**16 + 1 rows of one block each.

SPEC.md 3 bounds `max_num_reqs` by nothing. Engines run a few hundred rows and
the sweep's workloads at most 20, so an implementation that sizes its gather
programs by the table's width (the entries a program holds, divided by the
columns) never needs a second program of rows there: on the CPU, where the
interpreter's programs hold 65,536 entries, that takes more than 65,536 rows of
one column. The probe builds the preset's model with 2**16 + 1 rows and one
block a row, writes rows 0, 1 and the last, gathers every row in reverse order
and compares the result with the reference. It runs where the many-groups probe
does (presets of six groups or more, first CP group: `groups-6`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from .integrity_probes import probe_reference
from .violations import Violation

MANY_ROWS = 2**16 + 1
_CONSTRUCTION = 9  # the check a legal configuration that fails reports (`probes`)


def probe_many_rows(factory: Callable, args: list, kwargs: dict, cp_rank: int) -> list[Violation]:
    """A model of `MANY_ROWS` rows must gather every one of them as the reference does."""
    block_sizes, _, max_tokens, _, device = args
    if not block_sizes:
        return []
    one = [1] * len(block_sizes)
    ref = probe_reference([block_sizes, MANY_ROWS, max_tokens, one, device], kwargs, cp_rank)
    written = {
        r: tuple([1 + r + g] for g in range(len(block_sizes))) for r in (0, 1, MANY_ROWS - 1)
    }
    what = f"a gather of all {MANY_ROWS} rows of a model with one block a row (legal: SPEC.md 3)"
    try:
        impl = factory(block_sizes, MANY_ROWS, max_tokens, one, device, **kwargs)
        for r, ids in written.items():
            impl.append_block_ids(r, ids, True)
            ref.append_block_ids(r, ids, True)
        impl.apply_staged_writes()
        idx = torch.arange(MANY_ROWS - 1, -1, -1, dtype=torch.int32, device=device)
        views = [v.cpu().numpy() for v in impl.gather_block_tables(idx, MANY_ROWS)]
    except Exception as e:  # noqa: BLE001 - a legal call that fails is the finding
        actual = f"{type(e).__name__}: {e}"[:300]
        return [
            Violation(_CONSTRUCTION, what, -1, rank=cp_rank, expected="it gathers", actual=actual)
        ]
    expected = ref.gathered_block_tables(idx.cpu().numpy(), MANY_ROWS)
    for g, (got, (values, defined)) in enumerate(zip(views, expected, strict=True)):
        wrong = np.argwhere(defined & (got[:, : values.shape[1]] != values))
        if wrong.size:
            b, j = (int(x) for x in wrong[0])
            return [
                Violation(
                    _CONSTRUCTION,
                    f"{what}: group {g}, batch entry {b} (row {MANY_ROWS - 1 - b}), column {j}",
                    -1,
                    rank=cp_rank,
                    expected=str(int(values[b, j])),
                    actual=str(int(got[b, j])),
                )
            ]
    return []
