"""What the pytest plugin adds to a 4-rank CPU test: reused rank pool against fresh spawns.

Every path runs the same body (one gloo all-reduce) through the plugin's own machinery
(`pool`): "reused" is what a test costs on a pool that already exists, health
check included; "fresh" is start, run and kill per test, by spawning every rank (what
launchers that spawn per test pay) or by forking ranks from the plugin's fork server
(what a rebuild after a failure costs). The pool's one-off start is reported on its own.
"""

from __future__ import annotations

import os
import pickle
import statistics
import sys
import time

_WORLD_SIZE = 4
_FRESH_METHODS = ("forkserver", "spawn")


def bench_plugin_overhead(num_tests: int = 5) -> dict:
    """Per-test seconds of a 4-rank CPU test: reused pool, fresh fork-server pool, fresh spawn.

    Returns a dict with `reused_per_test_s` (health check + run on a pool that served
    before), `fresh_spawn_per_test_s` (start N spawned ranks, run, kill: what launchers
    that spawn per test pay), `fresh_forkserver_per_test_s` (the same with ranks forked
    from the plugin's fork server), each the median over `num_tests` tests;
    `pool_start_s` (the reused pool's one-off start, fork server included),
    `speedup_vs_spawn`, and the setup (`world_size`, `backend`, `device`, `num_tests`).
    """
    from ..pytest_plugin.pool import PoolKey, RankPool

    if num_tests < 1:
        raise ValueError(f"num_tests must be >= 1, got {num_tests}")
    key = PoolKey(_WORLD_SIZE, "gloo", "cpu")
    task = _bench_task()

    start = time.perf_counter()
    pool = RankPool(key, start_method="forkserver")
    pool.wait_ready()
    pool_start_s = time.perf_counter() - start
    reused = []
    try:
        _run_ok(pool, task)
        for _ in range(num_tests):
            t0 = time.perf_counter()
            if not pool.healthy():
                raise RuntimeError("bench pool failed its health check")
            _run_ok(pool, task)
            reused.append(time.perf_counter() - t0)
    finally:
        pool.kill()

    fresh = {method: _fresh_runs(key, task, method, num_tests) for method in _FRESH_METHODS}
    reused_s = statistics.median(reused)
    return {
        "world_size": _WORLD_SIZE,
        "backend": key.backend,
        "device": key.device,
        "num_tests": num_tests,
        "pool_start_s": round(pool_start_s, 4),
        "reused_per_test_s": round(reused_s, 4),
        "fresh_forkserver_per_test_s": round(fresh["forkserver"], 4),
        "fresh_spawn_per_test_s": round(fresh["spawn"], 4),
        "speedup_vs_spawn": round(fresh["spawn"] / reused_s, 1),
    }


def _fresh_runs(key, task, method: str, num_tests: int) -> float:
    """Median seconds of start + run + kill of a new pool, `num_tests` times."""
    from ..pytest_plugin.pool import RankPool

    times = []
    for _ in range(num_tests):
        t0 = time.perf_counter()
        pool = RankPool(key, start_method=method)
        try:
            pool.wait_ready()
            _run_ok(pool, task)
        finally:
            pool.kill()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def all_reduce_body(rank: int, world_size: int, device) -> None:
    """The benchmarked test body: one all-reduce, checked."""
    import torch
    import torch.distributed as dist

    ones = torch.ones(1, device=device)  # [1]
    dist.all_reduce(ones)
    assert int(ones.item()) == world_size, f"rank {rank}: all-reduce gave {ones.item()}"


def _bench_task():
    from ..pytest_plugin.worker import Task, WorkerFixture

    args = {name: WorkerFixture(name) for name in ("rank", "world_size", "device")}
    return Task(
        module_name=__name__,
        module_path=None,
        attr_path=("all_reduce_body",),
        kwargs=pickle.dumps(args),
        sys_path=tuple(sys.path),
        cwd=os.getcwd(),
        seed=0,
    )


def _run_ok(pool, task) -> None:
    result = pool.run(task, timeout_s=60.0, grace_s=1.0)
    bad = [o for o in result.outcomes if o.status != "passed"]
    if bad:
        raise RuntimeError(f"bench body failed: {[(o.rank, o.status, o.message) for o in bad]}")
