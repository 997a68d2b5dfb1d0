"""Lengths that are no whole number of tiles, on the GPU: the padding never
contributes, forward or backward, on every fused engine.

The Pallas kernels pad Sq and Skv to whole tiles, and cuDNN runs whole tiles
too; on the padding the score is 0 and the indices run past the ends. Each mod
here is finite on every real (q, kv) and not finite somewhere on the padding:
its value NaN and its derivative -inf at score 0 (``score_log_abs``), its value
-inf or NaN past the last key (``log_past_keys``), its derivative -inf or NaN
past the last key and query (``scaled_past_the_end``), and that with a learned
factor per head (``learned_past_the_end``, whose gradient must stay finite too). O, LSE, dQ, dK,
dV (and the factor's gradient) against the reference path, at lengths 1 to 4095,
on the Mosaic GPU and Triton engines and on cuDNN.
"""

import jax
import jax.numpy as jnp
import pytest

import scoremod
from scoremod.lowering.pallas.backend import PALLAS
from scoremod.lowering.problem import Problem
from tests import pallas_cases as pc
from tests.pallas_cases import quiet  # noqa: F401 - the autouse fixture

pytestmark = pytest.mark.gpu

LENGTHS = [(1, 12), (12, 100), (100, 1000), (1000, 4095), (4095, 1000)]  # (Sq, Skv)
ENGINES = {
    "mosaic": ("pallas", scoremod.LoweringOptions(pallas_engine="mosaic")),
    "triton": ("pallas", scoremod.LoweringOptions(pallas_engine="triton")),
    "cudnn": ("cudnn", None),
}
TOL, OPERAND_TOL = 3e-2, 5e-2  # bfloat16; an operand's gradient sums every score's share


def _mod(name, hq, sq, skv):
    """(mod function taking the learned factors last, learned factors)."""
    f32 = jnp.float32
    if name == "score_log_abs":
        return (lambda s, b, h, q, k: s * jnp.log(jnp.abs(s))), ()
    if name == "log_past_keys":
        return (lambda s, b, h, q, k: s + 0.5 * jnp.log((skv - k).astype(f32))), ()
    if name == "scaled_past_the_end":
        return (lambda s, b, h, q, k: s * jnp.log((skv - k).astype(f32))
                * jnp.sqrt((sq - q).astype(f32) / sq)), ()
    t = jnp.asarray([0.6 + 0.1 * i for i in range(hq)], f32)
    return (lambda s, b, h, q, k, t: s * t[h] * jnp.log((skv - k).astype(f32))
            * jnp.sqrt((sq - q).astype(f32) / sq)), (t,)


def _results(impl, options, fn, learned, q, k, v, do):
    """O, LSE and the gradients of <O, dO> in q, k, v and the learned factors."""
    def loss(q, k, v, learned):
        mod = lambda s, b, h, qi, ki: fn(s, b, h, qi, ki, *learned)  # noqa: E731
        o, lse = scoremod.attention(q, k, v, mod, implementation=impl, options=options,
                                    return_lse=True)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)), (o, lse)

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    (_, (o, lse)), (dq, dk, dv, dlearned) = grad(q, k, v, learned)
    return o, lse, dq, dk, dv, tuple(dlearned)


@pytest.mark.parametrize("sq,skv", LENGTHS, ids=[f"{a}x{b}" for a, b in LENGTHS])
@pytest.mark.parametrize("name", ["score_log_abs", "log_past_keys", "scaled_past_the_end",
                                  "learned_past_the_end"])
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_padding_never_contributes(engine, name, sq, skv):
    impl, options = ENGINES[engine]
    if engine == "mosaic":
        from scoremod import device

        if device.current().family != 9:
            pytest.skip("the Mosaic GPU engine runs on Hopper GPUs only")
    if engine == "cudnn" and name == "learned_past_the_end":
        pytest.skip("cuDNN computes no gradients of captured arrays (the Pallas kernels do)")
    hq = 4
    q, k, v, do = pc.inputs(b=2, sq=sq, skv=skv, hq=hq, hkv=2, d=128, dtype=jnp.bfloat16)
    fn, learned = _mod(name, hq, sq, skv)
    if engine != "cudnn":  # forward and backward on the engine asked for
        mod = scoremod.trace(lambda s, b, h, qi, ki: fn(s, b, h, qi, ki, *learned))
        plan = PALLAS.plan(Problem.of(q, k, v), mod, 1 / 128 ** 0.5, options, True)
        assert (plan.engine, plan.backward_engine, plan.triton_operands) == (
            engine, engine, ()), plan.describe()
    got = _results(impl, options, fn, learned, q, k, v, do)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    want = _results("xla", None, fn, learned, f32(q), f32(k), f32(v), f32(do))
    errs = pc.relative_errors(got, want)
    print(engine, name, sq, skv, errs)
    bad = {n: e for n, e in errs.items()
           if not e <= (OPERAND_TOL if n.startswith("d_operand") else TOL)}
    assert not bad, f"errors {errs}"
    if learned:
        assert "d_operand0" in errs


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_empty_batch(engine):
    """Batch 0 on every fused engine asked by name: an empty O and LSE, and empty
    gradients, as on the reference path (the Pallas kernels raised a TypeError)."""
    impl, options = ENGINES[engine]
    q, k, v, do = pc.inputs(b=0, sq=100, skv=130, hq=4, hkv=2, d=128, dtype=jnp.bfloat16)
    fn, learned = _mod("learned_past_the_end" if engine != "cudnn" else "score_log_abs", 4,
                       100, 130)
    got = _results(impl, options, fn, learned, q, k, v, do)
    want = _results("xla", None, fn, learned, q, k, v, do)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape)
    assert got[0].shape == (0, 100, 4, 128) and got[1].shape == (0, 4, 100)
