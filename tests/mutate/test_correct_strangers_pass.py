"""The harness accepts a correct implementation that shares none of our structure.

Mutation testing (docs/mutation.md) shows the harness rejects wrong code; this
is the other half of SPEC.md section 7: a right implementation must pass.
`tests/impls/pure_python.py` is plain Python lists (no Triton, no staging
buffers, nothing from `cp_blocktables`), run through the default sweep on 8
ranks, so every preset of `make verify` is included and none is skipped.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness_proc import child_env, leftover_processes, run_cli  # noqa: E402

from cp_blocktables.harness.presets import PRESETS, SWEEP  # noqa: E402

pytestmark = pytest.mark.multirank

PURE = "tests.impls.pure_python:BlockTables"


def test_pure_python_implementation_passes_the_default_sweep(tmp_path):
    env = child_env()
    report = tmp_path / "report.json"
    proc = run_cli(
        ["verify", "--world-size", "8", "--impl", PURE, "--quiet", "--report", str(report)],
        timeout=900,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    verdict = data["implementations"][PURE]
    assert (verdict["passed"], verdict["violated_checks"], verdict["first_violation"]) == (
        True,
        [],
        None,
    )
    # A seed-shaped class: every preset runs but those that need SPEC.md section 8's
    # kernel block sizes, which are listed as not supported, never as passed.
    needs_kbs = {n for n in SWEEP if "kernel_block_sizes" in PRESETS[n].constructor_needs()}
    ran = {r["preset"] for r in data["results"]}
    assert needs_kbs and ran == set(SWEEP) - needs_kbs
    for name in needs_kbs:
        assert any(u.startswith(f"{name}:") for u in verdict["unsupported"]), name
    for r in data["results"]:
        assert r["steps_checked"] == r["steps_planned"] and r["violations"] == []
        assert not (r["coverage_enforced"] and r["missing_corners"]), r["preset"]
    assert leftover_processes(env["CP_BLOCKTABLES_TEST_MARKER"]) == []
