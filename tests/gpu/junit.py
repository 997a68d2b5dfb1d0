"""What a GPU suite run's JUnit file says, for tests/gpu/run.sh: which tests a
run finished, which it left, and why the failed ones failed.

A run stopped at its time limit leaves tests unrun; the next run takes the
JUnit files of the earlier parts (``RESUME="part1.xml part2.xml" bash
tests/gpu/run.sh``) and runs only the tests passed or skipped in none of them:

    python -m tests.gpu.junit left PREVIOUS.xml... COLLECTED.txt   # node ids, one a line
    python -m tests.gpu.junit failures RUN.xml                 # one line per failure
    python -m tests.gpu.junit profile RUN.xml...               # where the time went

The profile sums, per test file, the seconds of its tests and of what
tests/conftest.py recorded in them (SCOREMOD_TEST_PROFILE=1): JAX's tracing
(cuDNN graphs are built then: cudnn_build_s is part of trace_s), lowering and
XLA's compile; then the slowest tests.

``COLLECTED.txt`` is ``pytest --collect-only -q`` output (node ids).
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def key_of_node(node_id: str) -> tuple:
    """``(classname, name)`` as pytest's JUnit writer names the test ``node_id``
    (``tests/gpu/test_x.py::Test::test_y[a]`` -> ``("tests.gpu.test_x.Test", "test_y[a]")``)."""
    path, *parts = node_id.split("::")
    module = path[:-3] if path.endswith(".py") else path
    return ".".join([module.replace("/", "."), *parts[:-1]]), parts[-1]


def outcomes(xml_path) -> dict:
    """``{(classname, name): "passed" | "failed" | "skipped"}`` of every test the
    run finished (entries a stopped run left without a name are not tests)."""
    out = {}
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        if case.get("name") is None:
            continue
        if case.find("failure") is not None or case.find("error") is not None:
            state = "failed"
        elif case.find("skipped") is not None:
            state = "skipped"
        else:
            state = "passed"
        out[(case.get("classname"), case.get("name"))] = state
    return out


def left(xml_paths, node_ids) -> list:
    """The node ids passed or skipped in none of the runs of ``xml_paths`` (the
    JUnit files of one or more parts of a suite run), in order."""
    done = {k for path in xml_paths for k, state in outcomes(path).items() if state != "failed"}
    return [n for n in node_ids if key_of_node(n) not in done]


def failures(xml_path) -> list:
    """``"classname::name: first line of the message"`` per failed test."""
    out = []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        for bad in list(case.iter("failure")) + list(case.iter("error")):
            message = (bad.get("message") or bad.text or "").strip().splitlines()
            out.append(f"{case.get('classname')}::{case.get('name')}: "
                       f"{message[0][:300] if message else '(no message)'}")
    return out


PROFILE_KEYS = ("trace_s", "cudnn_build_s", "lower_s", "compile_s")


def profile(xml_paths, slowest=25) -> list:
    """Lines: per test file (slowest first) its tests, seconds and the profile's
    seconds, a total, then the ``slowest`` tests."""
    files, cases = {}, []
    for path in xml_paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            if case.get("name") is None or case.find("skipped") is not None:
                continue
            row = {"time": float(case.get("time", 0))}
            for prop in case.iter("property"):
                if prop.get("name") in PROFILE_KEYS:
                    row[prop.get("name")] = float(prop.get("value"))
            cases.append((f"{case.get('classname')}::{case.get('name')}", row))
            total = files.setdefault(case.get("classname"), {"tests": 0})
            total["tests"] += 1
            for k, v in row.items():
                total[k] = total.get(k, 0.0) + v
    columns = ("time",) + PROFILE_KEYS
    head = f"{'file':44s} {'tests':>5s} " + " ".join(f"{c:>13s}" for c in columns)
    lines = [head]
    everything = {"tests": 0}
    for name, total in sorted(files.items(), key=lambda kv: -kv[1]["time"]):
        lines.append(f"{name:44s} {total['tests']:5d} "
                     + " ".join(f"{total.get(c, 0.0):13.1f}" for c in columns))
        for k, v in total.items():
            everything[k] = everything.get(k, 0) + v
    lines.append(f"{'all':44s} {everything['tests']:5d} "
                 + " ".join(f"{everything.get(c, 0.0):13.1f}" for c in columns))
    lines.append(f"slowest {slowest}:")
    for name, row in sorted(cases, key=lambda c: -c[1]["time"])[:slowest]:
        lines.append(f"  {row['time']:7.1f} s  " + " ".join(
            f"{c}={row.get(c, 0.0):.1f}" for c in PROFILE_KEYS) + f"  {name}")
    return lines


def main(argv) -> int:
    if len(argv) >= 3 and argv[0] == "left":
        ids = [line.strip() for line in open(argv[-1]) if "::" in line]
        lines = left(argv[1:-1], ids)
    elif len(argv) == 2 and argv[0] == "failures":
        lines = failures(argv[1])
    elif len(argv) >= 2 and argv[0] == "profile":
        lines = profile(argv[1:])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    for line in lines:  # none: an empty output
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
