"""vmap and forward-mode differentiation of attention, on the reference path and
on the fused path's route (a stand-in kernel behind the custom_vjp)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from scoremod import ScoreModError
from scoremod.dsl.evaluate import evaluate
from scoremod.lowering import registry
from scoremod.lowering.sharding import fold_batch
from tests.test_sharding import STANDIN, StandIn  # the stand-in kernel


@pytest.fixture(autouse=True, scope="module")
def _registered():
    registry.register(STANDIN)
    yield
    registry.unregister(STANDIN.name)


N, M, B, S, H, D = 2, 3, 2, 16, 2, 8


def _arrays(shape, seed):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    return [jax.random.normal(key, shape) for key in ks]


def _close(got, want, tol=1e-5):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.shape == w.shape
        assert np.max(np.abs(g - w)) <= tol * (1 + np.max(np.abs(w))), np.max(np.abs(g - w))


def _per_example_mod(bias, scale):
    """A mod of arrays that may be vmapped: a [b, h] table and a scalar."""
    return lambda s, b, h, q, k: jnp.where(q >= k, s * scale + bias[b, h] + 0.3 * b, -jnp.inf)


@pytest.mark.parametrize("impl", ["xla", "standin"])
def test_nested_vmap_with_per_example_operands(impl):
    """Two vmapped axes fold into the batch; arrays captured per example (vmapped
    along the outer axis) and shared ones, read at b directly or not, all keep
    their meaning, and b stays the index within one example."""
    q, k, v = _arrays((N, M, B, S, H, D), 0)
    bias = jax.random.normal(jax.random.PRNGKey(1), (N, B, H))
    scale = jnp.asarray([1.0, 0.5])
    shared = jnp.asarray([0.0, 2.0])

    def one(q, k, v, bias, scale, impl=impl):
        mod = lambda s, b, h, qi, ki: _per_example_mod(bias, scale)(s, b, h, qi, ki) + shared[b]  # noqa: E731,E501
        return scoremod.attention(q, k, v, mod, implementation=impl)

    def loss(q, k, v, impl=impl):
        inner = jax.vmap(lambda *a: one(*a, impl=impl), in_axes=(0, 0, 0, None, None))
        out = jax.vmap(inner)(q, k, v, bias, scale)
        return jnp.sum(jnp.sin(out))

    # The definition: a Python loop over the examples on the reference path.
    ref = jax.jit(lambda *a: one(*a, impl="xla"))
    want_out = jnp.stack([jnp.stack([ref(q[i, j], k[i, j], v[i, j], bias[i], scale[i])
                                     for j in range(M)]) for i in range(N)])
    got_out = jax.jit(lambda *a: jax.vmap(jax.vmap(lambda *b: one(*b), in_axes=(0, 0, 0, None, None)))(
        *a, bias, scale))(q, k, v)
    _close(got_out, want_out)
    want = jax.jit(jax.value_and_grad(lambda *a: loss(*a, impl="xla"), argnums=(0, 1, 2)))(q, k, v)
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)
    _close(got, want)


def test_vmap_of_unbatched_keys_and_lse():
    """Only the queries vmapped: keys and values broadcast; the LSE unfolds too."""
    q, _, _ = _arrays((N, B, S, H, D), 2)
    _, k, v = _arrays((B, S, H, D), 3)
    mod = scoremod.trace(lambda s, b, h, qi, ki: jnp.where(qi >= ki, s, -jnp.inf))
    f = lambda impl: jax.vmap(lambda q: scoremod.attention(  # noqa: E731
        q, k, v, mod, implementation=impl, return_lse=True))
    _close(jax.jit(f("standin"))(q), jax.jit(f("xla"))(q))


def test_fold_batch_means_the_same_mod():
    """The folded mod at the folded batch index equals the mod of each example."""
    tables = jax.random.normal(jax.random.PRNGKey(4), (N, B, 3))  # vmapped, read at [b, h]
    scalars = jnp.asarray([3.0, -1.0])  # vmapped, a scalar per example
    rows = jnp.asarray([5.0, 7.0])  # shared, read at b
    table0, scalar0 = tables[0], scalars[0]
    mod = scoremod.trace(lambda s, b, h, q, k: s * scalar0 + table0[b, h] + rows[b] + b * q)
    by_shape = {(B, 3): (tables, True), (): (scalars, True), (B,): (rows, False)}
    kinds = [by_shape[node.attr[1]] for node in mod.operand_nodes]
    folded, folded_operands = fold_batch(mod, [x for x, _ in kinds], [m for _, m in kinds], N, B)
    grids = {"score": jnp.float32(1.5), "h": jnp.arange(3)[None, :, None],
             "q_idx": jnp.arange(4)[None, None, :]}
    got = evaluate(folded.expr, dict(grids, b=jnp.arange(N * B)[:, None, None]),
                   dict(zip(folded.operand_names, folded_operands)))
    got = np.broadcast_to(got, (N * B, 3, 4))
    for n in range(N):
        values = {name: x[n] if mapped else x
                  for name, (x, mapped) in zip(mod.operand_names, kinds)}
        want = evaluate(mod.expr, dict(grids, b=jnp.arange(B)[:, None, None]), values)
        np.testing.assert_allclose(got[n * B:(n + 1) * B], np.broadcast_to(want, (B, 3, 4)),
                                   rtol=1e-6)


class NoRemainder(StandIn):
    """A stand-in that cannot compute an integer remainder (the folded b % B)."""

    name = "standin-norem"

    def why_not(self, problem, mod, automatic, options=None):
        if mod is not None and "%" in str(mod):
            return "it has no integer remainder"
        return None


def test_vmap_a_backend_cannot_fold_is_refused_clearly():
    registry.register(NoRemainder())
    try:
        q, k, v = _arrays((N, B, S, H, D), 8)
        uses_b = scoremod.trace(lambda s, b, h, qi, ki: s + 0.5 * b)
        f = jax.vmap(lambda q, k, v: scoremod.attention(q, k, v, uses_b,
                                                        implementation="standin-norem"))
        with pytest.raises(ScoreModError, match=r"under jax.vmap.*no integer remainder"):
            f(q, k, v)
        # A mod without b folds without a remainder.
        plain = scoremod.trace(lambda s, b, h, qi, ki: s * 0.5)
        jax.vmap(lambda q: scoremod.attention(q, k[0], v[0], plain,
                                              implementation="standin-norem"))(q)
    finally:
        registry.unregister("standin-norem")


# --- forward mode ------------------------------------------------------------

def _mod():
    return scoremod.trace(lambda s, b, h, qi, ki: jnp.where(qi >= ki, 5 * jnp.tanh(s / 5),
                                                            -jnp.inf))


class Automatic(StandIn):
    """The stand-in as implementation=None's first choice (as cuDNN on a GPU)."""

    name = "standin-auto"

    def why_not(self, problem, mod, automatic, options=None):
        return None


def test_jvp_with_automatic_choice_falls_back_with_a_warning():
    registry.register(Automatic(), before="xla")
    try:
        q, k, v = _arrays((B, S, H, D), 5)
        mod = _mod()
        f = lambda impl: lambda q, k, v: scoremod.attention(q, k, v, mod, implementation=impl)  # noqa: E731,E501
        assert scoremod.which_implementation(q, k, v, mod)[0] == "standin-auto"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = jax.jvp(f(None), (q, k, v), (v, q, k))
            got_jit = jax.jit(lambda *a: jax.jvp(f(None), a[:3], a[3:]))(q, k, v, v, q, k)
        assert any("jax.jvp" in str(w.message) and "falls back" in str(w.message)
                   for w in caught), [str(w.message) for w in caught]
        want = jax.jvp(f("xla"), (q, k, v), (v, q, k))
        _close(got, want)
        _close(got_jit, want)
        # Reverse mode still takes the fused route, without a warning.
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _close(jax.grad(lambda q: jnp.sum(f(None)(q, k, v)))(q),
                   jax.grad(lambda q: jnp.sum(f("xla")(q, k, v)))(q))
    finally:
        registry.unregister("standin-auto")


def test_jvp_of_a_fused_backend_asked_by_name_is_refused():
    q, k, v = _arrays((B, S, H, D), 6)
    mod = _mod()
    with pytest.raises(ScoreModError, match=r"forward-mode.*implementation=None.*\"xla\""):
        jax.jvp(lambda q: scoremod.attention(q, k, v, mod, implementation="standin"), (q,), (q,))


def test_jvp_and_linearize_on_the_reference_path():
    q, k, v = _arrays((B, S, H, D), 7)
    mod = _mod()
    f = lambda q: scoremod.attention(q, k, v, mod, implementation="xla")  # noqa: E731
    y, t = jax.jvp(f, (q,), (v,))
    y2, lin = jax.linearize(f, q)
    _close((y2, lin(v)), (y, t))
    eps = 1e-3  # and the tangent is the derivative
    _close(t, (f(q + eps * v) - f(q - eps * v)) / (2 * eps), tol=1e-3)


def test_per_example_gradients():
    """vmap of grad (the custom_vjp traced under the batching trace)."""
    q = jax.random.normal(jax.random.PRNGKey(9), (3, B, S, H, D))
    tables = jax.random.normal(jax.random.PRNGKey(10), (3, H))

    def loss(impl):
        def f(q, table):
            mod = lambda s, b, h, i, j: jnp.where(i >= j, s + table[h] + b, -jnp.inf)  # noqa: E731
            return jnp.sum(jnp.sin(scoremod.attention(q, q, q, mod, implementation=impl)))
        return f

    got = jax.jit(jax.vmap(jax.grad(loss("standin"))))(q, tables)
    want = jax.jit(jax.vmap(jax.grad(loss("xla"))))(q, tables)
    _close(got, want)


class _RefusedWhenBuilt(Automatic):
    """Turns the call down only when building its kernels (as cuDNN's 'no engine')."""

    name = "standin-refused"

    def forward(self, plan, q, k, v, operands):
        raise scoremod.UnsupportedOpError("cuDNN refused the forward graph (stand-in)")


class _BackwardRefusedWhenBuilt(Automatic):
    name = "standin-bwd-refused"

    def backward(self, plan, q, k, v, o, lse, do, operands, dlse=None, wanted=()):
        raise scoremod.UnsupportedOpError("cuDNN refused the backward graph (stand-in)")


@pytest.mark.parametrize("kind", [_RefusedWhenBuilt, _BackwardRefusedWhenBuilt])
def test_a_refusal_found_when_building_falls_back_for_implementation_none(kind):
    """implementation=None moves on (with a warning) when the chosen backend turns the
    call down only when building; asked for by name, the refusal is the error."""
    backend = kind()
    registry.register(backend, before="xla")
    try:
        q, k, v = _arrays((B, S, H, D), 11)
        mod = _mod()
        f = lambda impl: lambda q, k, v: scoremod.attention(q, k, v, mod, implementation=impl)  # noqa: E731,E501
        loss = lambda impl: lambda q: jnp.sum(jnp.sin(f(impl)(q, k, v)))  # noqa: E731
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = f(None)(q, k, v), jax.grad(loss(None))(q)
        assert any("refused" in str(w.message) for w in caught), [str(w.message) for w in caught]
        _close(got, (f("xla")(q, k, v), jax.grad(loss("xla"))(q)))
        with pytest.raises(scoremod.UnsupportedOpError, match="stand-in"):
            jax.grad(loss(backend.name))(q)
    finally:
        registry.unregister(backend.name)


# --- forward mode the call cannot see (jax.linearize, jvp of jit, jacfwd, hessian) ---
#
# These reach the fused call as a custom_jvp whose tangent is one primitive:
# evaluated, it is the reference tangent (implementation=None, with a warning);
# transposed (jax.grad), it is the stand-in's backward.

_TINY = (1, 4, 1, 2)  # jacobians are (size x size)


def _tiny(seed):
    return _arrays(_TINY, seed)


def _lin(f, *a):
    y, lin = jax.linearize(f, *a)
    return y, lin(*a[::-1])


_FORWARD = {
    "jvp": lambda f, q, k, v: jax.jvp(f, (q, k, v), (v, q, k)),
    "jvp_of_jit": lambda f, q, k, v: jax.jvp(jax.jit(f), (q, k, v), (v, q, k)),
    "linearize": lambda f, q, k, v: _lin(f, q, k, v),
    "linearize_of_jit": lambda f, q, k, v: _lin(jax.jit(f), q, k, v),
    "jit_of_linearize": lambda f, q, k, v: jax.jit(lambda *a: _lin(f, *a))(q, k, v),
    "jacfwd": lambda f, q, k, v: jax.jacfwd(f, argnums=(0, 1, 2))(q, k, v),
    "jacfwd_of_jit": lambda f, q, k, v: jax.jacfwd(jax.jit(f), argnums=(0, 2))(q, k, v),
    "vmap_of_linearize": lambda f, q, k, v: jax.vmap(
        lambda t: _lin(lambda q: f(q, k, v), q + t)[1])(jnp.stack([q, k, v])),
    "jvp_of_vmap": lambda f, q, k, v: jax.jvp(
        jax.jit(jax.vmap(lambda q: f(q, k, v))), (jnp.stack([q, k]),), (jnp.stack([v, q]),)),
}

_SECOND_ORDER = {
    "hessian": lambda f, q, k, v: jax.hessian(lambda q: jnp.sum(jnp.sin(f(q, k, v))))(q),
    "jacfwd_of_grad": lambda f, q, k, v: jax.jacfwd(
        jax.jit(jax.grad(lambda q, k: jnp.sum(jnp.sin(f(q, k, v))), argnums=(0, 1))))(q, k),
    "grad_of_grad": lambda f, q, k, v: jax.grad(
        lambda q: jnp.sum(jax.grad(lambda q: jnp.sum(jnp.sin(f(q, k, v))))(q) ** 2))(q),
}


def _attend(impl, mod=None):
    mod = mod or _mod()
    return lambda q, k, v: scoremod.attention(q, k, v, mod, implementation=impl)


@pytest.fixture
def automatic():
    registry.register(Automatic(), before="xla")
    yield "standin-auto"
    registry.unregister("standin-auto")


@pytest.mark.parametrize("name", sorted(_FORWARD) + sorted(_SECOND_ORDER))
def test_forward_mode_falls_back_for_implementation_none(automatic, name):
    """Every forward-mode transform gives the reference path's tangents, with a
    warning, however the call is traced (jitted first, linearized, vmapped)."""
    transform = {**_FORWARD, **_SECOND_ORDER}[name]
    q, k, v = _tiny(20) if name.startswith(("jac", "hess")) else _arrays((B, S, H, D), 20)
    assert scoremod.which_implementation(q, k, v, _mod())[0] == automatic
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = transform(_attend(None), q, k, v)
    assert any("falls back" in str(w.message) for w in caught), [str(w.message) for w in caught]
    _close(got, transform(_attend("xla"), q, k, v), tol=1e-4)


@pytest.mark.parametrize("name", sorted(_FORWARD))
def test_forward_mode_of_a_fused_backend_asked_by_name_is_refused(name):
    q, k, v = _tiny(21) if name.startswith("jac") else _arrays((B, S, H, D), 21)
    with pytest.raises(ScoreModError, match=r"forward-mode.*implementation=None.*\"xla\""):
        jax.block_until_ready(_FORWARD[name](_attend("standin"), q, k, v))


@pytest.mark.parametrize("name", sorted(_SECOND_ORDER))
def test_second_order_of_a_fused_backend_asked_by_name_is_refused(name):
    q, k, v = _tiny(22)
    # (forward-over-reverse meets the forward-mode tangent first)
    with pytest.raises(ScoreModError, match=r"(second-order|forward-mode).*implementation=None.*"
                                            r"\"xla\""):
        jax.block_until_ready(_SECOND_ORDER[name](_attend("standin"), q, k, v))


def _count(jaxpr, name, stop="custom_vmap_call"):
    """Equations ``name`` in ``jaxpr`` and its sub-jaxprs, not looking inside ``stop``
    (the boundary of a fused kernel call: lowering.sharding's batching rule)."""
    total = 0
    for eqn in jaxpr.eqns:
        total += eqn.primitive.name == name
        if eqn.primitive.name == stop:
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    total += _count(sub, name, stop)
    return total


_REVERSE = {
    "grad": lambda loss, q: jax.grad(loss)(q),
    "jit_of_grad": lambda loss, q: jax.jit(jax.grad(loss))(q),
    "vjp": lambda loss, q: jax.vjp(loss, q)[1](jnp.float32(1.0)),
    "vmap_of_grad": lambda loss, q: jax.vmap(jax.grad(loss))(jnp.stack([q, 2 * q, -q])),
    "vmap_of_jit_of_grad": lambda loss, q: jax.vmap(jax.jit(jax.grad(loss)))(jnp.stack([q, -q])),
    "nested_vmap_of_grad": lambda loss, q: jax.vmap(jax.vmap(jax.grad(loss)))(
        jnp.stack([jnp.stack([q, -q]), jnp.stack([2 * q, q])])),
    "grad_of_checkpoint": lambda loss, q: jax.jit(jax.grad(jax.checkpoint(loss)))(q),
    "grad_of_vmap": lambda loss, q: jax.grad(
        lambda qs: jnp.sum(jax.vmap(loss)(qs)))(jnp.stack([q, 2 * q])),
}


@pytest.mark.parametrize("name", sorted(_REVERSE))
def test_reverse_mode_stays_fused(automatic, name):
    """jax.grad and company run the stand-in's backward, with no warning."""
    q, k, v = _arrays((B, S, H, D), 23)
    w = jnp.cos(q)
    loss = lambda impl: lambda q: jnp.sum(_attend(impl)(q, k, v) * w)  # noqa: E731
    StandIn.seen.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _REVERSE[name](loss(None), q)
    assert not [w for w in caught if "falls back" in str(w.message)]
    assert {kind for kind, _ in StandIn.seen} == {"forward", "backward"}, StandIn.seen
    _close(got, _REVERSE[name](loss("xla"), q), tol=1e-4)


def test_gradient_jaxpr_is_one_fused_forward_and_one_fused_backward(automatic):
    """The gradient computes the kernels' forward and backward and nothing else:
    no reference forward, no tangent, beside them (every matrix product in the
    program is inside the two kernel calls)."""
    q, k, v = _arrays((B, S, H, D), 24)
    loss = lambda q, k, v: jnp.sum(jnp.sin(_attend(None)(q, k, v)))  # noqa: E731
    StandIn.seen.clear()
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr
    assert {kind for kind, _ in StandIn.seen} == {"forward", "backward"}
    assert _count(jaxpr, "custom_vmap_call") == 2
    assert _count(jaxpr, "dot_general") == 0
    assert _count(jaxpr, "scoremod_attention_tangent") == 0
    # The reference path, for contrast, computes its products in the open.
    ref = jax.make_jaxpr(jax.grad(lambda q: jnp.sum(_attend("xla")(q, k, v))))(q).jaxpr
    assert _count(ref, "dot_general") > 0
    # A linearized call keeps the tangent (to evaluate) and the fused forward only.
    lin = jax.make_jaxpr(lambda q, t: jax.linearize(lambda q: _attend(None)(q, k, v), q)[1](t))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lin_jaxpr = lin(q, v).jaxpr
    assert _count(lin_jaxpr, "scoremod_attention_tangent") == 1
    assert _count(lin_jaxpr, "custom_vmap_call") == 1


def test_operand_derivatives_fall_back_or_are_refused(automatic):
    """Derivatives for a captured array: the reference path computes the whole
    call (implementation=None, with a warning); asked for by name, refused."""
    q, k, v = _arrays((B, S, H, D), 25)
    table = jax.random.normal(jax.random.PRNGKey(26), (H,))

    def f(impl, table):
        mod = lambda s, b, h, i, j: jnp.where(i >= j, s + table[h], -jnp.inf)  # noqa: E731
        return jnp.sum(jnp.sin(scoremod.attention(q, k, v, mod, implementation=impl)))

    for transform in (jax.grad, lambda g: lambda t: _lin(g, t)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = transform(lambda t: f(None, t))(table)
        assert any("score_mod operands" in str(w.message) for w in caught)
        _close(got, transform(lambda t: f("xla", t))(table), tol=1e-4)
    with pytest.raises(scoremod.CudnnUnavailableError, match="stop_gradient"):
        jax.grad(lambda t: f("standin", t))(table)
