"""Low-rank biases folded into the head dim, fused on the GPU against the reference path.

MLA's decoupled RoPE at head dim 128 + rank 64: the fused call runs causal
attention at d_qk = 192, d_v = 128 under cuDNN's native mask; O, LSE and the
gradients of q, k, v, q_pe and k_pe must match the reference path running the
mod as written (low_rank_bias=False: the bias evaluated in float32).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from tests.gpu.test_fused import TOL, _rel_err

pytestmark = pytest.mark.gpu

WRITTEN = scoremod.LoweringOptions(low_rank_bias=False)


def _mla(b, s, hq, hkv, d, rank, dtype, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    q = jax.random.normal(ks[0], (b, s, hq, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, s, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, s, hkv, d), jnp.float32).astype(dtype)
    do = jax.random.normal(ks[3], (b, s, hq, d), jnp.float32).astype(dtype)
    # bfloat16-exact factors: the fused path carries them in q and k's dtype
    q_pe = (0.3 * jax.random.normal(ks[4], (b, s, hq, rank))).astype(dtype).astype(jnp.float32)
    k_pe = (0.3 * jax.random.normal(ks[5], (b, s, rank))).astype(dtype).astype(jnp.float32)
    return q, k, v, do, q_pe, k_pe


def _mod(q_pe, k_pe):
    return scoremod.trace(lambda s, b, h, qi, ki: jnp.where(
        qi >= ki, s + jnp.dot(q_pe[b, qi, h], k_pe[b, ki]), -jnp.inf))


def _run(impl, options, q, k, v, do, q_pe, k_pe, scale):
    def f(q, k, v, q_pe, k_pe):
        o, lse = scoremod.attention(q, k, v, _mod(q_pe, k_pe), implementation=impl,
                                    return_lse=True, scale=scale, options=options)
        return o, jax.lax.stop_gradient(lse)

    (o, lse), vjp = jax.vjp(f, q, k, v, q_pe, k_pe)
    return (o, lse, *vjp((do, jnp.zeros_like(lse))))


@pytest.mark.parametrize("hkv", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: d.__name__)
def test_mla_rope_fused_matches_reference(hkv, dtype):
    b, s, hq, d, rank = 2, 256, 4, 128, 64
    q, k, v, do, q_pe, k_pe = _mla(b, s, hq, hkv, d, rank, dtype)
    scale = 1.0 / np.sqrt(d + rank)
    choice = scoremod.which_implementation(q, k, v, _mod(q_pe, k_pe))
    assert "head dim 128 becomes 192" in choice.low_rank_bias and choice.implementation == "cudnn"
    got = jax.jit(lambda *a: _run("cudnn", None, *a, scale))(q, k, v, do, q_pe, k_pe)
    want = jax.jit(lambda *a: _run("xla", WRITTEN, *a, scale))(q, k, v, do, q_pe, k_pe)
    names = ("O", "LSE", "dQ", "dK", "dV", "dq_pe", "dk_pe")
    errs = {n: _rel_err(g, w) for n, g, w in zip(names, got, want)}
    for name, err in errs.items():
        assert np.isfinite(err) and err < TOL[dtype], f"{name} off by {err:.3g} (all: {errs})"


def test_mla_rope_past_the_head_dim_limit_runs_with_the_bias_in_the_mod():
    b, s, hq, d, rank = 1, 128, 2, 224, 64  # 224 + 64 > 256
    q, k, v, do, q_pe, k_pe = _mla(b, s, hq, hq, d, rank, jnp.bfloat16)
    choice = scoremod.which_implementation(q, k, v, _mod(q_pe, k_pe))
    assert "stays in the mod" in choice.low_rank_bias
    scale = 1.0 / np.sqrt(d + rank)
    got = jax.jit(lambda *a: _run("xla", None, *a, scale))(q, k, v, do, q_pe, k_pe)
    want = jax.jit(lambda *a: _run("xla", WRITTEN, *a, scale))(q, k, v, do, q_pe, k_pe)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
