"""Fused against reference on zero-padded query rows, where every score is 0.

A zero query row makes every score exactly 0: a mod with a kink or a custom
derivative at 0 (softplus, max(s, 0), abs, relu) is then evaluated at its tie,
and the fused backward (the IR's derivative rules) must give what the
reference path (JAX's autodiff) gives there: dQ of those rows is nonzero when
the derivative at 0 is. Also: NaN and inf in V at masked keys (docs/guide.md,
"Masked rows").
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from tests.gpu.test_fused import TOL, _inputs, _rel_err, _run

pytestmark = pytest.mark.gpu


@jax.custom_jvp
def softplus_with_sigmoid_rule(s):
    return jax.nn.softplus(s)  # a custom_jvp function inside one: nested with_grad


softplus_with_sigmoid_rule.defjvp(
    lambda p, t: (softplus_with_sigmoid_rule(p[0]), t[0] * jax.nn.sigmoid(p[0])))

TIE_MODS = {
    "user_custom_jvp": lambda s, b, h, q, k: softplus_with_sigmoid_rule(s),
    "softplus": lambda s, b, h, q, k: jax.nn.softplus(s),
    "max0": lambda s, b, h, q, k: jnp.maximum(s, 0.0),
    "abs": lambda s, b, h, q, k: jnp.abs(s),
    "relu": lambda s, b, h, q, k: jax.nn.relu(s) * 2.0,
    "logaddexp": lambda s, b, h, q, k: jnp.logaddexp(s, 0.0),
    "min0": lambda s, b, h, q, k: jnp.minimum(s, 0.0) + s,
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("name", sorted(TIE_MODS))
def test_zero_padded_query_rows(name, dtype):
    q, k, v, do = _inputs(2, 128, 192, 4, 2, 64, dtype)
    q = q.at[:, 96:].set(0)  # the last 32 query rows are padding: every score is 0
    mod = scoremod.trace(TIE_MODS[name])
    got = jax.jit(lambda *a: _run("cudnn", mod, *a))(q, k, v, do)
    want = jax.jit(lambda *a: _run("xla", mod, *a))(q, k, v, do)
    for label, g, w in zip(("O", "LSE", "dQ", "dK", "dV"), got, want):
        err = _rel_err(g, w)
        assert np.isfinite(err) and err < TOL[dtype], f"{label} off by {err:.3g}"
    # The padded rows on their own (their dQ is the derivative at the tie).
    dq_got, dq_want = got[2][:, 96:], want[2][:, 96:]
    assert _rel_err(dq_got, dq_want) < TOL[dtype]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("native", [True, False], ids=["native_mask", "score_mod_mask"])
def test_nan_values_at_masked_keys(native, bad, dtype, implementation="cudnn"):
    """The masked-key rule (lowering/nonfinite.py): rows that do not see the
    key are untouched, rows that do are NaN; gradients as the reference's."""
    q, k, v, do = _inputs(1, 256, 256, 2, 2, 64, dtype)
    v = v.at[0, 200].set(bad)  # masked for query rows 0..199
    causal = (lambda s, b, h, qi, ki: jnp.where(qi >= ki, s, -jnp.inf)) if native else (
        lambda s, b, h, qi, ki: jnp.where(qi >= ki, s * 1.0 + 0.0 * qi, -jnp.inf))
    mod = scoremod.trace(causal)
    checked = scoremod.LoweringOptions(check_values=True)
    got = jax.jit(lambda *a: _run(implementation, mod, *a, options=checked))(q, k, v, do)
    want = jax.jit(lambda *a: _run("xla", mod, *a))(q, k, v, do)
    o_want = np.asarray(want[0], np.float32)
    assert np.isfinite(o_want[0, :200]).all() and np.isnan(o_want[0, 200:]).all()
    np.testing.assert_array_equal(np.isnan(np.asarray(got[0], np.float32)), np.isnan(o_want))
    for label, g, w in zip(("O", "LSE", "dQ", "dK", "dV"), got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        if label != "O":
            assert np.isfinite(g).all() == np.isfinite(w).all(), label
        err = _rel_err(np.nan_to_num(g), np.nan_to_num(w))
        assert err < TOL[dtype], f"{label} off by {err:.3g}"


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf], ids=["nan", "inf"])
def test_nan_values_at_masked_keys_on_pallas(bad):
    """The same rule on the Pallas backend (its kernels skip the masked tiles
    and multiply the rest by V: the rule around the call must decide)."""
    test_nan_values_at_masked_keys(False, bad, jnp.bfloat16, implementation="pallas")
