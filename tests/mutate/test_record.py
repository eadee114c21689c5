"""The ledger: its format, merges, and that a mutant it names is never run again, found by
the same id before `exec` as after."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness_proc import run_cli  # noqa: E402

pytest.importorskip("cosmic_ray")

from cp_blocktables.mutate import outcome, record, session  # noqa: E402
from cp_blocktables.mutate.session import RECORDED_MARKER  # noqa: E402

TINY = """\
def f(x, y=2):
    if x > 100:
        return x - 1
    return [x * y for _ in range(3)]


def g(x):
    return not x or x + 1 == 4
"""
MODULE = "pkg/tiny.py"


def _verdict(mid: str, cls: str, **kw) -> outcome.Verdict:
    return outcome.Verdict(mid, "m.py", 1, "op", None, cls, "diff", **kw)


@pytest.fixture
def ledger(tmp_path) -> Path:
    return tmp_path / "record.tsv"


def test_a_written_ledger_reads_back_sorted_with_its_flags(ledger):
    vs = [
        _verdict("m-00000000bb", "killed", by_confirm=True),
        _verdict("m-00000000aa", "equivalent", not_reached=True),
        _verdict("m-00000000cc", "timeout"),
        _verdict("m-00000000dd", "survived", recorded=True),  # read from a ledger: not merged
    ]
    assert record.merge(ledger, vs, "2026-12-02") == 3
    rows = [x for x in ledger.read_text().splitlines() if not x.startswith("#")]
    assert rows == [
        "m-00000000aa\tsurvived\tnot-reached\t2026-12-02",
        "m-00000000bb\tkilled\tconfirm\t2026-12-02",
        "m-00000000cc\ttimeout\t-\t2026-12-02",
    ]
    back = record.read(ledger)
    assert back["m-00000000bb"].by_confirm and not back["m-00000000bb"].not_reached
    assert back["m-00000000aa"].not_reached and back["m-00000000aa"].cls == "survived"


def test_a_later_verdict_replaces_an_earlier_one(ledger):
    record.merge(ledger, [_verdict("m-00000000aa", "survived")], "2026-12-01")
    assert record.merge(ledger, [_verdict("m-00000000aa", "survived")], "2026-12-02") == 0
    assert record.merge(ledger, [_verdict("m-00000000aa", "killed")], "2026-12-03") == 1
    assert record.read(ledger)["m-00000000aa"] == record.Entry("killed", (), "2026-12-03")


def test_merging_another_hosts_ledger(ledger, tmp_path):
    other = tmp_path / "other.tsv"
    record.merge(ledger, [_verdict("m-00000000aa", "survived"), _verdict("m-00000000bb", "killed")])
    record.merge(other, [_verdict("m-00000000aa", "killed"), _verdict("m-00000000cc", "timeout")])
    assert record.merge_files(ledger, other) == 2
    assert {k: e.cls for k, e in record.read(ledger).items()} == {
        "m-00000000aa": "killed",
        "m-00000000bb": "killed",
        "m-00000000cc": "timeout",
    }


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("m-00000000aa\tkilled\t-", "expected 4 tab-separated fields, got 3"),
        ("m-0aa\tkilled\t-\t2026-12-02", "is not a mutant id"),
        ("m-00000000aa\tlost\t-\t2026-12-02", "unknown class or flag"),
        ("m-00000000aa\tkilled\tlate\t2026-12-02", "unknown class or flag"),
    ],
    ids=["three-fields", "short-id", "unknown-class", "unknown-flag"],
)
def test_a_malformed_line_is_named(ledger, line, message):
    ledger.write_text(f"# header\n{line}\n")
    with pytest.raises(record.RecordError, match=f"record.tsv:2: .*{message}"):
        record.read(ledger)


def test_no_ledger_reads_empty(ledger):
    assert record.read(ledger) == {}


def _init(home: Path, db: str) -> None:
    (home / "pkg").mkdir(exist_ok=True)
    (home / "pkg" / "__init__.py").write_text("")
    (home / MODULE).write_text(TINY)
    fail = [sys.executable, "-c", "import sys; sys.exit(1)"]
    session.write_config(home / "cosmic-ray.toml", [Path(MODULE)], fail, 60)
    session.cosmic_ray(["init", "cosmic-ray.toml", db], cwd=home)


def test_a_recorded_mutant_is_found_by_the_id_exec_gives_it(tmp_path):
    """Run every mutant of a small module (the test command kills all), record half of
    them, then skip the recorded ones in a fresh session: exactly those are skipped."""
    _init(tmp_path, "ran.sqlite")
    shutil.copyfile(tmp_path / "ran.sqlite", tmp_path / "fresh.sqlite")
    session.cosmic_ray(["exec", "cosmic-ray.toml", "ran.sqlite"], cwd=tmp_path)
    origins = {MODULE: "orig/tiny.py"}
    ran = outcome.verdicts(session.read_mutants(tmp_path / "ran.sqlite"), origins, {})
    assert len(ran) > 20 and {v.outcome for v in ran} == {"killed"}
    assert len({v.id for v in ran}) == len(ran)
    kept = ran[::2]
    ledger = tmp_path / "record.tsv"
    record.merge(ledger, kept)
    entries = record.read(ledger)
    fresh = tmp_path / "fresh.sqlite"
    assert record.skip_recorded(fresh, tmp_path, origins, entries) == len(kept)
    mutants = session.read_mutants(fresh)
    skipped = {session.recorded_id(m.output) for m in mutants if m.worker_outcome == "skipped"}
    assert skipped == {v.id for v in kept}
    assert session.count_pending(fresh) == len(ran) - len(kept)
    again = outcome.verdicts(mutants, origins, {}, entries)
    assert {v.id: v.outcome for v in again} == {v.id: "killed" for v in kept}
    assert all(v.recorded and v.diff == "" for v in again)
    assert (tmp_path / MODULE).read_text() == TINY


def test_verdicts_follow_code_moved_to_another_module(tmp_path):
    """Record every mutant of a module under its old name, then move its text, unchanged, to
    a new name: every entry is copied to the id a run of the new module gives that mutant,
    so a fresh session skips them all; an entry the new id already has stays, and so do the
    old ids' entries (the old module may still hold an identical line)."""
    _init(tmp_path, "ran.sqlite")
    for name in ("old.sqlite", "moved.sqlite"):
        shutil.copyfile(tmp_path / "ran.sqlite", tmp_path / name)
    session.cosmic_ray(["exec", "cosmic-ray.toml", "ran.sqlite"], cwd=tmp_path)
    mutants = session.read_mutants(tmp_path / "ran.sqlite")
    before = outcome.verdicts(mutants, {MODULE: "orig/old.py"}, {})
    after = outcome.verdicts(mutants, {MODULE: "orig/new.py"}, {})
    assert len(before) > 20 and not {v.id for v in before} & {v.id for v in after}
    entries = {v.id: record.Entry("killed", (), "2026-12-01") for v in before}
    kept = record.Entry("survived", (), "2026-12-05")
    entries[after[0].id] = kept
    new_origins = {MODULE: "orig/new.py"}
    pairs = record.moved_ids(
        tmp_path / "moved.sqlite", tmp_path, new_origins, {"orig/new.py": "orig/old.py"}
    )
    assert sorted(pairs) == sorted((b.id, a.id) for b, a in zip(before, after))
    carried = record.carry(entries, pairs)
    assert len(carried) == len(before) - 1 and entries[after[0].id] == kept
    assert set(entries) == {v.id for v in after} | {v.id for v in before}
    fresh = tmp_path / "old.sqlite"
    assert record.skip_recorded(fresh, tmp_path, new_origins, entries) == len(after)


def test_a_recorded_survivor_is_classed_by_the_allowlist_of_the_day():
    entry = record.Entry("survived", ("not-reached",), "2026-12-01")
    m = session.Mutant(
        "job", "src/x.py", "core/Op", 0, 3, "f", "skipped", None,
        f"{RECORDED_MARKER} m-00000000aa", "",
    )  # fmt: skip
    ledger = {"m-00000000aa": entry}
    [v] = outcome.verdicts([m], {"src/x.py": "x.py"}, {"m-00000000aa": "equivalent"}, ledger)
    assert (v.id, v.module, v.outcome, v.not_reached, v.recorded) == (
        "m-00000000aa", "x.py", "equivalent", True, True,
    )  # fmt: skip
    [v] = outcome.verdicts([m], {}, {}, ledger)
    assert v.outcome == "survived"
    summary = outcome.summarize([v], 1)
    assert (summary["unexplained_survivors"], summary["from_ledger"]) == (1, 1)
    assert "delete its line from the ledger" in outcome.render(summary, [v])


def test_moved_from_needs_a_ledger_and_one_module():
    proc = run_cli(["mutate", "--dry-run", "--moved-from", "buffers", "--modules", "staged"])
    assert proc.returncode == 2 and "--moved-from needs --record" in proc.stderr


def test_merge_record_needs_a_ledger_and_an_existing_other(tmp_path):
    proc = run_cli(["mutate", "--merge-record", str(tmp_path / "x.tsv")])
    assert proc.returncode == 2 and "--merge-record needs the --record" in proc.stderr
    args = ["mutate", "--record", str(tmp_path / "r.tsv"), "--merge-record"]
    proc = run_cli([*args, str(tmp_path / "none.tsv")])
    assert proc.returncode == 2 and "no ledger at" in proc.stderr
    record.merge(tmp_path / "o.tsv", [_verdict("m-00000000aa", "killed")])
    proc = run_cli([*args, str(tmp_path / "o.tsv")])
    assert proc.returncode == 0 and "1 entries" in proc.stdout
    assert set(record.read(tmp_path / "r.tsv")) == {"m-00000000aa"}
