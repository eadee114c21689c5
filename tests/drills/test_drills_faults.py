"""`cp-blocktables drill faults` under real torchrun: every scenario ends as promised."""

from __future__ import annotations

import json
import re

import pytest
from harness_proc import child_env, leftover_processes, run_cli

from cp_blocktables.drills.faults import FAULT_STEP, SCENARIOS, _other_interleave

TIMEOUT = 20
"""Collective timeout of the drill, in seconds: short, yet long enough for a rank's start
(torch and Triton imports, the census) on a loaded 2-core machine."""


@pytest.mark.multirank
def test_fault_scenarios_end_named_and_leave_nothing(tmp_path):
    env = child_env()
    report = tmp_path / "faults.json"
    logs = tmp_path / "logs"
    proc = run_cli(
        [
            "drill",
            "faults",
            "--timeout",
            str(TIMEOUT),
            "--steps",
            "3",
            "--report",
            str(report),
            "--keep-logs",
            str(logs),
        ],
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    outcomes = {o["scenario"]: o for o in json.loads(report.read_text())["outcomes"]}
    assert sorted(outcomes) == sorted(SCENARIOS)
    assert all(o["passed"] and o["leftovers"] == [] for o in outcomes.values()), outcomes
    step = f"step {FAULT_STEP} of preset cp2-i1"
    assert outcomes["raise"]["exit_codes"] == [1]
    assert (
        "root cause: rank 1; error file of rank 1: InjectedFault" in outcomes["raise"]["observed"]
    )
    assert step in outcomes["raise"]["observed"]
    assert list(logs.glob("raise/*/attempt_0/1/error.json"))
    assert outcomes["restart"]["exit_codes"] == [0]
    assert "attempt 1: PASS" in outcomes["restart"]["observed"]
    assert (
        f"({step}) failed after at most {TIMEOUT} s: never reached by rank 1"
        in outcomes["hang"]["observed"]
    )
    waited = re.search(r", ([\d.]+) s after rank 1 hung", outcomes["hang"]["observed"])
    assert waited and float(waited.group(1)) <= TIMEOUT + 5
    assert outcomes["mismatch"]["exit_codes"] == [1, 1]
    for name in ("cp_interleave", "seed"):
        assert f"field {name!r} differs between ranks" in outcomes["mismatch"]["observed"]
    assert "PASS: 4 fault scenarios" in proc.stdout
    assert leftover_processes(env["CP_BLOCKTABLES_TEST_MARKER"]) == []


@pytest.mark.parametrize(
    ("preset", "expected"), [("cp2-i1", 2), ("default", 16), ("cp1-window", 2)]
)
def test_the_mismatch_picks_an_interleave_the_preset_accepts(preset, expected):
    assert _other_interleave(preset) == expected
