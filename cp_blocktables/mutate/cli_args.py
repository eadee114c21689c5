"""The options of `cp-blocktables mutate` (docs/mutation.md, *Running it*)."""

from __future__ import annotations

import argparse

DEFAULT_PRESETS = ("mutation", "mutation-cp1", "mutation-odd", "groups-0")
"""The fast stage's presets: seconds a mutant, every argument path (docs/mutation.md)."""


def add_mutate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sample",
        type=int,
        default=None,
        metavar="N",
        help="run a fixed random sample of N mutants (default: all)",
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument(
        "--modules",
        action="append",
        metavar="NAME",
        help="mutate only these implementation modules (dotted, relative to the "
        "package, e.g. kernels or buffers; repeatable or comma-separated)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds per mutant (default: 5x the baseline run, at least 60)",
    )
    p.add_argument("--report", metavar="PATH", help="write figures and every verdict as JSON")
    p.add_argument(
        "--preset",
        action="append",
        metavar="NAME",
        help=f"harness presets per mutant (default: {' '.join(DEFAULT_PRESETS)})",
    )
    p.add_argument("--world-size", type=int, default=2, help="harness ranks (default 2)")
    p.add_argument(
        "--confirm-preset",
        action="append",
        metavar="NAME",
        help="presets of the confirming run that a mutant surviving --preset must also "
        "pass to count as a survivor (default: the default sweep, as `verify` runs it)",
    )
    p.add_argument(
        "--confirm-world-size",
        type=int,
        default=8,
        help="ranks of the confirming run (default 8, as `make verify`)",
    )
    p.add_argument(
        "--no-confirm",
        action="store_true",
        help="a mutant that passes --preset survives (no confirming run: faster, weaker)",
    )
    p.add_argument(
        "--allowlist",
        metavar="PATH",
        help="argued survivors: equivalent, outside the contract or GPU only "
        "(default: docs/mutation-survivors.md of the project)",
    )
    p.add_argument(
        "--work-dir",
        metavar="DIR",
        help="keep the copy, config, session (sqlite) and log here "
        "(default: a temporary directory, removed afterwards)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="build the copy and the session, print the mutant count, run nothing",
    )
    p.add_argument(
        "--no-coverage",
        action="store_true",
        help="run every mutant: no coverage pre-pass recording the mutants in statements "
        "the unmutated test command never runs as survivors (not reached) without running them",
    )
    p.add_argument("--progress", action="store_true", help="print progress every 30 s")
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        metavar="N",
        help="mutants run at once, each on a copy of its own (default 1; a mutant's fast "
        "stage takes 2 cores)",
    )
    p.add_argument(
        "--shares",
        type=int,
        default=None,
        metavar="N",
        help="sessions the run is split into (default: --jobs); more shares than jobs lets a "
        "later --resume on a bigger host run more at once",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=None,
        metavar="S",
        help="stop S seconds after the start (setup and baseline included); what is left "
        "stays pending in --work-dir for --resume (exit 3)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="run what is pending in the sessions of --work-dir (made here or on another "
        "host), after copying the pristine implementation again",
    )
    p.add_argument(
        "--record",
        metavar="PATH",
        help="the run's ledger (docs/mutation-record.tsv): mutants it names are not run "
        "again, and every verdict of this run is merged into it, also when stopped",
    )
    p.add_argument(
        "--moved-from",
        metavar="MODULE",
        help="with --record and one --modules NEW: NEW's code was moved from MODULE (dotted, "
        "as --modules names it), text unchanged; the ledger's verdicts follow it to NEW's ids",
    )
    p.add_argument(
        "--merge-record",
        metavar="OTHER",
        help="with --record: merge the ledger OTHER (another host's) into it, run nothing",
    )
