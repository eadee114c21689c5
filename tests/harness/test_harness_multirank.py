"""The harness end to end under plain pytest: spawned gloo ranks, world sizes 1, 2, 4 and 8."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
from harness_proc import child_env, leftover_processes, run_cli

pytestmark = pytest.mark.multirank

# Each world size once, with our implementation, inside the container leg too: a few steps
# prove the plumbing (the sweep's reach is `make verify`'s and the catalogue's).
CASES = {
    1: ["--preset", "cp1-window", "--steps", "8"],
    2: ["--preset", "cp2-i1", "--steps", "8"],
    4: ["--preset", "default", "--steps", "7"],
    8: ["--preset", "cp8-large-ids", "--preset", "cp2-i1", "--steps", "5"],
}


def _accounting_ok(result: dict) -> None:
    for s in result["stats"]:
        where = f"{result['preset']} group {s['group']} rank {s['rank']}"
        assert s["owned"] == s["expected"], where
        assert s["duplicates"] == s["misses"] == s["wrong_slots"] == 0, where
        assert s["read_back"] == s["read_expected"], where
    assert result["steps_checked"] == result["steps_planned"]
    assert result["violations"] == []
    assert result["tokens_checked"] > 0, "a run that checked no token proves nothing"


@pytest.mark.parametrize("world", sorted(CASES), ids=lambda w: f"world{w}")
def test_our_implementation_passes(world, tmp_path):
    env = child_env()
    report = tmp_path / "report.json"
    proc = run_cli(
        ["verify", "--world-size", str(world), *CASES[world], "--report", str(report)], env=env
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS" in proc.stdout
    data = json.loads(report.read_text())
    assert data["passed"] and data["world_size"] == world
    assert sorted(r["rank"] for r in data["ranks"]) == list(range(world))
    for result in data["results"]:
        _accounting_ok(result)
    assert leftover_processes(env["CP_BLOCKTABLES_TEST_MARKER"]) == []


def test_cp_groups_of_a_larger_world_get_their_own_seeds(tmp_path):
    report = tmp_path / "report.json"
    proc = run_cli(
        [
            "verify",
            "--world-size",
            "4",
            "--cp-size",
            "2",
            "--preset",
            "cp4-interleave",
            "--steps",
            "8",
            "--seed",
            "5",
            "--report",
            str(report),
        ]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(report.read_text())["results"]
    assert [(r["cp_group"], r["cp_size"], r["seed"], r["ranks"]) for r in results] == [
        (0, 2, 5, [0, 1]),
        (1, 2, 6, [2, 3]),
    ]
    assert results[0]["workload_digest"] != results[1]["workload_digest"]


def test_a_cp_size_that_does_not_divide_the_world_leaves_the_last_ranks_out(tmp_path):
    """cp 3 on 4 ranks: one CP group of ranks 0 to 2 runs the preset, rank 3 sits it out
    and still joins the run's verdict."""
    report = tmp_path / "report.json"
    args = ["verify", "--world-size", "4", "--preset", "cp3-no-power-of-two", "--steps", "6"]
    proc = run_cli([*args, "--report", str(report)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    (result,) = data["results"]
    assert (result["cp_size"], result["ranks"]) == (3, [0, 1, 2])
    _accounting_ok(result)
    assert result["corners"]["no_power_of_two"] > 0
    assert [r["tokens"] > 0 for r in data["ranks"]] == [True, True, True, False]


def test_report_junit_and_plot(tmp_path):
    paths = {k: tmp_path / f"out.{k}" for k in ("json", "xml", "png")}
    proc = run_cli(
        [
            "verify",
            "--world-size",
            "2",
            "--preset",
            "cp2-i1",
            "--steps",
            "12",
            "--report",
            str(paths["json"]),
            "--junit",
            str(paths["xml"]),
            "--plot",
            str(paths["png"]),
        ]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for header in ("owned/expected", "dup", "miss", "wrong", "read back", "steps"):
        assert header in proc.stdout
    assert "corners reached" in proc.stdout and "peak RSS" in proc.stdout
    suite = ET.parse(paths["xml"]).getroot()
    names = sorted(c.get("name") for c in suite.iter("testcase"))
    assert names == ["cp2-i1[seed 0, rank 0]", "cp2-i1[seed 0, rank 1]"]
    assert suite.get("failures") == "0"
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(paths["json"].read_text())
    assert data["results"][0]["corners"]["interleave_1"] > 0
    assert set(data["checks"]) == {str(i) for i in range(12)}


def test_a_preset_run_as_defined_enforces_and_reaches_its_corners(tmp_path):
    """No --steps: the promise is enforced, and every promised corner was reached."""
    report = tmp_path / "report.json"
    proc = run_cli(["verify", "--world-size", "2", "--preset", "groups-1", "--report", str(report)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (result,) = json.loads(report.read_text())["results"]
    assert result["coverage_enforced"] is True
    assert result["missing_corners"] == []
    assert all(result["corners"][c] > 0 for c in result["promised"])
    _accounting_ok(result)
