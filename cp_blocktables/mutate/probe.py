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
   survived) or non-zero (killed).
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
import sys
import traceback

INCOMPETENT_MARKER = "CPBT-MUTATE: INCOMPETENT"
INCOMPETENT_EXIT = 3
CONFIRM_KILL_MARKER = "CPBT-MUTATE: KILLED BY THE CONFIRMING RUN"


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
    args = p.parse_args(argv[:split])
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
    code = _harness(confirm)
    if code != 0:
        print(CONFIRM_KILL_MARKER, flush=True)
    return code


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
