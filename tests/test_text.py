"""The text form: parsing, printing, errors."""

import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from scoremod import ScoreModSyntaxError, ScoreModTypeError


def test_issue_examples():
    cap = scoremod.parse("cap * tanh(score / cap)", cap=30.0)
    assert str(cap) == "tanh(score / 30.0) * 30.0"
    causal = scoremod.parse("where(q_idx >= kv_idx, score, -inf)")
    assert causal == scoremod.trace(lambda s, b, h, q, k: jnp.where(q >= k, s, -jnp.inf))
    slopes = jnp.arange(8.0)
    alibi = scoremod.parse("score + slopes[h] * (kv_idx - q_idx)", slopes=slopes)
    assert str(alibi) == "slopes: float32[8]; score + slopes[h] * f32(kv_idx - q_idx)"
    assert alibi.operands == (slopes,)


@pytest.mark.parametrize(
    "src, canonical",
    [
        ("score", "score"),
        ("-score", "-score"),
        ("score - -2.0", "score + 2.0"),
        ("(score + 1) * 2", "(score + 1.0) * 2.0"),
        ("score - (1.0 - score)", "score - (1.0 - score)"),
        ("score / 2 / 3", "score / 2.0 / 3.0"),
        ("score / (2.0 / score)", "score / (2.0 / score)"),
        ("-score ** 2", "-score ** 2"),
        ("(-score) ** 2", "(-score) ** 2"),
        ("score ** -2", "score ** -2"),
        ("score ** 0.5", "pow(score, 0.5)"),
        ("q_idx // 64 * 1.0 + score", "f32(q_idx // 64) + score"),
        ("f32(q_idx % 7) + score", "f32(q_idx % 7) + score"),
        ("q_idx / 2 + score", "f32(q_idx) / 2.0 + score"),
        ("where(not q_idx > kv_idx or h == 0, score, 0)", "where(not q_idx > kv_idx or h == 0, score, 0.0)"),
        ("where(q_idx > 1 and (h == 0 or b == 1), score, 0)", "where(q_idx > 1 and (h == 0 or b == 1), score, 0.0)"),
        ("clip(score, -1, 1)", "min(max(score, -1.0), 1.0)"),
        ("maximum(score, 0)", "max(score, 0.0)"),
        ("relu(score)", "relu(score)"),
        ("score - 0.1 * (q_idx - kv_idx)", "score - f32(q_idx - kv_idx) * 0.1"),
        ("where(kv_idx == 1.5, score, 0.0)", "where(f32(kv_idx) == 1.5, score, 0.0)"),
        ("where(b >= 1e-3, score, -inf)", "where(f32(b) >= 0.001, score, -inf)"),
        ("where(q_idx + -2147483648 < 0, score, 0.0)", "score"),
        ("where(q_idx == -2147483648, score, 0.0)", "where(q_idx == -2147483648, score, 0.0)"),
        ("where(q_idx * 1000000 < 0, score, 0.0)", "where(q_idx * 1000000 < 0, score, 0.0)"),
        ("where(h < 0, score, 0.0)", "0.0"),
        ("let t = tanh(score); t * t", "let x0 = tanh(score); x0 * x0"),
        ("1e-3 * score", "score * 0.001"),
        ("true", None),
    ],
)
def test_canonical_text(src, canonical):
    if canonical is None:
        with pytest.raises(ScoreModSyntaxError, match="boolean"):
            scoremod.parse(src)
        return
    mod = scoremod.parse(src)
    assert str(mod) == canonical
    assert scoremod.parse(str(mod)) == mod


def test_floats_round_trip_exactly():
    for v in (1 / 3, 1e-30, 3.4e38, -0.0, 2.5e-7, 123456.789):
        mod = scoremod.parse("score * c", c=v)
        assert scoremod.parse(str(mod)) == mod
        assert scoremod.parse(str(mod)).expr.args[1].attr == np.float32(v)


def test_declarations_stand_for_unbound_arrays():
    mod = scoremod.parse("bias: float32[4, 8, 8]; score + bias[h, q_idx, kv_idx]")
    assert mod.operands == (None,)
    with pytest.raises(ScoreModTypeError, match="bind"):
        mod(0.0, 0, 0, 0, 0)
    bound = mod.bind(bias=jnp.ones((4, 8, 8)))
    assert float(bound(1.0, 0, 1, 2, 3)) == 2.0
    assert bound.same_ir(mod) and bound != mod  # same IR, other values
    with pytest.raises(ScoreModTypeError, match=r"float32\[4, 8, 8\]"):
        mod.bind(bias=jnp.ones((4, 8)))


def test_declaration_must_match_given_array():
    with pytest.raises(ScoreModSyntaxError, match="declared"):
        scoremod.parse("s2: float32[4]; score + s2[h]", s2=jnp.ones(5))


@pytest.mark.parametrize(
    "src, where, what",
    [
        ("score +", "line 1, column 8", "end of text"),
        ("score + * 2", "line 1, column 9", "'*'"),
        ("score $ 2", "line 1, column 7", "character '$'"),
        ("let t = 1.0;\nscore + nope", "line 2, column 9", "unknown name 'nope'"),
        ("tanh(score, score)", "line 1, column 1", "takes 1 arguments"),
        ("frobnicate(score)", "line 1, column 1", "unknown function"),
        ("where(score, score, 0.0)", "line 1, column 1", "where"),
        ("q_idx < kv_idx < 3", "line 1, column 16", "'<'"),
    ],
)
def test_syntax_errors_have_line_and_column(src, where, what):
    with pytest.raises(ScoreModSyntaxError) as e:
        scoremod.parse(src)
    assert where in str(e.value)
    assert what in str(e.value)


@pytest.mark.parametrize(
    "src, column, hint",
    [
        ("jnp.tanh(score)", 4, "write `tanh(...)`, not `jnp.tanh(...)`"),
        ("score + jax.nn.sigmoid(score)", 12, "write `sigmoid(...)`, not `jax.nn.sigmoid(...)`"),
        ("jnp.maximum(score, 0.0)", 4, "write `maximum(...)`"),
        ("where(q_idx >= kv_idx, score, -jnp.inf)", 35, "write `inf`, not `jnp.inf`"),
        ("f32(q_idx.astype(float32))", 10, "convert with f32(x)"),
        ("np.sort(score)", 3, "`np.sort` is not an op"),
    ],
)
def test_a_dot_says_the_text_form_has_no_modules_or_methods(src, column, hint):
    """jax.numpy spellings pasted into the text form: the '.' is named, with
    the op's name in the text form where there is one."""
    with pytest.raises(ScoreModSyntaxError) as e:
        scoremod.parse(src)
    assert f"line 1, column {column}: unexpected character '.'" in str(e.value)
    assert hint in str(e.value)
    assert (e.value.lineno, e.value.offset) == (1, column)


def test_array_used_without_index():
    with pytest.raises(ScoreModSyntaxError, match=r"index it"):
        scoremod.parse("score + slopes", slopes=jnp.ones(4))


def test_zero_d_array_is_an_operand_and_numpy_scalar_a_constant():
    t = scoremod.parse("score * t", t=jnp.float32(2.0))
    assert t.operand_names == ("t",) and str(t) == "t: float32[]; score * t"
    c = scoremod.parse("score * t", t=np.float32(2.0))
    assert c.operands == () and str(c) == "score * 2.0"


def test_index_count_is_checked():
    with pytest.raises(ScoreModSyntaxError, match="indexed with 1"):
        scoremod.parse("score + bias[h]", bias=jnp.ones((2, 3)))


def test_call_evaluates_with_broadcasting():
    mod = scoremod.parse("where(q_idx >= kv_idx, score * 2, -inf)")
    q, k = jnp.arange(3)[:, None], jnp.arange(3)[None, :]
    out = mod(jnp.ones((3, 3)), 0, 0, q, k)
    np.testing.assert_array_equal(np.asarray(out), np.where(np.tril(np.ones((3, 3))) > 0, 2.0, -np.inf))


def test_grad_is_printable_and_parsable():
    mod = scoremod.parse("30.0 * tanh(score / 30.0)")
    assert str(mod.grad) == "let x0 = tanh(score / 30.0); (x0 + 1.0) * (1.0 - x0) * 30.0 / 30.0"
    assert scoremod.parse(str(mod.grad)) == mod.grad
    assert str(scoremod.parse("max(score, 2.0)").grad) == (
        "relu_grad(1.0, score - 2.0) * 0.5 + (1.0 - relu_grad(1.0, 2.0 - score)) * 0.5")
    assert str(scoremod.parse("score + f32(h)").grad) == "1.0"
    assert str(scoremod.parse("f32(q_idx)").grad) == "0.0"


# --- numbers typed as jax.numpy types them ---------------------------------


@pytest.mark.parametrize(
    "text, fn",
    [
        ("score - 0.1 * (q_idx - kv_idx)", lambda s, b, h, q, k: s - 0.1 * (q - k)),
        ("where(kv_idx == 1.5, score, 0.0)", lambda s, b, h, q, k: jnp.where(k == 1.5, s, 0.0)),
        ("where(b >= 1e-3, score, -inf)", lambda s, b, h, q, k: jnp.where(b >= 1e-3, s, -jnp.inf)),
        ("score + q_idx / 2", lambda s, b, h, q, k: s + q / 2),
        ("score + max(q_idx, 0.5)", lambda s, b, h, q, k: s + jnp.maximum(q, 0.5)),
        ("score + where(h > 0, 1, 0.25)", lambda s, b, h, q, k: s + jnp.where(h > 0, 1, 0.25)),
        ("score + (h > 0) * 2", lambda s, b, h, q, k: s + (h > 0) * 2),
        ("score + floor(q_idx) * 1.5", lambda s, b, h, q, k: s + jnp.floor(q) * 1.5),
        ("pow(score, 3)", lambda s, b, h, q, k: jnp.power(s, 3)),
    ],
)
def test_literals_promote_as_in_jax(text, fn):
    s = jnp.array([0.0, -1.5, 2.0, 0.25], jnp.float32)
    idx = jnp.array([0, 1, 2, 3], jnp.int32)
    mod = scoremod.parse(text)
    np.testing.assert_array_equal(np.asarray(mod(s, idx, idx, idx, idx[::-1])),
                                  np.asarray(fn(s, idx, idx, idx, idx[::-1]), np.float32))
    assert mod == scoremod.trace(fn)


def test_float_where_an_index_is_needed():
    with pytest.raises(ScoreModSyntaxError, match=r"i32\(\.\.\.\)"):
        scoremod.parse("score + t[q_idx * 0.5]", t=jnp.ones(4))
    assert scoremod.parse("score + t[i32(q_idx * 0.5)]", t=jnp.ones(4)) is not None


@pytest.mark.parametrize("text, what", [
    ("score + 2147483648 * q_idx", "does not fit int32"),
    ("score * 3000000000", "does not fit int32"),  # JAX: OverflowError
    ("where(q_idx == 99999999999, score, 0.0)", "does not fit int32"),
    ("score * 2 ** -3", "negative power"),
    ("score * q_idx ** -1", "negative power"),
])
def test_number_errors_are_scoremod_errors(text, what):
    with pytest.raises(ScoreModSyntaxError, match=what):
        scoremod.parse(text)


def test_int32_min_round_trips():
    mod = scoremod.parse("where(q_idx - kv_idx == -2147483648, score, 0.0)")
    assert scoremod.parse(str(mod)) == mod
    traced = scoremod.trace(lambda s, b, h, q, k: jnp.where(q + jnp.int32(-2**31) == k, s, 0.0))
    assert scoremod.parse(str(traced)) == traced


def test_declared_array_given_a_number():
    with pytest.raises(ScoreModSyntaxError, match="declared"):
        scoremod.parse("t: float32[4]; score + t[h]", t=2.0)


# --- names ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["inf", "nan", "score", "q_idx", "true", "let", "not", "or"])
def test_reserved_names_cannot_be_given(name):
    with pytest.raises(ScoreModSyntaxError, match="cannot pass a value"):
        scoremod.parse("score * 2.0", **{name: 2.0})


@pytest.mark.parametrize("text", ["let: float32[4]; score + let[h]", "not: float32[4]; score",
                                  "let inf = 2.0; score", "let score = 1.0; score"])
def test_reserved_names_cannot_be_declared(text):
    with pytest.raises(ScoreModSyntaxError):
        scoremod.parse(text)


def test_typo_suggests_the_closest_name():
    with pytest.raises(ScoreModSyntaxError, match="did you mean 'q_idx'"):
        scoremod.parse("where(qidx >= kv_idx, score, -inf)")
    with pytest.raises(ScoreModSyntaxError, match="did you mean 'tanh'"):
        scoremod.parse("tahn(score)")
    with pytest.raises(ScoreModSyntaxError, match=r"parse\(text, cap=\.\.\.\)"):
        scoremod.parse("score * cap")


# --- size limits and linear printing ---------------------------------------------


def test_long_chains_parse_without_recursion():
    n = 5000
    mod = scoremod.parse(" + ".join(["score"] * n))
    assert scoremod.parse(str(mod)) == mod
    nested = "tanh(" * 400 + "score" + ")" * 400
    assert scoremod.parse(str(scoremod.parse(nested))) == scoremod.parse(nested)


@pytest.mark.parametrize("text", ["(" * 600 + "score" + ")" * 600,
                                  "tanh(" * 600 + "score" + ")" * 600,
                                  "score + t[" * 600 + "h" + "]" * 600])
def test_nesting_limit_is_a_syntax_error(text):
    from scoremod.dsl.text import MAX_NESTING

    with pytest.raises(ScoreModSyntaxError, match=f"deeper than {MAX_NESTING}"):
        scoremod.parse(text, t=jnp.ones(4, jnp.int32))


def test_text_size_limit():
    from scoremod.dsl.text import MAX_TEXT_CHARS

    with pytest.raises(ScoreModSyntaxError, match="limit"):
        scoremod.parse("score" + " " * MAX_TEXT_CHARS)


def test_traced_loop_prints_text_that_reparses():
    def fn(s, b, h, q, k):
        for i in range(400):
            s = jnp.tanh(s) * 1.01 + 0.001 * i
        return s

    mod = scoremod.trace(fn)
    assert scoremod.parse(str(mod)) == mod


def test_printing_is_linear():
    """Printing a chain of n ops allocates O(n): the peak for 20000 ops is
    about twice that for 10000 (quadratic printing took 9.75 GB at 20000).
    Memory, not time: measured by tracemalloc, the same on any machine."""
    import tracemalloc

    from scoremod.dsl import ir
    from scoremod.dsl.ops import apply
    from scoremod.dsl.text import format_expr, format_mod

    def chain(n):
        node = ir.var("score")
        for i in range(n):
            node = apply("add", node, ir.const(float(i % 7 + 1), "f32"))
        return node

    peaks = {}
    for n in (10000, 20000):
        node = chain(n)
        tracemalloc.start()
        text = format_mod(node)
        peaks[n] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert len(text) < 20 * n
    assert peaks[20000] < 40e6 and peaks[20000] < 3 * peaks[10000], peaks
    assert len(format_expr(node)) < 5000  # messages are cut
