#!/bin/bash
# Session 6, run 4: document + softcap on the planner's route (the Mosaic engine) against
# FlexAttention at 4096 and 32768 in one run; the block map of a bool-flag mask on the GPU
# and the CPU; then the Pallas, catalogue and low-rank GPU tests run 3 did not pass.
set -u
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -2
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3; echo "install done at $(( $(date +%s)-T0 )) s"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 115 python3 benchmarks/run.py --max-seconds 105 --mods document_softcap --seqs 4096 --head-dims 128 --long 32768 --impls scoremod,flex --directions fwd,fwdbwd --reps 7 --json $OUT/docsoftcap.json 2>&1 | grep -E "^\[|rror"
echo "== probe at $(( $(date +%s)-T0 )) s"
timeout 40 python3 benchmarks/probes/bool_window_map.py 2>&1 | grep -E "^s[0-9]|rror"
echo "== tests at $(( $(date +%s)-T0 )) s"
RESUME=gpu_resume3.xml TESTS="tests/gpu/test_pallas_gpu.py" N=${N:-12} LIMIT=${LIMIT:-250} SCOREMOD_TEST_TIMEOUT=170 OUT=$OUT/suite bash tests/gpu/run.sh tests/gpu/test_catalogue_gpu.py tests/gpu/test_lowrank_gpu.py
echo "== done at $(( $(date +%s)-T0 )) s"
