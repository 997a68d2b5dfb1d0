#!/bin/bash
# Planner crossover: document + softcap on cuDNN (implementation=None), Pallas (Triton), FlexAttention.
set -u
T0=$(date +%s)
left() { echo $(( ${BUDGET:-230} - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -2
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3; echo "install done at $(( $(date +%s)-T0 )) s"
git log --oneline -1 2>/dev/null || true
export XLA_PYTHON_CLIENT_PREALLOCATE=false
echo "== document_softcap 4096 at $(( $(date +%s)-T0 )) s"
timeout 110 python3 benchmarks/run.py --max-seconds 100 --mods document_softcap --seqs 4096 --head-dims 128 --long 0 --impls scoremod,pallas,flex --directions fwd,fwdbwd --json $OUT/docsoftcap4096.json 2>&1 | grep -E "^\[|rror"
echo "== document_softcap 32768 at $(( $(date +%s)-T0 )) s"
t=$(left); [ $t -gt 40 ] && timeout $t python3 benchmarks/run.py --max-seconds $(( t - 10 )) --mods document_softcap --seqs "" --long 32768 --head-dims 128 --impls pallas,flex --directions fwd,fwdbwd --json $OUT/docsoftcap32768.json 2>&1 | grep -E "^\[|rror"
echo "== done at $(( $(date +%s)-T0 )) s"
