"""What the planner chooses on each NVIDIA GPU generation, with Pallas's Triton
backend present and gone (JAX deprecated it in 0.11: docs/install.md).

The GPU is faked (``device.current``; the cuDNN extension's checks pass),
nothing runs: ``which_implementation`` is asked, which is what ``attention``
runs (tests/test_route.py). Ampere (sm_80): cuDNN has no score_mod graphs
there, so the Pallas kernels take every mod on their Triton engine. Hopper
(sm_90): cuDNN first, the Mosaic GPU engine for what it claims (tables read at
q_idx - kv_idx). Blackwell (sm_100): cuDNN is not validated there (by name
only), the Triton engine runs the mods. Without Triton, Ampere and Blackwell
take the reference path with a warning naming both refusals, and Hopper keeps
its routes; a Mosaic forward whose backward only the Triton kernels compute
refuses that backward with the reason.
"""

import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from scoremod import device, kernels_ffi, support
from scoremod import route as route_module
from scoremod.errors import ScoreModError
from scoremod.lowering.cudnn import backend as cudnn_backend
from scoremod.lowering.pallas import backend as pallas_backend
from scoremod.lowering.problem import Problem

GPUS = {"ampere": device.Device("gpu", "NVIDIA A100", 8, 108),
        "hopper": device.Device("gpu", "NVIDIA H200", 9, 132),
        "blackwell": device.Device("gpu", "NVIDIA B200", 10, 148)}
GONE = "this jax (9.9) has no Pallas Triton backend (No module named 'jax._src.pallas.triton')"
S = 1024
TABLE = jnp.zeros((2, 2 * S - 1))
BUCKETS = jnp.asarray(np.clip(np.arange(-S + 1, S) // 16, -8, 8) + 8, jnp.int32)
BUCKET_TABLE = jnp.zeros((17, 2))
MODS = {"softcap": lambda s, b, h, q, k: 30 * jnp.tanh(s / 30),
        "relative_table": lambda s, b, h, q, k: s + TABLE[h, q - k + S - 1]}


def bucket_table(s, b, h, q, k):
    """T5's, through an int bucket array: its gradient is a gather."""
    return s + BUCKET_TABLE[BUCKETS[k - q + S - 1], h]


@pytest.fixture
def gpu(monkeypatch):
    monkeypatch.setattr(kernels_ffi, "available", lambda: True)
    monkeypatch.setattr(cudnn_backend, "_frontend_installed", lambda: True)
    monkeypatch.setattr(kernels_ffi, "frontend_mismatch", lambda: "")
    monkeypatch.setattr(cudnn_backend.verify, "refusal", lambda automatic: None)
    monkeypatch.setattr(route_module, "_WARNED", set())

    def fake(name, triton):
        monkeypatch.setattr(device, "current", lambda: GPUS[name])
        monkeypatch.setattr(support, "pallas_triton_missing", lambda: None if triton else GONE)
    return fake


def _choice(mod):
    q = jnp.zeros((1, S, 2, 128), jnp.bfloat16)
    return scoremod.which_implementation(q, q, q, MODS[mod])


@pytest.mark.parametrize("mod", sorted(MODS))
@pytest.mark.parametrize("name", ["ampere", "blackwell"])
def test_off_hopper_the_triton_engine_runs_the_mods(gpu, name, mod):
    gpu(name, triton=True)
    choice = _choice(mod)
    assert choice.implementation == "pallas", choice
    assert choice.variant.startswith("the Triton engine"), choice
    assert "needs a Hopper GPU" in choice.variant or support.mosaic_missing(), choice
    why = {"ampere": "not supported on compute capability family sm_8x",
           "blackwell": "not validated on this GPU family (sm_10x)"}[name]
    assert choice.reason.startswith("pallas: cudnn refuses this call: ") and why in choice.reason


@pytest.mark.parametrize("mod", sorted(MODS))
@pytest.mark.parametrize("name", ["ampere", "blackwell"])
def test_off_hopper_without_triton_the_reference_path_runs_with_a_warning(gpu, name, mod):
    from scoremod import doctor

    gpu(name, triton=False)
    assert doctor.pallas_verdict() == (
        f"cannot run here: its Triton engine cannot compile here: {GONE}; its Mosaic GPU "
        "engine (Hopper GPUs, jax 0.11 or later) runs the calls it takes")
    choice = _choice(mod)
    assert choice.implementation == "xla", choice
    assert f"pallas refuses this call: its Triton engine cannot compile here: {GONE}" in (
        choice.reason), choice
    assert "cudnn refuses this call" in choice.reason
    q = jnp.zeros((1, S, 2, 128), jnp.bfloat16)
    with pytest.warns(UserWarning, match="uses the reference path here: cudnn refuses .*; pallas "
                                         "refuses this call: its Triton engine cannot compile"):
        scoremod.attention(q, q, q, MODS[mod])


@pytest.mark.parametrize("triton", [True, False], ids=["triton", "no-triton"])
def test_on_hopper_routes_do_not_need_triton(gpu, triton):
    from scoremod import doctor

    gpu("hopper", triton=triton)
    pallas = doctor.pallas_verdict()
    if not support.mosaic_missing():
        assert pallas.startswith("runs here on the Mosaic GPU engine"), pallas
        assert ("the Triton engine takes what it refuses" in pallas) == triton, pallas
        assert (GONE in pallas) == (not triton), pallas
    assert _choice("softcap").implementation == "cudnn"
    table = _choice("relative_table")
    if support.mosaic_missing():  # jax 0.10: the Mosaic engine is not there either
        assert table.implementation == "cudnn", table
        return
    assert table.implementation == "pallas" and "Mosaic GPU" in table.variant, table
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the chosen route is the first choice: silent
        _choice("relative_table")


def test_a_backward_only_triton_computes_is_refused_without_it(gpu, monkeypatch):
    """On Hopper the Mosaic GPU backward learns a table read at q_idx - kv_idx (per
    block diagonal) and one read through a gather (``bucket[q_idx - kv_idx]``, by
    the position of each score), and leaves two things to the Triton kernels: the
    gradient of an array read per score and also otherwise, and mods whose
    derivative it cannot evaluate. Without Triton the plan keeps the Mosaic
    forward, and that backward refuses, naming why."""
    if support.mosaic_missing():
        pytest.skip(f"the Mosaic GPU engine is {support.mosaic_missing()}")
    q = jnp.zeros((1, S, 2, 128), jnp.bfloat16)
    problem, options, pallas = Problem.of(q, q, q), scoremod.LoweringOptions(), pallas_backend.PALLAS
    gpu("hopper", triton=False)
    table = pallas.plan(problem, scoremod.trace(MODS["relative_table"]), 0.125, options, True)
    assert table.diagonal_operands and not table.triton_operands, table.describe()
    pallas_backend._refuse_without_triton(table, [], {})  # its gradient needs no Triton
    gathered = pallas.plan(problem, scoremod.trace(bucket_table), 0.125, options, True)
    assert not gathered.triton_operands and not gathered.diagonal_operands, gathered.describe()
    bias = jnp.zeros((2, S, S), jnp.float32)
    mod = scoremod.trace(lambda s, b, h, q, k: s * bias[h, 0, 0] + bias[h, q, k])
    gpu("hopper", triton=True)
    plan = pallas.plan(problem, mod, 0.125, options, True)
    assert plan.engine == plan.backward_engine == "mosaic", plan.describe()
    (name, why), = plan.triton_operands  # read both ways: Triton's backward
    pallas_backend._refuse_without_triton(plan, [name], dict(plan.triton_operands))
    gpu("hopper", triton=False)
    plan = pallas.plan(problem, mod, 0.125, options, True)
    pallas_backend._refuse_without_triton(plan, [], dict(plan.triton_operands))  # dQ, dK, dV
    with pytest.raises(ScoreModError, match=f"does not take the gradient of `{name}`.*the "
                                            "Triton backward cannot compile: this jax"):
        pallas_backend._refuse_without_triton(plan, [name], dict(plan.triton_operands))

    monkeypatch.setattr(pallas_backend, "_mosaic_backward_refusal", lambda *a: "a reason")
    plan = pallas.plan(problem, mod, 0.125, options, True)
    assert plan.engine == "mosaic" and plan.backward_engine is None
    with pytest.raises(ScoreModError, match=r"does not take this mod \(a reason\)"):
        pallas_backend._refuse_without_triton(plan, [], {})
    gpu("hopper", triton=True)
    assert pallas.plan(problem, mod, 0.125, options, True).backward_engine == "triton"


def test_a_bucketed_table_folded_learns_on_the_mosaic_backward(gpu):
    """T5's table read through an int bucket array, as attention passes it on
    (lowering.gathered.fold: one read of the gathered table at q_idx - kv_idx):
    on Hopper the Mosaic GPU backward's per-block-diagonal kernel learns it, and
    no gradient is left to the Triton backward."""
    if support.mosaic_missing():
        pytest.skip(f"the Mosaic GPU engine is {support.mosaic_missing()}")
    from scoremod.lowering import gathered

    q = jnp.zeros((1, S, 2, 128), jnp.bfloat16)
    problem, options, pallas = Problem.of(q, q, q), scoremod.LoweringOptions(), pallas_backend.PALLAS
    gpu("hopper", triton=True)
    folded = gathered.fold(scoremod.trace(bucket_table))
    plan = pallas.plan(problem, folded, 0.125, options, True)
    assert plan.engine == plan.backward_engine == "mosaic", plan.describe()
    assert not plan.triton_operands and plan.diagonal_operands == tuple(folded.operand_names)
