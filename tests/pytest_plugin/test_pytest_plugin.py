"""The multi-rank pytest plugin, run the way its users run it: pytest on a test file.

Each `multirank` test writes a small test file, runs pytest on it in a fresh subprocess
(pytester) with the plugin loaded, and checks what pytest reported and which processes
served the ranks. World size 2 keeps each run to two rank processes. Marker parsing and
how rank outcomes combine into one verdict are checked without pytest runs, in
`test_plugin_marker_and_verdict.py`.
"""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

_ROOT = Path(__file__).resolve().parents[2]
_PLUGIN = ("-p", "cp_blocktables.pytest_plugin", "-p", "no:cacheprovider")
_LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PYTEST_XDIST_WORKER",
    "PYTEST_XDIST_WORKER_COUNT",
    "PYTEST_ADDOPTS",
)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """This checkout importable, and no launcher variables leaking into the inner run."""
    path = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(_ROOT), path]))
    for var in _LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def inner(pytester: pytest.Pytester, clean_env: None):
    """Runs pytest with the plugin on a generated `test_inner.py`, in a subprocess."""

    def run(source: str, *args: str, timeout: float = 120) -> pytest.RunResult:
        pytester.makepyfile(test_inner=textwrap.dedent(source))
        return pytester.runpytest_subprocess(*_PLUGIN, *args, timeout=timeout)

    return run


def _pids(directory: Path, test: str) -> list[int]:
    files = sorted(directory.glob(f"pid-{test}-rank*"))
    return [int(f.read_text()) for f in files]


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


_RECORD_PID = """
    import os, pathlib, pytest, torch
    import torch.distributed as dist

    def record(name, rank):
        pathlib.Path(f"pid-{name}-rank{rank}").write_text(str(os.getpid()))
"""


@pytest.mark.multirank
def test_outcomes_are_reported_per_rank(inner):
    result = inner(
        _RECORD_PID
        + """
    @pytest.mark.ranks(2)
    @pytest.mark.parametrize("scale", [1, 3])
    def test_passes(rank, world_size, device, scale, block_tables_factory):
        ones = torch.full((1,), scale, device=device)
        dist.all_reduce(ones)
        assert ones.item() == scale * world_size
        tables = block_tables_factory(block_sizes=[4], max_num_reqs=2,
                                      max_num_batched_tokens=8, max_num_blocks_per_group=[2])
        assert (tables.cp_size, tables.cp_rank) == (world_size, rank)

    @pytest.mark.ranks(2)
    def test_fails_on_one_rank(rank):
        assert [rank, 7] == [0, 7]

    @pytest.mark.ranks(2)
    def test_fails_on_every_rank(rank):
        raise ValueError(f"broken on rank {rank}")

    @pytest.mark.ranks(2)
    def test_dies_on_one_rank(rank):
        if rank == 1:
            os._exit(3)

    @pytest.mark.ranks(2)
    def test_xfails_on_every_rank(rank):
        pytest.xfail("known gap")

    @pytest.mark.ranks(2)
    def test_skips_on_one_rank(rank):
        if rank == 1:
            pytest.skip("rank 1 has nothing to do")

    @pytest.mark.ranks(2)
    def test_skips_on_every_rank(rank):
        pytest.skip("not on this machine")

    @pytest.mark.ranks(0)
    def test_bad_marker():
        pass

    def test_rank_without_marker(rank):
        pass

    @pytest.mark.ranks(2)
    def test_process_bound_fixture(rank, monkeypatch):
        pass
    """,
        "-rsE",
    )
    result.assert_outcomes(passed=2, failed=4, skipped=1, xfailed=1, errors=3)
    result.stdout.fnmatch_lines(
        [
            "*_ test_fails_on_one_rank _*",
            "2-rank test: failed on ranks ?1?; rank 1: AssertionError: assert ?1, 7? == ?0, 7?",
            "  (world_size=2 backend=gloo device=cpu seed=0)",
            "  rank 0: passed*",
            "  rank 1: FAILED*AssertionError*",
            "*rank 1 traceback*",
            ">       assert ?rank, 7? == ?0, 7?",
            "E       assert ?1, 7? == ?0, 7?",
            "reproduce: pytest test_inner.py::test_fails_on_one_rank"
            " -p cp_blocktables.pytest_plugin --ranks-seed=0"
            "  # world_size=2 backend=gloo device=cpu",
            "*_ test_fails_on_every_rank _*",
            "  rank 0: FAILED*ValueError: broken on rank 0",
            "  rank 1: FAILED*ValueError: broken on rank 1",
            "*rank 0 traceback*",
            "E       ValueError: broken on rank 0",
            "*rank 1 traceback*",
            "E       ValueError: broken on rank 1",
            "reproduce: pytest test_inner.py::test_fails_on_every_rank *",
            "*_ test_dies_on_one_rank _*",
            "2-rank test: failed on ranks ?1?; rank 1: process exited with code 3",
            "  rank 0: passed*",
            "  rank 1: DIED process exited with code 3",
            "*_ test_skips_on_one_rank _*",
            "2-rank test: pytest.skip() on ranks ?1? only; ranks ?0? ran the test*",
            "  rank 1: skipped*rank 1 has nothing to do",
        ]
    )
    result.stdout.fnmatch_lines(
        [
            "*ERROR at setup of test_bad_marker*",
            "@pytest.mark.ranks world size must be an int >= 1, got 0",
            "*ERROR at setup of test_rank_without_marker*",
            "fixture 'rank' belongs to multi-rank tests: mark the test with @pytest.mark.ranks*",
            "*ERROR at setup of test_process_bound_fixture*",
            "fixtures ?'monkeypatch'? act on the pytest process and cannot be used*",
        ]
    )
    result.stdout.fnmatch_lines(["SKIPPED ?1? test_inner.py:*: not on this machine"])


@pytest.mark.multirank
def test_pool_is_reused_and_rebuilt_after_a_failure(inner, pytester):
    result = inner(
        _RECORD_PID
        + """
    @pytest.mark.ranks(2)
    def test_first(rank):
        record("first", rank)

    @pytest.mark.ranks(2)
    def test_second(rank):
        record("second", rank)

    @pytest.mark.ranks(2)
    def test_fails(rank):
        record("fails", rank)
        assert rank == 0

    @pytest.mark.ranks(2)
    def test_after_failure(rank):
        record("after", rank)
    """
    )
    result.assert_outcomes(passed=3, failed=1)
    first = _pids(pytester.path, "first")
    assert len(set(first)) == 2
    assert _pids(pytester.path, "second") == first
    assert _pids(pytester.path, "fails") == first
    after = _pids(pytester.path, "after")
    assert len(after) == 2 and not set(after) & set(first)
    assert not [pid for pid in first + after if _running(pid)]


@pytest.mark.multirank
def test_hanging_rank_has_its_stack_dumped_and_the_run_ends(inner):
    start = time.monotonic()
    result = inner(
        """
    import time, pytest
    import torch.distributed as dist

    def wait_for_ever():
        time.sleep(600)

    @pytest.mark.ranks(2, timeout=3)
    def test_hangs(rank):
        if rank == 1:
            wait_for_ever()
        dist.barrier()
    """,
        timeout=90,
    )
    assert time.monotonic() - start < 60
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "2-rank test: timed out after 3 s on ranks ?0, 1?",
            "  rank 0: TIMEOUT still running at the deadline; stacks dumped, killed",
            "  rank 1: TIMEOUT still running at the deadline; stacks dumped, killed",
            "*rank 0 Python stacks (timeout)*",
            "Current thread * (most recent call first):",
            '  File "*distributed_c10d.py", line * in barrier',
            "*rank 1 Python stacks (timeout)*",
            "Current thread * (most recent call first):",
            '  File "*test_inner.py", line * in wait_for_ever',
            '  File "*test_inner.py", line * in test_hangs',
            "reproduce: pytest test_inner.py::test_hangs *",
        ]
    )
    result.stdout.no_fnmatch_line("*_orphan_watch*")


@pytest.mark.multirank
def test_xdist_workers_run_their_own_pools_side_by_side(inner, pytester):
    source = _RECORD_PID + "".join(
        f"""
    @pytest.mark.ranks(2)
    def test_all_reduce_{i}(rank, world_size):
        record(f"{{os.environ['PYTEST_XDIST_WORKER']}}-{i}", rank)
        ones = torch.ones(1)
        dist.all_reduce(ones)
        assert ones.item() == world_size
    """
        for i in range(4)
    )
    result = inner(source, "-n", "2")
    result.assert_outcomes(passed=4)
    pools: dict[str, set[tuple[int, ...]]] = {}
    for worker in ("gw0", "gw1"):
        for i in range(4):
            pids = _pids(pytester.path, f"{worker}-{i}")
            if pids:
                pools.setdefault(worker, set()).add(tuple(pids))
    assert sum(len(p) for p in pools.values()) == len(pools), "one reused pool per worker"
    all_pids = [pid for p in pools.values() for pool in p for pid in pool]
    assert len(all_pids) == len(set(all_pids)) == 2 * len(pools)
    assert not [pid for pid in all_pids if _running(pid)]


@pytest.mark.multirank
def test_torchrun_runs_marked_tests_in_the_launched_processes(pytester, clean_env):
    pytester.makeconftest(
        """
        import os

        def pytest_runtest_logreport(report):
            if report.when == "call" or report.outcome != "passed":
                with open(f"outcomes-rank{os.environ['RANK']}.txt", "a") as f:
                    f.write(f"{report.nodeid.split('::')[-1]} {report.outcome}\\n")
        """
    )
    pytester.makepyfile(
        test_inner="""
        import multiprocessing, os, pytest, torch
        import torch.distributed as dist

        @pytest.mark.ranks(2)
        def test_in_place(rank, world_size):
            assert multiprocessing.parent_process() is None
            assert rank == int(os.environ["RANK"])
            ones = torch.ones(1)
            dist.all_reduce(ones)
            assert ones.item() == world_size

        @pytest.mark.ranks(4)
        def test_needs_four(rank):
            pass

        @pytest.mark.ranks(2)
        def test_fails_on_rank_one(rank):
            assert rank == 0

        @pytest.mark.ranks(2)
        def test_after_failure(rank):
            pass
        """
    )
    result = pytester.run(
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "pytest",
        *_PLUGIN,
        "test_inner.py",
        timeout=120,
    )
    assert result.ret != 0
    expected = [
        "test_in_place passed",
        "test_needs_four skipped",
        "test_fails_on_rank_one failed",
        "test_after_failure skipped",
    ]
    for rank in (0, 1):
        lines = (pytester.path / f"outcomes-rank{rank}.txt").read_text().splitlines()
        assert lines == expected, f"rank {rank}"
    result.stdout.fnmatch_lines(
        ["*reproduce: torchrun --nproc-per-node=2 -m pytest test_inner.py::test_fails_on_rank_one*"]
    )
