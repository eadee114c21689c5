"""Classify mutants, match them against the allowlist of argued-equivalent ones, report.

Classes (each mutant run, or recorded as not reached, has exactly one):

* `killed`: the harness exited non-zero;
* `timeout`: the run passed the per-mutant timeout (Cosmic Ray kills it and
  records it as killed with the output `timeout`; reported separately);
* `incompetent`: the mutant does not import (the probe's marker), or Cosmic
  Ray could not run it;
* `survived`: the harness passed; `equivalent` or `outside` when its id is
  allowlisted (argued in docs/mutation-survivors.md): equivalent, no input tells it
  apart; outside the contract, only inputs SPEC.md prescribes nothing for
  tell it apart (method arguments it forbids, helper options `BlockTables`
  never uses), so the harness must pass it, and the unit tests kill it;
  `gpu` when it changes only what a compiled GPU launch runs (launch
  constants, CUDA buffers), which the harness's interpreted CPU kernels never
  take: a GPU run or a CUDA test kills it, and a CPU unit test that drives the
  GPU's choices through the interpreter.

A survivor (of any of the four survivor classes) may be *not reached*: the
coverage pre-pass (`reach`) found that the unmutated test command never runs
its statement, and recorded it as a survivor without running it. It counts as
a survivor everywhere (kill rate, allowlist, exit code) and is counted apart
(`not_reached`), as `killed_by_confirm` is among the killed.

Not run: `annotation`, a mutant inside an annotation that is never evaluated
(`from __future__ import annotations`), equivalent by construction and
skipped before `exec` (counted, never run); sampled-out mutants.

A mutant's id (`m-` and 10 hex digits) hashes the module, the operator, the
enclosing definition and the changed source lines, not Cosmic Ray's
occurrence number or line number, so it survives edits elsewhere in the file.
The allowlist is every id in a `### ` heading of the `## Equivalent mutants`,
`## Outside the contract` and `## GPU only` sections of docs/mutation-survivors.md.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .probe import CONFIRM_KILL_MARKER, INCOMPETENT_MARKER
from .reach import NOT_REACHED_MARKER
from .session import ANNOTATION_SKIP, Mutant, recorded_id

_ID = re.compile(r"\bm-[0-9a-f]{10}\b")


@dataclass(frozen=True)
class Verdict:
    """One executed mutant, classified, with its diff against the original source."""

    id: str
    module: str  # the original file, relative to the project root
    line: int
    operator: str
    definition: str | None
    outcome: str  # killed, timeout, incompetent, survived, equivalent, outside, gpu
    diff: str
    by_confirm: bool = False  # killed only by the confirming run (the default sweep)
    not_reached: bool = False  # a survivor whose statement no harness run executes: not run
    recorded: bool = False  # read from the ledger (`record`), not run now: no diff

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def changed_lines(diff: str) -> tuple[list[str], list[str]]:
    """The removed and added lines of a unified diff, stripped."""
    minus = [x[1:].strip() for x in diff.splitlines() if x.startswith("-") and x[:3] != "---"]
    plus = [x[1:].strip() for x in diff.splitlines() if x.startswith("+") and x[:3] != "+++"]
    return minus, plus


def mutant_id(module: str, operator: str, definition: str | None, diff: str) -> str:
    minus, plus = changed_lines(diff)
    text = "\n".join([module, operator, definition or "", *minus, "=>", *plus])
    return "m-" + hashlib.sha256(text.encode()).hexdigest()[:10]


def classify(m: Mutant) -> str | None:
    """The class of an executed mutant; None when it was not run (pending, skipped, no-test)."""
    if m.worker_outcome == "skipped" and m.output == ANNOTATION_SKIP:
        return "annotation"
    if m.worker_outcome in (None, "skipped", "no-test"):
        return None
    if m.worker_outcome != "normal" or m.test_outcome == "incompetent":
        return "incompetent"
    if INCOMPETENT_MARKER in m.output:
        return "incompetent"
    if m.test_outcome == "killed":
        return "timeout" if m.output.strip() == "timeout" else "killed"
    return "survived"


_SECTIONS = {
    "## equivalent mutants": "equivalent",
    "## outside the contract": "outside",
    "## gpu only": "gpu",
}


def read_allowlist(path: Path | None) -> dict[str, str]:
    """Id -> class for ids in `### ` headings of the allowlisting sections of `path`."""
    if path is None or not path.is_file():
        return {}
    ids: dict[str, str] = {}
    inside = None
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            inside = _SECTIONS.get(line.strip().lower())
        elif inside and line.startswith("### "):
            ids.update(dict.fromkeys(_ID.findall(line), inside))
    return ids


def verdicts(
    mutants: list[Mutant],
    origins: dict[str, str],
    allowlist: dict[str, str],
    ledger: dict | None = None,
) -> list[Verdict]:
    """Executed mutants, classified, and those skipped as recorded in `ledger` (id ->
    `record.Entry`) with their recorded class. `origins` maps a copied file to its
    original's name."""
    out = []
    for m in mutants:
        known = recorded_id(m.output) if m.worker_outcome == "skipped" else None
        if known is not None and ledger and known in ledger:
            out.append(_recorded(m, known, ledger[known], origins, allowlist))
            continue
        cls = classify(m)
        if cls is None or cls == "annotation":
            continue
        module = origins.get(m.module_path, m.module_path)
        diff = m.diff.replace("--- mutation diff ---\n", "")
        diff = diff.replace(f"a/{m.module_path}", f"a/{module}").replace(
            f"b/{m.module_path}", f"b/{module}"
        )
        mid = mutant_id(module, m.operator, m.definition, diff)
        unreached = cls == "survived" and m.output.startswith(NOT_REACHED_MARKER)
        if cls == "survived" and mid in allowlist:
            cls = allowlist[mid]
        late = cls == "killed" and CONFIRM_KILL_MARKER in m.output
        out.append(
            Verdict(mid, module, m.line, m.operator, m.definition, cls, diff, late, unreached)
        )
    return out


def _recorded(
    m: Mutant, mid: str, entry, origins: dict[str, str], allowlist: dict[str, str]
) -> Verdict:
    cls = entry.cls
    if cls == "survived" and mid in allowlist:
        cls = allowlist[mid]
    module = origins.get(m.module_path, m.module_path)
    return Verdict(
        mid, module, m.line, m.operator, m.definition, cls, "", entry.by_confirm,
        entry.not_reached, recorded=True,
    )  # fmt: skip


def summarize(vs: list[Verdict], total: int, annotation: int = 0) -> dict:
    """Counts and kill rates. Kill rate: (killed + timeout) over the competent mutants
    (run, or not reached: survivors); the second leaves out the argued survivors
    (equivalent, outside the contract, GPU only). `mutants_run` leaves out the not reached."""
    c = Counter(v.outcome for v in vs)
    argued = c["equivalent"] + c["outside"] + c["gpu"]
    competent = c["killed"] + c["timeout"] + c["survived"] + argued
    dead = c["killed"] + c["timeout"]
    unreached = sum(v.not_reached for v in vs)
    return {
        "mutants_total": total,
        "annotation_skipped": annotation,
        "mutants_run": len(vs) - unreached,
        "not_reached": unreached,
        "from_ledger": sum(v.recorded for v in vs),
        "killed": c["killed"],
        "killed_by_confirm": sum(v.by_confirm for v in vs),
        "timeout": c["timeout"],
        "survived": c["survived"] + argued,
        "equivalent": c["equivalent"],
        "outside_contract": c["outside"],
        "gpu_only": c["gpu"],
        "unexplained_survivors": c["survived"],
        "incompetent": c["incompetent"],
        "kill_rate": dead / competent if competent else 1.0,
        "kill_rate_excluding_equivalent": (
            dead / (competent - argued) if competent > argued else 1.0
        ),
    }


_TAGS = {
    "equivalent": "equivalent (allowlisted)",
    "outside": "outside the contract (allowlisted)",
    "gpu": "GPU only (allowlisted)",
}


def render(summary: dict, vs: list[Verdict], show_killed: bool = False) -> str:
    """The terminal report: figures, then every survivor with its diff."""
    s = summary
    lines = [
        f"mutants: {s['mutants_run']} run of {s['mutants_total']} "
        f"({s['annotation_skipped']} in never-evaluated annotations and "
        f"{s['not_reached']} in statements the harness never runs, not run)",
        f"killed: {s['killed']} ({s['killed_by_confirm']} only by the confirming run)  "
        f"timeouts: {s['timeout']}  incompetent: {s['incompetent']}  "
        f"survived: {s['survived']} ({s['equivalent']} argued equivalent, "
        f"{s['outside_contract']} outside the contract, {s['gpu_only']} GPU only; "
        f"{s['not_reached']} not reached)",
        f"kill rate: {s['kill_rate']:.1%} "
        f"({s['kill_rate_excluding_equivalent']:.1%} excluding argued survivors)",
    ]
    if s.get("from_ledger"):
        lines.append(f"of these, {s['from_ledger']} read from the ledger, not run now")
    for v in sorted(vs, key=lambda v: (v.module, v.line, v.id)):
        if v.outcome in ("survived", "equivalent", "outside", "gpu") or show_killed:
            tag = _TAGS.get(v.outcome, v.outcome.upper())
            tag += ", not reached" if v.not_reached else ""
            tag += ", from the ledger" if v.recorded else ""
            diff = v.diff.rstrip() or "(no diff: delete its line from the ledger to run it again)"
            lines += ["", f"{v.id} {tag}: {v.module}:{v.line} {v.operator}", diff]
    return "\n".join(lines)
