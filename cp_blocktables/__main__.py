"""`python -m cp_blocktables COMMAND ...`: the same entry point as `cp-blocktables`."""

import sys

from .cli import main

sys.exit(main())
