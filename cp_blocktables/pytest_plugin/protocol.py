"""What the pytest process and its rank processes exchange, and what both sides use.

`Task` (a test body to run), `Outcome` (how it ended on one rank), `WorkerSpec`
(a rank's place in its pool), `WorkerFixture` (the pytest process's stand-in for a
fixture that only a rank resolves), the per-rank files of a pool, the stack-dump
signal, and the rank-side fixtures' values (`rank_device`,
`make_block_tables_factory`, `seed_everything`), which SPMD mode uses too.
Everything here is plain data or a small function: `pool` (the pytest side) and
`worker` (the rank side) both import it.
"""

from __future__ import annotations

import os
import random
import signal
import sys
from dataclasses import dataclass, field
from typing import Any

STACK_SIGNAL = getattr(signal, "SIGUSR1", None)
"""Signal that makes a worker dump all its Python stacks (faulthandler); None on Windows."""

ORPHAN_WATCH_FRAME = " in _orphan_watch\n"
"""Marks the worker's own watcher thread in a stack dump, so that reports can leave it out."""

PLUGIN_FIXTURES = ("rank", "world_size", "device", "block_tables_factory")
"""Fixtures that are resolved in the rank process, not in the pytest process."""


class WorkerFixture:
    """Stands in, in the pytest process, for a fixture that only a rank can resolve.

    Any use of it outside the rank (for example by another fixture that requested it)
    raises an error that says where the value lives.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self):
        return (WorkerFixture, (self.name,))

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"fixture {self.name!r} of a @pytest.mark.ranks test is resolved in the rank "
            "processes; another fixture cannot use it in the pytest process. Use it inside "
            "the test body instead."
        )

    __call__ = __index__ = __int__ = __bool__ = __iter__ = __getitem__ = _refuse

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        self._refuse()

    def __repr__(self) -> str:
        return f"<{self.name}: resolved in each rank>"


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to join its pool: its place and where the pool keeps files."""

    rank: int
    world_size: int
    backend: str
    device: str
    pool_dir: str
    capture: bool
    pg_timeout_s: float


@dataclass(frozen=True)
class Task:
    """One test body to run: where to import it from and the arguments to pass.

    `kwargs` is a pickle of {argument name: value}; `WorkerFixture` values are replaced
    by this rank's own.
    """

    module_name: str
    module_path: str | None
    attr_path: tuple[str, ...]
    kwargs: bytes
    sys_path: tuple[str, ...]
    cwd: str
    seed: int
    env: dict[str, str] = field(default_factory=dict)
    tbstyle: str = "long"
    showlocals: bool = False


@dataclass
class Outcome:
    """How the body ended on one rank: passed, failed, skipped or xfailed."""

    rank: int
    status: str
    message: str = ""
    longrepr: str = ""
    duration_s: float = 0.0
    extra: dict = field(default_factory=dict)


def pool_file(pool_dir: str, kind: str, rank: int) -> str:
    """Path of a per-rank file in a pool's directory: kind is stdout, stderr or stack."""
    return os.path.join(pool_dir, f"rank{rank}.{kind}")


def rank_device(device: str, rank: int):
    """The torch device of `rank`: the CPU, or GPU `rank % device_count` for CUDA."""
    import torch

    if device == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", rank % torch.cuda.device_count())


def make_block_tables_factory(rank: int, world_size: int, device):
    """A callable building `cp_blocktables.BlockTables` for this rank.

    Defaults: `device` is the rank's device, `cp_size` the world size and `cp_rank` the
    rank; any keyword given overrides them.
    """

    def block_tables_factory(**kwargs: Any):
        from cp_blocktables import BlockTables

        kwargs.setdefault("device", device)
        kwargs.setdefault("cp_size", world_size)
        kwargs.setdefault("cp_rank", rank)
        return BlockTables(**kwargs)

    return block_tables_factory


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's (if loaded) and torch's generators, equally on every rank."""
    import torch

    random.seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed % 2**32)
    torch.manual_seed(seed)
