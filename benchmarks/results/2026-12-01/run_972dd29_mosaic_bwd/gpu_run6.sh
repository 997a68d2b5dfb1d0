#!/bin/bash
# The Mosaic GPU backward's tests, the catalogue mods the planner now gives to Pallas, the 3 op-table
# groups the suite did not reach; then the Mosaic backward's timings against cuDNN.
set -u
T0=$(date +%s)
left() { echo $(( ${BUDGET:-425} - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -2
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3; echo "install done at $(( $(date +%s)-T0 )) s"
mapfile -t IDS < gpu_todo6.txt
TESTS="tests/gpu/test_bench_gpu.py::test_scoremod_row_records_cudnn_then_pallas_for_operand_gradients" N=${N:-14} LIMIT=${LIMIT:-230} SCOREMOD_TEST_TIMEOUT=200 OUT=$OUT/suite bash tests/gpu/run.sh "${IDS[@]}"
grep -E "^E  " $OUT/suite/gpu-suite.log | sort | uniq -c | sort -rn | head -20
python3 - $OUT/suite/gpu-suite.xml <<'P'
import sys, xml.etree.ElementTree as ET
try: r=ET.parse(sys.argv[1]).getroot()
except Exception as e: print("no xml", e); sys.exit()
for c in r.iter("testcase"):
    st = "FAIL" if (c.findall("failure") or c.findall("error")) else "skip" if c.findall("skipped") else "pass"
    if st != "pass": print(st, c.get("classname"), c.get("name"), ((c.findall("failure")+c.findall("error")+c.findall("skipped"))[0].get("message") or "")[:400].replace("\n"," | "))
P
export XLA_PYTHON_CLIENT_PREALLOCATE=false
echo "== mosaic backward bench at $(( $(date +%s)-T0 )) s"
t=$(left); [ $t -gt 30 ] && timeout $t python3 benchmarks/run.py --max-seconds $(( t - 8 )) --seqs 4096 --head-dims 128 --long 0 --mods softcap,causal,softcap_causal,alibi --impls pallas-mosaic,jax-cudnn --directions fwd,fwdbwd --json $OUT/mosaic_bwd.json 2>&1 | grep -E "^\[|rror"
echo "== done at $(( $(date +%s)-T0 )) s"
