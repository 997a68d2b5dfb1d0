#!/bin/bash
# Session 10, call 2: where scoremod's fwd+bwd first call spends the time JAX's own Mosaic GPU attention does not.
set -u
T0=$(date +%s)
. tests/gpu/device_setup.sh 2>&1 | grep -v "already exists" | tail -3
export PYTHONPATH=/tmp/site
echo "install done at $(( $(date +%s)-T0 )) s"
P=benchmarks/probes/first_call.py
echo "== bf16 + vlog at $(( $(date +%s)-T0 )) s"
python3 $P --cases jax_mgpu:grad,none:grad,softcap:grad --variants vlog --vlog-cases jax_mgpu:grad,none:grad,softcap:grad 2>&1 | tee $OUT/bf16_vlog.log
echo "== fp16 at $(( $(date +%s)-T0 )) s"
python3 $P --dtype float16 --cases none:grad,softcap:grad --variants "" 2>&1 | tee $OUT/fp16.log
echo "== profile at $(( $(date +%s)-T0 )) s"
python3 $P --profile 45 --cases jax_mgpu:grad,softcap:grad --variants "" > $OUT/profile.log 2>&1
echo "== done at $(( $(date +%s)-T0 )) s"
