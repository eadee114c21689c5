"""Integrity probes (SPEC.md 8.3): faults the checks must name, planted in instances of their own.

With integrity checks on, a slot shared by two tokens, a gather that reads a
count never published, and a gathered row that differs from its source must
raise `RuntimeError` naming the group, the rows or slot, and the tokens
involved. No legal workload makes these faults, so each probe builds an
instance, plants one, and requires the error and a number it must name.
Findings are check 10.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np

from ..reference import ReferenceBlockTables
from .planted import (
    CUT_ROWS,
    ENV_VAR,
    FRESH_ID,
    SHARED_ID,
    aliased_gather,
    aliased_pair,
    equal_pair,
    fault_behind_cut_rows,
    fault_behind_dummy_rows,
    filled,
    i32,
    i64,
    stale_behind_clean_rows,
    stale_into_dirty_out,
)
from .violations import Violation

INTEGRITY = 10
_LOWER_ID = 2053  # row 2's blocks in the probe whose smallest live slots are unshared
_LOWER_TOKENS = 64  # the most positions row 2 maps there


def names_number(message: str, number: str) -> bool:
    """Whether `message` holds `number` as a whole number (slot 12 is not in "123")."""
    return re.search(rf"(?<![0-9]){re.escape(number)}(?![0-9])", message) is not None


def probe_reference(args: list, kwargs: dict, cp_rank: int) -> ReferenceBlockTables:
    """The reference for the constructor arguments `(args, kwargs)` on rank `cp_rank`."""
    block_sizes, max_num_reqs, max_tokens, max_blocks, _ = args
    cfg = SimpleNamespace(
        block_sizes=block_sizes,
        max_num_reqs=max_num_reqs,
        max_num_batched_tokens=max_tokens,
        max_num_blocks_per_group=max_blocks,
        cp_size=kwargs.get("cp_size", 1),
        cp_rank=cp_rank,
        cp_interleave=kwargs.get("cp_interleave", 1),
        slot_mapping_enabled=kwargs.get("slot_mapping_enabled"),
        dcp_sharded=kwargs.get("dcp_sharded"),
        sliding_window_reach=kwargs.get("sliding_window_reach"),
        kernel_block_sizes=kwargs.get("kernel_block_sizes"),
    )
    return ReferenceBlockTables(cfg)


def _shared_rows(ref: ReferenceBlockTables, max_tokens: int) -> tuple[list, int] | None:
    """Block ids that make rows 0 and 1 hold the same blocks over positions `[0, P)`.

    `P` is one interleave round `cp_size * I` (every rank owns a position in
    it), capped so that both rows' tokens fit one step; `None` if the rows
    cannot hold it.
    """
    rules = ref.rules
    cp = max(rules.group_cp)  # cp_size, or 1 when no group is sharded
    span = min(cp * rules.interleave, max_tokens // 2)
    if rules.max_num_reqs < 2 or span < 1:
        return None
    ids = []
    for g in range(rules.num_groups):
        covers = rules.block_sizes[g] * rules.group_cp[g]  # positions one allocator block spans
        count = -(-span // covers)
        if count * rules.m[g] > rules.width[g]:
            return None
        ids.append([SHARED_ID + j for j in range(count)])
    return ids, span


def _expect_error(
    what: str,
    setup: Callable[[], Callable[[], object]],
    cp_rank: int,
    names: tuple[str, ...] | Callable[[], tuple[str, ...]] = (),
    refusal_ok: bool = False,
) -> list[Violation]:
    """`setup()` builds the state and returns the faulty call, which must raise `RuntimeError`
    whose message contains one of `names` (when given: SPEC.md 8.3 says what it names; a
    callable gives them once the call raised, from what it left behind);
    `refusal_ok`: a `ValueError` (the call refused before it ran) passes too."""
    refusal = " (or a ValueError refusing the call)" if refusal_ok else ""
    listed = () if callable(names) else names
    expected = "RuntimeError" + (f" naming one of {', '.join(listed)}" if listed else "") + refusal
    try:
        call = setup()
    except Exception as e:  # noqa: BLE001 - legal calls that raise are a finding too
        actual = f"setting up the probe raised {type(e).__name__}: {e}"
    else:
        try:
            call()
        except RuntimeError as e:
            wanted = names() if callable(names) else names
            if not wanted or any(names_number(str(e), n) for n in wanted):
                return []
            if callable(names):
                expected = f"RuntimeError naming one of {', '.join(wanted)}{refusal}"
            actual = f"RuntimeError: {e}"
        except ValueError as e:
            if refusal_ok:
                return []
            actual = f"ValueError: {e}"
        except Exception as e:  # noqa: BLE001
            actual = f"{type(e).__name__}: {e}"
        else:
            actual = "no error"
    return [Violation(INTEGRITY, what, -1, rank=cp_rank, expected=expected, actual=actual[:300])]


def probe_integrity(
    factory: Callable, args: list, kwargs: dict, cp_rank: int, fused: bool
) -> list[Violation]:
    """Plant the faults of SPEC.md 8.3 on fresh instances.

    A shared slot: rows 0 and 1 hold the same block ids and both map positions
    `[0, P)` (an allocator that hands one block to two requests); the message
    must name one of the shared slots, and the environment variable alone must
    turn the checks on too. Rows 0 and 1 holding block 1 share its first slot,
    the first past the null block's. Rows 0 and 1 sharing slots above row 2's
    unshared ones must be named too, and so must one request alone in its batch
    whose row holds one block twice. A stale count, both ways: a row grown by
    an append, and a row cut short by an overwrite with fewer blocks, after the
    last apply, then a gather of that row, alone, into `out` tensors holding
    other ids (`stale_into_dirty_out`) and behind eight clean rows
    (`stale_behind_clean_rows`). `fused`:
    the implementation has `gather_and_compute_slot_mappings` (section 8.2),
    whose effects are those of both calls, checks included. A gathered row
    unlike its source, counts published: see `aliased_gather`, `aliased_pair`,
    `fault_behind_cut_rows` and `fault_behind_dummy_rows`.
    """
    device = args[4]
    ref = probe_reference(args, kwargs, cp_rank)
    n = ref.rules.num_groups
    methods = ("gather_block_tables", "gather_and_compute_slot_mappings")[: 1 + fused]
    found: list[Violation] = []
    shared = _shared_rows(ref, args[2]) if n else None
    if shared is not None:
        ways = [("compute_slot_mappings", kwargs, ""), *((m, kwargs, "") for m in methods[1:])]
        plain = {k: v for k, v in kwargs.items() if k != "integrity_checks"}
        ways.append(("compute_slot_mappings", plain, f" (checks on by {ENV_VAR}=1 alone)"))
        found += _shared_slot(factory, args, ref, cp_rank, *shared, ways, "")
    if n and args[2] >= 2:
        # Block 1's first slot is the first past the null block's: a bound to get right.
        ways = [("compute_slot_mappings", kwargs, "")]
        found += _shared_slot(factory, args, ref, cp_rank, [[1]] * n, 1, ways, " at block 1")
    if shared is not None and ref.rules.max_num_reqs >= 3 and args[2] >= 3:
        ids, span = shared[0], min(shared[1], args[2] // 3)
        lower = _lower_row(ref, args[2] - 2 * span)
        ways = [("compute_slot_mappings", kwargs, "")]
        where = f" above the {lower[1]} of row 2, the smallest"
        found += _shared_slot(factory, args, ref, cp_rank, ids, span, ways, where, lower)
    if n:
        found += _block_twice_in_one_row(factory, args, ref, kwargs, cp_rank)
    stale = {"grown by an append": False, "cut short by an overwrite": True}
    two_fit = all(w >= 2 * m for w, m in zip(ref.rules.width, ref.rules.m))
    row = ref.rules.max_num_reqs - 1  # gathered into batch row 0: the message names one of them
    rows = (str(row), "0")
    for (change, overwrite), how in itertools.product(stale.items(), methods if two_fit else ()):

        def setup(how=how, overwrite=overwrite):
            first = [SHARED_ID, FRESH_ID] if overwrite else [SHARED_ID]
            impl = filled(factory, args, kwargs, {row: [first] * n})
            impl.append_block_ids(row, tuple([FRESH_ID] for _ in range(n)), overwrite)  # no apply
            idx = i32([row], device)
            if how == "gather_block_tables":
                return lambda: impl.gather_block_tables(idx, 1)
            q, pos = i32([0, 1], device), i64([0], device)
            return lambda: impl.gather_and_compute_slot_mappings(idx, 1, q, pos, 1)

        what = f"{how} of row {row} {change} after the last apply_staged_writes (a stale count)"
        found += _expect_error(what, setup, cp_rank, rows)
    if two_fit:
        found += _expect_error(
            f"gather_block_tables of row {row} grown by an append after the last "
            "apply_staged_writes, into out tensors holding other ids (a stale count)",
            lambda: stale_into_dirty_out(factory, args, kwargs, ref, row),
            cp_rank,
            rows,
        )
    if two_fit and ref.rules.max_num_reqs > CUT_ROWS:
        found += _expect_error(
            f"gather_block_tables of rows 0 to {CUT_ROWS - 1}, clean, then row {row}, cut "
            f"short by an overwrite after the last apply_staged_writes (a stale count behind "
            f"{CUT_ROWS} clean rows: the message must name row {row} or batch row {CUT_ROWS})",
            lambda: stale_behind_clean_rows(factory, args, kwargs, ref),
            cp_rank,
            (str(row), str(CUT_ROWS)),
        )
    for falling in (False, True)[: 2 * (n >= 2)]:
        found += _expect_error(  # row 0: a check comparing the sources with themselves is blind
            "gather_block_tables of row 0 into one out tensor given for every group, their "
            f"block ids {'falling' if falling else 'rising'} with the group (a gathered row "
            "that differs from its source, counts all published)",
            lambda falling=falling: aliased_gather(factory, args, kwargs, ref, 0, falling),
            cp_rank,
            ("0",),
            refusal_ok=True,
        )
    if n >= 3 and all(w >= 3 * m for w, m in zip(ref.rules.width, ref.rules.m)):  # 3 blocks a row
        state: dict = {}
        found += _expect_error(
            "gather_block_tables of row 0 with one out tensor given for groups 1 and 2 and one "
            "of its own for every other group (the message must name a group whose entries "
            "that tensor does not hold)",
            lambda: aliased_pair(factory, args, kwargs, ref, state),
            cp_rank,
            lambda: state["differing"](),
            refusal_ok=True,
        )
    pair = equal_pair(ref)
    if pair is not None and ref.rules.max_num_reqs > CUT_ROWS:
        last = ref.rules.max_num_reqs - 1
        found += _expect_error(
            f"gather_block_tables of rows 0 to {CUT_ROWS - 1}, cut short by an overwrite, then "
            f"row {last}, with one out tensor given for groups {pair[0]} and {pair[1]} (the "
            f"message must name row {last}, batch row {CUT_ROWS}, the one that differs)",
            lambda: fault_behind_cut_rows(factory, args, kwargs, ref, pair),
            cp_rank,
            (str(last), str(CUT_ROWS)),
            refusal_ok=True,
        )
        found += _expect_error(
            f"gather_block_tables of {CUT_ROWS} dummy entries (-1), then row {last}, with one "
            f"out tensor given for groups {pair[0]} and {pair[1]} (the message must name row "
            f"{last}, batch row {CUT_ROWS}, the one that differs)",
            lambda: fault_behind_dummy_rows(factory, args, kwargs, ref, pair),
            cp_rank,
            (str(last), str(CUT_ROWS)),
            refusal_ok=True,
        )
    return found


def _shared_slot(
    factory: Callable,
    args: list,
    ref: ReferenceBlockTables,
    cp_rank: int,
    ids: list,
    span: int,
    ways: list,
    where: str,
    lower: tuple[list, int] | None = None,
) -> list[Violation]:
    """Rows 0 and 1 hold the blocks `ids` and both map positions `[0, span)`; each way
    `(method, kwargs, note)` must raise naming one of the slots they share (if any).

    `lower`: row 2 holds these blocks, below `ids`, and maps positions
    `[0, lower[1])` after them (`_lower_row`), so each group's smallest live
    slots are ones no other token holds. An explanation that compares every
    slot with the smallest, or names the first slots in order whether shared
    or not, names nothing.
    """
    held = [ids, ids] if lower is None else [ids, ids, lower[0]]
    for r, row_ids in enumerate(held):
        ref.append_block_ids(r, row_ids, True)  # overwrites: the row holds `row_ids` alone
    k = len(held)
    spans = [span, span] + ([] if lower is None else [lower[1]])
    positions = [p for n in spans for p in range(n)]
    qsl = [0, *itertools.accumulate(spans)]
    n = len(positions)
    shared_slots = _shared_by_reference(ref, qsl, positions)
    if not shared_slots:
        return []
    device, found = args[4], []
    for how, kw, note in ways:

        def setup(how=how, kw=kw, env=bool(note)):
            impl = filled(factory, args, kw, dict(enumerate(held)), env=env)
            idx, q, pos = i32(list(range(k)), device), i32(qsl, device), i64(positions, device)
            if how == "compute_slot_mappings":
                return lambda: impl.compute_slot_mappings(idx, q, pos, n)
            return lambda: impl.gather_and_compute_slot_mappings(idx, k, q, pos, n)

        what = f"{how} with rows 0 and 1 holding the same blocks (a shared slot{where}){note}"
        found += _expect_error(what, setup, cp_rank, shared_slots)
    return found


def _lower_row(ref: ReferenceBlockTables, most: int) -> tuple[list, int]:
    """Row 2's blocks (`_LOWER_ID` on, below `SHARED_ID`) and its positions `[0, n)`:
    up to `_LOWER_TOKENS` of them, at most `most`, as many as every group's table holds.
    Past eight live slots of each group on a rank (as many as a message may list), so
    that an explanation naming the smallest slots whether shared or not misses the
    shared one."""
    rules = ref.rules
    covers = [rules.block_sizes[g] * rules.group_cp[g] for g in range(rules.num_groups)]
    fits = min(w // m * v for w, m, v in zip(rules.width, rules.m, covers))
    n = max(1, min(_LOWER_TOKENS, most, fits))
    return [[_LOWER_ID + j for j in range(-(-n // v))] for v in covers], n


def _block_twice_in_one_row(
    factory: Callable, args: list, ref: ReferenceBlockTables, kwargs: dict, cp_rank: int
) -> list[Violation]:
    """One request whose row holds one block twice, alone in its batch: its tokens at
    positions `q` and `C + q` share a slot, `C` a whole number of every group's block spans.
    The other shared-slot probes batch two or three requests, so an explanation that finds
    a token's batch entry wrong only when the batch has one entry names nothing there."""
    rules = ref.rules
    covers = [rules.block_sizes[g] * rules.group_cp[g] for g in range(rules.num_groups)]
    c = math.lcm(*covers)
    span = min(max(rules.group_cp) * rules.interleave, args[2] // 2, c)
    ids = [[SHARED_ID] * -(-(c + span) // v) for v in covers]
    if span < 1 or any(len(i) * m > w for i, m, w in zip(ids, rules.m, rules.width)):
        return []
    ref.append_block_ids(0, ids, True)
    positions = [*range(span), *range(c, c + span)]
    qsl = [0, 2 * span]
    shared_slots = _shared_by_reference(ref, qsl, positions)
    if not shared_slots:
        return []
    device = args[4]

    def setup():
        impl = filled(factory, args, kwargs, {0: ids})
        idx, q, pos = i32([0], device), i32(qsl, device), i64(positions, device)
        return lambda: impl.compute_slot_mappings(idx, q, pos, 2 * span)

    what = f"compute_slot_mappings of one request holding block {SHARED_ID} twice (a shared slot)"
    return _expect_error(what, setup, cp_rank, shared_slots)


def _shared_by_reference(ref: ReferenceBlockTables, qsl: list, positions: list) -> tuple:
    """The slots two tokens share when batch entries `0..len(qsl)-2` (rows of the same
    numbers) map `positions`, as the reference maps them: the numbers an error must name."""
    rows = np.arange(len(qsl) - 1)
    expected = ref.slot_mappings(rows, np.array(qsl), np.array(positions), len(positions))
    return tuple(str(x) for row in expected for x in _repeats(row))


def _repeats(row: np.ndarray) -> list[int]:
    """Slots (>= 0) that two or more tokens of `row` share."""
    values, counts = np.unique(row[row >= 0], return_counts=True)
    return values[counts > 1].tolist()
