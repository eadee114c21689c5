"""`cp-blocktables` / `python -m cp_blocktables`: subcommands and exit codes.

Exit codes: 0 every check passed, 1 a violation (or a lost peer), 2 bad usage
or configuration (a one-line message, no traceback).

Subcommands live in `SUBCOMMANDS`: a name maps to a help line, a function
that adds its arguments to its parser, and a function that runs it and
returns the exit code. `bench` has its own registry of actions,
`BENCH_ACTIONS` (`harness`, `kernels`, `plugin`), built the same way, and so
has `drill` (`DRILL_ACTIONS`: `null-block`, `wake-up`, `faults`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

from .harness import presets
from .harness.impl_loader import DEFAULT_IMPL, ImplSpecError, load_impl


@dataclass(frozen=True)
class Subcommand:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


class UsageError(Exception):
    """Bad usage or configuration: exit code 2 with this message."""


# ---------------------------------------------------------------- verify


def _positive(kind: type) -> Callable[[str], float]:
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a positive {kind.__name__}, got {text!r}"
            ) from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text}")
        return value

    return parse


def add_verify_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--impl",
        action="append",
        metavar="MODULE:ATTR",
        help=f"implementation under test (repeatable; default {DEFAULT_IMPL}); "
        f"MODULE may be a dotted name or a .py path",
    )
    p.add_argument(
        "--preset",
        action="append",
        metavar="NAME",
        help="preset or alias (repeatable; default: sweep); see --list-presets",
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed (CP group j uses seed+j)")
    p.add_argument(
        "--world-size",
        type=_positive(int),
        default=4,
        help="ranks to spawn when not under torchrun (default 4)",
    )
    p.add_argument(
        "--cp-size",
        type=_positive(int),
        default=None,
        help="run every preset with this CP size (CP groups of the world)",
    )
    p.add_argument(
        "--steps",
        type=_positive(int),
        default=None,
        help="steps per preset instead of the preset's own count",
    )
    _add_world_arguments(p)
    p.add_argument(
        "--keep-going", action="store_true", help="run every step even after a violation"
    )
    p.add_argument(
        "--fail-fast",
        action="store_true",
        help="stop testing an implementation after its first failing preset",
    )
    p.add_argument("--report", metavar="PATH", help="write every figure as JSON")
    p.add_argument("--junit", metavar="PATH", help="write JUnit XML (a case per preset and rank)")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of token ownership by rank")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )
    p.add_argument("--quiet", action="store_true", help="print only the verdict")
    p.add_argument("--list-presets", action="store_true", help="list presets and exit")


def _add_world_arguments(p: argparse.ArgumentParser) -> None:
    """--backend, --device and --timeout, shared by `verify` and `drill null-block`."""
    p.add_argument(
        "--backend",
        choices=("auto", "gloo", "nccl"),
        default="auto",
        help="collective backend (auto: nccl when every rank has a GPU, else gloo)",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where each rank's implementation runs (auto: cuda under nccl, else cpu; "
        "cuda with gloo lets several ranks share a GPU)",
    )
    p.add_argument(
        "--timeout",
        type=_positive(float),
        default=120.0,
        help="seconds a collective may wait for a peer (default 120)",
    )


def _rank_env(args: argparse.Namespace):
    """The torchrun environment (None when the ranks are to be spawned), after
    checking --device and --backend against the machine."""
    from .harness.dist import RankEnv

    try:
        env = RankEnv.from_environ()
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.device == "cuda" and not _cuda_visible():
        raise UsageError("--device cuda: no CUDA device is visible")
    if args.device == "cpu" and args.backend == "nccl":
        raise UsageError("--backend nccl needs --device cuda (or auto)")
    return env


def _check_plan(opts, plan: Callable) -> None:
    """Refuse what cannot run before any rank starts: NCCL without torchrun, unknown
    presets or implementations. A local spawn talks gloo."""
    if opts.spawned and opts.backend == "nccl":
        raise UsageError(
            "--backend nccl needs torchrun (one process per GPU); a local spawn "
            "runs on CPU with gloo"
        )
    if opts.spawned:
        opts.backend = "gloo"
    try:
        plan(opts, opts.world_size)
        for spec in opts.impls:
            load_impl(spec)
    except (ImplSpecError, ValueError) as e:
        raise UsageError(str(e)) from None


def _cuda_visible() -> bool:
    """Whether a GPU is visible, asked through NVML: initialising CUDA here would
    break the ranks the local spawner forks from this process."""
    import os

    import torch

    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    return torch.cuda.is_available()


def verify_options(args: argparse.Namespace):
    """`VerifyOptions` from parsed arguments, checked for the world it will run in."""
    from .harness.runner import VerifyOptions, plan

    env = _rank_env(args)
    opts = VerifyOptions(
        impls=args.impl or [DEFAULT_IMPL],
        presets=args.preset or ["sweep"],
        seed=args.seed,
        cp_size=args.cp_size,
        steps=args.steps,
        backend=args.backend,
        device=args.device,
        timeout=args.timeout,
        keep_going=args.keep_going,
        fail_fast=args.fail_fast,
        report_path=args.report,
        junit_path=args.junit,
        plot_path=args.plot,
        progress=args.progress,
        quiet=args.quiet,
        world_size=env.world_size if env else args.world_size,
        spawned=env is None,
    )
    _check_plan(opts, plan)
    if opts.plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib (pip install matplotlib)") from None
    return opts


def run_verify(args: argparse.Namespace) -> int:
    if args.list_presets:
        for name, p in presets.PRESETS.items():
            print(
                f"{name:<16} cp {p.cp_size}, interleave {p.cp_interleave}, "
                f"{p.num_steps} steps: {p.description}"
            )
        for alias, names in presets.ALIASES.items():
            print(f"{alias:<16} = {' '.join(names)}")
        return 0
    opts = verify_options(args)
    from .harness.dist import spawn_local
    from .harness.runner import run_rank

    if not opts.spawned:
        return run_rank(opts)
    return spawn_local(opts.world_size, lambda: run_rank(opts), opts.timeout)


# ---------------------------------------------------------------- bench


def _add_bench_harness_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=_positive(int), default=4, help="ranks (default 4)")
    p.add_argument("--preset", default="default", help="preset to run (default: default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-big", action="store_true", help="skip the 64K-tokens-per-step run")
    p.add_argument("--huge", action="store_true", help="add a 1M-tokens-per-step run (GPUs)")
    p.add_argument("--cp-size", type=_positive(int), default=None, help="as for verify")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")


def _bench_harness(args: argparse.Namespace) -> int:
    from .bench.harness import HarnessBench, bench_harness

    if args.device == "cuda" and not _cuda_visible():
        raise UsageError("--device cuda: no CUDA device is visible")
    return bench_harness(
        HarnessBench(
            world_size=args.world_size,
            preset=args.preset,
            seed=args.seed,
            big=not args.no_big,
            huge=args.huge,
            cp_size=args.cp_size,
            backend=args.backend,
            device=args.device,
        )
    )


def _add_bench_kernels_arguments(p: argparse.ArgumentParser) -> None:
    from .bench.kernels import add_bench_kernels_arguments

    add_bench_kernels_arguments(p)


def _bench_kernels(args: argparse.Namespace) -> int:
    from .bench.kernels import bench_kernels_command

    return bench_kernels_command(args)


def _add_bench_plugin_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tests", type=_positive(int), default=5, help="timed tests (default 5)")


def _bench_plugin(args: argparse.Namespace) -> int:
    from .bench.plugin import bench_plugin_overhead

    figures = bench_plugin_overhead(args.tests)
    for name, value in figures.items():
        print(f"{name:>28}  {value:.4f}" if isinstance(value, float) else f"{name:>28}  {value}")
    return 0


BENCH_ACTIONS: dict[str, Subcommand] = {
    "harness": Subcommand(
        "the harness on CPU: wall time, verified tokens/s and peak RSS per rank",
        _add_bench_harness_arguments,
        _bench_harness,
    ),
    "kernels": Subcommand(
        "the Triton kernels against the launch floor, copy bandwidth and plain PyTorch",
        _add_bench_kernels_arguments,
        _bench_kernels,
    ),
    "plugin": Subcommand(
        "per-test overhead of the multi-rank pytest plugin: reused pool against fresh ranks",
        _add_bench_plugin_arguments,
        _bench_plugin,
    ),
}


def _actions_parser(actions: dict[str, Subcommand]) -> Callable[[argparse.ArgumentParser], None]:
    """Adds one sub-parser per action of a subcommand (`bench`, `drill`)."""

    def add(p: argparse.ArgumentParser) -> None:
        sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
        for name, action in actions.items():
            q = sub.add_parser(name, help=action.help, description=action.help)
            action.add_arguments(q)
            q.set_defaults(_action=action.run)

    return add


def _run_action(args: argparse.Namespace) -> int:
    return args._action(args)


# ---------------------------------------------------------------- drill


def _sizes(text: str) -> list[int]:
    parts = text.split(",")
    if not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(
            f"expected world sizes as comma-separated positive ints, e.g. 4,2,4; got {text!r}"
        )
    return [int(p) for p in parts]


def _add_drill_null_block_arguments(p: argparse.ArgumentParser) -> None:
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
        type=_positive(int),
        default=None,
        help="ranks to spawn when not under torchrun (default: the largest of --sizes, else 4)",
    )
    p.add_argument(
        "--sizes",
        type=_sizes,
        default=None,
        help="world sizes to drill in turn, e.g. 4,2,4 (elastic resize; default: the world)",
    )
    p.add_argument("--steps", type=_positive(int), default=None, help="steps per serve phase")
    p.add_argument("--cp-size", type=_positive(int), default=None, help="override the CP size")
    p.add_argument(
        "--cp-interleave", type=_positive(int), default=None, help="override the CP interleave"
    )
    _add_world_arguments(p)
    p.add_argument(
        "--fail-fast",
        action="store_true",
        help="stop drilling an implementation after its first failing preset",
    )
    p.add_argument("--report", metavar="PATH", help="write every record as JSON")
    p.add_argument("--quiet", action="store_true", help="print only the verdict")


def drill_options(args: argparse.Namespace):
    """`DrillOptions` from parsed arguments, checked for the world it will run in."""
    from .drills.options import DrillOptions, plan

    env = _rank_env(args)
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
    _check_plan(opts, plan)
    return opts


def _drill_live_state(args: argparse.Namespace) -> int:
    opts = drill_options(args)
    from .drills.driver import run_drill_rank
    from .harness.dist import spawn_local

    if not opts.spawned:
        return run_drill_rank(opts)
    return spawn_local(opts.world_size, lambda: run_drill_rank(opts), opts.timeout)


def _add_drill_wake_up_arguments(p: argparse.ArgumentParser) -> None:
    _add_drill_null_block_arguments(p)
    p.add_argument(
        "--cycles",
        type=_positive(int),
        default=2,
        help="sleeps inside each serve phase (default 2; serve 2 adds one before its first step)",
    )


def _add_drill_faults_arguments(p: argparse.ArgumentParser) -> None:
    from .drills.faults import SCENARIOS

    p.add_argument("--nproc", type=_positive(int), default=2, help="ranks per run (default 2)")
    p.add_argument(
        "--timeout",
        type=_positive(float),
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
    p.add_argument("--steps", type=_positive(int), default=6, help="steps per serve phase")
    p.add_argument("--keep-logs", metavar="DIR", help="keep torchrun's logs and error files here")
    p.add_argument("--report", metavar="PATH", help="write the outcomes as JSON")


def _drill_faults(args: argparse.Namespace) -> int:
    from .drills.faults import FaultDrillOptions, run_fault_drill

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


DRILL_ACTIONS: dict[str, Subcommand] = {
    "null-block": Subcommand(
        "the elastic-EP warm-up on live state: no live KV touched, every check before and after",
        _add_drill_null_block_arguments,
        _drill_live_state,
    ),
    "wake-up": Subcommand(
        "sleep mode on live state: device memory overwritten, the engine's wake-up, every "
        "check after it",
        _add_drill_wake_up_arguments,
        _drill_live_state,
    ),
    "faults": Subcommand(
        "ranks that raise, restart, hang or disagree under torchrun: ended, named, nothing left",
        _add_drill_faults_arguments,
        _drill_faults,
    ),
}


SUBCOMMANDS: dict[str, Subcommand] = {
    "verify": Subcommand(
        "check that the CP ranks together cover every token exactly once",
        add_verify_arguments,
        run_verify,
    ),
    "bench": Subcommand(
        "benchmarks: harness, kernels, plugin", _actions_parser(BENCH_ACTIONS), _run_action
    ),
    "drill": Subcommand(
        "drills: the null-block warm-up and sleep/wake-up on live state, and rank faults",
        _actions_parser(DRILL_ACTIONS),
        _run_action,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cp-blocktables",
        description="Block tables and slot mappings for decode context parallelism.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, cmd in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args._run(args)
    except UsageError as e:
        print(f"cp-blocktables {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("cp-blocktables: interrupted", file=sys.stderr)
        return 130
