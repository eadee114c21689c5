"""Choosing the collective backend: NCCL only when every rank of every host has a GPU
of its own, decided from a census of the whole job, the same on every rank.

`LOCAL_WORLD_SIZE` counts the ranks of one torchrun agent, not of the host:
two agents on one host (two "nodes" of a test, or two jobs' worth of ranks)
each see `LOCAL_WORLD_SIZE=2`, and on a host of two GPUs NCCL then puts two
ranks on one GPU and dies with `invalid usage`. So before the group is formed
each rank writes its seat (host name, boot id, visible GPUs) into the
rendezvous store, waits for every other rank's seat (within the collective
timeout, naming the ranks that never wrote one), and computes the same
`Placement` from the same census:

* `auto`: NCCL when on every host the ranks there number at most the GPUs
  each of them sees; otherwise gloo, and where a host has GPUs its ranks
  share them round robin (the report says so).
* `nccl` where that does not hold: `BackendUsageError` (exit 2), naming the
  host, its ranks and its GPUs, before any collective.
* `gloo`: no census; it runs anywhere.

A rank's GPU is its index among the ranks of its host (by global rank), not
`LOCAL_RANK`, which two agents on one host would both count from 0.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch

from ..cli_base import UsageError
from .group import PeerError, RankEnv

_CENSUS = "cpbt/census/"


class BackendUsageError(UsageError):
    """`--backend nccl` where some rank would share a GPU: exit 2 before any collective."""


def choose_backend(requested: str, env: RankEnv) -> str:
    """The backend a rank asks for before the census: `gloo` and `nccl` as given; `auto`
    stays `auto` and is settled by `Comm.init` from the census of every rank."""
    del env  # the local view cannot see a second agent on the same host
    return requested


@dataclass(frozen=True)
class Seat:
    """What one rank tells the others: where it runs and how many GPUs it sees."""

    host: str
    boot_id: str
    gpus: int

    @property
    def key(self) -> tuple[str, str]:
        return (self.host, self.boot_id)


@dataclass(frozen=True)
class Placement:
    """The census's verdict for one rank; every rank derives it from the same seats."""

    backend: str
    host: str
    host_index: int  # this rank's index among the ranks of its host: its GPU
    ranks_on_host: int
    gpus: int  # GPUs this rank sees
    note: str = ""  # why ranks share GPUs, when they do

    @property
    def shares_gpus(self) -> bool:
        return self.backend == "gloo" and self.gpus > 0


def visible_gpus() -> int:
    """GPUs this process sees, counted through NVML: CUDA is not initialised."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def my_seat() -> Seat:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return Seat(socket.gethostname(), boot, visible_gpus())


def decide(requested: str, seats: list[Seat], rank: int) -> Placement:
    """The placement of `rank` given every rank's seat (a pure function of the census)."""
    hosts: dict[tuple[str, str], list[int]] = {}
    for r, s in enumerate(seats):
        hosts.setdefault(s.key, []).append(r)
    crowded = [
        (s, len(hosts[s.key])) for s in seats if len(hosts[s.key]) > s.gpus
    ]  # seats of ranks that would not have a GPU of their own
    mine = seats[rank]
    on_host = hosts[mine.key]
    if requested == "nccl" and crowded:
        s, n = crowded[0]
        fewer = f" or at most {s.gpus} ranks per host" if s.gpus else ""
        raise BackendUsageError(
            f"--backend nccl needs a GPU per rank: host {s.host} runs {n} ranks "
            f"(local world size {n}) but sees {s.gpus} GPU{'s' if s.gpus != 1 else ''}; "
            f"use --backend gloo (ranks share GPUs){fewer}"
        )
    backend = "gloo" if crowded else "nccl"
    note = ""
    if backend == "gloo" and mine.gpus > 0:
        s, n = crowded[0]
        note = (
            f"backend gloo: host {s.host} runs {n} ranks on {s.gpus} "
            f"GPU{'s' if s.gpus != 1 else ''}, so ranks share GPUs round robin "
            f"(NCCL needs a GPU per rank)"
        )
    return Placement(backend, mine.host, on_host.index(rank), len(on_host), mine.gpus, note)


def census(store, rank: int, world_size: int, seat: Seat, timeout: float) -> list[Seat]:
    """Every rank's seat, in rank order: publish ours, wait for the others'.

    A rank that never publishes is named within `timeout` (`PeerError`).
    """
    store.set(f"{_CENSUS}{rank}", json.dumps(asdict(seat)))
    keys = [f"{_CENSUS}{r}" for r in range(world_size)]
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except Exception:  # noqa: BLE001 - a timeout, or the store gone with its host
        missing = []
        for r, k in enumerate(keys):
            try:
                if not store.check([k]):
                    missing.append(r)
            except Exception:  # noqa: BLE001
                missing.append(r)
        if not missing:  # every seat arrived as the wait gave up
            return [Seat(**json.loads(store.get(k).decode())) for k in keys]
        raise PeerError(
            f"rank {rank}: choosing the backend (every rank's host and GPUs) failed after "
            f"at most {timeout:.0f} s: never reached by "
            + ", ".join(f"rank {r} (no seat in the census)" for r in missing)
        ) from None
    return [Seat(**json.loads(store.get(k).decode())) for k in keys]


def place(store, env: RankEnv, requested: str, timeout: float) -> Placement:
    """This rank's placement, agreed by census with every other rank."""
    return decide(requested, census(store, env.rank, env.world_size, my_seat(), timeout), env.rank)
