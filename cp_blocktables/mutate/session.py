"""Drive Cosmic Ray 8.x: config, `init`, sampling, baseline, `exec`, results.

Cosmic Ray is run as its own CLI (`cosmic-ray init`/`exec`, the `local`
distributor, one mutant at a time); only sampling and reading results use its
session API (`cosmic_ray.work_db`), the same way its `cr-filter-*` tools do.
A sampled-out mutant gets the result `skipped`, so `exec` leaves it alone and
reports never count it as run.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import random
import shlex
import signal
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

CR_MAIN = "import sys; from cosmic_ray.cli import main; sys.exit(main())"


class CosmicRayError(RuntimeError):
    """Cosmic Ray is missing or one of its commands failed."""


def require_cosmic_ray() -> None:
    try:
        import cosmic_ray  # noqa: F401
    except ImportError:
        raise CosmicRayError(
            "cosmic-ray is not installed: pip install 'cosmic-ray>=8.7' "
            "(or pip install -e '.[test]')"
        ) from None


def write_config(path: Path, modules: list[Path], test_command: list[str], timeout: float) -> None:
    """A Cosmic Ray config (TOML) mutating `modules` and running `test_command`."""
    paths = ", ".join(json.dumps(str(m)) for m in modules)
    path.write_text(
        "[cosmic-ray]\n"
        f"module-path = [{paths}]\n"
        f"timeout = {float(timeout)}\n"
        "excluded-modules = []\n"
        f"test-command = {json.dumps(shlex.join(test_command))}\n"
        "\n[cosmic-ray.distributor]\n"
        'name = "local"\n'
    )


def cosmic_ray(args: list[str], env: dict[str, str] | None = None, log=None, cwd=None) -> None:
    """Run `cosmic-ray ARGS` with this interpreter; `CosmicRayError` on a non-zero exit."""
    proc = subprocess.run(
        [sys.executable, "-c", CR_MAIN, *args],
        env=env,
        cwd=cwd,
        stdout=log or subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    if proc.returncode != 0:
        tail = "" if log else (proc.stdout or "")[-2000:]
        raise CosmicRayError(f"cosmic-ray {args[0]} exited {proc.returncode}\n{tail}")


@dataclass(frozen=True)
class Mutant:
    """One executed (or pending) mutant as read back from the session."""

    job_id: str
    module_path: str
    operator: str
    occurrence: int
    line: int
    definition: str | None
    worker_outcome: str | None  # normal, exception, abnormal, no-test, skipped; None: pending
    test_outcome: str | None  # killed, survived, incompetent
    output: str
    diff: str


def stable_key(item) -> tuple:
    """The stable order of mutants: module, operator, occurrence (never Cosmic Ray's ids)."""
    m = item.mutations[0]
    return (str(m.module_path), m.operator_name, m.occurrence)


def sample(session: Path, n: int, seed: int) -> int:
    """Keep a fixed random sample of `n` mutants pending; mark the rest skipped.

    The sample depends only on `(n, seed)` and the set of mutants (ordered by
    module, operator and occurrence, never by Cosmic Ray's random job ids).
    Returns how many stay pending.
    """
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    with use_db(str(session), WorkDB.Mode.open) as db:
        items = sorted(db.pending_work_items, key=stable_key)
        if n >= len(items):
            return len(items)
        keep = {id(x) for x in random.Random(seed).sample(items, n)}
        skipped = [x.job_id for x in items if id(x) not in keep]
        db.set_multiple_results(skipped, WorkResult(worker_outcome=WorkerOutcome.SKIPPED))
    return n


def skip_annotations(session: Path, base: Path) -> int:
    """Mark mutants inside annotations of `from __future__ import annotations` modules skipped.

    Such annotations are strings that nothing evaluates, so a mutant there is
    equivalent by construction; running it would only cost a harness run.
    Their result is `skipped` with the output `ANNOTATION_SKIP`; module paths are
    relative to `base`. Returns how many.
    """
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    spans: dict[str, list[tuple[tuple[int, int], tuple[int, int]]]] = {}
    with use_db(str(session), WorkDB.Mode.open) as db:
        hits = []
        for item in db.pending_work_items:
            m = item.mutations[0]
            path = str(m.module_path)
            if path not in spans:
                spans[path] = annotation_spans((base / path).read_text())
            pos = tuple(m.start_pos)
            if any(lo <= pos < hi for lo, hi in spans[path]):
                hits.append(item.job_id)
        result = WorkResult(worker_outcome=WorkerOutcome.SKIPPED, output=ANNOTATION_SKIP)
        db.set_multiple_results(hits, result)
    return len(hits)


ANNOTATION_SKIP = "skipped: inside an annotation that is never evaluated"
RECORDED_MARKER = "skipped: recorded in the ledger as"
"""Output of a mutant that `record.skip_recorded` marked skipped, followed by its id."""


def recorded_id(output: str) -> str | None:
    """The id in the output of a mutant skipped as recorded in the ledger, else None."""
    if not output.startswith(RECORDED_MARKER):
        return None
    return output[len(RECORDED_MARKER) :].strip() or None


def annotation_spans(source: str) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """`((line, col), (end_line, end_col))` of every annotation, when the module has
    `from __future__ import annotations` (else none: annotations are then evaluated)."""
    tree = ast.parse(source)
    postponed = any(
        isinstance(n, ast.ImportFrom)
        and n.module == "__future__"
        and any(a.name == "annotations" for a in n.names)
        for n in tree.body
    )
    if not postponed:
        return []
    nodes = []
    for n in ast.walk(tree):
        if isinstance(n, ast.arg) and n.annotation is not None:
            nodes.append(n.annotation)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.returns is not None:
            nodes.append(n.returns)
        elif isinstance(n, ast.AnnAssign):
            nodes.append(n.annotation)
    return [((a.lineno, a.col_offset), (a.end_lineno, a.end_col_offset)) for a in nodes]


def count(session: Path) -> tuple[int, int]:
    """(results recorded, work items) of a session, read while `exec` may be running."""
    from cosmic_ray.work_db import WorkDB, use_db

    with use_db(str(session), WorkDB.Mode.open) as db:
        return db.num_results, db.num_work_items


def count_pending(session: Path) -> int:
    """Mutants of the session still to run (no result yet, neither run nor skipped)."""
    results, items = count(session)
    return items - results


def count_annotation_skips(session: Path) -> int:
    """Mutants of the session skipped as inside never-evaluated annotations."""
    from cosmic_ray.work_db import WorkDB, use_db

    with use_db(str(session), WorkDB.Mode.open) as db:
        return sum(1 for _, r in db.results if r.output == ANNOTATION_SKIP)


def mutate_spec(text: str, spec) -> tuple[str, str] | None:
    """(mutated source, diff) of one Cosmic Ray mutation of `text`, made as `exec` makes
    them (its own `mutate_code` and `_make_diff`), so an id hashed from this diff is the
    id the run gives the mutant; None when the operator finds nothing to mutate."""
    from cosmic_ray.mutating import _make_diff, mutate_code
    from cosmic_ray.plugins import get_operator

    operator = get_operator(spec.operator_name)(**(spec.operator_args or {}))
    mutated = mutate_code(text, operator, spec.occurrence)
    if mutated is None:
        return None
    return mutated, "\n".join(_make_diff(text, mutated, spec.module_path))


def read_mutants(session: Path) -> list[Mutant]:
    """Every work item of the session with its result (if any), in the stable order.

    One SQL query over the session file, read-only: Cosmic Ray's own reader
    loads each item's mutation with a query of its own, seconds for a share
    of a full run's 5,988 items, and minutes for 64 shares.
    """
    from cosmic_ray.work_item import TestOutcome, WorkerOutcome

    query = (
        "SELECT m.job_id, m.module_path, m.operator_name, m.occurrence, m.start_pos_row, "
        "m.definition_name, r.worker_outcome, r.test_outcome, r.output, r.diff "
        "FROM mutation_specs AS m LEFT JOIN work_results AS r ON r.job_id = m.job_id "
        "ORDER BY m.module_path, m.operator_name, m.occurrence"
    )
    with contextlib.closing(sqlite3.connect(f"file:{session}?mode=ro", uri=True)) as con:
        rows = con.execute(query).fetchall()
    return [
        Mutant(
            job_id=job,
            module_path=path,
            operator=op,
            occurrence=occ,
            line=row,
            definition=definition,
            worker_outcome=WorkerOutcome[worker].value if worker else None,
            test_outcome=TestOutcome[test].value if test else None,
            output=output or "",
            diff=diff or "",
        )
        for job, path, op, occ, row, definition, worker, test, output, diff in rows
    ]


def run_test_command(command: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    """Run the test command once on the unmutated copy: (exit code, output); 124 when it
    outlasts `timeout`."""
    try:
        return run_whole(command, env, timeout)
    except subprocess.TimeoutExpired:
        return 124, f"baseline timed out after {timeout:.0f} s"


def run_whole(
    command: list[str], env: dict[str, str], timeout: float, cwd: Path | None = None
) -> tuple[int, str]:
    """Run `command` in a session of its own: (exit code, output). When it ends, outlasts
    `timeout` (`subprocess.TimeoutExpired`) or this process is interrupted, its whole group
    is killed: the harness's ranks never outlive it."""
    proc = subprocess.Popen(
        command,
        env=dict(env, PYTHONDONTWRITEBYTECODE="1"),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=max(timeout, 0.0))
    finally:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return proc.returncode, out


def child_env(paths: list[Path]) -> dict[str, str]:
    """This environment with `paths` first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [*(str(p) for p in paths), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    )
    return env
