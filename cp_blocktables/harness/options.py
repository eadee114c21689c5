"""What one harness run is asked to do (`VerifyOptions`) and which presets it runs
in a world of a given size (`plan`).

The options travel to every rank unchanged and are compared at the start of the
run (check 7), so all ranks replay the same presets with the same seeds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import presets

HARNESS_VERSION = "1"


@dataclass
class VerifyOptions:
    """Everything a rank needs to run; identical on every rank (check 7 verifies it)."""

    impls: list[str]
    presets: list[str]
    seed: int = 0
    cp_size: int | None = None
    steps: int | None = None
    backend: str = "auto"
    timeout: float = 120.0
    device: str = "auto"
    checks: str = "auto"  # where the leader checks: auto (device on a GPU), device, host
    keep_going: bool = False
    fail_fast: bool = False
    report_path: str | None = None
    junit_path: str | None = None
    plot_path: str | None = None
    progress: bool | None = None
    quiet: bool = False
    world_size: int = 4
    spawned: bool = False
    skipped: list[str] = field(default_factory=list)
    unsupported: list[dict] = field(default_factory=list)

    def agreement_fields(self) -> dict:
        return {
            "impls": self.impls,
            "presets": self.presets,
            "seed": self.seed,
            "cp_size": self.cp_size,
            "steps": self.steps,
            "keep_going": self.keep_going,
            "fail_fast": self.fail_fast,
            "harness": HARNESS_VERSION,
            "torch": torch.__version__,
        }


def plan(opts: VerifyOptions, world_size: int) -> tuple[list[presets.Preset], list[str]]:
    """Presets to run under `world_size` and notes on those skipped; `ValueError` if unusable."""
    chosen, skipped = [], []
    explicit = {n for n in opts.presets if n not in presets.ALIASES}
    for p in presets.resolve(opts.presets):
        p = p.with_overrides(opts.cp_size, opts.steps)
        p.validate()
        if p.cp_size > world_size:
            msg = f"preset {p.name} needs cp_size {p.cp_size}, more than world size {world_size}"
            if p.name in explicit:
                raise ValueError(msg)
            skipped.append(msg)
            continue
        chosen.append(p)
    if not chosen:
        raise ValueError(f"no preset can run with world size {world_size}: " + "; ".join(skipped))
    return chosen, skipped
