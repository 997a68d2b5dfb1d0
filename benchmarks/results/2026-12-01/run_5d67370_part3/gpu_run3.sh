#!/bin/bash
# Part 3: the GPU tests parts 1 and 2 left (gpu_todo.txt + test_lowrank_gpu.py), the MLA benchmark, then issue-15 rows.
set -u
T0=$(date +%s)
left() { echo $(( ${BUDGET:-530} - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -2
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3; echo "install done at $(( $(date +%s)-T0 )) s"
mapfile -t IDS < gpu_todo.txt
TESTS="tests/gpu/test_lowrank_gpu.py" N=${N:-10} LIMIT=${LIMIT:-250} SCOREMOD_TEST_TIMEOUT=170 OUT=$OUT/suite bash tests/gpu/run.sh --dist worksteal "${IDS[@]}"
grep -E "^E  " $OUT/suite/gpu-suite.log | sort | uniq -c | sort -rn | head -20
python3 - $OUT/suite/gpu-suite.xml <<'P'
import sys, xml.etree.ElementTree as ET
try: r=ET.parse(sys.argv[1]).getroot()
except Exception as e: print("no xml", e); sys.exit()
for c in r.iter("testcase"):
    for f in list(c.findall("failure"))+list(c.findall("error")):
        print("FAIL", c.get("classname"), c.get("name"), (f.get("message") or "")[:400].replace("\n"," | "))
P
export XLA_PYTHON_CLIENT_PREALLOCATE=false
echo "== mla at $(( $(date +%s)-T0 )) s"
t=$(left); [ $t -gt 25 ] && timeout $(( t < 40 ? t : 40 )) python3 benchmarks/run.py --mods mla_rope --impls scoremod,jax-cudnn,jax-cudnn-mla --seqs 4096 --head-dims 128 --long 0 --json $OUT/mla.json 2>&1 | grep -E "^\[|rror"
echo "== operand grads at $(( $(date +%s)-T0 )) s"
t=$(left); [ $t -gt 60 ] && timeout $(( t < 110 ? t : 110 )) python3 benchmarks/run.py --max-seconds $(( t < 110 ? t - 15 : 95 )) --mods alibi,relbias --seqs 4096 --head-dims 128 --long 0 --impls scoremod,pallas-mosaic,flex --directions fwdbwd,fwdbwd_ops --json $OUT/operand_grads.json 2>&1 | grep -E "^\[|rror"
echo "== document_softcap 4096 at $(( $(date +%s)-T0 )) s"
t=$(left); [ $t -gt 40 ] && timeout $(( t < 90 ? t : 90 )) python3 benchmarks/run.py --max-seconds $(( t < 90 ? t - 15 : 75 )) --mods document_softcap --seqs 4096 --head-dims 128 --long 0 --impls scoremod,pallas-mosaic,flex --json $OUT/docsoftcap4096.json 2>&1 | grep -E "^\[|rror"
echo "== document_softcap 32768 at $(( $(date +%s)-T0 )) s"
t=$(left); [ $t -gt 40 ] && timeout $t python3 benchmarks/run.py --max-seconds $(( t - 15 )) --mods document_softcap --seqs "" --long 32768 --head-dims 128 --impls pallas-mosaic,flex,scoremod --json $OUT/docsoftcap32768.json 2>&1 | grep -E "^\[|rror"
echo "== done at $(( $(date +%s)-T0 )) s"
