"""`cp-blocktables drill ...` on the command line: the actions' arguments, the
options built from them, and the checks that refuse bad input (exit 2) before
any rank starts. `cli.py` registers `NULL_BLOCK`, `WAKE_UP` and `FAULTS` as drill actions.
"""

from __future__ import annotations

import argparse

from ..cli_base import Subcommand, UsageError, positive
from ..harness import presets
from ..harness.cli_args import add_world_arguments, check_plan, rank_env
from ..harness.impl_loader import DEFAULT_IMPL


def _sizes(text: str) -> list[int]:
    parts = text.split(",")
    if not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(
            f"expected world sizes as comma-separated positive ints, e.g. 4,2,4; got {text!r}"
        )
    return [int(p) for p in parts]


def add_null_block_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--impl",
        action="append",
        metavar="MODULE:ATTR",
        help=f"implementation under test (repeatable; default {DEFAULT_IMPL})",
    )
    p.add_argument(
        "--preset", action="append", metavar="NAME", help="preset (repeatable; default: default)"
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument(
        "--world-size",
        type=positive(int),
        default=None,
        help="ranks to spawn when not under torchrun (default: the largest of --sizes, else 4)",
    )
    p.add_argument(
        "--sizes",
        type=_sizes,
        default=None,
        help="world sizes to drill in turn, e.g. 4,2,4 (elastic resize; default: the world)",
    )
    p.add_argument("--steps", type=positive(int), default=None, help="steps per serve phase")
    p.add_argument("--cp-size", type=positive(int), default=None, help="override the CP size")
    p.add_argument(
        "--cp-interleave", type=positive(int), default=None, help="override the CP interleave"
    )
    add_world_arguments(p)
    p.add_argument(
        "--fail-fast",
        action="store_true",
        help="stop drilling an implementation after its first failing preset",
    )
    p.add_argument("--report", metavar="PATH", help="write every record as JSON")
    p.add_argument("--quiet", action="store_true", help="print only the verdict")


def drill_options(args: argparse.Namespace):
    """`DrillOptions` from parsed arguments, checked for the world it will run in."""
    from .options import DrillOptions, plan

    env = rank_env(args)
    world = args.world_size or (max(args.sizes) if args.sizes else 4)
    opts = DrillOptions(
        impls=args.impl or [DEFAULT_IMPL],
        presets=args.preset or ["default"],
        sizes=args.sizes or [],
        seed=args.seed,
        steps=args.steps,
        cp_size=args.cp_size,
        cp_interleave=args.cp_interleave,
        backend=args.backend,
        device=args.device,
        timeout=args.timeout,
        fail_fast=args.fail_fast,
        report_path=args.report,
        quiet=args.quiet,
        world_size=env.world_size if env else world,
        spawned=env is None,
        drill=args.action,
        cycles=getattr(args, "cycles", 2),
    )
    check_plan(opts, plan)
    return opts


def run_live_state(args: argparse.Namespace) -> int:
    """`drill null-block` and `drill wake-up`: drills of a rank's live serving state."""
    opts = drill_options(args)
    from ..harness.spawn import spawn_local
    from .driver import run_drill_rank

    if not opts.spawned:
        return run_drill_rank(opts)
    return spawn_local(opts.world_size, lambda: run_drill_rank(opts), opts.timeout, opts.impls)


def add_wake_up_arguments(p: argparse.ArgumentParser) -> None:
    add_null_block_arguments(p)
    p.add_argument(
        "--cycles",
        type=positive(int),
        default=2,
        help="sleeps inside each serve phase (default 2; serve 2 adds one before its first step)",
    )


def add_faults_arguments(p: argparse.ArgumentParser) -> None:
    from .faults import SCENARIOS

    p.add_argument("--nproc", type=positive(int), default=2, help="ranks per run (default 2)")
    p.add_argument(
        "--timeout",
        type=positive(float),
        default=10.0,
        help="collective timeout of the runs, in seconds (default 10)",
    )
    p.add_argument(
        "--scenario",
        action="append",
        choices=SCENARIOS,
        help="scenario to run (repeatable; default: all)",
    )
    p.add_argument("--preset", default="cp2-i1", help="preset of the runs (default cp2-i1)")
    p.add_argument("--steps", type=positive(int), default=6, help="steps per serve phase")
    p.add_argument("--keep-logs", metavar="DIR", help="keep torchrun's logs and error files here")
    p.add_argument("--report", metavar="PATH", help="write the outcomes as JSON")


def run_faults(args: argparse.Namespace) -> int:
    from .faults import FaultDrillOptions, run_fault_drill

    if args.nproc < 2:
        raise UsageError(
            "--nproc must be at least 2: a fault needs a rank to fail and one to see it"
        )
    if args.preset not in presets.PRESETS:
        raise UsageError(f"unknown preset {args.preset!r}; known: {', '.join(presets.PRESETS)}")
    cp = presets.PRESETS[args.preset].cp_size
    if args.nproc % cp:
        raise UsageError(f"preset {args.preset} needs cp_size {cp}, which does not divide --nproc")
    return run_fault_drill(
        FaultDrillOptions(
            nproc=args.nproc,
            timeout=args.timeout,
            scenarios=args.scenario or [],
            preset=args.preset,
            steps=args.steps,
            keep_logs=args.keep_logs,
            report_path=args.report,
        )
    )


NULL_BLOCK = Subcommand(
    "the elastic-EP warm-up on live state: no live KV touched, every check before and after",
    add_null_block_arguments,
    run_live_state,
)
WAKE_UP = Subcommand(
    "sleep mode on live state: device memory overwritten, the engine's wake-up, every "
    "check after it",
    add_wake_up_arguments,
    run_live_state,
)
FAULTS = Subcommand(
    "ranks that raise, restart, hang or disagree under torchrun: ended, named, nothing left",
    add_faults_arguments,
    run_faults,
)
