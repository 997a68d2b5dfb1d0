"""The catalogue (tests/catalogue) fused on a GPU, forward and backward.

Each attention-gym mod at its GPU shape (bfloat16, head dim 128) runs with
``implementation=None`` (which must choose the fused path) and by name,
``implementation="cudnn"``; O, LSE, dQ, dK and dV match the reference path
within test_fused's tolerances. The plan on this GPU has the catalogue's
verdict, and a mod whose verdict materializes nothing allocates no
[.., Sq, Skv] tensor. A default call on its first-choice backend gives no
scoremod warning, and no call gives JAX's warning that Pallas's Triton
backend is deprecated (an error here).
"""

import math
import warnings

import jax
import numpy as np
import pytest

import scoremod
from scoremod import device
from scoremod import route
from scoremod.lowering.problem import Problem
from tests.catalogue.mods import CATALOGUE
from tests.catalogue.verdict import materialized, planned, spans_scores, verdict
from tests.gpu.test_fused import TOL, _inputs, _rel_err, _run

pytestmark = pytest.mark.gpu

HEAD_DIM = 128
DTYPE = jax.numpy.bfloat16

# cuDNN 9.19 on the H200 proposed no engine for these mods' graphs (run of
# 60396b6): by name (implementation="cudnn") the call is refused when built;
# implementation=None runs them on the Pallas kernels, which claim their
# static block maps.
REFUSED_WHEN_BUILT = {"block_diffusion"}


def _params():
    out = []
    for n, e in CATALOGUE.items():
        if e.needs:
            out.append(pytest.param(n, marks=pytest.mark.xfail(
                strict=True, reason=f"needs {e.needs}: issue 20's ops")))
        else:
            out.append(n)
    return out


def route_of(q, k, v, mod):
    """The Route of the default call (``attention``'s own decision)."""
    return route.route(Problem.of(q, k, v), mod, 1.0 / math.sqrt(q.shape[-1]),
                       scoremod.LoweringOptions())


@pytest.mark.parametrize("name", _params())
def test_catalogue_mod_fused_matches_the_reference(name):
    entry = CATALOGUE[name]
    shape = entry.gpu
    mod = scoremod.trace(entry.build(entry.env(shape)))
    q, k, v, do = _inputs(shape.b, shape.sq, shape.skv, shape.h, shape.h, HEAD_DIM, DTYPE)

    sms = device.current().sm_count
    assert verdict(mod, shape, HEAD_DIM, sms) == entry.verdict
    _, backend, plan = planned(mod, shape, HEAD_DIM, sms)
    if "materialized" not in entry.verdict and plan is not None:
        tensors = materialized(plan)
        assert not any(spans_scores(dims) for dims, _ in tensors), tensors
    assert scoremod.which_implementation(q, k, v, mod).implementation == backend
    # The default call on its first-choice backend is silent: scoremod's warnings
    # are errors unless the route itself says a faster backend here refused it
    # (or cuDNN refuses the graph only when building it).
    first_choice = route_of(q, k, v, mod).warning is None

    want = jax.jit(lambda *a: _run("xla", mod, *a))(q, k, v, do)
    for implementation in (None, backend) + (("cudnn",) if name in REFUSED_WHEN_BUILT else ()):
        if implementation == "cudnn" and name in REFUSED_WHEN_BUILT:
            with pytest.raises(scoremod.UnsupportedOpError, match="no engine"):
                jax.jit(lambda *a: _run(implementation, mod, *a))(q, k, v, do)
            continue
        with warnings.catch_warnings():
            if first_choice:
                warnings.filterwarnings("error", message="scoremod:")
            # No catalogue call runs a Triton kernel (JAX deprecates Pallas's Triton
            # backend from 0.11: the Mosaic GPU engine or cuDNN runs each).
            warnings.filterwarnings("error", message="The Pallas Triton backend is deprecated")
            got = jax.jit(lambda *a: _run(implementation, mod, *a))(q, k, v, do)
        errs = {n: _rel_err(g, w) for n, g, w in zip(("O", "LSE", "dQ", "dK", "dV"), got, want)}
        for what, err in errs.items():
            assert np.isfinite(err) and err < TOL[DTYPE], (
                f"{implementation}: {what} off by {err:.3g} (all: {errs})")


# The catalogue's mods whose captured float arrays are factors of a low-rank
# bias the fused path folds into the head dim: their gradients come back fused.
FACTOR_MODS = ("mla_decoupled_rope",)


def _with_factor_grads(implementation, mod, q, k, v, do):
    """O, LSE, dQ, dK, dV and the gradient of each captured float array."""
    ops = tuple(jax.numpy.asarray(x) for x in mod.operands)

    def f(q, k, v, *ops):
        o, lse = scoremod.attention(q, k, v, scoremod.ScoreMod(mod.expr, ops),
                                    implementation=implementation, return_lse=True)
        return o, jax.lax.stop_gradient(lse)

    (o, lse), vjp = jax.vjp(f, q, k, v, *ops)
    grads = vjp((do, jax.numpy.zeros_like(lse)))
    floats = [i for i, x in enumerate(ops) if x.dtype == jax.numpy.float32]
    return (o, lse, *grads[:3]) + tuple(grads[3 + i] for i in floats)


@pytest.mark.parametrize("name", FACTOR_MODS)
def test_catalogue_low_rank_factor_gradients_match_the_reference(name):
    """MLA's decoupled RoPE (q_rope, k_rope folded into the head dim): the
    gradients of the factors themselves, fused, match the reference path."""
    entry = CATALOGUE[name]
    shape = entry.gpu
    mod = scoremod.trace(entry.build(entry.env(shape)))
    assert any(x.dtype == np.float32 for x in mod.operands)
    q, k, v, do = _inputs(shape.b, shape.sq, shape.skv, shape.h, shape.h, HEAD_DIM, DTYPE)
    assert "head dim" in (scoremod.which_implementation(q, k, v, mod).low_rank_bias or "")
    want = jax.jit(lambda *a: _with_factor_grads("xla", mod, *a))(q, k, v, do)
    for implementation in (None, "cudnn"):
        got = jax.jit(lambda *a: _with_factor_grads(implementation, mod, *a))(q, k, v, do)
        names = ("O", "LSE", "dQ", "dK", "dV") + tuple(
            f"d(operand {i})" for i in range(len(got) - 5))
        assert len(got) == len(want) > 5
        errs = {n: _rel_err(g, w) for n, g, w in zip(names, got, want)}
        for what, err in errs.items():
            assert np.isfinite(err) and err < TOL[DTYPE], (
                f"{implementation}: {what} off by {err:.3g} (all: {errs})")
