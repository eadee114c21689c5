"""Pooled mode of the plugin: a marked test's body runs once per rank in a reused
rank pool (`pool`), its arguments pickled into a `Task`, its outcomes judged by
`rank_report`; `PoolCache` keeps idle pools between tests. `plugin` hands each
marked test to `PoolRunner.call` (or, under torchrun, to `spmd.SpmdRunner`,
which has the same methods).
"""

from __future__ import annotations

import os
import pickle
import sys
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

import pytest

from .pool import PoolKey, PoolStartError, RankPool, default_start_method
from .protocol import PLUGIN_FIXTURES, Task, WorkerFixture
from .rank_report import RanksFailed, render, verdict

if TYPE_CHECKING:
    from .plugin import RanksSpec

_PROCESS_BOUND_FIXTURES = frozenset(
    [
        "request",
        "monkeypatch",
        "capsys",
        "capsysbinary",
        "capfd",
        "capfdbinary",
        "caplog",
        "recwarn",
        "pytestconfig",
        "cache",
        "record_property",
        "record_xml_attribute",
        "record_testsuite_property",
        "pytester",
        "testdir",
        "doctest_namespace",
        "subtests",
    ]
)


class PoolCache:
    """Keeps up to `max_pools` idle pools, least recently used evicted first."""

    def __init__(
        self, max_pools: int = 2, capture: bool = True, start_method: str | None = None
    ) -> None:
        self.max_pools = max(1, max_pools)
        self.capture = capture
        self.start_method = start_method
        self._idle: OrderedDict[PoolKey, RankPool] = OrderedDict()

    def take(self, key: PoolKey) -> RankPool:
        """A started pool for `key`; one that served before must pass a health check first."""
        pool = self._idle.pop(key, None)
        if pool is not None and pool.ready and not pool.healthy():
            pool.kill()
            pool = None
        pool = pool or RankPool(key, self.capture, self.start_method)
        try:
            pool.wait_ready()
        except BaseException:
            pool.kill()
            raise
        return pool

    def give_back(self, pool: RankPool) -> None:
        """Keep a pool that ended its test cleanly for the next test with the same key."""
        self._keep(pool)

    def replace(self, pool: RankPool) -> None:
        """Kill a pool that must not be reused and launch its replacement in the background.

        The next test with the same key then finds processes that have been importing
        torch while the pytest process reported the failure.
        """
        pool.kill()
        self._keep(RankPool(pool.key, self.capture, self.start_method))

    def _keep(self, pool: RankPool) -> None:
        self._idle[pool.key] = pool
        self._idle.move_to_end(pool.key)
        while len(self._idle) > self.max_pools:
            _, oldest = self._idle.popitem(last=False)
            oldest.close()

    def close(self) -> None:
        """Stop every idle pool, all within one short deadline."""
        pools, self._idle = list(self._idle.values()), OrderedDict()
        for pool in pools:
            pool.request_stop()
        deadline = time.monotonic() + 2.0
        for pool in pools:
            pool.close(deadline)


class PoolRunner:
    """Runs marked tests on pooled rank processes (the default mode)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.fresh = config.getoption("ranks_fresh")
        capture = config.getoption("capture") != "no"
        self.pools = PoolCache(
            config.getoption("ranks_max_pools"), capture, config.getoption("ranks_start_method")
        )

    def describe(self) -> str:
        method = self.config.getoption("ranks_start_method") or default_start_method()
        reuse = "fresh per test" if self.fresh else "reused"
        return f"rank pools started by {method}, {reuse}"

    def launcher(self, spec: RanksSpec) -> str:
        return "pytest"

    def check(self, item: pytest.Function, spec: RanksSpec) -> None:
        bound = sorted(set(item._fixtureinfo.argnames) & _PROCESS_BOUND_FIXTURES)
        if bound:
            pytest.fail(
                f"fixtures {bound} act on the pytest process and cannot be used by the body "
                "of a @pytest.mark.ranks test, which runs in the rank processes",
                pytrace=False,
            )

    def fixture(self, item: pytest.Item, spec: RanksSpec, name: str) -> WorkerFixture:
        return WorkerFixture(name)

    def call(self, item: pytest.Function, spec: RanksSpec, repro: str) -> bool:
        task = self._task(item)
        try:
            pool = self.pools.take(PoolKey(spec.world_size, spec.backend, spec.device))
        except PoolStartError as exc:
            problem = f"{exc}\n\n{repro}"
        else:
            problem = None
        if problem is not None:
            pytest.fail(problem, pytrace=False)
        try:
            result = pool.run(task, spec.timeout_s, self.config.getoption("ranks_grace"))
        except BaseException:
            pool.kill()
            raise
        if self.fresh:
            pool.kill()
        elif result.clean:
            self.pools.give_back(pool)
        else:
            self.pools.replace(pool)
        for r in range(spec.world_size):
            for kind, texts in (("stdout", result.stdout), ("stderr", result.stderr)):
                if texts.get(r):
                    item.add_report_section("call", f"{kind} rank {r}", texts[r])
        v = verdict(result.outcomes, spec.timeout_s)
        if v.status == "skipped":
            pytest.skip(v.headline)
        if v.status == "xfailed":
            pytest.xfail(v.headline)
        if v.status == "failed":
            context = f"{spec.describe()} seed={task_seed(item)}"
            raise RanksFailed(render(result.outcomes, result.stacks, v.headline, context, repro))
        return True

    def _task(self, item: pytest.Function) -> Task:
        names = item._fixtureinfo.argnames
        values = {}
        for name in names:
            value = item.funcargs[name]
            if name in PLUGIN_FIXTURES:
                value = WorkerFixture(name)
            values[name] = value
        bad = [n for n in names if not _pickles(values[n])]
        if bad:
            pytest.fail(
                f"argument(s) {bad} of a @pytest.mark.ranks test cannot be sent to the rank "
                "processes (not picklable). A ranks test may take rank, world_size, device, "
                "block_tables_factory and picklable parametrize or fixture values.",
                pytrace=False,
            )
        module = item.module
        return Task(
            module_name=module.__name__,
            module_path=getattr(module, "__file__", None),
            attr_path=_attr_path(item),
            kwargs=pickle.dumps(values),
            sys_path=tuple(sys.path),
            cwd=os.getcwd(),
            seed=task_seed(item),
            env=dict(os.environ),
            tbstyle=self.config.getoption("tbstyle", "auto"),
            showlocals=bool(self.config.getoption("showlocals", False)),
        )

    def close(self) -> None:
        self.pools.close()


def task_seed(item: pytest.Item) -> int:
    return item.config.getoption("ranks_seed")


def _attr_path(item: pytest.Function) -> tuple[str, ...]:
    if item.cls is None:
        return (item.originalname,)
    return (*item.cls.__qualname__.split("."), item.originalname)


def _pickles(value: object) -> bool:
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True
