#!/bin/bash
# Session 8, run 1: the forward's Toeplitz strip for relative tables (mosaic.OffsetStrip):
# its GPU tests (offset reads incl. a table beside document ids at d128, through attention,
# sandwich, the Mosaic relative cases) and the vector-read tests (mosaic.per_program, first
# time on the GPU); then relbias / ALiBi with the backward split, and relbias against
# FlexAttention at 4096.
set -u
T0=$(date +%s)
left() { echo $(( ${BUDGET:-540} - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -2
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3; echo "install done at $(( $(date +%s)-T0 )) s"
P=tests/gpu/test_pallas_gpu.py
IDS=(
 "$P::test_mosaic_offset_reads" "$P::test_relative_table_through_attention"
 "$P::test_mosaic_vector_reads"
 "tests/gpu/test_catalogue_gpu.py::test_catalogue_mod_fused_matches_the_reference[sandwich]"
 "$P::test_mosaic_cases[relative_bias-bf16-d128]" "$P::test_mosaic_cases[relative_bias-fp16-d64]"
 "$P::test_mosaic_document_through_attention"
)
TESTS="${IDS[0]}" N=10 LIMIT=${LIMIT:-200} SCOREMOD_TEST_TIMEOUT=190 OUT=$OUT/suite bash tests/gpu/run.sh "${IDS[@]:1}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
echo "== probe at $(( $(date +%s)-T0 )) s"
t=$(left); [ $t -gt 40 ] && timeout $(( t < 150 ? t : 150 )) python3 benchmarks/probes/relbias_tiles.py 2>&1 | grep -vE "Warning|warn"
echo "== bench at $(( $(date +%s)-T0 )) s"
t=$(left); [ $t -gt 40 ] && timeout $t python3 benchmarks/run.py --max-seconds $(( t - 10 )) --seqs 4096 --head-dims 128 --long 0 --mods relbias --impls scoremod,flex --directions fwd,fwdbwd --json $OUT/relbias4096.json 2>&1 | grep -E "^\[|rror"
echo "== done at $(( $(date +%s)-T0 )) s"
