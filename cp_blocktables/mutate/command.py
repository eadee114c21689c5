"""`cp-blocktables mutate`: mutation testing of the implementation against the harness.

Steps: copy the implementation modules (`scratch`), run the harness once on
the unmutated copy (a baseline that must pass, and whose wall time sets the
default per-mutant timeout), `cosmic-ray init`, keep a fixed sample when
asked, record the mutants whose statement the unmutated test command never
runs as survivors (`reach`, unless `--no-coverage`), `cosmic-ray exec`, then
classify and report (`outcome`).

Both harness runs use `--device cpu`: the copy's Triton kernels run under the
interpreter on every host (a GPU host only adds cores), so a mutant's verdict
does not depend on where it ran.

Each mutant meets the fast mutation presets first (seconds); one that passes
them meets the confirming run, the default sweep unless told otherwise, so a
survivor is a mutant that `verify` with the default sweep passes, which is
the claim docs/mutation.md measures.

Exit codes: 0 every executed mutant was killed (or timed out, or does not
import) or is argued in docs/mutation-survivors.md (equivalent, outside the
contract, or GPU only); 1 an unexplained survivor; 2 bad usage, Cosmic Ray
missing, or the baseline failed; 3 `--time-limit` left mutants pending.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import outcome, reach, record, scratch, session, shares
from .cli_args import DEFAULT_PRESETS
from .probe import INCOMPETENT_EXIT

MUTANT_HOST_TILE = 16
"""Elements per interpreted program in the fast stage: the mutation presets' small steps
then take several programs a launch, as every launch on a GPU does (the confirming run
keeps the default tiles)."""


def _project() -> tuple[Path, Path]:
    """(the package directory, the project root) of the `cp_blocktables` being run."""
    import cp_blocktables

    source_dir = Path(cp_blocktables.__file__).resolve().parent
    return source_dir, source_dir.parent


@dataclass(frozen=True)
class HarnessRun:
    """One `verify` of the mutant: its presets (empty: the default sweep) and world size."""

    presets: tuple[str, ...]
    world_size: int

    def args(self, sp: scratch.ScratchPackage, collective_timeout: float) -> list[str]:
        return _verify_args(sp, self.presets, self.world_size, collective_timeout)


def test_command(
    sp: scratch.ScratchPackage,
    fast: HarnessRun,
    confirm: HarnessRun | None,
    collective_timeout: float,
) -> list[str]:
    """The per-mutant command: the probe, `verify --impl` on the copy, then the confirming run."""
    imports = [f"{sp.package}.{name}" for name in sorted(sp.modules)]
    cmd = [sys.executable, "-m", "cp_blocktables.mutate.probe", "--scratch", str(sp.root)]
    cmd += ["--host-tile", str(MUTANT_HOST_TILE)]
    for name in imports:
        cmd += ["--import", name]
    cmd += ["--", *fast.args(sp, collective_timeout)]
    if confirm is not None:
        cmd += ["--", *confirm.args(sp, collective_timeout)]
    return cmd


def _verify_args(
    sp: scratch.ScratchPackage, presets: tuple[str, ...], world_size: int, timeout: float
) -> list[str]:
    cmd = [
        "verify",
        "--impl",
        sp.entry_impl(),
        "--world-size",
        str(world_size),
        "--device",
        "cpu",
        "--seed",
        "0",
        "--fail-fast",
        "--quiet",
        "--no-progress",
        "--timeout",
        f"{timeout:g}",
    ]
    for name in presets:
        cmd += ["--preset", name]
    return cmd


def run_mutate(args: argparse.Namespace) -> int:
    try:
        session.require_cosmic_ray()
        if not (args.no_coverage or args.dry_run):
            reach.require_coverage()
        _check_args(args)
    except (session.CosmicRayError, reach.ReachError, ValueError) as e:
        print(f"cp-blocktables mutate: error: {e}", file=sys.stderr)
        return 2
    if args.merge_record:
        return _merge_record(Path(args.record), Path(args.merge_record))
    source_dir, root = _project()
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="cpbt-mutate-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        with shares.sigterm_unwinds():
            return _run(args, source_dir, root, work.resolve())
    except (
        ValueError,
        FileNotFoundError,
        session.CosmicRayError,
        reach.ReachError,
        record.RecordError,
    ) as e:
        print(f"cp-blocktables mutate: error: {e}", file=sys.stderr)
        return 2
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)


def _check_args(args: argparse.Namespace) -> None:
    if args.jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {args.jobs}")
    if args.shares is not None and args.shares < 1:
        raise ValueError(f"--shares must be at least 1, got {args.shares}")
    if args.time_limit is not None and args.time_limit <= 0:
        raise ValueError(f"--time-limit must be positive, got {args.time_limit:g}")
    if args.resume and not args.work_dir:
        raise ValueError("--resume needs the --work-dir of the run to resume")
    if args.resume and (args.sample is not None or args.shares is not None):
        raise ValueError("--resume keeps the run's mutants and shares: no --sample or --shares")
    if args.merge_record and not args.record:
        raise ValueError("--merge-record needs the --record ledger to merge into")
    if args.moved_from and not (args.record and len(_patterns(args)) == 1):
        raise ValueError("--moved-from needs --record and the one module moved to (--modules)")


def _run(args: argparse.Namespace, source_dir: Path, root: Path, work: Path) -> int:
    started = time.monotonic()
    count = shares.existing_count(work) if args.resume else args.shares or args.jobs
    if not count:
        raise ValueError(f"--resume: no mutation session in {work}")
    parts = shares.build(work, source_dir, count)
    names = list(parts[0].sp.select(_patterns(args)))
    presets = args.preset or list(DEFAULT_PRESETS)
    fast = HarnessRun(tuple(presets), args.world_size)
    confirm = (
        None
        if args.no_confirm
        else HarnessRun(tuple(args.confirm_preset or ()), args.confirm_world_size)
    )
    env = session.child_env([root])
    origins = {  # every share names the same files, relative to its own directory
        str(path.relative_to(parts[0].home)): str(parts[0].sp.origins[n].relative_to(root))
        for n, path in parts[0].sp.modules.items()
    }
    chosen = [str(parts[0].sp.origins[n].relative_to(root)) for n in names]
    print(f"mutate: {len(names)} modules: {', '.join(chosen)}")
    timeout = args.timeout or 60.0
    if not args.dry_run:
        timeout = _baseline(args, parts[0].sp, fast, confirm, env)
        if timeout is None:
            return 2
    for sh in parts:
        modules = [sh.sp.modules[n].relative_to(sh.home) for n in names]
        sh_cmd = test_command(sh.sp, fast, confirm, max(10.0, timeout / 2))
        session.write_config(sh.config, modules, sh_cmd, timeout)
    if args.resume:
        total, annotation = (
            session.count(parts[0].db)[1],
            session.count_annotation_skips(parts[0].db),
        )
        pending = sum(session.count_pending(sh.db) for sh in parts)
        print(f"mutate: resuming {count} shares: {total} mutants, {pending} still to run")
    else:
        total, annotation, pending = _init(args, parts, work, env)
    ledger_path = Path(args.record) if args.record else None
    ledger = record.read(ledger_path) if ledger_path else {}
    if args.moved_from:
        _carry_moved(parts, origins, chosen, args.moved_from, ledger, ledger_path)
    if ledger:
        known = _skip_recorded(parts, origins, ledger, args.jobs)
        pending -= known
        print(f"mutate: {known} mutants recorded in {ledger_path}, not run again; {pending} to run")
    if args.dry_run:
        return 0
    if pending and not args.no_coverage:
        cmd = test_command(parts[0].sp, fast, confirm, max(10.0, timeout / 2))
        reach.prepass(parts, cmd, env, timeout, _left(args, started))
    allow_path = Path(args.allowlist) if args.allowlist else root / "docs" / "mutation-survivors.md"
    allowlist = outcome.read_allowlist(allow_path)

    try:
        finished = shares.execute(parts, env, args.jobs, args.progress, _left(args, started))
    finally:  # stopped or not, what did run joins the ledger
        vs = [
            v
            for sh in parts
            for v in outcome.verdicts(session.read_mutants(sh.db), origins, allowlist, ledger)
        ]
        if ledger_path:
            added = record.merge(ledger_path, vs)
            print(f"mutate: {added} verdicts added to {ledger_path}", file=sys.stderr)
    summary = outcome.summarize(vs, total, annotation)
    summary["pending"] = sum(session.count_pending(sh.db) for sh in parts)
    wall = time.monotonic() - started
    print(outcome.render(summary, vs))
    print(f"wall time: {wall:.0f} s")
    if not finished:
        print(
            f"mutate: stopped by --time-limit with {summary['pending']} mutants pending; "
            f"run them with --resume --work-dir {work}"
        )
    if args.report:
        report = _report(args, parts[0].sp, fast, confirm, chosen, timeout, wall, summary, vs)
        Path(args.report).write_text(json.dumps(report, indent=1) + "\n")
    if summary["unexplained_survivors"]:
        return 1
    return 3 if summary["pending"] else 0


def _patterns(args: argparse.Namespace) -> list[str]:
    return [x for m in args.modules or [] for x in m.split(",") if x]


def _carry_moved(
    parts: list[shares.Share],
    origins: dict[str, str],
    chosen: list[str],
    old: str,
    ledger: dict,
    path: Path,
) -> None:
    """Copy the ledger's entries of the code moved from module `old` to the chosen module
    to their new ids, and print each pair (the allowlist's headings name ids too)."""
    if len(chosen) != 1:
        raise ValueError(f"--moved-from: --modules must select one module, got {len(chosen)}")
    (new,) = chosen
    before = {new: str(Path(Path(new).parts[0], *old.split(".")).with_suffix(".py"))}
    pairs = [p for sh in parts for p in record.moved_ids(sh.db, sh.home, origins, before)]
    carried = record.carry(ledger, pairs)
    record.write(path, ledger)
    for o, n in carried:
        print(f"mutate: copied {o} -> {n}")
    print(f"mutate: {len(carried)} entries of {path} copied from {before[new]} to {new}")


def _skip_recorded(
    parts: list[shares.Share], origins: dict[str, str], ledger: dict, jobs: int
) -> int:
    """Mark the pending mutants the ledger names skipped in every share (`jobs` at a time:
    each mutant's id takes a parse of its file)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(jobs, len(parts)), mp_context=ctx) as pool:
        futures = [
            pool.submit(record.skip_recorded, sh.db, sh.home, origins, ledger) for sh in parts
        ]
        return sum(f.result() for f in futures)


def _merge_record(path: Path, other: Path) -> int:
    if not other.is_file():
        print(
            f"cp-blocktables mutate: error: --merge-record: no ledger at {other}", file=sys.stderr
        )
        return 2
    try:
        changed = record.merge_files(path, other)
    except record.RecordError as e:
        print(f"cp-blocktables mutate: error: {e}", file=sys.stderr)
        return 2
    print(f"mutate: {changed} entries of {other} added to {path}")
    return 0


def _left(args: argparse.Namespace, started: float) -> float | None:
    """Seconds left of --time-limit (None: no limit)."""
    return None if args.time_limit is None else args.time_limit - (time.monotonic() - started)


def _report(
    args: argparse.Namespace,
    sp: scratch.ScratchPackage,
    fast: HarnessRun,
    confirm: HarnessRun | None,
    chosen: list[str],
    timeout: float,
    wall: float,
    summary: dict,
    vs: list[outcome.Verdict],
) -> dict:
    """The JSON report: the options, the figures and every executed mutant."""
    return {
        "date": datetime.date.today().isoformat(),
        "command": ["cp-blocktables", "mutate", *sys.argv[2:]],
        "test_command": test_command(sp, fast, confirm, max(10.0, timeout / 2)),
        "presets": list(fast.presets),
        "world_size": fast.world_size,
        "confirm": None
        if confirm is None
        else {
            "presets": list(confirm.presets) or ["(default sweep)"],
            "world_size": confirm.world_size,
        },  # fmt: skip
        "modules": sorted(chosen),
        "sample": args.sample,
        "seed": args.seed,
        "coverage_prepass": not args.no_coverage,
        "timeout_s": timeout,
        "wall_s": round(wall, 1),
        **summary,
        "verdicts": [v.as_dict() for v in vs],
    }


def _baseline(
    args: argparse.Namespace,
    sp: scratch.ScratchPackage,
    fast: HarnessRun,
    confirm: HarnessRun | None,
    env: dict[str, str],
) -> float | None:
    """Run the unmutated copy; the per-mutant timeout, or None (printed) when it fails."""
    probe_timeout = args.timeout or 900.0
    cmd = test_command(sp, fast, confirm, max(10.0, probe_timeout / 2))
    t0 = time.monotonic()
    code, out = session.run_test_command(cmd, env, probe_timeout)
    baseline = time.monotonic() - t0
    if code != 0:
        what = "does not import" if code == INCOMPETENT_EXIT else f"fails (exit {code})"
        print(
            f"cp-blocktables mutate: error: the unmutated copy {what}; nothing to "
            f"measure\n{out[-4000:]}",
            file=sys.stderr,
        )
        return None
    timeout = args.timeout or max(60.0, 5 * baseline)
    print(f"mutate: baseline passed in {baseline:.1f} s; timeout {timeout:.0f} s a mutant")
    return timeout


def _init(
    args: argparse.Namespace, parts: list[shares.Share], work: Path, env: dict[str, str]
) -> tuple[int, int, int]:
    """`cosmic-ray init` once, skip annotations, sample, then split into the shares:
    (total, annotation, to run)."""
    first = parts[0]
    session.cosmic_ray(
        ["init", first.config.name, first.db.name, "--force"], env=env, cwd=first.home
    )
    total = session.count(first.db)[1]
    annotation = session.skip_annotations(first.db, first.home)
    if args.sample is not None:
        session.sample(first.db, args.sample, args.seed)
    pending = shares.split(parts, args.jobs)
    print(
        f"mutate: {total} mutants, {annotation} in never-evaluated annotations, {pending} to run"
        + (f" (sample of {args.sample}, seed {args.seed})" if args.sample is not None else "")
        + (f" in {len(parts)} shares" if len(parts) > 1 else "")
    )
    return total, annotation, pending
