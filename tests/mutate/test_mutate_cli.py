"""`cp-blocktables mutate` end to end: usage errors, a dry run, and a two-mutant run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness_proc import run_cli  # noqa: E402

pytest.importorskip("cosmic_ray")


def test_unknown_module_is_bad_usage():
    proc = run_cli(["mutate", "--modules", "reference", "--dry-run"])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no such implementation module" in proc.stderr


def test_dry_run_counts_and_samples_without_running(tmp_path):
    proc = run_cli(
        [
            "mutate",
            "--dry-run",
            "--modules",
            "buffers",
            "--sample",
            "3",
            "--work-dir",
            str(tmp_path),
        ]
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 modules: cp_blocktables/buffers.py" in proc.stdout
    assert "3 to run (sample of 3, seed 0)" in proc.stdout
    assert (tmp_path / "session.sqlite").is_file()
    config = (tmp_path / "cosmic-ray.toml").read_text()
    assert "cpbt_mutant.block_tables:BlockTables" in config and 'name = "local"' in config


@pytest.mark.multirank
def test_a_two_mutant_sample_is_run_classified_and_reported(tmp_path):
    report = tmp_path / "mutate.json"
    args = ["mutate", "--modules", "kernels", "--sample", "2", "--seed", "7"]
    args += ["--report", str(report), "--allowlist", str(tmp_path / "none.md")]
    proc = run_cli(args, timeout=900)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    assert data["mutants_run"] == 2 and data["sample"] == 2
    assert data["killed"] + data["timeout"] + data["survived"] + data["incompetent"] == 2
    assert data["modules"] == ["cp_blocktables/kernels.py"] or all(
        m.startswith("cp_blocktables/kernels/") for m in data["modules"]
    )
    assert proc.returncode == (1 if data["unexplained_survivors"] else 0)
    for v in data["verdicts"]:
        assert v["diff"].startswith("--- a/cp_blocktables/kernels")
