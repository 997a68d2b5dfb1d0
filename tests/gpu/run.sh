#!/usr/bin/env bash
# The whole GPU suite (every test marked `gpu`) in one command, on one GPU:
#
#   bash tests/gpu/run.sh [extra pytest arguments]
#
# N pytest-xdist workers (default: the CPU cores less two, at most 14; the suite
# is bound by compiling) share the GPU: no memory preallocation, each worker's
# JAX memory pool capped at a share of the GPU, one JAX compilation cache for
# all of them, and XLA's autotuning off (it compiles each matrix product of the
# reference path many times over to time variants; tests compare values, the
# default variant computes the same; XLA_FLAGS given here are kept). Each test gets SCOREMOD_TEST_TIMEOUT
# seconds (default 180; tests/conftest.py): past that its worker prints every
# thread's stack to the log and exits, the test counts as failed and a new
# worker goes on, so one hang cannot stall the run. The whole run is stopped
# (cleanly, with its reports written) after LIMIT seconds (default 2400).
#
# Writes $OUT/doctor.txt (`scoremod doctor`: versions, GPU, extension),
# $OUT/gpu-suite.xml (JUnit, with each test's compile profile: tests/conftest.py),
# $OUT/gpu-suite.log (-v output and any stacks) and $OUT/profile.txt (where the
# time went, per file: tests/gpu/junit.py; OUT defaults to ./gpu-results), then
# prints the failures and one summary line. Environment: N (0: one process, no xdist), PYTHON (default
# python3), SCOREMOD_TEST_TIMEOUT, LIMIT, JAX_COMPILATION_CACHE_DIR, TESTS
# (the paths to collect, default tests; set but empty: the arguments alone
# select, e.g. node ids or -k with pyproject's testpaths), RESUME (the JUnit files of earlier
# runs, space-separated: run only the tests none of them passed or skipped,
# e.g. the rest of a run its LIMIT stopped, in as many parts as it takes;
# tests/gpu/junit.py).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
CORES=$(nproc 2>/dev/null || echo 4)
DEFAULT_N=$((CORES - 2 < 14 ? CORES - 2 : 14)); [ "$DEFAULT_N" -ge 1 ] || DEFAULT_N=1
N=${N:-$DEFAULT_N}
LIMIT=${LIMIT:-2400}
XML="$OUT/gpu-suite.xml"
LOG="$OUT/gpu-suite.log"
PREVIOUS=()
if [ -n "${RESUME:-}" ]; then  # kept before this run's reports replace them
    i=0
    for f in $RESUME; do
        i=$((i + 1)); cp "$f" "$OUT/previous-$i.xml" || exit 2; PREVIOUS+=("$OUT/previous-$i.xml")
    done
fi
rm -f "$XML" "$LOG" "$OUT/doctor.txt"

export XLA_PYTHON_CLIENT_PREALLOCATE=false
export SCOREMOD_TEST_TIMEOUT=${SCOREMOD_TEST_TIMEOUT:-180}
export SCOREMOD_TEST_PROFILE=1
export XLA_FLAGS="--xla_gpu_autotune_level=0${XLA_FLAGS:+ $XLA_FLAGS}"
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR-${XDG_CACHE_HOME:-$HOME/.cache}/scoremod/jax-tests}
PARALLEL=()
if [ "$N" -gt 0 ] && "$PY" -c "import xdist" 2>/dev/null; then
    # 85% of the GPU split between the workers; the rest is for cuDNN's own
    # allocations (handles, plans), which are outside JAX's pool.
    export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-$(awk "BEGIN {printf \"%.3f\", 0.85 / $N}")}
    # worksteal (pytest-xdist 3.2+): idle workers take queued tests from busy ones,
    # which keeps the slow compiling tests from piling up on one worker.
    PARALLEL=(-n "$N" --dist worksteal --max-worker-restart "$((2 * N))")
elif [ "$N" -gt 0 ]; then
    echo "pytest-xdist is not installed: running in one process" >&2
    N=0
fi

# What the run ran on (versions, GPU, extension), for the record; one line here.
"$PY" -m scoremod doctor > "$OUT/doctor.txt" 2>&1
grep -E "^fused path:" "$OUT/doctor.txt" || tail -n 3 "$OUT/doctor.txt"

SELECT=(${TESTS-tests} "$@")  # TESTS= (empty): no default paths
if [ -n "${RESUME:-}" ]; then
    # Only the tests the resumed run did not pass or skip (its time limit
    # stopped it, or they failed); extra arguments select when collecting.
    "$PY" -m pytest -m gpu --collect-only -q -p no:cacheprovider "${SELECT[@]}" \
        > "$OUT/collected.txt" 2>&1
    "$PY" -m tests.gpu.junit left "${PREVIOUS[@]}" "$OUT/collected.txt" > "$OUT/resumed.txt" \
        || exit 2
    if [ ! -s "$OUT/resumed.txt" ]; then
        echo "gpu suite: nothing left to run (every collected test passed or was skipped in $RESUME)"
        exit 0
    fi
    mapfile -t SELECT < "$OUT/resumed.txt"
    echo "resuming: ${#SELECT[@]} tests not passed or skipped in $RESUME"
fi

start=$(date +%s)
timeout -s INT -k 30 "$LIMIT" "$PY" -m pytest -m gpu -v -rfE -p no:cacheprovider \
    --junitxml="$XML" "${PARALLEL[@]}" "${SELECT[@]}" > "$LOG" 2>&1
rc=$?
seconds=$(( $(date +%s) - start ))

# Each failure with the first line of its message (the log has the rest).
if [ -s "$XML" ]; then
    "$PY" -m tests.gpu.junit profile "$XML" > "$OUT/profile.txt" 2>&1
    "$PY" -m tests.gpu.junit failures "$XML" | head -n 40
else
    grep -E "^(FAILED|ERROR) " "$LOG" | head -n 40
fi
"$PY" - "$XML" "$LOG" "$rc" "$seconds" "$N" "$LIMIT" <<'PY'
import re, sys, xml.etree.ElementTree as ET
xml, log, rc, seconds, n, limit = sys.argv[1:]
counts = None
try:
    suites = ET.parse(xml).getroot()
    suites = [suites] if suites.tag == "testsuite" else list(suites.iter("testsuite"))
    get = lambda k: sum(int(s.get(k, 0)) for s in suites)
    total, failed, errors, skipped = get("tests"), get("failures"), get("errors"), get("skipped")
    counts = (total - failed - errors - skipped, failed, skipped, errors)
except (OSError, ET.ParseError):
    text = open(log, errors="replace").read()
    counts = tuple(len(re.findall(rf"\b{w}\b tests/", text))
                   for w in ("PASSED", "FAILED", "SKIPPED", "ERROR"))
    xml = "none (the run did not finish)"
cut = {"124": f"; stopped at the {limit} s limit", "137": f"; killed at the {limit} s limit",
       "130": f"; interrupted at the {limit} s limit"}.get(rc, "")
print(f"gpu suite: {counts[0]} passed, {counts[1]} failed, {counts[2]} skipped, {counts[3]} errors "
      f"in {seconds} s ({'serial' if n == '0' else n + ' workers'}; pytest exit {rc}{cut}; "
      f"junit: {xml}; log: {log})")
PY
exit "$rc"
