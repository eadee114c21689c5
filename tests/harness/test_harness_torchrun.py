"""The harness under real torchrun: one node of 4 ranks, and two agents acting as two nodes."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest
from harness_proc import ROOT, child_env, leftover_processes

from cp_blocktables.drills.procs import free_port

pytestmark = pytest.mark.multirank

ARGS = ["--preset", "default", "--steps", "8", "--timeout", "60"]


def test_torchrun_standalone_four_ranks(tmp_path):
    report = tmp_path / "report.json"
    env = child_env()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
         "launch/verify.py", *ARGS, "--report", str(report)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS" in proc.stdout
    data = json.loads(report.read_text())
    assert data["world_size"] == 4 and data["backend"] == "gloo"
    assert data["results"][0]["ranks"] == [0, 1, 2, 3]
    assert leftover_processes(env["CP_BLOCKTABLES_TEST_MARKER"]) == []


def test_two_torchrun_agents_as_two_nodes(tmp_path):
    """launch/multinode.sh on 127.0.0.1: c10d rendezvous, two agents of two ranks each."""
    report = tmp_path / "report.json"
    env = child_env(
        PYTHON=sys.executable,
        NPROC_PER_NODE="2",
        RDZV_PORT=str(free_port()),
        RUN_ID=f"test-{uuid.uuid4().hex[:8]}",
    )
    cmd = ["bash", "launch/multinode.sh", "127.0.0.1", *ARGS, "--report", str(report)]
    agents = [
        subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for _ in range(2)
    ]
    try:
        outs = [a.communicate(timeout=300)[0] for a in agents]
    finally:
        for a in agents:
            a.kill()
            a.wait()
    assert [a.returncode for a in agents] == [0, 0], "\n".join(outs)
    assert sum("PASS" in out for out in outs) == 1
    data = json.loads(report.read_text())
    assert data["world_size"] == 4 and len(data["ranks"]) == 4
    assert leftover_processes(env["CP_BLOCKTABLES_TEST_MARKER"]) == []


SECOND_GROUP = """
import os, time
from cp_blocktables.harness.options import VerifyOptions
from cp_blocktables.harness.runner import run_rank
opts = VerifyOptions(impls=["cp_blocktables:BlockTables"], presets=["cp2-i1"], steps=2,
                     quiet=True, progress=False, timeout=20)
first = run_rank(opts)
if os.environ["RANK"] == "0":
    time.sleep(3)  # rank 1 reaches the second group first, as after a leader's report
raise SystemExit(max(first, run_rank(opts)))
"""


def test_second_process_group_in_one_torchrun_job(tmp_path):
    """A job that forms its group twice (bench harness, one run per preset) must not
    meet the first group's addresses in the agent's store."""
    script = tmp_path / "twice.py"
    script.write_text(SECOND_GROUP)
    env = child_env()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("PASS") == 2
    assert leftover_processes(env["CP_BLOCKTABLES_TEST_MARKER"]) == []
