"""`cp-blocktables bench harness`: what a verify run costs, per rank.

Runs the harness on one preset and, unless told not to, on `bench-64k`
(steps of about 64K tokens) and, with `--huge`, `bench-1m` (about 1M tokens a
step, for GPUs). Without a torchrun environment it spawns `--world-size`
ranks (gloo; `--device cuda` puts them on GPUs); under torchrun the ranks
join the launched job, so `--backend nccl` runs with a GPU per rank. Every
preset runs once per checks mode (`--checks`: by default the leader's checks
on the host, in numpy, then on the rank's device, in torch). Prints, per rank:
wall time, verified tokens per second over the wall time and over the steps
after the first (once compiled and connected), the leader's check time per
step, the gather time per step, peak RSS, backend and device; then the two
modes side by side. The figures come from the run's own JSON report.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import TextIO

from ..harness.dist import RankEnv, spawn_local
from ..harness.impl_loader import DEFAULT_IMPL
from ..harness.options import VerifyOptions
from ..harness.runner import run_rank


@dataclass
class HarnessBench:
    """What to run: presets, world, backend and device (as for `verify`)."""

    world_size: int = 4
    preset: str = "default"
    seed: int = 0
    big: bool = True
    huge: bool = False
    cp_size: int | None = None
    backend: str = "gloo"
    device: str = "auto"
    impl: str = DEFAULT_IMPL
    checks: tuple[str, ...] = ("host", "device")

    def presets(self) -> list[str]:
        return [self.preset] + ["bench-64k"] * self.big + ["bench-1m"] * self.huge


def _run_once(bench: HarnessBench, preset: str, path: str, checks: str) -> tuple[int, float]:
    opts = VerifyOptions(
        impls=[bench.impl],
        presets=[preset],
        seed=bench.seed,
        cp_size=bench.cp_size,
        report_path=path,
        quiet=True,
        progress=False,
        world_size=bench.world_size,
        spawned=RankEnv.from_environ() is None,
        backend=bench.backend,
        device=bench.device,
        checks=checks,
    )
    t0 = time.monotonic()
    if opts.spawned:
        code = spawn_local(bench.world_size, lambda: run_rank(opts), opts.timeout, opts.impls)
    else:
        code = run_rank(opts)
    return code, time.monotonic() - t0


def bench_harness(bench: HarnessBench, out: TextIO | None = None) -> int:
    """Print the harness's cost per rank; returns 0 when every measured run passed."""
    out = out or sys.stdout
    env = RankEnv.from_environ()
    printer = env is None or env.rank == 0
    worst = 0
    with tempfile.TemporaryDirectory() as tmp:
        for name in bench.presets():
            by_mode = {}
            for checks in bench.checks:
                path = os.path.join(tmp, f"{name}-{checks}.json")
                code, wall = _run_once(bench, name, path, checks)
                worst = max(worst, code)
                if printer:
                    by_mode[checks] = _print(out, name, code, wall, path, checks)
            if printer and len(by_mode) > 1:
                _side_by_side(out, name, by_mode)
    out.flush()
    return 0 if worst == 0 else 1


def _rates(r: dict) -> tuple[float, float]:
    """Verified tokens/s of one rank: over its wall time, and over its steps after the first."""
    wall = r["tokens"] / r["wall_s"] if r["wall_s"] else 0.0
    warm = r.get("warm_tokens", 0) / r["warm_s"] if r.get("warm_s") else 0.0
    return wall, warm


def _print(out: TextIO, name: str, code: int, wall: float, path: str, checks: str) -> list[dict]:
    data = {}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    ranks = data.get("ranks", [])
    steps = sum(r["steps_checked"] for r in data.get("results", []))
    tokens = sum(r["tokens_checked"] for r in data.get("results", []))
    out.write(
        f"harness bench: preset {name}, {checks} checks, {len(ranks)} ranks: {wall:.1f} s wall "
        f"for {steps} steps, {tokens} tokens verified, exit code {code}\n"
    )
    for r in ranks:
        rate, warm = _rates(r)
        per_step = max(r.get("steps", 0), 1)
        gather_ms = 1e3 * r.get("gather_s", 0.0) / per_step
        check = ""
        if r.get("check_s"):  # the leader: its checks alone, per step and as a rate
            check = (
                f", {1e3 * r['check_s'] / per_step:.1f} ms checks a step "
                f"({r['tokens'] / r['check_s']:,.0f} tokens/s checked)"
            )
        out.write(
            f"  rank {r['rank']} ({r.get('backend', '?')}, {r.get('device', '?')}, "
            f"{r.get('checks', checks)} checks): {r['wall_s']:.1f} s, {rate:,.0f} verified "
            f"tokens/s ({warm:,.0f} after the first step), {gather_ms:.1f} ms gather a step"
            f"{check}, peak RSS {r['max_rss_mb']:.0f} MB\n"
        )
    return ranks


def _side_by_side(out: TextIO, name: str, by_mode: dict[str, list[dict]]) -> None:
    """Per rank, one line: tokens/s (wall; after the first step) and peak RSS of each mode."""
    modes = list(by_mode)
    out.write(f"  {name}: verified tokens/s (wall; after the first step) and peak RSS\n")
    out.write("    rank  " + "  ".join(f"{m:>36}" for m in modes) + "\n")
    ranks = sorted({r["rank"] for rs in by_mode.values() for r in rs})
    for k in ranks:
        cells = []
        for m in modes:
            r = next((r for r in by_mode[m] if r["rank"] == k), None)
            if r is None:
                cells.append(f"{'-':>36}")
                continue
            rate, warm = _rates(r)
            cells.append(f"{rate:>11,.0f}; {warm:>11,.0f}; {r['max_rss_mb']:>6.0f} MB")
        out.write(f"    {k:>4}  " + "  ".join(cells) + "\n")
