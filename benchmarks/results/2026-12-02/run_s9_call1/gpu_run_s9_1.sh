#!/bin/bash
# Session 9, call 1 (64e4458+): relbias memory at 16k/32k/64k (b1) and relbias at 65536 (b4 h16 d128)
# on the Mosaic kernels, then the whole GPU suite, part 1.
set -u
T0=$(date +%s)
. tests/gpu/device_setup.sh 2>&1 | grep -v "already exists" | tail -3
export PYTHONPATH=/tmp/site
echo "install done at $(( $(date +%s)-T0 )) s"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 100 python3 benchmarks/probes/relbias_memory.py --json $OUT/relbias_memory.json 2>&1 | grep -vE "Warning|warn"
echo "== bench at $(( $(date +%s)-T0 )) s"
timeout 110 python3 benchmarks/run.py --max-seconds 100 --seqs "" --long 65536 --head-dims 128 --mods relbias --impls scoremod --directions fwd,fwdbwd --reps 3 --json $OUT/relbias64k.json 2>&1 | grep -E "^\[|rror"
echo "== suite at $(( $(date +%s)-T0 )) s"
N=12 LIMIT=$(( 560 - ($(date +%s)-T0) )) SCOREMOD_TEST_TIMEOUT=170 OUT=$OUT/suite bash tests/gpu/run.sh
echo "== done at $(( $(date +%s)-T0 )) s"
