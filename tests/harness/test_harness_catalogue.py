"""Every deliberately wrong implementation fails the harness, naming the right check."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest
from harness_proc import ROOT, run_cli

sys.path.insert(0, str(ROOT))
from cp_blocktables.harness.presets import SWEEP  # noqa: E402
from tests.wrong_impls.catalogue import CATALOGUE, CAUGHT_BY  # noqa: E402

pytestmark = pytest.mark.multirank

STAND_IN = "tests.wrong_impls.stand_in:StandInBlockTables"


def _verify(report: Path, impls: list[str], presets: tuple[str, ...] = ()) -> dict:
    """One spawned world of 8 ranks, fail-fast per implementation: the JSON report."""
    args = ["verify", "--world-size", "8", "--fail-fast", "--quiet", "--report", str(report)]
    for name in presets:
        args += ["--preset", name]
    for spec in impls:
        args += ["--impl", spec]
    proc = run_cli(args, timeout=3600)
    assert proc.returncode == (0 if impls == [STAND_IN] else 1), proc.stdout + proc.stderr
    return json.loads(report.read_text())


def test_every_entry_names_a_preset_of_the_default_sweep():
    assert set(CAUGHT_BY) == set(CATALOGUE)
    assert set(CAUGHT_BY.values()) <= set(SWEEP)


@pytest.mark.long
def test_every_wrong_implementation_is_caught_and_the_stand_in_passes(tmp_path):
    """The stand-in passes the default sweep, and the sweep fails every catalogue entry
    through the check it breaks.

    Each entry runs the whole sweep, starting at the preset that catches it
    (`CAUGHT_BY`) and then in the sweep's order; entries that start alike share a
    world. Under `--fail-fast` any order of the same presets fails the same
    implementations, and starting where an entry is caught spares the presets it
    passes: for the entries on the real kernels, minutes of interpreter time. The
    test also requires the run to stop at that preset, so `CAUGHT_BY` stays true."""
    assert len(CATALOGUE) >= 12
    stand_in = _verify(tmp_path / "stand-in.json", [STAND_IN])["implementations"][STAND_IN]
    assert (stand_in["passed"], stand_in["violated_checks"], stand_in["first_violation"]) == (
        True,
        [],
        None,
    )
    starts: dict[str, list[str]] = {}
    for name, preset in CAUGHT_BY.items():
        starts.setdefault(preset, []).append(name)
    verdicts, stopped_at = {}, {}
    for preset, names in starts.items():
        order = (preset, *(p for p in SWEEP if p != preset))
        specs = [CATALOGUE[name][0] for name in names]
        report = _verify(tmp_path / f"{preset}.json", specs, order)
        verdicts.update(report["implementations"])
        for result in report["results"]:  # in run order: an entry's last is where it stopped
            stopped_at[result["impl"]] = result["preset"]
    missed = {
        name: verdicts[spec]
        for name, (spec, check) in CATALOGUE.items()
        if verdicts[spec]["passed"] or check not in verdicts[spec]["violated_checks"]
    }
    assert missed == {}, f"not caught by the check they break: {missed}"
    for name, (spec, _) in CATALOGUE.items():
        assert verdicts[spec]["first_violation"].startswith("check "), name
    moved = {n: stopped_at[s] for n, (s, _) in CATALOGUE.items() if stopped_at[s] != CAUGHT_BY[n]}
    assert moved == {}, f"caught by another preset than CAUGHT_BY says: {moved}"


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
