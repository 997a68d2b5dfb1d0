"""Tracing: what becomes what, and the errors for what cannot be traced."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from scoremod import ScoreModTypeError, UnsupportedOpError

S, I = jnp.float32, jnp.int32


def text(fn):
    return str(scoremod.trace(fn))


@pytest.mark.parametrize(
    "fn, want",
    [
        (lambda s, b, h, q, k: 30 * jnp.tanh(s / 30), "tanh(score / 30.0) * 30.0"),
        (lambda s, b, h, q, k: jnp.where(q >= k, s, -jnp.inf), "where(q_idx >= kv_idx, score, -inf)"),
        (lambda s, b, h, q, k: jax.nn.relu(s), "relu(score)"),
        (lambda s, b, h, q, k: jnp.maximum(s, 0.0), "max(score, 0.0)"),
        (lambda s, b, h, q, k: jnp.clip(s, -1.0, 1.0), "min(max(score, -1.0), 1.0)"),
        (lambda s, b, h, q, k: jnp.square(s) + s**3, "score ** 2 + score ** 3"),
        (lambda s, b, h, q, k: jax.nn.sigmoid(s), "sigmoid(score)"),
        (lambda s, b, h, q, k: s * (h + 1), "score * f32(h + 1)"),
        (lambda s, b, h, q, k: jnp.where((q - k < 4) & (k <= q), s, -jnp.inf),
         "where(q_idx - kv_idx < 4 and kv_idx <= q_idx, score, -inf)"),
        (lambda s, b, h, q, k: s - jnp.abs(q - k).astype(jnp.float32), "score - f32(abs(q_idx - kv_idx))"),
        (lambda s, b, h, q, k: q * 1.0, "f32(q_idx)"),
        (lambda s, b, h, q, k: jnp.float32(2.0) * s, "score * 2.0"),
        (lambda s, b, h, q, k, c=np.float32(3.0): s / c, "score / 3.0"),
        (lambda s, b, h, q, k: jnp.floor(s) + jnp.ceil(s) + jnp.sign(s), "floor(score) + ceil(score) + sign(score)"),
        (lambda s, b, h, q, k: jnp.exp(s) + jnp.log(s) + jnp.log1p(s) + jnp.expm1(s),
         "exp(score) + log(score) + log1p(score) + expm1(score)"),
        (lambda s, b, h, q, k: jnp.sqrt(s) + jax.lax.rsqrt(s) + jnp.sin(s) + jnp.cos(s) + jax.lax.erf(s),
         "sqrt(score) + rsqrt(score) + sin(score) + cos(score) + erf(score)"),
        (lambda s, b, h, q, k: jnp.power(s, 1.5), "pow(score, 1.5)"),
        (lambda s, b, h, q, k: jnp.where(~(q > k) | (h == 0), s, 0.0),
         "where(not q_idx > kv_idx or h == 0, score, 0.0)"),
    ],
)
def test_traced_text(fn, want):
    assert text(fn) == want


def test_index_arithmetic_matches_jnp_on_negative_values():
    mod = scoremod.trace(lambda s, b, h, q, k: s + ((q - k) // 3) + ((q - k) % 3))
    q, k = jnp.arange(8, dtype=I)[:, None], jnp.arange(8, dtype=I)[None, :]
    want = 0.5 + ((q - k) // 3) + ((q - k) % 3)
    np.testing.assert_array_equal(np.asarray(mod(0.5, 0, 0, q, k)), np.asarray(want, np.float32))


def test_captured_arrays_become_operands():
    slopes, doc = jnp.arange(4.0), jnp.zeros((2, 16), I)
    temp = jnp.float32(0.5)
    mod = scoremod.trace(
        lambda s, b, h, q, k: jnp.where(doc[b, q] == doc[b, k], s * temp + slopes[h], -jnp.inf)
    )
    assert mod.operand_names == ("c0", "c1", "c2")
    assert [tuple(np.shape(v)) for v in mod.operands] == [(2, 16), (), (4,)]
    assert str(mod).startswith("c0: int32[2, 16]; c1: float32[]; c2: float32[4]; ")
    assert not mod.has_computed_index


def test_computed_index_is_marked_and_evaluates_like_jnp():
    table = jnp.linspace(-1, 1, 33)
    fn = lambda s, b, h, q, k: s + table[q - k + 16]  # noqa: E731
    mod = scoremod.trace(fn)
    assert mod.has_computed_index
    q, k = jnp.arange(20, dtype=I)[:, None], jnp.arange(20, dtype=I)[None, :]
    np.testing.assert_array_equal(np.asarray(mod(0.0, 0, 0, q, k)), np.asarray(fn(0.0, 0, 0, q, k)))


def test_arrays_transformed_before_indexing():
    slopes = jnp.arange(4.0)
    mod = scoremod.trace(lambda s, b, h, q, k: (2 * slopes)[h] + slopes.astype(I)[h] * s)
    h = jnp.arange(4, dtype=I)
    np.testing.assert_allclose(np.asarray(mod(1.5, 0, h, 0, 0)), np.asarray(2 * slopes + slopes * 1.5))


def test_same_array_captured_twice_is_one_operand():
    doc = jnp.zeros((2, 16), I)
    mod = scoremod.trace(lambda s, b, h, q, k: jnp.where(doc[b, q] == doc[b, k], s, -jnp.inf))
    assert len(mod.operands) == 1


def test_unsupported_primitive_names_it_and_the_line():
    def mod(s, b, h, q, k):
        return jnp.arcsin(s)  # the line reported

    line = mod.__code__.co_firstlineno + 1
    with pytest.raises(UnsupportedOpError, match=rf"asin at .*test_trace.py:{line}"):
        scoremod.trace(mod)


@jax.custom_vjp
def straight_through(x):
    return jnp.floor(x * 4.0) / 4.0


straight_through.defvjp(lambda x: (straight_through(x), None), lambda _, g: (g,))


def test_custom_vjp_is_refused_with_its_name_and_line():
    """Its custom backward cannot be kept, and the forward's derivative (0
    through floor) would silently differ from jax.grad's (1)."""
    def mod(s, b, h, q, k):
        return straight_through(s) * 2.0  # the line reported

    line = mod.__code__.co_firstlineno + 1
    with pytest.raises(UnsupportedOpError, match=rf"`straight_through` at .*test_trace.py:{line} "
                       r"is a jax.custom_vjp function.*jax.custom_jvp"):
        scoremod.trace(mod)
    with pytest.raises(UnsupportedOpError, match="custom_vjp"):
        scoremod.attention(*(jnp.ones((1, 4, 1, 8)),) * 3, mod, implementation="xla")


def test_custom_jvp_rewrite_of_it_is_traced():
    @jax.custom_jvp
    def straight(x):
        return jnp.floor(x * 4.0) / 4.0

    straight.defjvp(lambda p, t: (straight(p[0]), t[0]))
    mod = scoremod.trace(lambda s, b, h, q, k: straight(s) * 2.0)
    s = jnp.float32(0.3)
    assert float(mod.grad(s, 0, 0, 0, 0)) == 2.0
    assert float(jax.grad(lambda s: mod(s, 0, 0, 0, 0))(s)) == 2.0


def test_unsupported_inside_jax_nn_points_at_user_line():
    def mod(s, b, h, q, k):
        return jax.nn.log_sigmoid(s) + jnp.cumsum(jnp.stack([s, s]))[1]

    with pytest.raises((UnsupportedOpError, ScoreModTypeError)) as e:
        scoremod.trace(mod)
    assert "test_trace.py" in str(e.value)


def test_python_control_flow_gets_a_hint():
    def mod(s, b, h, q, k):
        if q >= k:
            return s
        return -jnp.inf

    with pytest.raises(ScoreModTypeError, match="jnp.where"):
        scoremod.trace(mod)


def test_non_scalar_result_is_refused():
    with pytest.raises(ScoreModTypeError, match="one scalar per score"):
        scoremod.trace(lambda s, b, h, q, k: jnp.stack([s, s]))


def test_boolean_result_is_refused():
    with pytest.raises(ScoreModTypeError, match="boolean"):
        scoremod.trace(lambda s, b, h, q, k: q >= k)


def test_wrong_signature_is_explained():
    with pytest.raises(ScoreModTypeError, match=re.escape("(score, b, h, q_idx, kv_idx)")):
        scoremod.trace(lambda s: s)


def test_low_precision_casts_are_refused():
    with pytest.raises(UnsupportedOpError, match="bfloat16"):
        scoremod.trace(lambda s, b, h, q, k: s.astype(jnp.bfloat16).astype(jnp.float32))


def test_numpy_array_indexed_by_tracer_gets_a_hint():
    table = np.arange(4.0)
    with pytest.raises(ScoreModTypeError, match="jnp.asarray"):
        scoremod.trace(lambda s, b, h, q, k: s + table[h])


def test_traced_under_jit_with_tracer_operands():
    q = jnp.ones((1, 8, 2, 16))

    @jax.jit
    def f(t):
        mod = scoremod.trace(lambda s, b, h, qi, ki: s * t)
        return scoremod.attention(q, q, q, mod, implementation="xla").sum()

    assert np.isfinite(float(f(jnp.float32(2.0))))
    assert float(jax.grad(f)(jnp.float32(2.0))) == pytest.approx(0.0, abs=1e-3)


def test_decorator_form():
    @scoremod.score_mod
    def softcap(score, b, h, q_idx, kv_idx):
        return 50.0 * jnp.tanh(score / 50.0)

    assert isinstance(softcap, scoremod.ScoreMod)
    assert str(softcap) == "tanh(score / 50.0) * 50.0"


def test_sources_point_at_user_lines():
    def mod(s, b, h, q, k):
        t = jnp.tanh(s)
        return t * 2.0

    m = scoremod.trace(mod)
    line = mod.__code__.co_firstlineno
    tanh_node = m.expr.args[0]
    assert m.sources[tanh_node].endswith(f"test_trace.py:{line + 1}")
    assert m.sources[m.expr].endswith(f"test_trace.py:{line + 2}")


def test_calling_a_mod_inside_a_traced_function_gives_the_same_mod():
    slopes, doc, table = jnp.arange(4.0), jnp.zeros((2, 16), I), jnp.ones(33)
    for fn in (lambda s, b, h, q, k: jnp.where(doc[b, q] == doc[b, k], s + slopes[h] * (k - q), -jnp.inf),
               lambda s, b, h, q, k: s + table[q - k + 16]):
        mod = scoremod.trace(fn)
        again = scoremod.trace(lambda *a: mod(*a))
        assert again == mod and again.has_computed_index == mod.has_computed_index
    softcap = scoremod.trace(lambda s, b, h, q, k: 30.0 * jnp.tanh(s / 30.0))
    both = scoremod.trace(lambda s, b, h, q, k: jnp.where(q >= k, softcap(s, b, h, q, k), -jnp.inf))
    assert str(both) == "where(q_idx >= kv_idx, tanh(score / 30.0) * 30.0, -inf)"


# --- bit operations, erfc, reductions and dot products -------------------------

_RNG = np.random.default_rng(20)
_VEC_A = jnp.asarray(_RNG.normal(size=(2, 4, 16, 8)), jnp.float32)
_VEC_C = jnp.asarray(_RNG.normal(size=(2, 4, 16, 8)), jnp.float32)
_TOPK = jnp.asarray(_RNG.integers(0, 2, (2, 4, 16, 4)), bool)
_BLOCKS = jnp.asarray(_RNG.integers(0, 4, (2, 4, 16, 3)), jnp.int32)
_NARROW = jnp.asarray(_RNG.integers(0, 255, (16, 6)), jnp.uint8)

REDUCING_MODS = {
    "dot": lambda s, b, h, q, k: s + jnp.dot(_VEC_A[b, h, q], _VEC_C[b, h, k]),
    "sum_of_products": lambda s, b, h, q, k: s + (_VEC_A[b, h, q] * _VEC_C[b, h, k]).sum(-1),
    "matmul": lambda s, b, h, q, k: s + _VEC_A[b, h, q] @ _VEC_C[b, h, k],
    "einsum": lambda s, b, h, q, k: s + jnp.einsum("r,r->", _VEC_A[b, h, q], _VEC_C[b, h, k]),
    "any": lambda s, b, h, q, k: jnp.where(_TOPK[b, h, q // 4].any(), s, -jnp.inf),
    "all": lambda s, b, h, q, k: jnp.where(_TOPK[b, h, q].all(), s, -1.0),
    "block_member": lambda s, b, h, q, k: jnp.where(
        (_BLOCKS[b, h, q, :] == k // 4).any(), s, -jnp.inf),
    "max_min": lambda s, b, h, q, k: s + _VEC_A[b, h, q].max() - _VEC_C[b, h, k].min(),
    "int_sum": lambda s, b, h, q, k: s + _BLOCKS[b, h, q].sum().astype(jnp.float32),
    "int_or": lambda s, b, h, q, k: s + jnp.bitwise_or.reduce(_BLOCKS[b, h, q]).astype(
        jnp.float32),
    "narrow_sum": lambda s, b, h, q, k: s + _NARROW[q].sum(dtype=jnp.uint8).astype(jnp.float32)
    + _NARROW[k].max().astype(jnp.float32),
    "bits": lambda s, b, h, q, k: s + (((q & 5) ^ (k | 2)) + ~h).astype(jnp.float32),
    "shifts": lambda s, b, h, q, k: s + ((q << 3) >> 2).astype(jnp.float32)
    + jax.lax.shift_right_logical(k - q, 30).astype(jnp.float32),
    "bool_xor": lambda s, b, h, q, k: jnp.where((q >= k) ^ (h == 1), s, -jnp.inf),
    "gelu_exact": lambda s, b, h, q, k: jax.nn.gelu(s, approximate=False),
    "erfc": lambda s, b, h, q, k: jax.scipy.special.erfc(s),
}


def _grid_points(n=96, seed=3):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.normal(0, 2, n), jnp.float32),
            *(jnp.asarray(rng.integers(0, hi, n), jnp.int32) for hi in (2, 4, 16, 16)))


@pytest.mark.parametrize("name", sorted(REDUCING_MODS))
def test_new_ops_and_reductions_trace_to_jax_numpy_values(name):
    fn = REDUCING_MODS[name]
    mod = scoremod.trace(fn)
    pts = _grid_points()
    np.testing.assert_allclose(np.asarray(mod(*pts)), np.asarray(jax.vmap(fn)(*pts)),
                               rtol=2e-6, atol=2e-6)
    grads = jax.vmap(jax.grad(fn))(*pts)
    np.testing.assert_allclose(np.asarray(mod.grad(*pts)), np.asarray(grads), rtol=1e-5, atol=1e-6)
    again = scoremod.parse(str(mod), **dict(zip(mod.operand_names, mod.operands)))
    assert again.same_ir(mod)


def test_gelu_exact_traces_to_erfc_or_erf():
    mod = scoremod.trace(REDUCING_MODS["gelu_exact"])
    ops = {n.op for n in scoremod.dsl.ir.toposort(mod.expr)}
    assert ops & {"erfc", "erf"}  # erfc since jax 0.4.2x; 1 + erf(x / sqrt 2) before


def test_bool_xor_is_not_equal_and_int_ops_are_bitwise():
    assert ") != (" in str(scoremod.trace(REDUCING_MODS["bool_xor"]))
    text = str(scoremod.trace(REDUCING_MODS["bits"]))
    assert "bitwise_and(" in text and "bitwise_xor(" in text and "invert(h)" in text


def test_a_reduction_over_too_many_elements_is_a_clear_error():
    wide = jnp.ones((4, 65), jnp.float32)
    with pytest.raises(UnsupportedOpError, match=r"reduce_sum over 65 elements at .*at most 64"):
        scoremod.trace(lambda s, b, h, q, k: s + wide[h].sum())
    with pytest.raises(UnsupportedOpError, match=r"dot_general over 65 elements"):
        scoremod.trace(lambda s, b, h, q, k: s + jnp.dot(wide[h], wide[0]))
    ok = jnp.ones((4, 64), jnp.float32)
    assert scoremod.trace(lambda s, b, h, q, k: s + ok[h].sum()) is not None


def test_shift_right_logical_of_narrow_signed_ints_is_refused():
    small = jnp.arange(-8, 8, dtype=jnp.int8)
    with pytest.raises(UnsupportedOpError, match="shift_right_logical on int8"):
        scoremod.trace(lambda s, b, h, q, k: s + jax.lax.shift_right_logical(
            small[q], jnp.int8(1)).astype(jnp.float32))


def test_text_form_of_the_bit_ops():
    mod = scoremod.parse("score + f32(bitwise_xor(bitwise_and(q_idx, 3), left_shift(kv_idx, 2))"
                         " + invert(h) + right_shift(q_idx, 1) + shift_right_logical(h, 1))")
    again = scoremod.parse(str(mod))
    assert again.same_ir(mod)
    assert scoremod.parse("score + f32(bitwise_not(h))").same_ir(
        scoremod.parse("score + f32(invert(h))"))
    with pytest.raises(scoremod.ScoreModError, match="int32"):
        scoremod.parse("score + f32(bitwise_and(score, 1.0))")


KEY = jax.random.key(1)


def test_jax_random_in_a_mod_is_refused_naming_the_line():
    """A key made in the mod, a raw uint32 key folded with an index, and a key
    the mod closes over: each a ScoreModError at the user's line (not JAX's
    "Cannot interpret 'key<fry>' as a data type")."""
    def made(s, b, h, q, k):
        return s + jax.random.normal(jax.random.key(0))  # the line reported

    def folded(s, b, h, q, k):
        return s + jax.random.uniform(jax.random.fold_in(jax.random.PRNGKey(0), q))  # reported

    def closed(s, b, h, q, k):
        return s + jax.random.normal(KEY)  # the line reported

    for mod in (made, folded, closed):
        line = mod.__code__.co_firstlineno + 1
        with pytest.raises(UnsupportedOpError,
                           match=rf"jax.random at .*test_trace.py:{line}: .*deterministic.*"
                                 r"Draw them outside the mod"):
            scoremod.trace(mod)


def test_floor_division_of_floats_traces_as_the_text_form_and_matches_jnp():
    """`s // 0.75` is jnp.floor_divide (Python's floor division, which ends in
    lax.round): the IR's floordiv, as `score // 0.75` parses, with jnp's
    values (signs, a zero divisor, inf, NaN) and its derivative, 0."""
    divisors = jnp.asarray([0.75, -0.75, 0.0, 0.1, jnp.inf, -3.0], jnp.float32)
    cases = [
        (lambda s, b, h, q, k: s // 0.75, "score // 0.75", lambda s, h, q: s // 0.75),
        (lambda s, b, h, q, k: 0.75 // s, "0.75 // score", lambda s, h, q: 0.75 // s),
        (lambda s, b, h, q, k: jnp.floor_divide(s, divisors[h]), "score // c0[h]",
         lambda s, h, q: s // divisors[h]),
        (lambda s, b, h, q, k: s // (q - 2), "score // f32(q_idx - 2)",
         lambda s, h, q: s // (q - 2)),
    ]
    s = jnp.asarray([-2.0, -1.5, -0.75, -0.0, 0.0, 0.3, 0.75, 1.0, 7.5, 1e30, jnp.inf,
                     jnp.nan], jnp.float32)[:, None, None]
    h = jnp.arange(6)[None, :, None]
    q = jnp.arange(5)[None, None, :]
    for fn, written, want in cases:
        mod = scoremod.trace(fn)
        assert mod.same_ir(scoremod.parse(written, c0=divisors)), (str(mod), written)
        np.testing.assert_array_equal(np.asarray(mod(s, 0, h, q, 0)), np.asarray(want(s, h, q)))
        grad = jax.vmap(jax.grad(lambda x: mod(x, 0, 1, 3, 0)))(s.ravel())
        want_grad = jax.vmap(jax.grad(lambda x: want(x, 1, 3)))(s.ravel())
        np.testing.assert_array_equal(np.asarray(grad), np.asarray(want_grad))
        assert not np.any(np.asarray(grad))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 8, 2, 16)), jnp.float32)
    out = scoremod.attention(x, x, x, lambda s, b, h, q, k: s // 0.75, implementation="xla")
    scores = jnp.einsum("bqhd,bkhd->bhqk", x, x, precision="highest") / 4.0
    want = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores // 0.75, -1), x,
                      precision="highest")
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_a_function_named_floor_divide_is_traced_as_written():
    @jax.jit
    def floor_divide(a, b):
        return a + b

    assert text(lambda s, b, h, q, k: floor_divide(s, 0.75)) == "score + 0.75"


def test_a_mod_keeps_the_numpy_arrays_it_read_as_they_were_when_traced():
    """NumPy arrays are mutable: jnp.asarray(bias) in the body (which JAX keeps
    as a view of bias's buffer), arithmetic on one, and arrays passed to
    parse or bind are copied, so writing into them later changes no mod,
    eagerly or under jit. (jax arrays are immutable; rebinding a name the
    function closed over does not reach a traced mod either.)"""
    bias = np.arange(8, dtype=np.float32)
    table = np.arange(8, dtype=np.float32)
    given = np.arange(8, dtype=np.float32)
    slopes = jnp.arange(4, dtype=jnp.float32)
    mods = [scoremod.trace(lambda s, b, h, q, k: s + jnp.asarray(bias)[k]),
            scoremod.trace(lambda s, b, h, q, k: s + (jnp.asarray(table) * 2.0)[k]),
            scoremod.parse("score + g[kv_idx]", g=given),
            scoremod.parse("g: float32[8]; score + g[kv_idx]").bind(g=given),
            scoremod.trace(lambda s, b, h, q, k: s + slopes[h])]
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 8, 4, 16)), jnp.float32)
    at_jit = jax.jit(lambda x, mod: scoremod.attention(x, x, x, mod, implementation="xla"))
    before = [(np.asarray(m(0.0, 0, 1, 0, jnp.arange(8))), np.asarray(at_jit(x, m)))
              for m in mods]
    for array in (bias, table, given):
        array[:] = 100.0
    slopes = jnp.full(4, 100.0)  # noqa: F841 - rebound after tracing
    for m, (value, out) in zip(mods, before):
        np.testing.assert_array_equal(np.asarray(m(0.0, 0, 1, 0, jnp.arange(8))), value)
        np.testing.assert_array_equal(np.asarray(at_jit(x, m)), out)
        for operand in m.operands:  # and the copy a mod keeps cannot be written into
            if isinstance(operand, np.ndarray):
                with pytest.raises(ValueError, match="read-only"):
                    operand[0] = 1.0


@pytest.fixture
def x64():
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", False)


def test_with_x64_on_python_floats_trace_as_without_it_and_float64_is_named(x64):
    """jax_enable_x64 makes `-jnp.inf` and `0.5` weak float64 values: a mod
    that only selects, bounds or converts them traces as without x64; one that
    computes in float64 is refused for that, at its line (no cast was written);
    float64 inputs get the inputs' dtype message, not the mod's."""
    slopes = jnp.ones(4, jnp.float32)
    same = [lambda s, b, h, q, k: jnp.where(q >= k, s, -jnp.inf),
            lambda s, b, h, q, k: s + jnp.where(q >= k, 0.0, -jnp.inf),
            lambda s, b, h, q, k: s + jnp.maximum(q - k, 0.5),
            lambda s, b, h, q, k: s + slopes[h] * (k - q),
            lambda s, b, h, q, k: s // 0.75]
    traced = [str(scoremod.trace(fn)) for fn in same]
    jax.config.update("jax_enable_x64", False)
    assert traced == [str(scoremod.trace(fn)) for fn in same]
    jax.config.update("jax_enable_x64", True)

    def half(s, b, h, q, k):
        return s + (q - k) * 0.5  # the line reported

    line = half.__code__.co_firstlineno + 1
    with pytest.raises(UnsupportedOpError,
                       match=rf"mul in float64 at .*test_trace.py:{line} \(`return s \+ \(q - k\) "
                             r"\* 0.5.*jax_enable_x64 on.*astype\(jnp.float32\)"):
        scoremod.trace(half)
    with pytest.raises(UnsupportedOpError, match="gt in float64"):  # a compare, rounded differently
        scoremod.trace(lambda s, b, h, q, k: jnp.where(q > 2.5, s, -jnp.inf))
    with pytest.raises(UnsupportedOpError, match="conversion to float64.*remove the cast"):
        scoremod.trace(lambda s, b, h, q, k: (s.astype(jnp.float64) * 2).astype(jnp.float32))
    x = jnp.ones((1, 8, 2, 16), jnp.float64)
    for mod in (same[0], half, None):
        with pytest.raises(ScoreModTypeError, match=r"query has dtype float64.*query.astype"):
            scoremod.attention(x, x, x, mod, implementation="xla")
