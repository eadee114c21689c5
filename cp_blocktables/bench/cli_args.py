"""`cp-blocktables bench ...` on the command line: each action's arguments and runner.
`cli.py` registers `HARNESS`, `KERNELS` and `PLUGIN` as bench actions."""

from __future__ import annotations

import argparse

from ..cli_base import Subcommand, UsageError, cuda_visible, positive


def _add_harness_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=positive(int), default=4, help="ranks (default 4)")
    p.add_argument("--preset", default="default", help="preset to run (default: default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-big", action="store_true", help="skip the 64K-tokens-per-step run")
    p.add_argument("--huge", action="store_true", help="add a 1M-tokens-per-step run (GPUs)")
    p.add_argument("--cp-size", type=positive(int), default=None, help="as for verify")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--checks",
        choices=("both", "host", "device", "auto"),
        default="both",
        help="where the leader checks: both (host, then device, side by side; default), "
        "host (numpy), device (torch on the rank's device) or auto (as verify)",
    )


def _run_harness(args: argparse.Namespace) -> int:
    from .harness import HarnessBench, bench_harness

    if args.device == "cuda" and not cuda_visible():
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
            checks=("host", "device") if args.checks == "both" else (args.checks,),
        )
    )


def _add_kernels_arguments(p: argparse.ArgumentParser) -> None:
    from .kernels import add_bench_kernels_arguments

    add_bench_kernels_arguments(p)


def _run_kernels(args: argparse.Namespace) -> int:
    from .kernels import bench_kernels_command

    return bench_kernels_command(args)


def _add_plugin_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tests", type=positive(int), default=5, help="timed tests (default 5)")


def _run_plugin(args: argparse.Namespace) -> int:
    from .plugin import bench_plugin_overhead

    figures = bench_plugin_overhead(args.tests)
    for name, value in figures.items():
        print(f"{name:>28}  {value:.4f}" if isinstance(value, float) else f"{name:>28}  {value}")
    return 0


HARNESS = Subcommand(
    "the harness: wall time, verified tokens/s and peak RSS per rank, host and device checks",
    _add_harness_arguments,
    _run_harness,
)
KERNELS = Subcommand(
    "the Triton kernels against the launch floor, copy bandwidth and plain PyTorch",
    _add_kernels_arguments,
    _run_kernels,
)
PLUGIN = Subcommand(
    "per-test overhead of the multi-rank pytest plugin: reused pool against fresh ranks",
    _add_plugin_arguments,
    _run_plugin,
)
