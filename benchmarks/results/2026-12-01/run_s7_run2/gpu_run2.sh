#!/bin/bash
# Session 7, run 2: relative-position tables on the Mosaic engine (a tile per diagonal):
# its GPU tests, the Mosaic cases (the forward's smem order and final waits changed), the
# catalogue's sandwich; then relbias against FlexAttention and cuDNN (direct) at 4096, and
# relbias at 32768 (with FlexAttention) and 65536.
set -u
T0=$(date +%s)
left() { echo $(( ${BUDGET:-560} - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -2
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3; echo "install done at $(( $(date +%s)-T0 )) s"
P=tests/gpu/test_pallas_gpu.py
IDS=(
 "$P::test_mosaic_offset_reads" "$P::test_relative_table_through_attention"
 "tests/gpu/test_catalogue_gpu.py::test_catalogue_mod_fused_matches_the_reference[sandwich]"
 "$P::test_mosaic_cases" "$P::test_mosaic_backward_deterministic"
)
TESTS="${IDS[0]}" N=10 LIMIT=${LIMIT:-210} SCOREMOD_TEST_TIMEOUT=200 OUT=$OUT/suite bash tests/gpu/run.sh "${IDS[@]:1}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
echo "== bench at $(( $(date +%s)-T0 )) s"
t=$(left); [ $t -gt 40 ] && timeout $(( t < 110 ? t : 110 )) python3 benchmarks/run.py --max-seconds $(( t < 110 ? t - 10 : 100 )) --seqs 4096 --head-dims 128 --long 0 --mods relbias --impls scoremod,direct,flex --directions fwd,fwdbwd --json $OUT/relbias4096.json 2>&1 | grep -E "^\[|rror"
t=$(left); [ $t -gt 40 ] && timeout $(( t < 100 ? t : 100 )) python3 benchmarks/run.py --max-seconds $(( t < 100 ? t - 10 : 90 )) --seqs "" --long 32768 --head-dims 128 --mods relbias --impls scoremod,flex --directions fwd,fwdbwd --reps 3 --json $OUT/relbias32k.json 2>&1 | grep -E "^\[|rror"
t=$(left); [ $t -gt 30 ] && timeout $t python3 benchmarks/run.py --max-seconds $(( t - 8 )) --seqs "" --long 65536 --head-dims 128 --mods relbias --impls scoremod --directions fwd,fwdbwd --reps 3 --json $OUT/relbias64k.json 2>&1 | grep -E "^\[|rror"
nvidia-smi --query-gpu=memory.total --format=csv
echo "== done at $(( $(date +%s)-T0 )) s"
