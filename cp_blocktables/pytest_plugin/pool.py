"""Pools of rank processes that run multi-rank test bodies, reused while they stay healthy.

Starting N processes that each import torch costs seconds; running a test body on
processes that are already in a process group costs milliseconds. A `RankPool` is N
`worker` processes sharing one process group, forked from a fork server that
imported torch once (or spawned); `pool_runner.PoolCache` keeps pools by `PoolKey`
(world size, backend, device) between tests.

Invariants:
- a pool is reused only after a test in which every rank answered and none failed, and
  only after a health check (every rank alive, one all-reduce) passes;
- any other ending (a failure, a timeout, a dead rank, uneven skips) tears the pool down
  by killing its processes: nothing is sent to them, so no collective runs after a failure;
- every wait has a deadline, and a rank still running at its deadline has its Python
  stacks dumped (faulthandler) before it is killed;
- `kill` and `close` return within a few seconds and leave no process behind.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import time
import weakref
from dataclasses import dataclass, field

from . import worker
from .protocol import ORPHAN_WATCH_FRAME, STACK_SIGNAL, Outcome, Task, WorkerSpec, pool_file

START_TIMEOUT_S = 180.0
"""Longest wait for N fresh processes to import torch and join their process group."""

HEALTH_TIMEOUT_S = 10.0
"""Longest wait for a reused pool's health check."""

STACK_WAIT_S = 2.0
"""Longest wait for a signalled rank to finish writing its stack dump."""

_PG_TIMEOUT_S = 24 * 3600.0


def default_start_method() -> str:
    """ "forkserver" where the platform has it, else "spawn"; never plain "fork".

    The fork server is a fresh interpreter that only imports torch (no threads of its
    own, no CUDA, no collectives), so forking ranks from it is safe and saves each rank
    the seconds of importing torch; forking the pytest process itself would not be.
    """
    methods = multiprocessing.get_all_start_methods()
    return "forkserver" if "forkserver" in methods else "spawn"


@dataclass(frozen=True)
class PoolKey:
    """What makes two multi-rank tests able to share rank processes."""

    world_size: int
    backend: str
    device: str


@dataclass
class RunResult:
    """Every rank's outcome of one test, plus what the ranks printed and their stacks."""

    outcomes: list[Outcome]
    stdout: dict[int, str] = field(default_factory=dict)
    stderr: dict[int, str] = field(default_factory=dict)
    stacks: dict[int, str] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        """True when the pool may serve another test: every rank ended the same quiet way."""
        statuses = {o.status for o in self.outcomes}
        return len(statuses) == 1 and statuses <= {"passed", "skipped", "xfailed"}


class PoolStartError(RuntimeError):
    """The rank processes could not be started or could not form their process group."""


class RankPool:
    """N rank processes in one process group, serving one test at a time."""

    def __init__(self, key: PoolKey, capture: bool = True, start_method: str | None = None):
        """Launch the rank processes; they import torch and rendezvous on their own."""
        self.key = key
        self.start_method = start_method or default_start_method()
        self.dir = tempfile.mkdtemp(prefix=f"cpbt-ranks{key.world_size}-")
        self.ready = False
        self._procs: list = []
        self._conns: list = []
        _LIVE.add(self)
        try:
            self._launch(capture)
        except BaseException:
            self.kill()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _launch(self, capture: bool) -> None:
        ctx = multiprocessing.get_context(self.start_method)
        if self.start_method == "forkserver":
            ctx.set_forkserver_preload([worker.__name__])
        n = self.key.world_size
        for rank in range(n):
            for kind in ("stdout", "stderr", "stack"):
                open(pool_file(self.dir, kind, rank), "wb").close()
            spec = WorkerSpec(
                rank, n, self.key.backend, self.key.device, self.dir, capture, _PG_TIMEOUT_S
            )
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(
                target=worker.main, args=(child_end, _owner_pipe(), spec), name=f"rank{rank}"
            )
            proc.start()
            child_end.close()
            self._procs.append(proc)
            self._conns.append(parent_end)

    def wait_ready(self) -> None:
        """Block until every rank joined the process group; `PoolStartError` if one cannot."""
        if self.ready:
            return
        n = self.key.world_size
        replies = self._gather(range(n), START_TIMEOUT_S)
        problems = [
            f"rank {r}: {reply}" for r, reply in sorted(replies.items()) if reply[0] != "ready"
        ]
        missing = sorted(set(range(n)) - set(replies))
        if missing:
            problems.append(f"ranks {missing} did not join within {START_TIMEOUT_S:.0f} s")
        if problems:
            tails = "\n".join(
                f"--- rank {r} stderr ---\n{_read(pool_file(self.dir, 'stderr', r))[-4000:]}"
                for r in range(n)
            )
            raise PoolStartError(
                f"could not start {n} rank processes ({self.key.backend}, {self.key.device}):\n"
                + "\n".join(problems)
                + "\n"
                + tails
            )
        self.ready = True

    def _gather(self, ranks, timeout_s: float) -> dict[int, tuple]:
        """Collect one reply per rank until the deadline; a dead rank replies ('died', code)."""
        deadline = time.monotonic() + timeout_s
        pending = set(ranks)
        replies: dict[int, tuple] = {}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            waitables = {self._conns[r]: r for r in pending}
            waitables.update({self._procs[r].sentinel: r for r in pending})
            for ready in multiprocessing.connection.wait(list(waitables), timeout=left):
                rank = waitables[ready]
                if rank in pending:
                    replies[rank] = self._receive(rank)
                    pending.discard(rank)
        return replies

    def _receive(self, rank: int) -> tuple:
        conn = self._conns[rank]
        try:
            if conn.poll():
                return conn.recv()
        except (EOFError, OSError):
            pass
        proc = self._procs[rank]
        proc.join(1.0)
        return ("died", proc.exitcode)

    def healthy(self) -> bool:
        """Every rank alive and one all-reduce over the group gives the world size."""
        if not all(p.is_alive() for p in self._procs):
            return False
        try:
            for conn in self._conns:
                conn.send(("ping", None))
        except OSError:
            return False
        replies = self._gather(range(self.key.world_size), HEALTH_TIMEOUT_S)
        return len(replies) == self.key.world_size and all(
            reply == ("pong", None) for reply in replies.values()
        )

    def run(self, task: Task, timeout_s: float, grace_s: float) -> RunResult:
        """Run `task` on every rank; bounded by `timeout_s`, and by `grace_s` after a failure.

        A rank still running when the bound passes has its stack dumped and is reported
        as "timeout" (the test's time ran out) or "stopped" (another rank had failed);
        the caller must then `kill` the pool.
        """
        n = self.key.world_size
        for conn in self._conns:
            conn.send(("run", task))
        deadline = time.monotonic() + timeout_s
        bound = deadline
        outcomes: dict[int, Outcome] = {}
        while len(outcomes) < n:
            pending = [r for r in range(n) if r not in outcomes]
            replies = self._gather_first(pending, bound)
            if not replies:
                break
            outcomes.update(replies)
            if any(o.status in ("failed", "died") for o in replies.values()):
                bound = min(bound, time.monotonic() + grace_s)
        timed_out = len(outcomes) < n and bound == deadline
        late = [r for r in range(n) if r not in outcomes]
        stacks = self._dump_stacks(late)
        for r in late:
            outcomes[r] = Outcome(r, "timeout" if timed_out else "stopped")
        return RunResult(
            outcomes=[outcomes[r] for r in range(n)],
            stdout={r: _read(pool_file(self.dir, "stdout", r)) for r in range(n)},
            stderr={r: _read(pool_file(self.dir, "stderr", r)) for r in range(n)},
            stacks=stacks,
        )

    def _gather_first(self, pending: list[int], bound: float) -> dict[int, Outcome]:
        """Wait until at least one pending rank answers or dies, or `bound` passes."""
        left = bound - time.monotonic()
        if left <= 0:
            return {}
        waitables = {self._conns[r]: r for r in pending}
        waitables.update({self._procs[r].sentinel: r for r in pending})
        got: dict[int, Outcome] = {}
        for ready in multiprocessing.connection.wait(list(waitables), timeout=left):
            rank = waitables[ready]
            if rank in got:
                continue
            reply = self._receive(rank)
            if reply[0] == "result":
                got[rank] = reply[1]
            else:
                stack = self._stack(rank)
                got[rank] = Outcome(
                    rank, "died", message=_exit_text(reply[1]), extra={"stack": stack}
                )
        return got

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask each live rank in `ranks` to write its Python stacks; return what they wrote."""
        live = [r for r in ranks if self._procs[r].is_alive()]
        if not live:
            return {}
        if STACK_SIGNAL is None:
            return {r: "(no stack: this platform has no SIGUSR1)" for r in live}
        for r in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._procs[r].pid, STACK_SIGNAL)
        deadline = time.monotonic() + STACK_WAIT_S
        sizes = {r: -1 for r in live}
        while time.monotonic() < deadline and live:
            time.sleep(0.05)
            for r in list(live):
                size = _size(pool_file(self.dir, "stack", r))
                if size > 0 and size == sizes[r]:
                    live.remove(r)
                sizes[r] = size
        return {r: self._stack(r) or "(no stack written)" for r in sizes}

    def _stack(self, rank: int) -> str:
        """The rank's stack dump without the worker's own orphan-watch thread."""
        text = _read(pool_file(self.dir, "stack", rank))
        blocks = text.split("\n\n")
        kept = [b for b in blocks if ORPHAN_WATCH_FRAME not in b]
        return "\n\n".join(kept)

    def request_stop(self) -> None:
        """Ask every rank to leave the process group and exit (used on healthy pools only)."""
        if not self.ready:
            return
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(("stop", None))

    def close(self, deadline: float | None = None) -> None:
        """Stop a healthy pool: ask, wait until `deadline` (monotonic), then kill the rest."""
        if not self.ready:
            self.kill()
            return
        self.request_stop()
        deadline = time.monotonic() + 2.0 if deadline is None else deadline
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Kill every rank process now and remove the pool's files; no message is sent."""
        for proc in self._procs:
            if proc.is_alive():
                try:
                    os.kill(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, AttributeError):
                    proc.kill()
        for proc in self._procs:
            proc.join(5.0)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []
        shutil.rmtree(self.dir, ignore_errors=True)
        _LIVE.discard(self)


_LIVE: weakref.WeakSet[RankPool] = weakref.WeakSet()
_OWNER: list = []


def _owner_pipe():
    """Read end of a pipe that only this process writes to, kept open for its lifetime.

    Ranks watch it: end-of-file means this process is gone (even by SIGKILL), and they
    exit. Their parent pid cannot tell, since a fork server outlives us while it has
    children.
    """
    if not _OWNER:
        _OWNER.extend(multiprocessing.Pipe(duplex=False))
    return _OWNER[0]


@atexit.register
def _kill_leftovers() -> None:
    """Kill pools nobody closed, before multiprocessing's own exit hook joins (and waits on)
    their processes."""
    for pool in list(_LIVE):
        pool.kill()


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _exit_text(code: int | None) -> str:
    if code is None:
        return "process died (exit code unknown)"
    if code < 0:
        try:
            return f"process killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"process killed by signal {-code}"
    return f"process exited with code {code}"
