#!/bin/bash
# Session 10, call 1: first-call probe against JAX's own Mosaic GPU attention; the GPU re-check of the changes after 64e4458.
set -u
T0=$(date +%s)
. tests/gpu/device_setup.sh 2>&1 | grep -v "already exists" | tail -3
export PYTHONPATH=/tmp/site
export XLA_PYTHON_CLIENT_PREALLOCATE=false
echo "install done at $(( $(date +%s)-T0 )) s"
git log -1 --format='%H %s' 2>/dev/null | cut -c1-80
python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
echo "== first_call at $(( $(date +%s)-T0 )) s"
python3 benchmarks/probes/first_call.py --cases jax_mgpu:fwd,jax_mgpu:grad,softcap:fwd,softcap:grad --variants "" 2>&1 | tee $OUT/first_call.log
echo "== delta tests at $(( $(date +%s)-T0 )) s"
TESTS="tests/test_cli.py tests/gpu/test_pallas_gpu.py" N=6 LIMIT=$(( 540 - ($(date +%s)-T0) )) SCOREMOD_TEST_TIMEOUT=170 OUT=$OUT/suite bash tests/gpu/run.sh -k "cli or learn or offset_reads or through_attention"
python3 -m scoremod doctor > $OUT/doctor_full.txt 2>&1
echo "== done at $(( $(date +%s)-T0 )) s"
