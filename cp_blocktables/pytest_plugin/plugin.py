"""pytest plugin: run a test body on N ranks with a ready process group.

    @pytest.mark.ranks(4)                      # backend=, device="cpu"|"cuda", timeout=
    def test_all_reduce(rank, world_size, device):
        t = torch.ones(1, device=device)
        dist.all_reduce(t)
        assert t.item() == world_size

Two modes, chosen once per session:

- pooled (default): the body runs once per rank in pooled rank processes
  (`pool`), forked from a fork server that imported torch once. Pools are reused
  across tests with the same world size, backend and device while they stay healthy.
  The body's arguments are `rank`, `world_size`, `device`, `block_tables_factory`
  (resolved in each rank) and any other argument whose value pickles (parametrize
  values, `tmp_path`, data fixtures); the test function is found in the rank by its
  module file and name, never pickled.
- SPMD: under `torchrun ... -m pytest` (RANK, WORLD_SIZE and LOCAL_RANK set) every
  launched process is one rank; marked tests run in place (`spmd`).

Every rank gets the same seed (`--ranks-seed`). A test's verdict is the ranks' common
outcome; anything uneven is a failure whose report lists every rank (`rank_report`)
and ends with a one-line reproduction command.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass

import pytest

from ..bench.plugin import bench_plugin_overhead
from .pool_runner import PoolRunner
from .rank_report import RANK_TABLE, RanksFailed

__all__ = ["RanksSpec", "bench_plugin_overhead", "ranks_spec"]

_SPEC = pytest.StashKey["RanksSpec"]()
_BACKENDS = ("gloo", "nccl")
_DEVICES = ("cpu", "cuda")
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class RanksSpec:
    """A validated `@pytest.mark.ranks(...)`: how many ranks, which backend and device."""

    world_size: int
    backend: str
    device: str
    timeout_s: float

    def describe(self) -> str:
        return f"world_size={self.world_size} backend={self.backend} device={self.device}"


def ranks_spec(item: pytest.Item, default_timeout_s: float) -> RanksSpec | None:
    """Parse the closest `ranks` marker of `item`; `ValueError` naming what is wrong."""
    marker = item.get_closest_marker("ranks")
    if marker is None:
        return None
    kwargs = dict(marker.kwargs)
    args = list(marker.args)
    if args:
        kwargs.setdefault("world_size", args.pop(0))
    if args or "world_size" not in kwargs:
        raise ValueError("@pytest.mark.ranks takes one positional argument, the world size")
    unknown = sorted(set(kwargs) - {"world_size", "backend", "device", "timeout"})
    if unknown:
        raise ValueError(f"@pytest.mark.ranks got unknown arguments {unknown}")
    world_size = kwargs["world_size"]
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"@pytest.mark.ranks world size must be an int >= 1, got {world_size!r}")
    device = kwargs.get("device", "cpu")
    if device not in _DEVICES:
        raise ValueError(f"@pytest.mark.ranks device must be one of {_DEVICES}, got {device!r}")
    backend = kwargs.get("backend") or ("nccl" if device == "cuda" else "gloo")
    if backend not in _BACKENDS:
        raise ValueError(f"@pytest.mark.ranks backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "nccl" and device != "cuda":
        raise ValueError("@pytest.mark.ranks backend='nccl' needs device='cuda'")
    timeout = kwargs.get("timeout", default_timeout_s)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"@pytest.mark.ranks timeout must be a positive number, got {timeout!r}")
    return RanksSpec(world_size, backend, device, float(timeout))


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when this process was launched by torchrun."""
    if not all(v in os.environ for v in _TORCHRUN_VARS):
        return None
    return tuple(int(os.environ[v]) for v in _TORCHRUN_VARS)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ranks", "multi-rank tests (@pytest.mark.ranks)")
    group.addoption(
        "--ranks-timeout",
        type=float,
        default=300.0,
        help="seconds a multi-rank test may run before every rank's stack is dumped and "
        "the ranks are killed (a marker's timeout= wins); default 300",
    )
    group.addoption(
        "--ranks-seed",
        type=int,
        default=0,
        help="seed given to random, numpy and torch on every rank before each test; default 0",
    )
    group.addoption(
        "--ranks-grace",
        type=float,
        default=5.0,
        help="seconds the other ranks may still run after one rank failed; default 5",
    )
    group.addoption(
        "--ranks-fresh",
        action="store_true",
        help="start fresh rank processes for every test instead of reusing pools",
    )
    group.addoption(
        "--ranks-start-method",
        choices=("forkserver", "spawn"),
        default=None,
        help="how rank processes start: forkserver (default where available; one process "
        "imports torch, ranks fork from it) or spawn (every rank imports torch itself)",
    )
    group.addoption(
        "--ranks-max-pools",
        type=int,
        default=2,
        help="idle rank pools kept for reuse (one per world size/backend/device); default 2",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "ranks(world_size, backend=None, device='cpu', timeout=None): run the test body on "
        "world_size ranks with an initialised torch.distributed process group "
        "(gloo on CPU, nccl on CUDA)",
    )
    config.addinivalue_line(
        "markers", "multirank: the test starts several processes (set on every ranks test)"
    )
    env = torchrun_env()
    if env is not None:
        from .spmd import SpmdRunner

        runner = SpmdRunner(config, *env)
    else:
        runner = PoolRunner(config)
    config.stash[_RUNNER] = runner


def pytest_itemcollected(item: pytest.Item) -> None:
    if item.get_closest_marker("ranks") is not None:
        item.add_marker("multirank")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    try:
        spec = ranks_spec(item, item.config.getoption("ranks_timeout"))
    except ValueError as exc:
        problem = str(exc)
    else:
        problem = None
    if problem is not None:
        pytest.fail(problem, pytrace=False)
    if spec is None:
        return
    if not isinstance(item, pytest.Function) or _is_unittest(item):
        pytest.fail("@pytest.mark.ranks applies to plain pytest test functions", pytrace=False)
    item.stash[_SPEC] = spec
    if spec.device == "cuda":
        _skip_without_gpus(spec)
    item.config.stash[_RUNNER].check(item, spec)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    spec = pyfuncitem.stash.get(_SPEC, None)
    if spec is None:
        return None
    runner = pyfuncitem.config.stash[_RUNNER]
    return runner.call(pyfuncitem, spec, reproduce_line(pyfuncitem, spec))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    spec = item.stash.get(_SPEC, None)
    if spec is None:
        return report
    if report.skipped and call.when == "call" and isinstance(report.longrepr, tuple):
        path, lineno, _ = item.reportinfo()
        report.longrepr = (os.fspath(path), (lineno or 0) + 1, report.longrepr[2])
    if not report.failed:
        return report
    if call.excinfo is not None and isinstance(call.excinfo.value, RanksFailed):
        report.longrepr = call.excinfo.value.longrepr
    elif hasattr(report.longrepr, "addsection"):
        table = item.stash.get(RANK_TABLE, None)
        if table:
            report.longrepr.addsection("ranks", table)
        report.longrepr.addsection("reproduce", reproduce_line(item, spec))
    return report


def pytest_report_header(config: pytest.Config) -> str:
    return f"ranks: {config.stash[_RUNNER].describe()}, seed={config.getoption('ranks_seed')}"


def pytest_unconfigure(config: pytest.Config) -> None:
    runner = config.stash.get(_RUNNER, None)
    if runner is not None:
        runner.close()


@pytest.fixture
def rank(request: pytest.FixtureRequest) -> int:
    """This rank's index in the process group, `0 <= rank < world_size`."""
    return _fixture(request, "rank")


@pytest.fixture
def world_size(request: pytest.FixtureRequest) -> int:
    """Number of ranks in the process group (the marker's world size)."""
    return _fixture(request, "world_size")


@pytest.fixture
def device(request: pytest.FixtureRequest):
    """This rank's `torch.device`: the CPU, or its own GPU for device='cuda'."""
    return _fixture(request, "device")


@pytest.fixture
def block_tables_factory(request: pytest.FixtureRequest):
    """`factory(**kwargs) -> BlockTables` with device, cp_size and cp_rank of this rank."""
    return _fixture(request, "block_tables_factory")


def reproduce_line(item: pytest.Item, spec: RanksSpec) -> str:
    """A shell line that reruns just this test with the same seed, and its rank setup."""
    args = [shlex.quote(item.nodeid)]
    if item.config.pluginmanager.has_plugin("cp_blocktables.pytest_plugin"):
        args.append("-p cp_blocktables.pytest_plugin")
    args.append(f"--ranks-seed={item.config.getoption('ranks_seed')}")
    launcher = item.config.stash[_RUNNER].launcher(spec)
    return f"reproduce: {launcher} {' '.join(args)}  # {spec.describe()}"


def _fixture(request: pytest.FixtureRequest, name: str):
    spec = request.node.stash.get(_SPEC, None)
    if spec is None:
        pytest.fail(
            f"fixture {name!r} belongs to multi-rank tests: mark the test with "
            "@pytest.mark.ranks(world_size)",
            pytrace=False,
        )
    return request.config.stash[_RUNNER].fixture(request.node, spec, name)


def _is_unittest(item: pytest.Item) -> bool:
    import unittest

    cls = getattr(item, "cls", None)
    return cls is not None and issubclass(cls, unittest.TestCase)


def _skip_without_gpus(spec: RanksSpec) -> None:
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    needed = spec.world_size if spec.backend == "nccl" else 1
    if found < needed:
        pytest.skip(
            f"needs {needed} CUDA device(s) for {spec.world_size} ranks with "
            f"{spec.backend}; found {found}"
        )


_RUNNER = pytest.StashKey[object]()  # PoolRunner, or SpmdRunner under torchrun
