"""Spawning the ranks locally: `spawn_local` forks `world_size` ranks of the current
process (the parent has already imported torch, and our implementation when
it is under test, so a rank starts in milliseconds), hosts the rendezvous
store itself as torchrun's agent does, sets the same environment torchrun
sets, waits, and kills every rank that is still alive once one has failed and
the others have had the collective timeout to notice. Every child is gone when it returns.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist


def spawn_local(
    world_size: int, rank_main: Callable[[], int], timeout: float, impls: Sequence[str] = ()
) -> int:
    """Fork `world_size` ranks that each run `rank_main()` under a torchrun-like environment.

    `impls`: the implementations the ranks will load (see `impl_loader.preload`).
    Returns rank 0's exit code, or 1 when any rank failed or had to be killed.
    """
    from .impl_loader import preload

    preload(impls)
    sys.stdout.flush()
    sys.stderr.flush()
    ctx = multiprocessing.get_context("fork")
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
    procs = [
        ctx.Process(
            target=_child,
            args=(r, world_size, pipes[r][0], rank_main),
            name=f"cp-blocktables-rank{r}",
        )
        for r in range(world_size)
    ]
    store = None
    try:
        for p in procs:
            p.start()
        store = dist.TCPStore(
            "127.0.0.1",
            0,
            world_size,
            is_master=True,
            timeout=timedelta(seconds=timeout),
            wait_for_workers=False,
        )
        for _, send in pipes:
            send.send(store.port)
        return _wait(procs, timeout)
    finally:
        _reap(procs)
        del store


def _child(rank: int, world_size: int, port_pipe, rank_main: Callable[[], int]) -> None:
    _die_with_parent()
    faulthandler.enable()  # a crash prints the line it happened on (see `_wait`)
    port = port_pipe.recv()
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "GROUP_RANK": "0",
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(world_size),
            "ROLE_NAME": "default",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": f"cp-blocktables-{os.getppid()}",
            "OMP_NUM_THREADS": "1",
        }
    )
    torch.set_num_threads(1)
    code = rank_main()
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


def _die_with_parent() -> None:
    """Linux: the kernel kills this rank if the spawning process dies first."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


_FATAL = {signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGABRT}
"""Signals after which faulthandler (enabled on every rank) has printed where the rank was."""


def _wait(procs: list, timeout: float) -> int:
    """Wait for every rank; once one failed, give the rest a grace period, then kill them.

    A rank that failed cleanly (exit 1 or 2) has printed its diagnosis, and
    the peers it waited on are hung: 5 s. So has a rank that a fatal signal
    ended (faulthandler printed the line it crashed on, and the spawner names
    the signal): 5 s. Any other crash has not, and its peers need up to the
    collective timeout to notice and say so. Ranks killed here are named once.
    """
    failed_at, grace, alive = None, 0.0, []
    while True:
        codes = [p.exitcode for p in procs]
        if all(c is not None for c in codes):
            break
        bad = [c for c in codes if c not in (None, 0)]
        if bad and failed_at is None:
            failed_at = time.monotonic()
            grace = 5.0 if all(c in (1, 2) or -c in _FATAL for c in bad) else timeout + 5.0
        if failed_at is not None and time.monotonic() - failed_at > grace:
            alive = [r for r, c in enumerate(codes) if c is None]
            print(
                f"cp-blocktables: killing ranks {alive}: still running {grace:.0f} s after "
                f"another rank failed",
                file=sys.stderr,
                flush=True,
            )
            _reap(procs)
            codes = [p.exitcode for p in procs]
            break
        time.sleep(0.05)
    for r, c in enumerate(codes):
        if c not in (0, 1, 2) and r not in alive:
            print(
                f"cp-blocktables: rank {r} ended abnormally ({_why(c)})",
                file=sys.stderr,
                flush=True,
            )
    if codes[0] in (0, 1, 2) and all(c in (0, 1, 2) for c in codes):
        worst = max(codes)
        return codes[0] if codes[0] == worst else 1
    return 1


def _why(code: int | None) -> str:
    """A rank's exit code in words; a segmentation fault names its likely cause here."""
    if code is None or code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = "unknown"
    why = f"signal {-code}, {name}"
    if -code in (signal.SIGSEGV, signal.SIGBUS):
        why += (
            ": an access to unmapped memory; on the CPU every input and caller-owned output "
            "the harness hands over ends at an unreadable page, so it may be a read past an "
            "input's end or a write past an output's"
        )
    return why


def _reap(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
