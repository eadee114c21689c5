"""`cp-blocktables bench harness`: what a verify run costs, per rank.

Runs the harness on one preset and, unless told not to, on `bench-64k`
(steps of about 64K tokens) and, with `--huge`, `bench-1m` (about 1M tokens a
step, for GPUs). Without a torchrun environment it spawns `--world-size`
ranks (gloo; `--device cuda` puts them on GPUs); under torchrun the ranks
join the launched job, so `--backend nccl` runs with a GPU per rank. Prints,
per rank: wall time, verified tokens per second, time per step spent
gathering the step's outputs, peak RSS, backend and device. The figures come
from the run's own JSON report.
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
from ..harness.runner import VerifyOptions, run_rank


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

    def presets(self) -> list[str]:
        return [self.preset] + ["bench-64k"] * self.big + ["bench-1m"] * self.huge


def _run_once(bench: HarnessBench, preset: str, path: str) -> tuple[int, float]:
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
    )
    t0 = time.monotonic()
    if opts.spawned:
        code = spawn_local(bench.world_size, lambda: run_rank(opts), opts.timeout)
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
            path = os.path.join(tmp, f"{name}.json")
            code, wall = _run_once(bench, name, path)
            worst = max(worst, code)
            if printer:
                _print(out, name, code, wall, path)
    out.flush()
    return 0 if worst == 0 else 1


def _print(out: TextIO, name: str, code: int, wall: float, path: str) -> None:
    data = {}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    ranks = data.get("ranks", [])
    steps = sum(r["steps_checked"] for r in data.get("results", []))
    tokens = sum(r["tokens_checked"] for r in data.get("results", []))
    out.write(
        f"harness bench: preset {name}, {len(ranks)} ranks: {wall:.1f} s wall for "
        f"{steps} steps, {tokens} tokens verified, exit code {code}\n"
    )
    for r in ranks:
        rate = r["tokens"] / r["wall_s"] if r["wall_s"] else 0.0
        gather_ms = 1e3 * r.get("gather_s", 0.0) / max(r.get("steps", 0), 1)
        out.write(
            f"  rank {r['rank']} ({r.get('backend', '?')}, {r.get('device', '?')}): "
            f"{r['wall_s']:.1f} s, {rate:,.0f} verified tokens/s, {gather_ms:.1f} ms gather "
            f"a step, peak RSS {r['max_rss_mb']:.0f} MB\n"
        )
