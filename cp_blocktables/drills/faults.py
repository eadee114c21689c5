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
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

SCENARIOS = ("raise", "restart", "hang", "mismatch")
FAULT_STEP = 2
_MARKER = "CP_BLOCKTABLES_DRILL_MARKER"
FAULT_ENV = "CP_BLOCKTABLES_DRILL_FAULT"
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


@dataclass
class Outcome:
    """What one scenario promised, what was seen, and whether they match."""

    scenario: str
    promise: str
    passed: bool = False
    observed: str = ""
    wall_s: float = 0.0
    exit_codes: list[int | None] = field(default_factory=list)
    leftovers: list[int] = field(default_factory=list)
    output_tail: str = ""


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


# ---------------------------------------------------------------- the fault a rank injects


class InjectedFault(RuntimeError):
    """Raised by a rank that the fault drill told to fail mid-step."""


@dataclass
class Fault:
    """A fault to inject (`CP_BLOCKTABLES_DRILL_FAULT=KIND:rank=R:step=S[:attempt=A]`).

    At step `S` of the first serve phase, after the step's kernels ran and
    before its first collective, rank `R` raises `InjectedFault` (`raise`) or
    sleeps forever (`hang`). With `attempt=A` only torchrun's attempt `A`
    (`TORCHELASTIC_RESTART_COUNT`) faults, so that a restarted group passes.
    """

    kind: str
    rank: int
    step: int
    attempt: int | None = None
    armed: str = ""

    @staticmethod
    def from_environ(rank: int) -> Fault | None:
        text = os.environ.get(FAULT_ENV, "")
        if not text:
            return None
        kind, *fields = text.split(":")
        try:
            values = {k: int(v) for k, v in (f.split("=", 1) for f in fields)}
            fault = Fault(kind, values.pop("rank"), values.pop("step"), values.pop("attempt", None))
        except (ValueError, KeyError) as e:
            raise ValueError(
                f"{FAULT_ENV}={text!r}: expected KIND:rank=R:step=S[:attempt=A] ({e})"
            ) from None
        if kind not in ("raise", "hang") or values:
            raise ValueError(
                f"{FAULT_ENV}={text!r}: KIND is raise or hang, fields rank, step, attempt"
            )
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if fault.rank != rank or fault.attempt not in (None, attempt):
            return None
        return fault

    def after_step(self, step: int, where: str) -> None:
        if step == self.step and not self.armed:
            self.armed = f"step {step} of {where}"

    def before_collective(self) -> None:
        if not self.armed:
            return
        if self.kind == "hang":
            print(
                f"cp-blocktables: rank {self.rank}: injected hang at {self.armed}",
                file=sys.stderr,
                flush=True,
            )
            while True:
                time.sleep(1)
        raise InjectedFault(f"injected fault: rank {self.rank} raised at {self.armed}")


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
    text = _text(_run(out, [_torchrun(opts, logs, 0)], [env], _deadline(opts)))
    errors = _error_files(logs, attempt=0)
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
    text = _text(_run(out, [_torchrun(opts, logs, 1)], [env], _deadline(opts)))
    message = _error_files(logs, attempt=0).get(bad, "")
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
    lines = _run(out, [_torchrun(opts, logs, 0)], [env], _deadline(opts))
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
    port = _free_port()
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
    text = _text(_run(out, cmds, envs, _deadline(opts)))
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


# ---------------------------------------------------------------- processes


def _deadline(opts: FaultDrillOptions) -> float:
    """How long a scenario may take before the drill kills it: timeouts plus a slow start."""
    return 4 * opts.timeout + 240


def _run(
    out: Outcome, cmds: list[list[str]], envs: list[dict], deadline: float
) -> list[tuple[float, str]]:
    """Start `cmds` (marked), wait up to `deadline` s, kill what is left.

    Returns every line they printed with the second it arrived (from the start).
    """
    marker = uuid.uuid4().hex
    root = str(Path(__file__).resolve().parents[2])
    base = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
    base["PYTHONPATH"] = os.pathsep.join(p for p in (root, base.get("PYTHONPATH", "")) if p)
    base[_MARKER] = marker
    t0 = time.monotonic()
    procs = [
        subprocess.Popen(
            cmd,
            cwd=root,
            env={**base, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for cmd, env in zip(cmds, envs)
    ]
    lines: list[tuple[float, str]] = []

    def read(p: subprocess.Popen) -> None:
        for line in p.stdout:
            lines.append((time.monotonic() - t0, line.rstrip("\n")))

    readers = [threading.Thread(target=read, args=(p,)) for p in procs]
    for t in readers:
        t.start()
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            out.observed = f"did not end within {deadline:.0f} s; killed"
    for p in procs:
        if p.poll() is None:
            _kill_group(p.pid)
            p.wait()
    for t in readers:
        t.join()
    out.wall_s = round(time.monotonic() - t0, 1)
    out.exit_codes = [p.returncode for p in procs]
    time.sleep(0.5)
    out.leftovers = _leftovers(marker)
    for pid in out.leftovers:
        _kill(pid)
    lines.sort(key=lambda x: x[0])
    out.output_tail = "\n".join(line for _, line in lines)[-4000:]
    return lines


_TORCHRUN_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_ERROR_FILE",
    FAULT_ENV,
)


def _error_files(logs: Path, attempt: int) -> dict[int, str]:
    """Local rank -> the message of its torchrun error file, for one attempt."""
    found = {}
    for path in glob.glob(str(logs / "*" / f"attempt_{attempt}" / "*" / "error.json")):
        try:
            data = json.loads(Path(path).read_text())
            found[int(Path(path).parent.name)] = data["message"]["message"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


def _leftovers(marker: str) -> list[int]:
    """Live processes whose environment carries `marker` (Linux `/proc`; elsewhere none seen)."""
    needle = f"{_MARKER}={marker}".encode()
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            mine = needle in (entry / "environ").read_bytes().split(b"\0")
            if mine and ") Z " not in (entry / "stat").read_text():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pgid, signal.SIGKILL)


def _kill(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
