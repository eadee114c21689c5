"""torchrun entry point of the null-block drill: one process per rank, errors recorded.

    torchrun --nproc-per-node 4 launch/drill.py --sizes 4,2,4 --preset cp2-i1

Takes the options of `cp-blocktables drill null-block`. `@record` makes a rank
that raises write torchrun's error file (its rank and traceback), which
torchrun's summary then names; `cp-blocktables drill faults` relies on it.
"""

import sys

from torch.distributed.elastic.multiprocessing.errors import record

from cp_blocktables.cli import main


@record
def run() -> int:
    return main(["drill", "null-block", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(run())
