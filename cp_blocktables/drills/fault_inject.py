"""The fault a drill rank injects into itself, read from `CP_BLOCKTABLES_DRILL_FAULT`.

`cp-blocktables drill faults` sets the variable for the runs it starts; every
rank of a drill reads it (`Fault.from_environ`) and only the named rank, on
the named torchrun attempt, faults.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

FAULT_ENV = "CP_BLOCKTABLES_DRILL_FAULT"


class InjectedFault(RuntimeError):
    """Raised by a rank that the fault drill told to fail mid-step."""


@dataclass
class Fault:
    """A fault to inject (`CP_BLOCKTABLES_DRILL_FAULT=KIND:rank=R:step=S[:attempt=A]`).

    At step `S` of the first serve phase, after the step's kernels ran and
    before its first collective, rank `R` raises `InjectedFault` (`raise`) or
    sleeps forever (`hang`). With `attempt=A` only torchrun's attempt `A`
    (`TORCHELASTIC_RESTART_COUNT`) faults, so that a restarted group passes.
    """

    kind: str
    rank: int
    step: int
    attempt: int | None = None
    armed: str = ""

    @staticmethod
    def from_environ(rank: int) -> Fault | None:
        text = os.environ.get(FAULT_ENV, "")
        if not text:
            return None
        kind, *fields = text.split(":")
        try:
            values = {k: int(v) for k, v in (f.split("=", 1) for f in fields)}
            fault = Fault(kind, values.pop("rank"), values.pop("step"), values.pop("attempt", None))
        except (ValueError, KeyError) as e:
            raise ValueError(
                f"{FAULT_ENV}={text!r}: expected KIND:rank=R:step=S[:attempt=A] ({e})"
            ) from None
        if kind not in ("raise", "hang") or values:
            raise ValueError(
                f"{FAULT_ENV}={text!r}: KIND is raise or hang, fields rank, step, attempt"
            )
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if fault.rank != rank or fault.attempt not in (None, attempt):
            return None
        return fault

    def after_step(self, step: int, where: str) -> None:
        if step == self.step and not self.armed:
            self.armed = f"step {step} of {where}"

    def before_collective(self) -> None:
        if not self.armed:
            return
        if self.kind == "hang":
            print(
                f"cp-blocktables: rank {self.rank}: injected hang at {self.armed}",
                file=sys.stderr,
                flush=True,
            )
            while True:
                time.sleep(1)
        raise InjectedFault(f"injected fault: rank {self.rank} raised at {self.armed}")
