"""Kernel benchmark: `BlockTables`' kernels beside an upstream-style rival, in one run.

Rows (see docs/performance.md for inputs and byte counts):

- a step's reads at decode (256 requests x 1 token), mixed 8K, 64K, 1M and 4M
  tokens, 1 and 4 KV-cache groups, `cp_size` 1 and 4: `compute_slot_mappings`,
  `gather_block_tables` and, where the core has it,
  `gather_and_compute_slot_mappings` (SPEC 8.2; the rival runs its two kernels);
- wide gathers with and without sliding-window masking;
- a step's writes: `append_block_ids` for 256 requests x 4 groups x 4 ids, then
  `apply_staged_writes`, against the rival's writer;
- the cost of SPEC 8.3's slot-mapping integrity check beside the kernel it
  follows, at 8K and 64K tokens (`integrity_checks`; no rival);
- yardsticks: an empty Triton kernel (the launch floor) and a large copy.

Each kernel row has device time (CUDA-graph replay) and host time (back-to-back
calls, one synchronisation at the end) for ours and the rival, their ratio,
and a bit-for-bit check of the outputs (`timing.py` says how). A failing row
records its error and the run goes on. Goals are printed as PASS or MISS.

On CPU the kernels run in Triton's interpreter: sizes are capped, figures are
marked as CPU figures, and they say nothing about GPU speed.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict

import numpy as np
import torch
import triton

from . import cases, cases_features, report
from .cases import slot_bytes as _slot_bytes  # noqa: F401 - tests count bytes through it
from .report import CPU_BANNER  # noqa: F401 - re-exported for the command's users
from .timing import Timer, TimingPlan

_FULL_TOKENS = (256, 8192, 65536, 1 << 20, 1 << 22)
_SHAPES = dict(groups=(1, 4), cp_sizes=(1, 4))
_PLANS = {
    ("cuda", False): dict(
        tokens=_FULL_TOKENS, gather_reqs=(256, 1024), gather_blocks=(2048,), write_reqs=256,
        copy_bytes=1 << 30, with_torch=True,
        timing=TimingPlan(host_calls=300, graph_calls=20, graph_replays=10, steps=20), **_SHAPES,
    ),
    ("cuda", True): dict(
        tokens=_FULL_TOKENS[:3], gather_reqs=(256,), gather_blocks=(2048,), write_reqs=256,
        copy_bytes=1 << 28, with_torch=False,
        timing=TimingPlan(host_calls=100, graph_calls=10, graph_replays=5, steps=5), **_SHAPES,
    ),
    # CPU: the interpreter costs milliseconds per program instance; small sizes.
    ("cpu", False): dict(
        tokens=_FULL_TOKENS[:2], gather_reqs=(64,), gather_blocks=(32,), write_reqs=256,
        copy_bytes=1 << 26, with_torch=True, max_context=4096,
        timing=TimingPlan(host_calls=3, graph_calls=1, graph_replays=1, steps=3), **_SHAPES,
    ),
    ("cpu", True): dict(
        tokens=(16,), gather_reqs=(16,), gather_blocks=(32,), write_reqs=32,
        copy_bytes=1 << 23, with_torch=False, max_context=512,
        timing=TimingPlan(host_calls=1, graph_calls=1, graph_replays=1, steps=2), **_SHAPES,
    ),
}  # fmt: skip


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"


def _resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be cuda or cpu, got {device}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda asked for, but torch sees no CUDA device")
    return device


FAMILIES = ("reads", "gathers", "writes", "integrity", "kernel-blocks")
"""Row families besides the yardsticks (always measured): `--only` picks some."""


def run_kernel_bench(
    device: str | torch.device,
    quick: bool,
    json_path: str | None,
    only: Sequence[str] | None = None,
) -> list[dict]:
    """Time every row on `device` ("auto", "cuda" or "cpu"), print the table and the goals,
    write `{"meta", "rows", "goals"}` to `json_path` when given; returns the rows as dicts.
    `only` restricts the rows to some of `FAMILIES` (the yardsticks always run)."""
    families = set(only or FAMILIES)
    if families - set(FAMILIES):
        raise ValueError(f"unknown row families {sorted(families - set(FAMILIES))}")
    device = _resolve_device(device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    cpu = device.type == "cpu"
    plan = _PLANS[(device.type, quick)]
    timer = Timer(device, plan["timing"])
    rng = np.random.default_rng(0)
    gen = torch.Generator(device=device).manual_seed(0)
    threads = torch.get_num_threads()
    if cpu:
        # The interpreter runs on one thread; so does torch, or figures swing
        # with thread wake-ups on a busy machine.
        torch.set_num_threads(1)
    began = time.perf_counter()
    try:
        yardsticks = cases.yardstick_rows(timer, plan, gen)
        rows = list(yardsticks)
        if "reads" in families:
            rows += cases.read_rows(timer, plan, rng, gen, plan["with_torch"])
        if "gathers" in families:
            rows += cases.gather_rows(timer, plan, rng, gen)
        if "writes" in families:
            rows += cases.write_rows(timer, plan, rng)
        if "integrity" in families:
            rows += cases_features.integrity_rows(timer, plan, rng, gen)
        if "kernel-blocks" in families:
            rows += cases_features.kernel_block_rows(timer, plan, rng, gen)
    finally:
        torch.set_num_threads(threads)
    floor, copy = yardsticks
    floor_us = floor.device_us if floor.device_us > 0 else 0.0
    copy_gbps = copy.bytes / copy.device_us / 1e3 if copy.device_us > 0 else 0.0
    for r in rows:
        r.derive(floor_us, copy_gbps)
    verdicts = report.goals(rows)
    meta = dict(
        device=device.type,
        device_name=_device_name(device),
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
        cpu_figures=cpu,
        quick=quick,
        l2_bytes=timer.l2_bytes,
        launch_floor_us=floor.device_us,
        launch_floor_host_us=floor.host_us,
        copy_gbps=copy_gbps,
        seconds=time.perf_counter() - began,
        timing="device: CUDA-graph replay; host: back-to-back calls, one sync at the end"
        if not cpu
        else "wall-clock median, one thread",
    )
    report.print_report(meta, rows, verdicts)
    out = [_jsonable(asdict(r)) | dict(device=device.type, cpu_figures=cpu) for r in rows]
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(meta=_jsonable(meta), rows=out, goals=verdicts), f, indent=1)
    return out


def _jsonable(d: dict) -> dict:
    """NaN (a figure not measured) becomes null, so the file is strict JSON."""
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in d.items()}


# ---------------------------------------------------------------- command line


def add_bench_kernels_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `cp-blocktables bench kernels`."""
    parser.add_argument(
        "--device",
        choices=("auto", "cuda", "cpu"),
        default="auto",
        help="cuda (compiled kernels), cpu (Triton interpreter, reduced sizes); auto: cuda if seen",
    )
    parser.add_argument("--json", dest="json_path", metavar="PATH", help="also write rows here")
    parser.add_argument(
        "--quick", action="store_true", help="fewer sizes and repeats (a smoke test)"
    )
    parser.add_argument(
        "--only",
        metavar="FAMILY",
        nargs="+",
        choices=FAMILIES,
        help="measure only these row families (yardsticks always run): " + ", ".join(FAMILIES),
    )


def bench_kernels_command(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 when every row ran and agreed with the rival, 1 if not, 2 on bad
    usage."""
    try:
        rows = run_kernel_bench(
            args.device, args.quick, args.json_path, getattr(args, "only", None)
        )
    except ValueError as e:
        print(f"cp-blocktables bench kernels: {e}", file=sys.stderr)
        return 2
    bad = [f"{r['kind']} {r['case']}" for r in rows if r["agrees"] is False]
    if bad:
        print(f"ours and the rival disagree on: {', '.join(bad)}", file=sys.stderr)
    failed = [f"{r['kind']} {r['case']}" for r in rows if r["error"]]
    if failed:
        print(f"rows that failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if bad or failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cp_blocktables.bench.kernels",
        description="Time the Triton kernels against an upstream-style rival, the launch "
        "floor and copy bandwidth.",
    )
    add_bench_kernels_arguments(parser)
    return bench_kernels_command(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
