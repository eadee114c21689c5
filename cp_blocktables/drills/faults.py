"""`cp-blocktables drill faults`: ranks that fail end the run, are named, and leave nothing.

Each scenario is a real run of the null-block drill (`launch/drill.py`) with
`--nproc` ranks; the last rank misbehaves (`Fault`, set through
`CP_BLOCKTABLES_DRILL_FAULT`):

- `raise`: it raises at step 2 of its first serve phase, under torchrun.
  Promised: torchrun exits non-zero; its error file (written by `@record`)
  and its summary name the rank; the message names the step.
- `restart`: the same on torchrun's first attempt only, with
  `--max-restarts 1`. Promised: the restarted group starts from a fresh
  state and passes (exit 0).
- `hang`: it sleeps before step 2's first collective, under torchrun.
  Promised: the other ranks end within the collective timeout naming the
  missing rank; torchrun exits non-zero.
- `mismatch`: it is started with another interleave and seed (the ranks are
  launched by hand, as separate nodes would be). Promised: refused before
  any step, by field and rank.

In every scenario, each process the drill started (and their children: every
one carries a marker in its environment) is gone when the scenario ends; a
survivor is killed and the scenario fails. The scenarios run side by side.

The fault itself is `fault_inject.Fault`; starting, timing and reaping the
processes is `procs.run_marked`.
"""

from __future__ import annotations

import json
import math
import re
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .fault_inject import FAULT_ENV
from .procs import Outcome, error_files, free_port, run_marked

SCENARIOS = ("raise", "restart", "hang", "mismatch")
FAULT_STEP = 2
_SLACK_S = 5.0
"""Beyond the collective timeout: gloo's timer granularity and a busy scheduler."""
_SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "drill.py"


@dataclass
class FaultDrillOptions:
    nproc: int = 2
    timeout: float = 10.0
    scenarios: list[str] = field(default_factory=list)
    preset: str = "cp2-i1"
    steps: int = 6
    keep_logs: str | None = None
    report_path: str | None = None


def run_fault_drill(opts: FaultDrillOptions) -> int:
    """Run the scenarios side by side, print a table; 0 when every promise held."""
    if not _SCRIPT.is_file():
        print(f"cp-blocktables drill faults: needs {_SCRIPT} (a source checkout)", file=sys.stderr)
        return 2
    names = opts.scenarios or list(SCENARIOS)
    with tempfile.TemporaryDirectory(prefix="cpbt-faults-") as tmp:
        logs = Path(opts.keep_logs or tmp)
        outcomes: dict[str, Outcome] = {}
        threads = [
            threading.Thread(
                target=lambda n=n: outcomes.__setitem__(n, _SCENARIO_RUNNERS[n](opts, logs / n))
            )
            for n in names
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    ordered = [outcomes[n] for n in names]
    _print(opts, ordered)
    if opts.report_path:
        Path(opts.report_path).parent.mkdir(parents=True, exist_ok=True)
        data = {"passed": all(o.passed for o in ordered), "outcomes": [asdict(o) for o in ordered]}
        Path(opts.report_path).write_text(json.dumps(data, indent=1) + "\n")
    return 0 if all(o.passed for o in ordered) else 1


# ---------------------------------------------------------------- scenarios


def _drill_args(opts: FaultDrillOptions) -> list[str]:
    return [
        "--preset",
        opts.preset,
        "--steps",
        str(opts.steps),
        "--timeout",
        f"{opts.timeout:g}",
        "--quiet",
    ]


def _torchrun(opts: FaultDrillOptions, logs: Path, restarts: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(opts.nproc),
        "--max-restarts",
        str(restarts),
        "--log-dir",
        str(logs),
        str(_SCRIPT),
        *_drill_args(opts),
    ]


def _raise(opts: FaultDrillOptions, logs: Path) -> Outcome:
    bad = opts.nproc - 1
    out = Outcome(
        "raise",
        f"rank {bad} raises at step {FAULT_STEP}: exit non-zero, torchrun's error file and "
        f"summary name rank {bad}, the message names the step",
    )
    env = {FAULT_ENV: f"raise:rank={bad}:step={FAULT_STEP}"}
    text = _text(run_marked(out, [_torchrun(opts, logs, 0)], [env], _deadline(opts)))
    errors = error_files(logs, attempt=0)
    root = re.search(r"Root Cause.*?rank\s*:\s*(\d+)", text, re.S)
    message = errors.get(bad, "")
    out.passed = (
        out.exit_codes[0] not in (0, None)
        and root is not None
        and int(root.group(1)) == bad
        and "InjectedFault" in message
        and f"step {FAULT_STEP} " in message
        and not out.leftovers
    )
    out.observed = (
        f"exit {out.exit_codes[0]}; torchrun's root cause: rank "
        f"{root.group(1) if root else '?'}; error file of rank {bad}: {message or 'missing'}"
    )
    return out


def _restart(opts: FaultDrillOptions, logs: Path) -> Outcome:
    bad = opts.nproc - 1
    out = Outcome(
        "restart",
        f"rank {bad} raises on torchrun's attempt 0 only; with --max-restarts 1 attempt 1 "
        f"starts fresh and passes: exit 0",
    )
    env = {FAULT_ENV: f"raise:rank={bad}:step={FAULT_STEP}:attempt=0"}
    text = _text(run_marked(out, [_torchrun(opts, logs, 1)], [env], _deadline(opts)))
    message = error_files(logs, attempt=0).get(bad, "")
    passed_again = "PASS" in text and "torchrun attempt 1" in text
    out.passed = (
        out.exit_codes[0] == 0 and "InjectedFault" in message and passed_again and not out.leftovers
    )
    out.observed = (
        f"attempt 0, rank {bad}: {message or 'no error file'}; attempt 1: "
        f"{'PASS' if passed_again else 'did not pass'}; exit {out.exit_codes[0]}"
    )
    return out


def _hang(opts: FaultDrillOptions, logs: Path) -> Outcome:
    bad = opts.nproc - 1
    out = Outcome(
        "hang",
        f"rank {bad} hangs before step {FAULT_STEP}'s collective: the others end within the "
        f"{opts.timeout:g} s timeout naming rank {bad}; exit non-zero",
    )
    env = {FAULT_ENV: f"hang:rank={bad}:step={FAULT_STEP}"}
    lines = run_marked(out, [_torchrun(opts, logs, 0)], [env], _deadline(opts))
    pattern = re.compile(
        rf"rank \d+: collective #\d+ \(.*?\) failed after at most \d+ s: never reached by "
        rf"rank {bad} \(.*?\)"
    )
    hung = next((t for t, line in lines if "injected hang" in line), None)
    named = next(((t, m.group(0)) for t, line in lines if (m := pattern.search(line))), None)
    waited = None if hung is None or named is None else named[0] - hung
    out.passed = (
        out.exit_codes[0] not in (0, None)
        and waited is not None
        and waited <= opts.timeout + _SLACK_S
        and not out.leftovers
    )
    if waited is None:
        out.observed = f"exit {out.exit_codes[0]}; no rank named the missing one"
    else:
        out.observed = (
            f"exit {out.exit_codes[0]}; {named[1]}, {waited:.1f} s after rank {bad} hung; "
            f"every process gone {out.wall_s - hung:.1f} s after it hung"
        )
    return out


def _mismatch(opts: FaultDrillOptions, logs: Path) -> Outcome:
    bad = opts.nproc - 1
    interleave = _other_interleave(opts.preset)
    extra = ["--seed", "1"] + ([] if interleave is None else ["--cp-interleave", str(interleave)])
    fields = ["seed"] + ([] if interleave is None else ["cp_interleave"])
    out = Outcome(
        "mismatch",
        f"rank {bad} started with another {' and '.join(fields)}: refused before any step, "
        f"naming each field and rank {bad}",
    )
    port = free_port()
    cmds, envs = [], []
    for r in range(opts.nproc):
        cmds.append(
            [sys.executable, str(_SCRIPT), *_drill_args(opts), *(extra if r == bad else [])]
        )
        envs.append(
            {
                "RANK": str(r),
                "WORLD_SIZE": str(opts.nproc),
                "LOCAL_RANK": str(r),
                "LOCAL_WORLD_SIZE": str(opts.nproc),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
        )
    text = _text(run_marked(out, cmds, envs, _deadline(opts)))
    lines = [ln.strip() for ln in text.splitlines() if "differs between ranks" in ln]
    named = all(any(f"field {f!r}" in ln and f"rank {bad}:" in ln for ln in lines) for f in fields)
    out.passed = (
        all(c == 1 for c in out.exit_codes)
        and "refused before any step" in text
        and named
        and "serve 1" not in text
        and not out.leftovers
    )
    out.observed = f"exit codes {out.exit_codes}; " + (" | ".join(lines) or "nothing refused")
    return out


_SCENARIO_RUNNERS = {"raise": _raise, "restart": _restart, "hang": _hang, "mismatch": _mismatch}


def _text(lines: list[tuple[float, str]]) -> str:
    return "\n".join(line for _, line in lines)


def _other_interleave(name: str) -> int | None:
    """An interleave the preset accepts other than its own, or None."""
    from ..harness.presets import PRESETS

    p = PRESETS[name]
    sharded = [g.block_size for g in p.groups if g.sharded] if p.cp_size > 1 else []
    if not sharded:
        return p.cp_interleave + 1
    gcd = math.gcd(*sharded)
    options = [i for i in range(gcd, 0, -1) if gcd % i == 0 and i != p.cp_interleave]
    return options[0] if options else None


def _deadline(opts: FaultDrillOptions) -> float:
    """How long a scenario may take before the drill kills it: timeouts plus a slow start."""
    return 4 * opts.timeout + 240


def _print(opts: FaultDrillOptions, outcomes: list[Outcome]) -> None:
    lines = [
        f"cp-blocktables drill faults: {opts.nproc} ranks a run, preset {opts.preset}, "
        f"collective timeout {opts.timeout:g} s"
    ]
    for o in outcomes:
        left = "none" if not o.leftovers else f"{o.leftovers} (killed)"
        lines += [
            "",
            f"{o.scenario}: {'ok' if o.passed else 'FAIL'} ({o.wall_s:.1f} s)",
            f"  promised: {o.promise}",
            f"  observed: {o.observed}",
            f"  processes left after the run: {left}",
        ]
        if not o.passed:
            lines += ["  output (tail):", *("    " + ln for ln in o.output_tail.splitlines()[-25:])]
    bad = [o.scenario for o in outcomes if not o.passed]
    lines += [
        "",
        f"FAIL: {', '.join(bad)}"
        if bad
        else f"PASS: {len(outcomes)} fault scenarios ended as promised; no process outlived a run",
    ]
    print("\n".join(lines), flush=True)
