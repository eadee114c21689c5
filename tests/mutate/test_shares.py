"""A run split into shares: every mutant in exactly one, a time limit that leaves the rest
pending and no process behind, and a resume that picks up what is pending."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import types
import weakref
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness_proc import child_env, leftover_processes, run_cli  # noqa: E402

pytest.importorskip("cosmic_ray")

from cp_blocktables.mutate import record, session, shares  # noqa: E402
from cp_blocktables.mutate.cli_args import add_mutate_arguments  # noqa: E402
from cp_blocktables.mutate.command import run_mutate  # noqa: E402
from cp_blocktables.mutate.scratch import ScratchPackage  # noqa: E402

# kernels.layout is small (110 mutants), groups-0 the cheapest preset: seconds a mutant.
SMALL = ["--modules", "kernels.layout", "--preset", "groups-0", "--no-confirm"]


def _pending_ids(db: Path) -> set[str]:
    from cosmic_ray.work_db import WorkDB, use_db

    with use_db(str(db), WorkDB.Mode.open) as wdb:
        return {item.job_id for item in wdb.pending_work_items}


def test_shares_split_the_selected_mutants_exactly(tmp_path):
    proc = run_cli(["mutate", "--dry-run", *SMALL, "--shares", "3", "--work-dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    to_run = int(proc.stdout.split(" to run")[0].rsplit(" ", 1)[1])
    assert to_run > 30 and "in 3 shares" in proc.stdout
    parts = [_pending_ids(tmp_path / f"share-{k}" / "session.sqlite") for k in range(3)]
    assert sum(len(p) for p in parts) == len(set().union(*parts)) == to_run  # disjoint, complete
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    configs = {(tmp_path / f"share-{k}" / "cosmic-ray.toml").read_text() for k in range(3)}
    assert all('module-path = ["src/cpbt_mutant/kernels/layout.py"]' in c for c in configs)
    assert shares.existing_count(tmp_path) == 3


def test_a_sample_is_split_like_the_whole(tmp_path):
    args = ["mutate", "--dry-run", *SMALL, "--sample", "7", "--shares", "2"]
    proc = run_cli([*args, "--work-dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    parts = [_pending_ids(tmp_path / f"share-{k}" / "session.sqlite") for k in range(2)]
    assert sorted(map(len, parts)) == [3, 4] and not parts[0] & parts[1]


@pytest.mark.long
@pytest.mark.multirank
def test_a_time_limit_leaves_the_rest_pending_and_a_resume_runs_it(tmp_path):
    work = tmp_path / "work"
    report = tmp_path / "report.json"
    base = ["mutate", *SMALL, "--sample", "2", "--jobs", "2", "--work-dir", str(work)]
    env = child_env()
    # The baseline alone outlasts one second: the run stops before any mutant ends.
    proc = run_cli([*base, "--time-limit", "1", "--report", str(report)], env=env)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "--resume --work-dir" in proc.stdout
    data = json.loads(report.read_text())
    assert data["pending"] == 2 and data["mutants_run"] == 0
    time.sleep(0.5)
    assert leftover_processes(env["CP_BLOCKTABLES_TEST_MARKER"]) == []
    ledger = tmp_path / "record.tsv"
    resumed = ["mutate", "--resume", *SMALL, "--jobs", "2", "--work-dir", str(work)]
    proc = run_cli([*resumed, "--report", str(report), "--record", str(ledger)], timeout=600)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr  # 1: a layout survivor
    data = json.loads(report.read_text())
    assert data["pending"] == 0 and data["mutants_run"] + data["not_reached"] == 2
    assert all(v["module"] == "cp_blocktables/kernels/layout.py" for v in data["verdicts"])
    ran = {v["id"]: v["outcome"] for v in data["verdicts"]}
    assert set(record.read(ledger)) == set(ran)
    # A new run of the same sample elsewhere, with the ledger: nothing runs, same verdicts.
    again = ["mutate", *SMALL, "--sample", "2", "--work-dir", str(tmp_path / "again")]
    proc = run_cli([*again, "--record", str(ledger), "--report", str(report)], timeout=600)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    assert "2 mutants recorded in" in proc.stdout and "; 0 to run" in proc.stdout
    data = json.loads(report.read_text())
    assert data["from_ledger"] == 2 and {v["id"]: v["outcome"] for v in data["verdicts"]} == ran


def _wait_for(condition, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the run never got there"
        time.sleep(0.1)


def _coverage_runs(src: Path) -> list[int]:
    """The coverage pre-pass's processes on the copy `src`."""
    pids = set(shares._pids_naming(["cpbt-reach-"]))
    return [p for p in shares._pids_naming([str(src)]) if p in pids]


@pytest.mark.multirank
@pytest.mark.parametrize("stage", ["baseline", "pre-pass", "exec"])
def test_sigterm_stops_the_run_with_no_process_behind(tmp_path, stage):
    work = tmp_path / "work"
    env = child_env()
    args = ["mutate", *SMALL, "--sample", "2", "--jobs", "2", "--work-dir", str(work)]
    run = subprocess.Popen(
        [sys.executable, "-m", "cp_blocktables", *args],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        if stage == "baseline":  # the unmutated copy's probe, its ranks forked or forking
            _wait_for(lambda: shares._pids_naming([str(work / "share-0" / "src")]))
        elif stage == "pre-pass":  # the same under `coverage run`, its config in a temp dir
            _wait_for(lambda: _coverage_runs(work / "share-0" / "src"))
        else:  # a share's `cosmic-ray exec` started
            _wait_for(lambda: (work / "share-0" / "exec.log").exists())
        time.sleep(0.5)
        run.terminate()
        _, err = run.communicate(timeout=60)
    finally:
        run.kill()
    assert run.returncode == 130 and "interrupted" in err, err
    time.sleep(0.5)
    assert leftover_processes(env["CP_BLOCKTABLES_TEST_MARKER"]) == []


def test_stopping_kills_the_probes_running_on_a_share(tmp_path):
    root = tmp_path / "share-0" / "src"
    root.mkdir(parents=True)
    probe = subprocess.Popen(  # a stand-in probe: its own session, the copy on its command line
        [sys.executable, "-c", "import time; time.sleep(60)", "--scratch", str(root)],
        start_new_session=True,
    )
    deadline = time.monotonic() + 10
    while str(root) not in Path(f"/proc/{probe.pid}/cmdline").read_text(errors="replace"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    share = shares.Share(0, tmp_path / "share-0", ScratchPackage(root=root, package="x"))
    shares._stop([], [share])
    assert probe.wait(timeout=10) != 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--jobs", "0"], "--jobs must be at least 1"),
        (["--shares", "0"], "--shares must be at least 1"),
        (["--time-limit", "0"], "--time-limit must be positive"),
        (["--resume"], "--resume needs the --work-dir"),
        (["--resume", "--work-dir", "WORK", "--sample", "3"], "no --sample or --shares"),
        (["--resume", "--work-dir", "WORK"], "no mutation session in"),
    ],
    ids=[
        "jobs-0",
        "shares-0",
        "time-limit-0",
        "resume-without-work-dir",
        "resume-sample",
        "resume-nothing",
    ],  # fmt: skip
)
def test_bad_options_are_usage_errors(tmp_path, capsys, args, message):
    parser = argparse.ArgumentParser()
    add_mutate_arguments(parser)
    args = [str(tmp_path) if a == "WORK" else a for a in args]
    assert run_mutate(parser.parse_args(["--dry-run", *args])) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "share-0").exists()


def test_pending_is_counted_without_loading_the_session(tmp_path):
    proc = run_cli(["mutate", "--dry-run", *SMALL, "--sample", "5", "--work-dir", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert session.count_pending(tmp_path / "session.sqlite") == 5


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_sigterm_dropped_inside_a_weakref_callback_still_stops_the_run(tmp_path, monkeypatch):
    """Python prints and drops an exception raised in a weakref callback; a SIGTERM whose
    handler ran there must still stop the run, and the fake `exec` it started."""
    started: list[subprocess.Popen] = []

    def fake_exec(sh, env):
        started.append(subprocess.Popen(["sleep", "60"], start_new_session=True))
        return started[-1]

    monkeypatch.setattr(shares, "_start_exec", fake_exec)
    monkeypatch.setattr(session, "count_pending", lambda db: 1)
    share = shares.Share(0, tmp_path, types.SimpleNamespace(root=tmp_path / "no-copy"))

    class Thing:
        pass

    with pytest.raises(KeyboardInterrupt), shares.sigterm_unwinds():
        thing = Thing()
        ref = weakref.ref(thing, lambda _: os.kill(os.getpid(), signal.SIGTERM))
        del thing  # the callback runs, the handler raises inside it, Python drops that
        assert ref() is None and shares._stop_signal == [signal.SIGTERM]
        shares.execute([share], {}, 1, False, None)
    assert started and started[0].poll() is not None  # killed on the way out
