"""Positions and lengths (``q_offset``, ``kv_lengths``, ``page_table``): the
reference path against an independent float64 formula, the Pallas kernels
(interpret mode) and a stand-in fused kernel against the reference path, a
decode loop at traced positions compiling once, and the refusals of bad
input."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from scoremod import ScoreModTypeError
from tests.test_sinks import fused_first  # noqa: F401 - the fixture

B, HQ, HKV, D = 2, 4, 2, 64
SLOPES = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)


def mod(s, b, h, q, k):
    """Causal, with an ALiBi bias: both read q_idx, which the offset moves."""
    return jnp.where(q >= k, s + jnp.asarray(SLOPES)[h] * (k - q), -jnp.inf)


def oracle(q, k, v, q_offset, kv_lengths):
    """float64 O [b, sq, hq, d] and LSE [b, hq, sq] for ``mod`` with query row i
    of batch b at position q_offset[b] + i and keys from kv_lengths[b] on masked."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, sq, hq, d = q.shape
    g = hq // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    out = np.zeros((b, sq, hq, v.shape[-1]))
    lse = np.full((b, hq, sq), -np.inf)
    for bi in range(b):
        for i in range(sq):
            pos = q_offset[bi] + i
            for h in range(hq):
                s = k[bi, :, h] @ q[bi, i, h] / np.sqrt(d)
                j = np.arange(k.shape[1])
                s = s + SLOPES[h].astype(np.float64) * (j - pos)
                s = np.where((pos >= j) & (j < kv_lengths[bi]), s, -np.inf)
                if np.isneginf(s).all():
                    continue
                m = s.max()
                e = np.exp(s - m)
                out[bi, i, h] = e @ v[bi, :, h] / e.sum()
                lse[bi, h, i] = np.log(e.sum()) + m
    return out, lse


def _inputs(sq, skv, dtype=jnp.float32, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(ks[0], (B, sq, HQ, D), dtype),
            jax.random.normal(ks[1], (B, skv, HKV, D), dtype),
            jax.random.normal(ks[2], (B, skv, HKV, D), dtype))


def _attention(q, k, v, impl, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return scoremod.attention(q, k, v, mod, implementation=impl, return_lse=True, **kw)


# (sq, q_offset, kv_lengths): a decode step per row, a speculative block, a
# chunk of a prefill; one row with no key at all (kv_lengths 0).
CASES = {
    "decode": (1, [17, 40], [18, 41]),
    "speculative": (4, [30, 3], [34, 7]),
    "chunk": (16, [8, 0], [24, 16]),
    "empty_row": (2, [5, 9], [0, 11]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_path_reads_positions_and_lengths(name):
    sq, off, lengths = CASES[name]
    q, k, v = _inputs(sq, 48)
    o, lse = _attention(q, k, v, "xla", q_offset=jnp.asarray(off, jnp.int32),
                        kv_lengths=jnp.asarray(lengths, jnp.int32))
    want_o, want_lse = oracle(q, k, v, off, lengths)
    np.testing.assert_allclose(np.asarray(o), want_o, atol=2e-6)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-6, atol=1e-6)


def test_paged_cache_reads_logical_positions():
    """Pages in shuffled order: the same results as the contiguous cache they
    make up (and as the formula)."""
    page, pages = 8, 6
    q, k, v = _inputs(3, page * pages)
    rng = np.random.default_rng(0)
    order = rng.permutation(B * pages + 3)[:B * pages].reshape(B, pages)  # 3 pages unused
    cache_k = np.zeros((B * pages + 3, page, HKV, D), np.float32)
    cache_v = np.zeros_like(cache_k)
    for bi in range(B):
        for p in range(pages):
            cache_k[order[bi, p]] = np.asarray(k[bi, p * page:(p + 1) * page])
            cache_v[order[bi, p]] = np.asarray(v[bi, p * page:(p + 1) * page])
    off, lengths = jnp.asarray([20, 41]), jnp.asarray([23, 44])
    got = _attention(q, jnp.asarray(cache_k), jnp.asarray(cache_v), "xla",
                     page_table=jnp.asarray(order, jnp.int32), q_offset=off, kv_lengths=lengths)
    want = _attention(q, k, v, "xla", q_offset=off, kv_lengths=lengths)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(np.asarray(got[0]), oracle(q, k, v, [20, 41], [23, 44])[0],
                               atol=2e-6)


def _grads(impl, q, k, v, off, lengths, sinks=None):
    def loss(q, k, v):
        o, lse = _attention(q, k, v, impl, q_offset=off, kv_lengths=lengths, sinks=sinks)
        return jnp.sum(o * jnp.cos(o)) + 0.3 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)


def _close(got, want, tol):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)


@pytest.mark.parametrize("impl", [None, "pallas"], ids=["fused-standin", "pallas"])
def test_the_fused_pipeline_and_the_pallas_kernels_take_them(fused_first, impl):
    """The stand-in fused kernel (implementation=None) and the Pallas kernels by
    name give the reference path's O, LSE and gradients; with sinks too."""
    sq, off, lengths = CASES["speculative"]
    q, k, v = _inputs(sq, 48)
    off, lengths = jnp.asarray(off), jnp.asarray(lengths)
    sinks = jnp.asarray([0.5, -1.0, 1.0, 0.0])
    assert scoremod.which_implementation(q, k, v, mod, q_offset=off,
                                         kv_lengths=lengths)[0] == "fused-standin"
    _close(_attention(q, k, v, impl, q_offset=off, kv_lengths=lengths),
           _attention(q, k, v, "xla", q_offset=off, kv_lengths=lengths), 2e-6)
    _close(_grads(impl, q, k, v, off, lengths, sinks),
           _grads("xla", q, k, v, off, lengths, sinks), 2e-5)


def test_a_decode_loop_at_traced_positions_compiles_once():
    """100 decode steps, each at a new position and length, through one jitted
    step: one compiled program; the last step's output is the formula's."""
    q, k, v = _inputs(1, 128)
    step = jax.jit(lambda q, k, v, pos: scoremod.attention(
        q, k, v, mod, q_offset=pos, kv_lengths=pos + 1, implementation="xla"))
    for t in range(100):
        pos = jnp.asarray([t, t + 20], jnp.int32)
        out = step(q, k, v, pos)
    assert step._cache_size() == 1
    np.testing.assert_allclose(np.asarray(out), oracle(q, k, v, [99, 119], [100, 120])[0],
                               atol=2e-6)


def test_positions_show_in_the_mod_the_backends_see():
    q, k, v = _inputs(1, 16)
    choice = scoremod.which_implementation(q, k, v, "score", q_offset=jnp.asarray([1, 2]),
                                           kv_lengths=3)
    assert choice[0] == "xla"
    mod_seen = scoremod.positions.apply_positions(scoremod.parse("where(q_idx >= kv_idx, score, "
                                                                  "-inf)"), B, 3, 4)
    text = str(mod_seen)
    assert "q_idx + q_offset[b] >= kv_idx" in text and "kv_idx < kv_lengths[b]" in text, text


@pytest.mark.parametrize("kw, message", [
    ({"q_offset": jnp.asarray([1.0, 2.0])}, "q_offset must be an integer array"),
    ({"q_offset": jnp.asarray([1, 2, 3])}, r"q_offset must have shape \[batch\] = \[2\]"),
    ({"kv_lengths": jnp.zeros((B, 1), jnp.int32)}, r"kv_lengths must have shape \[batch\]"),
    ({"page_table": jnp.zeros((B,), jnp.int32)}, r"page_table must be an integer array \[batch"),
    ({"page_table": jnp.zeros((B, 2), jnp.float32)}, "page_table must be an integer array"),
])
def test_bad_positions_are_refused(kw, message):
    q, k, v = _inputs(2, 16)
    for call in (scoremod.attention, scoremod.which_implementation):
        with pytest.raises(ScoreModTypeError, match=message):
            call(q, k, v, mod, **kw)


def test_a_page_table_needs_a_paged_cache():
    q, k, v = _inputs(2, 16)
    with pytest.raises(ScoreModTypeError, match="must be a paged cache"):
        scoremod.attention(q, k[0], v[0], page_table=jnp.zeros((B, 2), jnp.int32))


def test_the_block_map_skips_the_keys_past_each_rows_length():
    """The block-sparse kernels' map, computed from the traced lengths and offsets,
    visits for each row only the key tiles before its length (a decode step reads
    its own row's keys, not the longest row's)."""
    from scoremod.lowering import block_maps
    from scoremod.lowering.problem import Problem

    lengths, offsets = jnp.asarray([100, 1000], jnp.int32), jnp.asarray([99, 999], jnp.int32)
    causal = scoremod.parse("where(q_idx >= kv_idx, score, -inf)")
    seen = scoremod.positions.apply_positions(causal, 2, offsets, lengths)
    problem = Problem(2, 1, 1024, 4, 4, 64, 64, "bfloat16")
    tiles = jax.jit(lambda ops: block_maps.block_map(seen.expr, ops, problem, 64, 64).q_counts)(
        tuple(seen.operands))
    np.testing.assert_array_equal(np.asarray(tiles)[:, 0, 0], [2, 16])  # ceil(length / 64)
