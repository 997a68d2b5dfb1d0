#!/bin/bash
# Part 2 of the GPU suite (the files part 1 leaves), then the int_division probe and the MLA benchmark.
set -u
T0=$(date +%s)
left() { echo $(( ${BUDGET:-540} - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -2
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3; echo "install done at $(( $(date +%s)-T0 )) s"
TESTS="${TESTS:-tests/gpu/test_pallas_gpu.py::test_op_table tests/gpu/test_pallas_gpu.py::test_mosaic_op_table tests/gpu/test_catalogue_gpu.py tests/gpu/test_fused.py tests/gpu/test_blocks_gpu.py tests/test_flax.py tests/test_examples.py}" N=${N:-10} LIMIT=${LIMIT:-330} SCOREMOD_TEST_TIMEOUT=170 OUT=$OUT/suite bash tests/gpu/run.sh "$@"
grep -E "^E  " $OUT/suite/gpu-suite.log | sort | uniq -c | sort -rn | head -20
git log --oneline -1 | cut -c1-60
python3 - $OUT/suite/gpu-suite.xml <<'P'
import sys, xml.etree.ElementTree as ET
try: r=ET.parse(sys.argv[1]).getroot()
except Exception as e: print("no xml", e); sys.exit()
for c in r.iter("testcase"):
    for f in list(c.findall("failure"))+list(c.findall("error")):
        print("FAIL", c.get("classname"), c.get("name"), (f.get("message") or "")[:400].replace("\n"," | "))
P
export XLA_PYTHON_CLIENT_PREALLOCATE=false
echo "== int_division at $(( $(date +%s)-T0 )) s"
t=$(left); [ $t -gt 40 ] && timeout $(( t < 70 ? t : 70 )) python3 benchmarks/probes/int_division.py --budget 55 2>&1 | grep -v -i warn | tail -60
echo "== mla at $(( $(date +%s)-T0 )) s"
t=$(left); [ $t -gt 25 ] && timeout $(( t < 40 ? t : 40 )) python3 benchmarks/run.py --mods mla_rope --impls scoremod,jax-cudnn,jax-cudnn-mla --seqs 4096 --head-dims 128 --long 0 --json $OUT/mla.json 2>&1 | grep -E "^\[|rror"
echo "== mgpu at $(( $(date +%s)-T0 )) s"
true
echo "== done at $(( $(date +%s)-T0 )) s"
