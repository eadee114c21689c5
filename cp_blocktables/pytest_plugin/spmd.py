"""SPMD mode: under `torchrun ... -m pytest` each launched pytest process is one rank.

Every process collects the same tests in the same order, so a marked test runs in place
on all of them at once. The process group is initialised once, from torchrun's
environment, with gloo for CPU tensors (and nccl for CUDA tensors when there is a GPU).

After each marked test the ranks exchange their outcomes through the process group's
key-value store (not a collective, so a rank that failed early cannot deadlock it), and
every rank reports the same verdict: a rank whose own body passed still fails the test
when another rank failed. Because a failed rank may have left a collective unmatched,
later marked tests of the run are skipped rather than run on an untrusted group. A
faulthandler watchdog dumps the stacks and ends the process if a test outlives its
timeout, so torchrun stops the whole run instead of hanging.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import time

import pytest

from .protocol import Outcome, make_block_tables_factory, seed_everything
from .rank_report import RANK_TABLE, RanksFailed, render, status_table, verdict

_WATCHDOG_SLACK_S = 30.0


class SpmdRunner:
    """Runs marked tests in this torchrun-launched process, as rank `rank`."""

    def __init__(self, config: pytest.Config, rank: int, world_size: int, local_rank: int):
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.owns_group = False
        self.broken_by: str | None = None
        self.tests_run = 0

    def describe(self) -> str:
        return f"SPMD under torchrun, rank {self.rank} of {self.world_size}"

    def launcher(self, spec) -> str:
        return f"torchrun --nproc-per-node={spec.world_size} -m pytest"

    def check(self, item: pytest.Function, spec) -> None:
        if spec.world_size != self.world_size:
            pytest.skip(f"needs {spec.world_size} ranks; this torchrun run has {self.world_size}")
        if self.broken_by is not None:
            pytest.skip(
                f"an earlier multi-rank test failed ({self.broken_by}); its ranks may have "
                "left collectives unmatched, so this run's process group is not trusted"
            )
        self._init_group()

    def fixture(self, item: pytest.Item, spec, name: str):
        import torch

        device = torch.device("cpu")
        if spec.device == "cuda":
            device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(device)
        values = {"rank": self.rank, "world_size": self.world_size, "device": device}
        if name == "block_tables_factory":
            return make_block_tables_factory(self.rank, self.world_size, device)
        return values[name]

    def call(self, item: pytest.Function, spec, repro: str) -> bool:
        from _pytest.outcomes import Skipped, XFailed

        seed_everything(item.config.getoption("ranks_seed"))
        kwargs = {name: item.funcargs[name] for name in item._fixtureinfo.argnames}
        error: BaseException | None = None
        mine = Outcome(self.rank, "passed")
        start = time.perf_counter()
        faulthandler.dump_traceback_later(spec.timeout_s + _WATCHDOG_SLACK_S, exit=True)
        try:
            item.obj(**kwargs)
        except Skipped as exc:
            error, mine = exc, Outcome(self.rank, "skipped", message=exc.msg)
        except XFailed as exc:
            error, mine = exc, Outcome(self.rank, "xfailed", message=exc.msg)
        except BaseException as exc:
            error = exc
            mine = Outcome(self.rank, "failed", message=f"{type(exc).__name__}: {exc}"[:200])
        finally:
            faulthandler.cancel_dump_traceback_later()
        mine.duration_s = time.perf_counter() - start
        outcomes = self._exchange(mine, spec.timeout_s)
        v = verdict(outcomes, spec.timeout_s)
        if v.status != "failed":
            if error is not None:
                raise error
            return True
        self.broken_by = item.nodeid
        if mine.status == "failed":
            item.stash[RANK_TABLE] = status_table(outcomes)
            raise error
        seed = item.config.getoption("ranks_seed")
        context = f"{spec.describe()} seed={seed}; tracebacks are in the failing ranks' output"
        raise RanksFailed(render(outcomes, {}, v.headline, context, repro))

    def _exchange(self, mine: Outcome, timeout_s: float) -> list[Outcome]:
        """Every rank's outcome of this test, read from the store; silent ranks time out."""
        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
        prefix = f"cp_blocktables/ranks/{self.tests_run}/"
        self.tests_run += 1
        store.set(prefix + str(self.rank), json.dumps([mine.status, mine.message, mine.duration_s]))
        outcomes = []
        for r in range(self.world_size):
            try:
                store.wait([prefix + str(r)], datetime.timedelta(seconds=timeout_s))
                status, message, took = json.loads(store.get(prefix + str(r)))
            except Exception:
                status, message, took = "timeout", "did not report its outcome", 0.0
            outcomes.append(Outcome(r, status, message=message, duration_s=took))
        return outcomes

    def _init_group(self) -> None:
        import torch
        import torch.distributed as dist

        if dist.is_initialized():
            return
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        timeout = datetime.timedelta(seconds=self.config.getoption("ranks_timeout"))
        dist.init_process_group(backend, timeout=timeout)
        self.owns_group = True

    def close(self) -> None:
        if self.owns_group:
            import torch.distributed as dist

            dist.destroy_process_group()
