"""Implementations that misbehave as processes: hang, die or raise on one rank.

They drive the harness's failure paths: a hung rank must end the run within
the collective timeout with a message naming it, a dead rank must not leave
its peers waiting, and an exception is a finding, not a crash.
`OursReadsPastQueryStartLoc` computes every result right but reads one entry
past an input, and `OursWritesPastSlotOut` writes one entry past a
caller-owned `out`: only the harness's guarded buffers (`harness.guarded`)
turn that access into a death, of every rank on the CPU.
"""

from __future__ import annotations

import ctypes
import os
import time

from cp_blocktables import BlockTables
from cp_blocktables.harness.guarded import PAGE, guarded_storage

from .stand_in import STAND_IN_SIGNATURE, StandInBlockTables

_FAULT_STEP = 3
"""compute_slot_mappings calls before the fault: the ranks are well into the run."""


class _OnRankOne(StandInBlockTables):
    __signature__ = STAND_IN_SIGNATURE

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0

    def compute_slot_mappings(self, *args, **kwargs):
        self.calls += 1
        if self.cp_rank == 1 and self.calls == _FAULT_STEP:
            self.fault()
        return super().compute_slot_mappings(*args, **kwargs)

    def fault(self) -> None:
        raise NotImplementedError


class HangsOnRankOne(_OnRankOne):
    """cp_rank 1 never returns from its third compute_slot_mappings call."""

    def fault(self) -> None:
        while True:
            time.sleep(1)


class DiesOnRankOne(_OnRankOne):
    """cp_rank 1's process exits abruptly in its third compute_slot_mappings call."""

    def fault(self) -> None:
        os._exit(3)


class SegfaultsOnRankOne(_OnRankOne):
    """cp_rank 1's process dies of SIGSEGV (a read of an unreadable page) in its third
    compute_slot_mappings call."""

    def fault(self) -> None:
        buf = guarded_storage(1)
        ctypes.string_at(ctypes.addressof(ctypes.c_char.from_buffer(buf)) + PAGE, 1)


class RaisesOnRankOne(_OnRankOne):
    """cp_rank 1 raises in its third compute_slot_mappings call."""

    def fault(self) -> None:
        raise RuntimeError("injected failure on cp_rank 1")


class OursReadsPastQueryStartLoc(BlockTables):
    """The project's BlockTables that reads `query_start_loc` one entry past its end and
    discards the value (a search step taken after convergence): right results, and on a
    GPU an out-of-bounds read. Only on the CPU, where the address can be read from here."""

    def compute_slot_mappings(self, idx_mapping, query_start_loc, *args, **kwargs):
        self._read_past(query_start_loc)
        return super().compute_slot_mappings(idx_mapping, query_start_loc, *args, **kwargs)

    def gather_and_compute_slot_mappings(self, idx_mapping, nrp, query_start_loc, *args, **kw):
        self._read_past(query_start_loc)
        return super().gather_and_compute_slot_mappings(
            idx_mapping, nrp, query_start_loc, *args, **kw
        )

    @staticmethod
    def _read_past(t) -> None:
        if t.device.type == "cpu" and t.numel():
            end = t.data_ptr() + t.numel() * t.element_size()
            ctypes.string_at(end, t.element_size())  # the entry after the last, discarded


class OursWritesPastSlotOut(BlockTables):
    """The project's BlockTables whose slot mapping into a caller-owned `out` also stores
    one entry past its end (an unmasked store of a tail lane): right results in `out`,
    and on a GPU an out-of-bounds write into whatever the caller keeps there. Only on the
    CPU, where the address can be written from here."""

    def compute_slot_mappings(self, idx_mapping, query_start_loc, positions, ntp, out=None):
        slots = super().compute_slot_mappings(idx_mapping, query_start_loc, positions, ntp, out)
        if out is not None and out.device.type == "cpu" and out.numel():
            end = out.data_ptr() + out.numel() * out.element_size()
            ctypes.memmove(end, out.data_ptr(), out.element_size())  # a stray tail store
        return slots
