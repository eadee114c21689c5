"""One mutation run as several Cosmic Ray sessions (shares), run a few at a time, resumable.

Why: Cosmic Ray's `local` distributor runs one mutant at a time, and a mutant
costs a harness run of several seconds, so every mutant of the implementation
takes a day on one machine. Cosmic Ray mutates files in place, so two mutants
can only run at once on two copies: a run is split into `count` shares, each
a session of its own over a copy of its own (`share-K/src/`,
`share-K/session.sqlite`), and `--jobs` of them execute at once. Spread over a many-core host, and
stopped and resumed on another (`--time-limit`, `--resume`), the full run
fits in hours.

Invariants:

* A share is fixed by position, not by Cosmic Ray's random job ids: share
  `K` of `N` keeps the selected mutants whose place in the stable order
  (module, operator, occurrence) is `K` modulo `N`. So every selected mutant
  lies in exactly one share, and the split is the same on every machine.
* Sessions name the mutated files relative to their share's directory, where
  Cosmic Ray runs: every share names the same files, so one `cosmic-ray init`
  serves all (its session is copied, then split), and a work directory moves
  between machines (copy it, then `--resume`).
* A session records a mutant's result only when its run ends. Stopping a run
  loses the mutants in flight, which stay pending, and may leave a copy
  mutated: `--resume` copies the pristine implementation again before it runs
  what is pending.
* Every process a run starts is gone when it returns: on the time limit, on
  Ctrl-C and on SIGTERM (`timeout`, `kill`, a CI runner cancelling the job) the
  `exec` processes and the probes they started (each in a session of its own,
  found by the copy's path on its command line) are killed.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from . import session
from .scratch import ScratchPackage, build_scratch


@dataclass(frozen=True)
class Share:
    """One Cosmic Ray session: its directory (where Cosmic Ray runs), copy, config,
    sqlite file and `exec` log."""

    index: int
    home: Path
    sp: ScratchPackage

    @property
    def config(self) -> Path:
        return self.home / "cosmic-ray.toml"

    @property
    def db(self) -> Path:
        return self.home / "session.sqlite"

    @property
    def log(self) -> Path:
        return self.home / "exec.log"


def _share_dir(work: Path, index: int) -> Path:
    return work / f"share-{index}"


def _home(work: Path, index: int, count: int) -> Path:
    return work if count == 1 else _share_dir(work, index)


def build(work: Path, source_dir: Path, count: int) -> list[Share]:
    """`count` shares in `work`, each with a fresh copy of the implementation."""
    shares = []
    for k in range(count):
        home = _home(work, k, count)
        shares.append(Share(k, home, build_scratch(home / "src", source_dir)))
    return shares


def existing_count(work: Path) -> int:
    """How many shares the sessions in `work` were split into (0: none)."""
    if (work / "session.sqlite").is_file():
        return 1
    n = 0
    while (_share_dir(work, n) / "session.sqlite").is_file():
        n += 1
    return n


def split(shares: list[Share], jobs: int) -> int:
    """Copy share 0's session to every other share, then keep in each only its part
    (`jobs` at a time). Returns how many mutants stay pending in all."""
    for sh in shares[1:]:
        shutil.copyfile(shares[0].db, sh.db)
    if len(shares) == 1:
        return session.count_pending(shares[0].db)
    args = [(sh.db, sh.index, len(shares)) for sh in shares]
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(jobs, len(shares)), mp_context=ctx) as pool:
        return sum(pool.map(_keep_share, *zip(*args)))


def _keep_share(db: Path, index: int, count: int) -> int:
    """Keep pending the mutants at positions `index` modulo `count` of the stable order of
    the pending ones; mark the rest skipped. Returns how many stay pending."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    with use_db(str(db), WorkDB.Mode.open) as wdb:
        items = sorted(wdb.pending_work_items, key=session.stable_key)
        others = [x.job_id for i, x in enumerate(items) if i % count != index]
        wdb.set_multiple_results(others, WorkResult(worker_outcome=WorkerOutcome.SKIPPED))
    return len(items) - len(others)


def execute(
    shares: list[Share],
    env: dict[str, str],
    jobs: int,
    progress: bool,
    time_limit: float | None,
) -> bool:
    """`cosmic-ray exec` of every share with pending mutants, `jobs` at a time.

    Returns False when the time limit stopped the run (what was in flight stays
    pending); raises `CosmicRayError` when an `exec` fails. Under `sigterm_unwinds`
    a SIGTERM stops it like Ctrl-C, every process it started killed.
    """
    deadline = None if time_limit is None else time.monotonic() + max(0.0, time_limit)
    todo = [sh for sh in shares if session.count_pending(sh.db)]
    running: list[tuple[Share, subprocess.Popen]] = []
    last_report = time.monotonic()
    try:
        while todo or running:
            while todo and len(running) < jobs:
                sh = todo.pop(0)
                running.append((sh, _start_exec(sh, env)))
            time.sleep(0.5)
            if _stop_signal:  # caught where raising was lost (a weakref callback, say)
                raise KeyboardInterrupt(f"signal {_stop_signal[0]}")
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


_stop_signal: list[int] = []
"""The signal `sigterm_unwinds` caught, if any: `execute` raises again on its next poll."""


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """Inside, SIGTERM raises `KeyboardInterrupt` as Ctrl-C does, so that `finally`
    blocks still stop every process the run started (by default SIGTERM ends
    Python at once, its children left running).

    The signal is also remembered: a handler's exception raised inside a weakref
    callback or a `__del__` is printed and dropped by Python, and `execute`, which
    polls every half second, raises it again."""

    def _unwind(signum: int, frame: object) -> None:
        _stop_signal.append(signum)
        raise KeyboardInterrupt(f"signal {signum}")

    _stop_signal.clear()

    try:
        previous = signal.signal(signal.SIGTERM, _unwind)
    except ValueError:  # not the main thread: signals cannot be caught there
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _start_exec(sh: Share, env: dict[str, str]) -> subprocess.Popen:
    log = sh.log.open("a")
    try:
        return subprocess.Popen(
            [sys.executable, "-c", session.CR_MAIN, "exec", sh.config.name, sh.db.name],
            cwd=sh.home,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    finally:
        log.close()


def _print_progress(shares: list[Share]) -> None:
    pending = 0
    for sh in shares:
        try:
            pending += session.count_pending(sh.db)
        except Exception:  # noqa: BLE001 - a session being written; counted next time
            continue
    print(f"mutate: {pending} mutants still to run", file=sys.stderr)


def _stop(running: list[tuple[Share, subprocess.Popen]], shares: list[Share]) -> None:
    """Kill the running `exec`s, then every probe still running on their copies."""
    for _, proc in running:
        _kill_group(proc.pid)
        proc.wait()
    roots = [str(sh.sp.root) for sh in shares]
    for _ in range(2):  # again after a moment: a probe forked just before has exec'd by then
        for pid in _pids_naming(roots) if roots else []:
            _kill_group(pid)
        time.sleep(0.2)


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
