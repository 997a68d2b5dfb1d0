#!/bin/bash
# Part 2 of the suite on the final commit: the tests part 1 did not reach (gpu_todo.txt), then the MLA benchmark.
set -u
T0=$(date +%s)
left() { echo $(( ${BUDGET:-500} - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -2
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3; echo "install done at $(( $(date +%s)-T0 )) s"
mapfile -t IDS < gpu_todo.txt
TESTS="tests/gpu/test_lowrank_gpu.py" N=${N:-12} LIMIT=${LIMIT:-330} SCOREMOD_TEST_TIMEOUT=170 OUT=$OUT/suite bash tests/gpu/run.sh "${IDS[@]}"
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
t=$(left); [ $t -gt 25 ] && timeout $(( t < 70 ? t : 70 )) python3 benchmarks/run.py --mods mla_rope --impls scoremod,jax-cudnn,jax-cudnn-mla --seqs 4096 --head-dims 128 --long 0 --reps 9 --json $OUT/mla.json 2>&1 | grep -E "^\[|rror"
echo "== done at $(( $(date +%s)-T0 )) s"
