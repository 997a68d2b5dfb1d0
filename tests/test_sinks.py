"""Attention sinks (``scoremod.attention(..., sinks=...)``): the reference path
against an independent float64 formula (the sink as one more column of the
softmax, dropped before V), and every other route of the pipeline (the Pallas
kernels in interpret mode, a stand-in fused kernel through the custom_jvp,
jax.vmap, jax.jvp and second order) against the reference path."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from scoremod import ScoreModTypeError
from scoremod.lowering import registry
from scoremod.lowering import sinks as attention_sinks
from scoremod.lowering.reference import REFERENCE
from tests.test_attention import _PallasHere, _StandInFused

B, SQ, SKV, HQ, HKV = 2, 24, 40, 4, 2
SCALE = 0.25
# Head 3's sink is -inf (no sink); row 5 of every head is fully masked.
SINKS = np.array([0.5, -1.25, 2.0, -np.inf], np.float32)


def _mask(q, k):
    return (q + (SKV - SQ) >= k) & (q != 5)


def mod(s, b, h, q, k):
    return jnp.where(_mask(q, k), 20.0 * jnp.tanh(s / 20.0), -jnp.inf)


def oracle(q, k, v, sinks):
    """float64 O [b, sq, hq, dv] and LSE [b, hq, sq]: softmax over the scores
    and the sink's column, the sink's column dropped before V; a row with no
    finite entry at all gives 0 and -inf."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, sq, hq, _ = q.shape
    g = hq // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * SCALE
    qi, ki = np.arange(sq)[:, None], np.arange(k.shape[1])[None]
    s = np.where(_mask(qi, ki), 20.0 * np.tanh(s / 20.0), -np.inf)
    sink = np.broadcast_to(np.asarray(sinks, np.float64), (b, hq))[:, :, None, None]
    full = np.concatenate([s, np.broadcast_to(sink, (b, hq, sq, 1))], axis=-1)
    m = full.max(-1, keepdims=True)
    dead = np.isneginf(m)
    e = np.exp(full - np.where(dead, 0.0, m))
    den = e.sum(-1, keepdims=True)
    p = e[..., :-1] / np.where(dead, 1.0, den)
    o = np.einsum("bhqk,bkhd->bqhd", p, v)
    lse = np.where(dead, -np.inf, np.log(np.where(dead, 1.0, den)) + m)[..., 0]
    return o, lse


def _inputs(dtype=jnp.float32, d=64, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(ks[0], (B, SQ, HQ, d), dtype),
            jax.random.normal(ks[1], (B, SKV, HKV, d), dtype),
            jax.random.normal(ks[2], (B, SKV, HKV, d), dtype))


def _loss_of(o, lse):
    """A scalar that weighs O and the LSE (its finite entries) unevenly."""
    return jnp.sum(o * jnp.cos(o)) + 0.3 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))


def _oracle_loss(q, k, v, sinks):
    o, lse = oracle(q, k, v, sinks)
    return np.sum(o * np.cos(o)) + 0.3 * np.sum(np.where(np.isfinite(lse), lse, 0.0))


def _attention(q, k, v, sinks, impl, m=mod):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fallbacks' warnings: tested in test_attention
        return scoremod.attention(q, k, v, m, scale=SCALE, sinks=sinks, return_lse=True,
                                  implementation=impl)


def _grads(impl, q, k, v, sinks, m=mod):
    return jax.grad(lambda *a: _loss_of(*_attention(*a, impl, m)), argnums=(0, 1, 2, 3))(
        q, k, v, sinks)


@pytest.mark.parametrize("sinks", [SINKS, SINKS[None].repeat(B, 0) + np.array([[0.0], [1.5]],
                                                                                np.float32),
                                   np.array([[-3.0], [0.75]], np.float32),
                                   np.float32(1.0)],
                         ids=["per-head", "per-batch-and-head", "per-batch", "scalar"])
def test_reference_path_is_the_softmax_with_one_more_column(sinks):
    q, k, v = _inputs()
    o, lse = _attention(q, k, v, jnp.asarray(sinks), "xla")
    want_o, want_lse = oracle(q, k, v, sinks)
    np.testing.assert_allclose(np.asarray(o), want_o, atol=2e-6)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-6, atol=1e-6)
    dead = np.asarray(o)[:, 5]  # the fully masked row: zeros, LSE = the sink
    assert not dead.any()
    np.testing.assert_array_equal(np.asarray(lse)[:, :, 5],
                                  np.broadcast_to(np.asarray(sinks, np.float32), (B, HQ)))


def test_reference_gradients_match_float64_finite_differences():
    """d(sinks) entry by entry, and dQ, dK, dV along a random direction, against
    central differences of the float64 formula."""
    q, k, v = _inputs()
    sinks = jnp.asarray(SINKS)
    dq, dk, dv, ds = _grads("xla", q, k, v, sinks)
    eps = 1e-5
    for h in range(3):  # head 3: -inf, its gradient is 0
        e = np.zeros(HQ)
        e[h] = eps
        s64 = SINKS.astype(np.float64)
        fd = (_oracle_loss(q, k, v, s64 + e) - _oracle_loss(q, k, v, s64 - e)) / (2 * eps)
        np.testing.assert_allclose(float(ds[h]), fd, rtol=2e-4)
    assert float(ds[3]) == 0.0
    rng = np.random.default_rng(1)
    for x, g, at in ((q, dq, 0), (k, dk, 1), (v, dv, 2)):
        t = rng.standard_normal(x.shape)
        args = [np.asarray(a, np.float64) for a in (q, k, v)]
        plus, minus = list(args), list(args)
        plus[at], minus[at] = args[at] + eps * t, args[at] - eps * t
        fd = (_oracle_loss(*plus, SINKS) - _oracle_loss(*minus, SINKS)) / (2 * eps)
        np.testing.assert_allclose(float(np.sum(np.asarray(g, np.float64) * t)), fd, rtol=2e-4)


@pytest.mark.parametrize("value", [-1e4, 1e4, -np.inf])
def test_extreme_sinks(value):
    """A very negative sink changes nothing, a very positive one takes the whole
    row (O = 0, LSE = the sink), -inf is no sink at all; gradients stay finite."""
    q, k, v = _inputs()
    sinks = jnp.full((HQ,), value, jnp.float32)
    o, lse = _attention(q, k, v, sinks, "xla")
    plain_o, plain_lse = _attention(q, k, v, None, "xla")
    if value < 0:
        np.testing.assert_array_equal(np.asarray(o), np.asarray(plain_o))
        live = np.isfinite(np.asarray(plain_lse))
        np.testing.assert_array_equal(np.asarray(lse)[live], np.asarray(plain_lse)[live])
        np.testing.assert_array_equal(np.asarray(lse)[~live], np.full((~live).sum(), value))
    else:
        assert not np.asarray(o).any()
        np.testing.assert_array_equal(np.asarray(lse), np.full(lse.shape, value, np.float32))
    for g in _grads("xla", q, k, v, sinks):
        assert np.isfinite(np.asarray(g)).all()


def test_empty_calls_give_the_sink_as_lse():
    q, k, v = _inputs()
    sinks = jnp.asarray(SINKS[:3].tolist() + [0.0])
    for impl in (None, "xla"):
        o, lse = scoremod.attention(q, k[:, :0], v[:, :0], sinks=sinks, return_lse=True,
                                    implementation=impl)
        assert not np.asarray(o).any()
        np.testing.assert_array_equal(np.asarray(lse),
                                      np.broadcast_to(np.asarray(sinks)[None, :, None],
                                                      lse.shape))
    grad = jax.grad(lambda s: jnp.sum(scoremod.attention(
        q, k[:, :0], v[:, :0], sinks=s, return_lse=True)[1]))(sinks)
    np.testing.assert_array_equal(np.asarray(grad), np.full(HQ, B * SQ, np.float32))


def _close(got, want, tol):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=tol, atol=tol)


def test_pallas_kernels_take_sinks():
    """The Pallas kernels (interpret mode) with sinks and a learned operand, GQA,
    Sq != Skv: O, LSE and every gradient as the reference path's; twice the
    same bits."""
    q, k, v = _inputs()
    slopes = jnp.linspace(0.1, 0.4, HQ)
    sinks = jnp.asarray(SINKS)

    def loss(q, k, v, s, slopes, impl):
        m = lambda x, b, h, qi, ki: mod(x, b, h, qi, ki) + slopes[h] * (ki - qi)  # noqa: E731
        return _loss_of(*_attention(q, k, v, s, impl, m))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), static_argnums=5)
    want = grad(q, k, v, sinks, slopes, "xla")
    got = grad(q, k, v, sinks, slopes, "pallas")
    _close(got, want, 2e-5)
    again = grad(q, k, v, sinks, slopes, "pallas")
    for a, b in zip(got, again):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    _close(_attention(q, k, v, sinks, "pallas"), _attention(q, k, v, sinks, "xla"), 2e-6)


@pytest.fixture
def fused_first(monkeypatch):
    """A stand-in fused kernel first (the reference's numbers behind the fused
    protocol: it reads O and LSE in its backward as the kernels do), then the
    Pallas kernels, then the reference path."""
    monkeypatch.setattr(registry, "_BACKENDS", [_StandInFused(), _PallasHere(), REFERENCE])


def test_through_the_fused_pipeline(fused_first):
    """implementation=None on the stand-in fused kernel: the sinks join after its
    forward, its backward runs on the final O and LSE, d(sinks) is the closed
    form; jitted, and under jax.vmap (the mapped axis folds into the batch)."""
    q, k, v = _inputs()
    sinks = jnp.asarray(SINKS)
    assert scoremod.which_implementation(q, k, v, mod, sinks=sinks)[0] == "fused-standin"
    _close(_attention(q, k, v, sinks, None), _attention(q, k, v, sinks, "xla"), 2e-6)
    _close(jax.jit(lambda *a: _grads(None, *a))(q, k, v, sinks), _grads("xla", q, k, v, sinks),
           2e-5)
    per = jnp.stack([sinks, sinks[::-1]])  # vmapped over sinks and q

    def loss(q, s, impl):
        return _loss_of(*_attention(q, k, v, s, impl))

    want = jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, 0, None))(
        jnp.stack([q, q * 0.5]), per, "xla")
    got = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, 0, None)),
                  static_argnums=2)(jnp.stack([q, q * 0.5]), per, None)
    _close(got, want, 2e-5)


class _JoinsSinks(_StandInFused):
    """The stand-in fused kernel that joins per-head sinks in its own forward, as
    cuDNN's does: from the first batch row (the route gives it per-head sinks only)."""

    name = "fused-sinks-standin"
    joined: list = []
    summed: list = []

    def joins_sinks(self, plan, options):
        return not options.check_values

    def sums_sink_gradient(self, plan, options):
        return self.joins_sinks(plan, options)

    def backward_with_sinks(self, plan, q, k, v, o, lse, do, operands, sinks):
        """As cuDNN's dSink: the first batch row's sinks, summed over the batch, the
        total in the first row (a sum over rows of the closed form)."""
        self.summed.append(tuple(sinks.shape))
        dq, dk, dv, _ = self.backward(plan, q, k, v, o, lse, do, operands)
        head = jnp.broadcast_to(sinks[:1], sinks.shape)
        total = attention_sinks.gradient(o, lse, do, None, head).sum(0)
        return dq, dk, dv, jnp.zeros(sinks.shape, jnp.float32).at[0].set(total)

    def forward(self, plan, q, k, v, operands, sinks=None):
        out = super().forward(plan, q, k, v, operands)
        if sinks is None:
            return out
        self.joined.append(tuple(sinks.shape))
        return attention_sinks.combine(*out, jnp.broadcast_to(sinks[:1], sinks.shape))


def test_a_backend_that_joins_sinks_gets_them_per_head_only(monkeypatch):
    """A backend whose forward joins sinks (Backend.joins_sinks, as cuDNN's) gets
    them when they are one per head, under jit and jax.vmap with the sinks unmapped;
    sinks per batch row, sinks vmapped per example and check_values=True join around
    its forward instead. Every way gives the reference path's O, LSE and gradients."""
    joins = _JoinsSinks()
    monkeypatch.setattr(registry, "_BACKENDS", [joins, _PallasHere(), REFERENCE])
    q, k, v = _inputs()
    per_head = jnp.asarray(SINKS)
    per_batch = jnp.asarray(SINKS[None].repeat(B, 0) + np.array([[0.0], [1.5]], np.float32))
    choice = scoremod.which_implementation(q, k, v, mod, sinks=per_head)
    assert choice[0] == joins.name and "inside" in choice.sinks, choice.sinks
    assert "inside" not in scoremod.which_implementation(q, k, v, mod, sinks=per_batch).sinks
    for sinks, inside in ((per_head, True), (per_head[None], True), (per_batch, False)):
        joins.joined.clear()
        joins.summed.clear()
        _close(_attention(q, k, v, sinks, None), _attention(q, k, v, sinks, "xla"), 2e-6)
        _close(jax.jit(lambda *a: _grads(None, *a))(q, k, v, sinks),
               _grads("xla", q, k, v, sinks), 2e-5)
        assert bool(joins.joined) == inside, (sinks.shape, joins.joined)
        # an LSE cotangent (the loss weighs the LSE) leaves the sum to the pipeline
        assert not joins.summed
        only_o = jax.grad(lambda *a: jnp.sum(jnp.sin(_attention(*a, None)[0])),
                          argnums=(0, 3))(q, k, v, sinks)
        _close(only_o, jax.grad(lambda *a: jnp.sum(jnp.sin(_attention(*a, "xla")[0])),
                                argnums=(0, 3))(q, k, v, sinks), 2e-5)
        assert bool(joins.summed) == inside, (sinks.shape, joins.summed)
    checked = scoremod.LoweringOptions(check_values=True)
    assert "inside" not in scoremod.which_implementation(q, k, v, mod, sinks=per_head,
                                                         options=checked).sinks

    def loss(q, s, impl):
        return _loss_of(*_attention(q, k, v, s, impl))

    def o_loss(q, s, impl):
        return jnp.sum(jnp.sin(_attention(q, k, v, s, impl)[0]))

    # Vmapped sinks differ per example: joined from the first batch row (as the
    # stand-in does) they would give the second example the first one's sinks;
    # summed over the folded batch, their gradients would mix the examples'.
    qs = jnp.stack([q, q * 0.5])
    for sinks, axis in ((per_head, None), (jnp.stack([per_head, per_head[::-1]]), 0)):
        for f in (loss, o_loss):
            joins.joined.clear()
            grad = jax.vmap(jax.grad(f, argnums=(0, 1)), in_axes=(0, axis, None))
            got = jax.jit(grad, static_argnums=2)(qs, sinks, None)
            _close(got, grad(qs, sinks, "xla"), 2e-5)
            assert joins.joined
            # the gradient of the examples' sum: the sinks' folded over the batch
            summed = jax.grad(lambda q, s, impl: jnp.sum(jax.vmap(f, in_axes=(0, axis, None))(
                q, s, impl)), argnums=(0, 1))
            _close(jax.jit(summed, static_argnums=2)(qs, sinks, None),
                   summed(qs, sinks, "xla"), 2e-5)


def test_forward_mode_and_second_order_with_sinks(fused_first):
    """jax.jvp in the sinks and the Hessian of the sinks run on the reference
    path (with its warning) and give its numbers."""
    q, k, v = _inputs()
    sinks = jnp.asarray(SINKS[:3].tolist() + [0.1])

    def loss(s, impl):
        return _loss_of(*_attention(q, k, v, s, impl))

    tangent = jnp.linspace(-1.0, 1.0, HQ)
    _close(jax.jvp(lambda s: loss(s, None), (sinks,), (tangent,)),
           jax.jvp(lambda s: loss(s, "xla"), (sinks,), (tangent,)), 2e-5)
    _close(jax.hessian(lambda s: loss(s, None))(sinks),
           jax.hessian(lambda s: loss(s, "xla"))(sinks), 2e-4)


def test_sinks_dtype_and_gradient_shape():
    """Sinks in bfloat16 (any float dtype) broadcast from [batch, 1]; the gradient
    has the user's shape and dtype."""
    q, k, v = _inputs()
    sinks = jnp.array([[0.5], [-2.0]], jnp.bfloat16)
    grad = jax.grad(lambda s: _loss_of(*_attention(q, k, v, s, "xla")))(sinks)
    assert grad.shape == (B, 1) and grad.dtype == jnp.bfloat16


@pytest.mark.parametrize("sinks, message", [
    (np.zeros(HQ, np.int32), "float array"),
    (np.zeros(HKV, np.float32), "one entry per key/value head"),
    (np.zeros((B, HQ, 1), np.float32), r"\[q_heads\] = \[4\]"),
    (np.zeros((3, HQ), np.float32), r"\[batch, q_heads\] = \[2, 4\]"),
])
def test_bad_sinks_are_refused(sinks, message):
    q, k, v = _inputs()
    for call in (scoremod.attention, scoremod.which_implementation):
        with pytest.raises(ScoreModTypeError, match=message):
            call(q, k, v, mod, sinks=sinks)


def test_which_implementation_says_how_sinks_join():
    q, k, v = _inputs(jnp.bfloat16)
    assert scoremod.which_implementation(q, k, v, mod).sinks is None
    with_sinks = scoremod.which_implementation(q, k, v, mod, sinks=SINKS)
    assert "sinks join" in with_sinks.sinks
    by_name = scoremod.which_implementation(q, k, v, mod, sinks=SINKS, implementation="pallas")
    assert "backward runs unchanged" in by_name.sinks, by_name.sinks


def test_flax_attention_fn_takes_sinks():
    """``scoremod.flax.attention_fn``'s function takes ``sinks=`` (bound with
    functools.partial in a module that owns them as a parameter)."""
    import scoremod.flax

    q, k, v = _inputs()
    fn = scoremod.flax.attention_fn(implementation="xla")
    got = fn(q, k, v, sinks=jnp.asarray(SINKS))
    want = scoremod.attention(q, k, v, sinks=jnp.asarray(SINKS), implementation="xla")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
