#!/bin/bash
# Session 9, call 2: relbias memory with the table fixed (16k/32k/64k) and learned (16k/32k), b1 h16 d128;
# then the rest of the whole GPU suite (RESUME from call 1's JUnit file).
set -u
T0=$(date +%s)
. tests/gpu/device_setup.sh 2>&1 | grep -v "already exists" | tail -3
export PYTHONPATH=/tmp/site
echo "install done at $(( $(date +%s)-T0 )) s"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 70 python3 benchmarks/probes/relbias_memory.py --json $OUT/relbias_memory.json 2>&1 | grep -vE "Warning|warn"
timeout 50 python3 benchmarks/probes/relbias_memory.py --seqs 16384,32768 --learn-table --json $OUT/relbias_memory_learned.json 2>&1 | grep -vE "Warning|warn"
echo "== suite at $(( $(date +%s)-T0 )) s"
RESUME=shared_prev/gpu-suite.xml N=12 LIMIT=$(( 560 - ($(date +%s)-T0) )) SCOREMOD_TEST_TIMEOUT=170 OUT=$OUT/suite bash tests/gpu/run.sh
echo "== done at $(( $(date +%s)-T0 )) s"
