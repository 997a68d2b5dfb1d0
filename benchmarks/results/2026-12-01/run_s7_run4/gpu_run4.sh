#!/bin/bash
# Session 7, run 4 (the last of the session's device time): the relative-table tests at the
# final kernels (launch order as in run 2), the causal table case, the catalogue's sandwich,
# the through-attention test, and a few Mosaic tests beside them.
set -u
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -2
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3; echo "install done at $(( $(date +%s)-T0 )) s"
P=tests/gpu/test_pallas_gpu.py
IDS=(
 "$P::test_mosaic_offset_reads" "$P::test_relative_table_through_attention"
 "tests/gpu/test_catalogue_gpu.py::test_catalogue_mod_fused_matches_the_reference[sandwich]"
 "$P::test_mosaic_cases[relative_bias-bf16-d128]" "$P::test_mosaic_cases[relative_bias-fp16-d64]"
 "$P::test_mosaic_cases[softcap-bf16-d128]" "$P::test_mosaic_cases[document_softcap-bf16-d128]"
 "$P::test_mosaic_backward_learned_deterministic"
)
TESTS="${IDS[0]}" N=8 LIMIT=${LIMIT:-230} SCOREMOD_TEST_TIMEOUT=200 OUT=$OUT/suite bash tests/gpu/run.sh "${IDS[@]:1}"
echo "== done at $(( $(date +%s)-T0 )) s"
