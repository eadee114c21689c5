"""Starting harness processes from tests: the CLI, torchrun, hand-made ranks; leak checks.

Every process a test starts carries a marker in its environment, so a test
can prove afterwards that none of them (or of their children) is left.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = "CP_BLOCKTABLES_TEST_MARKER"


def child_env(marker: str | None = None, **extra: str) -> dict[str, str]:
    """This environment with the repository importable and a leak marker set."""
    env = dict(os.environ)
    for var in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_USE_AGENT_STORE",
        "LOCAL_WORLD_SIZE",
    ):
        env.pop(var, None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env[MARKER] = marker or uuid.uuid4().hex
    env.update(extra)
    return env


def run_cli(
    args: list[str], timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`python -m cp_blocktables ARGS` from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", "cp_blocktables", *args],
        cwd=ROOT,
        env=env or child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def leftover_processes(marker: str) -> list[int]:
    """Pids of live processes whose environment carries `marker`."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                stat = (entry / "stat").read_text()
                if ") Z " not in stat:
                    found.append(int(entry.name))
        except OSError:
            continue
    return found
