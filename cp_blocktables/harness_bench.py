"""`cp-blocktables bench harness`: what a verify run costs on this machine.

Runs the harness (spawned ranks, CPU, gloo) on one preset and on `bench-64k`
(steps of about 64K tokens) and prints, per rank: wall time, verified tokens
per second and peak RSS. The figures come from the run's own JSON report.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import TextIO

from .dist import spawn_local
from .impl_loader import DEFAULT_IMPL
from .runner import VerifyOptions, run_rank


def _run_once(preset: str, world_size: int, seed: int, impl: str) -> tuple[int, float, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "report.json")
        opts = VerifyOptions(
            impls=[impl],
            presets=[preset],
            seed=seed,
            report_path=path,
            quiet=True,
            progress=False,
            world_size=world_size,
            spawned=True,
            backend="gloo",
        )
        t0 = time.monotonic()
        code = spawn_local(world_size, lambda: run_rank(opts), opts.timeout)
        wall = time.monotonic() - t0
        data = {}
        if os.path.exists(path):
            with open(path) as f:
                data = json.load(f)
    return code, wall, data


def bench_harness(
    world_size: int = 4,
    preset: str = "default",
    seed: int = 0,
    big: bool = True,
    impl: str = DEFAULT_IMPL,
    out: TextIO | None = None,
) -> int:
    """Print the harness's cost per rank; returns 0 when every measured run passed."""
    out = out or sys.stdout
    worst = 0
    for name in [preset, "bench-64k"] if big else [preset]:
        code, wall, data = _run_once(name, world_size, seed, impl)
        worst = max(worst, code)
        steps = sum(r["steps_checked"] for r in data.get("results", []))
        tokens = sum(r["tokens_checked"] for r in data.get("results", []))
        out.write(
            f"harness bench: preset {name}, {world_size} ranks (CPU, gloo): {wall:.1f} s "
            f"wall for {steps} steps, {tokens} tokens verified, exit code {code}\n"
        )
        for r in data.get("ranks", []):
            rate = r["tokens"] / r["wall_s"] if r["wall_s"] else 0.0
            out.write(
                f"  rank {r['rank']}: {r['wall_s']:.1f} s, {rate:,.0f} verified tokens/s, "
                f"peak RSS {r['max_rss_mb']:.0f} MB\n"
            )
    out.flush()
    return 0 if worst == 0 else 1
