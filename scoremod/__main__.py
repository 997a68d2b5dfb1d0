"""``python -m scoremod``: the command line (see scoremod/cli.py)."""

import sys

from scoremod.cli import main

sys.exit(main())
