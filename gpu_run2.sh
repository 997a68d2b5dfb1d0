#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
t0=$(date +%s)
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.log 2>&1 || tail -20 $OUT/install.log
echo "install+build $(( $(date +%s) - t0 )) s"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 130 python3 benchmarks/probes/pallas_smoke.py 2>&1 | grep -v -i warn | tail -40 | tee $OUT/pallas_smoke.log
echo "smoke done $(( $(date +%s) - t0 )) s"
N=5 LIMIT=250 SCOREMOD_TEST_TIMEOUT=150 OUT=$OUT/suite TESTS="tests/gpu/test_varlen_gpu.py tests/gpu/test_pallas_gpu.py tests/gpu/test_catalogue_gpu.py" bash tests/gpu/run.sh 2>&1 | tail -45
grep -E "^E  " $OUT/suite/gpu-suite.log | sort | uniq -c | sort -rn | head -25
echo "tests done $(( $(date +%s) - t0 )) s"
timeout 60 python3 benchmarks/run.py --seqs 4096 --head-dims 128 --long 0 --mods softcap,softcap_causal --impls scoremod,jax-cudnn --reps 5 --json $OUT/softcap.json 2>&1 | grep -E "^\[|target" | tee $OUT/softcap.log
echo "all done $(( $(date +%s) - t0 )) s"
