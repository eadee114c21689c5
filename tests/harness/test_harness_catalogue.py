"""Every deliberately wrong implementation fails the harness, naming the right check."""

from __future__ import annotations

import json
import shlex
import sys

import pytest
from harness_proc import ROOT, run_cli

sys.path.insert(0, str(ROOT))
from tests.wrong_impls.catalogue import CATALOGUE  # noqa: E402

pytestmark = pytest.mark.multirank

STAND_IN = "tests.wrong_impls.stand_in:StandInBlockTables"


@pytest.mark.long
def test_every_wrong_implementation_is_caught_and_the_stand_in_passes(tmp_path):
    """One spawned world runs the stand-in and the whole catalogue (fail-fast per impl)."""
    assert len(CATALOGUE) >= 12
    report = tmp_path / "report.json"
    impls = [STAND_IN, *(spec for spec, _ in CATALOGUE.values())]
    args = [  # the default sweep: every defect class must be caught by it, not by a drill
        "verify",
        "--world-size",
        "8",
        "--fail-fast",
        "--quiet",
        "--report",
        str(report),
    ]
    for spec in impls:
        args += ["--impl", spec]
    proc = run_cli(args, timeout=3600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    verdicts = json.loads(report.read_text())["implementations"]
    stand_in = verdicts[STAND_IN]
    assert (stand_in["passed"], stand_in["violated_checks"], stand_in["first_violation"]) == (
        True,
        [],
        None,
    )
    missed = {
        name: verdicts[spec]
        for name, (spec, check) in CATALOGUE.items()
        if verdicts[spec]["passed"] or check not in verdicts[spec]["violated_checks"]
    }
    assert missed == {}, f"not caught by the check they break: {missed}"
    for name, (spec, _) in CATALOGUE.items():
        assert verdicts[spec]["first_violation"].startswith("check "), name


def test_one_wrong_implementation_alone_exits_1_with_a_repro_that_reproduces():
    spec, _ = CATALOGUE["wrong_owner"]
    proc = run_cli(
        ["verify", "--world-size", "4", "--preset", "default", "--steps", "6", "--impl", spec]
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert "FAIL" in out and "first violation:" in out
    first = out.split("first violation:\n", 1)[1].splitlines()[0].strip()
    assert first.startswith("check 1 ") and "step " in first and "rank " in first
    repro = next(line for line in out.splitlines() if line.startswith("reproduce: "))
    argv = shlex.split(repro.removeprefix("reproduce: "))
    assert argv[1:4] == ["-m", "cp_blocktables", "verify"]
    assert "--seed" in argv and "--world-size" in argv and spec in argv
    again = run_cli(argv[3:])
    assert again.returncode == 1
    assert first in again.stdout
