"""Folding a constant factor of the score into cuDNN's attn_scale."""

import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from scoremod.lowering import cudnn_path
from scoremod.lowering.cudnn_rules import canonical, fold_scale
from scoremod.lowering.reference import evaluate

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


def test_static_folds_only_when_enabled_and_keeps_the_callers_scale(monkeypatch):
    softcap = scoremod.trace(FOLDED["softcap"][0])
    shapes = (1, 128, 128, 2, 2, 64, 64)
    monkeypatch.setattr(cudnn_path, "FOLD_SCALE", False)
    plain = cudnn_path.Static(softcap, shapes, "bfloat16", 0.125, False)
    monkeypatch.setattr(cudnn_path, "FOLD_SCALE", True)
    folded = cudnn_path.Static(softcap, shapes, "bfloat16", 0.125, False)
    assert plain.problem.scale == 0.125 and folded.problem.scale == pytest.approx(0.125 / 30)
    assert folded.scale == plain.scale == 0.125  # the reference fallback's scale
    assert str(folded.fwd) == "<f32 tanh(score) * 30.0>"
    assert folded.key != plain.key
