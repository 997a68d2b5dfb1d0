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
    assert (out / "profile.txt").read_text().startswith("file "), (out / "profile.txt").read_text()


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


def test_profile_records_where_a_test_spent_its_time(tmp_path):
    """SCOREMOD_TEST_PROFILE=1: each test's JUnit entry holds the seconds of JAX's
    tracing, lowering and compiling in it, and cuDNN's graph builds; junit.py
    sums them per file."""
    from tests.gpu import junit

    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import pytest_configure, pytest_runtest_setup, "
        "pytest_runtest_teardown  # noqa: F401\n")
    (tmp_path / "test_jit.py").write_text(textwrap.dedent("""
        import jax, jax.numpy as jnp

        def test_compiles():
            jax.jit(lambda x: jnp.sin(x) * 3)(jnp.ones(7)).block_until_ready()

        def test_compiles_nothing():
            pass
    """))
    xml = tmp_path / "run.xml"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          f"--junitxml={xml}", str(tmp_path)], env=_env(SCOREMOD_TEST_PROFILE="1"),
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    props = {case.get("name"): {p.get("name"): float(p.get("value")) for p in case.iter("property")}
             for case in ET.parse(xml).getroot().iter("testcase")}
    compiled = props["test_compiles"]
    assert compiled["trace_s"] + compiled["lower_s"] + compiled["compile_s"] > 0, compiled
    assert props["test_compiles_nothing"] == {"cudnn_build_s": 0.0}
    lines = junit.profile([xml])
    assert lines[0].split()[:3] == ["file", "tests", "time"] and lines[1].split()[1] == "2"
    assert lines[-1].endswith("test_jit::test_compiles_nothing")


def _junit(path, cases):
    """A JUnit file as pytest writes it: ``cases`` of (classname, name, outcome),
    plus the nameless entry a run stopped at its limit leaves."""
    body = []
    for classname, name, outcome in cases:
        inner = {"passed": "", "skipped": '<skipped message="needs two GPUs"/>',
                 "failed": '<failure message="AssertionError: dV off by 0.7&#10;more">x</failure>',
                 "error": '<error message="worker crashed"/>'}[outcome]
        body.append(f'<testcase classname="{classname}" name="{name}" time="1.0">{inner}</testcase>')
    body.append('<testcase time="0.000"/>')
    path.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest">'
                    + "".join(body) + "</testsuite></testsuites>")
    return path


def test_junit_reads_what_a_run_finished_and_left(tmp_path):
    from tests.gpu import junit

    assert junit.key_of_node("tests/gpu/test_x.py::test_y[a-b]") == ("tests.gpu.test_x", "test_y[a-b]")
    assert junit.key_of_node("tests/test_z.py::TestK::test_w") == ("tests.test_z.TestK", "test_w")
    xml = _junit(tmp_path / "prev.xml", [
        ("tests.gpu.test_x", "test_y[a-b]", "passed"),
        ("tests.gpu.test_x", "test_y[c-d]", "failed"),
        ("tests.gpu.test_x", "test_crash", "error"),
        ("tests.test_z.TestK", "test_w", "skipped")])
    collected = ["tests/gpu/test_x.py::test_y[a-b]", "tests/gpu/test_x.py::test_y[c-d]",
                 "tests/gpu/test_x.py::test_crash", "tests/test_z.py::TestK::test_w",
                 "tests/gpu/test_x.py::test_not_reached"]
    assert junit.left([xml], collected) == collected[1:3] + collected[4:]
    # a second part that passed the crashed test: only what neither finished is left
    second = _junit(tmp_path / "part2.xml", [("tests.gpu.test_x", "test_crash", "passed")])
    assert junit.left([xml, second], collected) == [collected[1], collected[4]]
    assert junit.failures(xml) == [
        "tests.gpu.test_x::test_y[c-d]: AssertionError: dV off by 0.7",
        "tests.gpu.test_x::test_crash: worker crashed"]


def test_gpu_runner_resumes_a_run(tmp_path):
    """RESUME=<an earlier run's JUnit file>: only the tests it did not pass or skip
    run (here one of the two collected); with none left, nothing runs."""
    out = tmp_path / "out"
    out.mkdir()
    env = dict(OUT=str(out), N="0", PYTHON=sys.executable, TESTS="tests/gpu/test_fused.py",
               JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"))
    cases = [("tests.gpu.test_fused", "test_each_op_in_text[offset-bfloat16]", "passed"),
             ("tests.gpu.test_fused", "test_each_op_in_text[offset-float16]", "failed")]
    run = lambda xml: subprocess.run(  # noqa: E731
        ["bash", str(REPO / "tests" / "gpu" / "run.sh"), "-k", "each_op_in_text"],
        env=_env(RESUME=str(xml), **env), capture_output=True, text=True, timeout=300,
        cwd=tmp_path)
    first = run(_junit(out / "gpu-suite.xml", cases))  # the earlier run's file, in OUT itself
    assert first.returncode == 0, first.stdout + first.stderr
    assert "resuming: 1 tests not passed or skipped" in first.stdout, first.stdout
    assert (out / "resumed.txt").read_text().split() == [
        "tests/gpu/test_fused.py::test_each_op_in_text[offset-float16]"]
    suites = ET.parse(out / "gpu-suite.xml").getroot()
    assert sum(int(s.get("tests")) for s in suites.iter("testsuite")) == 1
    done = run(_junit(tmp_path / "all.xml", [(c, n, "passed") for c, n, _ in cases]))
    assert done.returncode == 0 and "nothing left to run" in done.stdout, done.stdout
