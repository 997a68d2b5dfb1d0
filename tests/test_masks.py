"""Pure band masks recognized for cuDNN's native mask compute the same mask."""

import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from scoremod.lowering.cudnn import masks
from scoremod.lowering.cudnn.plan import Part
from scoremod.lowering.problem import Problem
from scoremod.lowering.cudnn.rules import canonical
from scoremod.dsl.evaluate import evaluate

NEG = -jnp.inf
BANDS = {  # recognized whenever every row keeps a key
    "causal": lambda s, b, h, q, k: jnp.where(q >= k, s, NEG),
    "causal_flipped": lambda s, b, h, q, k: jnp.where(k <= q, s, NEG),
    "causal_difference": lambda s, b, h, q, k: jnp.where(q - k >= 0, s, NEG),
    "causal_strict_plus_one": lambda s, b, h, q, k: jnp.where(q + 1 > k, s, NEG),
    "window": lambda s, b, h, q, k: jnp.where((q >= k) & (q - k < 5), s, NEG),
    "window_nested": lambda s, b, h, q, k: jnp.where(q - k < 3, jnp.where(k <= q, s, NEG), NEG),
    "window_scaled": lambda s, b, h, q, k: jnp.where((2 * q >= 2 * k) & (2 * (q - k) <= 7), s, NEG),
}
NOT_BANDS = {
    "prefix_lm": lambda s, b, h, q, k: jnp.where((k < 4) | (q >= k), s, NEG),
    "softcap_causal": lambda s, b, h, q, k: jnp.where(q >= k, 30 * jnp.tanh(s / 30), NEG),
    "per_head": lambda s, b, h, q, k: jnp.where((q >= k) | (h == 0), s, NEG),
    "chunked": lambda s, b, h, q, k: jnp.where(q // 4 == k // 4, s, NEG),
    "future_only": lambda s, b, h, q, k: jnp.where(k >= q, s, NEG),
    "strictly_causal": lambda s, b, h, q, k: jnp.where(q > k, s, NEG),  # row 0 fully masked
    "bias": lambda s, b, h, q, k: s + 0.1 * (k - q),
}
SHAPES = [(8, 8), (6, 10), (10, 6), (1, 7), (16, 16), (9, 9)]


def visible_by_mod(expr, sq, skv):
    q = jnp.arange(sq).reshape(1, 1, sq, 1)
    k = jnp.arange(skv).reshape(1, 1, 1, skv)
    zero = jnp.zeros((1, 1, sq, skv), jnp.float32)
    out = evaluate(expr, {"score": zero, "b": jnp.zeros((1, 1, 1, 1), jnp.int32),
                          "h": jnp.zeros((1, 1, 1, 1), jnp.int32), "q_idx": q, "kv_idx": k}, {})
    return np.isfinite(np.broadcast_to(np.asarray(out), (1, 1, sq, skv)))[0, 0]


def visible_by_band(band, sq, skv):
    shift = skv - sq if band.alignment == "BOTTOM_RIGHT" else 0
    d = np.arange(skv)[None, :] - np.arange(sq)[:, None] - shift
    ok = np.ones((sq, skv), bool)
    if band.right_bound is not None:
        ok &= d <= band.right_bound
    if band.left_bound is not None:
        ok &= d >= 1 - band.left_bound
    return ok


def bottom_right_causal(sq, skv):
    return lambda s, b, h, q, k: jnp.where(k <= q + (skv - sq), s, NEG)


@pytest.mark.parametrize("sq,skv", SHAPES)
@pytest.mark.parametrize("name", sorted(BANDS) + ["bottom_right"])
def test_recognized_bands_compute_the_mods_mask(name, sq, skv):
    fn = bottom_right_causal(sq, skv) if name == "bottom_right" else BANDS[name]
    expr = canonical(scoremod.trace(fn).expr)
    want = visible_by_mod(expr, sq, skv)
    band = masks.native_band(expr, sq, skv)
    if not want.any(axis=1).all():
        assert band is None, "a mask with a fully masked row must keep the score_mod path"
        return
    if name == "bottom_right" or sq <= skv or "window" not in name:
        assert band is not None, f"{name} at {sq}x{skv} not recognized"
    if band is not None:
        np.testing.assert_array_equal(visible_by_band(band, sq, skv), want)


@pytest.mark.parametrize("sq,skv", SHAPES)
@pytest.mark.parametrize("name", sorted(NOT_BANDS))
def test_other_mods_keep_the_score_mod_path(name, sq, skv):
    expr = canonical(scoremod.trace(NOT_BANDS[name]).expr)
    assert masks.native_band(expr, sq, skv) is None


def test_window_maps_to_cudnn_bounds():
    expr = canonical(scoremod.trace(lambda s, b, h, q, k: jnp.where((q >= k) & (q - k < 256), s, NEG)).expr)
    assert masks.native_band(expr, 1024, 1024) == masks.Band("TOP_LEFT", 256, 0)
    causal = canonical(scoremod.trace(BANDS["causal"]).expr)
    assert masks.native_band(causal, 1024, 1024) == masks.Band("TOP_LEFT", None, 0)


def _part(mod, shape, dtype="bfloat16", **options):
    return Part(mod, Problem(*shape, dtype), 0.125, scoremod.LoweringOptions(**options))


def test_plan_uses_the_native_mask_only_when_enabled():
    causal = scoremod.trace(BANDS["causal"])
    shapes = (2, 64, 64, 4, 4, 64, 64)
    off = _part(causal, shapes, native_masks=False)
    assert off.band is None and off.fwd is not None
    static = _part(causal, shapes, native_masks=True)
    assert static.band == masks.Band("TOP_LEFT", None, 0) and static.fwd is None
    assert static.spec.band == static.band and static.loads == ()
    softcap = scoremod.trace(NOT_BANDS["softcap_causal"])
    other = _part(softcap, shapes)
    assert other.band is None and other.fwd is not None and other.key != static.key
    assert off.key != static.key  # the two lowerings never share a graph


def test_tensors_along_kv_only_are_materialized_with_the_q_axis():
    ramp = jnp.arange(192, dtype=jnp.float32)
    per_key = scoremod.trace(lambda s, b, h, q, k: s + ramp[k])
    static = _part(per_key, (2, 64, 192, 4, 4, 64, 64))
    (plan,) = static.loads
    assert plan.spec.dims == (1, 1, 64, 192) and plan.operand is None
    (array,) = static.load_arrays(per_key.operands)
    np.testing.assert_array_equal(np.asarray(array), np.broadcast_to(np.asarray(ramp), (1, 1, 64, 192)))
    per_head = scoremod.trace(lambda s, b, h, q, k: s + ramp[h])  # read as it is
    (plan,) = _part(per_head, (2, 64, 192, 4, 4, 64, 64)).loads
    assert plan.spec.dims == (1, 4, 1, 1) and plan.operand is not None


def test_kv_padding_is_masked_inside_the_mod_when_skv_is_not_a_tile_multiple():
    alibi = scoremod.trace(lambda s, b, h, q, k: s + 0.25 * (k - q))
    padded = _part(alibi, (1, 64, 192, 2, 2, 64, 64), "float16")
    exact = _part(alibi, (1, 64, 256, 2, 2, 64, 64), "float16")
    assert "kv_idx < 192" in str(padded.fwd) and "kv_idx < 192" in str(padded.bwd)
    assert "kv_idx <" not in str(exact.fwd)
    # Inside the sequence the guard changes nothing.
    np.testing.assert_array_equal(visible_by_mod(padded.fwd, 64, 192), np.ones((64, 192), bool))
