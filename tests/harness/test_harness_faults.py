"""Dead, hung and disagreeing ranks end the run with exit 1 and a message, never a hang."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from harness_proc import ROOT, child_env, leftover_processes, run_cli

from cp_blocktables.drills.procs import free_port

pytestmark = pytest.mark.multirank

FAULTY = "tests.wrong_impls.faulty"


def _rank_env(rank: int, world: int, port: int, marker: str) -> dict[str, str]:
    return child_env(
        marker,
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def _start(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _verify_cmd(*args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "cp_blocktables",
        "verify",
        "--preset",
        "cp2-i1",
        "--steps",
        "4",
        "--timeout",
        "20",
        *args,
    ]


def test_config_mismatch_between_ranks_is_reported_by_field_and_rank():
    port, marker = free_port(), "mismatch"
    procs = [
        _start(_verify_cmd("--seed", str(seed)), _rank_env(r, 2, port, marker))
        for r, seed in ((0, 1), (1, 2))
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [1, 1], outs
    assert "check 7" in outs[0] and "'seed'" in outs[0]
    assert "rank 0: 1" in outs[0] and "rank 1: 2" in outs[0]


@pytest.mark.parametrize("backend", ["auto", "gloo"])
def test_rank_that_never_reaches_the_collective_is_named_within_the_timeout(backend):
    """The absent rank joins the store but never runs the harness. Under `auto` the
    census of hosts and GPUs that picks the backend names it; under an explicit
    `gloo` (no census) the first collective's heartbeats do. Both within the timeout,
    on any machine: with GPUs, `auto` no longer picks NCCL against a gloo peer."""
    port, marker = free_port(), f"absent-{backend}"
    joiner = (
        "import time, datetime, torch.distributed as d; "
        "d.init_process_group('gloo', timeout=datetime.timedelta(seconds=60)); "
        "time.sleep(300)"
    )
    absent = _start([sys.executable, "-c", joiner], _rank_env(1, 2, port, marker))
    try:
        t0 = time.monotonic()
        proc = subprocess.run(
            _verify_cmd("--timeout", "5", "--backend", backend),
            cwd=ROOT,
            env=_rank_env(0, 2, port, marker),
            capture_output=True,
            text=True,
            timeout=120,
        )
        took = time.monotonic() - t0
    finally:
        absent.kill()
        absent.wait()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "never reached by rank 1" in proc.stderr
    assert took < 60


@pytest.mark.parametrize(
    ("impl", "expect"),
    [
        ("HangsOnRankOne", "never reached by rank 1"),
        ("DiesOnRankOne", "rank 1 ended abnormally (exit code 3)"),
        ("RaisesOnRankOne", "injected failure on cp_rank 1"),
        ("SegfaultsOnRankOne", "rank 1 ended abnormally (signal 11, SIGSEGV"),
    ],
    ids=["hang", "death", "exception", "segfault"],
)
def test_spawned_faults_end_the_run_and_leave_no_process(impl, expect):
    env = child_env()
    t0 = time.monotonic()
    proc = run_cli(
        [
            "verify",
            "--world-size",
            "2",
            "--preset",
            "cp2-i1",
            "--steps",
            "8",
            "--timeout",
            "5",
            "--impl",
            f"{FAULTY}:{impl}",
        ],
        timeout=180,
        env=env,
    )
    took = time.monotonic() - t0
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert expect in proc.stdout + proc.stderr
    assert took < 90
    time.sleep(0.5)
    assert leftover_processes(env["CP_BLOCKTABLES_TEST_MARKER"]) == []
