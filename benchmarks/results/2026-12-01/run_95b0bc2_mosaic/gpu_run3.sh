#!/bin/bash
# Session 6, run 3 (95b0bc2: the Mosaic engine's vector reads, its backward's operand
# gradients, pallas_engine="auto" by default): document + softcap on the planner's route against
# FlexAttention and ALiBi with / without slope gradients on the Mosaic kernels; then the Pallas,
# catalogue and low-rank GPU test files.
set -u
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -2
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3; echo "install done at $(( $(date +%s)-T0 )) s"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 75 python3 benchmarks/run.py --max-seconds 65 --mods document_softcap --seqs 4096 --head-dims 128 --long 0 --impls scoremod,flex --directions fwd,fwdbwd --reps 7 --json $OUT/docsoftcap4096.json 2>&1 | grep -E "^\[|rror"
timeout 50 python3 benchmarks/run.py --max-seconds 42 --mods alibi --seqs 4096 --head-dims 128 --long 0 --impls pallas-mosaic --directions fwdbwd,fwdbwd_ops --reps 7 --json $OUT/alibi_ops.json 2>&1 | grep -E "^\[|rror"
echo "== tests at $(( $(date +%s)-T0 )) s"
TESTS="tests/gpu/test_pallas_gpu.py" N=${N:-12} LIMIT=${LIMIT:-370} SCOREMOD_TEST_TIMEOUT=170 OUT=$OUT/suite bash tests/gpu/run.sh tests/gpu/test_catalogue_gpu.py tests/gpu/test_lowrank_gpu.py
echo "== done at $(( $(date +%s)-T0 )) s"
