#!/usr/bin/env bash
# The GPU suite in chunks that each fit a time limit, every chunk with -v
# output and JUnit XML under $OUT (default ./gpu-results), so that a chunk cut
# short still names what passed and what failed.
#
#   OUT=$OUT bash tests/gpu/run_chunks.sh            # all chunks, in order
#   OUT=$OUT bash tests/gpu/run_chunks.sh new rest   # some of them
#
# Chunks: new (native masks, query-block split, scale folding, each on and
# switched off, and the growing-score cases),
# rest (everything else but the per-op cases), ops (every op, bf16 and fp16).
# With pytest-xdist importable, N workers (default 4) share the one GPU.
# NEW_S, REST_S, OPS_S override each chunk's time limit in seconds.
set -u
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
XDIST=""
python3 -c "import xdist" 2>/dev/null && XDIST="-n ${N:-4}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # workers share the GPU

run() {  # name, seconds, pytest arguments...
    local name=$1 limit=$2
    shift 2
    timeout "$limit" python3 -m pytest -v -rfE -m gpu -p no:cacheprovider $XDIST \
        --junitxml="$OUT/$name.xml" "$@" 2>&1 \
        | grep -v -e "nanobind: leaked" -e "^ - leaked" -e "^ - \.\.\. skipped" > "$OUT/$name.log"
    echo "$name: $(grep -E '^(FAILED|ERROR)' "$OUT/$name.log" | wc -l) failed; $(tail -n 1 "$OUT/$name.log")"
}

NEW="native or growing or split or folding"
for chunk in "${@:-new rest ops}"; do
    for c in $chunk; do
        case $c in
            new) run new "${NEW_S:-240}" tests/gpu -k "$NEW" ;;
            rest) run rest "${REST_S:-300}" tests -k "not each_op and not ($NEW)" ;;
            ops) run ops "${OPS_S:-240}" tests/gpu -k each_op ;;
            *) echo "unknown chunk $c (new, rest, ops)"; exit 2 ;;
        esac
    done
done
