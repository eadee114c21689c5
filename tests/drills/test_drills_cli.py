"""`cp-blocktables drill` from the command line: bad input is exit 2 with a message and
nothing started or written; a spawned run reports per stage and reproduces a failure."""

from __future__ import annotations

import json
import multiprocessing

import pytest
from harness_proc import child_env, leftover_processes, run_cli

from cp_blocktables import cli
from cp_blocktables.drills.fault_inject import FAULT_ENV, Fault

NULL_BLOCK_ERRORS = [
    pytest.param(
        ["--sizes", "4,3", "--preset", "cp2-i1"],
        "preset cp2-i1 needs cp_size 2, which does not divide world size 3 of --sizes 4,3",
        id="size-not-multiple-of-cp",
    ),
    pytest.param(
        ["--sizes", "8", "--world-size", "4"],
        "--sizes: world size 8 is outside [1, 4] (the ranks launched)",
        id="size-too-big",
    ),
    pytest.param(
        ["--impl", "nosuch_mod:X"],
        "--impl 'nosuch_mod:X': cannot import module 'nosuch_mod'",
        id="impl-no-module",
    ),
    pytest.param(
        ["--impl", "cp_blocktables:Nope"],
        "--impl 'cp_blocktables:Nope': module 'cp_blocktables' has no attribute 'Nope'",
        id="impl-no-attr",
    ),
    pytest.param(
        ["--impl", "cp_blocktables"],
        "--impl 'cp_blocktables': expected MODULE:ATTR",
        id="impl-no-colon",
    ),
    pytest.param(
        ["--cp-interleave", "3"],
        "cp_interleave=3 does not divide block_sizes[0]=16 of DCP-sharded group 0",
        id="interleave",
    ),
    pytest.param(["--preset", "nope"], "unknown preset 'nope'", id="preset"),
    pytest.param(["--backend", "nccl"], "--backend nccl needs torchrun", id="nccl-spawned"),
]

FAULTS_ERRORS = [
    pytest.param(["--nproc", "1"], "--nproc must be at least 2", id="one-rank"),
    pytest.param(["--preset", "nope"], "unknown preset 'nope'", id="preset"),
    pytest.param(["--preset", "default"], "preset default needs cp_size 4", id="cp-vs-nproc"),
]

MALFORMED = [
    pytest.param(
        ["null-block", "--sizes", "4,x"],
        "expected world sizes as comma-separated positive ints",
        id="sizes",
    ),
    pytest.param(
        ["null-block", "--sizes", "0"],
        "expected world sizes as comma-separated positive ints",
        id="size-0",
    ),
    pytest.param(
        ["null-block", "--timeout", "0"], "expected a positive float, got 0", id="timeout"
    ),
    pytest.param(["null-block", "--steps", "x"], "expected a positive int, got 'x'", id="steps"),
    pytest.param(["faults", "--scenario", "bogus"], "invalid choice: 'bogus'", id="scenario"),
    pytest.param([], "the following arguments are required: ACTION", id="no-action"),
]


@pytest.fixture(autouse=True)
def _no_torchrun_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", FAULT_ENV):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def report(tmp_path):
    """Where a run would write its report; after the test: none written, no process started."""
    before = {p.pid for p in multiprocessing.active_children()}
    path = tmp_path / "r.json"
    yield path
    assert not path.exists()
    assert {p.pid for p in multiprocessing.active_children()} <= before


@pytest.mark.parametrize(("args", "message"), NULL_BLOCK_ERRORS)
def test_null_block_refuses_bad_input(args, message, capsys, report):
    assert cli.main(["drill", "null-block", *args, "--report", str(report)]) == 2
    err = capsys.readouterr().err
    assert f"cp-blocktables drill: error: {message}" in err and "Traceback" not in err


@pytest.mark.parametrize(("args", "message"), FAULTS_ERRORS)
def test_faults_refuses_bad_input(args, message, capsys, report):
    assert cli.main(["drill", "faults", *args, "--report", str(report)]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("args", "message"), MALFORMED)
def test_malformed_flags_are_usage_errors(args, message, capsys, report):
    with pytest.raises(SystemExit) as exc:
        cli.main(["drill", *args, "--report", str(report)] if args else ["drill"])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_malformed_torchrun_environment(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "one")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.main(["drill", "null-block"]) == 2
    assert "malformed torchrun environment" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("explode:rank=1:step=2", "KIND is raise or hang"),
        ("raise:rank=1", "expected KIND:rank=R:step=S"),
        ("raise:rank=x:step=2", "expected KIND:rank=R:step=S"),
        ("raise:rank=1:step=2:when=3", "fields rank, step, attempt"),
    ],
    ids=["kind", "no-step", "not-int", "unknown-field"],
)
def test_malformed_fault_injection_is_refused(value, message, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, value)
    with pytest.raises(ValueError, match=message):
        Fault.from_environ(1)


@pytest.mark.parametrize(
    ("rank", "attempt", "armed"),
    [(1, "0", True), (0, "0", False), (1, "1", False)],
    ids=["this-rank", "other-rank", "later-attempt"],
)
def test_fault_injection_targets_one_rank_and_attempt(rank, attempt, armed, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "raise:rank=1:step=2:attempt=0")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
    assert (Fault.from_environ(rank) is not None) == armed


@pytest.mark.multirank
def test_a_spawned_run_reports_each_stage_and_reproduces_a_failure(tmp_path):
    env = child_env()
    report = tmp_path / "drill.json"
    bad = "tests.wrong_impls.drill_catalogue:RedirectLatchedOnError"
    args = ["drill", "null-block", "--world-size", "2", "--preset", "cp2-i1", "--steps", "4"]
    proc = run_cli(
        [*args, "--impl", "cp_blocktables:BlockTables", "--impl", bad, "--report", str(report)],
        env=env,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    for stage in ("serve 1", "warm-up", "serve 2"):
        assert f"{stage}  " in out
    assert (
        f"FAIL: implementation {bad}: preset cp2-i1, world size 2, CP group 0, stage warm-up" in out
    )
    assert "flag-restored" in out and "after an exception in the warm-up body" in out
    data = json.loads(report.read_text())
    assert data["implementations"]["cp_blocktables:BlockTables"]["passed"]
    repro = next(line for line in out.splitlines() if line.startswith("reproduce: "))
    assert repro.endswith(f"--world-size 2 --preset cp2-i1 --seed 0 --steps 4 --impl {bad}")
    assert leftover_processes(env["CP_BLOCKTABLES_TEST_MARKER"]) == []
