"""The Pallas backend's Mosaic GPU engine (forward and backward), on the CPU
(no GPU needed).

The option and its refusals (why_not names the op, the dtype, the head dims
or the device); the plan's choice of backward (Mosaic's, or Triton's where
its kernels cannot run the mod's derivative); the tile rules the engine
evaluates the table's ops with, against the reference evaluator; and the
kernels' lowering for CUDA, which Pallas runs here without a GPU: every op
of the table lowers through the forward kernel, and through the backward
kernels, exactly when the engine does not refuse it, and whole calls (block
maps, tails, grouped heads, captured arrays, jax.vmap) lower through
scoremod.attention to Mosaic GPU kernels only, gradients of captured float
arrays read at one position per program included (those read at an index
that varies over the tile take the Triton backward). The backward kernels
also run here, in Mosaic GPU's interpret mode, against the reference path.
Running the kernels needs a Hopper GPU:
tests/gpu/test_pallas_gpu.py does, against the reference path.
"""

import dataclasses
import functools
import importlib
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from scoremod import device, positions, support
from scoremod.dsl import ir
from scoremod.dsl.evaluate import evaluate
from scoremod.errors import ScoreModError
from scoremod.lowering import block_maps, patterns
from scoremod.lowering.pallas import mosaic, mosaic_backward
from scoremod.lowering.pallas import backend as pallas_backend
from scoremod.lowering.pallas.backend import PALLAS, _map
from scoremod.lowering.problem import Problem
from scoremod.lowering.reference import REFERENCE
from tests import pallas_cases as pc
from tests.pallas_cases import quiet  # noqa: F401 - the autouse fixture
from tests.test_pallas import TABLE_OPS, _examples, triton_gpu_info

MOSAIC = scoremod.LoweringOptions(pallas_engine="mosaic")
TRITON = scoremod.LoweringOptions(pallas_engine="triton")
HOPPER = device.Device("gpu", "NVIDIA H200", 9, 132)


def _problem(d=128, dv=128, dtype="bfloat16", sq=256, skv=256):
    return Problem(b=1, sq=sq, skv=skv, hq=4, hkv=2, d=d, dv=dv, dtype=dtype)


def test_option():
    assert scoremod.LoweringOptions().pallas_engine == "auto"
    assert MOSAIC != scoremod.LoweringOptions() and hash(MOSAIC.replace(pallas_engine="mosaic"))
    with pytest.raises(ScoreModError,
                       match="pallas_engine must be one of 'auto', 'triton', 'mosaic'"):
        scoremod.LoweringOptions(pallas_engine="cuda")
    problem = _problem()
    plans = [PALLAS.plan(problem, None, 0.125, o, True) for o in (MOSAIC, TRITON)]
    assert plans[0].engine == "mosaic" and plans[1].engine == "triton"
    assert plans[0] != plans[1]  # options are part of the plan (and so of every cache key)
    assert plans[0].forward_blocks == (mosaic.TILE_Q, mosaic.BLOCK_KV)
    assert "Mosaic GPU" in plans[0].describe()


def test_refusals(monkeypatch):
    monkeypatch.setattr(device, "current", lambda: HOPPER)
    monkeypatch.setattr(jax, "__version__", "0.11.2")  # the engine's own rules (jax 0.10: CI)
    why = lambda problem, mod=None, options=MOSAIC: PALLAS.why_not(  # noqa: E731
        problem, mod, automatic=False, options=options)
    assert why(_problem()) is None
    assert why(_problem(d=64, dv=64, dtype="float16", sq=1000, skv=333)) is None
    # The dtype, head dims: the Triton engine runs them.
    assert "float16 or bfloat16" in why(_problem(dtype="float32"))
    assert why(_problem(dtype="float32"), options=TRITON) is None
    assert "head dims of 64 or 128" in why(_problem(d=96, dv=96))
    assert "head dims" in why(_problem(d=128, dv=64))
    assert why(_problem(d=128, dv=64), options=TRITON) is None
    # A gather (a read at an index that varies over the tile otherwise) runs, read per
    # score, one at an index computed from the score too (a lookup table).
    q = jnp.zeros((1, 256, 4, 128), jnp.bfloat16)
    mod, _ = pc.traced_vector_mod("grid_bias", q, q)
    assert why(_problem(), mod) is None and why(_problem(), mod, options=TRITON) is None
    table = jnp.ones((4, 64), jnp.float32)  # (not a short axis, which selects pick from)
    by_score = scoremod.trace(
        lambda s, b, h, qi, ki: s + table[h, jnp.clip((s * 8).astype(jnp.int32), 0, 63)])
    assert why(_problem(), by_score) is None
    # Scalar reads run: per head, per batch, and a 0-d array; reads along one tile axis
    # and at q_idx - kv_idx (a relative-position table) too.
    for case in ("alibi", "batch_scale", "learnable_softcap", "document", "document_softcap",
                 "relative_bias"):
        assert why(_problem(), pc.traced(case, q, q)[0]) is None, case
    # Bool flags read along one tile axis: wrong on the H200 on both engines, refused.
    flags = jnp.arange(256) % 7 == 0
    global_window = scoremod.trace(lambda s, b, h, qi, ki: jnp.where(
        (jnp.abs(qi - ki) <= 16) | flags[qi] | flags[ki], s, -jnp.inf))
    for options in (MOSAIC, TRITON):
        assert "the cause is not found yet" in why(_problem(), global_window, options)
    # ... and so did the same flags as ints compared with 0 (on the Mosaic engine): an
    # `or` over a read along one axis is refused; document ids compared and joined by
    # `&` run.
    ints = flags.astype(jnp.int32)
    int_window = scoremod.trace(lambda s, b, h, qi, ki: jnp.where(
        (jnp.abs(qi - ki) <= 16) | (ints[qi] != 0) | (ints[ki] != 0), s, -jnp.inf))
    documents = scoremod.trace(lambda s, b, h, qi, ki: jnp.where(
        (ints[qi] == ints[ki]) & (qi >= ki), s, -jnp.inf))
    for options in (MOSAIC, TRITON):
        assert "an `or` of a condition on one of q_idx or kv_idx alone" in why(
            _problem(), int_window, options)
        assert why(_problem(), documents, options) is None
    # Ops it runs by respelling them: softplus's log1p, floor, expm1, tan, atan, erf,
    # erfc, pow, and float remainders (Mosaic GPU lowers int ones only).
    for fn in (jax.nn.softplus, jnp.floor, jnp.expm1, jnp.tan, jnp.arctan, jax.lax.erf,
               jax.lax.erfc, lambda x: jnp.power(jnp.abs(x) + 0.0625, x),
               lambda x: x % 0.75, lambda x: jnp.fmod(x, x * 0.3 + 2.0), lambda x: x // 1.5):
        assert why(_problem(), scoremod.trace(lambda s, b, h, qi, ki, fn=fn: fn(s))) is None
    imod = scoremod.trace(lambda s, b, h, qi, ki: jnp.where((ki - qi) % 3 == 0, s, -jnp.inf))
    assert why(_problem(), imod) is None
    # What the Triton lowering cannot run (erf) is refused for the Triton engine only:
    # the Mosaic GPU engine runs it, forward and backward.
    erf = scoremod.trace(lambda s, b, h, qi, ki: s + jax.scipy.special.erf(s * 0.5))
    assert "Triton" in why(_problem(), erf, options=TRITON) and why(_problem(), erf) is None


def test_refused_on_old_jax(monkeypatch):
    monkeypatch.setattr(device, "current", lambda: HOPPER)
    monkeypatch.setattr(jax, "__version__", "0.10.2")
    assert "written for jax 0.11 or later, found 0.10.2" in PALLAS.why_not(
        _problem(), None, False, MOSAIC)


def test_refused_off_hopper(monkeypatch):
    """Off a Hopper GPU (here: the CPU) the engine refuses by name (its interpret
    mode is for tests)."""
    monkeypatch.setattr(jax, "__version__", "0.11.2")  # past the version check (jax 0.10: CI)
    if device.current().family == 9:
        pytest.skip("runs on a Hopper GPU here")
    assert "needs a Hopper GPU" in PALLAS.why_not(_problem(), None, False, MOSAIC)
    q = jnp.ones((1, 128, 2, 64), jnp.bfloat16)
    with pytest.raises(ScoreModError, match="needs a Hopper GPU"):
        scoremod.attention(q, q, q, implementation="pallas", options=MOSAIC)
    with scoremod.lowering_options(pallas_engine="mosaic"), pytest.raises(
            ScoreModError, match="needs a Hopper GPU"):
        scoremod.attention(q, q, q, implementation="pallas")


@pytest.mark.parametrize("name", TABLE_OPS)
def test_tile_rules(name):
    """The ops the engine evaluates by its own rules (``mosaic.TILE_RULES``:
    int remainders, a division by a constant, bool casts) give the reference
    evaluator's values on a tile."""
    rng = np.random.default_rng(1)
    s = jnp.asarray(rng.normal(size=(8, 16)) * 3, jnp.float32)
    index = {"b": jnp.int32(1), "h": jnp.int32(0),
             "q_idx": jnp.broadcast_to(5 + jnp.arange(8, dtype=jnp.int32)[:, None], (8, 16)),
             "kv_idx": jnp.broadcast_to(3 + jnp.arange(16, dtype=jnp.int32)[None, :], (8, 16))}
    from scoremod.lowering.pallas import codegen

    for expr in _examples(name):
        if mosaic.refusal(expr, {}):
            continue
        (got,) = codegen.evaluate_tile([expr], dict(index, score=s), {}, rules=mosaic.TILE_RULES)
        want = evaluate(expr, dict(index, score=s), {})
        # A division by a constant is a multiply here (within an ulp of the quotient;
        # XLA on the CPU did the same up to jax 0.12.0): 1 / (s / 7 + 0.5) near its
        # pole magnifies that ulp to 2e-6 of the result.
        np.testing.assert_allclose(np.broadcast_to(got, s.shape), np.broadcast_to(want, s.shape),
                                   rtol=1e-5, atol=1e-6)


def test_respelled_float_ops():
    """floor and ceil respelled through an int32 conversion are exact (signed zeros,
    halves, the int32 edge, 2**23 and past it, inf, NaN); log1p and expm1 stay
    within 3e-7 of float64's (their series near 0: log1p(1e-30) is 1e-30), tan
    within 2e-7 away from its poles, atan within 2.5e-7 (its reductions' edges,
    signed zeros, infinities), erf and erfc within 5e-7 (the series' edge at 0.75,
    erfc's tail down to 1e-37, past which float32 holds no normal value)."""
    rng = np.random.default_rng(3)
    edges = [0.0, -0.0, 0.5, -0.5, 1.5, -1.5, 1e-30, -1e-30, 8388607.5, -8388607.5,
             0.75, -0.75, 0.74999994, 9.3, -9.3, 26.0,
             0.41421354, 0.41421357, 2.4142134, 2.4142137, 1.0, -1.0,
             8388608.0, -8388609.0, 2.0 ** 31, -(2.0 ** 31) - 256, 3e38, np.inf, -np.inf, np.nan]
    x = np.concatenate([np.asarray(edges, np.float32),
                        rng.normal(size=4000).astype(np.float32) * 100,
                        rng.uniform(-0.6, 0.6, 4000).astype(np.float32)])
    for rule, want in ((mosaic._floor, np.floor), (mosaic._ceil, np.ceil)):
        got = np.asarray(rule(jnp.asarray(x)))
        np.testing.assert_array_equal(got, want(x))
        assert (np.signbit(got) == np.signbit(want(x)))[~np.isnan(x)].all()
    small = np.asarray([1e-30, -1e-30, 1e-8, -1e-8], np.float32)
    np.testing.assert_array_equal(np.asarray(mosaic._log1p(jnp.asarray(small))), small)
    np.testing.assert_array_equal(np.asarray(mosaic._expm1(jnp.asarray(small))), small)
    with np.errstate(all="ignore"):
        for rule, want, tol in ((mosaic._log1p, np.log1p, 3e-7), (mosaic._expm1, np.expm1, 3e-7),
                                (mosaic.TILE_RULES["tan"], np.tan, 2e-7),
                                (mosaic._atan, np.arctan, 2.5e-7),
                                (mosaic._erf, np.vectorize(math.erf), 5e-7),
                                (mosaic._erfc, np.vectorize(math.erfc), 5e-7)):
            got = np.asarray(rule(jnp.asarray(x)), np.float64)
            exact = want(x.astype(np.float64))
            np.testing.assert_array_equal(np.isnan(got), np.isnan(exact.astype(np.float32)))
            finite = np.isfinite(exact) & (np.abs(exact) < 1e6)  # tan: not at its poles
            # erfc's tail below float32's normals (1.2e-38) is what float32 holds
            np.testing.assert_allclose(got[finite], exact[finite], rtol=tol, atol=1e-37)


def test_respelled_pow():
    """pow as exp2(b * log2|a|) gives lax.pow's special values on a grid of signed
    zeros, ones, halves, whole and odd numbers, infinities, NaN and numbers past
    2**24 (every pair: signs, NaN, 1 for b == 0 and a == 1, NaN for a negative base
    and a fraction), and within 1.2e-5 of float64's elsewhere (a in [0, 50], b in
    [-20, 20])."""
    edges = np.float32([0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 3.0, -3.0, 1.5, -1.5,
                        np.inf, -np.inf, np.nan, 1e-30, 1e30, 7.25, -7.25, 2.0 ** 25,
                        -(2.0 ** 25), 0.1])
    a, b = (jnp.asarray(x) for x in np.meshgrid(edges, edges, indexing="ij"))
    got, want = np.asarray(mosaic._pow(a, b)), np.asarray(jax.lax.pow(a, b))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.signbit(got)[~np.isnan(want)],
                                  np.signbit(want)[~np.isnan(want)])
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=0)
    rng = np.random.default_rng(5)
    a = rng.uniform(0, 50, 20000).astype(np.float32)
    b = rng.uniform(-20, 20, 20000).astype(np.float32)
    got = np.asarray(mosaic._pow(jnp.asarray(a), jnp.asarray(b)), np.float64)
    exact = np.power(a.astype(np.float64), b.astype(np.float64))
    normal = (exact > 1.2e-38) & (exact < 3.4e38)  # float32's normal range
    np.testing.assert_allclose(got[normal], exact[normal], rtol=1.2e-5, atol=0)


def test_int_remainders_negative():
    """mod and floordiv round toward -inf (jnp's), rem toward 0, for every sign."""
    a = jnp.arange(-7, 8, dtype=jnp.int32)[:, None]
    b = jnp.asarray([-3, -2, 2, 3], jnp.int32)[None, :]
    np.testing.assert_array_equal(mosaic._mod(a, b), jnp.remainder(a, b))
    np.testing.assert_array_equal(mosaic._floordiv(a, b), jnp.floor_divide(a, b))
    np.testing.assert_array_equal(mosaic._rem(a, b), jax.lax.rem(*jnp.broadcast_arrays(a, b)))


def test_float_remainder_is_exact():
    """The float remainder spelled in int32 gives C fmod's bits (numpy's, which
    keeps subnormals) on random float32 bit patterns (every exponent gap, subnormals,
    infinities, NaNs), on scores by the divisors mods use, and on a grid of signed
    zeros, the largest and smallest floats, 2**24 and infinities; jnp.remainder's and
    jnp.floor_divide's from it, where no subnormal takes part (XLA on the CPU flushes
    them in its own formula, the GPU does not)."""
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2 ** 32, size=(2, 200_000), dtype=np.uint64).astype(np.uint32)
    a, b = bits.view(np.int32).view(np.float32)
    scores = (rng.normal(size=100_000) * 20).astype(np.float32)
    divisors = rng.choice(np.float32([0.75, -0.75, 1.0, 3.0, 0.1, 1e-3, 7.5, -2.0, 1e-40]),
                          scores.size)
    edges = np.float32([0.0, -0.0, 1.0, -1.0, 0.75, -1.5, 3.0, 2.0 ** 24, 2.0 ** 24 + 2, 1e-45,
                        -1e-45, 1.1754944e-38, 3.4028235e38, -3.4028235e38, np.inf, -np.inf,
                        np.nan])
    grid = [x.ravel() for x in np.meshgrid(edges, edges, indexing="ij")]
    for x, y in ((a, b), (scores, divisors), (divisors, scores), (scores * 1e30, divisors),
                 tuple(grid)):
        with np.errstate(all="ignore"):
            fmod = np.fmod(x, y)
        assert pc.same_bits(jax.jit(mosaic._rem)(x, y), fmod).all()
        kept = pc.not_subnormal(x) & pc.not_subnormal(y) & pc.not_subnormal(fmod)
        for rule, want in ((mosaic._mod, jnp.remainder), (mosaic._floordiv, jnp.floor_divide)):
            same = pc.same_bits(jax.jit(rule)(x, y), jax.jit(want)(x, y))
            assert same[kept].all(), rule.__name__


def test_float_remainders_lower_on_a_tile(lowers):
    """The float remainders lower for CUDA on a tile in the accumulator's layout (the
    GPU suite checks their bits there: ``test_mosaic_float_remainders_are_exact``)."""
    tile = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    for rule in (mosaic._rem, mosaic._mod, mosaic._floordiv):
        jax.jit(functools.partial(pc.tile_rule, rule)).trace(tile, tile).lower(
            lowering_platforms=("cuda",))


def test_block_map_tiles():
    """The engine visits the plan's map at its own tiles: causal skips the upper triangle."""
    q = jnp.zeros((1, 1000, 4, 128), jnp.bfloat16)
    mod, _ = pc.traced("causal", q, q)
    plan = PALLAS.plan(Problem.of(q, q, q), mod, 0.125, MOSAIC, True)
    bmap = _map(plan, plan.forward_blocks, ())
    n = block_maps.num_blocks(1000, mosaic.TILE_Q)
    assert bmap.q_counts.shape[-1] == n and mosaic.TILE_Q == mosaic.BLOCK_KV
    assert np.asarray(bmap.q_counts).ravel().tolist() == list(range(1, n + 1))


# --------------------------------------------------------------------------- #
# lowering for CUDA, here


def _lower_forward(expr, q, k, operands=()):
    sq, skv, groups = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    names = tuple(n.attr[0] for n in ir.operands_of(expr)) if expr is not None else ()
    spec = mosaic.MosaicSpec(expr, names, 0.125, sq, skv, groups)
    bmap = block_maps.dense_block_map(sq=sq, skv=skv, block_q=mosaic.TILE_Q,
                                      block_kv=mosaic.BLOCK_KV)
    fn = lambda q, k, v, ops: mosaic.forward(spec, bmap, q, k, v, ops)  # noqa: E731
    return jax.jit(fn).trace(q, k, k, operands).lower(lowering_platforms=("cuda",))


@pytest.fixture(scope="module")
def lowers():
    """Skips where this jax cannot lower Mosaic GPU kernels without a GPU, or has
    another Mosaic GPU API than the kernel's."""
    if support.mosaic_missing():
        pytest.skip(f"the Mosaic GPU engine is {support.mosaic_missing()}")
    try:
        importlib.import_module("jax.experimental.pallas.mosaic_gpu")

        q = jax.ShapeDtypeStruct((1, 128, 1, 64), jnp.bfloat16)
        _lower_forward(None, q, q)
    except Exception as e:  # noqa: BLE001 - a jax without it (0.10) or without the lowering
        pytest.skip(f"this jax cannot lower Mosaic GPU kernels here: {type(e).__name__}: {e}")


@pytest.mark.parametrize("name", TABLE_OPS)
def test_op_table_lowers_to_mosaic(name, lowers):
    """Every op's examples lower through the kernel exactly when the engine
    does not refuse them (so the refusal table is neither short nor long)."""
    q = jax.ShapeDtypeStruct((1, 128, 1, 64), jnp.bfloat16)
    for expr in _examples(name):
        refused = mosaic.refusal(expr, {})
        try:
            _lower_forward(expr, q, q)
            lowered = None
        except Exception as e:  # noqa: BLE001
            lowered = e
        assert (lowered is not None) == (refused is not None), (expr, refused, lowered)


@pytest.fixture
def hopper_here(monkeypatch, lowers):
    """The backend believes it is on a Hopper GPU (Triton's lowering too), so whole
    calls lower for CUDA on this machine."""
    monkeypatch.setattr(triton_gpu_info(), "get_gpu_info",
                        lambda *a, **k: SimpleNamespace(compute_capability=90))
    monkeypatch.setattr(device, "current", lambda: HOPPER)


def _lower_call(loss, *args):
    return jax.jit(loss).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("case,shape", [
    ("softcap", dict(sq=256, skv=256, hq=4, hkv=2, d=128)),
    ("causal", dict(sq=1000, skv=1000, hq=4, hkv=1, d=128)),
    ("alibi", dict(sq=300, skv=260, hq=4, hkv=2, d=64)),
    ("batch_scale", dict(sq=256, skv=384, hq=2, hkv=2, d=64)),
    ("learnable_softcap", dict(sq=128, skv=128, hq=2, hkv=1, d=128)),
    ("head_bias", dict(sq=192, skv=320, hq=4, hkv=1, d=128)),
    ("masked_rows", dict(sq=256, skv=256, hq=2, hkv=1, d=128)),
    ("softcap_causal", dict(sq=300, skv=260, hq=4, hkv=2, d=64, dtype=jnp.bfloat16)),
    ("sliding_window", dict(sq=200, skv=333, hq=2, hkv=2, d=128, dtype=jnp.float16)),
    ("document", dict(sq=256, skv=256, hq=2, hkv=1, d=64)),
    ("document_softcap", dict(sq=300, skv=260, hq=4, hkv=2, d=128)),
])
def test_calls_lower(case, shape, hopper_here):
    """scoremod.attention by name, jitted, forward and gradients of q, k, v lowers
    to three Mosaic GPU kernels (the forward, dQ, dK/dV) and no Triton one; with the
    gradients of the captured float arrays too (read at b, h and constants: the
    dK/dV kernel sums them), to the same three."""
    shape = dict(shape)
    dtype = shape.pop("dtype", jnp.float16 if shape["d"] == 64 else jnp.bfloat16)
    q, k, v, do = pc.inputs(b=2, dtype=dtype, **shape)
    fn, operands = pc.CASES[case](shape["hq"], shape["sq"], shape["skv"])
    floats = tuple(x for x in operands if jnp.issubdtype(x.dtype, jnp.floating))

    def loss(q, k, v, floats):
        given = iter(floats)  # the float arrays as arguments, the int ones captured
        ops = [next(given) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in operands]
        mod = lambda s, b, h, qi, ki: fn(s, b, h, qi, ki, *ops)  # noqa: E731
        o = scoremod.attention(q, k, v, mod, implementation="pallas", options=MOSAIC)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

    text = _lower_call(jax.grad(loss, argnums=(0, 1, 2)), q, k, v, floats)
    assert _kernels(text) == {"mosaic": 3, "triton": 0}
    # No kernel reads flags of one value (XLA would broadcast them in a kernel per call).
    assert not re.findall(r"stablehlo.constant dense<-?\d+> : tensor<(?:\d+x){4}i32>", text)
    if floats:
        assert _kernels(_lower_call(jax.grad(loss, argnums=(0, 1, 2, 3)), q, k, v, floats)) == \
            {"mosaic": 3, "triton": 0}


def _kernels(text):
    """Kernel calls in a lowered program, by engine."""
    calls = re.findall(r"custom_call @([\w$.]+)", text)
    return {"mosaic": sum(c.startswith("mosaic_gpu") for c in calls),
            "triton": sum("triton" in c for c in calls)}


def _lower_backward(expr, q, k, operands=(), full_expr=None, lengths=None):
    """dQ and dK/dV kernels of ``expr`` on the dense map, lowered for CUDA;
    ``lengths``: the real (sq, skv) inside the padded arrays."""
    sq, skv, groups = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    names = tuple(n.attr[0] for n in ir.operands_of(expr)) if expr is not None else ()
    real = (sq, skv) if lengths is None else lengths
    spec = mosaic_backward.BackwardSpec(expr, names, 0.125, *real, groups, full_expr)
    rows = jax.ShapeDtypeStruct((q.shape[0], q.shape[2], sq), jnp.float32)
    kernels = [mosaic_backward.dq, mosaic_backward.dkdv,  # and dK/dV with dQ (reduce-adds)
               functools.partial(mosaic_backward.dkdv, with_dq=True)]
    for kernel in kernels:
        bq, bk = (mosaic_backward.DQ_BLOCKS if kernel is mosaic_backward.dq
                  else mosaic_backward.DKDV_BLOCKS)
        bmap = block_maps.dense_block_map(sq=sq, skv=skv, block_q=bq, block_kv=bk)
        fn = lambda q, k, v, do, lse2, delta, ops, kernel=kernel, bmap=bmap: kernel(  # noqa: E731
            spec, bmap, q, k, v, do, lse2, delta, ops)
        jax.jit(fn).trace(q, k, k, q, rows, rows, operands).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("name", TABLE_OPS)
def test_op_table_lowers_through_backward(name, lowers):
    """Every op's examples lower through both backward kernels (the mod and its
    derivative on the tile) exactly when the backward does not refuse them."""
    q = jax.ShapeDtypeStruct((1, 128, 1, 64), jnp.bfloat16)
    for expr in _examples(name):
        refused = mosaic_backward.refusal(expr, {})
        try:
            _lower_backward(expr, q, q)
            lowered = None
        except Exception as e:  # noqa: BLE001
            lowered = e
        assert (lowered is not None) == (refused is not None), (expr, refused, lowered)


@pytest.mark.parametrize("d,dtype,groups", [(64, jnp.float16, 1), (128, jnp.bfloat16, 2),
                                           (128, jnp.bfloat16, 1)])
def test_backward_kernels_lower(d, dtype, groups, lowers):
    """Both kernels on their own: plain attention, a mask with its full-tile
    variant, tails on both sides (96 x 160 rows in 128 x 256 padded arrays) and
    grouped heads (float32 dK/dV per query head)."""
    causal = scoremod.trace(lambda s, b, h, qi, ki: jnp.where(qi >= ki, 20.0 * jnp.tanh(s / 20.0),
                                                                -jnp.inf))
    full = patterns.when_full(causal.expr)
    assert full is not causal.expr
    for expr, full_expr in ((None, None), (causal.expr, full)):
        q = jax.ShapeDtypeStruct((1, 128, 2 * groups, d), dtype)
        k = jax.ShapeDtypeStruct((1, 256, 2, d), dtype)
        _lower_backward(expr, q, k, full_expr=full_expr, lengths=(96, 160))


def test_backward_plan(monkeypatch):
    """The plan takes the Mosaic GPU backward with the Mosaic engine (padding to its
    own 128-row programs), the Triton one with the Triton engine (the options' tiles) and
    where the Mosaic kernels cannot evaluate the mod's derivative (saying why)."""
    problem = _problem()
    softcap = scoremod.trace(lambda s, b, h, qi, ki: 30.0 * jnp.tanh(s / 30.0))
    for mod in (None, softcap):
        plan = PALLAS.plan(problem, mod, 0.125, MOSAIC, True)
        assert plan.backward_engine == "mosaic" and plan.backward_note is None
        assert plan.backward_blocks == (mosaic_backward.TILE, mosaic_backward.TILE)
        assert "Mosaic GPU forward and backward" in plan.describe()
        # dQ in the dK/dV kernel (FUSE_DQ), unless asked to repeat bitwise: its adds
        # come in any order.
        assert not plan.fused_dq
        monkeypatch.setattr(mosaic_backward, "FUSE_DQ", True)
        for hkv in (problem.hkv, problem.hq):
            assert PALLAS.plan(dataclasses.replace(problem, hkv=hkv), mod, 0.125, MOSAIC,
                               True).fused_dq
        strict = dataclasses.replace(MOSAIC, deterministic=True)
        assert not PALLAS.plan(problem, mod, 0.125, strict, True).fused_dq
        monkeypatch.setattr(mosaic_backward, "FUSE_DQ", False)
        plain = PALLAS.plan(problem, mod, 0.125, TRITON, True)
        options = TRITON
        assert plain.backward_engine == "triton" and "Mosaic" not in plain.describe()
        assert plain.backward_blocks == (options.pallas_backward_block_q,
                                         options.pallas_backward_block_kv)
    # sin's derivative is cos: with cos unlowerable, the forward runs and the backward is Triton's.
    monkeypatch.setitem(mosaic.NOT_LOWERABLE, "cos", "no rule for cos (a test's)")
    mosaic_backward.local_derivative.cache_clear()
    sine = scoremod.trace(lambda s, b, h, qi, ki: jnp.sin(s))
    assert mosaic.refusal(sine.expr, sine.sources) is None
    plan = PALLAS.plan(problem, sine, 0.125, MOSAIC, True)
    assert plan.engine == "mosaic" and plan.backward_engine == "triton"
    assert "derivative" in plan.backward_note and "`cos`" in plan.backward_note
    assert "Triton backward" in plan.describe() and "`cos`" in plan.describe()


def test_local_derivative():
    """The derivative at dP = 1, times dP, is the symbolic derivative (it is linear in dP)."""
    rng = np.random.default_rng(4)
    s = jnp.asarray(rng.normal(size=(8, 16)) * 3, jnp.float32)
    dp = jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)
    index = {"b": jnp.int32(0), "h": jnp.int32(1),
             "q_idx": jnp.arange(8, dtype=jnp.int32)[:, None],
             "kv_idx": jnp.arange(16, dtype=jnp.int32)[None, :]}
    from scoremod.lowering.pallas import codegen

    for case in ("softcap", "softcap_causal", "alibi", "masked_rows"):
        mod, operands = pc.traced(case, jnp.zeros((1, 8, 4, 64)), jnp.zeros((1, 16, 4, 64)))
        values = dict(zip(mod.operand_names, operands))
        want = evaluate(codegen.derivatives(mod.expr).score, dict(index, score=s, dP=dp), values)
        local = mosaic_backward.local_derivative(mod.expr)
        got = dp if local is None else dp * evaluate(local, dict(index, score=s), values)
        np.testing.assert_allclose(np.broadcast_to(got, s.shape), np.broadcast_to(want, s.shape),
                                   rtol=1e-6, atol=1e-6, err_msg=case)
    plain = scoremod.trace(lambda s, b, h, qi, ki: s + 1.0)
    assert mosaic_backward.local_derivative(plain.expr) is None


def test_integer_pow_rule():
    """x ** n for every n the IR makes (a derivative's n - 1 goes negative), as lax's."""
    x = jnp.asarray(np.linspace(0.25, 3.0, 12), jnp.float32)
    for n in (-3, -2, -1, 0, 1, 2, 3):
        np.testing.assert_allclose(mosaic._integer_pow(x, n), jax.lax.integer_pow(x, n),
                                   rtol=1e-6, err_msg=str(n))


@pytest.fixture
def interprets(lowers):
    """Skips where this jax has no Mosaic GPU interpret mode (a CPU simulation)."""
    plgpu = importlib.import_module("jax.experimental.pallas.mosaic_gpu")
    if not hasattr(plgpu, "InterpretGPUParams"):
        pytest.skip("this jax has no Mosaic GPU interpret mode")


@pytest.mark.parametrize("case,shape", [
    (None, dict(sq=128, skv=128, hq=1, hkv=1, d=64)),
    ("softcap", dict(sq=128, skv=192, hq=2, hkv=1, d=128)),
    ("causal", dict(sq=300, skv=260, hq=4, hkv=2, d=64)),
    ("softcap_causal", dict(sq=200, skv=136, hq=2, hkv=1, d=128, dtype=jnp.float16)),
    ("alibi", dict(sq=130, skv=190, hq=4, hkv=2, d=64)),
    ("masked_rows", dict(sq=150, skv=150, hq=2, hkv=2, d=64, dtype=jnp.float16)),
    ("learnable_softcap", dict(sq=100, skv=70, hq=2, hkv=1, d=128)),
    ("batch_scale", dict(sq=64, skv=128, hq=2, hkv=1, d=64)),
    ("inf_past_the_end", dict(sq=80, skv=100, hq=1, hkv=1, d=64)),
    ("nan_at_score_zero", dict(sq=12, skv=100, hq=2, hkv=1, d=64)),
    # lengths of whole 64-row tiles in arrays padded to 128: one compute
    # warpgroup's rows (the queries') or keys all padding
    ("inf_past_the_end", dict(sq=192, skv=320, hq=2, hkv=1, d=64)),
    ("nan_at_score_zero", dict(sq=320, skv=192, hq=2, hkv=1, d=64)),
    # one key head per query head at d128 (dQ by column halves; softcap's tanh: turns)
    ("softcap_causal", dict(sq=256, skv=200, hq=2, hkv=2, d=128)),
    ("alibi", dict(sq=130, skv=190, hq=2, hkv=2, d=128, dtype=jnp.float16)),
])
def test_backward_interpreted(case, shape, interprets, monkeypatch):
    """The Mosaic backward kernels run in Mosaic GPU's interpret mode (the plan's
    interpret flag, off a GPU): dQ, dK and dV through the backend's backward
    (padding, LSE in log2 units, grouped heads summed) against the reference
    path's gradients, with an LSE cotangent too; the map skips masked tiles and
    marks full ones. On the GPU the kernels accumulate in place and take left
    operands from registers, which the interpreter cannot simulate (staged
    through fresh accumulators and shared memory here); everything else
    (the warpgroups, barriers, copies, slots, the mod and its derivative on
    transposed tiles, tails) runs as on the GPU. Scores have a standard
    deviation near 3 (scale 0.4 at d64, 0.3 at d128: a softcap's tanh bends);
    ``inf_past_the_end`` is +inf on keys and queries past the last (the
    padding's: the kernels mask them, else P is inf or NaN there and the
    gradients NaN); ``nan_at_score_zero`` is NaN at the padding's score 0, value and derivative
    (the kernels give the padding no gradient, else 0 * inf is NaN)."""
    monkeypatch.setattr(mosaic_backward, "FUSE_DQ", True)
    shape = dict(shape)
    dtype = shape.pop("dtype", jnp.bfloat16)
    q, k, v, do = pc.inputs(b=2 if case == "batch_scale" else 1, dtype=dtype, **shape)
    scale = 0.4 if shape["d"] == 64 else 0.3
    if case is None:
        mod, operands = None, ()
        plan = PALLAS.plan(Problem.of(q, k, v), None, scale, MOSAIC, True)
    else:
        if case == "inf_past_the_end":
            last_q, last_k = shape["sq"] - 1, shape["skv"] - 1
            mod = scoremod.trace(lambda s, b, h, qi, ki: jnp.where(
                (ki > last_k) | (qi > last_q), jnp.inf, s))
            operands = ()
        else:
            mod, operands = pc.traced(case, q, k)
        plan = pc.pallas_plan(mod, q, k, v, MOSAIC, skip=case != "inf_past_the_end", scale=scale)
    assert plan.interpret and plan.backward_engine == "mosaic", plan.describe()
    assert plan.fused_dq
    ref = REFERENCE.plan(Problem.of(q, k, v), mod, plan.scale, MOSAIC, True)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    want = pc.run(REFERENCE, ref, f32(q), f32(k), f32(v), f32(do), operands, False)
    o, lse = want[0], want[1]
    dlse = jnp.where(jnp.isfinite(lse), 0.1, 0.0)  # the loss's 0.1 * sum(finite LSE)
    dq, dk, dv, _ = pallas_backend._backward(plan, q, k, v, o.astype(dtype), lse, do, dlse,
                                             operands, ())
    errs = pc.relative_errors((o, lse, dq, dk, dv, ()), want)
    assert all(e < 3e-2 for e in errs.values()), errs
    assert dq.dtype == q.dtype and dk.shape == k.shape and dv.shape == v.shape


def _learned_backward(case, shape, runs=1):
    """The backend's backward in interpret mode with the float operands' gradients
    asked for (``runs`` times), and the reference path's results."""
    shape = dict(shape)
    dtype = shape.pop("dtype", jnp.bfloat16)
    q, k, v, do = pc.inputs(b=2, dtype=dtype, **shape)
    mod, operands = pc.traced(case, q, k)
    plan = pc.pallas_plan(mod, q, k, v, MOSAIC, skip=True, scale=0.3)
    assert plan.interpret and plan.backward_engine == "mosaic", plan.describe()
    assert plan.triton_operands == () and "gradients of captured arrays included" in \
        plan.describe()
    ref = REFERENCE.plan(Problem.of(q, k, v), mod, plan.scale, MOSAIC, True)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    want = pc.run(REFERENCE, ref, f32(q), f32(k), f32(v), f32(do), operands, True)
    o, lse = want[0], want[1]
    dlse = jnp.where(jnp.isfinite(lse), 0.1, 0.0)  # the loss's 0.1 * sum(finite LSE)
    names = tuple(n for n, x in zip(mod.operand_names, operands)
                  if jnp.issubdtype(x.dtype, jnp.floating))
    assert names
    got = [pallas_backend._backward(plan, q, k, v, o.astype(dtype), lse, do, dlse, operands,
                                    names) for _ in range(runs)]
    return mod, got, want


@pytest.mark.parametrize("case,shape", [
    ("alibi", dict(sq=300, skv=260, hq=4, hkv=2, d=64)),
    # whole tiles of 64 in arrays padded to 128: a compute warpgroup's keys (and
    # queries) all padding, which must add nothing to the slopes' sums
    ("alibi", dict(sq=192, skv=192, hq=4, hkv=2, d=64)),
    ("learnable_softcap", dict(sq=100, skv=70, hq=2, hkv=1, d=128, dtype=jnp.float16)),
    ("head_bias", dict(sq=130, skv=190, hq=4, hkv=1, d=64)),
    ("batch_scale", dict(sq=64, skv=128, hq=2, hkv=1, d=64)),
    ("nan_past_the_end", dict(sq=40, skv=100, hq=2, hkv=1, d=64)),
    ("nan_past_the_end", dict(sq=192, skv=320, hq=2, hkv=1, d=64)),
])
def test_backward_learns_operands_interpreted(case, shape, interprets, monkeypatch):
    """Gradients of captured float arrays read at one position per program
    (ALiBi's slopes[h] under a causal mask, a learned softcap's scalar, two
    columns of a per-head row, a per-batch factor) from the Mosaic dK/dV kernel
    in interpret mode, through the backend (its partial rows and their sum),
    against the reference path: grouped heads, tails on both sides, the map
    skipping masked tiles and marking full ones (alibi's full tiles run the mod
    without its mask and read the slopes there too); dQ in that kernel too."""
    monkeypatch.setattr(mosaic_backward, "FUSE_DQ", True)
    mod, (got,), want = _learned_backward(case, shape)
    dq, dk, dv, grads = got
    op_grads = tuple(grads.get(name) for name in mod.operand_names)
    errs = pc.relative_errors((want[0], want[1], dq, dk, dv, op_grads), want)
    assert set(errs) >= {"d_operand0"} and all(e < 3e-2 for e in errs.values()), errs
    for name, g, x in zip(mod.operand_names, op_grads, want[5]):
        assert g.shape == x.shape and g.dtype == x.dtype, name
    if case == "head_bias":  # column 1 is never read: exactly 0
        assert np.all(np.asarray(op_grads[0])[:, 1] == 0.0)


def test_backward_learned_operands_deterministic(interprets):
    """Two runs of the backward with the slopes' gradient give the same bits."""
    _, runs, _ = _learned_backward("alibi", dict(sq=130, skv=190, hq=4, hkv=2, d=64), runs=2)
    for a, b in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(runs[1])):
        assert np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)


def _learns_interpreted_twice(case, shape, check_plan):
    """``case`` (pc.vector_mod's, its last float operand learned) through the backend's
    Mosaic backward in interpret mode, twice: ``check_plan(plan, learned name)``,
    O, LSE, dQ, dK, dV and the learned array's gradient against the reference
    path, and the same bits on the second run."""
    shape = dict(shape)
    dtype = shape.pop("dtype", jnp.bfloat16)
    q, k, v, do = pc.inputs(b=2, dtype=dtype, **shape)
    mod, operands = pc.traced_vector_mod(case, q, k)
    plan = pc.pallas_plan(mod, q, k, v, MOSAIC, skip=True, scale=0.3)
    learned = [n for n, x in zip(mod.operand_names, operands)
               if jnp.issubdtype(x.dtype, jnp.floating)][-1]
    check_plan(plan, learned)
    ref = REFERENCE.plan(Problem.of(q, k, v), mod, plan.scale, MOSAIC, True)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    want = pc.run(REFERENCE, ref, f32(q), f32(k), f32(v), f32(do), operands, True)
    o, lse = want[0], want[1]
    dlse = jnp.where(jnp.isfinite(lse), 0.1, 0.0)
    runs = [pallas_backend._backward(plan, q, k, v, o.astype(dtype), lse, do, dlse, operands,
                                     (learned,)) for _ in range(2)]
    dq, dk, dv, grads = runs[0]
    op_grads = tuple(grads.get(name) for name in mod.operand_names)
    errs = pc.relative_errors((o, lse, dq, dk, dv, op_grads), want)
    at = mod.operand_names.index(learned)
    assert f"d_operand{at}" in errs and all(e < 3e-2 for e in errs.values()), errs
    assert grads[learned].shape == operands[at].shape
    for a, b in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(runs[1])):
        assert np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)


@pytest.mark.parametrize("case,shape", [
    ("relative_causal", dict(sq=130, skv=190, hq=2, hkv=1, d=64)),
    ("relative_softcap", dict(sq=100, skv=70, hq=2, hkv=2, d=64, dtype=jnp.float16)),
    ("relative_masked", dict(sq=200, skv=136, hq=2, hkv=1, d=64)),
    ("relative_document", dict(sq=200, skv=200, hq=2, hkv=1, d=64)),
])
def test_backward_learns_relative_tables_interpreted(case, shape, interprets):
    """A table read at q_idx - kv_idx (causal, jax.numpy's wrapped index under a
    softcap, -inf runs the map skips, beside document ids: both sides' slices of
    the ids stream with each tile), learned: its gradient from the
    per-block-diagonal kernel (mosaic_backward.diagonal_sums) in interpret mode,
    every diagonal's two shares added and placed at the entry it reads, against
    the reference path; no Triton kernel; twice the same bits."""
    def per_diagonal(plan, learned):
        assert plan.diagonal_operands == (learned,) and plan.triton_operands == ()

    _learns_interpreted_twice(case, shape, per_diagonal)


@pytest.mark.parametrize("case,shape", [
    ("block_bias64", dict(sq=200, skv=150, hq=2, hkv=1, d=64)),
    ("block_map_bias", dict(sq=256, skv=320, hq=2, hkv=1, d=64, dtype=jnp.float16)),
    ("block_bias", dict(sq=200, skv=150, hq=2, hkv=1, d=64)),
])
def test_backward_learns_block_reads_interpreted(case, shape, interprets):
    """Arrays read at whole blocks of positions (a bias per 64 queries by 32 keys
    under a causal mask; a bias per batch, head and 128 x 128 block beside a tile map
    the block map follows; a bias per 48 queries by 32 keys, read with `>>`: a step's
    64 queries meet two or three block rows), learned: the Mosaic dK/dV kernel's
    per-step sums over each block row in interpret mode, the steps the map skips
    dropped, each block's keys summed and placed at the entry it reads, against the
    reference path; no Triton kernel; twice the same bits."""
    def on_mosaic(plan, learned):
        assert plan.backward_engine == "mosaic" and plan.triton_operands == (), plan.describe()

    _learns_interpreted_twice(case, shape, on_mosaic)


@pytest.mark.parametrize("case,shape", [
    ("pair_bias", dict(sq=150, skv=200, hq=4, hkv=2, d=64)),
    ("head_bias_causal", dict(sq=300, skv=260, hq=2, hkv=1, d=64)),
    ("wider_bias", dict(sq=130, skv=190, hq=4, hkv=2, d=128, dtype=jnp.float16)),
    ("capped_bias", dict(sq=100, skv=70, hq=2, hkv=2, d=64)),
    ("half_bias", dict(sq=130, skv=100, hq=2, hkv=1, d=64)),
    ("masked_bias", dict(sq=300, skv=260, hq=2, hkv=1, d=64)),
    ("transposed_bias", dict(sq=200, skv=260, hq=2, hkv=1, d=64)),
    ("pair_features", dict(sq=150, skv=130, hq=4, hkv=2, d=64)),
    ("edge_types", dict(sq=130, skv=200, hq=2, hkv=1, d=64)),
    ("query_pairs_bias", dict(sq=200, skv=150, hq=2, hkv=1, d=64)),
    ("key_pairs_bias", dict(sq=130, skv=190, hq=2, hkv=2, d=64)),
])
def test_backward_learns_dense_reads_interpreted(case, shape, interprets):
    """A float array read per score (``bias[b, h, q_idx, kv_idx]``; one per head
    shared by the batch, causal; one longer than the sequences, per head pair;
    under a softcap, its derivative varying; bfloat16, read as it is; beside a bool
    mask per score, Flax's, read as int8; stored keys first, causal; pair features
    [B, Sq, Skv, 3] read at a head's feature; an int edge type per score picking a
    learned weight per head; a row per two queries, causal; a column per two keys,
    placed by key), forward and backward in interpret mode,
    learned: each thread's values gathered from global memory on every kernel's
    tiles (keys down in dK/dV), the dQ kernel's tiles of cotangents placed by batch
    and head, against the reference path; no Triton kernel; twice the same bits."""
    def per_score(plan, learned):
        assert plan.backward_engine == "mosaic" and plan.triton_operands == (), plan.describe()
        assert mosaic.dense_reads(plan.expr)

    _learns_interpreted_twice(case, shape, per_score)


def test_dense_gradient_ignores_the_tiles_the_map_skips(interprets, monkeypatch):
    """The dQ kernel writes a read per score's cotangents only on the tiles its map
    visits and leaves the others as the allocation found them: NaN written there
    (as uninitialized memory may hold) leaves the gradient as it was."""
    q, k, v, do = pc.inputs(b=1, sq=300, skv=260, hq=2, hkv=1, d=64, dtype=jnp.bfloat16)
    mod, operands = pc.traced_vector_mod("head_bias_causal", q, k)
    plan = pc.pallas_plan(mod, q, k, v, MOSAIC, skip=True, scale=0.3)
    o, lse = pallas_backend._forward(plan, q, k, v, operands)
    name = mod.operand_names[0]

    def gradient():
        return pallas_backend._backward(plan, q, k, v, o, lse, do, jnp.zeros(lse.shape),
                                        operands, (name,))[3][name]

    clean = gradient()
    tile_q, blk = mosaic_backward.DQ_BLOCKS
    real_dq = mosaic_backward.dq

    def poisoned(*args):
        dq, sums, dense = real_dq(*args)
        rows = jnp.arange(dense.shape[3])[:, None] // tile_q
        cols = jnp.arange(dense.shape[4])[None, :] // blk
        skipped = cols * blk > rows * tile_q + tile_q - 1  # causal: past the tile's last query
        assert bool(skipped.any())
        return dq, sums, jnp.where(skipped, jnp.nan, dense)

    monkeypatch.setattr(mosaic_backward, "dq", poisoned)
    assert np.array_equal(np.asarray(gradient()), np.asarray(clean))


def test_a_16_bit_array_read_per_score_reaches_the_mosaic_kernels_as_it_is():
    """A bfloat16 bias read only per score goes to the Mosaic kernels in bfloat16 (no
    float32 copy of the [.., Sq, Skv] array), to the Triton kernels in float32; a
    bool mask read per score in int8."""
    q, k, v, _ = pc.inputs(b=1, sq=128, skv=128, hq=2, hkv=1, d=64, dtype=jnp.bfloat16)
    mod, operands = pc.traced_vector_mod("half_bias", q, k)
    plan = pc.pallas_plan(mod, q, k, v, MOSAIC, skip=True)
    (mine,) = pallas_backend._kernel_operands(plan, operands)
    (theirs,) = pallas_backend._kernel_operands(plan, operands, mosaic_kernels=False)
    assert mine.dtype == jnp.bfloat16 and theirs.dtype == jnp.float32
    scaled = scoremod.trace(lambda s, b, h, qi, ki: s * operands[0][b, h, 0, 0]
                            + operands[0][b, h, qi, ki])  # also read at one position
    plan = pc.pallas_plan(scaled, q, k, v, MOSAIC, skip=True)
    assert pallas_backend._kernel_operands(plan, operands)[0].dtype == jnp.float32
    mod, operands = pc.traced_vector_mod("masked_bias", q, k)  # a bool mask: 8-bit
    plan = pc.pallas_plan(mod, q, k, v, MOSAIC, skip=True)
    assert [x.dtype for x in pallas_backend._kernel_operands(plan, operands)] == \
        [jnp.int8, jnp.float32]


def test_an_array_past_int32_positions_is_not_read_per_score():
    """A bias per score of more than 2^31 - 1 entries is refused by the Mosaic engine,
    saying so (the kernels' positions are int32; traced abstractly, never built)."""
    bias = jax.ShapeDtypeStruct((4, 16, 8192, 8192), jnp.float32)
    found = {}

    def trace(bias):
        mod = scoremod.trace(lambda s, b, h, qi, ki: s + bias[b, h, qi, ki])
        found["read"] = next(n for n in ir.toposort(mod.expr) if n.op == ir.LOAD)
        found["why"] = mosaic.refusal(mod.expr, mod.sources)
        return jnp.zeros(())

    jax.eval_shape(trace, bias)
    assert not mosaic.is_dense(found["read"]) and mosaic.read_axis(found["read"]) is False
    assert "int32" in found["why"] and str(4 * 16 * 8192 * 8192) in found["why"]


def test_a_read_per_score_and_elsewhere_is_not_learned_on_mosaic():
    """An array read per score and also at one position per program keeps its
    gradient off the Mosaic backward, saying which read and why."""
    q, k, v, _ = pc.inputs(b=1, sq=128, skv=128, hq=2, hkv=1, d=64, dtype=jnp.bfloat16)
    bias = jnp.zeros((2, 128, 128), jnp.float32)
    mod = scoremod.trace(lambda s, b, h, qi, ki: s * bias[h, 0, 0] + bias[h, qi, ki])
    plan = pc.pallas_plan(mod, q, k, v, MOSAIC, skip=True)
    (name, why), = plan.triton_operands
    assert name == mod.operand_names[0] and "both ways" in why and "q_idx, kv_idx" in why


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
def test_erf_runs_on_mosaic_kernels_interpreted(dtype, interprets):
    """GELU with erf (exact) and a softcap through erfc, on the Mosaic kernels in
    interpret mode: forward and backward against the reference path (erf and erfc
    respelled: Pallas's lowerings have neither); a gradient that would need the
    Triton backward (an array read per score and at one position) is refused,
    naming erf and the user's line."""
    q, k, v, do = pc.inputs(b=1, sq=200, skv=160, hq=2, hkv=1, d=64, dtype=dtype)
    for fn in (lambda s, b, h, qi, ki: s * 0.5 * jax.scipy.special.erfc(-s * 0.70710677),
               lambda s, b, h, qi, ki: jnp.where(qi >= ki, 4.0 * jax.lax.erf(s / 4.0),
                                                 -jnp.inf)):
        mod = scoremod.trace(fn)
        plan = pc.pallas_plan(mod, q, k, v, MOSAIC, scale=0.5)
        assert plan.engine == plan.backward_engine == "mosaic", plan.describe()
        assert "`erf" in plan.triton_refusal
        ref = REFERENCE.plan(Problem.of(q, k, v), mod, plan.scale, MOSAIC, True)
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        want = pc.run(REFERENCE, ref, f32(q), f32(k), f32(v), f32(do), (), False)
        o, lse = pallas_backend._forward(plan, q, k, v, ())
        dlse = jnp.where(jnp.isfinite(lse), 0.1, 0.0)
        dq, dk, dv, _ = pallas_backend._backward(plan, q, k, v, o, lse, do, dlse, (), ())
        errs = pc.relative_errors((o, lse, dq, dk, dv, ()), want)
        assert all(e < 3e-2 for e in errs.values()), errs
    bias = jnp.zeros((2, 200, 160), jnp.float32)
    mod = scoremod.trace(lambda s, b, h, qi, ki: jax.lax.erf(s) * bias[h, 0, 0] + bias[h, qi, ki])
    plan = pc.pallas_plan(mod, q, k, v, MOSAIC, scale=0.5)
    name = mod.operand_names[0]
    assert plan.backward_engine == "mosaic" and plan.triton_operands[0][0] == name
    o, lse = pallas_backend._forward(plan, q, k, v, (bias,))
    with pytest.raises(ScoreModError, match=r"(?s)`erf`.*test_pallas_mosaic.py.*xla"):
        pallas_backend._backward(plan, q, k, v, o, lse, do, jnp.zeros(lse.shape), (bias,),
                                 (name,))


def test_float_remainders_run_on_mosaic_kernels_interpreted(interprets):
    """Float remainders (a sawtooth of the score, a floor division, fmod by a learned
    per-head divisor) on the Mosaic kernels in interpret mode, forward and backward
    with the divisor's gradient (-g * trunc(s / c)), against the reference path."""
    q, k, v, do = pc.inputs(b=1, sq=200, skv=160, hq=2, hkv=1, d=64, dtype=jnp.bfloat16)
    c = jnp.asarray([0.75, 1.25], jnp.float32)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    for fn, operands in (
            (lambda s, b, h, qi, ki: jnp.where(qi >= ki, s + 0.5 * (s % 0.75), -jnp.inf), ()),
            (lambda s, b, h, qi, ki: s + 0.25 * (s // 1.5), ()),
            (lambda s, b, h, qi, ki: s + jnp.fmod(s, c[h]), (c,))):
        mod = scoremod.trace(fn)
        plan = pc.pallas_plan(mod, q, k, v, MOSAIC, scale=0.5)
        assert plan.engine == plan.backward_engine == "mosaic", plan.describe()
        assert plan.triton_operands == ()
        ref = REFERENCE.plan(Problem.of(q, k, v), mod, plan.scale, MOSAIC, True)
        want = pc.run(REFERENCE, ref, f32(q), f32(k), f32(v), f32(do), operands, True)
        o, lse = pallas_backend._forward(plan, q, k, v, operands)
        dlse = jnp.where(jnp.isfinite(lse), 0.1, 0.0)
        names = mod.operand_names
        dq, dk, dv, grads = pallas_backend._backward(plan, q, k, v, o, lse, do, dlse, operands,
                                                     names)
        got = (o, lse, dq, dk, dv, tuple(grads.get(n) for n in names))
        errs = pc.relative_errors(got, want)
        assert all(e < 3e-2 for e in errs.values()), errs
        assert not operands or "d_operand0" in errs


def test_lookup_tables_of_the_score_run_on_mosaic_kernels_interpreted(interprets):
    """A lookup table read at an index computed from the score (64 entries a head: a
    gather, past what ``selects`` picks by comparisons) on the Mosaic kernels in
    interpret mode, forward and backward against the reference path (the read's
    derivative in the score is 0: its index is an int); the table's own gradient is
    refused there (where it reads is known in the kernel only) and named in the plan."""
    q, k, v, do = pc.inputs(b=1, sq=200, skv=160, hq=2, hkv=1, d=64, dtype=jnp.bfloat16)
    lut = jnp.asarray(np.random.default_rng(0).normal(size=(2, 64)) * 0.5, jnp.float32)
    mod = scoremod.trace(lambda s, b, h, qi, ki: jnp.where(
        qi >= ki, s + lut[h, jnp.clip((s * 4 + 32).astype(jnp.int32), 0, 63)], -jnp.inf))
    plan = pc.pallas_plan(mod, q, k, v, MOSAIC, scale=0.5)
    assert plan.engine == plan.backward_engine == "mosaic", plan.describe()
    ((name, why),) = plan.triton_operands
    assert name == mod.operand_names[0] and "reads no score" in why
    ref = REFERENCE.plan(Problem.of(q, k, v), mod, plan.scale, MOSAIC, True)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    want = pc.run(REFERENCE, ref, f32(q), f32(k), f32(v), f32(do), (lut,), False)
    o, lse = pallas_backend._forward(plan, q, k, v, (lut,))
    dlse = jnp.where(jnp.isfinite(lse), 0.1, 0.0)
    dq, dk, dv, _ = pallas_backend._backward(plan, q, k, v, o, lse, do, dlse, (lut,), ())
    errs = pc.relative_errors((o, lse, dq, dk, dv, (None,)), want)
    assert all(e < 3e-2 for e in errs.values()), errs
    # the table matters: the same call without it is far off
    plain = pc.run(REFERENCE, ref, f32(q), f32(k), f32(v), f32(do), (jnp.zeros_like(lut),), False)
    assert pc.relative_errors(plain[:5] + ((None,),), want)["O"] > 0.1


def test_a_lookup_table_of_the_score_lowers_to_mosaic_kernels_only(hopper_here):
    """The lookup table's call by name, jitted, forward and gradients of q, k, v,
    lowers for CUDA to three Mosaic GPU kernels and no Triton one."""
    q, k, v, do = pc.inputs(b=1, sq=256, skv=256, hq=2, hkv=1, d=128, dtype=jnp.bfloat16)
    lut = jnp.linspace(-1.0, 1.0, 2 * 64, dtype=jnp.float32).reshape(2, 64)

    def mod(s, b, h, qi, ki):
        return s + lut[h, jnp.clip((s * 4 + 32).astype(jnp.int32), 0, 63)]

    def loss(q, k, v):
        o = scoremod.attention(q, k, v, mod, implementation="pallas", options=MOSAIC)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

    assert _kernels(_lower_call(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)) == \
        {"mosaic": 3, "triton": 0}


@pytest.mark.parametrize("case,shape", [
    ("wrapped_bias", dict(sq=200, skv=260, hq=2, hkv=1, d=64)),
    ("swin_bias", dict(sq=130, skv=100, hq=2, hkv=1, d=64)),
    ("grid_bias", dict(sq=70, skv=130, hq=4, hkv=2, d=64, dtype=jnp.float16)),
])
def test_reads_without_an_axis_of_their_own_learn_by_position_interpreted(case, shape,
                                                                          interprets):
    """Reads whose gradient cannot be placed by rows: one per score whose indices
    each take a part of one position (``t[h, q % 64, kv % 96]``), Swin's table at a
    relative index read per score (``table[h, rel[q, kv]]``), a table at a 2-D
    relative position. Learned on the Mosaic backward (the dQ kernel's cotangents
    per score, summed by the position each score reads), in interpret mode, against
    the reference path; no Triton kernel; the same bits twice."""
    def by_position(plan, learned):
        assert plan.engine == plan.backward_engine == "mosaic", plan.describe()
        assert plan.triton_operands == (), plan.triton_operands
        read = next(n for n in mosaic_backward.learned_loads(plan.expr, (learned,)))
        assert mosaic_backward.along_dense(read) and all(
            mosaic.bare_axis(read, a) is None for a in ("q_idx", "kv_idx"))

    _learns_interpreted_twice(case, shape, by_position)


def test_sum_by_position_matches_a_scatter():
    """``_sum_by_position`` against numpy's unordered add at positions with repeats,
    gaps and one position taking every entry; the same bits twice."""
    rng = np.random.default_rng(3)
    for n, size in ((1000, 37), (257, 400), (64, 1)):
        values = rng.standard_normal(n).astype(np.float32)
        at = rng.integers(0, size, n).astype(np.int32)
        want = np.zeros(size, np.float64)
        np.add.at(want, at, values)
        got = [np.asarray(jax.jit(pallas_backend._sum_by_position, static_argnums=2)(
            jnp.asarray(values), jnp.asarray(at), size)) for _ in range(2)]
        np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)
        assert np.array_equal(got[0], got[1])
        assert (got[0][np.setdiff1d(np.arange(size), at)] == 0).all()


@pytest.mark.parametrize("case,shape", [
    ("grid_bias", dict(sq=130, skv=190, hq=4, hkv=2, d=64)),
    ("swin_bias", dict(sq=200, skv=150, hq=2, hkv=1, d=64, dtype=jnp.float16)),
])
def test_gathers_run_per_score_interpreted(case, shape, interprets):
    """Reads at an index that mixes q_idx and kv_idx (a 2-D relative position on an
    8 x 8 grid; Swin's table at a relative index read per score): each thread
    loads its own scores' values at the index evaluated on the tile, forward and
    backward on the Mosaic kernels in interpret mode against the reference path."""
    shape = dict(shape)
    dtype = shape.pop("dtype", jnp.bfloat16)
    q, k, v, do = pc.inputs(b=2, dtype=dtype, **shape)
    mod, operands = pc.traced_vector_mod(case, q, k)
    plan = pc.pallas_plan(mod, q, k, v, MOSAIC, skip=True, scale=0.3)
    assert plan.engine == plan.backward_engine == "mosaic", plan.describe()
    assert any(mosaic.gathered(n) for n in ir.toposort(plan.expr) if n.op == ir.LOAD)
    assert plan.triton_operands == (), plan.triton_operands
    ref = REFERENCE.plan(Problem.of(q, k, v), mod, plan.scale, MOSAIC, True)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    want = pc.run(REFERENCE, ref, f32(q), f32(k), f32(v), f32(do), operands, False)
    o, lse = pallas_backend._forward(plan, q, k, v, operands)
    dlse = jnp.where(jnp.isfinite(lse), 0.1, 0.0)
    dq, dk, dv, _ = pallas_backend._backward(plan, q, k, v, o, lse, do, dlse, operands, ())
    errs = pc.relative_errors((o, lse, dq, dk, dv, ()), want)
    assert all(e < 3e-2 for e in errs.values()), errs


def test_a_decode_step_packs_a_mask_per_score(interprets, monkeypatch):
    """Speculative decoding's tree mask (a bool per draft query and key, Flax's
    [B, 1, Sq, Skv]) on the Mosaic engine: its query heads packed into the rows
    (the packed read ``mask[b, 0, q // 2, kv]`` is a row's offset plus a column's),
    against the reference path."""
    monkeypatch.setattr(device, "current", lambda: HOPPER)
    plan = PALLAS.plan
    monkeypatch.setattr(type(PALLAS), "plan",
                        lambda self, *a: dataclasses.replace(plan(*a), interpret=True))
    b, sq, hq, hkv, skv, d = 2, 4, 4, 2, 384, 64
    rng = np.random.default_rng(9)
    q = jnp.asarray(rng.standard_normal((b, sq, hq, d)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((b, skv, hkv, d)), jnp.bfloat16) for _ in "kv")
    tree = rng.random((b, 1, sq, skv)) < 0.6
    tree[..., :skv - sq] = True  # the prefix, then each draft's ancestors
    tree[..., skv - sq:] &= np.tril(np.ones((sq, sq), bool))
    tree = jnp.asarray(tree)

    def mod(s, b, h, qi, ki):
        return jnp.where(tree[b, 0, qi, ki], 30.0 * jnp.tanh(s / 30.0), -jnp.inf)

    chosen = scoremod.which_implementation(q, k, v, mod, implementation="pallas",
                                           options=MOSAIC)
    assert "packed" in chosen.variant, chosen.variant
    got = scoremod.attention(q, k, v, mod, implementation="pallas", options=MOSAIC,
                             return_lse=True)
    want = scoremod.attention(q, k, v, mod, implementation="xla", return_lse=True)
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32),
                               atol=2e-2)
    np.testing.assert_allclose(got[1], want[1], atol=1e-3)


def test_a_learned_dense_bias_lowers_to_mosaic_kernels_only(hopper_here):
    """jax.grad of a call that learns a bias per batch, head and score (Flax's
    ``bias``) lowers for CUDA to the three Mosaic kernels and no Triton kernel."""
    q, k, v, do = pc.inputs(b=2, sq=300, skv=260, hq=4, hkv=2, d=128, dtype=jnp.bfloat16)
    fn, (bias,) = pc.vector_mod("pair_bias", 2, 4, 300, 260)

    def loss(q, bias):
        mod = lambda s, b, h, qi, ki: fn(s, b, h, qi, ki, bias)  # noqa: E731
        o = scoremod.attention(q, k, v, mod, implementation="pallas", options=MOSAIC)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

    # The forward and the dQ kernel (which writes the bias's cotangents); XLA drops
    # the dK/dV kernel, whose outputs no gradient asked for reads.
    assert _kernels(_lower_call(jax.grad(loss, argnums=(0, 1)), q, bias)) == \
        {"mosaic": 2, "triton": 0}


@pytest.mark.parametrize("case", ["swin_bias", "grid_bias", "wrapped_bias"])
def test_a_learned_gather_lowers_to_mosaic_kernels_only(case, hopper_here):
    """jax.grad of a call that learns a table read at a gathered index (Swin's
    ``table[h, rel[q, kv]]``, a 2-D relative position) or a bias tiled over the
    scores lowers for CUDA to the three Mosaic kernels (the dQ kernel's per-score
    cotangents through ``dense_gather``) and no Triton kernel."""
    q, k, v, do = pc.inputs(b=2, sq=300, skv=260, hq=4, hkv=2, d=128, dtype=jnp.bfloat16)
    fn, operands = pc.vector_mod(case, 2, 4, 300, 260)

    def loss(q, k, v, table):
        mod = lambda s, b, h, qi, ki: fn(s, b, h, qi, ki, *operands[:-1], table)  # noqa: E731
        o = scoremod.attention(q, k, v, mod, implementation="pallas", options=MOSAIC)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

    lowered = _lower_call(jax.grad(loss, argnums=(0, 1, 2, 3)), q, k, v, operands[-1])
    assert _kernels(lowered) == {"mosaic": 3, "triton": 0}


def test_a_learned_block_table_lowers_to_mosaic_kernels_only(hopper_here):
    """jax.grad of a call that learns a bias per 64 x 64 block (beside a tile map of
    the same blocks, as video sparse attention's), or per 48 queries by 64 keys,
    lowers for CUDA to the three Mosaic kernels and no Triton kernel."""
    q, k, v, _ = pc.inputs(b=1, sq=256, skv=256, hq=2, hkv=1, d=64, dtype=jnp.bfloat16)
    keep = jnp.asarray(np.random.default_rng(5).random((2, 4, 4)) < 0.6) | jnp.eye(4, dtype=bool)

    for rows, kernels in ((64, {"mosaic": 3, "triton": 0}), (48, {"mosaic": 3, "triton": 0})):
        table = jnp.zeros((2, -(-256 // rows), 4), jnp.float32)

        def loss(q, k, v, table, rows=rows):
            mod = lambda s, b, h, qi, ki: jnp.where(  # noqa: E731
                keep[h, qi // 64, ki // 64], s + table[h, qi // rows, ki // 64], -jnp.inf)
            o = scoremod.attention(q, k, v, mod, implementation="pallas", options=MOSAIC)
            return jnp.sum(o.astype(jnp.float32))

        lowered = _lower_call(jax.grad(loss, argnums=(0, 1, 2, 3)), q, k, v, table)
        assert _kernels(lowered) == kernels, rows


def test_block_reads_learned_past_the_step_sums_bound_go_to_triton(monkeypatch):
    """A block read whose per-step sums pass MAX_STEP_SUMS (counting the block rows a
    step meets: two or three for blocks of 48 queries) is learned by the Triton
    backward, saying why."""
    monkeypatch.setattr(device, "current", lambda: HOPPER)
    monkeypatch.setattr(jax, "__version__", "0.11.2")
    q = jnp.zeros((2, 256, 2, 64), jnp.bfloat16)
    for case, rows in (("block_bias64", 1), ("block_bias", 2)):
        (node,) = mosaic_backward.block_loads(pc.traced_vector_mod(case, q, q)[0].expr, ("c0",))
        assert mosaic_backward.step_blocks(node) == rows, case
    # block_bias at b2 h2, 256 x 256: 2 * 2 * 4 steps * 2 rows * 256 keys = 8192 sums
    for case, bound, refused in (("block_bias64", None, False), ("block_bias", None, False),
                                 ("block_bias64", 1000, True), ("block_bias", 8191, True),
                                 ("block_bias", 8192, False)):
        if bound is not None:
            monkeypatch.setattr(pallas_backend, "MAX_STEP_SUMS", bound)
        mod, _ = pc.traced_vector_mod(case, q, q)
        plan = PALLAS.plan(Problem.of(q, q, q), mod, 0.125, MOSAIC, True)
        assert plan.backward_engine == "mosaic"
        assert bool(plan.triton_operands) == refused, (case, plan.triton_operands)
        if refused:
            assert f"past {bound}" in plan.triton_operands[0][1]


@pytest.mark.parametrize("case,shape", [
    ("shifted_bias", dict(sq=130, skv=190, hq=4, hkv=2, d=64)),
    ("key_chunks", dict(sq=100, skv=150, hq=2, hkv=1, d=128, dtype=jnp.float16)),
    ("query_scale", dict(sq=200, skv=136, hq=4, hkv=2, d=64)),
    ("query_scale", dict(sq=192, skv=320, hq=2, hkv=1, d=64)),
])
def test_backward_learns_position_reads_interpreted(case, shape, interprets):
    """Arrays read along the keys or the queries at positions known when tracing (a
    per-head key bias under a document mask; a factor of the score per 4 keys,
    shared by the heads: each entry sums 4 keys of every head; a factor per head
    and query under a causal mask), learned: the Mosaic dK/dV kernel's per-key
    sums, or the dQ kernel's per-query ones, in interpret mode, placed at the
    positions read, against the reference path; no Triton kernel; twice the same
    bits."""
    def per_position(plan, learned):
        assert plan.backward_engine == "mosaic" and plan.triton_operands == ()
        assert plan.diagonal_operands == () and pallas_backend._along_axes(plan) == (learned,)

    _learns_interpreted_twice(case, shape, per_position)


def test_position_reads_refusals():
    """A read at q_idx - kv_idx is not learned by the dK/dV kernel's sums (the
    block-diagonal kernel's), saying why; one along the keys or the queries is, its
    index reading a captured array or not, and so is a gather."""
    doc = pc.doc_ids(1, 64)
    w = jnp.ones((64,), jnp.float32)
    def learned(mod):  # the float operand's name
        return next(n for n, x in zip(mod.operand_names, mod.operands)
                    if jnp.issubdtype(x.dtype, jnp.floating))

    mod = scoremod.trace(lambda s, b, h, q, k: s * w[(q - k) % 64])
    why = mosaic_backward.learning_refusal(mod.expr, learned(mod), mod.sources)
    assert why is not None and "along the keys" in why, why
    for fn in (lambda s, b, h, q, k: s + w[k // 2], lambda s, b, h, q, k: s * w[q],
               lambda s, b, h, q, k: s + w[doc[0, k]], lambda s, b, h, q, k: s * w[doc[0, q]],
               lambda s, b, h, q, k: s * w[(q + k) % 64]):
        mod = scoremod.trace(fn)
        assert mosaic_backward.learning_refusal(mod.expr, learned(mod), mod.sources) is None


def test_diagonal_map_and_gradient_place_every_diagonal_once():
    """The per-block-diagonal lists hold exactly the block map's visited tiles of
    each block diagonal, in ascending order; ``diagonal_gradient`` adds the two
    shares of each diagonal (a numpy scatter of the same sums, for comparison)."""
    from scoremod.lowering import block_maps

    blk = mosaic_backward.BLOCK
    nq, nk = 5, 3
    rng = np.random.default_rng(0)
    visited = rng.random((1, 2, nq, nk)) < 0.6
    full = visited & (rng.random(visited.shape) < 0.5)
    bmap = block_maps.block_lists(jnp.asarray(visited), jnp.asarray(full))
    counts, blocks, fulls = (np.asarray(x) for x in mosaic_backward.diagonal_map(bmap, nq, nk))
    for h in range(2):
        for t in range(nq + nk - 1):
            shift = t - (nk - 1)
            want = [i for i in range(nq) if 0 <= i - shift < nk and visited[0, h, i, i - shift]]
            n = int(counts[0, h, t])
            assert list(np.asarray(blocks[0, h, t, :n])) == want, (h, t)
            assert list(np.asarray(fulls[0, h, t, :n])) == [
                bool(full[0, h, i, i - shift]) for i in want]
    sums = rng.standard_normal((1, 1, 1, nq + nk - 1, 2, blk)).astype(np.float32)
    sums[..., 1, 0] = 0.0  # upper[0] is the main diagonal's, counted in lower
    got = np.asarray(mosaic_backward.diagonal_gradient(jnp.asarray(sums), nq, nk))[0, 0, 0]
    want = np.zeros((nq + nk) * blk - 1)
    first = nk * blk - 1
    for t in range(nq + nk - 1):
        base = (t - (nk - 1)) * blk
        for u in range(blk):
            want[first + base + u] += sums[0, 0, 0, t, 0, u]  # lower: q - kv = base + u
            if u:
                want[first + base - u] += sums[0, 0, 0, t, 1, u]  # upper: base - u
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_learning_refusal(monkeypatch, hopper_here):
    """A read at an index that varies over the tile, or one whose derivative the
    engine cannot evaluate, is not learned by the Mosaic backward: the plan names
    the operand and why, and a call that asks for its gradient lowers to the
    Triton backward (one that does not, to the Mosaic one)."""
    t = jnp.ones((4, 8), jnp.float32)
    for fn in (lambda s, b, h, qi, ki: s + t[h, jnp.clip(ki - qi + 4, 0, 7)],  # relative
               lambda s, b, h, qi, ki: s + t[h, jnp.where(s > 0, 1, 0)]):  # by the score
        read = scoremod.trace(fn)
        why = mosaic_backward.learning_refusal(read.expr, read.operand_names[0], read.sources)
        assert "is none of these" in why and "test_pallas_mosaic.py" in why
    gather = scoremod.trace(lambda s, b, h, qi, ki: s + t[h, (qi + ki) % 8])
    assert mosaic_backward.learning_refusal(gather.expr, gather.operand_names[0],
                                            gather.sources) is None
    monkeypatch.setitem(mosaic.NOT_LOWERABLE, "cos", "no rule for cos (a test's)")
    c = jnp.asarray([0.5, 1.0, 1.5, 2.0], jnp.float32)
    q, k, v, do = pc.inputs(b=1, sq=128, skv=128, hq=4, hkv=2, d=64, dtype=jnp.float16)
    sine = scoremod.trace(lambda s, b, h, qi, ki: s + jnp.sin(c[h]))
    plan = PALLAS.plan(Problem.of(q, k, v), sine, 0.125, MOSAIC, True)
    assert plan.backward_engine == "mosaic" and len(plan.triton_operands) == 1
    name, why = plan.triton_operands[0]
    assert "`cos`" in why and f"`{name}`" in plan.describe() and "Triton" in plan.describe()

    def loss(q, k, c):
        mod = lambda s, b, h, qi, ki: s + jnp.sin(c[h])  # noqa: E731
        o = scoremod.attention(q, k, v, mod, implementation="pallas", options=MOSAIC)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

    assert _kernels(_lower_call(jax.grad(loss, argnums=(0, 1)), q, k, c)) == \
        {"mosaic": 3, "triton": 0}
    assert _kernels(_lower_call(jax.grad(loss, argnums=(0, 1, 2)), q, k, c)) == \
        {"mosaic": 1, "triton": 2}


def test_vmap_lowers(hopper_here):
    q, k, v, do = pc.inputs(b=1, sq=256, skv=256, hq=4, hkv=2, d=128, dtype=jnp.bfloat16)
    qs = jnp.stack([q, q])
    slopes = jnp.asarray([[0.5, 0.25, 0.125, 0.0625], [0.1, 0.2, 0.3, 0.4]], jnp.float32)

    def out(q, slopes):
        mod = lambda s, b, h, qi, ki: jnp.where(qi >= ki, s + slopes[h] * (ki - qi), -jnp.inf)
        return scoremod.attention(q, k, v, mod, implementation="pallas", options=MOSAIC)

    assert "mosaic_gpu" in _lower_call(jax.vmap(out), qs, slopes)
    # Gradients of q and k under vmap: the forward and both backward kernels, batched.
    def loss(q, k, slopes):
        mod = lambda s, b, h, qi, ki: jnp.where(qi >= ki, s + slopes[h] * (ki - qi), -jnp.inf)
        o = scoremod.attention(q, k, v, mod, implementation="pallas", options=MOSAIC)
        return jnp.sum(o.astype(jnp.float32))

    grads = jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None, 0))
    assert _kernels(_lower_call(grads, qs, k, slopes)) == {"mosaic": 3, "triton": 0}
    # The slopes' gradients too (per example): the same three kernels.
    grads = jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=(0, None, 0))
    assert _kernels(_lower_call(grads, qs, k, slopes)) == {"mosaic": 3, "triton": 0}


def test_import_is_lazy():
    """scoremod and the backend import where jax has no Mosaic GPU (jax 0.10 on CI):
    the engine imports it when it builds a kernel."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['jax.experimental.pallas.mosaic_gpu'] = None; "
            "import scoremod, scoremod.lowering.pallas.backend; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
    assert out.stdout.strip() == "ok", out.stderr


def test_read_axes():
    """A captured array indexed by b, h and constants is a scalar read; by those and
    one of q_idx or kv_idx (through any arithmetic), a vector along that axis; by
    both as whole blocks of positions (few per tile), a value per block; by both
    otherwise, a gather, read per score where its index is evaluated on the tile;
    by the score: refused, saying so."""
    t = jnp.ones((4, 8), jnp.float32)
    u = jnp.ones((4, 8, 8), jnp.float32)
    doc = jnp.zeros((2, 300), jnp.int32)
    flags = jnp.arange(300) % 3 == 0

    def read(fn):
        mod = scoremod.trace(fn)
        (node,) = [n for n in ir.toposort(mod.expr) if n.op == ir.LOAD]
        return mod, mosaic.read_axis(node)

    taken = {
        "scalar": (lambda s, b, h, qi, ki: s + t[h, 3], None),
        "scalar, computed": (lambda s, b, h, qi, ki: s * t[b, h + 1], None),
        "doc[b, q_idx]": (lambda s, b, h, qi, ki: jnp.where(doc[b, qi] > 0, s, 0.0), "q_idx"),
        "doc[b, kv_idx]": (lambda s, b, h, qi, ki: jnp.where(doc[b, ki] > 0, s, 0.0), "kv_idx"),
        "doc[b, kv_idx + 1]": (lambda s, b, h, qi, ki: s + doc[b, ki + 1], "kv_idx"),
        "t[h, q_idx // 64]": (lambda s, b, h, qi, ki: s + t[h, qi // 64], "q_idx"),
        "bool flags[kv_idx]": (lambda s, b, h, qi, ki: jnp.where(flags[ki], s, -jnp.inf),
                               "kv_idx"),
        "t[q_idx // 64, kv_idx // 64]": (lambda s, b, h, qi, ki: s + t[qi // 64, ki // 64],
                                         mosaic.BLOCKS),
        "t[h, (q_idx >> 5) + 1, kv_idx // 96]": (
            lambda s, b, h, qi, ki: s + u[h, (qi >> 5) + 1, ki // 96], mosaic.BLOCKS),
    }
    # Not whole blocks, but each index of one position: per score, a row's offset plus
    # a column's.
    taken.update({
        "blocks and a position": (lambda s, b, h, qi, ki: s + t[qi // 64, ki], mosaic.DENSE),
        "blocks of a shifted position": (
            lambda s, b, h, qi, ki: s + t[(qi + 1) // 64, ki // 64], mosaic.DENSE),
        "too many blocks per tile": (lambda s, b, h, qi, ki: s + t[qi // 16, ki // 16],
                                     mosaic.DENSE),
    })
    for name, (fn, axis) in taken.items():
        mod, got = read(fn)
        assert got == axis, name
        assert mosaic.refusal(mod.expr, mod.sources) is None, name
        assert mosaic_backward.refusal(mod.expr, mod.sources) is None, name
    gathers = {
        "both indices": lambda s, b, h, qi, ki: s + t[h, (qi + ki) % 8],
        "difference and q_idx": lambda s, b, h, qi, ki: s + t[qi % 4, ki - qi],
        # a read whose index is another read: the outer read's axes decide
        "nested": lambda s, b, h, qi, ki: s + t[h, doc[b, qi] - doc[b, ki]],
    }
    for name, fn in gathers.items():
        mod, got = (scoremod.trace(fn), None) if name == "nested" else read(fn)
        outer = next(n for n in ir.toposort(mod.expr) if n.op == ir.LOAD
                     and n.args[0].attr[0] == mod.operand_names[0])
        assert mosaic.read_axis(outer) is False and mosaic.gathered(outer), name
        assert mosaic.refusal(mod.expr, mod.sources) is None, name
    mod, got = read(lambda s, b, h, qi, ki: s + t[h, jnp.where(s > 0, 1, 0)])
    assert got is False and mosaic.gathered(mod.expr.args[1])  # at the score: in the kernel
    assert mosaic.reads_score(mod.expr.args[1]) and mosaic.refusal(mod.expr, mod.sources) is None
    inner = scoremod.trace(lambda s, b, h, qi, ki: s + t[h, doc[b, qi]])
    assert mosaic.refusal(inner.expr, inner.sources) is None
    assert len(mosaic.vector_reads(inner.expr)) == 1  # the outer one, read whole


def test_vector_sources_and_uses():
    """doc[b, q_idx] and doc[b, kv_idx] share one vector array; an index read only
    inside vector reads needs no index tile of its own."""
    doc = jnp.zeros((2, 300), jnp.int32)
    same = scoremod.trace(lambda s, b, h, qi, ki: jnp.where(doc[b, qi] == doc[b, ki], s, -1e9))
    reads = mosaic.vector_reads(same.expr)
    assert len(reads) == 2 and len(mosaic.vector_sources(reads)) == 1
    assert not mosaic.uses_var(same.expr, "q_idx") and not mosaic.uses_var(same.expr, "kv_idx")
    causal = scoremod.trace(lambda s, b, h, qi, ki: jnp.where(
        (doc[b, qi] == doc[b, ki]) & (qi >= ki), s, -1e9))
    assert mosaic.uses_var(causal.expr, "q_idx") and mosaic.uses_var(causal.expr, "kv_idx")
    shifted = scoremod.trace(lambda s, b, h, qi, ki: jnp.where(doc[b, qi] == doc[b, ki + 1],
                                                               s, -1e9))
    assert len(mosaic.vector_sources(mosaic.vector_reads(shifted.expr))) == 2


def test_vector_arrays():
    """Each source's values at every position of the (padded) axis, per batch if it
    reads b and per query head if it reads h: the reference path's reads, clamped
    past the arrays' ends; bool arrays as int32, compared with 0 on the tile."""
    rng = np.random.default_rng(7)
    doc = jnp.asarray(rng.integers(0, 5, size=(2, 100)), jnp.int32)
    bias = jnp.asarray(rng.normal(size=(3, 90)), jnp.float32)
    flags = jnp.asarray(rng.integers(0, 2, size=(100,)) == 1)
    mods = [lambda s, b, h, qi, ki: jnp.where(doc[b, ki + 1] > 2, s + bias[h, qi], s),
            lambda s, b, h, qi, ki: jnp.where(flags[ki], s, -jnp.inf)]
    for fn in mods:
        mod = scoremod.trace(fn)
        names, values = mod.operand_names, tuple(mod.operands)
        from scoremod.lowering.pallas import codegen

        flat = tuple(codegen.kernel_operand(x, n) for x, n in zip(values, mod.operand_nodes))
        reads = mosaic.vector_reads(mod.expr)
        sources = mosaic.vector_sources(reads)
        arrays = mosaic.vector_arrays(sources, names, flat, 2, 3, 128)
        for src, arr in zip(sources, arrays):
            used = ir.variables(src)
            assert arr.shape == (2 if "b" in used else 1, 3 if "h" in used else 1, 128)
            assert arr.dtype == (jnp.float32 if src.dtype == ir.F32 else jnp.int32)
            for bi in range(arr.shape[0]):
                for hi in range(arr.shape[1]):
                    want = evaluate(src, {"b": bi, "h": hi, "q_idx": jnp.arange(128)},
                                    dict(zip(names, values)))
                    np.testing.assert_array_equal(np.asarray(arr[bi, hi]),
                                                  np.asarray(want).astype(arr.dtype))
        # On a tile: each read broadcast along its axis, bool flags compared after.
        own = {"q_idx": {}, "kv_idx": {}}
        for src, arr in zip(sources, arrays):
            for read in reads:
                if mosaic.vector_source(read) is src:
                    axis = mosaic.read_axis(read)
                    start = 0 if axis == "q_idx" else 64
                    own[axis][src] = arr[0, 0, start:start + 64]
        tiles = mosaic.tile_reads(reads, own, {"q_idx": 0, "kv_idx": 1}, (64, 64))
        index = {"b": 0, "h": 0, "q_idx": jnp.arange(64)[:, None],
                 "kv_idx": 64 + jnp.arange(64)[None, :]}
        for read, got in tiles.items():
            want = evaluate(read, index, dict(zip(names, values)))
            assert got.dtype == jnp.asarray(want).dtype
            np.testing.assert_array_equal(np.asarray(got), np.broadcast_to(want, (64, 64)))


@pytest.mark.parametrize("case", sorted(pc.CASES))
def test_prepared_expression(case):
    """The kernel's form of the mod (log2(e) and the score's constant factor
    moved into constants and the scale) is the mod times log2(e)."""
    q = jnp.zeros((2, 96, 4, 64), jnp.float32)
    mod, operands = pc.traced(case, q, q)
    expr, factor, in_log2 = mosaic.prepared(mod.expr)
    rng = np.random.default_rng(2)
    s = jnp.asarray(rng.normal(size=(96, 96)) * 4, jnp.float32)
    index = {"b": jnp.int32(1), "h": jnp.int32(2),
             "q_idx": jnp.arange(96, dtype=jnp.int32)[:, None],
             "kv_idx": jnp.arange(96, dtype=jnp.int32)[None, :]}
    values = dict(zip(mod.operand_names, operands))
    want = np.asarray(evaluate(mod.expr, dict(index, score=s), values)) * mosaic.LOG2E
    got = np.asarray(evaluate(expr, dict(index, score=s * np.float32(factor)), values))
    got = got if in_log2 else got * mosaic.LOG2E
    np.testing.assert_allclose(np.broadcast_to(got, s.shape), np.broadcast_to(want, s.shape),
                               rtol=2e-6, atol=2e-6)


def test_prepared_folds():
    softcap = scoremod.trace(lambda s, b, h, qi, ki: 30.0 * jnp.tanh(s / 30.0))
    causal = scoremod.trace(lambda s, b, h, qi, ki: jnp.where(qi >= ki, s, -jnp.inf))
    square = scoremod.trace(lambda s, b, h, qi, ki: s * s)
    (e, c, log2) = mosaic.prepared(softcap.expr)
    assert log2 and c == pytest.approx(1 / 30) and "/" not in str(e)
    (e, c, log2) = mosaic.prepared(causal.expr)
    assert log2 and c == pytest.approx(mosaic.LOG2E) and str(e) == str(causal.expr)
    assert mosaic.prepared(square.expr) == (square.expr, 1.0, False)


# --------------------------------------------------------------------------- #
# Captured arrays read along one tile axis (document ids, per-key flags and biases)


@pytest.mark.parametrize("case,b,shape,dtype", [
    ("document_softcap", 2, dict(sq=300, skv=260, hq=4, hkv=2, d=64), jnp.bfloat16),
    ("document", 2, dict(sq=130, skv=190, hq=2, hkv=1, d=128), jnp.float16),
    ("document_bidirectional", 2, dict(sq=200, skv=200, hq=2, hkv=2, d=64), jnp.bfloat16),
    ("shifted_bias", 2, dict(sq=150, skv=170, hq=4, hkv=2, d=64), jnp.bfloat16),
])
def test_vector_reads_interpreted(case, b, shape, dtype, interprets):
    """Mods that read captured arrays along one tile axis, forward and backward
    on the Mosaic kernels in Mosaic GPU's interpret mode (the plan's own map:
    documents skip tiles), through the backend's custom_vjp, against the
    reference path: O, LSE, dQ, dK, dV with an LSE cotangent too. Document ids
    differ per batch and leave some rows of a tile in another document than
    others; lengths are no whole number of tiles (the vectors' padding); query
    heads share key heads; an offset index and a
    float vector per head."""
    _interpreted_against_reference(case, b, shape, dtype, mosaic.vector_reads)


def test_one_axis_parts():
    """The forward's one-axis parts: ALiBi's product of a difference of positions
    split into a term of each (log2(e) on the vectors), which then take both
    positions off the tile (no index tiles where no mask reads them); a factor that
    reads a position is not split; a lone difference is (exactly)."""
    sl = jnp.asarray([0.5, 0.25], jnp.float32)
    alibi = scoremod.trace(lambda s, b, h, qi, ki: s + sl[h] * (ki - qi))
    expr, factor, in_log2 = mosaic.prepared(alibi.expr)
    parts = mosaic.axis_parts(expr)
    assert in_log2 and factor == pytest.approx(mosaic.LOG2E)
    assert sorted(a for _, a in parts) == ["kv_idx", "q_idx"], expr
    whole = {n for n, _ in parts}
    assert not mosaic.uses_var(expr, "kv_idx", whole) and not mosaic.uses_var(expr, "q_idx", whole)
    causal = scoremod.trace(lambda s, b, h, qi, ki: jnp.where(qi >= ki, s + sl[h] * (ki - qi),
                                                              -jnp.inf))
    expr = mosaic.prepared(causal.expr)[0]
    assert len(mosaic.axis_parts(expr)) == 2 and mosaic.uses_var(
        expr, "kv_idx", {n for n, _ in mosaic.axis_parts(expr)})  # the mask's own
    kept = scoremod.trace(lambda s, b, h, qi, ki: s + ki * (ki - qi))
    assert mosaic.split_axes(kept.expr) is kept.expr
    lone = scoremod.trace(lambda s, b, h, qi, ki: s + (ki - qi))
    assert str(mosaic.split_axes(lone.expr)) == "<f32 score + (f32(kv_idx) - f32(q_idx))>"
    assert mosaic.axis_parts(mosaic.prepared(None)[0]) == ()


@pytest.mark.parametrize("case,b,shape,dtype", [
    ("alibi_unmasked", 2, dict(sq=150, skv=260, hq=4, hkv=2, d=64), jnp.bfloat16),
    ("log_scaled", 1, dict(sq=200, skv=200, hq=2, hkv=1, d=128), jnp.float16),
    ("key_terms", 2, dict(sq=130, skv=190, hq=2, hkv=2, d=64), jnp.bfloat16),
])
def test_one_axis_parts_interpreted(case, b, shape, dtype, interprets):
    """Mods with terms of one position (ALiBi split, a factor of the query, a term
    of the key beside a vector read, which stays a read), their forward computing
    those terms on the tile's vectors, forward and backward in interpret mode
    against the reference."""
    _interpreted_against_reference(
        case, b, shape, dtype, lambda e: mosaic.axis_parts(mosaic.prepared(e)[0]))


@pytest.mark.parametrize("case,b,shape,dtype", [
    ("block_map", 2, dict(sq=300, skv=250, hq=4, hkv=2, d=64), jnp.bfloat16),
    ("block_bias", 1, dict(sq=200, skv=330, hq=2, hkv=1, d=128), jnp.float16),
])
def test_block_reads_interpreted(case, b, shape, dtype, interprets):
    """Mods that read captured arrays at whole blocks of positions (video sparse
    attention's tile map per batch and head with its padded keys; a float bias
    per 48 queries by 32 keys, whose blocks' edges fall inside the kernels'
    tiles, up to four of them across a tile), forward and backward on the Mosaic
    kernels in interpret mode against the reference path."""
    _interpreted_against_reference(case, b, shape, dtype, mosaic.block_reads)


def _interpreted_against_reference(case, b, shape, dtype, reads):
    """``case`` (pc.vector_mod's) forward and backward on the Mosaic kernels in
    interpret mode against the reference path; ``reads(expr)`` must find the
    reads the case is about."""
    q, k, v, do = pc.inputs(b=b, dtype=dtype, **shape)
    mod, operands = pc.traced_vector_mod(case, q, k)
    assert reads(mod.expr), case
    plan = pc.pallas_plan(mod, q, k, v, MOSAIC, scale=0.4 if shape["d"] == 64 else 0.3)
    assert plan.interpret and plan.engine == "mosaic" and plan.backward_engine == "mosaic"
    ref = REFERENCE.plan(Problem.of(q, k, v), mod, plan.scale, MOSAIC, True)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    want = pc.run(REFERENCE, ref, f32(q), f32(k), f32(v), f32(do), operands, False)
    # The kernels one after another, outside jit: under one jit XLA may start the
    # dQ and dK/dV kernels together, and two interpreted kernels can starve each
    # other's simulated warpgroups of the CPU runtime's threads (a hang, not a result).
    o, lse = pallas_backend._forward(plan, q, k, v, operands)
    dlse = jnp.where(jnp.isfinite(lse), 0.1, 0.0)  # the loss's 0.1 * sum(finite LSE)
    dq, dk, dv, _ = pallas_backend._backward(plan, q, k, v, o, lse, do, dlse, operands, ())
    errs = pc.relative_errors((o, lse, dq, dk, dv, ()), want)
    assert all(e < 3e-2 for e in errs.values()), errs


@pytest.mark.parametrize("case", ["document_bidirectional", "shifted_bias", "block_map",
                                  "alibi_unmasked", "log_scaled", "key_terms", "pair_bias",
                                  "wider_bias", "half_bias", "masked_bias", "transposed_bias",
                                  "pair_features", "query_pairs_bias", "grid_bias", "swin_bias"])
def test_vector_reads_lower(case, hopper_here):
    """Vector reads lower for CUDA: gradients of q, k, v to the three Mosaic GPU
    kernels; with a float vector along the keys learned, its gradient from the
    Mosaic dK/dV kernel too (no Triton kernel)."""
    q, k, v, do = pc.inputs(b=2, sq=300, skv=260, hq=4, hkv=2, d=128, dtype=jnp.bfloat16)
    fn, operands = pc.vector_mod(case, 2, 4, 300, 260)

    def loss(q, k, v, operands):
        mod = lambda s, b, h, qi, ki: fn(s, b, h, qi, ki, *operands)  # noqa: E731
        o = scoremod.attention(q, k, v, mod, implementation="pallas", options=MOSAIC)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

    assert _kernels(_lower_call(jax.grad(loss, argnums=(0, 1, 2)), q, k, v, operands)) == \
        {"mosaic": 3, "triton": 0}
    if case == "shifted_bias":
        learn = lambda q, k, v, w: loss(q, k, v, (operands[0], w))  # noqa: E731
        assert _kernels(_lower_call(jax.grad(learn, argnums=(0, 3)), q, k, v, operands[1])) == \
            {"mosaic": 3, "triton": 0}


# --------------------------------------------------------------------------- #
# Short tables read at indices that vary over the tile: chains of selects (selects.py)


def _gathers(expr):
    return [n for n in ir.toposort(expr) if n.op == ir.LOAD and mosaic.read_axis(n) is False]


def test_short_axis_gathers_are_spelled_as_selects():
    """A table read through other arrays at both tile axes is rewritten over its
    shortest axis that leaves reads the kernels make (here the 3 kinds of the
    query's token: vectors along the keys); the chain's value is the read's at
    every index, past both ends too (reads clamp), and at an index computed from
    the score; a gather along long axes, or a bool table, stays as written, and
    the Mosaic engine reads it per score."""
    from scoremod.lowering.pallas import selects

    kind = jnp.asarray([0, 2, 1, 5, -1, 1], jnp.int32)  # 5 and -1 read past the ends
    pair = jnp.asarray(np.arange(12.0).reshape(4, 3), jnp.float32)
    mod = scoremod.trace(lambda s, b, h, qi, ki: s + pair[kind[qi] + 1, kind[ki]])
    assert len(_gathers(mod.expr)) == 1
    spelled = selects.spelled(mod.expr)
    assert _gathers(spelled) == []
    reads = [n for n in ir.toposort(spelled) if n.op == ir.LOAD and n.args[0].attr[1] == (4, 3)]
    assert sorted(mosaic.read_axis(n) for n in reads) == ["q_idx"] * 3  # the key's 3 kinds
    qi, ki = np.meshgrid(np.arange(6), np.arange(6), indexing="ij")
    values = dict(zip(mod.operand_names, mod.operands))
    at = lambda i, n: np.clip(np.where(i < 0, i + n, i), 0, n - 1)  # noqa: E731 - as jnp reads
    want = np.asarray(pair)[at(np.asarray(kind)[qi] + 1, 4), at(np.asarray(kind)[ki], 3)]
    for expr in (mod.expr, spelled):
        got = evaluate(expr, {"score": jnp.zeros((6, 6)), "b": 0, "h": 0, "q_idx": qi,
                              "kv_idx": ki}, values)
        np.testing.assert_array_equal(got, want)
    # an index computed from the score (its derivative through the index is 0 either way)
    steps = jnp.asarray([[-1.0, 0.5, 2.0], [0.0, 1.0, 3.0]], jnp.float32)
    by_score = scoremod.trace(lambda s, b, h, qi, ki: s + steps[h, (s > 0).astype(jnp.int32)
                                                                + (s > 1).astype(jnp.int32)])
    spelled = selects.spelled(by_score.expr)
    assert _gathers(by_score.expr) and not _gathers(spelled)
    s = jnp.linspace(-2.0, 2.0, 9)[:, None]
    values = dict(zip(by_score.operand_names, by_score.operands))
    for h in (0, 1):
        grid = {"score": s, "b": 0, "h": h, "q_idx": 0, "kv_idx": 0}
        np.testing.assert_array_equal(evaluate(spelled, grid, values),
                                      evaluate(by_score.expr, grid, values))
    long = jnp.zeros((64, 64), jnp.float32)
    flags = jnp.zeros((3, 3), bool)
    for fn in (lambda s, b, h, qi, ki: s + long[kind[qi], ki % 64],
               lambda s, b, h, qi, ki: jnp.where(flags[kind[qi], kind[ki]], s, -jnp.inf)):
        kept = scoremod.trace(fn)
        assert selects.spelled(kept.expr) is kept.expr
        assert mosaic.refusal(kept.expr, kept.sources) is None and any(
            mosaic.gathered(n) for n in _gathers(kept.expr))


@pytest.mark.parametrize("case,b,shape,dtype", [
    ("kind_pair", 2, dict(sq=200, skv=150, hq=4, hkv=2, d=64), jnp.bfloat16),
    ("kind_mask", 2, dict(sq=130, skv=190, hq=2, hkv=1, d=128), jnp.float16),
])
def test_short_axis_gathers_interpreted(case, b, shape, dtype, interprets):
    """A bias between token kinds (a per-head 3 x 3 table read at each side's
    kind), and a mask of which kinds see which (an int table) with a float scale
    per kind pair, causal: forward and backward on the Mosaic kernels in
    interpret mode, against the reference path."""
    _interpreted_against_reference(case, b, shape, dtype, _gathers)


@pytest.mark.parametrize("case,spelled", [("kind_pair", True), ("kind_query_scale", False),
                                          ("kind_key_bias", False)])
def test_short_axis_gathers_learned_interpreted(case, spelled, interprets):
    """The kind-pair bias learned (each entry, a vector along the queries, from the
    dQ kernel's per-query sums, placed by the queries' kinds at run time), a factor
    per head and query kind (the same sums), and a bias per head and key kind (the
    dK/dV kernel's per-key sums, placed by the keys' kinds): against the reference
    path; twice the same bits; no Triton kernel."""
    def on_mosaic(plan, learned):
        assert (plan.spelled is not None) == spelled and plan.triton_operands == (), \
            plan.describe()

    _learns_interpreted_twice(case, dict(sq=200, skv=150, hq=4, hkv=2, d=64), on_mosaic)


def test_short_axis_gathers_lower_to_mosaic_kernels_only(hopper_here):
    """jax.grad of a call that learns a bias between token kinds, written against
    the kinds of documents (gathered.fold reads it through document ids first),
    lowers for CUDA to the three Mosaic kernels and no Triton kernel."""
    q, k, v, do = pc.inputs(b=2, sq=256, skv=256, hq=2, hkv=1, d=64, dtype=jnp.bfloat16)
    doc = jnp.asarray(np.arange(256) // 64, jnp.int32)
    kind_of_doc = jnp.asarray([0, 1, 0, 2], jnp.int32)

    def loss(q, k, v, pair):
        def mod(s, b, h, qi, ki):
            return s + pair[h, kind_of_doc[doc[qi]], kind_of_doc[doc[ki]]]

        o = scoremod.attention(q, k, v, mod, implementation="pallas", options=MOSAIC)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

    pair = jnp.zeros((2, 3, 3), jnp.float32)
    assert _kernels(_lower_call(jax.grad(loss, argnums=(0, 1, 2, 3)), q, k, v, pair)) == \
        {"mosaic": 3, "triton": 0}


def test_a_read_through_arrays_past_the_one_hot_bound_is_learned_elsewhere(hopper_here):
    """A learned read along the keys through captured arrays is placed by a one-hot
    product of B x H x Skv x entries: a per-kind bias is learned on the Mosaic
    backward, a per-position one read through a permutation (past 2^26 entries at
    b4 h16 s4096) is left to the Triton backward by the plan, saying why."""
    q = jnp.zeros((4, 4096, 16, 64), jnp.bfloat16)
    perm = jnp.asarray(np.random.default_rng(0).permutation(4096), jnp.int32)
    kind = perm % 3
    per_kind, per_position = jnp.zeros((16, 3)), jnp.zeros((16, 4096))
    for w, at, learned in ((per_kind, kind, True), (per_position, perm, False)):
        mod = scoremod.trace(lambda s, b, h, qi, ki, w=w, at=at: s + w[h, at[ki]])
        plan = PALLAS.plan(Problem.of(q, q, q), mod, 0.125, MOSAIC, False)
        assert plan.backward_engine == "mosaic", plan.describe()
        if learned:
            assert plan.triton_operands == (), plan.describe()
        else:
            (name, why), = plan.triton_operands
            assert "one-hot product of 1073741824 entries" in why, why


def test_the_kernels_claim_a_bias_cudnn_computes_ahead_from_arrays(hopper_here):
    """implementation=None gives a small table read through other arrays to the
    Mosaic engine, where cuDNN would compute it ahead as a [B, H, Sq, Skv] float32
    tensor (it says so), and the call, gradients included, lowers to the Mosaic
    kernels alone; a bias cuDNN reads as vectors (no such tensor) stays on cuDNN."""
    b, s, h = 2, 512, 2
    q, k, v, do = pc.inputs(b=b, sq=s, skv=s, hq=h, hkv=h, d=64, dtype=jnp.bfloat16)
    kind = jnp.asarray(np.random.default_rng(0).integers(0, 3, (b, s)), jnp.int32)
    pair, w = jnp.zeros((h, 3, 3), jnp.float32), jnp.zeros((h, s), jnp.float32)

    def kinds(s_, b_, h_, qi, ki):
        return s_ + pair[h_, kind[b_, qi], kind[b_, ki]]

    choice = scoremod.which_implementation(q, k, v, kinds)
    assert choice[0] == "pallas", choice
    assert f"[{b},{h},{s},{s}] float32 tensor" in choice[1] and "claims" in choice[1], choice
    vectors = scoremod.which_implementation(q, k, v, lambda s_, b_, h_, qi, ki: s_ + w[h_, ki])
    assert vectors[0] == "cudnn", vectors

    def loss(q, k, v):
        o = scoremod.attention(q, k, v, kinds)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

    assert _kernels(_lower_call(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)) == \
        {"mosaic": 3, "triton": 0}


# --------------------------------------------------------------------------- #
# Captured arrays read at q_idx - kv_idx (relative-position tables): tiles per diagonal


def test_offset_reads():
    """A read whose index sees q_idx and kv_idx only as their difference (either
    sign, through any arithmetic, inside another read's index too) is read per
    diagonal; the index of such a read needs no index tile; a second table read
    at q_idx - kv_idx is refused (shared memory holds one), naming its line."""
    t = jnp.ones((4, 300), jnp.float32)
    u = jnp.ones((300,), jnp.int32)
    for fn in (lambda s, b, h, qi, ki: s + t[h, qi - ki + 150],
               lambda s, b, h, qi, ki: s + t[h, jnp.clip(ki - qi, -8, 8) * 2 + 20],
               lambda s, b, h, qi, ki: s + t[h, u[ki - qi + 150]]):
        mod = scoremod.trace(fn)
        (read,) = mosaic.offset_reads(mod.expr)
        assert mosaic.read_axis(read) == mosaic.OFFSET and not mosaic.vector_reads(mod.expr)
        assert not mosaic.uses_var(mod.expr, "q_idx") and not mosaic.uses_var(mod.expr, "kv_idx")
        assert ir.variables(mosaic.offset_source(read)) <= {"h", "q_idx"}
        assert mosaic.refusal(mod.expr, mod.sources) is None
    two = scoremod.trace(lambda s, b, h, qi, ki: s + t[h, qi - ki + 150] + t[0, ki - qi + 7])
    why = mosaic.refusal(two.expr, two.sources)
    assert "one array read at q_idx - kv_idx per mod" in why and "test_pallas_mosaic.py" in why
    same = scoremod.trace(lambda s, b, h, qi, ki: jnp.where(t[h, qi - ki + 150] > 0,
                                                            s + t[h, qi - ki + 150], s))
    assert mosaic.refusal(same.expr, same.sources) is None  # one source, read twice
    # Bool flags at q_idx - kv_idx are refused (not run on the GPU; bool reads along one
    # tile axis went wrong there); the same flags as an int array run.
    flags = jnp.arange(300) % 3 == 0
    as_bool = scoremod.trace(lambda s, b, h, qi, ki: jnp.where(flags[qi - ki + 150], s,
                                                               -jnp.inf))
    why = mosaic.refusal(as_bool.expr, as_bool.sources)
    assert "bool array read at q_idx - kv_idx" in why and "test_pallas_mosaic.py" in why
    ints = flags.astype(jnp.int32)
    as_int = scoremod.trace(lambda s, b, h, qi, ki: jnp.where(ints[qi - ki + 150] != 0, s,
                                                              -jnp.inf))
    assert mosaic.refusal(as_int.expr, as_int.sources) is None


@pytest.mark.parametrize("sq,skv", [(384, 256), (128, 640)])
@pytest.mark.parametrize("rows,cols,keys_down", [(128, 128, False), (64, 64, False),
                                                  (64, 64, True)])
def test_offset_diagonals(rows, cols, keys_down, sq, skv):
    """On padded lengths sq x skv, for every program (q0, k0) of the kernels' tiles (the forward's 128 x 128 of
    two warpgroups, dQ's 64 x 64, dK/dV's keys down), its window is 16-byte
    aligned and inside the array, and the tile spread from it (interpret mode's
    gather, the GPU's contract) is the read evaluated by the reference path on
    that tile, per batch and head where the read uses them; int arrays as int32."""
    rng = np.random.default_rng(6)
    table = jnp.asarray(rng.normal(size=(3, 700)), jnp.float32)
    buckets = jnp.asarray(rng.integers(0, 7, size=(2, 900)), jnp.int32)
    mods = [lambda s, b, h, qi, ki: s + table[h, qi - ki + 300],
            lambda s, b, h, qi, ki: jnp.where(buckets[b, ki - qi + 400] > 3, s, -jnp.inf)]
    from scoremod.lowering.pallas import codegen

    for fn in mods:
        mod = scoremod.trace(fn)
        names, values = mod.operand_names, tuple(mod.operands)
        flat = tuple(codegen.kernel_operand(x, n) for x, n in zip(values, mod.operand_nodes))
        (read,) = mosaic.offset_reads(mod.expr)
        diagonals = mosaic.OffsetDiagonals.build(mosaic.offset_sources((read,)), names, flat,
                                                 2, 3, rows, cols, sq, skv)
        (arr,) = diagonals.arrays
        used = ir.variables(read)
        assert arr.dtype == (jnp.float32 if read.dtype == ir.F32 else jnp.int32)
        assert arr.shape == (2 if "b" in used else 1, 3 if "h" in used else 1, sq + skv)
        tile_q = 64  # queries per tile: a warpgroup's in the forward
        for q0 in range(0, sq, rows):
            for k0 in range(0, skv, cols):
                start = diagonals.start(q0, k0)
                assert start % 4 == 0 and 0 <= start <= arr.shape[-1] - diagonals.window
                for row in range(0, rows, tile_q):
                    shape = (cols, tile_q) if keys_down else (tile_q, cols)
                    r = q0 + row + jnp.arange(tile_q)
                    c = k0 + jnp.arange(cols)
                    qi, ki = (r[None, :], c[:, None]) if keys_down else (r[:, None], c[None, :])
                    for bi in range(arr.shape[0]):
                        for hi in range(arr.shape[1]):
                            window = arr[bi, hi, start:start + diagonals.window]
                            view = window[row:row + tile_q + cols - 1]  # tile()'s slice
                            got = mosaic.diagonal_gather(view, cols - 1, -1 if keys_down else 1,
                                                         shape, interpret=True)
                            want = evaluate(read, {"b": bi, "h": hi, "q_idx": qi, "kv_idx": ki},
                                            dict(zip(names, values)))
                            np.testing.assert_array_equal(
                                np.asarray(got),
                                np.broadcast_to(np.asarray(want).astype(arr.dtype), shape))


@pytest.mark.parametrize("case,b,shape,dtype", [
    ("relative_bias", 2, dict(sq=300, skv=260, hq=4, hkv=2, d=64), jnp.bfloat16),
    ("relative_softcap", 1, dict(sq=130, skv=200, hq=2, hkv=1, d=128), jnp.float16),
    ("relative_buckets", 1, dict(sq=200, skv=136, hq=2, hkv=2, d=64), jnp.bfloat16),
    ("relative_causal", 1, dict(sq=320, skv=320, hq=2, hkv=1, d=64), jnp.bfloat16),
    ("relative_document", 2, dict(sq=256, skv=256, hq=2, hkv=1, d=64), jnp.bfloat16),
    ("relative_masked", 1, dict(sq=450, skv=450, hq=2, hkv=1, d=64), jnp.bfloat16),
])
def test_offset_reads_interpreted(case, b, shape, dtype, interprets):
    """Relative-position tables forward and backward on the Mosaic kernels in
    Mosaic GPU's interpret mode, against the reference path (O, LSE, dQ, dK, dV
    with an LSE cotangent): a table per head with a clamped index, grouped heads
    and tails; jax.numpy's wrapped negative index under a softcap, float16, Sq <
    Skv; T5's int buckets at kv_idx - q_idx indexing a float table; a causal
    table (the map skips tiles and marks full ones, whose mod drops the mask); a
    table beside document ids (vector reads and the diagonals in one program);
    -inf runs in a table (the map, bounded from the diagonals, skips tiles)."""
    _interpreted_against_reference(case, b, shape, dtype, mosaic.offset_reads)


def test_offset_reads_lower(hopper_here):
    """A relative-position table lowers for CUDA to the three Mosaic GPU kernels;
    with the table learned, to four: its gradient from the per-block-diagonal
    kernel, no Triton one (with dK and dV not asked for, JAX drops the dK/dV
    kernel: three)."""
    q, k, v, do = pc.inputs(b=2, sq=300, skv=260, hq=4, hkv=2, d=128, dtype=jnp.bfloat16)
    fn, operands = pc.vector_mod("relative_softcap", 2, 4, 300, 260)

    def loss(q, k, v, table):
        mod = lambda s, b, h, qi, ki: fn(s, b, h, qi, ki, table)  # noqa: E731
        o = scoremod.attention(q, k, v, mod, implementation="pallas", options=MOSAIC)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

    assert _kernels(_lower_call(jax.grad(loss, argnums=(0, 1, 2)), q, k, v, *operands)) == \
        {"mosaic": 3, "triton": 0}
    assert _kernels(_lower_call(jax.grad(loss, argnums=(0, 1, 2, 3)), q, k, v, *operands)) == \
        {"mosaic": 4, "triton": 0}
    assert _kernels(_lower_call(jax.grad(loss, argnums=(0, 3)), q, k, v, *operands)) == \
        {"mosaic": 3, "triton": 0}


def test_offset_and_vector_reads_share_shared_memory(hopper_here, monkeypatch):
    """A relative table beside document ids fits the forward's shared memory at
    head dims 64 and 128 (a window of the table's diagonals per stage, 1 KiB; the
    two warpgroups' own 64 x 128 tiles left 152 bytes too few at 128): the call
    lowers to the three Mosaic GPU kernels, which the CUDA lowering checks
    against the 227 KiB."""
    monkeypatch.setattr(jax, "__version__", "0.11.2")
    doc = pc.doc_ids(2, 512)
    t = jax.random.normal(jax.random.PRNGKey(1), (4, 1023))

    def fn(s, b, h, qi, ki):
        return jnp.where(doc[b, qi] == doc[b, ki], s + t[h, qi - ki + 511], -jnp.inf)

    for d in (64, 128):
        q, k, v, do = pc.inputs(b=2, sq=512, skv=512, hq=4, hkv=2, d=d, dtype=jnp.bfloat16)
        problem, mod = Problem.of(q, k, v), scoremod.trace(fn)
        assert PALLAS.why_not(problem, mod, automatic=False, options=MOSAIC) is None

        def loss(q, k, v):
            o = scoremod.attention(q, k, v, fn, implementation="pallas", options=MOSAIC)
            return jnp.sum(o.astype(jnp.float32))

        assert _kernels(_lower_call(jax.grad(loss, argnums=(0, 1, 2)), q, k, v)) == \
            {"mosaic": 3, "triton": 0}


def test_flags_along_one_tile_axis(hopper_here):
    """Flags read along one tile axis under an `or` are refused on both engines,
    bool or int (wrong on the H200, codegen.ONE_AXIS_READ_UNDER_OR), naming the read
    and the line. Read outside an `or` they run, and the Mosaic backward learns
    arrays read per program (slopes[h]) and along the keys (bias[kv_idx]) next to
    them."""
    q, k, v, do = pc.inputs(b=1, sq=128, skv=128, hq=2, hkv=1, d=64, dtype=jnp.bfloat16)
    flags = jnp.arange(128) % 9 == 0
    ints = flags.astype(jnp.int32)
    slopes = jnp.asarray([0.5, 0.25], jnp.float32)
    bias = jnp.linspace(-1.0, 1.0, 128)
    for options in (MOSAIC, TRITON):
        for globals_ in (lambda ki: flags[ki], lambda ki: ints[ki] != 0):
            with pytest.raises(ScoreModError, match="the cause is not found yet") as e:
                scoremod.attention(q, k, v, lambda s, b, h, qi, ki: jnp.where(
                    globals_(ki) | (qi >= ki), s, -jnp.inf), implementation="pallas",
                    options=options)
            assert "c0[kv_idx]" in str(e.value) and "test_pallas_mosaic.py" in str(e.value)

    def loss(q, k, v, slopes, bias):
        mod = lambda s, b, h, qi, ki: jnp.where(  # noqa: E731
            (ints[ki] != 0) & (qi >= ki), s + slopes[h] + bias[ki], -jnp.inf)
        o = scoremod.attention(q, k, v, mod, implementation="pallas", options=MOSAIC)
        return jnp.sum(o.astype(jnp.float32))

    for wrt in ((0, 1, 2), (0, 3), (0, 4), (0, 3, 4)):
        assert _kernels(_lower_call(jax.grad(loss, argnums=wrt), q, k, v, slopes, bias)) == \
            {"mosaic": 3, "triton": 0}, wrt


# --------------------------------------------------------------------------- #
# pallas_engine="auto" (the default): the Mosaic GPU engine where it takes the call


def test_auto_engine(monkeypatch):
    """On a Hopper GPU with jax 0.11, "auto" plans the Mosaic engine (its tiles, its
    backward) for what it runs, gathers too; the Triton engine for float32, other
    head dims, and two tables read at q_idx - kv_idx, saying why; off Hopper
    and on older jax, the Triton engine. The plan's description and
    which_implementation's ``variant`` name the engine and the reason."""
    auto = scoremod.LoweringOptions()
    monkeypatch.setattr(device, "current", lambda: HOPPER)
    monkeypatch.setattr(jax, "__version__", "0.11.2")
    q = jnp.zeros((1, 256, 4, 128), jnp.bfloat16)
    softcap = pc.traced("softcap", q, q)[0]
    document = pc.traced("document_softcap", q, q)[0]
    for mod in (None, softcap, document):
        assert PALLAS.why_not(_problem(), mod, False, auto) is None
        plan = PALLAS.plan(_problem(), mod, 0.125, auto, True)
        assert plan.engine == "mosaic" and plan.backward_engine == "mosaic", plan.describe()
        assert plan.forward_blocks == (mosaic.TILE_Q, mosaic.BLOCK_KV)
        assert 'Mosaic GPU forward and backward' in plan.describe()
        assert 'pallas_engine="auto": it takes the call' in plan.describe()
        assert PALLAS.variant(_problem(), mod, auto) == (
            'the Mosaic GPU engine (pallas_engine="auto": it takes the call)')
    relative = pc.traced("relative_bias", q, q)[0]
    assert PALLAS.plan(_problem(), relative, 0.125, auto, True).engine == "mosaic"
    gather = pc.traced_vector_mod("grid_bias", q, q)[0]
    # A relative-position table: implementation=None takes it from cuDNN (which would
    # materialize it) to the Mosaic engine, not to the Triton engine (slower than cuDNN).
    from scoremod.lowering.cudnn.backend import CUDNN

    from scoremod import route

    takes_all = {name: None for name in scoremod.lowering.registry.names()}
    assert "table at q_idx - kv_idx" in PALLAS.claims(_problem(), relative, auto, CUDNN)
    chosen, why = route._claimed(CUDNN, _problem(), relative, takes_all, auto)
    assert chosen is PALLAS and why.startswith("pallas: it claims the call from cudnn"), why
    for problem, mod, options in ((_problem(), relative, TRITON), (_problem(), gather, auto),
                                  (_problem(dtype="float32"), relative, auto), (_problem(), None, auto)):
        assert PALLAS.claims(problem, mod, options, CUDNN) is None
        assert route._claimed(CUDNN, problem, mod, takes_all, options) == (None, None)
    assert PALLAS.plan(_problem(), gather, 0.125, auto, True).engine == "mosaic"  # per score
    t1 = jnp.ones((4, 511), jnp.float32)
    t2 = t1 * 0.5
    two_tables = scoremod.trace(
        lambda s, b, h, qi, ki: s + t1[h, qi - ki + 255] + t2[h, qi - ki + 255])
    triton = {"float32": (_problem(dtype="float32"), None, "float16 or bfloat16"),
              "dv64": (_problem(d=128, dv=64), softcap, "head dims of 64 or 128"),
              "two tables": (_problem(), two_tables, "one array read at q_idx - kv_idx")}
    for name, (problem, mod, why) in triton.items():
        assert PALLAS.why_not(problem, mod, False, auto) is None, name
        plan = PALLAS.plan(problem, mod, 0.125, auto, True)
        assert plan.engine == "triton" and plan.backward_engine == "triton", name
        assert plan.forward_blocks == (auto.pallas_block_q, auto.pallas_block_kv), name
        assert why in plan.describe() and "Triton engine" in plan.describe(), plan.describe()
        assert 'pallas_engine="triton") runs it' not in plan.describe()  # it does, already
        assert why in PALLAS.variant(problem, mod, auto), name
        assert PALLAS.variant(problem, mod, auto).startswith("the Triton engine"), name
    # which_implementation: the engine of the Pallas kernels when they take the call.
    qs = jnp.zeros((1, 256, 4, 128), jnp.bfloat16)
    choice = scoremod.which_implementation(qs, qs, qs, lambda s, b, h, qi, ki: 30.0 * jnp.tanh(
        s / 30.0) + jnp.sin(s))
    if choice.implementation == "pallas":
        assert choice.variant == 'the Mosaic GPU engine (pallas_engine="auto": it takes the call)'
    # float32 asked for automatically: the Triton engine's own refusal.
    assert "float32" in PALLAS.why_not(_problem(dtype="float32"), None, True, auto)
    # Named engines stay as they were.
    assert PALLAS.plan(_problem(), softcap, 0.125, TRITON, True).engine == "triton"
    assert PALLAS.variant(_problem(), softcap, TRITON) == \
        'the Triton engine (pallas_engine="triton")'
    assert "Mosaic" not in PALLAS.plan(_problem(), softcap, 0.125, TRITON, True).describe()
    # Older jax: the Triton engine, saying so.
    monkeypatch.setattr(jax, "__version__", "0.10.2")
    plan = PALLAS.plan(_problem(), softcap, 0.125, auto, True)
    assert plan.engine == "triton" and "written for jax 0.11 or later" in plan.describe()


def test_auto_engine_off_hopper():
    """Off a Hopper GPU (here: the CPU) "auto" runs the Triton engine, and
    which_implementation says which engine and why."""
    if device.current().family == 9:
        pytest.skip("runs on a Hopper GPU here")
    q = jnp.ones((1, 128, 2, 64), jnp.float32)
    plan = PALLAS.plan(Problem.of(q, q, q), None, 0.125, scoremod.LoweringOptions(), True)
    assert plan.engine == "triton" and plan.backward_engine == "triton"
    variant = PALLAS.variant(Problem.of(q, q, q), None, scoremod.LoweringOptions())
    assert variant.startswith('the Triton engine (pallas_engine="auto": ')
    choice = scoremod.which_implementation(q, q, q)
    assert choice.implementation == "xla" and choice.variant is None  # one way: no variant
    with scoremod.lowering_options(pallas_engine="mosaic"):
        assert scoremod.which_implementation(q, q, q).verdicts["pallas"]
    got = scoremod.attention(q, q, q, implementation="pallas")
    want = scoremod.attention(q, q, q, implementation="xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_kernel_digests_identify_the_kernels(lowers, tmp_path):
    """``benchmarks/probes/kernel_sizes.py --digests``, the check that a refactor
    lowers to the same kernels: a kernel's digest leaves out where its code
    lives (a copy of the package elsewhere, its kernel modules' lines shifted,
    gives the same digests) and tells mods apart (it hashes the kernel, not
    something constant)."""
    import shutil

    root = Path(__file__).resolve().parents[1]
    copy = tmp_path / "elsewhere"
    shutil.copytree(root / "scoremod", copy / "scoremod",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copytree(root / "benchmarks" / "probes", copy / "benchmarks" / "probes",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("mosaic.py", "mosaic_backward.py"):
        path = copy / "scoremod" / "lowering" / "pallas" / name
        path.write_text("# shifted\n\n" + path.read_text())

    def digests(tree):
        out = subprocess.run([sys.executable, str(tree / "benchmarks/probes/kernel_sizes.py"),
                              "--seq", "256", "--digests"], capture_output=True, text=True,
                             cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        rows = dict(re.findall(r"^(scoremod \w+): .*digests ((?:[0-9a-f]{16} ?){3})$",
                               out.stdout, re.M))
        assert set(rows) == {"scoremod none", "scoremod softcap", "scoremod relbias",
                             "scoremod document"}, out.stdout
        return {name: tuple(d.split()) for name, d in rows.items()}

    here = digests(root)
    assert digests(copy) == here
    kernels = [k for ks in here.values() for k in ks]
    assert len(set(kernels)) == len(kernels), here


def test_learned_relative_tables_have_no_size_bound_on_the_mosaic_backward(interprets,
                                                                          monkeypatch):
    """The Triton backward sums a learned array's share in a row of at most
    MAX_GRADIENT_ELEMENTS (a table read at q_idx - kv_idx: up to seq 32768) and refuses
    a longer one; the per-block-diagonal kernel needs no such row: with the bound
    below the table's length, the Mosaic backward still learns it (the same bits as
    with the bound above it) and the Triton one refuses, saying why."""
    q, k, v, do = pc.inputs(b=1, sq=70, skv=100, hq=1, hkv=1, d=64, dtype=jnp.bfloat16)
    mod, operands = pc.traced_vector_mod("relative_causal", q, k)
    name = mod.operand_names[-1]
    plan = pc.pallas_plan(mod, q, k, v, MOSAIC, skip=True, scale=0.3)
    ref = REFERENCE.plan(Problem.of(q, k, v), mod, plan.scale, MOSAIC, True)
    o, lse = pc.run(REFERENCE, ref, q, k, v, do, operands, True)[:2]
    dlse = jnp.zeros_like(lse)

    def learn(plan):
        return pallas_backend._backward(plan, q, k, v, o.astype(q.dtype), lse, do, dlse,
                                        operands, (name,))

    want = learn(plan)
    monkeypatch.setattr(pallas_backend, "MAX_GRADIENT_ELEMENTS", 64)
    got = learn(plan)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)
    triton = pc.pallas_plan(mod, q, k, v, scoremod.LoweringOptions(pallas_engine="triton"),
                            skip=True, scale=0.3)
    with pytest.raises(scoremod.ScoreModError, match="up to seq 32768 on the Triton backward"):
        learn(triton)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ["natten", "batchify_causal", "block_diffusion",
                                  "dilated_sliding_window", "morton_natten"])
def test_claimed_static_masks_interpreted(name, dtype, interprets):
    """The catalogue's static masks the Mosaic GPU engine claims (Pallas.claims: by
    tile counts, or a mask cuDNN would compute ahead, as Morton-order NATTEN's bit
    operations), at the catalogue's CPU shape: forward and backward in interpret
    mode against the reference path."""
    from tests.catalogue.mods import CATALOGUE

    entry = CATALOGUE[name]
    shape = entry.cpu
    mod = scoremod.trace(entry.build(entry.env(shape)))
    q, k, v, do = pc.inputs(b=1, sq=shape.sq, skv=shape.skv, hq=2, hkv=1, d=64, dtype=dtype)
    plan = pc.pallas_plan(mod, q, k, v, MOSAIC, scale=0.4)
    assert plan.interpret and plan.engine == "mosaic" and plan.backward_engine == "mosaic"
    ref = REFERENCE.plan(Problem.of(q, k, v), mod, plan.scale, MOSAIC, True)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    want = pc.run(REFERENCE, ref, f32(q), f32(k), f32(v), f32(do), (), False)
    o, lse = pallas_backend._forward(plan, q, k, v, ())
    dlse = jnp.where(jnp.isfinite(lse), 0.1, 0.0)  # the loss's 0.1 * sum(finite LSE)
    dq, dk, dv, _ = pallas_backend._backward(plan, q, k, v, o, lse, do, dlse, (), ())
    errs = pc.relative_errors((o, lse, dq, dk, dv, ()), want)
    assert all(e < 3e-2 for e in errs.values()), errs


def test_a_static_map_of_only_full_tiles_runs_one_mod_without_flags(interprets, monkeypatch):
    """A map known when tracing whose visited tiles are all full (keys before 512, four
    query rows) runs the full tiles' mod on every tile, with no flags and no branch
    (a decode step's window: its flags, one value, would cost XLA a broadcast kernel
    per call): the same O and LSE as the reference path; a map with partial tiles
    (causal) keeps the branch."""
    specs = []
    forward = mosaic.forward
    monkeypatch.setattr(mosaic, "forward", lambda spec, *a, **k: specs.append(spec)
                        or forward(spec, *a, **k))
    for fn, uniform in ((lambda s, b, h, qi, ki: jnp.where(ki < 512, 30.0 * jnp.tanh(s / 30.0),
                                                           -jnp.inf), True),
                        (lambda s, b, h, qi, ki: jnp.where(qi >= ki, s, -jnp.inf), False)):
        q, k, v, _ = pc.inputs(b=1, sq=4 if uniform else 256, skv=1024 if uniform else 256,
                               hq=2, hkv=1, d=64, dtype=jnp.bfloat16)
        mod = scoremod.trace(fn)
        plan = PALLAS.plan(Problem.of(q, k, v), mod, 0.125, MOSAIC, True)
        assert plan.interpret and plan.full_expr is not None, plan.describe()
        specs.clear()
        got = pallas_backend._forward(plan, q, k, v, ())
        (spec,) = specs
        if uniform:
            assert spec.full_expr is None and spec.expr is plan.full_expr
        else:
            assert spec.full_expr is plan.full_expr
        ref = REFERENCE.plan(Problem.of(q, k, v), mod, 0.125, MOSAIC, True)
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        want = REFERENCE.forward(ref, f32(q), f32(k), f32(v), ())
        for a, b in zip(got, want):  # O and LSE (every row sees a key)
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            assert np.max(np.abs(a - b)) <= 3e-2 * np.max(np.abs(b)), (uniform, a, b)


@pytest.mark.parametrize("case,parts,shape", [
    ("softcap", 3, dict(sq=4, skv=700, hq=2, hkv=1, d=64)),  # 6 key tiles: parts of 2
    ("masked_rows", 4, dict(sq=40, skv=300, hq=1, hkv=1, d=64)),  # 3 tiles: one part empty
    ("alibi", 5, dict(sq=8, skv=520, hq=2, hkv=2, d=128)),  # 5 tiles: a tile per part
])
def test_forward_key_parts_interpreted(case, parts, shape, interprets):
    """The forward with each query tile's key list split over ``parts`` programs
    (decoding: ``PallasPlan.key_parts``), in interpret mode: the parts' O and LSE
    joined equal the reference path's, with a part that has no key tile and
    rows that see no key (O 0, LSE -inf); and one program per tile's up to the
    join's rounding."""
    q, k, v, _ = pc.inputs(b=2, dtype=jnp.bfloat16, **shape)
    mod, operands = pc.traced(case, q, k)
    one = pc.pallas_plan(mod, q, k, v, MOSAIC.replace(decode_splits=0), scale=0.3)
    plan = dataclasses.replace(one, key_parts=parts)
    assert one.key_parts == 1 and plan.engine == "mosaic" and plan.interpret
    ref = REFERENCE.plan(Problem.of(q, k, v), mod, plan.scale, MOSAIC, True)
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    want_o, want_lse = REFERENCE.forward(ref, *(x.astype(jnp.float32) for x in (q, k, v)),
                                         operands)
    got_o, got_lse = pallas_backend._forward(plan, q, k, v, operands)
    one_o, one_lse = pallas_backend._forward(one, q, k, v, operands)
    assert got_o.shape == q.shape[:3] + (v.shape[-1],) and got_lse.shape == want_lse.shape
    np.testing.assert_array_equal(np.isneginf(f32(got_lse)), np.isneginf(f32(want_lse)))
    live = np.isfinite(f32(want_lse))
    np.testing.assert_allclose(f32(got_lse)[live], f32(want_lse)[live], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(f32(got_o), f32(want_o), atol=2e-2)
    np.testing.assert_allclose(f32(got_lse)[live], f32(one_lse)[live], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(f32(got_o), f32(one_o), atol=1e-2)
    if case == "masked_rows":
        assert (~live).any() and not f32(got_o)[:, :21].any()


def test_part_sizes_spread_a_run_by_its_lists():
    """With key lists known at run time, a tile's programs take parts of its list by
    its share of the run's tiles over the multiprocessors: uniform rows keep the
    parts the wave model picks, a long row beside short ones takes more of them, a
    short list one; a map shared by the batch counts once per program row."""
    def sizes(counts, parts=4, spread=132, rows=None):
        counts = jnp.asarray(counts, jnp.int32)
        rows = counts.size if rows is None else rows
        return np.asarray(pallas_backend.part_sizes(counts, parts, spread, rows)).tolist()

    assert sizes([[[256]] * 64]) == [[[128]] * 64]  # 2 parts of the 4
    half = [[[256]], [[8]]] * 32
    assert sizes(half) == [[[64]], [[8]]] * 32  # the long rows in 4, the short in 1
    assert sizes([[[8]] * 64]) == [[[8]] * 64]  # parts of at least MIN_PART_TILES
    assert sizes([[[0], [256]]]) == [[[0], [64]]]  # 256 tiles over 132: parts of 8 or more
    assert sizes([[[256]]], rows=64) == [[[128]]]  # one map row for 64 program rows
    assert sizes([[[256]], [[8]]], parts=16, spread=132, rows=16) == [[[16]], [[8]]]


@pytest.mark.parametrize("case,shape", [
    ("softcap", dict(sq=4, skv=4200, hq=2, hkv=1, d=64)),  # 33 key tiles: 4 parts of 9
    ("learnable_softcap", dict(sq=8, skv=2200, hq=2, hkv=2, d=128)),  # 18 tiles: 2 parts of 9
])
def test_forward_spread_parts_interpreted(case, shape, interprets):
    """Ragged ``kv_lengths`` on the Mosaic forward whose parts are spread by the rows'
    lists (a row of all the keys beside one of a few and one of none), in interpret
    mode: O and LSE against the reference path with those lengths."""
    q, k, v, _ = pc.inputs(b=3, dtype=jnp.bfloat16, **shape)
    mod, operands = pc.traced(case, q, k)
    lengths = jnp.asarray([shape["skv"], 70, 0], jnp.int32)
    ragged = positions.apply_positions(mod, 3, kv_lengths=lengths)
    opts = MOSAIC.replace(sms=64)
    plan = pc.pallas_plan(ragged, q, k, v, opts, scale=0.3)
    plan = dataclasses.replace(plan, key_parts=4, part_spread=64)
    sizes = np.asarray(pallas_backend.part_sizes(
        _map(plan, plan.forward_blocks, ragged.operands).q_counts, 4, 64, 3 * shape["hq"]))
    assert sizes.ravel().tolist()[:3] == [9, 1, 0], sizes  # rows differ
    ref = REFERENCE.plan(Problem.of(q, k, v), ragged, plan.scale, opts, True)
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    want_o, want_lse = REFERENCE.forward(ref, *(x.astype(jnp.float32) for x in (q, k, v)),
                                         ragged.operands)
    got_o, got_lse = pallas_backend._forward(plan, q, k, v, ragged.operands)
    np.testing.assert_array_equal(np.isneginf(f32(got_lse)), np.isneginf(f32(want_lse)))
    live = np.isfinite(f32(want_lse))
    np.testing.assert_allclose(f32(got_lse)[live], f32(want_lse)[live], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(f32(got_o), f32(want_o), atol=2e-2)


def test_key_parts_choice():
    """Parts only where the programs are fewer than the multiprocessors: the power of
    two whose waves of programs finish first (PART_FIXED_TILES), each part at least
    MIN_PART_TILES of the tiles a static mask keeps; decode_splits sets them for
    short queries (0 or 1: none)."""
    opts = MOSAIC.replace(sms=132)
    window = scoremod.trace(lambda s, b, h, q, k: jnp.where(
        (q + 32767 >= k) & (q + 32767 - k < 4096), s, -jnp.inf))
    decode = Problem(8, 4, 32768, 8, 8, 128, 128, "bfloat16")  # 64 programs
    # two parts: 128 programs in one wave; four would take two waves of half the tiles
    assert pallas_backend.key_parts(decode, None, opts) == 2
    assert pallas_backend.key_parts(decode, window, opts) == 2  # 33 live tiles
    assert pallas_backend.key_parts(decode, None, opts.replace(sms=264)) == 4  # one wave
    few = Problem(2, 4, 32768, 8, 8, 128, 128, "bfloat16")  # 16 programs
    assert pallas_backend.key_parts(few, None, opts) == 8
    assert pallas_backend.key_parts(few, window, opts) == 4  # 33 live tiles: parts of 8
    small = Problem(1, 4, 32768, 1, 1, 128, 128, "bfloat16")
    assert pallas_backend.key_parts(small, None, opts) == 32  # 256 tiles: parts of 8
    prefill = Problem(4, 4096, 4096, 16, 16, 128, 128, "bfloat16")
    assert pallas_backend.key_parts(prefill, None, opts) == 1
    assert pallas_backend.key_parts(decode, None, opts.replace(decode_splits=0)) == 1
    assert pallas_backend.key_parts(decode, None, opts.replace(decode_splits=6)) == 6
    assert pallas_backend.key_parts(prefill, None, opts.replace(decode_splits=6)) == 1


# --------------------------------------------------------------------------- #
# A paged KV cache read through its page table (lowering/paged.py)


def _paged_cache(b, pages, page, hkv, d, seed=0, spare=3):
    """K and V as rows, the same as shuffled pages of a cache with ``spare`` unused
    pages, and the page table."""
    rng = np.random.default_rng(seed)
    k, v = (jnp.asarray(rng.standard_normal((b, pages * page, hkv, d)), jnp.bfloat16)
            for _ in range(2))
    order = rng.permutation(b * pages + spare)[:b * pages].reshape(b, pages)
    cache = [np.zeros((b * pages + spare, page, hkv, d), np.float32) for _ in range(2)]
    for bi in range(b):
        for p in range(pages):
            for c, x in zip(cache, (k, v)):
                c[order[bi, p]] = np.asarray(x[bi, p * page:(p + 1) * page], np.float32)
    kp, vp = (jnp.asarray(c, jnp.bfloat16) for c in cache)
    return k, v, kp, vp, jnp.asarray(order, jnp.int32)


def test_page_copies_and_rows():
    """Pages nest with the 128-key tiles (a page of whole tiles, or whole swizzled
    rows of 8 dividing a tile) or are refused; the table the kernel reads covers
    the padded tiles with the last page and clips page numbers into the cache."""
    assert [mosaic.page_copies(p) for p in (8, 16, 64, 128, 256, 512)] == [16, 8, 2, 1, 1, 1]
    assert [mosaic.page_copies(p) for p in (4, 48, 96, 192)] == [None] * 4
    table = jnp.asarray([[3, 1, 9], [0, 2, 5]], jnp.int32)
    rows = mosaic.paged_rows(table, 64, 3 * 64, num_pages=7)  # 192 keys: 2 tiles, 4 pages
    np.testing.assert_array_equal(rows, [[3, 1, 6, 6], [0, 2, 5, 5]])
    rows = mosaic.paged_rows(table, 256, 3 * 256, num_pages=10)  # 768 keys: 3 pages of tiles
    np.testing.assert_array_equal(rows, table)


@pytest.mark.parametrize("page,pages,sq,hq", [
    (64, 5, 1, 8),  # two pages per key tile, the last tile half past the end; heads packed
    (128, 3, 4, 4),  # a page per tile
    (256, 2, 130, 2),  # two tiles per page; a second query tile
])
def test_paged_forward_reads_the_pages_interpreted(page, pages, sq, hq, interprets, monkeypatch):
    """On the Mosaic engine (interpret mode, the route on a faked H200) a paged call
    reads the pages through the table, with no gathered copy of the cache: bitwise
    the kernel's result on the gathered rows, and the reference path's within
    bf16; its gradients (through the gathered call) reach the pages. A page read
    from the wrong place (a permuted cache) fails it."""
    monkeypatch.setattr(device, "current", lambda: HOPPER)
    plan = PALLAS.plan
    monkeypatch.setattr(type(PALLAS), "plan",
                        lambda self, *a: dataclasses.replace(plan(*a), interpret=True))
    b, hkv, d = 2, 2, 64
    k, v, kp, vp, table = _paged_cache(b, pages, page, hkv, d)
    q = jnp.asarray(np.random.default_rng(1).standard_normal((b, sq, hq, d)), jnp.bfloat16)
    slopes = jnp.linspace(0.1, 1.0, hq)
    lengths = jnp.asarray([pages * page - 37, pages * page], jnp.int32)
    kw = dict(q_offset=lengths - sq, kv_lengths=lengths, return_lse=True)

    def mod(s, b, h, qi, ki):
        return jnp.where(qi - ki <= 150, 30 * jnp.tanh(s / 30) - slopes[h] * (qi - ki) / 64,
                         -jnp.inf)

    gathers = []
    gather = scoremod.positions.gather_pages
    monkeypatch.setattr(scoremod.positions, "gather_pages",
                        lambda *a: gathers.append(1) or gather(*a))
    got = scoremod.attention(q, kp, vp, mod, implementation="pallas", options=MOSAIC,
                             page_table=table, **kw)
    assert gathers == []
    rows = scoremod.attention(q, k, v, mod, implementation="pallas", options=MOSAIC, **kw)
    for a, c in zip(got, rows):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
    want = scoremod.attention(q, k, v, mod, implementation="xla", **kw)
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32),
                               atol=2e-2)
    np.testing.assert_allclose(got[1], want[1], atol=1e-3)
    moved = scoremod.attention(q, jnp.roll(kp, 1, axis=0), vp, mod, implementation="pallas",
                               options=MOSAIC, page_table=table, **kw)
    assert not np.allclose(np.asarray(moved[0], np.float32), np.asarray(got[0], np.float32),
                           atol=2e-2)
    if page == 128:  # sinks join the paged kernel's O and LSE
        sinks = jnp.linspace(-2.0, 3.0, hq)
        got = scoremod.attention(q, kp, vp, mod, implementation="pallas", options=MOSAIC,
                                 page_table=table, sinks=sinks, **kw)
        want = scoremod.attention(q, k, v, mod, implementation="xla", sinks=sinks, **kw)
        np.testing.assert_allclose(np.asarray(got[0], np.float32),
                                   np.asarray(want[0], np.float32), atol=2e-2)
        np.testing.assert_allclose(got[1], want[1], atol=1e-3)
    if page != 64:
        return

    def loss(q, kp, vp, impl):
        o, _ = scoremod.attention(q, kp, vp, mod, implementation=impl, options=MOSAIC,
                                  page_table=table, **kw)
        return jnp.sum(o.astype(jnp.float32) ** 2)

    for a, c in zip(jax.grad(loss, (0, 1, 2))(q, kp, vp, "pallas"),
                    jax.grad(loss, (0, 1, 2))(q, kp, vp, "xla")):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(c, np.float32),
                                   atol=2e-2)


def test_paged_decode_lowers_without_gathering_the_cache(hopper_here):
    """A decode step on a paged cache on the Pallas kernels on an H200 lowers to one
    Mosaic kernel and no gather (the kernel fetches the pages); a page size
    that does not nest with the key tiles (96), the Triton engine, or a low-rank
    bias appended to K gathers the pages first."""
    q = jnp.zeros((8, 1, 32, 128), jnp.bfloat16)
    def lowered(page, options=None, mod=lambda s, b, h, qi, ki: 30 * jnp.tanh(s / 30)):
        pages = 4096 // page
        table = jnp.arange(8 * pages, dtype=jnp.int32).reshape(8, pages)
        kp = jnp.zeros((8 * pages, page, 8, 128), jnp.bfloat16)
        return _lower_call(lambda q, kp, vp: scoremod.attention(
            q, kp, vp, mod, page_table=table, implementation="pallas",
            options=options or MOSAIC), q, kp, kp)

    for page in (16, 64, 128, 256):  # copies into a tile's rows, or a window of a page
        text = lowered(page)
        assert _kernels(text) == {"mosaic": 1, "triton": 0} and "gather" not in text, page
    kp = jnp.zeros((8 * 32, 128, 8, 128), jnp.bfloat16)
    table = jnp.arange(8 * 32, dtype=jnp.int32).reshape(8, 32)
    for options, fetches in ((MOSAIC, True), (TRITON, False)):
        choice = scoremod.which_implementation(q, kp, kp, page_table=table,
                                               implementation="pallas", options=options)
        assert ("through the page table" in choice.pages) == fetches, choice.pages
    assert "gather" in lowered(96)  # pages of 96 keys do not nest with the tiles
    assert "gather" in lowered(128, TRITON)
    # K with a low-rank bias's columns appended (the Triton engine's head dims) is
    # K's rows: the pages are gathered for it.
    from scoremod.lowering import paged
    from scoremod.route import route

    problem = Problem(b=8, sq=1, skv=32 * 128, hq=32, hkv=8, d=128, dv=128, dtype="bfloat16")
    chosen = route(problem, None, 0.125, MOSAIC, "pallas")
    assert paged.fetched(chosen, 128, (q,))
    assert not paged.fetched(dataclasses.replace(chosen, low_rank=object()), 128, (q,))
    assert not paged.fetched(route(problem, None, 0.125, MOSAIC.replace(check_values=True),
                                   "pallas"), 128, (q,))


def test_paged_forward_under_vmap_runs_the_gathered_call(interprets, monkeypatch):
    """Under jax.vmap a paged call on the Mosaic engine runs the gathered call (its
    pipeline folds the mapped axes into the batch), not the kernel on the pages:
    each mapped query batch's O equals its own call's within bf16."""
    monkeypatch.setattr(device, "current", lambda: HOPPER)
    plan = PALLAS.plan
    monkeypatch.setattr(type(PALLAS), "plan",
                        lambda self, *a: dataclasses.replace(plan(*a), interpret=True))
    k, v, kp, vp, table = _paged_cache(2, 2, 128, 1, 64)
    qs = jnp.asarray(np.random.default_rng(2).standard_normal((3, 2, 1, 4, 64)), jnp.bfloat16)
    mod = lambda s, b, h, qi, ki: 30 * jnp.tanh(s / 30)  # noqa: E731
    gathers = []
    gather = scoremod.positions.gather_pages
    monkeypatch.setattr(scoremod.positions, "gather_pages",
                        lambda *a: gathers.append(1) or gather(*a))
    got = jax.vmap(lambda q: scoremod.attention(q, kp, vp, mod, implementation="pallas",
                                                options=MOSAIC, page_table=table))(qs)
    assert gathers, "the vmap rule did not run the gathered call"
    for i in range(3):
        want = scoremod.attention(qs[i], k, v, mod, implementation="xla")
        np.testing.assert_allclose(np.asarray(got[i], np.float32), np.asarray(want, np.float32),
                                   atol=2e-2)


def test_the_deprecated_triton_engine_is_not_chosen_on_hopper(hopper_here):
    """Where the Mosaic engine runs the problem but refuses the mod (two tables read
    at q_idx - kv_idx) and cuDNN refuses it too (a float remainder),
    implementation=None does not take the Triton engine that JAX deprecates: the
    reference path runs the call, the Pallas verdict saying why; by name the Triton
    engine still runs it."""
    q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
    t1 = jnp.arange(511, dtype=jnp.float32)
    t2 = t1 * 0.5

    def fn(s, b, h, qi, ki):
        return jax.lax.rem(s, 3.0) + t1[qi - ki + 255] + t2[qi - ki + 255]

    choice = scoremod.which_implementation(q, q, q, fn)
    assert choice[0] == "xla", choice
    assert "JAX deprecates Pallas's Triton engine" in choice.verdicts["pallas"]
    by_name = scoremod.which_implementation(q, q, q, fn, implementation="pallas")
    assert by_name[0] == "pallas" and "Triton engine" in by_name.variant


def test_graphormer_edge_encoding_learns_interpreted(interprets):
    """The catalogue's Graphormer edge encoding (path types read per score as
    ``path_types[b, q, k, n]``, an int array whose hop axis is last, picking a
    learned per-head weight per hop and edge type): forward and backward on the
    Mosaic kernels in interpret mode with the weights learned, against the
    reference path; no Triton kernel."""
    from tests.catalogue.mods import CATALOGUE

    entry = CATALOGUE["graphormer_edge"]
    shape = entry.cpu
    mod = scoremod.trace(entry.build(entry.env(shape)))
    q, k, v, do = pc.inputs(b=shape.b, sq=shape.sq, skv=shape.skv, hq=shape.h, hkv=shape.h,
                            d=64, dtype=jnp.bfloat16)
    plan = pc.pallas_plan(mod, q, k, v, MOSAIC, scale=0.3)
    assert plan.engine == "mosaic" and plan.backward_engine == "mosaic", plan.describe()
    assert plan.triton_operands == () and mosaic.dense_reads(plan.expr), plan.describe()
    operands = tuple(jnp.asarray(x) for x in mod.operands)
    learned = next(n for n, x in zip(mod.operand_names, operands) if x.dtype == jnp.float32)
    ref = REFERENCE.plan(Problem.of(q, k, v), mod, plan.scale, MOSAIC, True)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    want = pc.run(REFERENCE, ref, f32(q), f32(k), f32(v), f32(do), operands, True)
    o, lse = want[0], want[1]
    dlse = jnp.where(jnp.isfinite(lse), 0.1, 0.0)
    dq, dk, dv, grads = pallas_backend._backward(plan, q, k, v, o.astype(q.dtype), lse, do,
                                                 dlse, operands, (learned,))
    got_o, got_lse = pallas_backend._forward(plan, q, k, v, operands)
    op_grads = tuple(grads.get(name) for name in mod.operand_names)
    errs = pc.relative_errors((got_o, got_lse, dq, dk, dv, op_grads), want)
    assert f"d_operand{mod.operand_names.index(learned)}" in errs, errs
    assert all(e < 3e-2 for e in errs.values()), errs


def test_ragged_decode_lowers_with_spread_parts(hopper_here):
    """A decode step with traced ``kv_lengths`` (and a paged cache) on the Pallas
    kernels on an H200 lowers to one Mosaic kernel whose parts are spread by the
    rows' lists (twice the parts: the plan's ``part_spread``)."""
    q = jnp.zeros((8, 1, 32, 128), jnp.bfloat16)
    k = jnp.zeros((8, 32768, 8, 128), jnp.bfloat16)
    lengths = jnp.full((8,), 32768, jnp.int32)
    softcap = lambda s, b, h, qi, ki: 30 * jnp.tanh(s / 30)  # noqa: E731
    text = _lower_call(lambda q, k, v, n: scoremod.attention(
        q, k, v, softcap, kv_lengths=n, implementation="pallas", options=MOSAIC),
        q, k, k, lengths)
    assert _kernels(text) == {"mosaic": 1, "triton": 0}
    kp = jnp.zeros((8 * 256, 128, 8, 128), jnp.bfloat16)
    table = jnp.arange(8 * 256, dtype=jnp.int32).reshape(8, 256)
    text = _lower_call(lambda q, kp, vp, n: scoremod.attention(
        q, kp, vp, softcap, kv_lengths=n, page_table=table, implementation="pallas",
        options=MOSAIC), q, kp, kp, lengths)
    assert _kernels(text) == {"mosaic": 1, "triton": 0}
    gathers = [line for line in text.splitlines() if "stablehlo.gather" in line]
    assert not any("bf16" in line for line in gathers), gathers  # not the cache's pages
