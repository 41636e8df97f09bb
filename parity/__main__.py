"""`python -m parity ...`: the `parity` command, for an environment whose scripts folder is not on PATH."""

import sys

from .cli import main

sys.exit(main())
