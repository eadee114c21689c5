"""Instances with one integrity fault planted, for the probes of SPEC.md 8.3.

`integrity_probes` says what each probe requires of the error; this module
builds the states: rows filled and applied (`filled`), a stale count behind
clean rows, and gathers whose `out` tensors alias, so that a gathered row
differs from its source while every count is published. Each builder returns
the faulty call, unmade; inputs end at an unreadable page on the CPU
(`guarded`), so a read past them is a fault too.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable

import numpy as np
import torch

from ..reference import ReferenceBlockTables, expand_block_ids
from .guarded import guard

ENV_VAR = "CPBT_INTEGRITY_CHECKS"  # SPEC.md 8.3: also turns the checks on
SHARED_ID = 4099  # allocator block id both probe rows hold: far from the null block 0
FRESH_ID = 4111
CUT_ROWS = 8  # clean rows gathered before a faulty one: as many as a message may list


def i32(values, device: torch.device) -> torch.Tensor:
    """An input for the implementation: on the CPU it ends at an unreadable page (`guarded`)."""
    return guard(torch.tensor(values, dtype=torch.int32, device=device))


def i64(values, device: torch.device) -> torch.Tensor:
    return guard(torch.tensor(values, dtype=torch.int64, device=device))


def stale_behind_clean_rows(
    factory: Callable, args: list, kwargs: dict, ref: ReferenceBlockTables
) -> Callable[[], object]:
    """Rows `[0, CUT_ROWS)` hold a block each, applied; the last row holds two, applied,
    then one by an overwrite with no apply after it, so the count its gather reads is
    stale. Gathered behind the clean rows, a message that takes their agreeing counts for
    stale ones names them (eight a group) and never the last row."""
    rules, device = ref.rules, args[4]
    n, last = rules.num_groups, rules.max_num_reqs - 1
    impl = factory(*args, **kwargs)
    for r in range(CUT_ROWS):
        impl.append_block_ids(r, tuple([SHARED_ID + r] for _ in range(n)), True)
    impl.append_block_ids(last, tuple([FRESH_ID, FRESH_ID + 1] for _ in range(n)), True)
    impl.apply_staged_writes()
    impl.append_block_ids(last, tuple([FRESH_ID] for _ in range(n)), True)  # no apply
    idx = i32([*range(CUT_ROWS), last], device)
    return lambda: impl.gather_block_tables(idx, CUT_ROWS + 1)


def equal_pair(ref: ReferenceBlockTables) -> tuple[int, int] | None:
    """Two groups of one kernel block factor whose rows hold two blocks, if any."""
    m, width = ref.rules.m, ref.rules.width
    fit = [g for g in range(ref.rules.num_groups) if width[g] >= 2 * m[g]]
    return next(((a, b) for a, b in itertools.combinations(fit, 2) if m[a] == m[b]), None)


def _pair_sharing_out(
    num_rows: int, width: int, n: int, pair: tuple, device: torch.device
) -> list[torch.Tensor]:
    """Zeroed `out` tensors of `num_rows` x `width`, one for each of `n` groups, but one for
    both groups of `pair`."""
    shared = torch.zeros((num_rows, width), dtype=torch.int32, device=device)
    return [
        shared if g in pair else torch.zeros((num_rows, width), dtype=torch.int32, device=device)
        for g in range(n)
    ]


def fault_behind_cut_rows(
    factory: Callable, args: list, kwargs: dict, ref: ReferenceBlockTables, pair: tuple
) -> Callable[[], object]:
    """Rows `[0, CUT_ROWS)` hold three blocks, applied, then one by an overwrite, applied: each
    keeps stale entries at its count and one column past it, which are no difference from
    its source (a message that skips only the column at the count still sees one). They hold the
    same ids in every group, so the two groups of `pair`, sharing one `out` tensor, copy the
    same entries there. The last row holds different ids in those two groups, so whichever
    copy lands last, it alone differs from its source; gathered behind the cut rows, a
    message that names them (eight rows at a time) may never reach it."""
    rules, device = ref.rules, args[4]
    n, last = rules.num_groups, rules.max_num_reqs - 1
    impl = factory(*args, **kwargs)
    for r in range(CUT_ROWS):
        base = SHARED_ID + 3 * r
        impl.append_block_ids(r, tuple([base, base + 1, base + 2] for _ in range(n)), True)
    impl.apply_staged_writes()
    for r in range(CUT_ROWS):
        impl.append_block_ids(r, tuple([SHARED_ID + 3 * r] for _ in range(n)), True)
    fault = SHARED_ID + 3 * CUT_ROWS  # past the cut rows' ids
    impl.append_block_ids(last, tuple([fault + (g == pair[1])] for g in range(n)), True)
    impl.apply_staged_writes()
    num_rows = CUT_ROWS + 1
    outs = _pair_sharing_out(num_rows, max(rules.width), n, pair, device)
    idx = i32([*range(CUT_ROWS), last], device)
    return lambda: impl.gather_block_tables(idx, num_rows, out=outs)


def fault_behind_dummy_rows(
    factory: Callable, args: list, kwargs: dict, ref: ReferenceBlockTables, pair: tuple
) -> Callable[[], object]:
    """`CUT_ROWS` dummy entries (-1), then the last row, which holds different ids in the two
    groups of `pair`, sharing one `out` tensor, applied: whichever copy lands last, that row
    alone differs from its source. A dummy entry gives a zero row whose source is never read
    (SPEC.md 3), no difference; a message that names dummies (eight rows at a time) may never
    reach the row that differs. Row 0 holds blocks too, not gathered: an explanation that
    reads a dummy's source from a clamped row 0 sees it differ."""
    rules, device = ref.rules, args[4]
    n, last = rules.num_groups, rules.max_num_reqs - 1
    impl = factory(*args, **kwargs)
    impl.append_block_ids(0, tuple([SHARED_ID + 2] for _ in range(n)), True)
    impl.append_block_ids(last, tuple([SHARED_ID + (g == pair[1])] for g in range(n)), True)
    impl.apply_staged_writes()
    num_rows = CUT_ROWS + 1
    outs = _pair_sharing_out(num_rows, max(rules.width), n, pair, device)
    idx = i32([-1] * CUT_ROWS + [last], device)
    return lambda: impl.gather_block_tables(idx, num_rows, out=outs)


def stale_into_dirty_out(
    factory: Callable, args: list, kwargs: dict, ref: ReferenceBlockTables, row: int
) -> Callable[[], object]:
    """`row` holds one block, applied, then one more by an append with no apply after it (a
    stale count); the gather writes into caller-owned `out` tensors that hold other ids. The
    entry the stale count leaves uncopied then differs from its source as well: a check that
    lets the two findings cancel (a difference less a stale count) raises nothing, where
    zeroed tables, equal to the unwritten source there, hide the difference."""
    device, n = args[4], ref.rules.num_groups
    impl = filled(factory, args, kwargs, {row: [[SHARED_ID]] * n})
    impl.append_block_ids(row, tuple([FRESH_ID] for _ in range(n)), False)  # no apply
    outs = [
        torch.full((1, w), FRESH_ID + 1, dtype=torch.int32, device=device) for w in ref.rules.width
    ]
    return lambda: impl.gather_block_tables(i32([row], device), 1, out=outs)


def aliased_gather(
    factory: Callable,
    args: list,
    kwargs: dict,
    ref: ReferenceBlockTables,
    row: int,
    falling: bool = False,
) -> Callable[[], object]:
    """`row` holds a different block in every group, applied; the gather's `out` names one
    tensor for all groups, so one group's copy overwrites another's: a gathered row differs
    from its source while every count is published. Only the entry comparison of SPEC.md 8.3
    sees it (a refusal of the aliased `out` up front is fine too).

    The groups' first kernel ids rise with the group, or fall (`falling`): whichever group's
    copy lands last, in one of the two orders the others read ids smaller than their own,
    so a comparison that counts only larger gathered entries misses it there."""
    rules, device = ref.rules, args[4]
    ids: list = [None] * rules.num_groups
    top = -1  # the largest first kernel id so far: each group's must pass it
    order = range(rules.num_groups)
    for g in reversed(order) if falling else order:
        b = max(SHARED_ID, top // rules.m[g] + 1)
        ids[g], top = [b], b * rules.m[g]
    impl = filled(factory, args, kwargs, {row: ids})
    shared = torch.zeros((1, max(rules.width)), dtype=torch.int32, device=device)
    idx = i32([row], device)
    return lambda: impl.gather_block_tables(idx, 1, out=[shared] * rules.num_groups)


def aliased_pair(
    factory: Callable, args: list, kwargs: dict, ref: ReferenceBlockTables, state: dict
) -> Callable[[], object]:
    """Row 0 holds three blocks in every group, applied; groups 1 and 2 share one `out`
    tensor, every other group has its own. Their kernel ids differ in every column, so
    whichever copy lands last, one of the two differs from its source; once the call ran,
    `state["differing"]()` gives the groups whose entries the shared tensor does not hold,
    and a right message names one of them. Every other number a right message needs (row 0,
    group 0, counts of three or more entries, block ids) stays apart from 1 and 2, so a
    message that names the groups that match instead cannot pass."""
    rules, device = ref.rules, args[4]
    ids, kernel = [], []
    for g in range(rules.num_groups):
        b = SHARED_ID + 3 * g
        while g == 2 and _any_column_equal(
            expand_block_ids(range(b, b + 3), rules.m[g]), kernel[1]
        ):
            b += 3
        ids.append(list(range(b, b + 3)))
        kernel.append(expand_block_ids(ids[-1], rules.m[g]))
    impl = filled(factory, args, kwargs, {0: ids})
    width = max(rules.width)
    shared = torch.zeros((1, width), dtype=torch.int32, device=device)
    outs = [
        shared if g in (1, 2) else torch.zeros((1, width), dtype=torch.int32, device=device)
        for g in range(rules.num_groups)
    ]

    def differing() -> tuple[str, ...]:
        held = shared[0].cpu().numpy()
        return tuple(str(g) for g in (1, 2) if np.any(held[: kernel[g].size] != kernel[g]))

    state["differing"] = differing
    idx = i32([0], device)
    return lambda: impl.gather_block_tables(idx, 1, out=outs)


def _any_column_equal(a: np.ndarray, b: np.ndarray) -> bool:
    k = min(a.size, b.size)
    return bool(np.any(a[:k] == b[:k]))


def filled(
    factory: Callable, args: list, kwargs: dict, held: dict[int, list], env: bool = False
) -> object:
    """An instance whose rows hold the ids `held` gives them (`{row: ids}`), applied; `env`:
    built under `CPBT_INTEGRITY_CHECKS=1` (SPEC.md 8.3 reads it at construction), restored
    afterwards."""
    old = os.environ.get(ENV_VAR)
    if env:
        os.environ[ENV_VAR] = "1"
    try:
        impl = factory(*args, **kwargs)
    finally:
        if env and old is None:
            del os.environ[ENV_VAR]
        elif env:
            os.environ[ENV_VAR] = old
    for r, ids in held.items():
        impl.append_block_ids(r, tuple(ids), True)
    impl.apply_staged_writes()
    return impl
