"""Implementations that misbehave as processes: hang, die or raise on one rank.

They drive the harness's failure paths: a hung rank must end the run within
the collective timeout with a message naming it, a dead rank must not leave
its peers waiting, and an exception is a finding, not a crash.
"""

from __future__ import annotations

import os
import time

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


class RaisesOnRankOne(_OnRankOne):
    """cp_rank 1 raises in its third compute_slot_mappings call."""

    def fault(self) -> None:
        raise RuntimeError("injected failure on cp_rank 1")
