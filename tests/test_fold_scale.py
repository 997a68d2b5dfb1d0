"""Folding a constant factor of the score into the softmax scale: the one rule
(``patterns.score_factor``), and cuDNN's attn_scale taking it."""

import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from scoremod.lowering.problem import Problem
from scoremod.lowering.cudnn.rules import canonical, fold_scale
from scoremod.lowering.patterns import score_factor
from scoremod.dsl.evaluate import evaluate

FOLDED = {  # mod, factor
    "softcap": (lambda s, b, h, q, k: 30.0 * jnp.tanh(s / 30.0), 1 / 30),
    "softcap_causal": (lambda s, b, h, q, k: jnp.where(q >= k, 30.0 * jnp.tanh(s / 30.0), -jnp.inf), 1 / 30),
    "two_uses": (lambda s, b, h, q, k: s * 0.5 + jnp.tanh(s * 0.5), 0.5),
    "temperature": (lambda s, b, h, q, k: s / 0.7, 1 / 0.7),
}
KEPT = {
    "plain_use": lambda s, b, h, q, k: s * 2.0 + s,
    "two_factors": lambda s, b, h, q, k: jnp.tanh(s * 0.5) + jnp.tanh(s * 0.25),
    "negative": lambda s, b, h, q, k: -2.0 * s,
    "bias": lambda s, b, h, q, k: s + 0.1 * (k - q),
}


def values(expr, score):
    q = np.arange(6).reshape(6, 1)
    k = np.arange(5).reshape(1, 5)
    return np.asarray(evaluate(expr, {"score": score, "b": 0, "h": 0, "q_idx": q, "kv_idx": k}, {}))


@pytest.mark.parametrize("name", sorted(FOLDED))
def test_folded_mod_on_the_scaled_score_is_the_mod(name):
    fn, want = FOLDED[name]
    expr = canonical(scoremod.trace(fn).expr)
    folded, c = fold_scale(expr)
    assert c == pytest.approx(want)
    assert folded is not expr
    score = np.random.default_rng(0).normal(0, 20, (6, 5)).astype(np.float32)
    np.testing.assert_allclose(values(folded, score * np.float32(c)), values(expr, score),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(KEPT))
def test_mods_without_one_positive_factor_are_kept(name):
    expr = canonical(scoremod.trace(KEPT[name]).expr)
    assert fold_scale(expr) == (expr, 1.0)


def test_plan_folds_only_when_enabled_and_keeps_the_callers_scale():
    from scoremod.lowering.cudnn.plan import Plan

    softcap = scoremod.trace(FOLDED["softcap"][0])
    shape = Problem(1, 128, 128, 2, 2, 64, 64, "bfloat16")
    plain = Plan(softcap, shape, 0.125, scoremod.LoweringOptions(fold_scale=False))
    folded = Plan(softcap, shape, 0.125, scoremod.LoweringOptions(fold_scale=True))
    (p,), (f,) = plain.parts, folded.parts
    assert p.spec.scale == 0.125 and f.spec.scale == pytest.approx(0.125 / 30)
    assert folded.scale == plain.scale == 0.125  # the reference fallback's scale
    assert str(f.fwd) == "<f32 tanh(score) * 30.0>"
    assert f.key != p.key and folded != plain


@pytest.mark.parametrize("name", sorted(FOLDED) + ["negative"])
def test_the_rule_folds_the_traced_mod_and_keeps_a_negative_factor(name):
    # The rule holds on any IR (the Pallas Mosaic engine folds the traced mod,
    # whatever the factor's sign); cuDNN takes positive factors only.
    fn, want = FOLDED[name] if name in FOLDED else (KEPT[name], -2.0)
    expr = scoremod.trace(fn).expr
    folded, c = score_factor(expr)
    assert c == pytest.approx(want) and folded is not expr
    score = np.random.default_rng(1).normal(0, 20, (6, 5)).astype(np.float32)
    np.testing.assert_allclose(values(folded, score * np.float32(c)), values(expr, score),
                               rtol=1e-5, atol=1e-5)
    if c < 0:
        assert fold_scale(canonical(expr)) == (canonical(expr), 1.0)


@pytest.mark.parametrize("name", ["plain_use", "two_factors", "bias"])
def test_the_rule_keeps_mods_without_one_factor(name):
    expr = scoremod.trace(KEPT[name]).expr
    assert score_factor(expr) == (expr, 1.0)
