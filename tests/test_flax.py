"""scoremod.flax.attention_fn as a drop-in for Flax's linen and nnx attention layers.

Every comparison is against the same Flax model run with a hand-written
jax.numpy attention_fn (scores, the mod by hand, + bias, Flax's masking,
softmax), or, for no mod, with Flax's own default attention.
"""

import functools
import inspect
import math
import pathlib
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

flax = pytest.importorskip("flax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import scoremod  # noqa: E402
import scoremod.flax  # noqa: E402
from scoremod.flax import FlaxAttentionError  # noqa: E402

B, L, H, F = 2, 16, 4, 32  # batch, length, heads, features (head_dim 8)
CAP = 5.0  # small enough that the softcap bends the scores


def softcap(score, b, h, q_idx, kv_idx):
    return CAP * jnp.tanh(score / CAP)


def reference_attention(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                        dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                        precision=None, module=None, is_causal=False, *, mod=softcap):
    """The softcap by hand, Flax's conventions (bias added, then masked with finfo.min)."""
    f32 = jnp.float32
    s = jnp.einsum("bqhd,bkhd->bhqk", query.astype(f32), key.astype(f32),
                   precision=jax.lax.Precision.HIGHEST) / math.sqrt(query.shape[-1])
    if mod is not None:
        s = CAP * jnp.tanh(s / CAP)
    if bias is not None:
        s = s + bias
    keep = jnp.ones(s.shape, bool)
    if mask is not None:
        keep = keep & (mask != 0)
    if is_causal:
        keep = keep & jnp.tril(jnp.ones(s.shape[-2:], bool))
    s = jnp.where(keep, s, jnp.finfo(f32).min)
    p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", p, value.astype(f32), precision=jax.lax.Precision.HIGHEST)
    return out.astype(query.dtype)


def inputs(seed=0):
    x = jax.random.normal(jax.random.key(seed), (B, L, F), jnp.float32)
    causal = nn.make_causal_mask(x[..., 0])  # float32 [B, 1, L, L], as Flax makes it
    valid = jnp.arange(L)[None, :] < jnp.asarray([[L], [L - 3]])  # batch 1: 3 padded keys
    padding = nn.make_attention_mask(jnp.ones((B, L), bool), valid)
    return x, nn.combine_masks(causal, padding)


def assert_trees_close(a, b, tol=1e-5):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32),
                                   rtol=tol, atol=tol)


def loss_weights():
    return jax.random.normal(jax.random.key(7), (B, L, F), jnp.float32)


# --- linen -------------------------------------------------------------------


class LinenModel(nn.Module):
    """MultiHeadDotProductAttention with a learned [H, L, L] bias bound into attention_fn."""

    attention_fn: object

    @nn.compact
    def __call__(self, x, mask):
        rel_bias = self.param("rel_bias", nn.initializers.normal(0.5), (H, L, L))
        attn = nn.MultiHeadDotProductAttention(
            num_heads=H, qkv_features=F,
            attention_fn=functools.partial(self.attention_fn, bias=rel_bias), name="attn")
        return attn(x, mask=mask)


def linen_outputs_and_grads(fn):
    x, mask = inputs()
    model = LinenModel(fn)
    params = model.init(jax.random.key(1), x, mask)
    w = loss_weights()

    def loss(params, x):
        return jnp.sum(model.apply(params, x, mask) * w)

    out = jax.jit(model.apply)(params, x, mask)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
    return out, grads


def test_linen_matches_hand_written_softcap():
    out, grads = linen_outputs_and_grads(
        scoremod.flax.attention_fn(softcap, implementation="xla"))
    ref_out, ref_grads = linen_outputs_and_grads(reference_attention)
    assert out.shape == (B, L, F)
    assert_trees_close(out, ref_out)
    assert_trees_close(grads, ref_grads)
    assert float(jnp.abs(grads[0]["params"]["rel_bias"]).sum()) > 0  # the bias learns


def test_linen_without_mod_matches_flax_default():
    out, grads = linen_outputs_and_grads(scoremod.flax.attention_fn(implementation="xla"))
    ref_out, ref_grads = linen_outputs_and_grads(nn.dot_product_attention)
    assert_trees_close(out, ref_out)
    assert_trees_close(grads, ref_grads)


# --- nnx ---------------------------------------------------------------------


class NnxModel(nnx.Module):
    """nnx.MultiHeadAttention with a learned [H, L, L] bias bound into attention_fn."""

    def __init__(self, attention_fn, *, rngs, dtype=None, features=F, length=L,
                 learn_bias=True):
        self.fn = attention_fn
        self.learn_bias = learn_bias
        self.rel_bias = nnx.Param(0.5 * jax.random.normal(rngs.params(), (H, length, length)))
        self.attn = nnx.MultiHeadAttention(num_heads=H, in_features=features,
                                           qkv_features=features, decode=False, dtype=dtype,
                                           attention_fn=attention_fn, rngs=rngs)

    def __call__(self, x, mask=None, is_causal=False):
        bias = self.rel_bias[...]
        if not self.learn_bias:
            bias = jax.lax.stop_gradient(bias)
        self.attn.attention_fn = functools.partial(self.fn, bias=bias)
        try:
            return self.attn(x, mask=mask, is_causal=is_causal)
        finally:
            self.attn.attention_fn = self.fn


def nnx_outputs_and_grads(fn, is_causal=False, use_mask=True):
    x, mask = inputs()
    mask = mask if use_mask else None
    model = NnxModel(fn, rngs=nnx.Rngs(1))
    w = loss_weights()

    def loss(model, x):
        return jnp.sum(model(x, mask, is_causal) * w)

    out = nnx.jit(lambda m, x: m(x, mask, is_causal))(model, x)
    model_grads, x_grad = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(model, x)
    return out, (nnx.to_pure_dict(model_grads), x_grad)


def test_nnx_matches_hand_written_softcap():
    out, grads = nnx_outputs_and_grads(scoremod.flax.attention_fn(softcap, implementation="xla"))
    ref_out, ref_grads = nnx_outputs_and_grads(reference_attention)
    assert out.shape == (B, L, F)
    assert_trees_close(out, ref_out)
    assert_trees_close(grads, ref_grads)
    assert float(jnp.abs(grads[0]["rel_bias"]).sum()) > 0


def test_nnx_without_mod_matches_flax_default():
    out, grads = nnx_outputs_and_grads(scoremod.flax.attention_fn(implementation="xla"))
    ref_out, ref_grads = nnx_outputs_and_grads(nnx.dot_product_attention)
    assert_trees_close(out, ref_out)
    assert_trees_close(grads, ref_grads)


def test_nnx_is_causal():
    fn = scoremod.flax.attention_fn(softcap, implementation="xla")
    out, grads = nnx_outputs_and_grads(fn, is_causal=True, use_mask=False)
    ref_out, ref_grads = nnx_outputs_and_grads(reference_attention, is_causal=True,
                                               use_mask=False)
    assert_trees_close(out, ref_out)
    assert_trees_close(grads, ref_grads)
    both, _ = nnx_outputs_and_grads(fn, is_causal=True, use_mask=True)  # mask and causal
    ref_both, _ = nnx_outputs_and_grads(reference_attention, is_causal=True, use_mask=True)
    assert_trees_close(both, ref_both)


def test_nnx_decode_matches_flax_default():
    # One query at a time against the cache: Flax's mask hides the unwritten slots.
    def layer(fn):
        m = nnx.MultiHeadAttention(num_heads=H, in_features=F, decode=True, attention_fn=fn,
                                   rngs=nnx.Rngs(0))
        m.init_cache((B, L, F))
        return m

    ours = layer(scoremod.flax.attention_fn(implementation="xla"))
    theirs = layer(nnx.dot_product_attention)
    x, _ = inputs()
    for t in range(L):
        np.testing.assert_allclose(ours(x[:, t:t + 1]), theirs(x[:, t:t + 1]),
                                   rtol=1e-5, atol=1e-5)


# --- the function itself -----------------------------------------------------


def qkv(seed=3, shape=(B, L, H, 8), dtype=jnp.float32):
    return tuple(jax.random.normal(k, shape, dtype)
                 for k in jax.random.split(jax.random.key(seed), 3))


def test_signature_covers_flax_dot_product_attention():
    # linen passes only the keyword arguments attention_fn's signature names
    # (silently dropping the others, mask included), so each must be there.
    ours = set(inspect.signature(scoremod.flax.attention_fn()).parameters)
    for theirs in (nn.dot_product_attention, nnx.dot_product_attention):
        assert set(inspect.signature(theirs).parameters) <= ours, theirs.__module__
    fn = scoremod.flax.attention_fn(softcap)
    assert set(inspect.signature(functools.partial(fn, bias=None)).parameters) == ours


@pytest.mark.parametrize("mask_shape", [(B, H, L, L), (B, 1, L, L), (1, 1, L, L), (L, L),
                                        (B, 1, 1, L), (H, 1, L)])
@pytest.mark.parametrize("bias_shape", [None, (B, H, L, L), (1, H, L, L), (L,), ()])
def test_mask_and_bias_broadcast(mask_shape, bias_shape):
    q, k, v = qkv()
    keys = jax.random.split(jax.random.key(4), 2)
    mask = jax.random.bernoulli(keys[0], 0.7, mask_shape)
    mask = mask.at[..., 0].set(True)  # every query keeps key 0: no fully masked row
    bias = None if bias_shape is None else jax.random.normal(keys[1], bias_shape)
    fn = scoremod.flax.attention_fn(softcap, implementation="xla")
    out = fn(q, k, v, bias=bias, mask=mask)
    ref = reference_attention(q, k, v, bias=bias, mask=mask)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_fully_masked_row_gives_zeros():
    q, k, v = qkv()
    mask = jnp.tril(jnp.ones((B, H, L, L), bool))
    mask = mask.at[0, :, 3, :].set(False).at[1, 2, 5:9, :].set(False)  # rows with no keys
    bias = jax.random.normal(jax.random.key(5), (H, L, L))
    fn = scoremod.flax.attention_fn(softcap, implementation="xla")
    out = fn(q, k, v, bias=bias, mask=mask)
    empty = ~mask.any(-1)  # [B, H, L]
    empty_bqh = jnp.transpose(empty, (0, 2, 1))
    assert (out[empty_bqh] == 0).all()  # scoremod's rule (Flax would average the values)
    ref = reference_attention(q, k, v, bias=bias, mask=mask)
    np.testing.assert_allclose(out[~empty_bqh], ref[~empty_bqh], rtol=1e-5, atol=1e-5)
    dq = jax.grad(lambda q: fn(q, k, v, bias=bias, mask=mask).sum())(q)
    assert jnp.isfinite(dq).all() and (dq[empty_bqh] == 0).all()


def test_dropout_is_refused_unless_deterministic():
    q, k, v = qkv()
    fn = scoremod.flax.attention_fn(softcap, implementation="xla")
    with pytest.raises(FlaxAttentionError, match="dropout"):
        fn(q, k, v, dropout_rate=0.1, deterministic=False, dropout_rng=jax.random.key(0))
    np.testing.assert_array_equal(fn(q, k, v, dropout_rate=0.1, deterministic=True), fn(q, k, v))

    x, mask = inputs()
    layer = nn.MultiHeadDotProductAttention(num_heads=H, dropout_rate=0.1, attention_fn=fn)
    params = layer.init(jax.random.key(0), x, mask=mask, deterministic=True)
    layer.apply(params, x, mask=mask, deterministic=True)
    with pytest.raises(FlaxAttentionError, match="dropout"):
        layer.apply(params, x, mask=mask, deterministic=False,
                    rngs={"dropout": jax.random.key(1)})

    nnx_layer = nnx.MultiHeadAttention(num_heads=H, in_features=F, dropout_rate=0.1,
                                       decode=False, attention_fn=fn, rngs=nnx.Rngs(0))
    nnx_layer(x, mask=mask, deterministic=True)
    with pytest.raises(FlaxAttentionError, match="dropout"):
        nnx_layer(x, mask=mask, deterministic=False, rngs=nnx.Rngs(dropout=1))


def test_rank_other_than_four_is_refused():
    fn = scoremod.flax.attention_fn(softcap, implementation="xla")
    q, k, v = qkv(shape=(B, 3, L, H, 8))
    with pytest.raises(scoremod.ScoreModTypeError, match="one batch dimension"):
        fn(q, k, v)
    q, k, v = qkv(shape=(L, H, 8))
    with pytest.raises(scoremod.ScoreModTypeError, match="one batch dimension"):
        fn(q, k, v)
    layer = nn.MultiHeadDotProductAttention(num_heads=H, attention_fn=fn)
    x = jnp.ones((B, 3, L, F))
    with pytest.raises(scoremod.ScoreModTypeError, match="one batch dimension"):
        layer.init(jax.random.key(0), x)


def test_bad_mask_and_bias_shapes():
    q, k, v = qkv()
    fn = scoremod.flax.attention_fn(softcap, implementation="xla")
    with pytest.raises(scoremod.ScoreModTypeError, match="does not broadcast"):
        fn(q, k, v, mask=jnp.ones((B, H, L, L - 1), bool))
    with pytest.raises(scoremod.ScoreModTypeError, match="rank 4 at most"):
        fn(q, k, v, bias=jnp.ones((1, B, H, L, L)))


def test_sow_weights_and_custom_einsums_are_refused():
    fn = scoremod.flax.attention_fn(softcap, implementation="xla")
    x, mask = inputs()
    layer = nn.MultiHeadDotProductAttention(num_heads=H, attention_fn=fn)
    params = layer.init(jax.random.key(0), x, mask=mask)
    with pytest.raises(FlaxAttentionError, match="sow"):
        layer.apply(params, x, mask=mask, sow_weights=True)
    q, k, v = qkv()
    with pytest.raises(FlaxAttentionError, match="einsum"):
        fn(q, k, v, qk_attn_weights_einsum=jnp.einsum, attn_weights_value_einsum=jnp.einsum)


def test_dtype_casts_like_flax():
    q, k, v = qkv()
    fn = scoremod.flax.attention_fn(softcap, implementation="xla")
    out = fn(q, k, v, dtype=jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    ref = reference_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=2e-2, rtol=2e-2)
    assert fn(q.astype(jnp.bfloat16), k, v).dtype == jnp.float32  # promoted, as Flax does
    x, _ = inputs()
    layer = nnx.MultiHeadAttention(num_heads=H, in_features=F, decode=False,
                                   dtype=jnp.bfloat16, attention_fn=fn, rngs=nnx.Rngs(0))
    assert layer(x).dtype == jnp.bfloat16


def test_gqa_passes_through():
    q = qkv(shape=(B, L, H, 8))[0]
    k, v = qkv(seed=4, shape=(B, L, 2, 8))[:2]
    mask = jnp.tril(jnp.ones((L, L), bool))
    fn = scoremod.flax.attention_fn(implementation="xla")
    np.testing.assert_allclose(fn(q, k, v, mask=mask),
                               nnx.dot_product_attention(q, k, v, mask=mask),
                               rtol=1e-5, atol=1e-5)


def test_combine_text_and_mod_forms():
    slopes = jnp.linspace(0.1, 0.4, H)
    alibi = scoremod.trace(lambda s, b, h, q, k: s + slopes[h] * (k - q))
    mask = jnp.ones((B, 1, L, L), bool)
    mod = scoremod.flax.combine(alibi, mask=mask, bias=jnp.zeros((1, H, L, L)),
                                shape=(B, H, L, L))
    assert str(mod) == (
        "mask: bool[2, 16, 16]; c0: float32[4]; bias: float32[4, 16, 16]; "
        "where(mask[b, q_idx, kv_idx], score + c0[h] * f32(kv_idx - q_idx) + bias[h, q_idx, "
        "kv_idx], -inf)")
    assert not mod.has_computed_index  # direct reads: the fused path takes them as tensors
    assert scoremod.parse(str(mod)).same_ir(mod)  # declarations stand in for the values
    assert scoremod.flax.combine(alibi, shape=(B, H, L, L)) is alibi
    # operand names of the user's mod are kept apart
    named = scoremod.parse("bias: float32[4]; score + bias[h]", bias=slopes)
    both = scoremod.flax.combine(named, bias=jnp.zeros((H, L, L)), shape=(B, H, L, L))
    assert both.operand_names == ("bias", "bias1")
    assert both.operands[0] is slopes


def test_fn_accepts_text_and_repr():
    fn = scoremod.flax.attention_fn("5.0 * tanh(score / 5.0)", implementation="xla")
    assert fn.score_mod == scoremod.trace(softcap)
    assert "tanh" in repr(fn)
    with pytest.raises(ValueError, match="implementation"):
        scoremod.flax.attention_fn(softcap, implementation="flash")


def test_import_scoremod_without_flax():
    code = textwrap.dedent("""
        import sys
        sys.modules["flax"] = None  # import flax now raises ImportError
        import jax.numpy as jnp
        import scoremod
        import scoremod.flax
        q = k = v = jnp.ones((1, 8, 2, 16))
        out = scoremod.flax.attention_fn(implementation="xla")(
            q, k, v, mask=jnp.tril(jnp.ones((8, 8), bool)))
        assert out.shape == (1, 8, 2, 16)
        assert sys.modules["flax"] is None
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "ok"


def test_guide_flax_examples_run():
    """The ```py blocks of docs/guide.md's "## Flax" section (test_docs runs the python ones)."""
    guide = (pathlib.Path(__file__).parent.parent / "docs" / "guide.md").read_text()
    section = guide[guide.index("\n## Flax\n"):]
    blocks = [textwrap.dedent(m.group(2))
              for m in re.finditer(r"^( *)```py\n(.*?)^\1```", section, re.M | re.S)]
    assert blocks
    namespace = {"__name__": "guide_flax"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/guide.md [Flax py block {i + 1}]", "exec"), namespace)


# --- GPU: the fused path against the reference, in bf16 ----------------------


def assert_fused_bf16_model_close(run):
    """``run(implementation, dtype=bf16) -> (out, grads)`` of one model: the fused
    bf16 model against the reference bf16 and float32 models."""
    out, grads = run("cudnn")
    ref_out, ref_grads = run("xla")
    _, true_grads = run("xla", jnp.float32)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32),
                               atol=3e-2, rtol=3e-2)
    # A bf16 model's parameter gradients sum many rounded terms: judge the fused
    # path by its distance to the float32 model, next to the bf16 reference's.
    leaves = zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), jax.tree.leaves(true_grads))
    for g, r, t in leaves:
        g, r, t = (np.asarray(a, np.float32) for a in (g, r, t))
        scale = max(float(np.abs(t).max()), 1e-6)
        fused_err, ref_err = float(np.abs(g - t).max()), float(np.abs(r - t).max())
        assert fused_err <= max(2 * ref_err, 2e-2 * scale), (fused_err, ref_err, scale)


@pytest.mark.gpu
def test_nnx_fused_matches_reference_bf16():
    length, features = 128, 64  # head_dim 16
    x = jax.random.normal(jax.random.key(0), (B, length, features), jnp.float32)
    mask = nnx.make_causal_mask(x[..., 0], dtype=jnp.bool_)
    w = jax.random.normal(jax.random.key(7), (B, length, features), jnp.float32)

    def run(implementation, dtype=jnp.bfloat16):
        fn = scoremod.flax.attention_fn(softcap, implementation=implementation)
        # cuDNN returns no gradient for operands, so this bias is held fixed.
        model = NnxModel(fn, rngs=nnx.Rngs(1), dtype=dtype, features=features,
                         length=length, learn_bias=False)

        def loss(model, x):
            return jnp.sum(model(x, mask).astype(jnp.float32) * w)

        out = nnx.jit(lambda m, x: m(x, mask))(model, x)
        model_grads, x_grad = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(model, x)
        return out, (nnx.to_pure_dict(model_grads), x_grad)

    assert_fused_bf16_model_close(run)


class LinenPlain(nn.Module):
    """MultiHeadDotProductAttention in a given dtype, no learned bias (cuDNN returns
    no gradient for operands)."""

    attention_fn: object
    dtype: object = jnp.bfloat16

    @nn.compact
    def __call__(self, x, mask):
        attn = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=64, dtype=self.dtype,
                                               attention_fn=self.attention_fn, name="attn")
        return attn(x, mask=mask)


@pytest.mark.gpu
def test_linen_fused_matches_reference_bf16():
    length = 128  # head_dim 32
    x = jax.random.normal(jax.random.key(0), (B, length, 64), jnp.float32)
    mask = nn.make_causal_mask(x[..., 0])
    w = jax.random.normal(jax.random.key(7), (B, length, 64), jnp.float32)

    def run(implementation, dtype=jnp.bfloat16):
        model = LinenPlain(scoremod.flax.attention_fn(softcap, implementation=implementation), dtype)
        params = model.init(jax.random.key(1), x, mask)

        def loss(params, x):
            return jnp.sum(model.apply(params, x, mask).astype(jnp.float32) * w)

        return jax.jit(model.apply)(params, x, mask), jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)

    assert_fused_bf16_model_close(run)
