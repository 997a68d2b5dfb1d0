#!/bin/bash
# Session 10, call 3: the Mosaic GPU engine's tests after the refactors (CopiedReads, BackwardSpec, _product/_tile_inputs).
set -u
T0=$(date +%s)
. tests/gpu/device_setup.sh 2>&1 | grep -v "already exists" | tail -3
export PYTHONPATH=/tmp/site
echo "install done at $(( $(date +%s)-T0 )) s"
git log -1 --format='%H %s' 2>/dev/null | cut -c1-80
TESTS="tests/gpu/test_pallas_gpu.py tests/test_cli.py" N=12 LIMIT=$(( 530 - ($(date +%s)-T0) )) SCOREMOD_TEST_TIMEOUT=170 OUT=$OUT/suite bash tests/gpu/run.sh -k "mosaic or cli"
echo "== done at $(( $(date +%s)-T0 )) s"
