#!/bin/bash
# The whole GPU suite (or TESTS), N workers, LIMIT seconds.
set -u
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v "already exists" | tail -2
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -3; echo "install done at $(( $(date +%s)-T0 )) s"
git log --oneline -1 2>/dev/null || true
TESTS="${TESTS:-tests}" \
N=${N:-12} LIMIT=${LIMIT:-500} SCOREMOD_TEST_TIMEOUT=${SCOREMOD_TEST_TIMEOUT:-170} OUT=$OUT/suite bash tests/gpu/run.sh "$@"
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
python3 - $OUT/suite/gpu-suite.xml > $OUT/suite/done_ids.txt <<'P'
import sys, xml.etree.ElementTree as ET
for c in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    st = "fail" if (c.findall("failure") or c.findall("error")) else "skip" if c.findall("skipped") else "pass"
    print(st, c.get("classname"), c.get("name"))
P
