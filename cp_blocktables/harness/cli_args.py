"""`cp-blocktables verify` on the command line: its arguments, the options built from
them, and the checks that refuse what cannot run (exit 2) before any rank starts.

`add_world_arguments`, `rank_env` and `check_plan` are shared with the other
subcommands that run ranks (`drill null-block`, `soak`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from ..cli_base import Subcommand, UsageError, cuda_visible, positive
from . import presets
from .impl_loader import DEFAULT_IMPL, ImplSpecError, load_impl


def add_impl_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--impl",
        action="append",
        metavar="MODULE:ATTR",
        help=f"implementation under test (repeatable; default {DEFAULT_IMPL}); "
        f"MODULE may be a dotted name or a .py path",
    )


def add_verify_arguments(p: argparse.ArgumentParser) -> None:
    add_impl_argument(p)
    p.add_argument(
        "--preset",
        action="append",
        metavar="NAME",
        help="preset or alias (repeatable; default: sweep); see --list-presets",
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed (CP group j uses seed+j)")
    _add_world_size_and_cp_size(p)
    p.add_argument(
        "--steps",
        type=positive(int),
        default=None,
        help="steps per preset instead of the preset's own count",
    )
    add_world_arguments(p)
    add_checks_argument(p)
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


def _add_world_size_and_cp_size(p: argparse.ArgumentParser) -> None:
    """--world-size and --cp-size, the same for `verify` and `soak`."""
    p.add_argument(
        "--world-size",
        type=positive(int),
        default=4,
        help="ranks to spawn when not under torchrun (default 4)",
    )
    p.add_argument(
        "--cp-size",
        type=positive(int),
        default=None,
        help="run every preset with this CP size (CP groups of the world)",
    )


def add_world_arguments(p: argparse.ArgumentParser) -> None:
    """--backend, --device and --timeout, shared by `verify`, `soak` and `drill null-block`."""
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
        type=positive(float),
        default=120.0,
        help="seconds a collective may wait for a peer (default 120)",
    )


def add_checks_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checks",
        choices=("auto", "device", "host"),
        default="auto",
        help="where the CP group's leader runs the checks: torch on the rank's device, or "
        "numpy on the host (auto: device on a GPU rank, host on a CPU rank)",
    )


def rank_env(args: argparse.Namespace):
    """The torchrun environment (None when the ranks are to be spawned), after
    checking --device and --backend against the machine."""
    from .group import RankEnv

    try:
        env = RankEnv.from_environ()
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.device == "cuda" and not cuda_visible():
        raise UsageError("--device cuda: no CUDA device is visible")
    if args.device == "cpu" and args.backend == "nccl":
        raise UsageError("--backend nccl needs --device cuda (or auto)")
    if env is not None and args.backend == "nccl":
        check_gpu_per_rank(env.local_world_size)
    return env


def check_gpu_per_rank(local_world_size: int) -> None:
    """`--backend nccl` under torchrun: this agent's ranks need a GPU each. (Ranks of
    another agent on the same host are counted by the census, `backend.decide`.)"""
    from .backend import visible_gpus

    gpus = visible_gpus()
    if local_world_size > gpus:
        fewer = f" or at most {gpus} ranks per host" if gpus else ""
        raise UsageError(
            f"--backend nccl needs a GPU per rank: local world size {local_world_size}, "
            f"{gpus} GPU{'s' if gpus != 1 else ''} visible; use --backend gloo "
            f"(ranks share GPUs){fewer}"
        )


def check_plan(opts, plan: Callable) -> None:
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


def verify_options(args: argparse.Namespace):
    """`VerifyOptions` from parsed arguments, checked for the world it will run in."""
    from .options import VerifyOptions, plan

    env = rank_env(args)
    opts = VerifyOptions(
        impls=args.impl or [DEFAULT_IMPL],
        presets=args.preset or ["sweep"],
        seed=args.seed,
        cp_size=args.cp_size,
        steps=args.steps,
        backend=args.backend,
        device=args.device,
        checks=args.checks,
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
    check_plan(opts, plan)
    if opts.plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib (pip install matplotlib)") from None
    return opts


def list_presets() -> int:
    for name, p in presets.PRESETS.items():
        print(
            f"{name:<16} cp {p.cp_size}, interleave {p.cp_interleave}, "
            f"{p.num_steps} steps: {p.description}"
        )
    for alias, names in presets.ALIASES.items():
        print(f"{alias:<16} = {' '.join(names)}")
    return 0


def run_verify(args: argparse.Namespace) -> int:
    if args.list_presets:
        return list_presets()
    opts = verify_options(args)
    from .runner import run_rank
    from .spawn import spawn_local

    if not opts.spawned:
        return run_rank(opts)
    return spawn_local(opts.world_size, lambda: run_rank(opts), opts.timeout, opts.impls)


VERIFY = Subcommand(
    "check that the CP ranks together cover every token exactly once",
    add_verify_arguments,
    run_verify,
)


# ---------------------------------------------------------------- soak


def add_soak_arguments(p: argparse.ArgumentParser) -> None:
    add_impl_argument(p)
    p.add_argument(
        "--preset",
        action="append",
        metavar="NAME",
        help="preset or alias run each round (repeatable; default: sweep)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="first round's seed (round r: seed + r * world size)"
    )
    _add_world_size_and_cp_size(p)
    p.add_argument(
        "--preset-steps",
        type=positive(int),
        default=None,
        help="steps per preset instead of the preset's own count (shorter rounds)",
    )
    budget = p.add_argument_group("budget (the first one spent ends the soak; default 10 minutes)")
    budget.add_argument("--minutes", type=positive(float), default=None, help="wall time")
    budget.add_argument("--seconds", type=positive(float), default=None, help="wall time")
    budget.add_argument("--steps", type=positive(int), default=None, help="steps verified")
    budget.add_argument("--tokens", type=positive(int), default=None, help="tokens verified")
    add_world_arguments(p)
    add_checks_argument(p)
    p.add_argument("--report", metavar="PATH", help="write the totals and the last round as JSON")
    p.add_argument("--junit", metavar="PATH", help="write the last round's JUnit XML")
    p.add_argument("--quiet", action="store_true", help="print only the verdict")


def soak_options(args: argparse.Namespace):
    """`SoakOptions` from parsed arguments, checked for the world it will run in."""
    from .options import VerifyOptions, plan
    from .soak import SoakOptions

    env = rank_env(args)
    if env is not None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        raise UsageError(
            "soak needs a store that outlives the rounds: run it under torchrun "
            "(its agent store) or spawned"
        )
    rounds = VerifyOptions(
        impls=args.impl or [DEFAULT_IMPL],
        presets=args.preset or ["sweep"],
        seed=args.seed,
        cp_size=args.cp_size,
        steps=args.preset_steps,
        backend=args.backend,
        device=args.device,
        checks=args.checks,
        timeout=args.timeout,
        fail_fast=True,
        quiet=args.quiet,
        world_size=env.world_size if env else args.world_size,
        spawned=env is None,
    )
    check_plan(rounds, plan)
    seconds = None
    if args.minutes is not None or args.seconds is not None:
        seconds = 60 * (args.minutes or 0.0) + (args.seconds or 0.0)
    if seconds is None and args.steps is None and args.tokens is None:
        seconds = 600.0
    return SoakOptions(
        rounds=rounds,
        seconds=seconds,
        steps=args.steps,
        tokens=args.tokens,
        report_path=args.report,
        junit_path=args.junit,
    )


def run_soak(args: argparse.Namespace) -> int:
    opts = soak_options(args)
    from .soak import soak_rank
    from .spawn import spawn_local

    if not opts.rounds.spawned:
        return soak_rank(opts)
    return spawn_local(
        opts.rounds.world_size, lambda: soak_rank(opts), opts.rounds.timeout, opts.rounds.impls
    )


SOAK = Subcommand(
    "run presets with fresh seeds round after round until a budget is spent or a check breaks",
    add_soak_arguments,
    run_soak,
)
