#!/bin/bash
# Session 8, run 2: relative tables as one value per diagonal (mosaic.OffsetDiagonals: a
# 256-value window per step, spread over the tile by a gather from shared memory written
# in Mosaic GPU) in all three Mosaic kernels: their GPU tests, then relbias / ALiBi with
# the backward split, relbias against FlexAttention at 4096, relbias at 32768.
set -u
T0=$(date +%s)
left() { echo $(( ${BUDGET:-520} - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -2
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3; echo "install done at $(( $(date +%s)-T0 )) s"
P=tests/gpu/test_pallas_gpu.py
IDS=(
 "$P::test_mosaic_offset_reads" "$P::test_relative_table_through_attention"
 "tests/gpu/test_catalogue_gpu.py::test_catalogue_mod_fused_matches_the_reference[sandwich]"
 "$P::test_mosaic_cases[relative_bias-bf16-d128]" "$P::test_mosaic_cases[relative_bias-fp16-d64]"
)
TESTS="${IDS[0]}" N=10 LIMIT=${LIMIT:-170} SCOREMOD_TEST_TIMEOUT=160 OUT=$OUT/suite bash tests/gpu/run.sh "${IDS[@]:1}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
echo "== probe at $(( $(date +%s)-T0 )) s"
t=$(left); [ $t -gt 40 ] && timeout $(( t < 120 ? t : 120 )) python3 benchmarks/probes/relbias_tiles.py 2>&1 | grep -vE "Warning|warn"
echo "== bench at $(( $(date +%s)-T0 )) s"
t=$(left); [ $t -gt 40 ] && timeout $(( t < 90 ? t : 90 )) python3 benchmarks/run.py --max-seconds $(( t < 90 ? t - 10 : 80 )) --seqs 4096 --head-dims 128 --long 0 --mods relbias --impls scoremod,flex --directions fwd,fwdbwd --json $OUT/relbias4096.json 2>&1 | grep -E "^\[|rror"
t=$(left); [ $t -gt 30 ] && timeout $t python3 benchmarks/run.py --max-seconds $(( t - 8 )) --seqs "" --long 32768 --head-dims 128 --mods relbias --impls scoremod --directions fwd,fwdbwd --reps 3 --json $OUT/relbias32k.json 2>&1 | grep -E "^\[|rror"
echo "== done at $(( $(date +%s)-T0 )) s"
