"""The ledger of a mutation run that outlives any one machine: every verdict, by mutant id.

Why: the full run takes longer than a machine is held, and a session
(sqlite, in `--work-dir`) lives only where it was made. The ledger is a text
file kept with the project (`docs/mutation-record.tsv`): `mutate --record
PATH` reads it before a run, so that a mutant it names is not run again, and
merges every verdict of the run into it afterwards, so that the next run,
here or on another host, starts where this one stopped.

Format: `#` comment lines, then one line per mutant, sorted by id:
`id<TAB>class<TAB>flags<TAB>date`. The class is the raw verdict (`killed`,
`timeout`, `incompetent`, `survived`); the allowlist classes a survivor when a
report is made, as it does for a mutant just run. Flags are `confirm` (killed
only by the confirming run), `not-reached` (a survivor the coverage pre-pass
recorded without running it), or `-`. The date is the day of the run.

Invariants:

* An entry is keyed by the mutant's id (`outcome.mutant_id`: the module, the
  operator, the enclosing definition and the changed lines, never positions),
  so it names the same mutant after edits elsewhere in the file. An entry
  whose mutant no longer exists (its code changed) is kept and counts
  nowhere: the changed code's mutants have new ids and run again.
* Two mutants that make the same change to two identical lines of one
  definition share an id, and so an entry: the first verdict recorded
  stands for both (one pair among the first 1,070 recorded).
* A later verdict for an id replaces the earlier one (`merge`).
* To run a recorded mutant again (the harness changed), delete its line.
* Code moved to another module, text unchanged, keeps its verdicts only
  through `--moved-from` (`moved_ids`, `carry`): the id hashes the module's
  name. The old ids' entries stay, and count nowhere unless the old module
  still holds an identical line of a same-named definition.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path

from .outcome import Verdict, mutant_id
from .session import RECORDED_MARKER, mutate_spec

CLASSES = ("killed", "timeout", "incompetent", "survived")
FLAGS = ("confirm", "not-reached")
_SURVIVOR_CLASSES = ("survived", "equivalent", "outside", "gpu")
_HEADER = (
    "# The mutation run's ledger (cp-blocktables mutate --record; docs/mutation.md).\n"
    "# id\tclass\tflags\tdate\n"
)


class RecordError(ValueError):
    """The ledger cannot be read: a malformed line, named with its number."""


@dataclass(frozen=True)
class Entry:
    """One mutant's recorded verdict."""

    cls: str  # one of CLASSES
    flags: tuple[str, ...]  # of FLAGS
    date: str  # ISO date of the run that recorded it

    @property
    def by_confirm(self) -> bool:
        return "confirm" in self.flags

    @property
    def not_reached(self) -> bool:
        return "not-reached" in self.flags


def read(path: Path) -> dict[str, Entry]:
    """The ledger at `path` by mutant id (empty when the file does not exist)."""
    if not path.is_file():
        return {}
    entries: dict[str, Entry] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        fields = line.split("\t")
        if len(fields) != 4:
            raise RecordError(f"{path}:{n}: expected 4 tab-separated fields, got {len(fields)}")
        mid, cls, flags, date = fields
        parsed = () if flags == "-" else tuple(flags.split(","))
        if not mid.startswith("m-") or len(mid) != 12:
            raise RecordError(f"{path}:{n}: {mid!r} is not a mutant id (m- and 10 hex digits)")
        if cls not in CLASSES or any(f not in FLAGS for f in parsed):
            raise RecordError(f"{path}:{n}: unknown class or flag in {line!r}")
        entries[mid] = Entry(cls, parsed, date)
    return entries


def write(path: Path, entries: dict[str, Entry]) -> None:
    """Write the ledger, sorted by id (so that a merge changes only the lines it adds)."""
    lines = [
        f"{mid}\t{e.cls}\t{','.join(e.flags) or '-'}\t{e.date}"
        for mid, e in sorted(entries.items())
    ]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(_HEADER + "".join(x + "\n" for x in lines))
    tmp.replace(path)


def entry_of(v: Verdict, date: str) -> Entry:
    """The ledger entry of a verdict of this run (an argued survivor is recorded `survived`)."""
    cls = "survived" if v.outcome in _SURVIVOR_CLASSES else v.outcome
    flags = tuple(f for f, on in (("confirm", v.by_confirm), ("not-reached", v.not_reached)) if on)
    return Entry(cls, flags, date)


def merge(path: Path, verdicts: list[Verdict], date: str | None = None) -> int:
    """Add this run's verdicts (not those read from the ledger) to the ledger at `path`;
    returns how many entries were added or changed."""
    entries = read(path)
    day = date or datetime.date.today().isoformat()
    changed = 0
    for v in verdicts:
        if v.recorded:
            continue
        e = entry_of(v, day)
        old = entries.get(v.id)
        if old is None or (old.cls, old.flags) != (e.cls, e.flags):
            entries[v.id] = e
            changed += 1
    write(path, entries)
    return changed


def merge_files(path: Path, other: Path) -> int:
    """Merge the ledger `other` (another host's) into `path`; `other`'s entries win.
    Returns how many entries of `path` were added or changed."""
    mine, theirs = read(path), read(other)
    changed = sum(1 for mid, e in theirs.items() if mine.get(mid) != e)
    mine.update(theirs)
    write(path, mine)
    return changed


def skip_recorded(db: Path, home: Path, origins: dict[str, str], ledger: dict[str, Entry]) -> int:
    """Mark every pending mutant of session `db` that the ledger names skipped, with the
    output `RECORDED_MARKER` and its id, so that `exec` leaves it alone. `origins` maps a
    copied file (relative to `home`) to the original's name, which the id hashes.
    Returns how many."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    if not ledger:
        return 0
    texts: dict[str, str] = {}
    with use_db(str(db), WorkDB.Mode.open) as wdb:
        hits = []
        for item in wdb.pending_work_items:
            mid = _pending_id(item, home, origins, texts)
            if mid in ledger:
                hits.append((item.job_id, mid))
        for job, mid in hits:
            result = WorkResult(
                worker_outcome=WorkerOutcome.SKIPPED, output=f"{RECORDED_MARKER} {mid}"
            )
            wdb.set_result(job, result)
    return len(hits)


def _pending_id(item, home: Path, origins: dict[str, str], texts: dict[str, str]) -> str | None:
    """The id the mutant of a pending work item will have once run (None: no mutation)."""
    made = _pending_diff(item, home, texts)
    if made is None:
        return None
    m, diff = made
    path = str(m.module_path)
    return mutant_id(origins.get(path, path), m.operator_name, m.definition_name, diff)


def _pending_diff(item, home: Path, texts: dict[str, str]):
    """`(mutation, diff)` of a pending work item, as `exec` will make it (None: none).
    `texts` caches each file's source."""
    from cosmic_ray.util import read_python_source

    if len(item.mutations) != 1:
        return None
    m = item.mutations[0]
    path = str(m.module_path)
    if path not in texts:
        texts[path] = read_python_source(home / path)
    made = mutate_spec(texts[path], m)
    return None if made is None else (m, made[1])


def moved_ids(
    db: Path, home: Path, origins: dict[str, str], before: dict[str, str]
) -> list[tuple[str, str]]:
    """`(old, new)` ids of every pending mutant of session `db` in a moved file.

    `before` maps a file's name (as `origins` gives it) to the name it had
    before its code moved there, text unchanged: the old id is the one the
    same mutation had in the old file, since an id hashes only the file's
    name, the operator, the definition and the changed lines."""
    from cosmic_ray.work_db import WorkDB, use_db

    renamed = {copied: before[o] for copied, o in origins.items() if o in before}
    texts: dict[str, str] = {}
    pairs = []
    with use_db(str(db), WorkDB.Mode.open) as wdb:
        for item in wdb.pending_work_items:
            if len(item.mutations) != 1 or str(item.mutations[0].module_path) not in renamed:
                continue
            made = _pending_diff(item, home, texts)  # one mutation, hashed under both names
            if made is None:
                continue
            m, diff = made
            path = str(m.module_path)
            old, new = (
                mutant_id(name, m.operator_name, m.definition_name, diff)
                for name in (renamed[path], origins[path])
            )
            pairs.append((old, new))
    return pairs


def carry(entries: dict[str, Entry], pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Copy each recorded old id's entry to its new id, unless the new id has one.

    The old entry stays: identical lines of same-named definitions share an id,
    and one may remain in the module the code left. Returns the pairs carried."""
    carried = [(o, n) for o, n in pairs if o in entries and n not in entries]
    for o, n in carried:
        entries[n] = entries[o]
    return carried
