"""tests/gpu/run.sh (the one-command GPU suite) and the per-test watchdog of tests/conftest.py.

Both run here without a GPU: the runner's gpu tests are skipped, but its
reports and summary line are the same.
"""

import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _env(**extra):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


def test_gpu_runner_writes_junit_log_and_one_summary_line(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(
        ["bash", str(REPO / "tests" / "gpu" / "run.sh"), "-k", "each_op_in_text"],
        env=_env(OUT=str(out), N="0", PYTHON=sys.executable, TESTS="tests/gpu/test_fused.py",
                 JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache")),
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    summary = run.stdout.strip().splitlines()[-1]
    suites = ET.parse(out / "gpu-suite.xml").getroot()
    tests = sum(int(s.get("tests")) for s in suites.iter("testsuite"))
    assert tests == 2  # the offset op, bf16 and fp16
    ran = "2 passed, 0 failed, 0 skipped" if "runs here" in run.stdout else "0 passed, 0 failed, 2 skipped"
    assert summary.startswith(f"gpu suite: {ran}, 0 errors in "), summary
    assert f"junit: {out}/gpu-suite.xml" in summary
    assert (out / "gpu-suite.log").read_text().count("each_op_in_text") >= 2
    assert "fused path:" in (out / "doctor.txt").read_text()


def test_watchdog_ends_a_hanging_test_with_its_stack(tmp_path):
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import pytest_configure, pytest_runtest_protocol  # noqa: F401\n")
    (tmp_path / "test_hang.py").write_text(textwrap.dedent("""
        import time

        def test_fast():
            pass

        def test_hangs_forever():
            time.sleep(600)
    """))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(tmp_path)], env=_env(SCOREMOD_TEST_TIMEOUT="3"),
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode != 0
    assert "Timeout" in run.stderr and "test_hangs_forever" in run.stderr, run.stderr[-2000:]
