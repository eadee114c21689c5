"""torchrun entry point of the drills on live state: one process per rank, errors recorded.

    torchrun --nproc-per-node 4 launch/drill.py --sizes 4,2,4 --preset cp2-i1
    torchrun --nproc-per-node 4 launch/drill.py wake-up --sizes 4,2,4 --preset cp2-i1

A first argument `null-block` or `wake-up` picks the drill (default
`null-block`); the rest are that drill's options (`cp-blocktables drill
null-block --help`). `@record` makes a rank that raises write torchrun's
error file (its rank and traceback), which torchrun's summary then names;
`cp-blocktables drill faults` relies on it.
"""

import sys

from torch.distributed.elastic.multiprocessing.errors import record

from cp_blocktables.cli import main

DRILLS = ("null-block", "wake-up")


@record
def run() -> int:
    args = sys.argv[1:]
    drill = args.pop(0) if args and args[0] in DRILLS else "null-block"
    return main(["drill", drill, *args])


if __name__ == "__main__":
    sys.exit(run())
