"""The benchmark harness: ``python benchmarks/run.py ARGS`` (``--help`` lists them).

The code is benchmarks/harness.py, outside the package: it imports scoremod's
public API only. See benchmarks/README.md for the commands and what is measured.
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # this checkout's scoremod, and the harness

from harness import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
