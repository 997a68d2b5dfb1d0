#!/bin/bash
# Session 9, call 3: the rest of the whole GPU suite (RESUME from calls 1+2, JUnit merged).
set -u
T0=$(date +%s)
. tests/gpu/device_setup.sh 2>&1 | grep -v "already exists" | tail -3
export PYTHONPATH=/tmp/site
echo "install done at $(( $(date +%s)-T0 )) s"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
echo "== suite at $(( $(date +%s)-T0 )) s"
RESUME=shared_prev/gpu-suite.xml N=12 LIMIT=$(( 330 - ($(date +%s)-T0) )) SCOREMOD_TEST_TIMEOUT=170 OUT=$OUT/suite bash tests/gpu/run.sh
echo "== done at $(( $(date +%s)-T0 )) s"
