#!/bin/bash
# Session 7, run 3: relbias on the Mosaic engine with the diagonal tiles' kernels launched
# row tiles first (benchmarks/probes/relbias_grid.py: both orders, ALiBi, the tiles' cost);
# the relative-table tests again (launch order changed) and those run 2 did not reach or
# failed on its own fault (the loss compared through cancellation); relbias vs FlexAttention.
set -u
T0=$(date +%s)
left() { echo $(( ${BUDGET:-420} - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -2
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3; echo "install done at $(( $(date +%s)-T0 )) s"
timeout 100 python3 benchmarks/probes/relbias_grid.py 2>&1 | grep -v Warning | tail -6
P=tests/gpu/test_pallas_gpu.py
IDS=(
 "$P::test_relative_table_through_attention"
 "tests/gpu/test_catalogue_gpu.py::test_catalogue_mod_fused_matches_the_reference[sandwich]"
 "$P::test_mosaic_offset_reads" "$P::test_mosaic_cases[relative_bias-bf16-d128]"
 "$P::test_mosaic_cases[relative_bias-fp16-d64]"
)
TESTS="${IDS[0]}" N=8 LIMIT=${LIMIT:-150} SCOREMOD_TEST_TIMEOUT=140 OUT=$OUT/suite bash tests/gpu/run.sh "${IDS[@]:1}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
echo "== bench at $(( $(date +%s)-T0 )) s"
t=$(left); [ $t -gt 30 ] && timeout $t python3 benchmarks/run.py --max-seconds $(( t - 8 )) --seqs 4096 --head-dims 128 --long 0 --mods relbias --impls scoremod,flex --directions fwd,fwdbwd --json $OUT/relbias4096.json 2>&1 | grep -E "^\[|rror"
echo "== done at $(( $(date +%s)-T0 )) s"
