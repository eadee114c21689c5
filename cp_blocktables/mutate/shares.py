"""One mutation run as several Cosmic Ray sessions (shares), run a few at a time, resumable.

Why: Cosmic Ray's `local` distributor runs one mutant at a time, and a mutant
costs a harness run of several seconds, so every mutant of the implementation
takes a day on one machine. Cosmic Ray mutates files in place, so two mutants
can only run at once on two copies: a run is split into `count` shares, each
a session of its own over a copy of its own (`src-K/`, `session-K.sqlite`),
and `--jobs` of them execute at once. Spread over a many-core host, and
stopped and resumed on another (`--time-limit`, `--resume`), the full run
fits in hours.

Invariants:

* A share is fixed by position, not by Cosmic Ray's random job ids: share
  `K` of `N` keeps the selected mutants whose place in the stable order
  (module, operator, occurrence) is `K` modulo `N`. So every selected mutant
  lies in exactly one share, and the split is the same on every machine.
* Sessions name the mutated files relative to the work directory and Cosmic
  Ray runs there, so a work directory moves between machines (copy it, then
  `--resume`).
* A session records a mutant's result only when its run ends. Stopping a run
  loses the mutants in flight, which stay pending, and may leave a copy
  mutated: `--resume` copies the pristine implementation again before it runs
  what is pending.
* Every process a run starts is gone when it returns: on the time limit the
  `exec` processes and the probes they started (each in a session of its own,
  found by the copy's path on its command line) are killed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from . import session
from .scratch import ScratchPackage, build_scratch


@dataclass(frozen=True)
class Share:
    """One Cosmic Ray session: its copy, config, sqlite file and `exec` log."""

    index: int
    sp: ScratchPackage
    config: Path
    db: Path
    log: Path


def _names(work: Path, index: int, count: int) -> tuple[Path, Path, Path, Path]:
    if count == 1:  # the single-session layout keeps its plain names
        return work / "src", work / "cosmic-ray.toml", work / "session.sqlite", work / "exec.log"
    return (
        work / f"src-{index}",
        work / f"cosmic-ray-{index}.toml",
        work / f"session-{index}.sqlite",
        work / f"exec-{index}.log",
    )


def build(work: Path, source_dir: Path, count: int) -> list[Share]:
    """`count` shares in `work`, each with a fresh copy of the implementation."""
    shares = []
    for k in range(count):
        src, config, db, log = _names(work, k, count)
        shares.append(Share(k, build_scratch(src, source_dir), config, db, log))
    return shares


def existing_count(work: Path) -> int:
    """How many shares the sessions in `work` were split into (0: none)."""
    if (work / "session.sqlite").is_file():
        return 1
    n = 0
    while (work / f"session-{n}.sqlite").is_file():
        n += 1
    return n


def init_all(shares: list[Share], work: Path, env: dict[str, str], jobs: int) -> None:
    """`cosmic-ray init` of every share, `jobs` at a time, in `work`."""
    pending = list(shares)
    running: list[tuple[Share, subprocess.Popen]] = []
    failed: list[str] = []
    while pending or running:
        while pending and len(running) < jobs:
            sh = pending.pop(0)
            cmd = [sys.executable, "-c", session.CR_MAIN, "init", sh.config.name, sh.db.name]
            proc = subprocess.Popen(
                [*cmd, "--force"],
                cwd=work,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            running.append((sh, proc))
        sh, proc = running.pop(0)
        out, _ = proc.communicate()
        if proc.returncode != 0:
            failed.append(f"share {sh.index}: exit {proc.returncode}\n{out[-2000:]}")
    if failed:
        raise session.CosmicRayError("cosmic-ray init failed: " + "\n".join(failed))


def keep_share(db: Path, index: int, count: int) -> int:
    """Keep pending the mutants at positions `index` modulo `count` of the stable order of
    the pending ones; mark the rest skipped. Returns how many stay pending."""
    if count == 1:
        return session.count_pending(db)
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    with use_db(str(db), WorkDB.Mode.open) as wdb:
        items = sorted(wdb.pending_work_items, key=session.stable_key)
        others = [x.job_id for i, x in enumerate(items) if i % count != index]
        wdb.set_multiple_results(others, WorkResult(worker_outcome=WorkerOutcome.SKIPPED))
    return len(items) - len(others)


def execute(
    shares: list[Share],
    work: Path,
    env: dict[str, str],
    jobs: int,
    progress: bool,
    time_limit: float | None,
) -> bool:
    """`cosmic-ray exec` of every share with pending mutants, `jobs` at a time.

    Returns False when the time limit stopped the run (what was in flight stays
    pending); raises `CosmicRayError` when an `exec` fails.
    """
    deadline = None if time_limit is None else time.monotonic() + max(0.0, time_limit)
    todo = [sh for sh in shares if session.count_pending(sh.db)]
    running: list[tuple[Share, subprocess.Popen]] = []
    last_report = time.monotonic()
    try:
        while todo or running:
            while todo and len(running) < jobs:
                sh = todo.pop(0)
                running.append((sh, _start_exec(sh, work, env)))
            time.sleep(0.5)
            for sh, proc in list(running):
                if proc.poll() is None:
                    continue
                running.remove((sh, proc))
                if proc.returncode != 0:
                    raise session.CosmicRayError(
                        f"cosmic-ray exec of share {sh.index} exited {proc.returncode} "
                        f"(log: {sh.log})"
                    )
            if progress and time.monotonic() - last_report >= 30:
                last_report = time.monotonic()
                _print_progress(shares)
            if deadline is not None and time.monotonic() >= deadline and (todo or running):
                return False
        return True
    finally:
        _stop(running, [sh for sh, _ in running])


def _start_exec(sh: Share, work: Path, env: dict[str, str]) -> subprocess.Popen:
    log = sh.log.open("a")
    try:
        return subprocess.Popen(
            [sys.executable, "-c", session.CR_MAIN, "exec", sh.config.name, sh.db.name],
            cwd=work,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    finally:
        log.close()


def _print_progress(shares: list[Share]) -> None:
    done = total = 0
    for sh in shares:
        try:
            pending = session.count_pending(sh.db)
            ran = session.count_run(sh.db)
        except Exception:  # noqa: BLE001 - a session being written; counted next time
            continue
        done += ran
        total += ran + pending
    print(f"mutate: {done}/{total} mutants run", file=sys.stderr)


def _stop(running: list[tuple[Share, subprocess.Popen]], shares: list[Share]) -> None:
    """Kill the running `exec`s, then every probe still running on their copies."""
    for _, proc in running:
        _kill_group(proc.pid)
        proc.wait()
    roots = [str(sh.sp.root) for sh in shares]
    if not roots:
        return
    for pid in _pids_naming(roots):
        _kill_group(pid)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(os.getpgid(pid), signal.SIGKILL)


def _pids_naming(needles: list[str]) -> list[int]:
    """Processes whose command line holds one of `needles` (Linux `/proc`; none elsewhere)."""
    found = []
    me = os.getpid()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(entry.name) != me and any(n in cmdline for n in needles):
            found.append(int(entry.name))
    return found
