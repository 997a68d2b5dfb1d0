"""The key: different mods never share one, equal mods always do."""

import hashlib
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np

import scoremod
from tests import keyed_mods as km


def key(fn):
    return scoremod.trace(fn).key


def test_module_level_lambdas_with_different_bodies_differ():
    assert km.softcap_lambda.__qualname__ == km.relbias_lambda.__qualname__ == "<lambda>"
    assert key(km.softcap_lambda) != key(km.relbias_lambda)


def test_default_argument_values_are_in_the_key():
    assert key(km.default_30) != key(km.default_50)
    f = km.default_30
    g = lambda s, b, h, q, k, cap=30.0: cap * jnp.tanh(s / cap)  # noqa: E731
    assert key(f) == key(g)


def test_closures_over_different_constants_differ():
    assert key(km.make_softcap(30.0)) != key(km.make_softcap(50.0))
    assert key(km.make_softcap(30.0)) == key(km.make_softcap(30.0))
    assert key(km.make_softcap(np.float32(20.0))) != key(km.make_softcap(30.0))


def test_same_function_traced_twice_has_same_key():
    assert key(km.softcap_named) == key(km.softcap_named)
    assert scoremod.trace(km.softcap_named) == scoremod.trace(km.softcap_named)


def test_different_functions_same_expression_share_key():
    assert key(km.softcap_named) == key(km.softcap_lambda) == key(km.default_30)
    assert key(km.softcap_named) == scoremod.parse("30.0 * tanh(score / 30.0)").key


def test_captured_array_values_are_not_in_the_key():
    a, c = jnp.arange(8.0), jnp.ones(8) * 3
    ma = scoremod.trace(lambda s, b, h, q, k: s + a[h] * (k - q))
    mc = scoremod.trace(lambda s, b, h, q, k: s + c[h] * (k - q))
    assert ma.key == mc.key and ma.same_ir(mc)
    assert ma != mc  # == also compares the values (safe as a jit static argument)
    assert ma.operands[0] is a and mc.operands[0] is c


def test_captured_array_shape_and_dtype_are_in_the_key():
    a8, a16 = jnp.arange(8.0), jnp.arange(16.0)
    a8h = a8.astype(jnp.bfloat16)
    k8 = key(lambda s, b, h, q, k: s + a8[h])
    assert k8 != key(lambda s, b, h, q, k: s + a16[h])
    assert k8 != key(lambda s, b, h, q, k: s + a8h[h])
    # Which index reads the array is in the key too.
    assert k8 != key(lambda s, b, h, q, k: s + a8[b])


def test_key_is_stable_across_processes():
    code = textwrap.dedent(
        """
        import jax.numpy as jnp, scoremod
        slopes = jnp.arange(8.0)
        m = scoremod.trace(lambda s, b, h, q, k: jnp.where(q >= k, 30 * jnp.tanh(s / 30) + slopes[h] * (k - q), -jnp.inf))
        print(m.key)
        """
    )
    slopes = jnp.arange(8.0)
    here = scoremod.trace(
        lambda s, b, h, q, k: jnp.where(q >= k, 30 * jnp.tanh(s / 30) + slopes[h] * (k - q), -jnp.inf)
    ).key
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": seed, "JAX_PLATFORMS": "cpu", "PATH": ""}).stdout.strip()
        for seed in ("1", "2")
    }
    assert outs == {here}


def test_key_is_a_digest_of_the_canonical_text():
    mod = scoremod.parse("where(q_idx >= kv_idx, score, -inf)")
    assert str(mod) == "where(q_idx >= kv_idx, score, -inf)"
    # Changing this breaks persisted cache keys: bump KEY_VERSION if you must.
    want = hashlib.sha256(b"scoremod-ir-1\nwhere(q_idx >= kv_idx, score, -inf)").hexdigest()
    assert mod.key == want


def test_commutative_spellings_share_a_key():
    assert key(lambda s, b, h, q, k: 30 * s) == key(lambda s, b, h, q, k: s * 30)
