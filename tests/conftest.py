"""Shared test setup: float32 precision, and skips for what this machine lacks.

Tests marked ``gpu`` skip without an NVIDIA GPU; tests that take the ``ffi``
fixture skip when the native extension is not built (unless
SCOREMOD_REQUIRE_FFI=1, where that is a failure). Each skip is raised here,
with one short reason, so that the summary folds them into one line each;
``scoremod doctor`` gives the full reasons.

SCOREMOD_TEST_TIMEOUT=<seconds> (set by tests/gpu/run.sh) ends a test that
runs longer: the stacks of all threads go to stderr and the process exits, so
that one hang cannot stall a whole run (under pytest-xdist the worker is
replaced and the test reported as failed).

Two tiers (tests/tiers.py): ``python -m pytest`` runs the fast one, which
samples the large families and leaves the tests marked ``slow`` out;
``python -m pytest --full`` runs every test.

SCOREMOD_TEST_PROFILE=1 (set by tests/gpu/run.sh) records in each test's JUnit
properties where its time went: JAX's tracing (cuDNN graphs are built then),
lowering (Pallas kernels are generated then) and XLA's compile, and scoremod's
cuDNN graph builds, in seconds (``python -m tests.gpu.junit profile RUN.xml``).
"""

import faulthandler
import functools
import os
import sys

import jax
import pytest

from tests import tiers

# Tests never read or write the user's cuDNN plan cache (a warm cache would
# turn the build counts they check into disk hits); tests of the cache give
# their own directory.
os.environ["SCOREMOD_CACHE_DIR"] = ""

# float32 comparisons in the tests mean float32 arithmetic: GPUs default to
# TF32 matmuls, which differ from float32 by about 1e-3.
jax.config.update("jax_default_matmul_precision", "highest")

NO_GPU = "needs an NVIDIA GPU (`python -m pytest -m gpu` runs these on one)"
NO_FFI = "needs the FFI extension, not built here (`scoremod doctor` says why)"
_TIMEOUT = float(os.environ.get("SCOREMOD_TEST_TIMEOUT", "0") or 0)
_stderr = None  # the real stderr, kept while tests run with their output captured
_PROFILE = os.environ.get("SCOREMOD_TEST_PROFILE") == "1"
_spent: dict = {}  # JAX compile event -> seconds, in the test running now
_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace_s",
           "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
           "/jax/core/compile/backend_compile_duration": "compile_s"}


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="run the full tier: the tests marked slow too, and every Hypothesis "
                          "test at its full example count (tests/tiers.py)")


def _by_node_id(config) -> bool:
    return any("::" in str(a) for a in config.args)


def _tiered(config) -> bool:
    """Whether this run is the fast tier: not --full, and no selection by -m or
    node id (which runs what it names)."""
    if config.getoption("full", False) or config.option.markexpr:
        return False
    return not _by_node_id(config)


def pytest_configure(config):
    global _stderr
    tiers.FULL = config.getoption("full", False)
    if _TIMEOUT > 0 and _stderr is None:
        # Output capture is suspended here, so fd 2 is still the terminal or log.
        _stderr = os.fdopen(os.dup(sys.__stderr__.fileno()), "w")
    if _PROFILE:
        def spent(event, seconds, **_):
            if event in _EVENTS:
                _spent[_EVENTS[event]] = _spent.get(_EVENTS[event], 0.0) + seconds
        jax.monitoring.register_event_duration_secs_listener(spent)


@pytest.fixture
def stand_in_h200(monkeypatch):
    """A faked H200 on which the cuDNN path plans and traces for real, and whose
    graph builds and FFI calls are stand-ins (the calls return zeros): for tests
    that a call lowers through the fused pipeline (jit, grad,
    custom_partitioning), not of its values."""
    import jax.numpy as jnp

    from scoremod import device, kernels_ffi
    from scoremod.lowering.cudnn import backend as cudnn_backend
    from scoremod.lowering.cudnn import graph as cg

    monkeypatch.setattr(device, "current", lambda: device.Device("gpu", "NVIDIA H200", 9, 132))
    monkeypatch.setattr(kernels_ffi, "available", lambda: True)
    monkeypatch.setattr(kernels_ffi, "frontend_mismatch", lambda: "")
    monkeypatch.setattr(cudnn_backend, "_frontend_installed", lambda: True)
    monkeypatch.setattr(cudnn_backend.verify, "refusal", lambda automatic: None)
    monkeypatch.setattr(cg, "cached", lambda key, build: cg.Built(b"", 0, (), (), (), (), 0, "", 0.0))
    monkeypatch.setattr(cg, "backend_version", lambda: 91900)
    monkeypatch.setattr(cg, "frontend_version", lambda: 13200)
    monkeypatch.setattr(kernels_ffi, "call", lambda blob, gid, inputs, out_shapes, *a, **kw: [
        jnp.zeros(s.shape, s.dtype) for s in out_shapes])


@functools.cache
def has_gpu():
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


@functools.cache
def has_ffi():
    from scoremod import kernels_ffi

    return kernels_ffi.available() or os.environ.get("SCOREMOD_REQUIRE_FFI") == "1"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if _PROFILE:  # the profile's start
        _spent.clear()
        item._cudnn_seconds = _cudnn_build_seconds()
    if "gpu" in item.keywords and not has_gpu():
        pytest.skip(NO_GPU)
    if "ffi" in getattr(item, "fixturenames", ()) and not has_ffi():
        pytest.skip(NO_FFI)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _stderr is not None:
        faulthandler.dump_traceback_later(_TIMEOUT, exit=True, file=_stderr)
    try:
        yield
    finally:
        if _stderr is not None:
            faulthandler.cancel_dump_traceback_later()


def pytest_collection_modifyitems(config, items):
    """Mark what the fast tier leaves out ``slow`` (tests/tiers.py), and leave it out."""
    families, files = {}, set()
    for item in items:
        path = os.path.relpath(str(item.path), os.path.dirname(__file__)).replace(os.sep, "/")
        files.add(path)
        name = getattr(item, "originalname", None) or item.name.split("[")[0]
        families.setdefault(f"{path}::{name}", []).append(item)
    whole_files = not config.option.keyword and not _by_node_id(config)
    for key in list(tiers.SAMPLED) + sorted(tiers.SLOW):
        if whole_files and key.split("::")[0] in files and key not in families:
            raise pytest.UsageError(f"tests/tiers.py names {key}, which no collected test is")
    for key, members in families.items():
        if key in tiers.SLOW:
            keep = set()
        elif key in tiers.SAMPLED:
            keep = tiers.spread(len(members), tiers.SAMPLED[key])
        else:
            continue
        for i, item in enumerate(members):
            if i not in keep:
                item.add_marker(pytest.mark.slow)
    if _tiered(config):
        slow = {item for item in items if item.get_closest_marker("slow")}
        if slow:
            config.hook.pytest_deselected(items=[item for item in items if item in slow])
            items[:] = [item for item in items if item not in slow]


def pytest_terminal_summary(terminalreporter, config):
    if _tiered(config):
        terminalreporter.write_line("fast tier: the tests marked slow were left out "
                                    "(python -m pytest --full runs every test)")


def _cudnn_build_seconds():
    from scoremod.lowering.cudnn import graph

    return graph.cache_info()["build_seconds"]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if _PROFILE and hasattr(item, "_cudnn_seconds"):
        built = _cudnn_build_seconds() - item._cudnn_seconds
        # A test that cleared the graph cache reset the counter: what it built since.
        _spent["cudnn_build_s"] = built if built >= 0 else _cudnn_build_seconds()
        item.user_properties.extend((k, f"{v:.3f}") for k, v in sorted(_spent.items()))
