"""What every rank of a drill runs: the options (identical on every rank) and the presets planned.

`DrillOptions` is shared by `drill null-block` and `drill wake-up` (`drill`
names which); `plan` applies the overrides and refuses what cannot run at
every world size of `--sizes`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from ..harness import options, presets

DRILL_VERSION = "1"
DRILLS = ("null-block", "wake-up")
SEED_STRIDE = 1000
"""Serve phase `k` of CP group `j` uses workload seed `seed + SEED_STRIDE * k + j`."""


@dataclass
class DrillOptions:
    """What every rank runs; identical on every rank (compared before anything runs)."""

    impls: list[str]
    presets: list[str]
    sizes: list[int] = field(default_factory=list)
    seed: int = 0
    steps: int | None = None
    cp_size: int | None = None
    cp_interleave: int | None = None
    backend: str = "auto"
    device: str = "auto"
    timeout: float = 120.0
    fail_fast: bool = False
    report_path: str | None = None
    quiet: bool = False
    world_size: int = 4
    spawned: bool = False
    drill: str = "null-block"
    cycles: int = 2
    """wake-up: sleeps inside each serve phase (serve 2 adds one before its first step)."""

    def agreement_fields(self) -> dict:
        return {
            "impls": self.impls,
            "presets": self.presets,
            "sizes": self.sizes,
            "seed": self.seed,
            "steps": self.steps,
            "cp_size": self.cp_size,
            "cp_interleave": self.cp_interleave,
            "fail_fast": self.fail_fast,
            "kind": self.drill,
            "cycles": self.cycles,
            "drill": DRILL_VERSION,
            "harness": options.HARNESS_VERSION,
            "torch": torch.__version__,
        }

    def phase_options(self, phase: int) -> options.VerifyOptions:
        """The harness options of serve phase `phase` (its workloads get seed + 1000 * phase)."""
        return options.VerifyOptions(
            impls=self.impls,
            presets=self.presets,
            seed=self.seed + SEED_STRIDE * phase,
            cp_size=self.cp_size,
            steps=self.steps,
            timeout=self.timeout,
        )


def plan(opts: DrillOptions, world_size: int) -> list[presets.Preset]:
    """The presets to drill, with overrides applied; `ValueError` naming what cannot run."""
    if opts.drill not in DRILLS:
        raise ValueError(f"unknown drill {opts.drill!r}; known: {', '.join(DRILLS)}")
    if opts.cycles < 0:
        raise ValueError(f"--cycles must be >= 0, got {opts.cycles}")
    sizes = opts.sizes or [world_size]
    for s in sizes:
        if not 1 <= s <= world_size:
            raise ValueError(
                f"--sizes: world size {s} is outside [1, {world_size}] (the ranks launched)"
            )
    chosen = []
    for p in presets.resolve(opts.presets):
        p = p.with_overrides(opts.cp_size, opts.steps)
        if opts.cp_interleave is not None:
            p = dataclasses.replace(p, cp_interleave=opts.cp_interleave)
        p.validate()
        bad = [s for s in sizes if s % p.cp_size]
        if bad:
            raise ValueError(
                f"preset {p.name} needs cp_size {p.cp_size}, which does not divide world "
                f"size {bad[0]} of --sizes {','.join(map(str, sizes))}"
            )
        chosen.append(p)
    return chosen
