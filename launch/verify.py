"""torchrun entry point of the harness: one process per CP rank.

    torchrun --nproc-per-node 4 launch/verify.py --preset default --report out/verify.json

Takes the options of `cp-blocktables verify`; the ranks join the process group
that torchrun describes in their environment instead of spawning their own.
"""

import sys

from cp_blocktables.cli import main

if __name__ == "__main__":
    sys.exit(main(["verify", *sys.argv[1:]]))
