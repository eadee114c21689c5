"""Gathers of more rows than one program holds: 2**16 + 1 rows of one block each, and
257 rows of 2,049 blocks.

SPEC.md 3 bounds neither `max_num_reqs` nor a row's width. Engines run a few
hundred rows and the sweep's workloads at most 20, so an implementation that
sizes its gather programs wrong never shows it there:
- by the table's width alone (the entries a program holds, divided by the
  columns): a second program of rows is needed, on the CPU, where the
  interpreter's programs hold 65,536 entries, only past 65,536 rows of one
  column;
- by the batch alone (every row in one program, whatever the width): Triton
  refuses a block of more than 2**20 entries, which 20 rows of 2,560 columns
  stay under and 257 rows of 2,049 (512 x 4,096 once padded) do not.
Each probe builds the preset's model with that many rows and blocks a row,
writes rows 0, 1 and the last, gathers every row in reverse order and compares
the result with the reference. They run where the many-groups probe does
(presets of six groups or more, first CP group: `groups-6`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from .integrity_probes import probe_reference
from .violations import Violation

MANY_ROWS = 2**16 + 1
WIDE_SHAPE = (257, 2049)  # rows, blocks a row: past 2**20 entries once padded to powers of two
_CONSTRUCTION = 9  # the check a legal configuration that fails reports (`probes`)


def probe_many_rows(factory: Callable, args: list, kwargs: dict, cp_rank: int) -> list[Violation]:
    """Models of `MANY_ROWS` rows of one block and of `WIDE_SHAPE` must gather every row
    as the reference does."""
    if not args[0]:
        return []
    found = _probe_rows(factory, args, kwargs, cp_rank, MANY_ROWS, 1)
    return found or _probe_rows(factory, args, kwargs, cp_rank, *WIDE_SHAPE)


def _probe_rows(
    factory: Callable, args: list, kwargs: dict, cp_rank: int, num_rows: int, width: int
) -> list[Violation]:
    block_sizes, _, max_tokens, _, device = args
    n = len(block_sizes)
    blocks = [width] * n
    ref = probe_reference([block_sizes, num_rows, max_tokens, blocks, device], kwargs, cp_rank)
    written = {
        r: tuple(list(range(1 + r + g, 1 + r + g + width)) for g in range(n))
        for r in (0, 1, num_rows - 1)
    }
    what = (
        f"a gather of all {num_rows} rows of a model with {width} block(s) a row (legal: SPEC.md 3)"
    )
    try:
        impl = factory(block_sizes, num_rows, max_tokens, blocks, device, **kwargs)
        for r, ids in written.items():
            impl.append_block_ids(r, ids, True)
            ref.append_block_ids(r, ids, True)
        impl.apply_staged_writes()
        idx = torch.arange(num_rows - 1, -1, -1, dtype=torch.int32, device=device)
        views = [v.cpu().numpy() for v in impl.gather_block_tables(idx, num_rows)]
    except Exception as e:  # noqa: BLE001 - a legal call that fails is the finding
        actual = f"{type(e).__name__}: {e}"[:300]
        return [
            Violation(_CONSTRUCTION, what, -1, rank=cp_rank, expected="it gathers", actual=actual)
        ]
    expected = ref.gathered_block_tables(idx.cpu().numpy(), num_rows)
    for g, (got, (values, defined)) in enumerate(zip(views, expected, strict=True)):
        wrong = np.argwhere(defined & (got[:, : values.shape[1]] != values))
        if wrong.size:
            b, j = (int(x) for x in wrong[0])
            return [
                Violation(
                    _CONSTRUCTION,
                    f"{what}: group {g}, batch entry {b} (row {num_rows - 1 - b}), column {j}",
                    -1,
                    rank=cp_rank,
                    expected=str(int(values[b, j])),
                    actual=str(int(got[b, j])),
                )
            ]
    return []
