"""The world's process group, its CP subgroups, and collectives that name absent peers.

`Comm.init` joins the rendezvous store (`group.open_store`), settles the
backend by census unless it was given as gloo (`backend.place`), and forms
the default process group in that store with the collective timeout.

Hangs: before each collective a rank writes a heartbeat (a sequence number and
a label) into the store. When a collective fails or times out, the rank reads
its peers' heartbeats and names the ranks that never reached it (`PeerError`).
A per-rank watchdog (`faulthandler`) ends a rank whose own code hangs.
"""

from __future__ import annotations

import contextlib
import faulthandler
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from .backend import Placement, place
from .group import PeerError, RankEnv, first_line, next_formation, open_store

_HEARTBEAT = "cpbt/heartbeat/"
_FLAG = "cpbt/flag/"


class Comm:
    """The world's process group, its CP subgroups, and collectives that name absent peers."""

    def __init__(self, env: RankEnv, backend: str, timeout: float, device: str = "auto") -> None:
        self.env = env
        self._device = device
        self.rank = env.rank
        self.world_size = env.world_size
        self.backend = backend  # "auto" until `init` settles it
        self.timeout = timeout
        self.placement: Placement | None = None  # the census's verdict, when one was taken
        self._seq = 0
        self.peer_lost = False  # a collective failed: see teardown_safe
        self._groups: dict[int, tuple[object, object, list[int]] | None] = {}
        self._store = None
        self._objects = None  # gloo group of the world for objects when the backend is NCCL
        self._owns_group = True

    # ------------------------------------------------------------ setup

    def init(self) -> None:
        try:
            store = open_store(self.env, self.timeout, next_formation())
        except (RuntimeError, ValueError) as e:
            raise self._formation_error(e) from None
        if self.backend in ("auto", "nccl"):
            self.placement = place(store, self.env, self.backend, self.timeout)
            self.backend = self.placement.backend
            if self.rank == 0 and self.placement.note:
                print(f"cp-blocktables: {self.placement.note}", flush=True)
        self._make_gpu_current()
        try:
            dist.init_process_group(
                self.backend,
                store=store,
                rank=self.rank,
                world_size=self.world_size,
                timeout=timedelta(seconds=self.timeout),
            )
        except (RuntimeError, ValueError) as e:
            raise self._formation_error(e) from None
        self._store = store
        if self.backend != "gloo":
            self._objects = dist.new_group(timeout=timedelta(seconds=self.timeout), backend="gloo")

    def _formation_error(self, e: BaseException) -> PeerError:
        return PeerError(
            f"rank {self.rank}: could not form the process group of "
            f"{self.world_size} ranks at {self.env.master_addr}:"
            f"{self.env.master_port} within {self.timeout:.0f} s: "
            f"{first_line(e)}"
        )

    def adopt(self) -> None:
        """Use the default process group that someone else formed (a test plugin, an engine).

        `close` then leaves it alone: its owner destroys it.
        """
        if not dist.is_initialized():
            raise PeerError(f"rank {self.rank}: no process group to adopt")
        self._owns_group = False
        self._make_gpu_current()
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
        """The rank's device: its own GPU under NCCL; under gloo the CPU, or a GPU shared
        round robin by the host's ranks with `device="cuda"`, or with `device="auto"`
        when the census chose gloo because the host has fewer GPUs than ranks.

        Even ranks name it with an index and odd ranks without: `cpu` and `cpu:0`,
        `cuda:N` and the bare `cuda` (with `N` made current). Engines name devices
        both ways, and tensors always report theirs with an index on a GPU and
        without one on the CPU, so an implementation that compares devices by
        their names refuses its own tables on one kind of rank."""
        gpu = self._gpu()
        if gpu is None:
            return torch.device("cpu", 0) if self.rank % 2 else torch.device("cpu")
        return torch.device("cuda") if self.rank % 2 else torch.device("cuda", gpu)

    def _gpu(self) -> int | None:
        """The index of the rank's GPU, or None when it runs on the CPU."""
        gpu = self.placement.host_index if self.placement else self.env.local_rank
        if self.backend == "nccl":
            return gpu
        shared = self.placement is not None and self.placement.shares_gpus
        if self._device == "cuda" or (self._device == "auto" and shared):
            return gpu % torch.cuda.device_count()
        return None

    def _make_gpu_current(self) -> None:
        """Make the rank's GPU current, before any tensor lands on the bare `cuda`."""
        gpu = self._gpu()
        if gpu is not None:
            torch.cuda.set_device(gpu)

    @property
    def backend_note(self) -> str:
        """Why ranks share GPUs, when the census made them ("" otherwise)."""
        return self.placement.note if self.placement else ""

    def cp_group(self, cp_size: int) -> tuple[object, object, list[int]] | None:
        """(tensor group, object group, global ranks) of this rank's CP group of `cp_size`;
        None for a rank past the last whole group.

        The world splits into `world_size // cp_size` groups of consecutive ranks, so a
        CP size that does not divide the world size (3 of 8) still runs, with the
        remaining ranks sitting it out. Every rank creates every CP group of that size
        (new_group is collective).
        """
        if cp_size not in self._groups:
            if cp_size > self.world_size:
                raise ValueError(f"cp_size {cp_size} exceeds world size {self.world_size}")
            mine = None
            whole = self.world_size - self.world_size % cp_size
            for start in range(0, whole, cp_size):
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
            return f"{head}: never reached by {', '.join(behind)}; {first_line(err)}"
        return f"{head}: every rank reached it, a peer died or hung inside it; {first_line(err)}"

    def _peer_heartbeat(self, rank: int) -> tuple[int | None, str]:
        key = f"{_HEARTBEAT}{rank}"
        try:
            if self._store is None or not self._store.check([key]):
                return None, ""
            seq, _, where = self._store.get(key).decode().partition("|")
            return int(seq), where
        except Exception:  # noqa: BLE001 - the store itself may be gone with its host
            return None, ""


def arm_watchdog(seconds: float) -> None:
    """End this process with all thread tracebacks if it makes no progress for `seconds`."""
    faulthandler.dump_traceback_later(seconds, exit=True)


def disarm_watchdog() -> None:
    faulthandler.cancel_dump_traceback_later()
