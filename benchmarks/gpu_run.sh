#!/usr/bin/env bash
# One run on a GPU machine: set it up, then run the steps in order, each
# bounded by what is left of the run's time, every log under $OUT.
#
#   bash benchmarks/gpu_run.sh [OPTIONS] STEP [-- STEP ...]
#
# Steps (a step word may carry a cap in seconds, e.g. bench=120; without one a
# step may take all the time left):
#   tests [PYTEST ARGS]       tests/gpu/run.sh on this selection (files, node ids,
#                             -k EXPR, @FILE: node ids one a line); no arguments:
#                             the whole GPU suite. Reports in $OUT/suite/ (the
#                             second tests step: $OUT/suite-2/, ...); its LIMIT is
#                             the step's time.
#   bench NAME [RUN.PY ARGS]  python benchmarks/run.py ARGS --json $OUT/NAME.json,
#                             log $OUT/NAME.log; its --max-seconds is the step's time.
#   probe SCRIPT [ARGS]       python benchmarks/probes/SCRIPT.py ARGS (or
#                             benchmarks/SCRIPT.py), log $OUT/SCRIPT.log.
#
# Options:
#   --budget S   seconds for the whole run, setup included (default 560)
#   --commit C   the commit measured, recorded in the bench JSON (default: git
#                rev-parse of this checkout, whose .git may be missing or stale)
#   --no-setup   the machine is set up already (no . tests/gpu/device_setup.sh)
#   --print      print the commands (with the time of a run starting now), run none
#
# Environment: OUT (default gpu-results), PYTHON (default python3); tests steps
# pass N, SCOREMOD_TEST_TIMEOUT and RESUME on to tests/gpu/run.sh.
# Everything printed also goes to $OUT/run.log. Exit status: the last failed
# step's (0 when all passed), 2 for bad arguments or a failed setup.
set -u
OUT=${OUT:-gpu-results}
[[ $OUT == /* ]] || OUT=$PWD/$OUT  # the caller's folder; the steps run in the repository root
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUDGET=560
COMMIT=""
SETUP=1
PRINT=0
MIN_STEP=30  # a step with less time left is skipped: it could not finish
T0=$(date +%s)

die() { echo "gpu_run.sh: $*" >&2; exit 2; }
number() { [[ $1 =~ ^[0-9]+$ ]] || die "$2 takes whole seconds, got '$1'"; }

while [ $# -gt 0 ]; do
    case $1 in
        --budget) [ $# -ge 2 ] || die "--budget needs a value"; number "$2" --budget; BUDGET=$2; shift 2 ;;
        --commit) [ $# -ge 2 ] || die "--commit needs a value"; COMMIT=$2; shift 2 ;;
        --no-setup) SETUP=0; shift ;;
        --print) PRINT=1; shift ;;
        -h|--help) sed -n '2,/^set -u/{/^set -u/d;s/^# \{0,1\}//;p}' "$0"; exit 0 ;;
        -*) die "unknown option '$1' (--help lists them)" ;;
        *) break ;;
    esac
done
[ $# -gt 0 ] || die "no steps given (--help lists them)"
[ -n "$COMMIT" ] || COMMIT=$(git rev-parse --short HEAD 2>/dev/null || true)

# Split the steps at "--" and check each before anything runs: a typo found
# after the setup and the first steps would cost the run.
STEPS=()
declare -A BENCH_NAMES=()
check_step() {
    local kind=${1%%=*} cap=""
    [[ $1 == *=* ]] && { cap=${1#*=}; number "$cap" "$kind="; }
    case $kind in
        tests) ;;
        bench)
            [ $# -ge 2 ] || die "bench needs a NAME (its JSON: \$OUT/NAME.json)"
            [[ $2 =~ ^[A-Za-z0-9_.-]+$ ]] || die "bench NAME '$2': letters, digits, . _ - only"
            [ -z "${BENCH_NAMES[$2]:-}" ] || die "bench NAME '$2' given twice (its JSON would be overwritten)"
            BENCH_NAMES[$2]=1 ;;
        probe)
            [ $# -ge 2 ] || die "probe needs a SCRIPT"
            probe_path "$2" > /dev/null || die "no probe '$2' (benchmarks/probes/$2.py or benchmarks/$2.py)" ;;
        *) die "unknown step '$kind' (tests, bench or probe)" ;;
    esac
    STEPS+=("$(printf '%q ' "$@")")
}
probe_path() {
    local p
    for p in "benchmarks/probes/${1%.py}.py" "benchmarks/${1%.py}.py" "$1"; do
        [ -f "$p" ] && { echo "$p"; return 0; }
    done
    return 1
}
words=()
for w in "$@"; do
    if [ "$w" = "--" ]; then
        [ ${#words[@]} -gt 0 ] || die "an empty step (two -- in a row, or -- first or last)"
        check_step "${words[@]}"; words=()
    else
        words+=("$w")
    fi
done
[ ${#words[@]} -gt 0 ] || die "an empty step (two -- in a row, or -- first or last)"
check_step "${words[@]}"

# --print runs nothing, so no time passes for its plan (its output is the same on a busy machine).
elapsed() { [ $PRINT = 1 ] && echo 0 || echo $(( $(date +%s) - T0 )); }
# The seconds a step may take: what is left of the budget, at most its cap.
step_seconds() {
    local t=$(( BUDGET - $(elapsed) ))
    [ -n "$1" ] && [ "$1" -lt "$t" ] && t=$1
    echo "$t"
}
# A command as it would be typed (quotes only where a word needs them).
show() {
    local w line="+"
    for w in "$@"; do
        if [[ $w =~ ^[A-Za-z0-9_./:=,@+%-]+$ ]]; then line+=" $w"; else line+=" ${w@Q}"; fi
    done
    echo "$line"
}

# Each step's output goes to its log in full; what is printed is the lines
# worth reading in the device tool's output tail.
bench_lines() { grep -E '^\[|rror|^wrote|cases not run|^library start-up' || true; }
probe_lines() { grep -vE '^(WARNING|I0000|W0000|E0000)|Warning' || true; }

STATUS=0
SUITES=0
declare -A LOGS=()
run_step() {
    local kind=${1%%=*} cap="" t rc=0
    [[ $1 == *=* ]] && cap=${1#*=}
    shift
    t=$(step_seconds "$cap")
    echo "== $kind ${1:-(the whole suite)} at $(elapsed) s ($t s)"
    if [ "$t" -lt "$MIN_STEP" ]; then
        echo "== skipped: $t s left"; STATUS=1; return
    fi
    case $kind in
        tests)
            SUITES=$((SUITES + 1))
            local suite="$OUT/suite" tests=tests
            [ $SUITES -gt 1 ] && suite="$OUT/suite-$SUITES"
            [ $# -gt 0 ] && tests=""  # the arguments alone select
            # run.sh's LIMIT covers pytest only; doctor and collection come before it.
            local cmd=(env TESTS="$tests" LIMIT=$((t - 20)) OUT="$suite" PYTHON="$PY"
                       bash tests/gpu/run.sh "$@")
            show "${cmd[@]}"
            [ $PRINT = 1 ] || { "${cmd[@]}"; rc=$?; } ;;
        bench)
            local name=$1; shift
            local cmd=(timeout -k 10 "$t" "$PY" benchmarks/run.py --max-seconds $((t - 10))
                       ${COMMIT:+--commit "$COMMIT"} "$@" --json "$OUT/$name.json")
            show "${cmd[@]}"; echo "  (log: $OUT/$name.log)"
            [ $PRINT = 1 ] || { "${cmd[@]}" > "$OUT/$name.log" 2>&1; rc=$?; bench_lines < "$OUT/$name.log"; } ;;
        probe)
            local script; script=$(probe_path "$1"); shift
            local name; name=$(basename "$script" .py)
            LOGS[$name]=$(( ${LOGS[$name]:-0} + 1 ))
            [ "${LOGS[$name]}" -gt 1 ] && name="$name-${LOGS[$name]}"
            local cmd=(timeout -k 10 "$t" "$PY" "$script" "$@")
            show "${cmd[@]}"; echo "  (log: $OUT/$name.log)"
            [ $PRINT = 1 ] || { "${cmd[@]}" > "$OUT/$name.log" 2>&1; rc=$?; probe_lines < "$OUT/$name.log"; } ;;
    esac
    [ $rc = 0 ] || { echo "== $kind ${name:-} exited $rc"; STATUS=$rc; }
}

main() {
    echo "== gpu_run: $(date -u '+%Y-%m-%d %H:%M UTC'), commit ${COMMIT:-?}, budget $BUDGET s, OUT=$OUT"
    if [ $SETUP = 1 ]; then
        show . tests/gpu/device_setup.sh; echo "  (log: $OUT/setup.log)"
        if [ $PRINT = 0 ]; then
            . tests/gpu/device_setup.sh > "$OUT/setup.log" 2>&1 || {
                tail -n 20 "$OUT/setup.log"; echo "== setup failed"; return 2; }
            echo "== setup done at $(elapsed) s"
        fi
    fi
    export XLA_PYTHON_CLIENT_PREALLOCATE=false  # torch and JAX share the GPU
    if [ $PRINT = 0 ]; then
        "$PY" -c "import sys, jax, jaxlib; print('python', sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())" 2>&1 | tail -n 1
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
    fi
    local step
    for step in "${STEPS[@]}"; do
        eval "run_step $step"
    done
    echo "== done at $(elapsed) s"
    return $STATUS
}

if [ $PRINT = 1 ]; then
    main
    exit
fi
mkdir -p "$OUT" || die "cannot make OUT=$OUT"
main 2>&1 | tee "$OUT/run.log"
exit "${PIPESTATUS[0]}"
