"""Forming the process group: where a rank is (`RankEnv`), the rendezvous store it
joins, and `PeerError`, what every failure to reach a peer raises.

torchrun (or anything that sets the same variables) gives `RANK`,
`WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`/`MASTER_PORT`
and the `TORCHELASTIC_*` variables. `open_store` joins the rendezvous store
they name exactly as `init_process_group("env://")` would, so that the ranks
can agree on a backend (`backend.py`) before the group is formed in that same
store.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist


class PeerError(RuntimeError):
    """A collective failed: a peer died, hung, or never arrived. The message names it."""


def end_after_peer_failure(e: PeerError) -> int:
    """Print `e` and give exit code 1; under torchrun, only once the next whole second began.

    torchrun names as the root cause the failure of the smallest timestamp, in whole
    seconds, ties going to the lowest rank. A rank that ends because a peer failed would
    often share that peer's second and be named in its place.
    """
    print(f"cp-blocktables: {e}", file=sys.stderr, flush=True)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        time.sleep(1.5 - time.time() % 1.0)
    return 1


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


_formations = itertools.count()


def next_formation() -> int:
    """The index of this process's next process group (0 for its first)."""
    return next(_formations)


def open_store(env: RankEnv, timeout: float, formation: int):
    """The rendezvous store of this process group, under its own key prefix.

    The first group of a job joins the store as `init_process_group("env://")`
    does (rank 0 hosts it unless torchrun's agent does) under the prefix
    `default_pg`. A group restarted by torchrun, or formed again in the same
    process (one `bench harness` run per preset), joins the agent's store
    again, where the group before left its ranks' addresses under the same
    keys: gloo would connect to dead ranks. A prefix per torchrun attempt and
    per formation keeps each group's keys apart. Every rank forms its groups
    in the same order, so the prefixes agree.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    wait = timedelta(seconds=timeout)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if (attempt, formation) != (0, 0) and agent:
        store = dist.TCPStore(
            env.master_addr, env.master_port, env.world_size, is_master=False, timeout=wait
        )
        return dist.PrefixStore(f"cpbt/attempt{attempt}/group{formation}/", store)
    store, _, _ = next(dist.rendezvous("env://", env.rank, env.world_size, timeout=wait))
    store.set_timeout(wait)
    return dist.PrefixStore("default_pg", store)


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
