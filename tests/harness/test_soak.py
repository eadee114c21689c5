"""`cp-blocktables soak`: rounds with fresh seeds until the budget is spent; the first
violation ends every rank with a line that reproduces it."""

from __future__ import annotations

import json
import time

import pytest
from harness_proc import child_env, leftover_processes, run_cli

from cp_blocktables import cli
from cp_blocktables.harness.options import VerifyOptions
from cp_blocktables.harness.soak import SoakOptions

SHORT = ["--world-size", "2", "--preset", "cp2-i1", "--preset-steps", "4"]


def test_rounds_take_fresh_seeds_that_no_cp_group_repeats():
    opts = SoakOptions(VerifyOptions(impls=["x:Y"], presets=["sweep"], seed=5, world_size=4))
    seeds = [opts.round_options(r, None, None).seed for r in range(3)]
    assert seeds == [5, 9, 13]  # CP group j of a round uses seed + j, j < world size
    assert all(opts.round_options(r, None, None).fail_fast for r in range(3))


@pytest.mark.multirank
def test_a_clean_soak_passes_with_totals_and_flat_memory(tmp_path):
    report = tmp_path / "soak.json"
    env = child_env()
    t0 = time.monotonic()
    proc = run_cli(["soak", *SHORT, "--seconds", "12", "--report", str(report)], 240, env)
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "soak: PASS" in proc.stdout and "every check held" in proc.stdout
    assert "soak: round 1 (seeds from 0)" in proc.stderr
    data = json.loads(report.read_text())
    assert data["passed"] and data["rounds"] >= 1 and data["tokens"] > 0
    # a round starts only when it is expected to end within the budget
    assert data["wall_s"] <= 12 + max(data["round_s"])
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    for r in data["ranks"]:
        assert r["tokens_per_s"] > 0
        assert r["peak_rss_mb"] < r["rss_first_round_mb"] + 64  # memory stays flat
    assert took < 200
    assert leftover_processes(env["CP_BLOCKTABLES_TEST_MARKER"]) == []


@pytest.mark.multirank
def test_a_wrong_implementation_stops_the_soak_with_its_repro(tmp_path):
    env = child_env()
    impl = "tests.wrong_impls.catalogue:WrongOwner"
    proc = run_cli(["soak", *SHORT, "--seconds", "60", "--seed", "7", "--impl", impl], 240, env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "check 1" in proc.stdout
    line = next(x for x in proc.stdout.splitlines() if x.startswith("soak: FAIL"))
    assert "round 1 (seeds from 7)" in line
    assert "reproduce: " in line and "verify --world-size 2 --preset cp2-i1 --seed 7" in line
    assert f"--impl {impl}" in line
    assert "soak: round 2" not in proc.stderr  # the first violation ends every rank
    assert leftover_processes(env["CP_BLOCKTABLES_TEST_MARKER"]) == []


def test_soak_under_torchrun_without_its_agent_store_is_a_usage_error(monkeypatch, capsys):
    for var, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert cli.main(["soak", "--preset", "cp2-i1", "--seconds", "1"]) == 2
    assert "soak needs a store that outlives the rounds" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args", [["--seconds", "0"], ["--minutes", "x"], ["--tokens", "-3"], ["--steps", "0"]]
)
def test_malformed_budgets_are_argparse_errors(args):
    with pytest.raises(SystemExit) as exc:
        cli.main(["soak", *args])
    assert exc.value.code == 2
