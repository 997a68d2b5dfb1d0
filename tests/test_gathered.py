"""lowering.gathered: a float table read through an int array (T5's relative
buckets) folded into one read of the gathered table: the same attention and the
same table gradient as the read written out, on the reference path; every form
the fold must leave alone left alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from scoremod.lowering import gathered

B, S, H, D = 2, 48, 3, 16
BUCKETS = jnp.asarray(np.clip(np.arange(-S + 1, S) // 8, -4, 4) + 4, jnp.int32)  # 9 buckets


def _inputs():
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, v = (jax.random.normal(kk, (B, S, H, D), jnp.float32) for kk in ks[:3])
    table = jax.random.normal(ks[3], (9, H), jnp.float32)
    return q, k, v, table


def _written_out(q, k, v, table, buckets):
    """The attention with T5's bias computed by plain JAX indexing."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=jax.lax.Precision.HIGHEST) / np.sqrt(D)
    rel = jnp.arange(S)[None, :] - jnp.arange(S)[:, None]  # k - q
    bias = table[buckets[rel + S - 1]]  # [q, k, h]
    p = jax.nn.softmax(s + jnp.transpose(bias, (2, 0, 1))[None], axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v, precision=jax.lax.Precision.HIGHEST)


@pytest.mark.parametrize("buckets", [BUCKETS, BUCKETS - 4], ids=["in range", "negative (wrapped)"])
def test_the_fold_keeps_the_attention_and_the_table_gradient(buckets):
    q, k, v, table = _inputs()

    def loss(table, fold):
        mod = lambda s, b, h, qi, ki: s + table[buckets[ki - qi + S - 1], h]  # noqa: E731
        traced = scoremod.trace(mod)
        assert (gathered.fold(traced) is traced) is False  # the read is folded
        return jnp.sum(scoremod.attention(q, k, v, mod, implementation="xla") ** 2)

    want = jax.grad(lambda t: jnp.sum(_written_out(q, k, v, t, buckets) ** 2))(table)
    got = jax.jit(jax.grad(lambda t: loss(t, True)))(table)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * float(jnp.abs(want).max()))
    np.testing.assert_array_equal(got, jax.jit(jax.grad(lambda t: loss(t, True)))(table))
    o = scoremod.attention(q, k, v, lambda s, b, h, qi, ki: s + table[buckets[ki - qi + S - 1], h],
                           implementation="xla")
    np.testing.assert_allclose(o, _written_out(q, k, v, table, buckets), rtol=2e-5, atol=2e-5)


def test_what_is_not_a_table_through_an_int_array_stays():
    """A read at the positions, a float table read through a float array, an int
    array read at a captured array, and an int array of two axes are left as written."""
    table, fbuckets = jnp.zeros((9, H)), jnp.zeros((2 * S - 1,))
    ids2 = jnp.zeros((2, 2 * S - 1), jnp.int32)
    other = jnp.zeros((S,), jnp.int32)
    for fn in (lambda s, b, h, q, k: s + table[k % 9, h],
               lambda s, b, h, q, k: s + table[fbuckets[k - q + S - 1].astype(jnp.int32), h],
               lambda s, b, h, q, k: s + table[BUCKETS[other[q]], h],
               lambda s, b, h, q, k: s + table[ids2[b, k - q + S - 1], h]):
        mod = scoremod.trace(fn)
        assert gathered.fold(mod) is mod, str(mod)


def test_unbound_operands_stay_unbound():
    mod = scoremod.parse("table: float32[9, 3]; bucket: int32[95]; "
                         "score + table[bucket[kv_idx - q_idx + 47], h]")
    folded = gathered.fold(mod)
    assert folded is not mod and folded.operand_names == ("table_bucket",), folded
