#!/bin/bash
# Session 10, call 4: the rest of call 3 (its time limit stopped 3 tests, 1 not reached).
set -u
T0=$(date +%s)
. tests/gpu/device_setup.sh 2>&1 | grep -v "already exists" | tail -3
export PYTHONPATH=/tmp/site
echo "install done at $(( $(date +%s)-T0 )) s"
RESUME=shared_prev/s10c3.xml TESTS="tests/gpu/test_pallas_gpu.py tests/test_cli.py" N=4 LIMIT=$(( 290 - ($(date +%s)-T0) )) SCOREMOD_TEST_TIMEOUT=170 OUT=$OUT/suite bash tests/gpu/run.sh -k "mosaic or cli"
echo "== done at $(( $(date +%s)-T0 )) s"
