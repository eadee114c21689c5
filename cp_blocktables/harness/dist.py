"""Process groups for the harness: join torchrun, or spawn the ranks locally.

Joining: torchrun (or anything that sets the same variables) gives `RANK`,
`WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`/`MASTER_PORT`
and the `TORCHELASTIC_*` variables; `init_from_env` builds the default
process group from them with a collective timeout. Backend: NCCL when every
local rank has its own GPU, else gloo.

Spawning: `spawn_local` forks `world_size` ranks of the current process (the
parent has already imported torch, so a rank starts in milliseconds), hosts
the rendezvous store itself as torchrun's agent does, sets the same
environment torchrun sets, waits, and kills every rank that is still alive
once one has failed and the others have had the collective timeout to notice.
Every child is gone when it returns.

Hangs: before each collective a rank writes a heartbeat (a sequence number and
a label) into the store. When a collective fails or times out, the rank reads
its peers' heartbeats and names the ranks that never reached it (`PeerError`).
A per-rank watchdog (`faulthandler`) ends a rank whose own code hangs.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import itertools
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

_HEARTBEAT = "cpbt/heartbeat/"
_FLAG = "cpbt/flag/"


class PeerError(RuntimeError):
    """A collective failed: a peer died, hung, or never arrived. The message names it."""


@dataclass(frozen=True)
class RankEnv:
    """What torchrun tells a rank about its place in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int

    @staticmethod
    def from_environ(environ: dict[str, str] | None = None) -> RankEnv | None:
        """The torchrun environment, or None when this process was not started by one."""
        env = os.environ if environ is None else environ
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return None
        try:
            return RankEnv(
                rank=int(env["RANK"]),
                world_size=int(env["WORLD_SIZE"]),
                local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
                local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
                master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                master_port=int(env.get("MASTER_PORT", "29500")),
            )
        except ValueError as e:
            raise ValueError(f"malformed torchrun environment: {e}") from None


def choose_backend(requested: str, env: RankEnv) -> str:
    """`nccl` when every local rank has its own GPU, else `gloo`; `requested` wins unless auto."""
    if requested != "auto":
        return requested
    if torch.cuda.is_available() and torch.cuda.device_count() >= env.local_world_size:
        return "nccl"
    return "gloo"


class Comm:
    """The world's process group, its CP subgroups, and collectives that name absent peers."""

    def __init__(self, env: RankEnv, backend: str, timeout: float, device: str = "auto") -> None:
        self.env = env
        self._device = device
        self.rank = env.rank
        self.world_size = env.world_size
        self.backend = backend
        self.timeout = timeout
        self._seq = 0
        self.peer_lost = False  # a collective failed: see teardown_safe
        self._groups: dict[int, tuple[object, object, list[int]]] = {}
        self._store = None
        self._objects = None  # gloo group of the world for objects when the backend is NCCL
        self._owns_group = True

    # ------------------------------------------------------------ setup

    def init(self) -> None:
        if self.backend == "nccl" or self._device == "cuda":
            torch.cuda.set_device(self.device)
        try:
            store = _store_of_restart(self.env, self.timeout)
            dist.init_process_group(
                self.backend,
                init_method=None if store is not None else "env://",
                store=store,
                rank=self.rank,
                world_size=self.world_size,
                timeout=timedelta(seconds=self.timeout),
            )
        except (RuntimeError, ValueError) as e:
            raise PeerError(
                f"rank {self.rank}: could not form the process group of "
                f"{self.world_size} ranks at {self.env.master_addr}:"
                f"{self.env.master_port} within {self.timeout:.0f} s: "
                f"{_first_line(e)}"
            ) from None
        with contextlib.suppress(Exception):
            self._store = dist.distributed_c10d._get_default_store()
        if self.backend != "gloo":
            self._objects = dist.new_group(timeout=timedelta(seconds=self.timeout), backend="gloo")

    def adopt(self) -> None:
        """Use the default process group that someone else formed (a test plugin, an engine).

        `close` then leaves it alone: its owner destroys it.
        """
        if not dist.is_initialized():
            raise PeerError(f"rank {self.rank}: no process group to adopt")
        self._owns_group = False
        with contextlib.suppress(Exception):
            self._store = dist.distributed_c10d._get_default_store()
        if self.backend != "gloo":
            self._objects = dist.new_group(timeout=timedelta(seconds=self.timeout), backend="gloo")

    def close(self) -> None:
        """Destroy the process group, unless NCCL lost a peer (see `teardown_safe`)."""
        if dist.is_initialized() and self._owns_group and self.teardown_safe:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()

    @property
    def teardown_safe(self) -> bool:
        """Whether destroying process groups cannot hang: after a lost peer NCCL's
        destroy waits on it (seen on two H200s), so the process's exit frees them
        instead. Gloo must still be destroyed: its groups abort the process at
        exit while an operation with the lost peer is pending."""
        return not (self.peer_lost and self.backend == "nccl")

    @property
    def device(self) -> torch.device:
        """The rank's device: its own GPU under NCCL; under gloo the CPU, or with
        `device="cuda"` a GPU shared round robin by the node's ranks."""
        if self.backend == "nccl":
            return torch.device("cuda", self.env.local_rank)
        if self._device == "cuda":
            return torch.device("cuda", self.env.local_rank % torch.cuda.device_count())
        return torch.device("cpu")

    def cp_group(self, cp_size: int) -> tuple[object, object, list[int]]:
        """(tensor group, object group, global ranks) of this rank's CP group of `cp_size`.

        Every rank creates every CP group of that size (new_group is collective).
        """
        if cp_size not in self._groups:
            if self.world_size % cp_size:
                raise ValueError(f"cp_size {cp_size} does not divide world size {self.world_size}")
            mine = None
            for start in range(0, self.world_size, cp_size):
                ranks = list(range(start, start + cp_size))
                if cp_size == self.world_size:
                    groups = (None, self._objects)
                else:
                    t = dist.new_group(ranks, timeout=timedelta(seconds=self.timeout))
                    o = (
                        t
                        if self.backend == "gloo"
                        else dist.new_group(
                            ranks, timeout=timedelta(seconds=self.timeout), backend="gloo"
                        )
                    )
                    groups = (t, o)
                if self.rank in ranks:
                    mine = (*groups, ranks)
            self._groups[cp_size] = mine
        return self._groups[cp_size]

    # ------------------------------------------------------------ collectives

    def all_gather_object(
        self, obj: object, label: str, group: object = None, ranks: list[int] | None = None
    ) -> list:
        """Every rank's `obj`, in rank order; `PeerError` naming absent ranks on failure.

        Objects always travel over gloo (a host-side group under NCCL), so that
        a lost peer surfaces as a timeout here rather than as an NCCL abort.
        """
        size = len(ranks) if ranks is not None else self.world_size
        out = [None] * size
        group = group if group is not None else self._objects
        self._collective(label, ranks, lambda: dist.all_gather_object(out, obj, group=group))
        return out

    def gather_tensor(
        self, t: torch.Tensor, label: str, dst: int, group: object, ranks: list[int]
    ) -> list[torch.Tensor] | None:
        """`t` of every rank on global rank `dst` (others get None)."""
        parts = [torch.empty_like(t) for _ in ranks] if self.rank == dst else None
        self._collective(label, ranks, lambda: dist.gather(t, parts, dst=dst, group=group))
        return parts

    def publish(self, key: str) -> None:
        """Set `key` in the rendezvous store, with this rank's collective count as its value."""
        if self._store is not None:
            self._store.set(f"{_FLAG}{key}", str(self._seq))

    def wait_for(self, key: str, watched: list[int], what: str) -> None:
        """Block until a rank `publish`es `key`, while the `watched` ranks make progress.

        Progress is a change in any watched rank's heartbeat; none for `timeout`
        seconds raises `PeerError` naming where each watched rank was last seen.
        Afterwards this rank's collective count is at least the publisher's, so
        that heartbeats compare across ranks that sat out some collectives.
        """
        if self._store is None:
            return
        flag, seen, since = f"{_FLAG}{key}", None, time.monotonic()
        while not self._store.check([flag]):
            beats = [self._peer_heartbeat(r) for r in watched]
            if beats != seen:
                seen, since = beats, time.monotonic()
            elif time.monotonic() - since > self.timeout:
                where = ", ".join(
                    f"rank {r} (last seen at collective #{s}: {w})"
                    if s is not None
                    else f"rank {r} (no heartbeat)"
                    for r, (s, w) in zip(watched, beats)
                )
                raise PeerError(
                    f"rank {self.rank}: waiting for {what}: no progress for "
                    f"{self.timeout:.0f} s from {where}"
                )
            time.sleep(0.1)
        self._seq = max(self._seq, int(self._store.get(flag).decode()))

    def _collective(self, label: str, ranks: list[int] | None, fn: Callable[[], object]) -> None:
        self._seq += 1
        self._beat(label)
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - gloo/nccl raise several types for a lost peer
            self.peer_lost = True
            raise PeerError(self._explain(label, ranks, e)) from None

    def _beat(self, label: str) -> None:
        if self._store is not None:
            with contextlib.suppress(Exception):
                self._store.set(f"{_HEARTBEAT}{self.rank}", f"{self._seq}|{label}")

    def _explain(self, label: str, ranks: list[int] | None, err: Exception) -> str:
        ranks = ranks if ranks is not None else list(range(self.world_size))
        head = (
            f"rank {self.rank}: collective #{self._seq} ({label}) failed after at most "
            f"{self.timeout:.0f} s"
        )
        behind = []
        for r in ranks:
            seq, where = self._peer_heartbeat(r)
            if seq is None:
                behind.append(f"rank {r} (no heartbeat)")
            elif seq < self._seq:
                behind.append(f"rank {r} (last seen at collective #{seq}: {where})")
        if behind:
            return f"{head}: never reached by {', '.join(behind)}; {_first_line(err)}"
        return f"{head}: every rank reached it, a peer died or hung inside it; {_first_line(err)}"

    def _peer_heartbeat(self, rank: int) -> tuple[int | None, str]:
        key = f"{_HEARTBEAT}{rank}"
        try:
            if self._store is None or not self._store.check([key]):
                return None, ""
            seq, _, where = self._store.get(key).decode().partition("|")
            return int(seq), where
        except Exception:  # noqa: BLE001 - the store itself may be gone with its host
            return None, ""


_formations = itertools.count()


def _store_of_restart(env: RankEnv, timeout: float):
    """A store of this process group's own when it is not the job's first; else None.

    A group restarted by torchrun, or formed again in the same process (one
    `bench harness` run per preset), joins the agent's store again, where the
    group before left its ranks' addresses under the same keys: gloo would
    connect to dead ranks. A prefix per torchrun attempt and per formation
    keeps each group's keys apart. Every rank forms its groups in the same
    order, so the prefixes agree.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    formation = next(_formations)
    if (attempt, formation) == (0, 0) or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(
        env.master_addr,
        env.master_port,
        env.world_size,
        is_master=False,
        timeout=timedelta(seconds=timeout),
    )
    return dist.PrefixStore(f"cpbt/attempt{attempt}/group{formation}/", store)


def arm_watchdog(seconds: float) -> None:
    """End this process with all thread tracebacks if it makes no progress for `seconds`."""
    faulthandler.dump_traceback_later(seconds, exit=True)


def disarm_watchdog() -> None:
    faulthandler.cancel_dump_traceback_later()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


# ---------------------------------------------------------------- local spawn


def spawn_local(world_size: int, rank_main: Callable[[], int], timeout: float) -> int:
    """Fork `world_size` ranks that each run `rank_main()` under a torchrun-like environment.

    Returns rank 0's exit code, or 1 when any rank failed or had to be killed.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    ctx = multiprocessing.get_context("fork")
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
    procs = [
        ctx.Process(
            target=_child,
            args=(r, world_size, pipes[r][0], rank_main),
            name=f"cp-blocktables-rank{r}",
        )
        for r in range(world_size)
    ]
    store = None
    try:
        for p in procs:
            p.start()
        store = dist.TCPStore(
            "127.0.0.1",
            0,
            world_size,
            is_master=True,
            timeout=timedelta(seconds=timeout),
            wait_for_workers=False,
        )
        for _, send in pipes:
            send.send(store.port)
        return _wait(procs, timeout)
    finally:
        _reap(procs)
        del store


def _child(rank: int, world_size: int, port_pipe, rank_main: Callable[[], int]) -> None:
    _die_with_parent()
    port = port_pipe.recv()
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "GROUP_RANK": "0",
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(world_size),
            "ROLE_NAME": "default",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": f"cp-blocktables-{os.getppid()}",
            "OMP_NUM_THREADS": "1",
        }
    )
    torch.set_num_threads(1)
    code = rank_main()
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def _die_with_parent() -> None:
    """Linux: the kernel kills this rank if the spawning process dies first."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _wait(procs: list, timeout: float) -> int:
    """Wait for every rank; once one failed, give the rest a grace period, then kill them.

    A rank that failed cleanly (exit 1 or 2) has printed its diagnosis, and
    the peers it waited on are hung: 5 s. A rank that crashed has not, and its
    peers need up to the collective timeout to notice and say so.
    """
    failed_at, grace = None, 0.0
    while True:
        codes = [p.exitcode for p in procs]
        if all(c is not None for c in codes):
            break
        bad = [c for c in codes if c not in (None, 0)]
        if bad and failed_at is None:
            failed_at = time.monotonic()
            grace = 5.0 if all(c in (1, 2) for c in bad) else timeout + 5.0
        if failed_at is not None and time.monotonic() - failed_at > grace:
            alive = [r for r, c in enumerate(codes) if c is None]
            print(
                f"cp-blocktables: killing ranks {alive}: still running {grace:.0f} s after "
                f"another rank failed",
                file=sys.stderr,
                flush=True,
            )
            _reap(procs)
            codes = [p.exitcode for p in procs]
            break
        time.sleep(0.05)
    for r, c in enumerate(codes):
        if c not in (0, 1, 2):
            why = f"signal {-c}" if c is not None and c < 0 else f"exit code {c}"
            print(f"cp-blocktables: rank {r} ended abnormally ({why})", file=sys.stderr, flush=True)
    if codes[0] in (0, 1, 2) and all(c in (0, 1, 2) for c in codes):
        worst = max(codes)
        return codes[0] if codes[0] == worst else 1
    return 1


def _reap(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
