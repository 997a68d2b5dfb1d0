"""The command line: show, check, doctor (demo is run by tests/test_examples.py's README check)."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import scoremod
from scoremod import doctor, kernels_ffi, support
from scoremod.cli import main

HAS_GPU = any(d.platform == "gpu" for d in jax.devices())
REPO = Path(__file__).resolve().parents[1]


def test_show_prints_text_key_grad_and_lowering(capsys):
    assert main(["show", "where(q_idx >= kv_idx, cap * tanh(score / cap), -inf)", "--set", "cap=30"]) == 0
    out = capsys.readouterr().out
    assert "text:               where(q_idx >= kv_idx, tanh(score / 30.0) * 30.0, -inf)" in out
    assert "fused cuDNN path:   supported" in out
    assert "cmp_ge x1" in out and "tanh x1" in out and "binary_select" in out
    bprop = out.split("score_mod_bprop:")[1]
    assert "tanh" not in bprop.split("cuDNN nodes:")[1]  # reused from score_mod, not recomputed


def test_show_explains_refusal(capsys):
    assert main(["show", "where(score > 0.5, score, 0.0)"]) == 0
    out = capsys.readouterr().out
    assert "not supported" in out and "compares float values" in out


def test_show_unknown_name_suggests_set(capsys):
    assert main(["show", "cap * tanh(score / cap)"]) == 2
    assert "--set cap=" in capsys.readouterr().err


def test_check_says_why_not_fused_before_timing_anything(capsys):
    import jax.numpy as jnp

    q = jnp.ones((1, 64, 2, 64), jnp.bfloat16)
    if scoremod.which_implementation(q, q, q).verdicts["cudnn"] is None:
        pytest.skip("a GPU is present: the fused comparison runs instead")
    assert main(["check", "30.0 * tanh(score / 30.0)", "--seq", "64", "--heads", "2", "--head-dim", "64"]) == 0
    out = capsys.readouterr().out
    assert "fused path not run: no NVIDIA GPU" in out
    assert "reference (xla)" not in out  # with nothing to compare, the reference is not timed


def _errors(out, name):
    """{"O": relative error, ...} of backend ``name`` in check's output."""
    errors = {}
    for line in out.splitlines():
        if line.startswith("max |") and f" {name} - reference|" in line:
            errors[line[5:].split()[0]] = float(line.split("relative ")[1].rstrip(")"))
    return errors


@pytest.mark.gpu
def test_check_compares_fused_with_reference_on_a_gpu(capsys):
    assert main(["check", "30.0 * tanh(score / 30.0)", "--seq", "256", "--heads", "4",
                 "--head-dim", "64"]) == 0
    out = capsys.readouterr().out
    assert "fused (cudnn)" in out and "(chosen by implementation=None)" in out, out
    for name in ("cudnn", "pallas"):  # both take a dense pointwise mod on a GPU
        errors = _errors(out, name)
        assert sorted(errors) == ["O", "dK", "dQ", "dV"], out
        assert max(errors.values()) < 3e-2, (name, errors)
    assert main(["check", "30.0 * tanh(score / 30.0)", "--seq", "256", "--heads", "4",
                 "--head-dim", "64", "--sinks", "1.0"]) == 0
    out = capsys.readouterr().out
    for name in ("cudnn", "pallas"):
        errors = _errors(out, name)
        assert sorted(errors) == ["O", "dK", "dQ", "dV", "dsinks"], out
        assert max(errors.values()) < 3e-2, (name, errors)
    # cuDNN's backward graphs built with its deterministic algorithm: the backward
    # stays on cuDNN, and a second run gives the same bits
    assert main(["check", "30.0 * tanh(score / 30.0)", "--seq", "256", "--heads", "4",
                 "--head-dim", "64", "--deterministic"]) == 0
    out = capsys.readouterr().out
    assert "backward:" not in out, out
    assert out.count("a second run: the same bits") == 2, out
    assert max(_errors(out, "cudnn").values()) < 3e-2, out


def test_check_by_name_runs_the_pallas_kernels(capsys):
    """--implementation pallas: the kernels (interpret mode off a GPU) against the
    reference, four errors printed, all small; a wrong backend name is a ScoreModError."""
    assert main(["check", "30.0 * tanh(score / 30.0)", "--seq", "64", "--heads", "2",
                 "--head-dim", "64", "--batch", "1", "--dtype", "float32",
                 "--implementation", "pallas"]) == 0
    out = capsys.readouterr().out
    assert "fused (pallas):" in out, out
    errors = _errors(out, "pallas")
    assert sorted(errors) == ["O", "dK", "dQ", "dV"] and max(errors.values()) < 1e-3, out
    assert main(["check", "30.0 * tanh(score / 30.0)", "--seq", "64", "--heads", "2",
                 "--head-dim", "64", "--batch", "1", "--dtype", "float32",
                 "--implementation", "pallas", "--sinks", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "a sink of 0.5 per head" in out, out
    errors = _errors(out, "pallas")
    assert sorted(errors) == ["O", "dK", "dQ", "dV", "dsinks"], out
    assert max(errors.values()) < 1e-3, out
    assert "a second run: the same bits" in out, out
    assert main(["check", "score", "--seq", "64", "--heads", "2", "--head-dim", "64",
                 "--batch", "1", "--dtype", "float32", "--implementation", "pallas",
                 "--deterministic"]) == 0
    out = capsys.readouterr().out
    assert "a second run: the same bits" in out and "backward:" not in out, out
    assert main(["check", "score", "--seq", "64", "--implementation", "cudnnn"]) == 2
    streams = capsys.readouterr()
    assert "unknown implementation 'cudnnn'" in streams.err and "reference" not in streams.out


@pytest.mark.skipif(HAS_GPU, reason="a GPU is present")
def test_show_does_not_claim_the_fused_path_runs_without_a_gpu(capsys):
    assert main(["show", "30.0 * tanh(score / 30.0)"]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("fused cuDNN path"))
    assert line.endswith("supported by the lowering; not runnable here: no NVIDIA GPU is visible to JAX")


@pytest.mark.gpu
def test_show_says_runnable_on_a_gpu(capsys):
    assert main(["show", "30.0 * tanh(score / 30.0)"]) == 0
    assert "supported by the lowering; runnable here" in capsys.readouterr().out


def _rows(out):
    return {line.split(":", 1)[0]: line.split(":", 1)[1].strip()
            for line in out.splitlines() if ":" in line and not line.startswith(" ")}


@pytest.mark.skipif(HAS_GPU, reason="a GPU is present")
@pytest.mark.parametrize("command", ["doctor", "info"])
def test_doctor_explains_the_missing_gpu(capsys, command):
    assert main([command]) == 0
    rows = _rows(capsys.readouterr().out)
    for label in ("python", "jax", "CUDA plugin", "GPU", "cuDNN", "cuDNN frontend", "extension",
                  "fused path", "pallas kernels", "caches"):
        assert rows.get(label), (label, rows)
    assert rows["GPU"].startswith("none visible to JAX: ")
    assert rows["fused path"] == "cannot run here: no NVIDIA GPU is visible to JAX"
    assert support.cudnn_range_text() in rows["cuDNN"]
    if not doctor.cuda_plugins():
        assert 'pip install "scoremod[cuda13]"' in rows["CUDA plugin"]


def test_doctor_says_where_the_pallas_kernels_run_and_the_caches(monkeypatch, tmp_path):
    """The Pallas kernels' row follows the device (interpret mode off a GPU; on a
    Hopper GPU the engine the backend picks, Mosaic GPU where this jax has it); the
    caches' row follows the SCOREMOD_* settings."""
    from scoremod import device

    monkeypatch.setattr(device, "current", lambda: device.Device("cpu", "cpu", None, 0))
    cpu = doctor.pallas_verdict()
    assert cpu.startswith("interpret mode only (no GPU)"), cpu
    # What the default Python's jax (0.10) misses is said, with the way to it.
    assert ("Mosaic GPU engine (Hopper) is written for jax 0.11" in cpu) == bool(
        support.mosaic_missing()), cpu
    monkeypatch.setattr(device, "current", lambda: device.Device("gpu", "NVIDIA H200", 9, 132))
    too_old = support.mosaic_missing()
    if not too_old:
        assert doctor.pallas_verdict().startswith("runs here on the Mosaic GPU engine")
    else:
        assert doctor.pallas_verdict().startswith(
            "runs here on the Triton engine (the Mosaic GPU engine: its Mosaic GPU engine is "
            "written for jax")
    monkeypatch.setattr(device, "current", lambda: device.Device("gpu", "NVIDIA A100", 8, 108))
    ampere = doctor.pallas_verdict()
    assert ampere.startswith("runs here on the Triton engine (the Mosaic GPU engine: "), ampere
    assert "needs a Hopper GPU" in ampere or too_old, ampere
    monkeypatch.setenv("SCOREMOD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SCOREMOD_JAX_CACHE", "1")
    theirs = jax.config.jax_compilation_cache_dir  # the GPU suite sets one
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        assert doctor.caches_line().splitlines() == [
            f"cuDNN plan cache: {tmp_path / 'cudnn-plans'} (0 graphs, 0.0 of 256 MB)",
            f"JAX compilation cache: {tmp_path / 'jax'} (SCOREMOD_JAX_CACHE=1)"]
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
        assert doctor.caches_line().endswith(f"{tmp_path / 'mine'} (your jax_compilation_cache_dir)")
    finally:
        jax.config.update("jax_compilation_cache_dir", theirs)
    monkeypatch.setenv("SCOREMOD_JAX_CACHE", "yes")
    assert "SCOREMOD_JAX_CACHE='yes'" in doctor.caches_line()


def test_doctor_gives_the_build_command_when_the_extension_is_missing(capsys, monkeypatch):
    monkeypatch.setattr(kernels_ffi, "_lib", None)
    monkeypatch.setattr(kernels_ffi, "_load_error", None)
    monkeypatch.setattr(kernels_ffi, "library_path", lambda: None)
    monkeypatch.setattr(doctor, "driver_version", lambda: "580.1")  # a machine to build it on
    monkeypatch.setattr(kernels_ffi, "_read_build_info", lambda: {
        "status": "missing_headers",
        "missing": "the scoremod FFI extension was not built: missing cuDNN 9 headers (cudnn.h). "
                   "Build it with: X\n- cuDNN 9 headers (cudnn.h): set SCOREMOD_CUDNN_INCLUDE_DIR"})
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert rows["extension"].startswith("not built: scoremod's native FFI extension was not built "
                                        "at install time: missing cuDNN 9 headers (cudnn.h)")
    assert "SCOREMOD_CUDA=" in rows["extension"] and "pip install --no-deps -e" in rows["extension"]
    assert str(REPO) in rows["extension"]  # the checkout to rebuild
    assert "SCOREMOD_CUDNN_INCLUDE_DIR" in out  # the details, indented below
    if not HAS_GPU:
        assert rows["fused path"].startswith("cannot run here")
    # With no NVIDIA driver there is nothing to build it for: one line, no command.
    monkeypatch.setattr(doctor, "driver_version", lambda: None)
    out = capsys.readouterr().out if main(["doctor"]) == 0 else ""
    rows = _rows(out)
    assert rows["extension"] == (
        "not built (needed only with an NVIDIA GPU; on one, this line gives the build command): "
        "scoremod's native FFI extension was not built at install time: missing cuDNN 9 headers "
        "(cudnn.h).")
    assert "SCOREMOD_CUDNN_INCLUDE_DIR" not in out and "pip install --no-deps -e" not in out


def test_doctor_says_whether_implementation_none_takes_the_fused_path(monkeypatch):
    import scoremod

    from scoremod.attention import Choice

    monkeypatch.setattr(scoremod, "which_implementation",
                        lambda q, k, v: Choice("cudnn", "cudnn: takes it", {"cudnn": None}))
    ok, line = doctor.fused_verdict()
    assert ok and line.startswith("runs here")
    monkeypatch.setattr(scoremod, "which_implementation", lambda q, k, v: Choice(
        "xla", "xla: no faster backend", {"cudnn": "no GPU here"}))
    assert doctor.fused_verdict() == (False, "cannot run here: no GPU here")
    monkeypatch.setattr(scoremod, "which_implementation", lambda q, k, v: Choice(
        "pallas", "pallas: cudnn refuses", {"cudnn": "a reason"}))
    assert doctor.fused_verdict() == (False, "cannot run here: a reason")
    monkeypatch.setattr(scoremod, "which_implementation", lambda q, k, v: Choice(
        "xla", "xla: ...", {"cudnn": "the fused path is not validated on this GPU family; ask "
                                     "for it by name"}))
    assert doctor.fused_verdict()[1].startswith('runs only when asked for (implementation="cudnn")')
    monkeypatch.setattr(scoremod, "which_implementation", lambda q, k, v: Choice(
        "pallas", "pallas: ...", {"cudnn": "cuDNN 9.27.0 ... not verified on this GPU yet; "
                                           "`scoremod doctor --verify` checks it"}))
    assert doctor.fused_verdict()[1].startswith("not yet: cuDNN 9.27.0")


def test_supported_cudnn_range():
    assert support.cudnn_supported(91900) and support.cudnn_supported(92700)
    assert not support.cudnn_supported(91800) and not support.cudnn_supported(100000)
    assert support.cudnn_validated(91902) and not support.cudnn_validated(92000)
    assert support.cudnn_range_text() == ">= 9.19.0, < 10.0.0"
    assert support.cudnn_validated_text() == "9.19.x"
    assert support.cudnn_version_text(92701) == "9.27.1"
    assert support.frontend_supported(13200) and support.frontend_supported(13999)
    assert not support.frontend_supported(13199) and not support.frontend_supported(20000)
    assert (support.cudnn_requirement(), support.frontend_requirement()) == (">=9.19,<10",
                                                                             ">=1.32,<2")


def test_show_into_a_closed_pipe_exits_quietly():
    # `scoremod show ... | head -1`: the reader is gone before scoremod writes.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "scoremod", "show", "30.0 * tanh(score / 30.0)"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO, env=env)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1
    assert "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.gpu
def test_doctor_on_a_gpu(capsys):
    assert main(["doctor"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert "compute capability" in rows["GPU 0"]
    version = rows["cuDNN"].split()[0]
    assert rows["cuDNN"].endswith(": validated") or ": verified on this GPU: PASSED" in \
        rows["cuDNN"], rows["cuDNN"]
    assert support.cudnn_supported(kernels_ffi.encode_version(version))
    assert rows["extension"].startswith("built, loads: ")
    assert rows["fused path"].startswith("runs here"), rows["fused path"]
