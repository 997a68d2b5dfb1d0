"""The native FFI extension: built, loadable, registrable, self-contained.

All but the last tests run on CPU. With SCOREMOD_REQUIRE_FFI=1 (set by .ci/run)
a missing extension is a failure; otherwise the tests that need it skip with
scoremod.kernels_ffi.unavailable_reason(). The ``gpu``-marked tests at the end
execute the handler on small hand-built cuDNN graphs (skipped without a GPU).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scoremod import kernels_ffi
from scoremod.errors import CudnnUnavailableError
from scoremod.kernels_ffi import find_headers

REQUIRE = os.environ.get("SCOREMOD_REQUIRE_FFI") == "1"
# One short line for the skip summary; `scoremod doctor` gives the whole reason.
from tests.conftest import NO_FFI as NOT_BUILT  # noqa: E402
REPO = Path(__file__).resolve().parents[1]

# What the .so may link against: the C/C++ runtime only (ld-linux appears as
# NEEDED for thread_local on glibc >= 2.34). Never libcudnn / libcudart / libcuda.
ALLOWED_NEEDED = re.compile(
    r"^(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|ld-linux[-\w.]*)\.so(\.[\d.]+)?$")


@pytest.fixture(scope="module")
def ffi():
    if not kernels_ffi.available():
        reason = kernels_ffi.unavailable_reason()
        if REQUIRE:
            pytest.fail(f"SCOREMOD_REQUIRE_FFI=1 but the FFI extension is unavailable: {reason}")
        pytest.skip(NOT_BUILT)
    return kernels_ffi


def test_extension_is_available_when_required():
    if not REQUIRE and not kernels_ffi.available():
        pytest.skip(NOT_BUILT)
    assert kernels_ffi.available(), kernels_ffi.unavailable_reason()
    assert kernels_ffi.unavailable_reason() == ""


def test_compiled_frontend_version_matches_python_cudnn(ffi):
    try:
        import cudnn
    except Exception as e:  # noqa: BLE001 - any import failure means "not importable"
        pytest.skip(f"the cudnn Python package is not importable: {e}")
    major, minor, patch = (int(re.match(r"\d+", p).group()) for p in cudnn.__version__.split(".")[:3])
    assert ffi.compiled_frontend_version() == major * 10000 + minor * 100 + patch
    assert ffi.installed_frontend_version() == ffi.compiled_frontend_version()


def test_compiled_header_versions(ffi):
    assert ffi.compiled_cudnn_version() // 10000 == 9
    assert ffi.compiled_cudart_version() // 1000 in (12, 13)
    info = ffi._read_build_info()
    assert info is not None and info["status"] == "built"
    fe = info["headers"]["cudnn_frontend"]["version"]
    assert kernels_ffi.encode_version(fe) == ffi.compiled_frontend_version()


def test_register_is_idempotent_on_cpu_jax(ffi):
    ffi.register()
    ffi.register()


def test_so_links_no_cuda_library(ffi):
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf not installed")
    out = subprocess.run([readelf, "-d", ffi.library_path()], capture_output=True, text=True,
                         check=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)
    assert needed, out
    assert not [n for n in needed if re.search(r"cudnn|cudart|libcuda|nvrtc", n)], needed
    assert all(ALLOWED_NEEDED.match(n) for n in needed), needed
    assert "RPATH" not in out and "RUNPATH" not in out


def test_load_cuda_libraries_reports_without_crashing(ffi):
    ok, text = ffi.load_cuda_libraries()
    assert isinstance(ok, bool) and text
    if not ok:
        assert "cuDNN" in text or "cudnn" in text


def _lowered_call(**overrides):
    # frontend_version given explicitly: these tests need the extension, not the cudnn package
    kwargs = dict(graph_bytes=b"\x01\x02\x03", graph_id=7, in_uids=[1, 2], out_uids=[3],
                  scalar_uids=[], scalar_bits=[], workspace_size=0,
                  frontend_version=kernels_ffi.compiled_frontend_version())
    kwargs.update(overrides)

    def f(a, b):
        return kernels_ffi.call(inputs=[a, b], out_shapes=[jax.ShapeDtypeStruct((2, 4), jnp.bfloat16)],
                                **kwargs)

    x = jnp.zeros((2, 4), jnp.bfloat16)
    return jax.jit(f).lower(x, x)


def test_call_lowers_to_the_ffi_target_with_empty_scalars(ffi):
    lowered = _lowered_call()
    text = lowered.as_text()
    assert f"custom_call @{kernels_ffi.TARGET_NAME}" in text
    assert "scalar_uids = dense<> : tensor<0xi64>" in text
    assert "scalar_bits = dense<> : tensor<0xi32>" in text
    assert "graph_id = 7 : i64" in text
    assert f"frontend_version = {ffi.compiled_frontend_version()} : i64" in text
    # the workspace is an extra uint8 result, dropped from what call() returns
    assert "-> (tensor<2x4xbf16>, tensor<1xui8>)" in text
    out = jax.eval_shape(lambda a, b: kernels_ffi.call(
        b"\x01", 7, [a, b], [jax.ShapeDtypeStruct((2, 4), jnp.bfloat16)], [1, 2], [3],
        frontend_version=ffi.compiled_frontend_version()),
        jnp.zeros((2, 4), jnp.bfloat16), jnp.zeros((2, 4), jnp.bfloat16))
    assert len(out) == 1 and out[0].shape == (2, 4)


def test_call_encodes_scalars_and_ids(ffi):
    text = _lowered_call(scalar_uids=[10, 11],
                         scalar_bits=[kernels_ffi.float32_bits(1.5), np.int32(-3)],
                         graph_id=2**64 - 1, workspace_size=300).as_text()
    assert "scalar_uids = dense<[10, 11]> : tensor<2xi64>" in text
    assert f"scalar_bits = dense<[{kernels_ffi.float32_bits(1.5)}, -3]> : tensor<2xi32>" in text
    assert "graph_id = -1 : i64" in text
    assert "tensor<300xui8>" in text


def test_call_runs_nowhere_but_cuda(ffi):
    # On the CPU backend the target has no implementation: an error, never a silent no-op.
    cpu = jax.devices("cpu")[0]
    x = jax.device_put(jnp.zeros((2, 4), jnp.bfloat16), cpu)
    f = jax.jit(lambda a: kernels_ffi.call(b"\x01", 7, [a], [jax.ShapeDtypeStruct((2, 4), jnp.bfloat16)],
                                           [1], [3],
                                           frontend_version=ffi.compiled_frontend_version())[0])
    with pytest.raises(Exception, match=kernels_ffi.TARGET_NAME):
        f.lower(x).compile()


def test_call_rejects_bad_arguments(ffi):
    x = jnp.zeros((2, 4), jnp.bfloat16)
    s = [jax.ShapeDtypeStruct((2, 4), jnp.bfloat16)]
    with pytest.raises(ValueError, match="in_uids"):
        kernels_ffi.call(b"\x01", 1, [x], s, [1, 2], [3])
    with pytest.raises(ValueError, match="out_uids"):
        kernels_ffi.call(b"\x01", 1, [x], s, [1], [])
    with pytest.raises(ValueError, match="scalar_bits"):
        kernels_ffi.call(b"\x01", 1, [x], s, [1], [3], [9], [])
    with pytest.raises(ValueError, match="duplicate"):
        kernels_ffi.call(b"\x01", 1, [x], s, [1], [1])
    with pytest.raises(TypeError, match="float32_bits"):
        kernels_ffi.call(b"\x01", 1, [x], s, [1], [3], [9], [1.5])
    with pytest.raises(ValueError, match="empty"):
        kernels_ffi.call(b"", 1, [x], s, [1], [3])
    with pytest.raises(CudnnUnavailableError, match="mismatch"):
        kernels_ffi.call(b"\x01", 1, [x], s, [1], [3], frontend_version=10000)
    with pytest.raises(ValueError, match="offsets"):
        kernels_ffi.call(b"\x01", 1, [x], s, [1], [3], offsets=[0])
    with pytest.raises(ValueError, match="offsets must be >= 0"):
        kernels_ffi.call(b"\x01", 1, [x], s, [1], [3], offsets=[0, -2])
    with pytest.raises(ValueError, match="in_uid -1"):
        kernels_ffi.call(b"\x01", 1, [x], s, [1], [3], carry={0: 0})
    with pytest.raises(ValueError, match="needs a carry entry"):
        kernels_ffi.call(b"\x01", 1, [x, x], s, [1, -1], [3])
    with pytest.raises(ValueError, match="cannot become"):
        kernels_ffi.call(b"\x01", 1, [x, x.astype(jnp.float32)], s, [1, -1], [3], carry={1: 0})


def test_scalar_bit_helpers():
    assert kernels_ffi.float32_bits(1.0) == 0x3F800000
    assert kernels_ffi.float32_bits(-2.0) == -(2**32 - 0xC0000000)
    assert kernels_ffi.int32_bits(-5) == -5
    with pytest.raises(ValueError):
        kernels_ffi.int32_bits(2**31)
    bits = kernels_ffi._scalar_bits(np.array([1.0, -2.0], np.float32))
    assert bits.dtype == np.int32 and bits.tolist() == [0x3F800000, -(2**32 - 0xC0000000)]
    assert kernels_ffi._scalar_bits([0xFFFFFFFF]).tolist() == [-1]
    assert kernels_ffi._scalar_bits([]).shape == (0,)
    assert kernels_ffi.hash_graph(b"abc") == kernels_ffi.hash_graph(bytearray(b"abc"))


def test_unavailable_reason_names_the_fix(monkeypatch):
    # Simulate an install whose build found no cuDNN headers.
    missing = find_headers.missing_message([find_headers.HeaderSet(
        "cudnn", "cuDNN 9 headers (cudnn.h)", "SCOREMOD_CUDNN_INCLUDE_DIR",
        fix="python -m pip install --no-deps nvidia-cudnn-jit-cu13==9.19.0.56")])
    monkeypatch.setattr(kernels_ffi, "_lib", None)
    monkeypatch.setattr(kernels_ffi, "_load_error", None)
    monkeypatch.setattr(kernels_ffi, "_registered", False)
    monkeypatch.setattr(kernels_ffi, "library_path", lambda: None)
    monkeypatch.setattr(kernels_ffi, "_read_build_info",
                        lambda: {"status": "missing_headers", "missing": missing})
    assert not kernels_ffi.available()
    reason = kernels_ffi.unavailable_reason()
    assert "cuDNN 9 headers" in reason and "pip install" in reason
    assert "SCOREMOD_CUDNN_INCLUDE_DIR" in reason
    with pytest.raises(CudnnUnavailableError, match="cuDNN 9 headers"):
        kernels_ffi.register()
    # Not built at all (imported from a checkout without pip install).
    monkeypatch.setattr(kernels_ffi, "_load_error", None)
    monkeypatch.setattr(kernels_ffi, "_read_build_info", lambda: None)
    assert "pip install" in kernels_ffi.unavailable_reason()


def test_find_headers_reports_a_missing_set(tmp_path, monkeypatch):
    monkeypatch.setenv("SCOREMOD_CUDNN_INCLUDE_DIR", str(tmp_path))
    sets = {hs.key: hs for hs in find_headers.find_all()}
    assert not sets["cudnn"].found
    msg = find_headers.missing_message(list(sets.values()))
    assert "SCOREMOD_CUDNN_INCLUDE_DIR" in msg and find_headers.HEADER_PACKAGES[1] in msg
    assert str(tmp_path) in msg


@pytest.mark.skipif(shutil.which("cmake") is None or not (REPO / "CMakeLists.txt").exists(),
                    reason="needs cmake and the source checkout")
@pytest.mark.parametrize("require", [False, True])
def test_cmake_without_headers_still_succeeds(tmp_path, require):
    env = dict(os.environ, SCOREMOD_CUDNN_INCLUDE_DIR=str(tmp_path / "empty"))
    env.pop("SCOREMOD_REQUIRE_FFI", None)
    if require:
        env["SCOREMOD_REQUIRE_FFI"] = "1"
    (tmp_path / "empty").mkdir()
    build, prefix = tmp_path / "build", tmp_path / "prefix"
    configure = subprocess.run(
        ["cmake", "-S", str(REPO), "-B", str(build), f"-DPython_EXECUTABLE={sys.executable}",
         f"-DCMAKE_INSTALL_PREFIX={prefix}"], env=env, capture_output=True, text=True)
    if require:
        assert configure.returncode != 0
        assert "cuDNN 9 headers" in configure.stderr
        return
    assert configure.returncode == 0, configure.stdout + configure.stderr
    assert "cuDNN 9 headers" in configure.stderr  # the warning
    subprocess.run(["cmake", "--build", str(build)], env=env, check=True, capture_output=True)
    subprocess.run(["cmake", "--install", str(build)], env=env, check=True, capture_output=True)
    installed = prefix / "scoremod" / "kernels_ffi"
    assert not (installed / "_scoremod_ffi.so").exists()
    namespace: dict = {}
    exec((installed / "_build_info.py").read_text(), namespace)
    assert namespace["BUILD_INFO"]["status"] == "missing_headers"
    assert "SCOREMOD_CUDNN_INCLUDE_DIR" in namespace["BUILD_INFO"]["missing"]


def test_ci_builds_the_extension_with_isolation():
    ci = REPO / ".ci" / "run"
    if not ci.exists():
        pytest.skip("no .ci/run in this checkout")
    text = ci.read_text()
    assert "SCOREMOD_CUDA=13" in text and "SCOREMOD_REQUIRE_FFI=1" in text
    assert "--no-build-isolation" not in text


def _pyproject():
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _backend():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_test_scoremod_build",
                                                  REPO / "build_backend" / "scoremod_build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("major", [12, 13])
def test_install_extras_pin_what_the_project_supports(major):
    from scoremod import support

    extra = _pyproject()["project"]["optional-dependencies"][f"cuda{major}"]
    assert support.cudnn_requirement() == ">=9.19,<10"
    assert f"nvidia-cudnn-cu{major}{support.cudnn_requirement()}" in extra
    assert f"nvidia-cudnn-frontend{support.frontend_requirement()}" in extra
    assert any(r.startswith(f"jax[cuda{major}]") for r in extra)
    # the headers the extension compiles against: the same frontend range, the
    # validated cuDNN line
    headers = find_headers.HEADER_PACKAGES_BY_CUDA[major]
    assert f"nvidia-cudnn-frontend{support.frontend_requirement()}" in headers
    assert find_headers.FRONTEND_REQUIREMENT in headers
    cudnn = next(h for h in headers if h.startswith("nvidia-cudnn-jit"))
    assert support.cudnn_validated(kernels_ffi.encode_version(cudnn.split("==")[1]))


def test_the_build_checks_the_frontend_range_the_project_supports(tmp_path):
    from scoremod import support

    low, high = (kernels_ffi.encode_version(".".join(map(str, v)))
                 for v in find_headers.FRONTEND_RANGE)
    assert (low, high) == support.CUDNN_FRONTEND_SUPPORTED
    assert kernels_ffi.encode_version(support.CUDNN_FRONTEND) >= low
    for version, taken in (("1.32.0", True), ("1.40.2", True), ("1.31.9", False),
                           ("2.0.0", False)):
        include = tmp_path / version / "include"
        _touch(include, "cudnn_frontend.h", "cudnn_frontend/graph_interface.h")
        major, minor, patch = version.split(".")
        (include / "cudnn_frontend_version.h").write_text(
            f"#define CUDNN_FRONTEND_MAJOR_VERSION {major}\n"
            f"#define CUDNN_FRONTEND_MINOR_VERSION {minor}\n"
            f"#define CUDNN_FRONTEND_PATCH_VERSION {patch}\n")
        hs = find_headers.find_cudnn_frontend([(str(tmp_path / version), "sys.path")])
        assert hs.found == taken, (version, hs.tried)
        if taken:
            assert hs.version == version
        else:
            assert "outside the supported range" in hs.tried[0]
        # the build pins the headers to the installed Python package when it is in range
        (tmp_path / version / f"nvidia_cudnn_frontend-{version}.dist-info").mkdir()
        found = find_headers.installed_frontend([(str(tmp_path / version), "target environment")])
        assert found == tuple(map(int, version.split(".")))
        assert find_headers.frontend_requirement(found) == (
            f"nvidia-cudnn-frontend=={version}" if taken else find_headers.FRONTEND_REQUIREMENT)


def test_build_backend_picks_header_packages_by_cuda_major():
    backend = _backend()
    build = _pyproject()["build-system"]
    assert build["build-backend"] == "scoremod_build" and build["backend-path"] == ["build_backend"]
    no_driver, driver = (lambda: None), (lambda: 580)
    none, installed = (lambda: None), (lambda: (1, 33, 2))
    assert backend.header_requirements({}, no_driver) == []  # a CPU machine: light
    assert backend.header_requirements({"SCOREMOD_CUDA": "13"}, no_driver, none) == \
        list(find_headers.HEADER_PACKAGES_BY_CUDA[13])
    assert backend.header_requirements({"SCOREMOD_CUDA": "12"}, driver, none) == \
        list(find_headers.HEADER_PACKAGES_BY_CUDA[12])
    # the frontend headers of the version the target environment has installed
    pinned = backend.header_requirements({"SCOREMOD_CUDA": "13"}, driver, installed)
    assert pinned[0] == "nvidia-cudnn-frontend==1.33.2"
    assert pinned[1:] == list(find_headers.HEADER_PACKAGES_BY_CUDA[13][1:])
    assert backend.cuda_major({}, driver) == 13
    assert backend.cuda_major({}, lambda: 570) == 12
    assert backend.cuda_major({"SCOREMOD_CUDA": "0"}, driver) is None
    with pytest.raises(ValueError, match="SCOREMOD_CUDA"):
        backend.cuda_major({"SCOREMOD_CUDA": "11"}, driver)


def _touch(root, *rels, text=""):
    for rel in rels:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_find_headers_assembles_cuda12_pip_wheels(tmp_path, monkeypatch):
    monkeypatch.setattr(find_headers, "_system_roots", lambda: [])  # only the fake site
    # CUDA 12 wheels split the headers over four packages (runtime, nvcc's crt/,
    # cccl's nv/target, nvrtc); CUDA 13 keeps them in one nvidia/cu13/include.
    inc = tmp_path / "nvidia"
    _touch(inc / "cuda_runtime" / "include", "cuda.h", "cuda_fp16.h")
    (inc / "cuda_runtime" / "include" / "cuda_fp16.h").write_text("#include <nv/target>\n")
    (inc / "cuda_runtime" / "include" / "cuda_runtime_api.h").write_text(
        "#define CUDART_VERSION 12090\n")
    _touch(inc / "cuda_nvcc" / "include", "crt/host_defines.h")
    _touch(inc / "cuda_cccl" / "include", "nv/target")
    _touch(inc / "cuda_nvrtc" / "include", "nvrtc.h")
    hs = find_headers.find_cuda([(str(tmp_path), "test")])
    assert hs.found, hs.tried
    assert hs.version == "12.9"
    assert {Path(d).parent.name for d in hs.include_dirs} == {
        "cuda_runtime", "cuda_nvcc", "cuda_cccl", "cuda_nvrtc"}
    (inc / "cuda_nvcc" / "include" / "crt" / "host_defines.h").unlink()
    hs = find_headers.find_cuda([(str(tmp_path), "test")])
    assert not hs.found and "crt/host_defines.h" in hs.tried[0]


def test_missing_headers_message_starts_with_the_build_command():
    msg = find_headers.missing_message(find_headers.find_all()[:0] + [find_headers.HeaderSet(
        "cudnn", "cuDNN 9 headers (cudnn.h)", "SCOREMOD_CUDNN_INCLUDE_DIR")])
    first = msg.splitlines()[0]
    assert "missing cuDNN 9 headers" in first
    assert first.endswith(f"Build it with: {find_headers.REBUILD}")
    assert find_headers.REBUILD == f"SCOREMOD_CUDA=13 python -m pip install --no-deps -e {REPO}"


# --------------------------------------------------------------------------- #
# On a GPU: run the handler on hand-built SDPA graphs (BSHD layout, bf16).

SHAPE = (2, 128, 4, 64)  # b, s, h, d


def _sdpa_graph(cap):
    """An SDPA graph; with `cap`, score_mod = tanh(S) * cap (cap a pass-by-value scalar, uid 10)."""
    cudnn = pytest.importorskip("cudnn")
    b, s, h, d = SHAPE
    dims, strides = (b, h, s, d), (s * h * d, d, h * d, 1)
    bf16, f32 = cudnn.data_type.BFLOAT16, cudnn.data_type.FLOAT
    g = cudnn.pygraph(io_data_type=bf16, intermediate_data_type=f32, compute_data_type=f32)
    q, k, v = (g.tensor(name=n, dim=dims, stride=strides, data_type=bf16) for n in "qkv")
    for t, uid in zip((q, k, v), (1, 2, 3)):
        t.set_uid(uid)
    extra = {}
    if cap is not None:
        c = g.tensor(name="cap", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], is_pass_by_value=True,
                     data_type=f32)
        c.set_uid(10)
        extra["score_mod"] = lambda gg, score: gg.mul(a=gg.tanh(input=score), b=c)
    o, stats = g.sdpa(name="sdpa", q=q, k=k, v=v, attn_scale=1 / math.sqrt(d) / (cap or 1.0),
                      generate_stats=True, use_causal_mask=False, **extra)
    o.set_output(True).set_dim(dims).set_stride(strides)
    o.set_uid(4)
    stats.set_output(True).set_data_type(f32)
    stats.set_uid(5)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans(cudnn.build_plan_policy.HEURISTICS_CHOICE)
    return bytes(g.serialize(as_bytes=True)), int(g.get_workspace_size())


def _run(blob, ws, cap, *inputs, **overrides):
    b, s, h, d = SHAPE
    args = dict(graph_bytes=blob, graph_id=None,
                out_shapes=[jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16),
                            jax.ShapeDtypeStruct((b, h, s, 1), jnp.float32)],
                in_uids=[1, 2, 3], out_uids=[4, 5],
                scalar_uids=[] if cap is None else [10],
                scalar_bits=[] if cap is None else [kernels_ffi.float32_bits(cap)],
                workspace_size=ws)
    args.update(overrides)
    return jax.jit(lambda *xs: kernels_ffi.call(inputs=list(xs), **args))(*inputs)


def _qkv(device=None):
    key = jax.random.PRNGKey(0)
    xs = [jax.random.normal(jax.random.fold_in(key, i), SHAPE, jnp.float32).astype(jnp.bfloat16)
          for i in range(3)]
    return [jax.device_put(x, device) for x in xs] if device is not None else xs


def _reference(q, k, v, cap):
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32))
    s = s / math.sqrt(q.shape[-1])
    if cap is not None:
        s = cap * jnp.tanh(s / cap)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v.astype(jnp.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("cap", [30.0, None], ids=["one_scalar", "no_scalars"])
def test_handler_runs_a_serialized_graph(ffi, cap):
    blob, ws = _sdpa_graph(cap)
    q, k, v = _qkv()
    o, stats = _run(blob, ws, cap, q, k, v)
    err = float(jnp.max(jnp.abs(o.astype(jnp.float32) - _reference(q, k, v, cap))))
    assert err < 0.02, err
    assert stats.shape == (SHAPE[0], SHAPE[2], SHAPE[1], 1) and bool(jnp.all(jnp.isfinite(stats)))


@pytest.mark.gpu
def test_handler_errors_are_reported_and_harmless(ffi):
    blob, ws = _sdpa_graph(30.0)
    q, k, v = _qkv()
    want, _ = _run(blob, ws, 30.0, q, k, v)
    with pytest.raises(Exception, match="dtype float16 but graph tensor 'q' is bfloat16"):
        jax.block_until_ready(_run(blob, ws, 30.0, q.astype(jnp.float16), k, v))
    with pytest.raises(Exception, match=r"also needs tensors \[10\]"):
        jax.block_until_ready(_run(blob, ws, 30.0, q, k, v, scalar_uids=[], scalar_bits=[]))
    if ws > 1:
        with pytest.raises(Exception, match="workspace has 1 bytes"):
            jax.block_until_ready(_run(blob, ws, 30.0, q, k, v, workspace_size=0))
    with pytest.raises(Exception, match="deserializing the cuDNN graph"):
        jax.block_until_ready(_run(b"\xff" * 4096, ws, 30.0, q, k, v))
    again, _ = _run(blob, ws, 30.0, q, k, v)
    assert bool(jnp.array_equal(again, want))


@pytest.mark.gpu
def test_handler_reads_and_writes_at_byte_offsets_in_place(ffi):
    # The graph's tensors start one batch element into larger arrays; O and the
    # stats are carried in, so the bytes the graph does not write keep their values.
    blob, ws = _sdpa_graph(30.0)
    q, k, v = _qkv()
    want_o, want_stats = _run(blob, ws, 30.0, q, k, v)
    b, s, h, d = SHAPE
    big = [jnp.concatenate([jnp.full((1, s, h, d), 7, jnp.bfloat16), x]) for x in (q, k, v)]
    o0 = jnp.full((b + 1, s, h, d), -1, jnp.bfloat16)
    stats0 = jnp.full((b + 1, h, s, 1), -1, jnp.float32)
    row = s * h * d * 2
    args = dict(in_uids=[1, 2, 3, -1, -1], carry={3: 0, 4: 1},
                out_shapes=[jax.ShapeDtypeStruct(o0.shape, o0.dtype),
                            jax.ShapeDtypeStruct(stats0.shape, stats0.dtype)])
    o, stats = _run(blob, ws, 30.0, *big, o0, stats0, offsets=[row] * 3 + [0, 0, row, h * s * 4],
                    **args)
    assert bool(jnp.array_equal(o[1:], want_o)) and bool(jnp.all(o[0] == -1))
    assert bool(jnp.array_equal(stats[1:], want_stats)) and bool(jnp.all(stats[0] == -1))
    with pytest.raises(Exception, match="bytes after its offset"):
        jax.block_until_ready(_run(blob, ws, 30.0, *big, o0, stats0,
                                   offsets=[2 * row] * 3 + [0, 0, row, h * s * 4], **args))


@pytest.mark.gpu
def test_handler_deserializes_once_per_device(ffi):
    devices = [d for d in jax.devices() if d.platform == "gpu"]
    if len(devices) < 2:
        pytest.skip("needs two GPUs")
    blob, ws = _sdpa_graph(None)
    outs, added = [], []
    for device in devices[:2]:
        before = ffi.cache_entries()
        o, _ = _run(blob, ws, None, *_qkv(device))
        outs.append(np.asarray(o.astype(jnp.float32)))
        added.append(ffi.cache_entries() - before)
        assert o.devices() == {device}
    # device 0 may already hold this graph (an identical one ran above); device 1
    # must get its own deserialization, never device 0's plan.
    assert added[1] == 1, added
    np.testing.assert_array_equal(outs[0], outs[1])


def test_any_supported_frontend_runs_when_the_package_matches_the_headers(monkeypatch):
    """Not one exact version: the Python package must be the version of the headers
    compiled in, whichever that is; the fused path asks before it builds a graph."""

    class Extension:  # compiled against frontend 1.33.5 headers
        def scoremod_ffi_compiled_frontend_version(self):
            return 13305

    monkeypatch.setattr(kernels_ffi, "_load", lambda: Extension())
    monkeypatch.setattr(kernels_ffi, "installed_frontend_version", lambda: 13305)
    assert kernels_ffi.frontend_mismatch() == ""
    monkeypatch.setattr(kernels_ffi, "installed_frontend_version", lambda: 13200)
    why = kernels_ffi.frontend_mismatch()
    assert why.startswith("cuDNN frontend mismatch: graphs come from the Python package 1.32.0")
    assert "compiled against 1.33.5 headers" in why and "nvidia-cudnn-frontend==1.33.5" in why
    monkeypatch.setattr(kernels_ffi, "installed_frontend_version", lambda: None)
    assert "not installed; pip install --no-deps nvidia-cudnn-frontend==1.33.5" in \
        kernels_ffi.frontend_mismatch()
