"""The test command Cosmic Ray runs for each mutant: import the copy, then run the harness.

`python -m cp_blocktables.mutate.probe --scratch DIR --import MOD ... -- verify ARGS
[-- verify CONFIRM-ARGS]`

1. Puts `DIR` (the scratch package's root) first on `sys.path` and in
   `PYTHONPATH`, so the harness's `--impl cpbt_mutant...` resolves to the copy
   in every rank.
2. Imports each `--import` module. A mutant that does not import (a syntax
   or type error at import time) is *incompetent*: the probe prints
   `INCOMPETENT_MARKER` and exits 3, so the report can tell it from a mutant
   that the harness killed.
3. Runs `python -m cp_blocktables ARGS` in this process (`runpy`), the
   harness's public entry point, and exits with its code: 0 (the mutant
   survived) or non-zero (killed). With `--host-tile N` the copy's kernels
   run interpreted programs of N elements (`CPBT_HOST_TILE`), so that the
   small mutation presets take several programs a launch.
4. When a second `--` gives a confirming run (by default `mutate` passes the
   default sweep) and the first run passed, runs that too: the fast presets
   are a proxy, and a mutant survives only if the default sweep also passes
   it. A mutant the confirming run kills prints `CONFIRM_KILL_MARKER`, so
   the report can count the mutants that only the sweep reaches.
"""

from __future__ import annotations

import argparse
import importlib
import os
import runpy
import subprocess
import sys
import traceback

INCOMPETENT_MARKER = "CPBT-MUTATE: INCOMPETENT"
INCOMPETENT_EXIT = 3
CONFIRM_KILL_MARKER = "CPBT-MUTATE: KILLED BY THE CONFIRMING RUN"
HOST_TILE_ENV = "CPBT_HOST_TILE"  # kernels/_common.py reads it (named here: no kernel import)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: probe --scratch DIR [--import MOD]... -- verify ARGS", file=sys.stderr)
        return 2
    split = argv.index("--")
    rest = argv[split + 1 :]
    confirm = None
    if "--" in rest:
        cut = rest.index("--")
        rest, confirm = rest[:cut], rest[cut + 1 :]
    p = argparse.ArgumentParser(prog="cp_blocktables.mutate.probe")
    p.add_argument("--scratch", required=True)
    p.add_argument("--import", dest="imports", action="append", default=[])
    p.add_argument("--host-tile", type=int, default=0)
    args = p.parse_args(argv[:split])
    if args.host_tile:  # before the copy is imported: the kernels read it at import
        os.environ[HOST_TILE_ENV] = str(args.host_tile)
    sys.path.insert(0, args.scratch)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        x for x in (args.scratch, os.environ.get("PYTHONPATH", "")) if x
    )
    for name in args.imports:
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - anything at import time makes the mutant unusable
            print(f"{INCOMPETENT_MARKER}: importing {name} failed", flush=True)
            traceback.print_exc(file=sys.stdout)
            return INCOMPETENT_EXIT
    code = _harness(rest)
    if code != 0 or confirm is None:
        return code
    code = _confirm(confirm)
    if code != 0:
        print(CONFIRM_KILL_MARKER, flush=True)
    return code


def _confirm(args: list[str]) -> int:
    """The confirming run, in a process of its own with the default tiles: this one's
    imported kernels (and ranks forked from it) keep the fast stage's `--host-tile`."""
    env = {k: v for k, v in os.environ.items() if k != HOST_TILE_ENV}
    return subprocess.run([sys.executable, "-m", "cp_blocktables", *args], env=env).returncode


def _harness(args: list[str]) -> int:
    """Run `python -m cp_blocktables ARGS` here; its exit code."""
    sys.argv = ["cp_blocktables", *args]
    try:
        runpy.run_module("cp_blocktables", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code
        if code is None:
            return 0
        return code if isinstance(code, int) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
