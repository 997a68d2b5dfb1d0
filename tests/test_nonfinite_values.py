"""The masked-key rule for non-finite V on the fused route (lowering/nonfinite.py).

The rule (docs/guide.md, "Fully masked rows"): a key of weight 0 never
contributes, even when its value holds NaN or inf; a row that gives positive
weight to such a key is NaN. The fused route runs a backend's kernel, which
multiplies the probabilities with V; a stand-in backend with the reference
attention as its kernel, minus the rule (it multiplies P with V as a kernel
does, so 0 * nan is nan), shows that the route adds the rule for every fused
backend: O, LSE, dQ, dK and dV equal the reference path's, under jit, grad
and vmap.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from scoremod.lowering import registry
from scoremod.lowering.problem import Problem
from tests.test_sharding import StandIn  # the stand-in fused backend


def _kernel_attention(q, k, v, mod, scale):
    """Attention as a fused kernel computes it: P @ V, so 0 * inf is NaN."""
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q.reshape(b, sq, hkv, g, d), k,
                   precision=jax.lax.Precision.HIGHEST).reshape(b, hq, sq, -1) * scale
    if mod is not None:
        idx = [jnp.arange(n, dtype=jnp.int32).reshape(shape) for n, shape in
               ((b, (-1, 1, 1, 1)), (hq, (1, -1, 1, 1)), (sq, (1, 1, -1, 1)),
                (k.shape[1], (1, 1, 1, -1)))]
        s = jnp.broadcast_to(mod(s, *idx), s.shape)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    safe = jnp.where(denom == 0, 1.0, denom)
    p = (p / safe).reshape(b, hkv, g, sq, -1)
    o = jnp.einsum("bhgqk,bkhd->bqhgd", p, v, precision=jax.lax.Precision.HIGHEST)
    lse = jnp.where(denom == 0, -jnp.inf, jnp.log(safe) + m)[..., 0]
    return o.reshape(b, sq, hq, -1).astype(q.dtype), lse


class Kernel(StandIn):
    """A fused backend whose kernel is plain attention (no rule of its own);
    records the V each call gets."""

    name = "nonfinite_standin"
    calls: list = []

    def _run(self, plan, q, k, v, operands):
        from scoremod.dsl.scoremod import ScoreMod

        mod = None if plan.mod is None else ScoreMod(plan.mod.expr, tuple(operands))
        return _kernel_attention(q, k, v, mod, plan.scale)

    def forward(self, plan, q, k, v, operands):
        self.calls.append(("forward", Problem.of(q, k, v)))
        return self._run(plan, q, k, v, operands)

    def backward(self, plan, q, k, v, o, lse, do, operands, dlse=None, wanted=()):
        self.calls.append(("backward", Problem.of(q, k, v)))
        _, vjp = jax.vjp(lambda q, k, v: self._run(plan, q, k, v, operands)[0], q, k, v)
        return (*vjp(do), {})


KERNEL = Kernel()


@pytest.fixture(autouse=True, scope="module")
def _registered():
    registry.register(KERNEL)
    yield
    registry.unregister(KERNEL.name)


@pytest.fixture(autouse=True)
def _checked():
    # The rule on the fused paths is opt-in (LoweringOptions.check_values).
    with scoremod.lowering_options(check_values=True):
        yield


def causal(s, b, h, q, k):
    return jnp.where(q >= k, s, -jnp.inf)


def first_rows_masked(s, b, h, q, k):  # rows 0..3 see no key at all
    return jnp.where(q >= 4, s * 0.5, -jnp.inf)


MODS = {"causal": causal, "none": None, "fully_masked_rows": first_rows_masked,
        "softcap": lambda s, b, h, q, k: 5.0 * jnp.tanh(s / 5.0)}
BAD = {"nan": jnp.nan, "inf": jnp.inf, "-inf": -jnp.inf}


def _inputs(b=2, s=16, hq=4, hkv=2, d=8, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(ks[0], (b, s, hq, d))
    k = jax.random.normal(ks[1], (b, s, hkv, d))
    v = jax.random.normal(ks[2], (b, s, hkv, d))
    w = jax.random.normal(ks[3], (b, s, hq, d))
    return q, k, v, w


def _all(impl, mod, q, k, v, w):
    """O, LSE and the gradients of q, k, v for the cotangent w of O."""
    def f(q, k, v):
        return scoremod.attention(q, k, v, mod, implementation=impl, return_lse=True)

    (o, lse), vjp = jax.vjp(f, q, k, v)
    return (o, lse) + tuple(vjp((w, jnp.zeros_like(lse))))


def _all_fused(mod, q, k, v, w):
    """As _all on the stand-in, whose LSE cannot be differentiated (as cuDNN's)."""
    def f(q, k, v):
        o, lse = scoremod.attention(q, k, v, mod, implementation=KERNEL.name, return_lse=True)
        return o, jax.lax.stop_gradient(lse)

    (o, lse), vjp = jax.vjp(f, q, k, v)
    return (o, lse) + tuple(vjp((w, jnp.zeros_like(lse))))


def _same(got, want):
    for label, g, x in zip(("O", "LSE", "dQ", "dK", "dV"), got, want):
        g, x = np.asarray(g), np.asarray(x)
        np.testing.assert_array_equal(np.isnan(g), np.isnan(x), err_msg=label)
        np.testing.assert_allclose(g, x, rtol=1e-5, atol=1e-5, err_msg=label)


@pytest.mark.parametrize("bad", sorted(BAD))
@pytest.mark.parametrize("mod", sorted(MODS))
@pytest.mark.parametrize("hkv", [2, 4], ids=["gqa", "mha"])
def test_fused_route_follows_the_reference_rule(mod, bad, hkv):
    q, k, v, w = _inputs(hkv=hkv)
    # Key 9 of batch 0, kv head 0: masked for query rows 0..8 under causal;
    # key 2 of batch 1, kv head 1, one channel: seen by every causal row from 2.
    v = v.at[0, 9, 0].set(BAD[bad]).at[1, 2, hkv - 1, 3].set(BAD[bad])
    mod = MODS[mod]
    want = jax.jit(lambda *a: _all("xla", mod, *a))(q, k, v, w)
    got = jax.jit(lambda *a: _all_fused(mod, *a))(q, k, v, w)
    _same(got, want)
    o = np.asarray(got[0])
    if mod is causal:
        assert np.isfinite(o[0, :9]).all() and np.isnan(o[0, 9:, :4 // hkv]).all()  # the heads reading kv head 0
    if mod is first_rows_masked:
        assert (o[:, :4] == 0).all()  # the fully masked rows stay zero
    assert np.isfinite(np.asarray(got[4])).all()  # dV: 0 at the non-finite entries


def test_without_the_route_the_kernel_is_nan():
    """The stand-in kernel itself gives NaN at masked keys (so the test above
    can fail): the rule is the route's."""
    q, k, v, _ = _inputs()
    v = v.at[0, 9, 0].set(jnp.nan)
    o, _ = _kernel_attention(q, k, v, causal, 1 / np.sqrt(8))
    assert np.isnan(np.asarray(o[0, :9])).any()


def test_finite_values_take_one_call():
    """All of V finite: the forward runs one kernel call, the backward one
    backward (the other branch is traced but does not run)."""
    q, k, v, w = _inputs()
    got = jax.jit(lambda *a: _all_fused(causal, *a))(q, k, v, w)
    _same(got, _all("xla", causal, q, k, v, w))
    jaxpr = jax.make_jaxpr(lambda *a: _all_fused(causal, *a))(q, k, v, w)
    assert "cond" in str(jaxpr)


@pytest.mark.parametrize("bad_example", [0, 1, None])
def test_under_vmap(bad_example):
    """Under vmap the examples fold into one call: a non-finite value in one
    example does not touch the others."""
    xs = [jnp.stack(t) for t in zip(*(_inputs(seed=i) for i in range(2)))]
    q, k, v, w = xs
    if bad_example is not None:
        v = v.at[bad_example, 0, 9, 0].set(jnp.inf)
    want = jax.vmap(lambda *a: _all("xla", causal, *a))(q, k, v, w)
    got = jax.jit(jax.vmap(lambda *a: _all_fused(causal, *a)))(q, k, v, w)
    _same(got, want)


def test_grad_of_a_loss():
    """jax.grad through the route: NaN rows do not reach a loss that skips them."""
    q, k, v, w = _inputs()
    v = v.at[0, 9, 0].set(jnp.nan)

    def loss(impl):
        def f(q, k, v):
            o = scoremod.attention(q, k, v, causal, implementation=impl)
            return jnp.sum(jnp.where(jnp.isnan(o), 0.0, o) * w)
        return jax.jit(jax.grad(f, argnums=(0, 1, 2)))

    for g, x in zip(loss(KERNEL.name)(q, k, v), loss("xla")(q, k, v)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(x), rtol=1e-5, atol=1e-5)


def test_check_values_off_runs_the_kernel_alone():
    """LoweringOptions(check_values=False) promises V finite: no test, no
    conditional, and the kernel's own NaN at a masked key shows."""
    q, k, v, w = _inputs()
    off = scoremod.LoweringOptions(check_values=False)

    def f(v):
        return scoremod.attention(q, k, v, causal, implementation=KERNEL.name, options=off)

    assert "cond" not in str(jax.make_jaxpr(jax.grad(lambda v: jnp.sum(f(v) * w)))(v))
    np.testing.assert_allclose(np.asarray(f(v)), np.asarray(
        scoremod.attention(q, k, v, causal, implementation="xla")), rtol=1e-5, atol=1e-5)
    bad = v.at[0, 9, 0].set(jnp.nan)
    assert np.isnan(np.asarray(f(bad))[0, :9]).any()


def test_check_values_from_the_environment(monkeypatch):
    from scoremod import options

    assert scoremod.LoweringOptions().check_values is False  # off unless asked for
    monkeypatch.setenv("SCOREMOD_CHECK_VALUES", "1")
    options.defaults.cache_clear()
    try:
        assert options.defaults().check_values is True
    finally:
        options.defaults.cache_clear()
    with pytest.raises(scoremod.ScoreModError, match="check_values"):
        scoremod.LoweringOptions(check_values=1)
