"""The processes of a fault scenario: started marked, timed, killed if late, none left behind.

Every process a scenario starts (and their children) carries a marker in its
environment; `run_marked` waits for them up to a deadline, kills what is
left, and records every line they printed with the second it arrived, their
exit codes and any marked process still alive afterwards (killed, and a
failure of the scenario).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import random
import signal
import socket
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from .fault_inject import FAULT_ENV

MARKER = "CP_BLOCKTABLES_DRILL_MARKER"


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


def run_marked(
    out: Outcome, cmds: list[list[str]], envs: list[dict], deadline: float
) -> list[tuple[float, str]]:
    """Start `cmds` (marked), wait up to `deadline` s, kill what is left.

    Returns every line they printed with the second it arrived (from the start).
    """
    marker = uuid.uuid4().hex
    root = str(Path(__file__).resolve().parents[2])  # the checkout: launch/ lives here
    base = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
    base["PYTHONPATH"] = os.pathsep.join(p for p in (root, base.get("PYTHONPATH", "")) if p)
    base[MARKER] = marker
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
    out.leftovers = leftovers(marker)
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


def error_files(logs: Path, attempt: int) -> dict[int, str]:
    """Local rank -> the message of its torchrun error file, for one attempt."""
    found = {}
    for path in glob.glob(str(logs / "*" / f"attempt_{attempt}" / "*" / "error.json")):
        try:
            data = json.loads(Path(path).read_text())
            found[int(Path(path).parent.name)] = data["message"]["message"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


def leftovers(marker: str) -> list[int]:
    """Live processes whose environment carries `marker` (Linux `/proc`; elsewhere none seen)."""
    needle = f"{MARKER}={marker}".encode()
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


_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000


def free_port(ephemeral: Path = _EPHEMERAL) -> int:
    """A port that is free now and that the kernel will not hand to anybody else.

    Ranks launched by hand learn the store's port before rank 0 binds it, so
    the port is chosen here, released, and bound seconds later. A port from
    the kernel's ephemeral range (what `bind(0)` gives) can be handed out
    again in between: to a torchrun agent's store or a gloo socket of a run
    beside this one, and a rank then joins a stranger's store. The kernel
    hands out only ports inside `ip_local_port_range` (to `bind(0)` and to
    `connect`), so the port is drawn at random below it; only another
    explicit choice could take it. Where that range leaves no room below,
    `bind(0)` it is.
    """
    try:
        low = int(ephemeral.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = _LOWEST
    rng = random.SystemRandom()
    for _ in range(64 if low - _LOWEST >= 1024 else 0):
        port = rng.randrange(_LOWEST, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
