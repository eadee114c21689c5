"""`cp-blocktables drill wake-up`: sleep mode and wake-up (SPEC.md 8.4) on live state.

Per CP group of the world, in lockstep, at every world size of `--sizes`:

1. **serve 1**: a harness workload, checked step by step (SPEC.md section 6).
   Before `--cycles` of its steps, spread over the workload while requests
   are running, every rank sleeps and wakes up:
   - `sleep.simulate_sleep` overwrites with garbage every device tensor the
     instance owns (found by walking it; host truth is left alone);
   - the engine's wake-up runs: `init_block_table_layout_tensors()`, then
     every live row is re-appended with `overwrite=True` (its ids come from
     the serving state, which saw the workload's appends, never from the
     implementation), then `apply_staged_writes()`;
   - the drill's own checks (`WAKE_UP_CHECKS`): the wake-up raised nothing,
     no derived device tensor still holds the sleep's garbage (`rebuilt`),
     the forward-pass tables and slot mappings kept their addresses.
   Serving then goes on, checked as before: the KV round trip (check 5)
   spans the sleep, since the KV caches are the engine's and stay.
2. **serve 2**: a second workload on the same instance, with one more sleep
   before its first step (an idle engine: no live row) and `--cycles` inside.

An elastic resize keeps, as in the null-block drill, the state of the CP
groups whose ranks stay: their next era sleeps on the same instance again.
An implementation without `init_block_table_layout_tensors` is reported as
"not supported by this implementation", never as a pass.
"""

from __future__ import annotations

import numpy as np

from ..harness.sleep import moved, simulate_sleep, survivors
from .era import Era
from .executor import Phase, ServingExecutor
from .report import describe_finding, finding

WAKE_UP = "init_block_table_layout_tensors"
UNSUPPORTED = f"not supported by this implementation: it has no {WAKE_UP}()"


class WakeUpError(RuntimeError):
    """The wake-up after a simulated sleep failed; the step it preceded does not run."""


class WakeUpExecutor(ServingExecutor):
    """A serving executor that sleeps and wakes the instance up before chosen steps."""

    def __init__(self, *args, sleep_before: set[int], seed: list[int], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sleep_before, self.seed = sleep_before, seed
        self.findings: list[dict] = []
        self.cycles: list[dict] = []

    def run(self, step):
        if step.index in self.sleep_before:
            self.cycle(step.index)
        return super().run(step)

    def cycle(self, before: int) -> None:
        """Sleep, then the engine's wake-up; a failed check raises `WakeUpError`."""
        impl, rank = self.impl, self.state.rank
        where = f"the wake-up before step {before} ({self.where})"
        rng = np.random.default_rng([*self.seed, before])
        slept = simulate_sleep(impl, self.device, rng)
        live = self.state.live_rows()
        self.cycles.append(
            {"before": before, "tensors": len(slept.garbage), "bytes": slept.nbytes,
             "host": len(slept.host_paths), "live_rows": len(live)}
        )  # fmt: skip
        try:
            getattr(impl, WAKE_UP)()
        except Exception as e:
            self._fail(finding("wake-up-runs", f"{WAKE_UP}() raised {e!r}", rank), where)
        kept = survivors(impl, self.device, slept)
        if kept:
            paths = ", ".join(k["path"] for k in kept[:6])
            self._fail(
                finding(
                    "rebuilt",
                    f"after {WAKE_UP}(), {len(kept)} derived device tensor(s) still hold "
                    f"what the sleep left: {kept[0]['path']} {kept[0]['what']}",
                    rank,
                    expected="every derived tensor rebuilt",
                    actual=paths,
                ),
                where,
            )
        try:
            for row, _, ids in live:
                impl.append_block_ids(row, tuple(ids), True)
            impl.apply_staged_writes()
        except Exception as e:
            self._fail(
                finding("wake-up-runs", f"re-appending {len(live)} live rows raised {e!r}", rank),
                where,
            )
        for line in moved(impl, slept):
            self.findings.append(
                finding("stable-addresses", f"{line} (in {where})", rank, expected="unchanged")
            )

    def _fail(self, f: dict, where: str) -> None:
        self.findings.append(f)
        raise WakeUpError(f"{where}: {f['check']}: {f['what']}")


class WakeUpPhase(Phase):
    """A serve phase whose executor sleeps before the steps in `sleep_before`."""

    sleep_before: set[int] = set()
    sleep_seed: list[int] = []

    def _steps(self, workload, executor, checker) -> int:
        if checker is not None:
            checker = _ForgetsAtSleeps(checker, self.sleep_before)
        return super()._steps(workload, executor, checker)

    def make_executor(self) -> ServingExecutor:
        return WakeUpExecutor(
            self.seat,
            self.preset,
            self.comm.device,
            self.fault,
            self.where,
            sleep_before=set(self.sleep_before),
            seed=list(self.sleep_seed),
        )


class _ForgetsAtSleeps:
    """The leader's checker, told before each slept step that the persistent
    buffers' past contents were discarded with the device memory."""

    def __init__(self, checker, sleep_before: set[int]) -> None:
        self._checker, self._sleep_before = checker, sleep_before

    def check_step(self, step, *args, **kwargs):
        if step.index in self._sleep_before:
            self._checker.forget_persistent()
        return self._checker.check_step(step, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._checker, name)


def sleep_points(num_steps: int, cycles: int, idle_first: bool) -> set[int]:
    """Steps to sleep before: `cycles` spread inside the workload, and step 0 if `idle_first`."""
    inside = {max(1, num_steps * (i + 1) // (cycles + 1)) for i in range(cycles)}
    points = {s for s in inside if s < num_steps}
    return points | {0} if idle_first else points


class WakeUpEra(Era):
    """The wake-up drill's stages for one CP group at one world size."""

    phase_class = WakeUpPhase

    def stages(self):
        if not callable(getattr(self.cls, WAKE_UP, None)):
            return [("wake-up", self._unsupported)]
        return [
            ("serve 1", lambda: self.serve(2 * self.era, "serve 1")),
            ("serve 2", self._serve_2),
        ]

    def _serve_2(self) -> dict | None:
        self.seat.state.pool.drain()  # a workload starts on free rows; its first sleep is idle
        return self.serve(2 * self.era + 1, "serve 2")

    def make_phase(self, phase: int, label: str) -> Phase:
        run = super().make_phase(phase, label)
        run.sleep_before = sleep_points(
            self.preset.num_steps, self.opts.cycles, idle_first=label == "serve 2"
        )
        run.sleep_seed = [self.opts.seed, self.era, phase, self.rank]
        return run

    def after_serve(self, run: Phase) -> dict:
        ex = run.executor
        mine = {
            "found": ex.findings if ex is not None else [],
            "cycles": ex.cycles if ex is not None else [],
        }
        metas = run.comm.all_gather_object(mine, "wake-up findings", run.ogroup, run.ranks)
        found = [f for m in metas for f in m["found"]]
        cycles = metas[0]["cycles"]
        summary = ""
        if cycles:
            tensors = max(c["tensors"] for m in metas for c in m["cycles"])
            kib = max(c["bytes"] for m in metas for c in m["cycles"]) / 1024
            rows = sum(c["live_rows"] for c in cycles)
            summary = (
                f"; {len(cycles)} sleeps (before steps "
                f"{', '.join(str(c['before']) for c in cycles)}): {tensors} device tensors "
                f"({kib:.1f} KiB) overwritten a rank, {rows} live rows re-appended"
            )
        return {
            "failures": [describe_finding(f) for f in found[:1]],
            "failed_checks": sorted({f["check"] for f in found}),
            "findings": found[:50],
            "summary": summary,
            "sleeps": cycles,
        }

    def _unsupported(self) -> dict | None:
        if self.rank != self.base["ranks"][0]:
            return None
        return {
            **self.base,
            "stage": "wake-up",
            "seed": None,
            "steps": 0,
            "tokens": 0,
            "failures": [],
            "failed_checks": [],
            "violations": [],
            "findings": [],
            "summary": UNSUPPORTED,
            "skipped": UNSUPPORTED,
        }
