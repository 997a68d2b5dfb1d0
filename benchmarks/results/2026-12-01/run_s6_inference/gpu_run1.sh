#!/bin/bash
# Session 6, run 1: the cuDNN inference graphs (tests), global_sliding_window on the Pallas
# kernels (catalogue test), the Mosaic backward tests not reached last session; then MLA and
# softcap forward timings (inference graphs) against jax.nn / JAX's cuDNN MLA call.
set -u
T0=$(date +%s)
left() { echo $(( ${BUDGET:-480} - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -2
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3; echo "install done at $(( $(date +%s)-T0 )) s"
IDS=(
 "tests/gpu/test_fused.py::test_inference_graphs_without_stats_match_reference"
 "tests/gpu/test_catalogue_gpu.py::test_catalogue_mod_fused_matches_the_reference[global_sliding_window]"
 "tests/gpu/test_pallas_gpu.py::test_mosaic_shapes[tail-1000]"
 "tests/gpu/test_pallas_gpu.py::test_mosaic_backward_full_tiles[masked_rows]"
 "tests/gpu/test_pallas_gpu.py::test_mosaic_backward_shapes[causal-1000]"
 "tests/gpu/test_pallas_gpu.py::test_mosaic_backward_deterministic"
)
TESTS="${IDS[0]}" N=${N:-8} LIMIT=${LIMIT:-200} SCOREMOD_TEST_TIMEOUT=150 OUT=$OUT/suite bash tests/gpu/run.sh "${IDS[@]:1}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
echo "== bench at $(( $(date +%s)-T0 )) s"
t=$(left); [ $t -gt 30 ] && timeout $t python3 benchmarks/run.py --max-seconds $(( t - 8 )) --seqs 4096 --head-dims 128 --long 0 --mods mla_rope,softcap --impls scoremod,direct,jax-cudnn,jax-cudnn-mla --directions fwd,fwdbwd --reps 9 --json $OUT/mla_inference.json 2>&1 | grep -E "^\[|rror|^ *(mla|softcap)"
echo "== done at $(( $(date +%s)-T0 )) s"
