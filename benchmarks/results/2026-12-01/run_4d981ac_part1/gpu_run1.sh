#!/bin/bash
# Part 1 of the GPU suite: varlen, Pallas (incl. Mosaic), zero rows, low rank, warm start, sharding, cli/flax/examples/ffi.
set -u
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -2
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3; echo "install done at $(( $(date +%s)-T0 )) s"
git log --oneline -1 2>/dev/null || true
TESTS="${TESTS:-tests/gpu/test_varlen_gpu.py tests/gpu/test_pallas_gpu.py tests/gpu/test_zero_rows.py tests/gpu/test_lowrank_gpu.py tests/gpu/test_warm_start.py tests/gpu/test_clean_exit.py tests/gpu/test_sharding_gpu.py tests/test_flax.py tests/test_ffi_build.py tests/test_examples.py tests/test_cli.py}" \
N=${N:-10} LIMIT=${LIMIT:-440} SCOREMOD_TEST_TIMEOUT=${SCOREMOD_TEST_TIMEOUT:-170} OUT=$OUT/suite bash tests/gpu/run.sh "$@"
grep -E "^E  " $OUT/suite/gpu-suite.log | sort | uniq -c | sort -rn | head -30
python3 - $OUT/suite/gpu-suite.xml <<'P'
import sys, xml.etree.ElementTree as ET
try: r=ET.parse(sys.argv[1]).getroot()
except Exception as e: print("no xml", e); sys.exit()
cases=sorted(r.iter("testcase"), key=lambda c:-float(c.get("time",0)))
print("slowest:", ", ".join(f"{c.get('name')} {float(c.get('time')):.0f}s" for c in cases[:10]))
for c in r.iter("testcase"):
    for f in list(c.findall("failure"))+list(c.findall("error")):
        print("FAIL", c.get("classname"), c.get("name"), (f.get("message") or "")[:500].replace("\n"," | "))
P
echo "== done at $(( $(date +%s)-T0 )) s"
