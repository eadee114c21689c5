"""Serving through the harness: its preset run and executor, on a rank's kept serving state.

`Seat` is a rank's place in one CP group for one preset; its `ServingState`
(the implementation instance, request pool and KV caches) outlives eras
while the rank stays. `Phase` is the harness's preset run whose instance
lives in a seat; `ServingExecutor` is the harness's executor that also keeps
the pool and writes KV every step.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..harness import presets, runner
from ..harness.workload import Step
from .era_comm import EraComm
from .fault_inject import Fault
from .options import DrillOptions
from .serving import JUNK_UID, ServingState


class Seat:
    """A rank's place in one CP group for one preset; its state outlives eras while it stays."""

    def __init__(self) -> None:
        self.state: ServingState | None = None
        self.recent_ids: list[list[int]] = []


class ServingExecutor(runner._Executor):
    """The harness's executor, on a serving state: keeps the pool and writes KV every step.

    In a warm-up (`in_warmup`) the steps' appends come from warm-up requests,
    and the flag is left to the enclosing `null_block_warmup`.
    """

    def __init__(
        self,
        seat: Seat,
        preset: presets.Preset,
        device,
        fault: Fault | None,
        where: str,
        in_warmup: bool = False,
    ) -> None:
        state = seat.state
        super().__init__(state.impl, preset, device)
        self.seat, self.state, self.fault, self.where = seat, state, fault, where
        self.in_warmup = in_warmup
        self.appended: list[set[int]] = [set() for _ in range(self.num_groups)]
        self.tokens = 0

    def run(self, step: Step):
        pool = self.state.pool
        if self.in_warmup:
            for a in step.appends:
                pool.admit_warmup(a.uid, a.row)
            drive = dataclasses.replace(step, kind="real")
        else:
            for r in step.admitted:
                pool.admit(r.uid, r.row)
            drive = step
        try:
            out = super().run(drive)
            if step.kind != "dummy":
                self._write_kv(step)
        finally:
            if self.in_warmup:
                for a in step.appends:
                    pool.release_warmup(a.row)
            else:
                for f in step.finished:
                    pool.finish(f.uid)
        if step.kind == "real":
            for a in step.appends:
                if a.expect_error:  # refused by contract: nothing was appended
                    continue
                for g, ids in enumerate(a.block_ids):
                    self.appended[g].update(ids)
                if not self.in_warmup:
                    self.state.note_append(a.uid, a.row, a.block_ids, a.overwrite)
        if self.fault is not None:
            self.fault.after_step(step.index, self.where)
        return out

    def _write_kv(self, step: Step) -> None:
        """Every non-PAD slot of `[0, num_tokens_padded)` gets its token's tag, as engines write."""
        n = step.num_tokens_padded
        slots = self.impl.slot_mappings[:, :n].cpu().numpy()  # [groups, n]
        _, uids = step.token_rows()
        uid = np.full(n, JUNK_UID, dtype=np.int64)
        pos = np.arange(n, dtype=np.int64)
        real = np.flatnonzero(uids >= 0)
        uid[real] = uids[real]
        pos[real] = step.positions[real]
        self.state.write_kv(slots, uid, pos)
        self.tokens += len(real)


class Phase(runner._PresetRun):
    """A harness preset run whose implementation instance and caches live in a `Seat`."""

    def __init__(
        self,
        ecomm: EraComm,
        opts: DrillOptions,
        phase: int,
        spec: str,
        cls: type,
        preset: presets.Preset,
        seat: Seat,
        fault: Fault | None,
        where: str,
    ) -> None:
        totals = runner._RankTotals()
        super().__init__(ecomm, opts.phase_options(phase), spec, cls, preset, None, totals)
        self.seat, self.fault, self.where = seat, fault, where
        self.executor: ServingExecutor | None = None

    def _build(self):
        if self.seat.state is None:
            impl, executor, found = super()._build()
            if executor is None:
                return impl, None, found
            self.seat.state = ServingState(impl, self.preset, self.comm.rank)
        else:
            _empty_every_row(self.seat.state.impl, self.preset.max_num_reqs)
        ex = self.make_executor()
        found = ex.check_buffers()
        for v in found:
            v.rank = self.cp_rank
        self.executor = None if found else ex
        return self.seat.state.impl, self.executor, found

    def make_executor(self) -> ServingExecutor:
        return ServingExecutor(self.seat, self.preset, self.comm.device, self.fault, self.where)


def _empty_every_row(impl: object, max_num_reqs: int) -> None:
    """Set every row's length to 0 on a kept instance (its requests drained), as a fresh one
    has it: a workload's appends land at the lengths it wrote, and a junk append before an
    overwrite fills a row up to its capacity from the length the workload gave it."""
    n = impl.num_kv_cache_groups
    if not n:
        return
    for row in range(max_num_reqs):
        impl.append_block_ids(row, tuple([] for _ in range(n)), True)
    impl.apply_staged_writes()
