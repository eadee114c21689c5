"""What one rank process does: join the process group, then run test bodies on request.

A worker is started by `pool.RankPool` from a fork server or by "spawn", never by
forking the pytest process (a fork of a process that has run torch may inherit locked
mutexes and dead threads). It initialises `torch.distributed` once, through a
`FileStore` in the pool's private directory, so no TCP port is chosen ahead of time and
any number of pools can rendezvous at once on one host. It then serves messages from its pipe:

- `("run", task)`: take the pytest process's environment, working directory and
  `sys.path` as of this test, import the test module by path (with pytest's assertion
  rewriting), call the test with this rank's fixtures, answer `("result", outcome)`;
- `("ping", None)`: one all-reduce, to prove every rank and the group still work;
  answer `("pong", error_or_None)`;
- `("stop", None)`: leave the process group and exit.

Invariants: one message in, one message out, so a reused pool has nothing stale in its
pipes; the outcome is plain data (no exception objects cross the pipe); stdout and
stderr go to per-rank files truncated at the start of every test, and a SIGUSR1 (or a
fatal signal) dumps every thread's Python stack into the rank's stack file.
"""

from __future__ import annotations

import ast
import contextlib
import datetime
import faulthandler
import importlib
import importlib.util
import os
import pickle
import shutil
import sys
import threading
import time
import traceback
from typing import Any

from .protocol import (
    ORPHAN_WATCH_FRAME,
    PLUGIN_FIXTURES,
    STACK_SIGNAL,
    Outcome,
    Task,
    WorkerFixture,
    WorkerSpec,
    make_block_tables_factory,
    pool_file,
    rank_device,
    seed_everything,
)

# Importers that know these names as `worker.X` keep working.
__all__ = [
    "ORPHAN_WATCH_FRAME",
    "PLUGIN_FIXTURES",
    "STACK_SIGNAL",
    "Outcome",
    "Task",
    "WorkerFixture",
    "WorkerSpec",
    "main",
    "make_block_tables_factory",
    "pool_file",
    "rank_device",
    "seed_everything",
]


def main(conn, owner, spec: WorkerSpec) -> None:
    """Entry point of a rank process: serve `conn` until told to stop or orphaned.

    `owner` is the read end of a pipe whose only writer is the pytest process: it reads
    end-of-file when that process is gone, however it died.
    """
    if spec.capture:
        _redirect_output(spec)
    stack_file = _arm_stack_dumps(spec)
    _exit_when_orphaned(owner, spec.pool_dir)
    try:
        worker = _Worker(spec, stack_file)
    except BaseException:
        conn.send(("start_failed", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    worker.serve(conn)


def _redirect_output(spec: WorkerSpec) -> None:
    for fd, kind in ((1, "stdout"), (2, "stderr")):
        target = os.open(pool_file(spec.pool_dir, kind, spec.rank), os.O_WRONLY | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)


def _arm_stack_dumps(spec: WorkerSpec):
    stack_file = open(pool_file(spec.pool_dir, "stack", spec.rank), "ab")  # noqa: SIM115
    faulthandler.enable(file=stack_file, all_threads=True)
    if STACK_SIGNAL is not None:
        faulthandler.register(STACK_SIGNAL, file=stack_file, all_threads=True)
    return stack_file


def _exit_when_orphaned(owner, pool_dir: str) -> None:
    def _orphan_watch() -> None:
        with contextlib.suppress(EOFError, OSError):
            owner.recv()
        shutil.rmtree(pool_dir, ignore_errors=True)
        os._exit(3)

    threading.Thread(target=_orphan_watch, name="orphan-watch", daemon=True).start()


class _Worker:
    def __init__(self, spec: WorkerSpec, stack_file) -> None:
        import torch
        import torch.distributed as dist

        self.spec = spec
        self.stack_file = stack_file
        self.rank_env = {
            "RANK": str(spec.rank),
            "WORLD_SIZE": str(spec.world_size),
            "LOCAL_RANK": str(spec.rank),
            "LOCAL_WORLD_SIZE": str(spec.world_size),
        }
        os.environ.update(self.rank_env)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
        self.device = rank_device(spec.device, spec.rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        store = dist.FileStore(os.path.join(spec.pool_dir, "store"), spec.world_size)
        dist.init_process_group(
            spec.backend,
            store=store,
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=datetime.timedelta(seconds=spec.pg_timeout_s),
        )
        self.fixtures = {
            "rank": spec.rank,
            "world_size": spec.world_size,
            "device": self.device,
            "block_tables_factory": make_block_tables_factory(
                spec.rank, spec.world_size, self.device
            ),
        }

    def serve(self, conn) -> None:
        import torch.distributed as dist

        while True:
            try:
                kind, payload = conn.recv()
            except EOFError:
                return
            if kind == "run":
                conn.send(("result", self.run(payload)))
            elif kind == "ping":
                conn.send(("pong", self.health_error()))
            else:
                break
        dist.destroy_process_group()

    def health_error(self) -> str | None:
        import torch
        import torch.distributed as dist

        try:
            ones = torch.ones(1, device=self.device)  # [1]
            dist.all_reduce(ones)
            total = int(ones.item())
        except Exception as exc:
            return f"health all-reduce failed: {exc!r}"
        if total != self.spec.world_size:
            return f"health all-reduce gave {total}, expected {self.spec.world_size}"
        return None

    def run(self, task: Task) -> Outcome:
        """Run one test body; the process state a body commonly changes is put back after."""
        __tracebackhide__ = True
        import torch

        self._truncate_outputs()
        saved_env, saved_cwd = dict(os.environ), os.getcwd()
        saved_dtype, saved_threads = torch.get_default_dtype(), torch.get_num_threads()
        if task.env:
            os.environ.clear()
            os.environ.update(task.env)
            os.environ.update(self.rank_env)
        start = time.perf_counter()
        try:
            outcome = _call(task, self.fixtures, self.spec.rank)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.environ.clear()
            os.environ.update(saved_env)
            os.chdir(saved_cwd)
            torch.set_default_dtype(saved_dtype)
            torch.set_num_threads(saved_threads)
        outcome.duration_s = time.perf_counter() - start
        return outcome

    def _truncate_outputs(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        if self.spec.capture:
            os.ftruncate(1, 0)
            os.ftruncate(2, 0)
        self.stack_file.flush()
        os.ftruncate(self.stack_file.fileno(), 0)


def _call(task: Task, fixtures: dict, rank: int) -> Outcome:
    """Run the test body and turn however it ended into an `Outcome` (never raises)."""
    __tracebackhide__ = True
    from _pytest._code import ExceptionInfo
    from _pytest.outcomes import Skipped, XFailed

    try:
        _sync_sys_path(task.sys_path)
        os.chdir(task.cwd)
        seed_everything(task.seed)
        func = _resolve(task)
        kwargs = pickle.loads(task.kwargs)
        kwargs = {k: _substitute(v, fixtures) for k, v in kwargs.items()}
        result = func(**kwargs)
        if result is not None and hasattr(result, "__await__"):
            result.close()
            raise TypeError("async test functions are not supported in @pytest.mark.ranks")
    except Skipped as exc:
        return Outcome(rank, "skipped", message=exc.msg)
    except XFailed as exc:
        return Outcome(rank, "xfailed", message=exc.msg)
    except BaseException as exc:
        info = ExceptionInfo.from_exception(exc)
        style = {"auto": "long", "line": "short"}.get(task.tbstyle, task.tbstyle)
        text = str(info.getrepr(style=style, showlocals=task.showlocals, tbfilter=True))
        return Outcome(rank, "failed", message=info.exconly().splitlines()[0], longrepr=text)
    return Outcome(rank, "passed")


def _substitute(value: Any, fixtures: dict) -> Any:
    if isinstance(value, WorkerFixture):
        return fixtures[value.name]
    return value


def _sync_sys_path(parent_path: tuple[str, ...]) -> None:
    missing = [p for p in parent_path if p not in sys.path]
    sys.path[:0] = missing


def _resolve(task: Task):
    """Find the test callable: a module attribute, or a method of a fresh class instance."""
    obj = _load_module(task.module_name, task.module_path)
    owner = None
    for name in task.attr_path:
        if isinstance(obj, type):
            owner = obj
        obj = getattr(obj, name)
    if owner is not None:
        return getattr(owner(), task.attr_path[-1])
    return obj


def _load_module(name: str, path: str | None):
    """Import a test module from its file, rewriting asserts the way pytest does.

    A module already loaded from the same file is reused, so a pooled worker imports
    each test module once.
    """
    loaded = sys.modules.get(name)
    if path is None:
        return loaded if loaded is not None else importlib.import_module(name)
    if loaded is not None and _same_file(getattr(loaded, "__file__", None), path):
        return loaded
    package = name.rpartition(".")[0]
    if package:
        with contextlib.suppress(ImportError):
            importlib.import_module(package)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    code = _compile_with_rewritten_asserts(path)
    sys.modules[name] = module
    try:
        exec(code, module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _compile_with_rewritten_asserts(path: str):
    with open(path, "rb") as f:
        source = f.read()
    tree = ast.parse(source, filename=path)
    try:
        from _pytest.assertion.rewrite import rewrite_asserts

        rewrite_asserts(tree, source, path)
    except Exception:
        tree = ast.parse(source, filename=path)
    return compile(tree, path, "exec", dont_inherit=True)


def _same_file(a: str | None, b: str) -> bool:
    try:
        return a is not None and os.path.samefile(a, b)
    except OSError:
        return False
