"""Process groups for the harness, one import for the modules that run ranks.

* `group`: where a rank is (`RankEnv`), the rendezvous store it joins, `PeerError`;
* `backend`: the census that picks NCCL only when every rank of every host has
  a GPU of its own (`choose_backend`, `place`, `BackendUsageError`);
* `comm`: `Comm`, the world's process group and its CP subgroups, with
  collectives that name absent peers, and the per-rank watchdog;
* `spawn`: `spawn_local`, the ranks forked locally under a torchrun-like
  environment when there is no torchrun.
"""

from __future__ import annotations

from .backend import BackendUsageError, Placement, choose_backend
from .comm import Comm, arm_watchdog, disarm_watchdog
from .group import PeerError, RankEnv, end_after_peer_failure
from .spawn import spawn_local

__all__ = [
    "BackendUsageError",
    "Comm",
    "PeerError",
    "end_after_peer_failure",
    "Placement",
    "RankEnv",
    "arm_watchdog",
    "choose_backend",
    "disarm_watchdog",
    "spawn_local",
]
