"""The wake-up probe: an instance of its own sleeps and wakes up as an engine does (SPEC.md 8.4).

An engine's sleep mode may discard the contents of every device tensor the
block tables own; on wake-up it calls `init_block_table_layout_tensors()`,
re-appends every live row with `overwrite=True` and applies, and from then on
every method must behave as if no sleep happened. The workload never sleeps,
so without this probe a wake-up that raises, or one that leaves a derived
tensor (a pointer, stride, size, flag or reach) as the sleep left it, passes
every step. Per preset and rank, on a fresh instance built from the preset's
own constructor arguments (the workload's instance never sleeps):

1. the control: two rows far apart (`0` and `max_num_reqs - 1`) get blocks
   in every group, by an overwrite and an append, and are applied; a gather
   of every row (`num_reqs_padded = max_num_reqs`) writes the whole
   persistent tables, then one step's reads (`gather_block_tables` with a
   padded row, `compute_slot_mappings` over the whole buffer, and
   `gather_and_compute_slot_mappings` where the implementation has it,
   SPEC.md 8.2) are compared with the reference's, and the persistent rows
   past the step's padded batch must be zero (left by the larger gather).
   A difference, or an error, here is no wake-up defect: the probe stops
   without a finding and leaves it to the workload's checks, which name it
   by the check it breaks;
2. `sleep.simulate_sleep` overwrites every device tensor the instance owns
   with garbage, in place (host truth is left alone);
3. the wake-up: `init_block_table_layout_tensors()`; then no device tensor
   other than section 3's refilled buffers may still hold the garbage
   (`sleep.survivors`: checked before any kernel runs, since a stale pointer
   table would make a kernel touch a random address), and the forward-pass
   tables and slot mappings keep their addresses (`sleep.moved`); then both
   rows re-appended with `overwrite=True` and applied;
4. the same step's reads again, each way: every output must equal the
   reference's, as it did before the sleep, and the persistent rows past the
   padded batch must be zero again: without the sleep they would be, and the
   step's gather need not touch them (the call before it wrote no more rows).

5. the reallocation (SPEC.md 3: `init_block_table_layout_tensors()` rebuilds
   the pointer, stride and size tensors after the tables are reallocated):
   every group's `block_tables[g].gpu` becomes a view `[:, :width]` of fresh
   memory whose rows are wider than the table's (so row `r` starts at `r`
   times the stride, not the width), filled with junk; then
   `init_block_table_layout_tensors()`, both rows appended anew with other
   block ids (`overwrite=True`) and applied, and the same reads once more.
   An apply into the old tables, or a row found by its width, differs there.
   Skipped where the tables cannot be replaced.

Anything raised, kept, moved or different is check 11, naming what happened.
An implementation without `init_block_table_layout_tensors` is reported as
"not supported by this implementation", never as a pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..reference import ReferenceBlockTables
from .features import UNSUPPORTED
from .integrity_probes import probe_reference
from .sleep import moved, simulate_sleep, survivors
from .violations import Violation

WAKE = 11
WAKE_UP = "init_block_table_layout_tensors"
NOT_SUPPORTED = f"{WAKE_UP}() (SPEC.md 8.4): {UNSUPPORTED}"
_FIRST_ID = 7  # allocator block ids from here: far from the null block 0
_MAX_TOKENS_A_ROW = 16  # keep it cheap
_SPARE_COLUMNS = 3  # a reallocated table's row pitch past its width
_JUNK = 0x5A5A5A5A  # what a reallocated table holds before the re-appends
_MOVED_IDS = 64  # the re-appends' ids: these far from the ones before


class _Found(Exception):
    """A finding that ends the probe: what happened, as the violation will say it."""

    def __init__(self, what: str, expected: str = "", actual: str = "", **where) -> None:
        super().__init__(what)
        self.violation = (what, expected, actual, where)


def probe_wake_up(
    factory: Callable,
    args: list,
    kwargs: dict,
    cp_rank: int,
    fused: bool,
    seed: Sequence[int] = (0,),
) -> tuple[list[Violation], str | None]:
    """Sleep and wake up a fresh instance; `(violations, what was not supported or None)`.

    `args` and `kwargs` built the preset's instance (`args[4]` is the device);
    `fused`: the implementation has `gather_and_compute_slot_mappings`;
    `seed` seeds the sleep's garbage.
    """
    device = args[4]
    try:
        impl = factory(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the workload's own construction reports it too
        return [_violation(f"building the probe's instance raised {_name(e)}", cp_rank)], None
    if not callable(getattr(impl, WAKE_UP, None)):
        return [], NOT_SUPPORTED
    ref = probe_reference(args, kwargs, cp_rank)
    step = _Step(ref, device)
    try:
        _before(impl, ref, step, fused)
    except _Found:  # not the wake-up's defect: the workload's checks name it, as theirs
        return [], None
    try:
        _wake(impl, step, device, fused, np.random.default_rng([*seed, cp_rank]))
        _reallocate(impl, step, fused)
    except _Found as f:
        what, expected, actual, where = f.violation
        return [_violation(what, cp_rank, expected, actual, **where)], None
    return [], None


def _before(impl, ref: ReferenceBlockTables, step: _Step, fused: bool) -> None:
    """Fill both rows and read them once each way: the control, before any sleep."""
    for i, row in enumerate(step.rows):
        ids = step.ids[i]
        _call(f"append_block_ids of row {row} before the sleep", impl.append_block_ids,
              row, tuple(g[:1] for g in ids), True)  # fmt: skip
        _call(f"append_block_ids of row {row} before the sleep", impl.append_block_ids,
              row, tuple(g[1:] for g in ids), False)  # fmt: skip
        ref.append_block_ids(row, ids, True)
    _call("apply_staged_writes before the sleep", impl.apply_staged_writes)
    step.gather_every_row(impl, "before the sleep")
    step.read(impl, "before the sleep", fused=False)
    if fused:
        step.read(impl, "before the sleep", fused=True)


def _wake(impl, step: _Step, device, fused: bool, rng) -> None:
    """Sleep, wake up as an engine does, and read again: any difference is the wake-up's."""
    slept = simulate_sleep(impl, device, rng)
    _call(f"{WAKE_UP}() after the sleep", getattr(impl, WAKE_UP))
    kept = survivors(impl, device, slept)
    if kept:
        raise _Found(
            f"after {WAKE_UP}(), {len(kept)} derived device tensor(s) still hold what the "
            f"sleep left: {kept[0]['path']} {kept[0]['what']}",
            "every derived device tensor rebuilt",
            ", ".join(k["path"] for k in kept[:6]),
        )
    lines = moved(impl, slept)
    if lines:
        raise _Found(
            f"a forward-pass buffer moved across the sleep: {lines[0]}",
            "input_block_tables and slot_mappings keep their addresses",
            "; ".join(lines[:4]),
        )
    for i, row in enumerate(step.rows):
        _call(f"re-appending row {row} with overwrite=True after {WAKE_UP}()",
              impl.append_block_ids, row, tuple(step.ids[i]), True)  # fmt: skip
    _call("apply_staged_writes after the re-appends", impl.apply_staged_writes)
    step.read(impl, "after the wake-up", fused=False)
    if fused:
        step.read(impl, "after the wake-up", fused=True)


def _reallocate(impl, step: _Step, fused: bool) -> None:
    """Move every table into a wider allocation, rebuild, re-append other ids, read again."""
    tables = getattr(impl, "block_tables", None)
    if not tables or not all(isinstance(getattr(t, "gpu", None), torch.Tensor) for t in tables):
        return
    for t in tables:
        rows, width = t.gpu.shape
        wide = torch.full((rows, width + _SPARE_COLUMNS), _JUNK, dtype=t.gpu.dtype,
                          device=t.gpu.device)  # fmt: skip
        try:
            t.gpu = wide[:, :width]
        except AttributeError:  # tables this implementation does not let an engine replace
            return
    _call(f"{WAKE_UP}() after the tables were reallocated", getattr(impl, WAKE_UP))
    step.ids = [[[i + _MOVED_IDS for i in g] for g in row] for row in step.ids]
    for i, row in enumerate(step.rows):
        _call(f"appending row {row} after the tables were reallocated",
              impl.append_block_ids, row, tuple(step.ids[i]), True)  # fmt: skip
        step.ref.append_block_ids(row, step.ids[i], True)
    _call("apply_staged_writes after the tables were reallocated", impl.apply_staged_writes)
    step.read(impl, "after the tables were reallocated", fused=False)
    if fused:
        step.read(impl, "after the tables were reallocated", fused=True)


class _Step:
    """Two rows, their ids and positions, and one step's reads of them checked."""

    def __init__(self, ref: ReferenceBlockTables, device: torch.device) -> None:
        rules = ref.rules
        self.ref, self.device = ref, device
        self.rows = sorted({0, rules.max_num_reqs - 1})
        max_blocks = ref.config.max_num_blocks_per_group
        counts = [min(2, int(c)) for c in max_blocks]  # allocator blocks a row holds
        self.ids = [
            [[_FIRST_ID + 8 * g + 4 * i + j for j in range(c)] for g, c in enumerate(counts)]
            for i in range(len(self.rows))
        ]
        # positions every group's blocks cover: counts * block size * the group's CP size
        covers = [c * b * cp for c, b, cp in zip(counts, rules.block_sizes, rules.group_cp)]
        span = min(covers, default=_MAX_TOKENS_A_ROW)
        max_tokens = int(ref.config.max_num_batched_tokens)
        t = max(1, min(span, max_tokens // len(self.rows), _MAX_TOKENS_A_ROW))
        self.batch = self.rows[::-1]  # batch row b reads table row batch[b]: not the same
        # the batch's first row reads the end of what its blocks cover, the second the start
        ends = [(span - t, span), (0, t)]
        self.positions = np.concatenate(
            [np.arange(*ends[b], dtype=np.int64) for b in range(len(self.batch))]
        )
        self.qsl = np.arange(len(self.batch) + 1, dtype=np.int64) * t
        self.padded = min(len(self.batch) + 1, rules.max_num_reqs)  # one padded row when it fits
        self.num_tokens = max_tokens  # the whole buffer: the tail must be PAD_SLOT_ID

    def gather_every_row(self, impl, when: str) -> None:
        """A gather padded to `max_num_reqs`: it writes every persistent row."""
        idx = torch.tensor(self.batch, dtype=torch.int32, device=self.device)
        _call(f"gather_block_tables of every row {when}", impl.gather_block_tables,
              idx, self.ref.rules.max_num_reqs)  # fmt: skip

    def read(self, impl, when: str, fused: bool) -> None:
        """One step's reads through the separate calls or the fused one, checked."""
        d = self.device
        idx = torch.tensor(self.batch, dtype=torch.int32, device=d)
        qsl = torch.tensor(self.qsl, dtype=torch.int32, device=d)
        pos = torch.tensor(self.positions, dtype=torch.int64, device=d)
        if fused:
            how = "gather_and_compute_slot_mappings"
            tables, slots = _call(f"{how} {when}", impl.gather_and_compute_slot_mappings,
                                  idx, self.padded, qsl, pos, self.num_tokens)  # fmt: skip
            what = {"tables": how, "slots": how}
        else:
            tables = _call(f"gather_block_tables {when}", impl.gather_block_tables,
                           idx, self.padded)  # fmt: skip
            slots = _call(f"compute_slot_mappings {when}", impl.compute_slot_mappings,
                          idx, qsl, pos, self.num_tokens)  # fmt: skip
            what = {"tables": "gather_block_tables", "slots": "compute_slot_mappings"}
        self._tables(tables, f"{what['tables']} {when}")
        self._slots(slots, f"{what['slots']} {when}")
        if not fused:
            self._rows_past_the_batch(impl, f"{what['tables']} {when}")

    def _rows_past_the_batch(self, impl, what: str) -> None:
        """Persistent rows `[padded, max_num_reqs)`: zeroed by the gather of every row
        before, untouched since; nothing left by the sleep may show there."""
        for g, t in enumerate(impl.input_block_tables):
            rest = t[self.padded :].cpu().numpy()
            bad = np.argwhere(rest != 0)
            if len(bad):
                r, j = (int(x) for x in bad[0])
                raise _Found(
                    f"after {what}, persistent row {self.padded + r} of group {g} (past the "
                    f"padded batch, zeroed by an earlier gather of every row) is not zero "
                    f"({len(bad)} entries)",
                    "0",
                    str(rest[r, j]),
                    group=g,
                    row=self.padded + r,
                )

    def _tables(self, tables, what: str) -> None:
        expected = self.ref.gathered_block_tables(np.array(self.batch), self.padded)
        if len(tables) != len(expected):
            raise _Found(f"{what} returned {len(tables)} tables", f"{len(expected)} (one a group)")
        for g, (got, (values, defined)) in enumerate(zip(tables, expected)):
            got = got[: self.padded].cpu().numpy().astype(np.int64)
            if got.shape[0] != self.padded or got.shape[1] < values.shape[1]:
                raise _Found(f"{what}: group {g}'s table is shaped {tuple(got.shape)}",
                             f"{self.padded} rows of {values.shape[1]}", group=g)  # fmt: skip
            got = got[:, : values.shape[1]]
            bad = np.argwhere(defined & (got != values))
            if len(bad):
                b, j = (int(x) for x in bad[0])
                row = self.batch[b] if b < len(self.batch) else None
                source = f"row {row}" if row is not None else "a padded row"
                raise _Found(
                    f"{what}: batch row {b} ({source}) entry {j} of group {g} differs from "
                    f"the reference ({len(bad)} entries differ)",
                    str(values[b, j]),
                    str(got[b, j]),
                    group=g,
                    row=row,
                )

    def _slots(self, slots, what: str) -> None:
        expected = self.ref.slot_mappings(
            np.array(self.batch), self.qsl, self.positions, self.num_tokens
        )
        got = slots.cpu().numpy().astype(np.int64)
        if got.shape != expected.shape:
            raise _Found(f"{what} returned shape {tuple(got.shape)}", str(expected.shape))
        bad = np.argwhere(got != expected)
        if len(bad):
            g, k = (int(x) for x in bad[0])
            b = int(np.searchsorted(self.qsl, k, side="right")) - 1
            row = self.batch[b] if b < len(self.batch) else None
            where = f"token {k} (position {self.positions[k]})" if row is not None else f"{k}"
            raise _Found(
                f"{what}: group {g} index {where} differs from the reference "
                f"({len(bad)} entries differ)",
                str(expected[g, k]),
                str(got[g, k]),
                group=g,
                row=row,
                token=k,
            )


def _call(what: str, fn: Callable, *args):
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - whatever it raises is the finding
        raise _Found(f"{what} raised {_name(e)}") from e


def _name(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"[:300]


def _violation(what: str, cp_rank: int, expected: str = "", actual: str = "", **where) -> Violation:
    return Violation(WAKE, what, -1, rank=cp_rank, expected=expected, actual=actual[:300], **where)
