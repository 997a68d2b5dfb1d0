"""The benchmark harness: ``python benchmarks/run.py ARGS`` is ``scoremod bench ARGS``.

The code lives in scoremod/bench.py (so that ``scoremod bench`` works from an
install); see benchmarks/README.md for the commands and what is measured.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's scoremod

from scoremod.bench import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
