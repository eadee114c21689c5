"""What the pytest plugin adds to a 4-rank CPU test: reused rank pool against fresh spawns.

Both paths run the same body (one gloo all-reduce) through the plugin's own machinery
(`_rank_pool`): "reused" is what a test costs on a pool that already exists, health
check included; "fresh" is start, run and kill per test, which is what launchers that
spawn per test pay. The pool's one-off start is reported on its own.
"""

from __future__ import annotations

import os
import pickle
import statistics
import sys
import time

_WORLD_SIZE = 4


def bench_plugin_overhead(num_tests: int = 5) -> dict:
    """Per-test seconds of a 4-rank CPU test, reused pool against a fresh spawn per test.

    Returns a dict with `reused_per_test_s` and `fresh_per_test_s` (medians over
    `num_tests` tests each), `pool_start_s` (the reused pool's one-off start), the
    `speedup` of reuse, and the setup (`world_size`, `backend`, `device`, `num_tests`).
    """
    from ._rank_pool import PoolKey, RankPool

    if num_tests < 1:
        raise ValueError(f"num_tests must be >= 1, got {num_tests}")
    key = PoolKey(_WORLD_SIZE, "gloo", "cpu")
    task = _bench_task()

    start = time.perf_counter()
    pool = RankPool(key)
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

    fresh = []
    for _ in range(num_tests):
        t0 = time.perf_counter()
        pool = RankPool(key)
        try:
            pool.wait_ready()
            _run_ok(pool, task)
        finally:
            pool.kill()
        fresh.append(time.perf_counter() - t0)

    reused_s, fresh_s = statistics.median(reused), statistics.median(fresh)
    return {
        "world_size": _WORLD_SIZE,
        "backend": key.backend,
        "device": key.device,
        "num_tests": num_tests,
        "pool_start_s": round(pool_start_s, 4),
        "reused_per_test_s": round(reused_s, 4),
        "fresh_per_test_s": round(fresh_s, 4),
        "speedup": round(fresh_s / reused_s, 1),
    }


def all_reduce_body(rank: int, world_size: int, device) -> None:
    """The benchmarked test body: one all-reduce, checked."""
    import torch
    import torch.distributed as dist

    ones = torch.ones(1, device=device)  # [1]
    dist.all_reduce(ones)
    assert int(ones.item()) == world_size, f"rank {rank}: all-reduce gave {ones.item()}"


def _bench_task():
    from ._rank_worker import Task, WorkerFixture

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
