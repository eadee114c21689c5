"""One era of a drill: one CP group at one world size, its stages run in lockstep.

`Era` runs `stages()` in order; after each, the era's ranks agree on the
verdict, and a failed stage ends the era (and the preset, for that
implementation). A stage returns the record of its CP group on the group's
leader (`None` elsewhere). `serve` is the stage every drill shares: one
harness workload on the seat's serving state, checked step by step.
Subclasses (`null_block.NullBlockEra`, `wake_up.WakeUpEra`) name the stages.
"""

from __future__ import annotations

from collections.abc import Callable

from ..harness import presets
from ..harness.checks import Violation
from .era_comm import EraComm
from .executor import Phase, Seat
from .fault_inject import Fault
from .options import DrillOptions


class Era:
    """The stages of one drill for one CP group at one world size."""

    phase_class: type[Phase] = Phase

    def __init__(
        self,
        ecomm: EraComm,
        opts: DrillOptions,
        spec: str,
        cls: type,
        preset: presets.Preset,
        seat: Seat,
        era: int,
        fault: Fault | None,
    ) -> None:
        self.ecomm, self.opts, self.spec, self.cls = ecomm, opts, spec, cls
        self.preset, self.seat, self.era, self.fault = preset, seat, era, fault
        self.rank = ecomm.rank
        self.cp_index = ecomm.rank // preset.cp_size
        self.base = {
            "impl": spec,
            "preset": preset.name,
            "era": era,
            "size": ecomm.size,
            "cp_group": self.cp_index,
            "ranks": list(ecomm.cp_group(preset.cp_size)[2]),
            "kept_state": seat.state is not None,
        }

    def stages(self) -> list[tuple[str, Callable[[], dict | None]]]:
        raise NotImplementedError

    def run(self) -> tuple[list[dict], bool]:
        """This CP group's records (on its leader) and whether any CP group of the era failed."""
        records = []
        for label, stage in self.stages():
            record = stage()
            if record is not None:
                records.append(record)
            failed = record is not None and bool(record["failures"])
            if self.ecomm.any(failed, f"verdict of {label} (world size {self.ecomm.size})"):
                return records, True
        if self.seat.state is not None:
            self.seat.state.pool.drain()
        return records, False

    # ------------------------------------------------------------ serving

    def make_phase(self, phase: int, label: str) -> Phase:
        where = f"preset {self.preset.name}, {label}, world size {self.ecomm.size}"
        return self.phase_class(
            self.ecomm,
            self.opts,
            phase,
            self.spec,
            self.cls,
            self.preset,
            self.seat,
            self.fault,
            where,
        )

    def serve(self, phase: int, label: str) -> dict | None:
        """Serve phase `phase`: one harness workload on the kept state; the leader's record."""
        run = self.make_phase(phase, label)
        result = run.run()
        if run.executor is not None:
            self.seat.recent_ids = [sorted(s) for s in run.executor.appended]
        extra = self.after_serve(run)
        if result is None:
            return None
        failures = list(extra.get("failures", []))
        if result["violations"]:
            failures.append(Violation(**result["violations"][0]).describe())
        enforced = self.opts.cp_interleave is None and result["coverage_enforced"]
        if enforced and result["missing_corners"]:
            failures.append(
                f"coverage: preset {result['preset']} promised corners it never reached: "
                f"{', '.join(result['missing_corners'])}"
            )
        read = sum(s["read_back"] for s in result["stats"])
        want = sum(s["read_expected"] for s in result["stats"])
        return {
            **self.base,
            "stage": label,
            "seed": result["seed"],
            "steps": result["steps_checked"],
            "tokens": result["tokens_checked"],
            "failures": failures,
            "failed_checks": sorted(
                set(result["violation_counts"]) | set(extra.get("failed_checks", []))
            ),
            "violations": result["violations"][:20],
            "findings": extra.get("findings", []),
            "summary": f"KV read back {read}/{want}" + extra.get("summary", ""),
        }

    def after_serve(self, run: Phase) -> dict:
        """What a drill adds to a serve record (collective over the CP group: every rank calls
        it): `failures` (first), `failed_checks`, `findings`, `summary` (appended)."""
        return {}
