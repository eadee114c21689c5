"""The report: verdict rules, the table, JUnit cases per rank, JSON and the repro line."""

from __future__ import annotations

import io
import json
import xml.etree.ElementTree as ET

import pytest

from cp_blocktables.harness.checks import Violation
from cp_blocktables.harness.options import VerifyOptions
from cp_blocktables.harness.report import Progress, RunReport


def _result(violations=(), missing=(), enforced=True, impl="cp_blocktables:BlockTables"):
    stats = [
        {
            "group": 0,
            "cp_rank": k,
            "rank": 2 + k,
            "owned": 10,
            "expected": 10,
            "duplicates": 0,
            "misses": 0,
            "wrong_slots": 0,
            "read_back": 9,
            "read_expected": 9,
        }
        for k in range(2)
    ]
    return {
        "impl": impl, "preset": "cp2-i1", "cp_size": 2, "cp_interleave": 1, "cp_group": 1,
        "ranks": [2, 3], "seed": 8, "groups": [{"block_size": 16, "sharded": True,
                                                "enabled": True, "window": 0}],
        "steps_planned": 5, "steps_checked": 5, "tokens_checked": 20,
        "corners": {"decode": 3, "row_reused": 0}, "promised": ["decode", "row_reused"],
        "missing_corners": list(missing), "coverage_enforced": enforced, "stats": stats,
        "violation_counts": {str(v.check): 1 for v in violations},
        "violations": [v.as_dict() for v in violations], "plot": None, "wall_s": 1.0,
        "workload_digest": "x",
    }  # fmt: skip


def _report(*results, **opts) -> RunReport:
    o = VerifyOptions(impls=["cp_blocktables:BlockTables"], presets=["cp2-i1"], seed=7, **opts)
    ranks = [{"rank": r, "max_rss_mb": 200.0, "wall_s": 3.0, "tokens": 20} for r in range(4)]
    return RunReport(o, 4, "gloo", list(results), ranks)


BAD = Violation(
    1,
    "wrong slot",
    3,
    group=0,
    request=5,
    row=2,
    position=40,
    token=7,
    rank=1,
    expected="slot 16",
    actual="slot 17",
)


def test_clean_run_passes_and_renders_the_table():
    rep = _report(_result())
    assert rep.passed()
    text = rep.render()
    assert "PASS" in text and "owned/expected" in text and "decode*=3" in text
    assert "      10/10      " in text


def test_violation_fails_with_first_violation_and_repro():
    rep = _report(_result([BAD]), steps=5)
    assert not rep.passed()
    text = rep.render()
    assert "first violation:" in text and BAD.describe() in text
    assert "(cp rank 1 is global rank 3)" in text
    repro = text.rstrip().splitlines()[-1]
    assert repro.startswith("reproduce: ")
    assert repro.endswith(
        " -m cp_blocktables verify --world-size 2 --preset cp2-i1 --seed 8 --steps 5"
    )


@pytest.mark.parametrize("enforced", [True, False], ids=["as-defined", "overridden"])
def test_missing_promised_corner_fails_only_when_enforced(enforced):
    rep = _report(_result(missing=["row_reused"], enforced=enforced))
    assert rep.passed() is not enforced
    if enforced:
        assert "promised corners it never reached: row_reused" in rep.render()


def test_junit_has_a_case_per_rank_and_fails_the_right_one():
    suite = ET.fromstring(_report(_result([BAD])).junit())
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    assert set(cases) == {"cp2-i1[seed 8, rank 2]", "cp2-i1[seed 8, rank 3]"}
    assert cases["cp2-i1[seed 8, rank 2]"].find("failure") is None
    assert "wrong slot" in cases["cp2-i1[seed 8, rank 3]"].find("failure").get("message")
    assert suite.get("failures") == "1"


def test_json_holds_every_figure_and_per_impl_verdicts():
    other = "tests.wrong_impls.catalogue:WrongOwner"
    rep = _report(_result(), _result([BAD], impl=other))
    data = json.loads(json.dumps(rep.as_dict()))
    assert data["passed"] is False
    assert data["implementations"]["cp_blocktables:BlockTables"]["passed"] is True
    assert data["implementations"][other]["violated_checks"] == [1]
    assert data["results"][1]["repro"].endswith(f"--impl {other}")
    assert data["ranks"][0]["max_rss_mb"] == 200.0


def test_progress_draws_only_when_enabled():
    buf = io.StringIO()
    p = Progress(4, enabled=True, stream=buf)
    p.advance(4, "done")
    p.close()
    assert "[" + "#" * 30 + "] 4/4 steps done" in buf.getvalue()
    quiet = io.StringIO()
    Progress(4, enabled=False, stream=quiet).advance(2)
    assert quiet.getvalue() == ""
