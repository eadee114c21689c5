"""The coverage pre-pass on a tiny package: which mutants it finds unreached, how it records
them, that `exec` never runs them and that their diffs are the ones `exec` makes."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("cosmic_ray")
pytest.importorskip("coverage")

from cp_blocktables.mutate import outcome, reach, session  # noqa: E402

TINY = '''\
"""A branch never taken, a multi-line statement, and code only a fork or a subprocess runs."""


def f(x):
    if x > 100:
        return x - 1
    y = (x +
         2)
    return y * 3


def in_fork():
    return 4 + 1


def in_subprocess():
    return 5 + 1


def never(x):
    return 6 * -x
'''

DRIVE = """\
import os
import subprocess
import sys

from pkg import tiny

assert tiny.f(1) == 9
pid = os.fork()
if pid == 0:
    tiny.in_fork()
    os._exit(0)
os.waitpid(pid, 0)
subprocess.run([sys.executable, "-c", "from pkg import tiny; tiny.in_subprocess()"], check=True)
"""

# Every statement runs, and with it every operator Cosmic Ray has: decorators, a signature
# and a comprehension over several rows, a loop's every branch, an exception caught.
WHOLE = """\
import functools


def deco(n=1):
    def wrap(fn):
        return fn

    return wrap


@deco(
    n=2 + 1,
)
@functools.lru_cache(maxsize=4 * 2)
def f(
    x,
    y=3 - 1,
    *,
    z=not False,
):
    total = 0
    for i in range(x + 1):
        if i % 2 == 0 and y > 0 or z:
            total += i * 2
        elif i == 3:
            total -= 1
        else:
            continue
        while total > 4:
            total //= 2
            break
    try:
        1 / (x - x)
    except ZeroDivisionError:
        total = total + 1
    finally:
        total = -total
    g = lambda a=1 + 1: a * 2  # noqa: E731
    data = {
        k: v + 1
        for k, v in zip(range(3), range(3 + 0))
        if k >= 0
    }
    return total + g() + len(data) + (
        1 if x > 0 else 2
    ) | 0


class C:
    limit = 10 << 1
    flag = True

    @property
    def p(self):
        return self.limit >> 1


RESULT = (f(3), f(5, 1, z=False), C().p, ~1, +2, 3**2, 7 % 3, 5 & 3, 5 ^ 3)
"""

MODULE = "src/pkg/tiny.py"
UNREACHED_ROWS = {6, 21}  # `return x - 1` and the body of `never`


def _row(text: str) -> int:
    (row,) = [i for i, line in enumerate(TINY.splitlines(), 1) if text in line]
    return row


def _env(home: Path) -> dict[str, str]:
    path = [str(home / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path))


def _package(home: Path, source: str = TINY) -> None:
    pkg = home / "src" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "tiny.py").write_text(source)


def _measure(home: Path, module: str = "drive", timeout: float = 120) -> dict[str, reach.Ran]:
    pkg = home / "src" / "pkg"
    files = [pkg / "__init__.py", pkg / "tiny.py"]
    return reach.measure([sys.executable, "-m", module], _env(home), home, pkg, files, timeout)


def _init(home: Path, db: str) -> None:
    """`cosmic-ray init` of `tiny.py` into `home/db`, with a test command that kills all."""
    fail = [sys.executable, "-c", "import sys; sys.exit(1)"]
    session.write_config(home / "cosmic-ray.toml", [Path(MODULE)], fail, 60)
    session.cosmic_ray(["init", "cosmic-ray.toml", db], env=_env(home), cwd=home)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, dict[str, reach.Ran]]:
    """The package, its driver, a Cosmic Ray session of `tiny.py` (`fresh.sqlite`, never
    touched) and what the driver runs of it under coverage."""
    home = tmp_path_factory.mktemp("tiny")
    _package(home)
    (home / "drive.py").write_text(DRIVE)
    _init(home, "fresh.sqlite")
    return home, _measure(home)


@pytest.fixture
def db(tiny, tmp_path) -> Path:
    """A copy of the fresh session, next to the package (sessions name files relative to it)."""
    home, _ = tiny
    path = home / f"{tmp_path.name}.sqlite"
    shutil.copyfile(home / "fresh.sqlite", path)
    yield path
    path.unlink()


def _results(db: Path) -> dict[str, session.Mutant]:
    return {m.job_id: m for m in session.read_mutants(db)}


@pytest.mark.parametrize(
    ("text", "reached"),
    [
        ("if x > 100", True),
        ("return x - 1", False),
        ("y = (x +", True),
        ("2)", True),  # the continuation row of a statement that ran
        ("return y * 3", True),
        ("def never", True),  # the definition runs at import, its body never
        ("4 + 1", True),  # only in a forked child that leaves by os._exit
        ("5 + 1", True),  # only in a subprocess
        ("6 * -x", False),
    ],
    ids=[
        "taken-condition",
        "branch-never-taken",
        "multi-line-first-row",
        "multi-line-continuation",
        "after-the-branch",
        "def-line",
        "fork",
        "subprocess",
        "never-called",
    ],
)
def test_a_row_is_reached_when_its_statement_ran(tiny, text, reached):
    _, ran = tiny
    assert ran[MODULE].reached(_row(text)) is reached


def test_no_mutant_of_a_module_that_runs_whole_is_unreached(tmp_path):
    _package(tmp_path, WHOLE)
    (tmp_path / "drive.py").write_text("from pkg import tiny  # noqa: F401\n")
    _init(tmp_path, "whole.sqlite")
    ran = _measure(tmp_path)
    assert ran[MODULE].statements == ran[MODULE].parser.statements
    operators = {m.operator.split("_")[0] for m in session.read_mutants(tmp_path / "whole.sqlite")}
    assert len(operators) >= 14  # every operator family of Cosmic Ray but the variable ones
    assert reach.record(tmp_path / "whole.sqlite", tmp_path, ran) == 0


def test_unreached_mutants_are_recorded_as_survivors_and_the_rest_stay_pending(tiny, db):
    home, ran = tiny
    before = session.read_mutants(db)
    found = reach.record(db, home, ran)
    after = _results(db)
    recorded = [m for m in after.values() if m.worker_outcome is not None]
    assert len(recorded) == found > 0
    assert {m.line for m in recorded} == UNREACHED_ROWS
    for m in recorded:
        assert (m.worker_outcome, m.test_outcome) == ("normal", "survived")
        assert m.output.startswith(reach.NOT_REACHED_MARKER) and f"line {m.line}" in m.output
        assert outcome.classify(m) == "survived"
    # `6 * -x` with `-x` made `not x` does not compile: left to exec (incompetent there).
    left = [
        m for m in before if m.line in UNREACHED_ROWS and after[m.job_id].worker_outcome is None
    ]
    assert [m.operator for m in left] == ["core/ReplaceUnaryOperator_USub_Not"]
    assert session.count_pending(db) == len(before) - found


def test_exec_skips_the_recorded_mutants_and_would_have_made_the_same_diffs(tiny, db, tmp_path):
    home, ran = tiny
    reach.record(db, home, ran)
    mutants = _results(db)
    recorded = {j: m for j, m in mutants.items() if m.worker_outcome is not None}
    reached = [j for j, m in mutants.items() if m.worker_outcome is None][:3]
    _keep_pending(db, set(reached))  # exec runs 3 reached mutants besides skipping the rest
    # Two recorded mutants of each row in a session of their own, run: the diffs exec makes.
    sample = {
        j for row in UNREACHED_ROWS for j in [j for j, m in recorded.items() if m.line == row][:2]
    }
    alone = home / f"{tmp_path.name}-alone.sqlite"
    shutil.copyfile(home / "fresh.sqlite", alone)
    _keep_pending(alone, sample)
    for path in (db, alone):
        session.cosmic_ray(["exec", "cosmic-ray.toml", path.name], env=_env(home), cwd=home)
    after = _results(db)
    assert session.count_pending(db) == 0
    assert {j: after[j] for j in recorded} == recorded  # exec left them alone
    assert [after[j].test_outcome for j in reached] == ["killed"] * 3
    executed = _results(alone)
    alone.unlink()
    assert {j: executed[j].diff for j in sample} == {j: recorded[j].diff for j in sample}
    assert all(list(map(len, outcome.changed_lines(recorded[j].diff))) == [1, 1] for j in sample)
    assert (home / MODULE).read_text() == TINY


def _keep_pending(db: Path, jobs: set[str]) -> None:
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    with use_db(str(db), WorkDB.Mode.open) as wdb:
        others = [x.job_id for x in wdb.pending_work_items if x.job_id not in jobs]
        wdb.set_multiple_results(others, WorkResult(worker_outcome=WorkerOutcome.SKIPPED))


def test_a_copy_that_differs_from_the_measured_one_is_an_error(tiny, db, tmp_path):
    home, ran = tiny
    other = tmp_path / "other"
    _package(other)
    (other / MODULE).write_text(TINY.replace("6 * -x", "7 * -x"))
    with pytest.raises(reach.ReachError, match="differs from the copy coverage measured"):
        reach.record(db, other, ran)


@pytest.mark.parametrize(
    ("driver", "timeout", "error", "message"),
    [
        ("import sys; sys.exit(4)", 120, reach.ReachError, "fails under coverage .exit 4"),
        ("import os", 120, reach.ReachError, "coverage traced no line of the copy"),
        ("import time; time.sleep(60)", 2, reach.ReachTimeout, "outlasted 2 s"),
    ],
    ids=["command-fails", "nothing-traced", "timeout"],
)
def test_a_run_that_cannot_tell_is_an_error(tmp_path, driver, timeout, error, message):
    _package(tmp_path)
    (tmp_path / "other_driver.py").write_text(driver + "\n")
    with pytest.raises(error, match=message):
        _measure(tmp_path, "other_driver", timeout)


def test_the_timeout_kills_the_whole_group(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)\n"
    )
    with pytest.raises(reach.ReachTimeout):
        reach._run_group([sys.executable, "-c", code], dict(os.environ), tmp_path, 5)
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10  # SIGKILL is sent; a loaded machine takes a while
    while _alive(child):
        assert time.monotonic() < deadline, "the grandchild outlived the timeout"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        return ") Z " not in Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False


def test_missing_coverage_names_the_way_out(monkeypatch):
    monkeypatch.setitem(sys.modules, "coverage", None)
    with pytest.raises(reach.ReachError, match="--no-coverage"):
        reach.require_coverage()
