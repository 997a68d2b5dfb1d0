"""What a GPU suite run's JUnit file says, for tests/gpu/run.sh: which tests a
run finished, which it left, and why the failed ones failed.

A run stopped at its time limit leaves tests unrun; the next run takes the
JUnit files of the earlier parts (``RESUME="part1.xml part2.xml" bash
tests/gpu/run.sh``) and runs only the tests passed or skipped in none of them:

    python -m tests.gpu.junit left PREVIOUS.xml... COLLECTED.txt   # node ids, one a line
    python -m tests.gpu.junit failures RUN.xml                 # one line per failure

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


def main(argv) -> int:
    if len(argv) >= 3 and argv[0] == "left":
        ids = [line.strip() for line in open(argv[-1]) if "::" in line]
        lines = left(argv[1:-1], ids)
    elif len(argv) == 2 and argv[0] == "failures":
        lines = failures(argv[1])
    else:
        print(__doc__, file=sys.stderr)
        return 2
    for line in lines:  # none: an empty output
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
