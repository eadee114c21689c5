"""`drill wake-up`: our implementation passes, at one size and across a resize; every wrong one
of the wake catalogue fails with the check it breaks; one without the feature is skipped."""

from __future__ import annotations

import json

import pytest

from cp_blocktables import cli
from cp_blocktables.drills.driver import run_drill_in_process_group
from cp_blocktables.drills.options import DrillOptions, plan
from cp_blocktables.drills.wake_up import sleep_points
from cp_blocktables.harness.impl_loader import DEFAULT_IMPL
from tests.wrong_impls.wake_catalogue import WAKE_CATALOGUE

STAND_IN = "tests.wrong_impls.stand_in:StandInBlockTables"


def drill(tmp_path, name: str, **kwargs) -> tuple[int, dict | None]:
    """Run the wake-up drill in this rank's process group; rank 0 also returns the report."""
    import torch.distributed as dist

    path = tmp_path / f"{name}.json"
    opts = DrillOptions(report_path=str(path), quiet=True, drill="wake-up", **kwargs)
    code = run_drill_in_process_group(opts)
    return code, json.loads(path.read_text()) if dist.get_rank() == 0 else None


@pytest.mark.long
@pytest.mark.ranks(4, timeout=600)
def test_the_wake_up_drill_passes_ours_skips_the_stand_in_and_fails_every_wrong_one(rank, tmp_path):
    specs = [DEFAULT_IMPL, STAND_IN, *(spec for spec, _ in WAKE_CATALOGUE.values())]
    code, report = drill(tmp_path, "wake", impls=specs, presets=["cp2-i1"], steps=6)
    assert code == 1
    if report is None:
        return
    verdicts = report["implementations"]
    ours = [r for r in report["records"] if r["impl"] == DEFAULT_IMPL]
    assert verdicts[DEFAULT_IMPL]["passed"], verdicts[DEFAULT_IMPL]
    assert [(r["cp_group"], r["stage"]) for r in ours] == [
        (0, "serve 1"),
        (0, "serve 2"),
        (1, "serve 1"),
        (1, "serve 2"),
    ]
    assert all(
        "2 sleeps (before steps 2, 4)" in r["summary"] for r in ours if r["stage"] == "serve 1"
    )
    assert all("3 sleeps (before steps 0, 2, 4)" in r["summary"] for r in ours[1::2])
    assert verdicts[STAND_IN]["skipped"].startswith("not supported by this implementation")
    assert not verdicts[STAND_IN]["passed"] and verdicts[STAND_IN]["failed_stage"] is None
    missed = {
        name: verdicts[spec]
        for name, (spec, check) in WAKE_CATALOGUE.items()
        if verdicts[spec]["passed"] or check not in verdicts[spec]["failed_checks"]
    }
    assert missed == {}, f"not caught by the check they break: {missed}"


@pytest.mark.ranks(4, timeout=300)
def test_the_wake_up_drill_passes_while_the_world_shrinks_and_grows(rank, tmp_path):
    code, report = drill(
        tmp_path, "resize", impls=[DEFAULT_IMPL], presets=["cp2-i1"], sizes=[4, 2, 4], steps=4
    )
    assert code == 0
    if report is None:
        return
    runs = {}
    for r in report["records"]:
        assert r["failures"] == [], r
        runs.setdefault((r["era"], r["size"], r["cp_group"]), []).append(r)
    assert sorted(runs) == [(0, 4, 0), (0, 4, 1), (1, 2, 0), (2, 4, 0), (2, 4, 1)]
    assert all([r["stage"] for r in rs] == ["serve 1", "serve 2"] for rs in runs.values())
    assert runs[(1, 2, 0)][0]["kept_state"] and not runs[(2, 4, 1)][0]["kept_state"]


# ---------------------------------------------------------------- no process group needed


def test_plan_refuses_an_unknown_drill():
    with pytest.raises(ValueError, match="unknown drill 'nap'; known: null-block, wake-up"):
        plan(DrillOptions(impls=[DEFAULT_IMPL], presets=["cp2-i1"], drill="nap"), 4)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cycles", "0"], "expected a positive int, got 0"),
        (["--cycles", "x"], "expected a positive int, got 'x'"),
    ],
)
def test_wake_up_refuses_malformed_cycles(args, message, capsys, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(SystemExit) as exc:
        cli.main(["drill", "wake-up", *args])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_wake_up_shares_null_blocks_checks_before_any_rank_starts(capsys, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert cli.main(["drill", "wake-up", "--sizes", "4,3", "--preset", "cp2-i1"]) == 2
    assert "which does not divide world size 3" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("steps", "cycles", "idle", "points"),
    [(12, 2, False, {4, 8}), (12, 2, True, {0, 4, 8}), (3, 5, False, {1, 2}), (1, 2, False, set())],
)
def test_sleep_points(steps, cycles, idle, points):
    assert sleep_points(steps, cycles, idle) == points
