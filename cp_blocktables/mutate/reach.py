"""The coverage pre-pass: a mutant in a statement that the test command never runs survives.

Why: a surviving mutant costs a harness run of minutes, and some mutants lie
in statements that no harness run executes (input refusals, GPU-only
branches). Running the test command once on the unmutated copy under
coverage.py tells which; such a mutant is recorded as a survivor, *not
reached*, and `cosmic-ray exec` never runs it (PIT's NO_COVERAGE, Stryker's
NoCoverage).

Soundness: the test command is seeded and deterministic. A mutant changes
one statement of a copied module. If the unmutated command never executes
that statement, the mutated program executes exactly as the unmutated one up
to the point where it would first reach it, which it never does: it passes as
the unmutated copy does, so it survives, without running it. The argument
needs three things, each checked here:

* the same file contents: coverage measures share 0's copy, and every share's
  copy must be identical to it, text for text (they are, pristine at rest);
* one notion of statement on both sides: the executed lines and a mutant's
  first row are both mapped to the first line of their statement by
  coverage's own parser, so a mutant on a continuation line of a statement
  that ran counts as reached;
* a mutant that compiles (without even a warning): one that does not fails
  at import wherever it lies, so it is left to `exec`, which calls it
  incompetent.

A coverage run that fails, or that traced no line of the copy at all, is an
error, never "nothing reached". The diff recorded is the one `exec` would
record: Cosmic Ray's own mutation of the source text (`mutate_code`) and its
own diff (`_make_diff`, as `mutate_and_test` makes it), so the mutant's id,
and its allowlist entry, are the same whether it ran or not.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .session import mutate_spec, run_whole

if TYPE_CHECKING:
    from cosmic_ray.work_item import WorkItem, WorkResult
    from coverage.parser import PythonParser

    from .shares import Share

NOT_REACHED_MARKER = "CPBT-MUTATE: NOT REACHED"
MIN_COVERAGE = (7, 10)  # `[run] patch = fork, _exit, subprocess`


class ReachError(RuntimeError):
    """coverage.py is missing, or the coverage run failed or traced nothing."""


class ReachTimeout(ReachError):
    """The coverage run outlasted its time."""


def require_coverage() -> None:
    try:
        import coverage
    except ImportError:
        coverage = None
    if coverage is None or coverage.version_info[:2] < MIN_COVERAGE:
        raise ReachError(
            "the coverage pre-pass needs coverage>=7.10: pip install 'coverage>=7.10' "
            "(or pip install -e '.[test]'), or pass --no-coverage"
        )


def prepass(
    shares: list[Share],
    command: list[str],
    env: dict[str, str],
    timeout: float,
    left: float | None,
) -> None:
    """Run `command` on share 0's copy under coverage, then record in every share the
    pending mutants whose statement never ran as survivors (printed). It may take 3
    mutants' `timeout`s; a --time-limit (`left` seconds) that ends first skips it."""
    limit = 3 * timeout if left is None else min(3 * timeout, left)
    if limit <= 0:
        print("mutate: --time-limit reached before the coverage pre-pass; it is skipped")
        return
    sp = shares[0].sp
    t0 = time.monotonic()
    try:
        files = list(sp.modules.values())
        ran = measure(command, env, shares[0].home, sp.root / sp.package, files, limit)
    except ReachTimeout:
        if left is None or limit < left:
            raise
        print("mutate: --time-limit reached during the coverage pre-pass; nothing recorded")
        return
    found = sum(record(sh.db, sh.home, ran) for sh in shares)
    print(
        f"mutate: coverage pre-pass ({time.monotonic() - t0:.0f} s): {found} mutants lie in "
        "statements the unmutated test command never runs: survivors (not reached), not run"
    )


@dataclass(frozen=True)
class Ran:
    """What the unmutated test command executed in one copied file."""

    text: str
    parser: PythonParser  # coverage's parser over `text`
    statements: frozenset[int]  # first lines of the statements that ran

    def reached(self, row: int) -> bool:
        """Whether the statement holding `row` ran."""
        return self.parser.first_line(row) in self.statements


def measure(
    command: list[str],
    env: dict[str, str],
    home: Path,
    package: Path,
    files: list[Path],
    timeout: float,
) -> dict[str, Ran]:
    """Run `command` (`python -m MODULE ...`) once in `home` under coverage, measuring the
    package directory `package`; what ran in each of `files` (in `package`), keyed by path
    relative to `home`."""
    from cosmic_ray.util import read_python_source
    from coverage.parser import PythonParser

    lines, out = _executed_lines(command, env, home, package, timeout)
    found = {}
    for path in files:
        text = read_python_source(path)
        parser = PythonParser(text=text, filename=str(path))
        parser.parse_source()
        ran = frozenset(parser.translate_lines(lines.get(path.resolve(), [])))
        found[str(path.relative_to(home))] = Ran(text, parser, ran)
    if not any(r.statements - {0} for r in found.values()):  # 0: an empty module ran
        raise ReachError(
            f"coverage traced no line of the copy in {package} although the test "
            f"command passed: it did not measure the copy, so nothing can be judged "
            f"unreached (pass --no-coverage)\n{out[-2000:]}"
        )
    return found


def _executed_lines(
    command: list[str], env: dict[str, str], home: Path, package: Path, timeout: float
) -> tuple[dict[Path, list[int]], str]:
    """The lines `command` executes in files under `package`, by resolved path, from its
    run under `coverage run` and every process it forks or starts; and its output."""
    from coverage import Coverage
    from coverage.exceptions import CoverageException

    if command[:2] != [sys.executable, "-m"]:
        raise ReachError(f"not a `python -m` command: {command[:3]}")
    env = {k: v for k, v in env.items() if not k.startswith("COVERAGE_")}  # ours alone
    with tempfile.TemporaryDirectory(prefix="cpbt-reach-") as tmp:
        rc = Path(tmp) / ".coveragerc"
        rc.write_text(
            f"[run]\nsource = {package.resolve()}\ndata_file = {tmp}/.coverage\n"
            "parallel = true\npatch =\n    fork\n    _exit\n    subprocess\n"
        )
        run = [sys.executable, "-m", "coverage", "run", f"--rcfile={rc}", *command[1:]]
        code, out = _run_group(run, env, home, timeout)
        if code != 0:
            raise ReachError(
                f"the unmutated copy fails under coverage (exit {code}): pass --no-coverage "
                f"to run every mutant\n{out[-4000:]}"
            )
        cov = Coverage(config_file=str(rc))
        try:
            cov.combine(strict=True)
        except CoverageException as e:
            raise ReachError(f"no coverage data to read: {e}\n{out[-2000:]}") from None
        data = cov.get_data()
        return {Path(f).resolve(): data.lines(f) or [] for f in data.measured_files()}, out


def _run_group(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float) -> tuple[int, str]:
    """`session.run_whole`, its timeout a `ReachTimeout`."""
    try:
        return run_whole(cmd, env, timeout, cwd)
    except subprocess.TimeoutExpired:
        raise ReachTimeout(f"the coverage run outlasted {timeout:.0f} s") from None


def record(db: Path, home: Path, ran: dict[str, Ran]) -> int:
    """Give every pending mutant of session `db` (files relative to `home`) whose statement
    did not run a survivor's result, marked `NOT_REACHED_MARKER`; returns how many."""
    from cosmic_ray.work_db import WorkDB, use_db

    with use_db(str(db), WorkDB.Mode.open) as wdb:
        found = [(item.job_id, unreached(item, home, ran)) for item in wdb.pending_work_items]
        hits = [(job, result) for job, result in found if result is not None]
        for job, result in hits:
            wdb.set_result(job, result)
    return len(hits)


def unreached(item: WorkItem, home: Path, ran: dict[str, Ran]) -> WorkResult | None:
    """The survivor's `WorkResult` of a work item whose statement never ran, else None
    (reached, not a single mutation, a file coverage did not see, or a mutant that does
    not compile)."""
    from cosmic_ray.util import read_python_source
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome, WorkResult

    if len(item.mutations) != 1:
        return None
    m = item.mutations[0]
    path = str(m.module_path)
    row = m.start_pos[0]
    if path not in ran or ran[path].reached(row):
        return None
    text = read_python_source(home / path)
    if text != ran[path].text:
        raise ReachError(f"{home / path} differs from the copy coverage measured")
    made = mutate_spec(text, m)
    if made is None or not _compiles(made[0], path):
        return None
    line = ran[path].parser.first_line(row)
    return WorkResult(
        worker_outcome=WorkerOutcome.NORMAL,
        test_outcome=TestOutcome.SURVIVED,
        output=f"{NOT_REACHED_MARKER}: the statement at line {line} of {path} (row {row} "
        "mutated) never runs in the unmutated test command, so the mutant was not run",
        diff=made[1],
    )


def _compiles(source: str, filename: str) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            compile(source, filename, "exec", dont_inherit=True)
        except (SyntaxError, ValueError, Warning):
            return False
    return True
