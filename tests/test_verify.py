"""The cuDNN version check and its conformance check (``lowering/cudnn/verify.py``),
on a faked H200: the loaded cuDNN's version is faked, and a runner stands in for
the GPU (the reference results, or deliberately wrong ones for the fused path).

The real check on a GPU is tests/gpu/test_verify_gpu.py.
"""

import os
import socket
import subprocess
import sys
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from scoremod import device, doctor, kernels_ffi, support
from scoremod import route as route_module
from scoremod.cli import main
from scoremod.lowering import registry
from scoremod.lowering.cudnn import masks, verify
from scoremod.lowering.cudnn.plan import Plan
from scoremod.lowering.problem import Problem

H200 = device.Device("gpu", "NVIDIA H200", 9, 132, "9.0")
UNVALIDATED = 92700  # a cuDNN in the supported range, neither validated nor known bad
FRONTEND = 13200


def _outputs(case, dtype):
    """Stand-in (O, LSE, dQ, dK, dV) of ``case``: fixed random arrays of its shapes."""
    rng = np.random.default_rng(abs(hash((case.name, dtype))) % 2**32)
    q, kv = (case.b, case.sq, case.hq, case.d), (case.b, case.skv, case.hkv, case.d)
    return tuple(rng.standard_normal(s).astype(np.float32)
                 for s in (q, (case.b, case.hq, case.sq), q, kv, kv))


class Runner:
    """The conformance runner: the reference results, and for the fused path the same
    (``wrong=None``) or with a NaN at one query row of dQ (``wrong="nan"``)."""

    def __init__(self, wrong=None):
        self.wrong, self.calls = wrong, []

    def __call__(self, case, dtype, implementation):
        self.calls.append((case.name, dtype, implementation))
        out = _outputs(case, dtype)
        if implementation != "xla" and self.wrong == "nan":
            out[2][:, 5] = np.nan
        return out


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """An H200 whose cuDNN checks pass, with the given cuDNN loaded; returns the runner."""
    monkeypatch.setattr(device, "current", lambda: H200)
    monkeypatch.setattr(kernels_ffi, "available", lambda: True)
    monkeypatch.setattr(kernels_ffi, "frontend_mismatch", lambda: "")
    monkeypatch.setattr(kernels_ffi, "installed_frontend_version", lambda: FRONTEND)
    monkeypatch.setitem(sys.modules, "cudnn", types.ModuleType("cudnn"))
    monkeypatch.setenv("SCOREMOD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("SCOREMOD_CUDNN_VERIFY", raising=False)
    monkeypatch.setattr(verify, "_WARNED", set())
    monkeypatch.setattr(route_module, "_WARNED", set())
    verify.forget()
    runner = Runner()
    monkeypatch.setattr(verify, "run_case", runner)

    def load(version, family=9):
        monkeypatch.setattr(device, "loaded_cudnn_version", lambda: (version, "/fake/libcudnn.so.9"))
        if family != 9:
            monkeypatch.setattr(device, "current", lambda: device.Device(
                "gpu", "pretend", family, 148, f"{family}.0"))
        return runner

    yield load
    verify.forget()


def _qkv():
    q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    return q, q, q


def _choice_traced():
    """which_implementation asked while a jitted function is being traced."""
    seen = []

    def f(q, k, v):
        seen.append(scoremod.which_implementation(q, k, v))
        return q

    jax.jit(f)(*_qkv())
    return seen[0]


def _key(version=UNVALIDATED):
    return verify.Key(version, FRONTEND, "sm_90", support.VERSION)


def test_an_unverified_cudnn_is_checked_once_at_its_first_automatic_use(machine, tmp_path):
    runner = machine(UNVALIDATED)
    with pytest.warns(UserWarning, match=r"cuDNN 9\.27\.0, frontend 1\.32\.0, sm_90, scoremod "
                      r".* is not validated with scoremod: checking it on this GPU now, once"
                      r".*SCOREMOD_CUDNN_VERIFY=0 turns this check at first use off"):
        choice = _choice_traced()  # inside a jit trace: the check's calls run all the same
    assert choice.implementation == "cudnn", choice
    fused = {c for c in runner.calls if c[2] != "xla"}
    assert fused == {(c.name, d, c.implementation) for c in verify.CASES for d in verify.DTYPES}
    assert ("document_ragged", "float16", "cudnn-varlen") in fused
    # the verdict, sealed in the cache folder, keyed by what it holds for
    path = tmp_path / "cache" / "cudnn-verdicts" / _key().file_name()
    assert path.name == f"cudnn-9.27.0_frontend-1.32.0_sm_90_scoremod-{support.VERSION}.verdict"
    assert verify.read(_key()).passed and oct(path.stat().st_mode & 0o777) == "0o600"
    assert oct(path.parent.stat().st_mode & 0o777) == "0o700"
    # later calls, and a later process (nothing remembered but the file), check nothing
    runner.calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert scoremod.which_implementation(*_qkv()).implementation == "cudnn"
        verify.forget()
        assert scoremod.which_implementation(*_qkv()).implementation == "cudnn"
    assert runner.calls == []
    # another frontend is another key: checked again
    machine(UNVALIDATED).calls.clear()
    with pytest.warns(UserWarning, match="frontend 1.33.0"):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(kernels_ffi, "installed_frontend_version", lambda: 13300)
            assert scoremod.which_implementation(*_qkv()).implementation == "cudnn"
    assert runner.calls and len(os.listdir(path.parent)) == 2


def test_a_damaged_or_foreign_verdict_file_is_not_trusted(machine, tmp_path):
    runner = machine(UNVALIDATED)
    with pytest.warns(UserWarning, match="checking it on this GPU now"):
        scoremod.which_implementation(*_qkv())
    path = tmp_path / "cache" / "cudnn-verdicts" / _key().file_name()
    data = path.read_bytes()
    path.write_bytes(data.replace(b'"passed"', b'"passes"'))  # the digest no longer matches
    verify.forget()
    assert verify.read(_key()) is None and not path.exists()  # removed
    # a verdict of another key copied over this one's name
    other = verify.Verdict(_key(92800), "passed", when="then")
    path.write_bytes(verify._encode(other))
    assert verify.read(_key()) is None and not path.exists()
    # a file others may write is not read (and the check runs again)
    path.write_bytes(data)
    assert verify.read(_key()).passed
    path.chmod(0o666)
    assert verify.read(_key()) is None
    runner.calls.clear()
    with pytest.warns(UserWarning, match="checking it on this GPU now"):
        assert scoremod.which_implementation(*_qkv()).implementation == "cudnn"
    assert runner.calls


def test_a_failed_verdict_takes_the_next_route_with_a_warning_naming_the_command(machine):
    runner = machine(UNVALIDATED)
    runner.wrong = "nan"
    with pytest.warns(UserWarning, match="checking it on this GPU now"):
        choice = scoremod.which_implementation(*_qkv())
    assert choice.implementation != "cudnn", choice
    why = choice.verdicts["cudnn"]
    assert "failed scoremod's conformance check on this GPU" in why, why
    assert "plain bfloat16: wrong (dQ above 0.03)" in why and "`scoremod doctor --verify`" in why
    found = verify.read(_key())
    assert found.state == "failed"
    assert {r.status for r in found.results} == {"wrong"} and np.isnan(found.results[0].errors["dQ"])
    # attention warns once, naming the command; the check does not run again
    runner.calls.clear()
    q, k, v = _qkv()
    with pytest.warns(UserWarning, match=r"implementation=None uses .* cudnn refuses this call: "
                      r".*failed scoremod's conformance check.*scoremod doctor --verify"):
        jax.eval_shape(lambda q: scoremod.attention(q, k, v), q)
    assert runner.calls == []
    # by name it runs, with a warning
    problem = Problem.of(q, k, v)
    with pytest.warns(UserWarning, match='failed scoremod.*running it because implementation="cudnn"'):
        assert registry.get("cudnn").why_not(problem, None, automatic=False) is None


def test_a_failed_verdict_outweighs_validation(machine):
    machine(91900)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert scoremod.which_implementation(*_qkv()).implementation == "cudnn"  # validated
    failed = verify.judge(_key(91900), [verify.Result("softcap", "float16", "wrong",
                                                      {"dV": 0.5}, "dV above 0.01")], 1.0)
    verify.write(failed)
    verify.forget()
    choice = scoremod.which_implementation(*_qkv())
    assert choice.implementation != "cudnn" and "softcap float16: wrong" in choice.verdicts["cudnn"]


def test_known_bad_versions_are_refused_with_the_reason_by_name_too(machine):
    runner = machine(92600)
    q, k, v = _qkv()
    choice = scoremod.which_implementation(q, k, v)
    why = choice.verdicts["cudnn"]
    assert "cuDNN 9.26.0 is known to be wrong for scoremod's graphs on sm_9x" in why
    assert "NaN at one query row" in why and "a user report, not reproduced" in why
    with pytest.raises(scoremod.CudnnUnavailableError, match="known to be wrong"):
        scoremod.attention(q, k, v, implementation="cudnn")
    ragged = next(c for c in verify.CASES if c.implementation == "cudnn-varlen")
    why = registry.get("cudnn-varlen").why_not(Problem.of(*ragged.inputs("float16")[:3]),
                                               ragged.mod(), automatic=False)
    assert why is not None and "known to be wrong" in why
    assert runner.calls == []
    assert verify.known_bad(92600, FRONTEND, 10) is None  # the row names Hopper only
    assert verify.known_bad(92700, FRONTEND, 9) is None and verify.known_bad(92599, None, 9) is None


def test_outside_the_supported_range_only_by_name(machine):
    runner = machine(100000)
    choice = scoremod.which_implementation(*_qkv())
    assert "cuDNN 10.0.0 is loaded, but scoremod's fused path supports cuDNN >= 9.19.0, < 10.0.0" \
        in choice.verdicts["cudnn"]
    assert runner.calls == []


def test_the_check_at_first_use_can_be_turned_off(machine, monkeypatch):
    runner = machine(UNVALIDATED)
    monkeypatch.setenv("SCOREMOD_CUDNN_VERIFY", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        choice = scoremod.which_implementation(*_qkv())
    why = choice.verdicts["cudnn"]
    assert choice.implementation != "cudnn" and "not verified on this GPU yet" in why
    assert "`scoremod doctor --verify` checks it" in why and "SCOREMOD_CUDNN_VERIFY=0" in why
    assert runner.calls == [] and verify.read(_key()) is None
    with pytest.warns(UserWarning, match="not verified on this GPU yet.*running it because"):
        assert registry.get("cudnn").why_not(Problem.of(*_qkv()), None, automatic=False) is None
    monkeypatch.setenv("SCOREMOD_CUDNN_VERIFY", "yes")
    with pytest.raises(scoremod.ScoreModError, match="SCOREMOD_CUDNN_VERIFY='yes'"):
        scoremod.which_implementation(*_qkv())


def test_a_check_that_died_reads_as_failed_and_is_not_run_again(machine):
    runner = machine(UNVALIDATED)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    verify.write(verify.Verdict(_key(), "started", when="earlier", pid=gone.pid,
                                host=socket.gethostname()))
    choice = scoremod.which_implementation(*_qkv())
    assert f"process {gone.pid} did not finish" in choice.verdicts["cudnn"]
    assert runner.calls == []
    # a check another live process is running, or one of another host: checked here too
    for pid, host in ((os.getppid(), socket.gethostname()), (gone.pid, "elsewhere")):
        verify.forget()
        verify.write(verify.Verdict(_key(), "started", when="now", pid=pid, host=host))
        with pytest.warns(UserWarning, match="checking it on this GPU now"):
            assert scoremod.which_implementation(*_qkv()).implementation == "cudnn"


def test_an_interrupted_check_leaves_nothing_behind(machine):
    runner = machine(UNVALIDATED)

    def interrupted(case, dtype, implementation):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        verify.check_and_record(_key(), run=interrupted)
    assert verify.read(_key()) is None and runner.calls == []


def test_the_doctor_reports_and_runs_the_check(machine, monkeypatch, capsys):
    runner = machine(UNVALIDATED)
    # the report says what is known and starts no check
    assert verify.status_line().startswith("supported, not validated (cuDNN 9.19.x, frontend 1.32.0")
    ok, line = doctor.fused_verdict()
    assert not ok and line.startswith("not yet: ") and "scoremod doctor --verify" in line, line
    assert runner.calls == []
    monkeypatch.setattr(doctor, "gpus", lambda: ([types.SimpleNamespace(device_kind="NVIDIA H200")],
                                                 ""))
    # the check's clock stopped: its seconds are the machine's (a loaded one took 1)
    monkeypatch.setattr(verify, "time", types.SimpleNamespace(perf_counter=lambda: 0.0))
    assert main(["doctor", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "checking cuDNN 9.27.0, frontend 1.32.0, sm_90" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("  ")]
    assert ["sigmoid", "float16", "ok", "O", "0.00e+00,"] == rows[-1][:5]
    assert len(rows) == 2 * len(verify.CASES)
    assert f"PASSED in 0 s: {2 * len(verify.CASES)} of {2 * len(verify.CASES)} agree" in out
    assert "verdict kept in " + str(verify.verdict_path(_key())) in out
    assert verify.status_line().startswith("verified on this GPU: PASSED")
    assert doctor.fused_verdict()[0]
    runner.wrong = "nan"  # checked again by hand: the new verdict replaces the old
    assert main(["doctor", "--verify"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "ok" not in {line.split()[2] for line in out.splitlines()
                                            if line.startswith("  ")}
    assert "O 0.00e+00, LSE 0.00e+00, dQ nan, dK 0.00e+00, dV 0.00e+00; dQ above 0.01" in out
    assert "implementation=None takes the next route" in out
    assert verify.status_line().startswith("verified on this GPU: FAILED")
    machine(92600)
    assert main(["doctor", "--verify"]) == 1
    assert "not checked: cuDNN 9.26.0 is known to be wrong" in capsys.readouterr().out
    assert verify.status_line().startswith("REFUSED: ")


def test_a_frontend_that_does_not_match_the_headers_is_passed_over(machine, monkeypatch):
    machine(91900)
    monkeypatch.setattr(kernels_ffi, "frontend_mismatch", lambda: "cuDNN frontend mismatch: X")
    choice = scoremod.which_implementation(*_qkv())
    assert choice.implementation != "cudnn" and choice.verdicts["cudnn"] == "cuDNN frontend mismatch: X"


def test_the_conformance_set_covers_the_graph_shapes_scoremod_emits(machine):
    """Each case is taken by the backend it names and is planned into the graph it
    stands for (the fused path's planning runs without a GPU)."""
    machine(91900)
    plans = {}
    for case in verify.CASES:
        mod = case.mod()
        q, k, v, _ = case.inputs("float16")
        problem = Problem.of(q, k, v)
        assert registry.get(case.implementation).why_not(problem, mod, automatic=True) is None, case
        if case.implementation == "cudnn":
            plans[case.name] = Plan(mod, problem, 0.125, case.options)
    assert set(verify.TOLERANCE) == set(verify.DTYPES) and len(verify.CASES) >= 12
    assert plans["plain"].parts[0].fwd is None and plans["plain"].parts[0].band is None
    for name in ("causal", "sliding_window"):
        assert isinstance(plans[name].parts[0].band, masks.Band), name
    assert plans["sliding_window"].parts[0].band.left_bound is not None
    assert plans["softcap"].parts[0].spec.scale != 0.125  # 1/cap folded
    assert plans["softcap_causal_split"].split and len(plans["softcap_causal_split"].blocks) == 4
    loads = {n: [l.spec.dims for l in p.parts[0].loads] for n, p in plans.items()}
    assert loads["alibi"] == [(1, 4, 1, 1)]  # the per-head array as it is
    assert loads["kv_bias"] == [(1, 1, 128, 192)]  # kv-only, with the q axis
    assert loads["document"] == [(2, 1, 128, 192)] and loads["relative_bias"] == [(1, 1, 128, 192)]
    shapes = {(c.sq != c.skv, c.hq != c.hkv) for c in verify.CASES}
    assert (True, True) in shapes  # Sq != Skv with grouped-query attention
    assert "integer_division" in plans and "fully_masked_rows" in plans


def test_the_runner_computes_each_case_through_attention():
    """The real runner, the reference path standing in for the fused one: the outputs
    have the case's shapes, fully masked rows give zeros and an LSE of -inf, and
    the comparison of a result with itself passes."""
    cases = {c.name: c for c in verify.CASES}
    out = verify.run_case(cases["fully_masked_rows"], "bfloat16", "xla")
    c = cases["fully_masked_rows"]
    assert [x.shape for x in out] == [(c.b, c.sq, c.hq, c.d), (c.b, c.hq, c.sq),
                                      (c.b, c.sq, c.hq, c.d), (c.b, c.skv, c.hkv, c.d),
                                      (c.b, c.skv, c.hkv, c.d)]
    assert np.all(out[0][:, :16] == 0) and np.all(np.isneginf(out[1][:, :, :16]))
    results = verify.verify(lambda case, dtype, impl: verify.run_case(case, dtype, "xla"),
                            [cases["document_ragged"], cases["alibi"]], dtypes=("float16",))
    assert [(r.case, r.status) for r in results] == [("document_ragged", "ok"), ("alibi", "ok")]


def test_the_comparison_uses_the_gpu_suites_tolerances():
    want = np.ones((2, 3), np.float32)
    assert verify.relative_error(want * (1 + 2e-2), want) == pytest.approx(2e-2, rel=1e-3)
    assert np.isnan(verify.relative_error(np.where(want > 0, np.nan, 0), want))
    inf = np.full((2,), -np.inf, np.float32)
    assert verify.relative_error(inf, inf) == 0.0
    case = verify.CASES[0]
    off = lambda by: lambda c, d, impl: tuple(x * (by if impl != "xla" else 1.0)  # noqa: E731
                                              for x in _outputs(c, d))
    assert verify.check_case(off(1.02), case, "bfloat16").status == "ok"  # 2e-2 < 3e-2
    wrong = verify.check_case(off(1.02), case, "float16")  # 2e-2 > 1e-2
    assert wrong.status == "wrong" and wrong.detail == "O, LSE, dQ, dK, dV above 0.01"

    def refused(c, d, impl):
        if impl != "xla":
            raise scoremod.UnsupportedOpError("cuDNN refused the forward graph")
        return _outputs(c, d)

    assert verify.check_case(refused, case, "float16").status == "refused"
    only_refused = verify.judge(_key(), verify.verify(refused, verify.CASES[:2]), 0.0)
    assert not only_refused.passed and only_refused.summary() == "cuDNN refused every conformance graph"
