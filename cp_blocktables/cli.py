"""`cp-blocktables` / `python -m cp_blocktables`: subcommands and exit codes.

Exit codes: 0 every check passed, 1 a violation (or a lost peer), 2 bad usage
or configuration (a one-line message, no traceback).

This module only registers and dispatches. Each product keeps its arguments,
the options built from them and the checks of bad usage beside itself, as
`Subcommand`s (`cli_base.Subcommand`: help line, argument adder, runner that
returns the exit code): `harness/cli_args.py` (`verify`, `soak`),
`drills/cli_args.py` (the actions of `drill`), `bench/cli_args.py` (the
actions of `bench`). Adding a subcommand, or an action of `bench` or `drill`,
is one line in `SUBCOMMANDS`, `BENCH_ACTIONS` or `DRILL_ACTIONS`.
"""

from __future__ import annotations

import argparse
import sys

from .bench import cli_args as bench_cli
from .cli_base import Subcommand, UsageError, actions_parser, run_action
from .drills import cli_args as drill_cli
from .harness import cli_args as harness_cli
from .mutate.cli_args import add_mutate_arguments
from .mutate.command import run_mutate

__all__ = ["BENCH_ACTIONS", "DRILL_ACTIONS", "SUBCOMMANDS", "UsageError", "build_parser", "main"]

BENCH_ACTIONS: dict[str, Subcommand] = {
    "harness": bench_cli.HARNESS,
    "kernels": bench_cli.KERNELS,
    "plugin": bench_cli.PLUGIN,
}

DRILL_ACTIONS: dict[str, Subcommand] = {
    "null-block": drill_cli.NULL_BLOCK,
    "wake-up": drill_cli.WAKE_UP,
    "faults": drill_cli.FAULTS,
}

SUBCOMMANDS: dict[str, Subcommand] = {
    "verify": harness_cli.VERIFY,
    "soak": harness_cli.SOAK,
    "bench": Subcommand(
        "benchmarks: harness, kernels, plugin", actions_parser(BENCH_ACTIONS), run_action
    ),
    "mutate": Subcommand(
        "mutation testing: Cosmic Ray mutates a copy of the implementation, the harness must fail",
        add_mutate_arguments,
        run_mutate,
    ),
    "drill": Subcommand(
        "drills: the null-block warm-up and sleep/wake-up on live state, and rank faults",
        actions_parser(DRILL_ACTIONS),
        run_action,
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
