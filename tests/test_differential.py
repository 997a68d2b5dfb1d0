"""Differential tests: random expressions, as jax.numpy functions and as text,
against the same jax.numpy function evaluated directly; values and gradients.

Each random expression is rendered twice from one spec: as Python source of a
jax.numpy function and as the text form. Four things must agree with
``fn(*points)`` (JAX itself) on a vector of points that includes exact ties
(score 0, -0, equal to the literals) and int32 edge values (0, 2**31 - 1,
values whose products overflow, zero divisors):

* the traced mod's value, and the parsed text's value;
* jax.grad of ``fn`` against the mod's own derivative (``mod.grad``, what the
  fused path runs) and against jax.grad of the reference evaluation.

Values must match exactly (NaN for NaN, the sign of zero included, up to
float32 rounding); derivatives too, with the tolerance docs/guide.md
documents for sums of nearly cancelling terms.
"""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import scoremod

INT_LITERALS = [0, 1, -1, 2, 3, 7, 64, 1000000, 2147483647, -2147483648]
FLOAT_LITERALS = [0.0, 0.5, -0.5, 1.0, 2.0, 0.001, 0.1, 3.0, -0.0, 1e-30]

# name: (jnp source, text source); {0}, {1}, {2} are the operands.
FLOAT_UNARY = {
    "tanh": ("jnp.tanh({0})", "tanh({0})"),
    "sigmoid": ("jax.nn.sigmoid({0})", "sigmoid({0})"),
    "abs": ("jnp.abs({0})", "abs({0})"),
    "neg": ("(-{0})", "(-{0})"),
    "exp": ("jnp.exp({0})", "exp({0})"),
    "exp2": ("jnp.exp2({0})", "exp2({0})"),
    "expm1": ("jnp.expm1({0})", "expm1({0})"),
    "log": ("jnp.log({0})", "log({0})"),
    "log1p": ("jnp.log1p({0})", "log1p({0})"),
    "sqrt": ("jnp.sqrt({0})", "sqrt({0})"),
    "rsqrt": ("lax.rsqrt({0})", "rsqrt({0})"),
    "reciprocal": ("jnp.reciprocal({0})", "reciprocal({0})"),
    "sin": ("jnp.sin({0})", "sin({0})"),
    "cos": ("jnp.cos({0})", "cos({0})"),
    "erf": ("lax.erf({0})", "erf({0})"),
    "floor": ("jnp.floor({0})", "floor({0})"),
    "ceil": ("jnp.ceil({0})", "ceil({0})"),
    "sign": ("jnp.sign({0})", "sign({0})"),
    "relu": ("jax.nn.relu({0})", "relu({0})"),
    "square": ("jnp.square({0})", "square({0})"),
    "cube": ("({0} ** 3)", "({0} ** 3)"),
    "inv_sq": ("({0} ** -2)", "({0} ** -2)"),
    "clip": ("jnp.clip({0}, -1.5, 2.0)", "clip({0}, -1.5, 2.0)"),
}
# Functions that jax.numpy applies to an int and returns a float (or, floor,
# ceil, relu and sign, an int; the text form follows).
FLOAT_OF_INT = ("tanh", "abs", "exp", "exp2", "expm1", "log", "log1p", "sqrt", "reciprocal",
                "sin", "cos", "floor", "ceil", "sign", "relu")
INT_KEEPING = ("abs", "floor", "ceil", "sign", "relu")
# Traced only: functions the text form has no name for (custom_jvp rules).
TRACED_UNARY = {
    "softplus": "jax.nn.softplus({0})",
    "logaddexp": "jnp.logaddexp({0}, 0.5)",
    "relu6": "jax.nn.relu6({0})",
    "silu": "jax.nn.silu({0})",
    "gelu": "jax.nn.gelu({0})",
}
NUM_BINARY = {
    "add": ("({0} + {1})", "({0} + {1})"),
    "sub": ("({0} - {1})", "({0} - {1})"),
    "mul": ("({0} * {1})", "({0} * {1})"),
    "max": ("jnp.maximum({0}, {1})", "max({0}, {1})"),
    "min": ("jnp.minimum({0}, {1})", "min({0}, {1})"),
    "floordiv": ("({0} // {1})", "({0} // {1})"),
    "mod": ("({0} % {1})", "({0} % {1})"),
}
INT_BINARY = {
    "tdiv": ("lax.div({0}, {1})", "trunc_div({0}, {1})"),
    "rem": ("lax.rem({0}, {1})", "rem({0}, {1})"),
}
# An int table read at any index: jnp wraps a negative index once and clamps.
TABLE = jnp.array([5, -3, 0, 7, 2147483647, -2147483648, 1, 9], jnp.int32)
DIV = ("({0} / {1})", "({0} / {1})")
POW = ("jnp.power({0}, {1})", "pow({0}, {1})")
CMP = {"<": "<", "<=": "<=", ">": ">", ">=": ">=", "==": "==", "!=": "!="}


class Gen:
    """Random well-typed expressions; each is (jnp source, text source, type)."""

    def __init__(self, rng: random.Random, traced_only: bool):
        self.rng, self.traced_only = rng, traced_only

    def leaf(self, want):
        r = self.rng
        if want == "f":
            pick = r.random()
            if pick < 0.55:
                return "s", "score", False
            lit = r.choice(FLOAT_LITERALS)
            return repr(lit), repr(lit), True
        if r.random() < 0.75:
            v = r.choice(["b", "h", "q", "k"])
            return v, {"q": "q_idx", "k": "kv_idx"}.get(v, v), False
        lit = r.choice(INT_LITERALS)
        return f"({lit})", f"({lit})", True

    def expr(self, want, depth):
        """(jnp, text, is_literal) of type ``want``: "f" float, "i" int, "b" bool."""
        r = self.rng
        if want == "b":
            if r.random() < 0.2 and depth > 0:
                (a, ta, _), (c, tc, _) = self.expr("b", depth - 1), self.expr("b", depth - 1)
                op = r.choice(["and", "or"])
                return (f"({a} {'&' if op == 'and' else '|'} {c})", f"({ta} {op} {tc})", False)
            if r.random() < 0.1 and depth > 0:
                a, ta, _ = self.expr("b", depth - 1)
                return f"(~{a})", f"(not {ta})", False
            op = r.choice(sorted(CMP))
            kinds = r.choice(["ii", "if", "fi", "ff"])
            (a, ta, la), (c, tc, lc) = self.pair(kinds, depth - 1)
            return f"({a} {op} {c})", f"({ta} {op} {tc})", False
        if depth <= 0:
            return self.leaf(want)
        roll = r.random()
        if want == "i":
            if roll < 0.55:
                name = r.choice(["add", "sub", "mul", "max", "min", "floordiv", "mod",
                                 "tdiv", "rem"])
                (a, ta, _), (c, tc, _) = self.pair("ii", depth - 1)
                js, ts = {**NUM_BINARY, **INT_BINARY}[name]
                return js.format(a, c), ts.format(ta, tc), False
            if roll < 0.6:
                idx, tidx, lit = self.expr("i", depth - 1)
                if lit:
                    return self.leaf("i")
                if r.random() < 0.5:  # the query-block split's shift of an index
                    n = r.choice([0, 37, -5])
                    return f"({idx} + ({n}))", f"offset({tidx}, {n})", False
                if self.traced_only:  # jnp wraps a negative index once, then clamps
                    return f"TABLE[{idx}]", None, False
                # the text form's name[i] clamps (docs/guide.md)
                return f"TABLE[jnp.clip({idx}, 0, 7)]", f"table[{tidx}]", False
            if roll < 0.65:
                a, ta, la = self.expr("i", depth - 1)
                if la:
                    return self.leaf("i")
                return f"jnp.abs({a})", f"abs({ta})", False
            if roll < 0.75:
                a, ta, la = self.expr("f", depth - 1)
                if la:
                    return self.leaf("i")
                return f"({a}).astype(jnp.int32)", f"i32({ta})", False
            if roll < 0.85:
                (c, tc, _), (a, ta, _), (e, te, _) = (self.expr("b", depth - 1),
                                                      *self.pair("ii", depth - 1))
                return f"jnp.where({c}, {a}, {e})", f"where({tc}, {ta}, {te})", False
            return self.leaf("i")
        # float results
        if roll < 0.35:
            if self.traced_only and r.random() < 0.25:
                js = TRACED_UNARY[r.choice(sorted(TRACED_UNARY))]
                a, _, la = self.expr("f", depth - 1)
                return (js.format(a), None, False) if not la else self.leaf("f")
            name = r.choice(sorted(FLOAT_UNARY))
            js, ts = FLOAT_UNARY[name]
            kind = r.choice("ff" + "i" * (name in FLOAT_OF_INT))
            a, ta, la = self.expr(kind, depth - 1)
            if la:  # a function of a literal is a Python number in jnp: not an expression
                return self.leaf("f")
            if kind == "i" and name in INT_KEEPING:
                return (f"({js.format(a)}).astype(jnp.float32)", f"f32({ts.format(ta)})",
                        False)
            return js.format(a), ts.format(ta), False
        if roll < 0.75:
            name = r.choice(sorted(NUM_BINARY) + ["div", "pow"])
            js, ts = DIV if name == "div" else POW if name == "pow" else NUM_BINARY[name]
            kinds = r.choice(["ff", "ff", "fi", "if"])
            (a, ta, la), (c, tc, lc) = self.pair(kinds, depth - 1)
            return js.format(a, c), ts.format(ta, tc), False
        if roll < 0.85:
            a, ta, la = self.expr("i", depth - 1)
            if la:
                return self.leaf("f")
            return f"({a}).astype(jnp.float32)", f"f32({ta})", False
        if roll < 0.88:
            (g, tg, _), (x, tx, lit) = self.pair("ff", depth - 1)
            if lit:  # x > 0 of a literal is a Python bool: jnp.where of a constant
                return self.leaf("f")
            return f"jnp.where({x} > 0, {g}, 0.0)", f"relu_grad({tg}, {tx})", False
        if roll < 0.9:
            c, tc, lit = self.expr("i", depth - 1)
            if lit:
                return self.leaf("f")
            return (f"jnp.where(({c}).astype(bool), 1.5, -0.5)",
                    f"where(bool({tc}), 1.5, -0.5)", False)
        if roll < 0.95:
            c, tc, _ = self.expr("b", depth - 1)
            (a, ta, _), (e, te, _) = self.pair(r.choice(["ff", "fi", "if"]), depth - 1)
            return f"jnp.where({c}, {a}, {e})", f"where({tc}, {ta}, {te})", False
        return self.leaf("f")

    def pair(self, kinds, depth):
        """Two operands, not both literals (Python would compute those itself)."""
        a = self.expr(kinds[0], depth)
        c = self.expr(kinds[1], depth)
        while a[2] and c[2]:
            c = self.expr(kinds[1], max(depth, 1))
        return a, c


def random_exprs(seed, n, traced_only=False, depth=4):
    rng = random.Random(seed)
    gen = Gen(rng, traced_only)
    out = []
    while len(out) < n:
        js, ts, lit = gen.expr("f", rng.randint(1, depth))
        if not lit:
            out.append((js, None if traced_only else ts))
    return out


def _points():
    """Scores with exact ties (0, -0, the literals) and int32 edge values."""
    scores = [0.0, -0.0, 0.5, -0.5, 1.0, -1.0, 2.0, 3.0, -1.5, 0.001, 0.1, 6.0, 1e-30,
              -3.25, 7.5, 100.0, -100.0, 0.75, 1.25, -0.25]
    ints = [0, 1, 2, 3, 7, 63, 64, 3000, 46341, 2**31 - 1, 2**31 - 64, 1000]
    rng = np.random.default_rng(0)
    n = 96
    s = np.array(scores + list(rng.normal(0, 2, n - len(scores))), np.float32)
    idx = [np.array([ints[(i * p + c) % len(ints)] for i in range(n)], np.int32)
           for p, c in ((1, 0), (5, 3), (7, 1), (11, 5))]
    return (jnp.asarray(s), *(jnp.asarray(x) for x in idx))


POINTS = _points()


def _fn(js):
    return eval(f"lambda s, b, h, q, k: jnp.asarray({js}, jnp.float32)",
                {"jnp": jnp, "jax": jax, "lax": lax, "TABLE": TABLE})


def _same(got, want, what, src, rtol=2e-6, atol=0.0, where=True):
    got, want = np.broadcast_to(np.asarray(got), np.shape(want)), np.asarray(want)
    both_nan = np.isnan(got) & np.isnan(want)
    close = np.isclose(got, want, rtol=rtol, atol=atol) | both_nan | (got == want)
    close |= ~np.broadcast_to(np.asarray(where, bool), close.shape)
    if not close.all():
        i = int(np.argmin(close))
        pt = [np.asarray(p)[i] for p in POINTS]
        raise AssertionError(f"{what} of {src!r} at (s, b, h, q, k) = {pt}: got {got[i]}, "
                             f"JAX gives {want[i]}")


def _traced(fn):
    """The traced mod, or None where the tracer refuses (a refusal is not a wrong
    result: float ``%`` traces to lax.round, which has no IR op; lax.pow with
    an int exponent has no IR op either)."""
    try:
        return scoremod.trace(fn)
    except scoremod.ScoreModError:
        return None


def _check_value(js, ts):
    fn = _fn(js)
    want = fn(*POINTS)
    mod = _traced(fn)
    if mod is not None:
        _same(mod(*POINTS), want, "traced value", js)
        assert scoremod.parse(str(mod)).same_ir(mod)
    if ts is not None:
        mod = scoremod.parse(ts, table=TABLE) if "table[" in ts else scoremod.parse(ts)
        _same(mod(*POINTS), want, "text value", ts)
        assert scoremod.parse(str(mod)).same_ir(mod)


def _check_grad(js):
    fn = _fn(js)
    mod = _traced(fn)
    if mod is None:
        return
    want = jax.grad(lambda s: jnp.sum(fn(s, *POINTS[1:])))(POINTS[0])
    # The rules are JAX's formulas, but XLA may evaluate a sum of nearly
    # cancelling terms (gelu's derivative at -4) in another order: float32
    # rounding of the terms, not of the result, bounds the difference. A wrong
    # tie (0.5 against 0 or 1), sign or NaN is far outside this tolerance.
    tol = dict(rtol=1e-2, atol=1e-4)
    # The mod's own rules (the fused path's backward) use no float comparison:
    # at a point where the mod's value is NaN or inf they may differ from JAX's
    # (max(7, nan) splits a tie). Documented in docs/guide.md.
    finite = np.isfinite(np.asarray(fn(*POINTS)))
    _same(mod.grad(*POINTS), want, "the mod's derivative", js, where=finite, **tol)
    ref = jax.grad(lambda s: jnp.sum(mod(s, *POINTS[1:])))(POINTS[0])
    _same(ref, want, "the reference path's derivative", js, **tol)
    assert scoremod.parse(str(mod)).same_ir(mod)


# Op by op, as JAX runs a function outside jit: every op rounds as IEEE
# float32 says (XLA may fuse and reassociate inside a jit), and no compile
# per expression, so CI runs thousands of expressions in about a minute.
N_VALUE, N_GRAD, CHUNKS = 250, 150, 5


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_text_and_trace_values_match_jax(chunk):
    with jax.disable_jit():
        for js, ts in random_exprs(1000 + chunk, N_VALUE):
            _check_value(js, ts)


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_derivatives_match_jax(chunk):
    with jax.disable_jit():
        for js, _ in random_exprs(2000 + chunk, N_GRAD, traced_only=True):
            _check_grad(js)


def test_generator_reaches_every_op():
    """The random expressions above reach every op of the table."""
    seen = set()
    with jax.disable_jit():
        for js, ts in [*random_exprs(1000, N_VALUE), *random_exprs(2000, N_GRAD, True)]:
            for mod in (_traced(_fn(js)), ts and scoremod.parse(ts, table=TABLE)):
                if mod:
                    seen |= {n.op for n in scoremod.dsl.ir.toposort(mod.expr)}
    assert set(scoremod.OPS) - seen == set()


# --- non-finite values at masked keys (docs/guide.md, "Masked rows") -----------


def _attention_inputs(seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(ks[0], (1, 8, 2, 16), jnp.float32)
    k = jax.random.normal(ks[1], (1, 8, 2, 16), jnp.float32)
    v = jax.random.normal(ks[2], (1, 8, 2, 16), jnp.float32)
    return q, k, v


CAUSAL = "where(q_idx >= kv_idx, score, -inf)"


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_masked_keys_never_contribute(bad):
    q, k, v = _attention_inputs()
    clean = scoremod.attention(q, k, v, CAUSAL, implementation="xla")
    poisoned = v.at[0, 5].set(bad)  # key 5: masked for query rows 0..4
    out = scoremod.attention(q, k, poisoned, CAUSAL, implementation="xla")
    np.testing.assert_array_equal(np.asarray(out[0, :5]), np.asarray(clean[0, :5]))
    # Rows that attend to key 5 are NaN (every column), as documented.
    assert np.isnan(np.asarray(out[0, 5:])).all()
    # Gradients of the clean rows stay finite.
    def clean_rows(v):
        return jnp.sum(scoremod.attention(q, k, v, CAUSAL, implementation="xla")[0, :5])

    grads = jax.grad(clean_rows)(poisoned)
    assert np.isfinite(np.asarray(grads)).all()


def test_finite_values_unchanged_by_the_masked_key_rule():
    q, k, v = _attention_inputs(1)
    out = scoremod.attention(q, k, v, CAUSAL, implementation="xla")
    mask = jnp.tril(jnp.ones((8, 8), bool))[None, None]
    want = jax.nn.dot_product_attention(q, k, v, mask=mask)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-5, atol=2e-6)


# --- the fused path's forms (cudnn_rules), evaluated on the CPU ------------------


def _small_points():
    """Positions below 2**24, where the fused path's float forms of // and % are exact."""
    s, *idx = POINTS
    return (s, *(jnp.minimum(i, 4095) for i in idx))


def _check_fused_forms(js):
    from scoremod.lowering.cudnn import rules as cudnn_rules
    from scoremod.dsl.evaluate import evaluate

    fn = _fn(js)
    mod = _traced(fn)
    if mod is None:
        return 0
    try:
        cudnn_rules.check_supported(mod.expr, mod.sources)
    except scoremod.UnsupportedOpError:
        return 0
    fwd, bwd = cudnn_rules.forward_and_backward(mod.expr)
    assert not {"with_grad", "tangent"} & {n.op for n in scoremod.dsl.ir.toposort(fwd, bwd)}
    pts = _small_points()
    inputs = dict(zip(scoremod.dsl.ir.VAR_NAMES, pts), dP=jnp.float32(1.0))
    want = fn(*pts)
    # The fused path assumes finite values (NaN and inf tests fold to false).
    finite = np.isfinite(np.asarray(want))
    arrays = dict(zip(mod.operand_names, mod.operands))
    # cuDNN has no log1p, expm1, exp2: log(x + 1), exp(x) - 1, exp(x * ln 2)
    # round differently near 0.
    _same(evaluate(fwd, inputs, arrays), want, "the fused forward form", js, where=finite,
          rtol=1e-4, atol=1e-6)
    grad = jax.grad(lambda s: jnp.sum(fn(s, *pts[1:])))(pts[0])
    _same(evaluate(bwd, inputs, arrays), grad, "the fused backward form", js, where=finite,
          rtol=1e-2, atol=1e-4)
    return 1


def test_fused_forms_match_jax():
    checked = 0
    with jax.disable_jit():
        for js, _ in random_exprs(3000, 300, traced_only=True):
            checked += _check_fused_forms(js)
    assert checked > 60  # most mods with a float comparison are refused


@pytest.mark.parametrize("fn, grad_at_0", [
    (lambda s, b, h, q, k: jax.nn.softplus(s), 0.5),
    (lambda s, b, h, q, k: jnp.logaddexp(s, 0.0), 0.5),
    (lambda s, b, h, q, k: jax.nn.relu(s), 0.0),
    (lambda s, b, h, q, k: jnp.maximum(s, 0.0), 0.5),
    (lambda s, b, h, q, k: jnp.abs(s), 1.0),
    (lambda s, b, h, q, k: jnp.clip(s, 0.0, 1.0), 0.5),
])
def test_ties_on_the_fused_path(fn, grad_at_0):
    from scoremod.lowering.cudnn import rules as cudnn_rules
    from scoremod.dsl.evaluate import evaluate

    mod = scoremod.trace(fn)
    cudnn_rules.check_supported(mod.expr, mod.sources)
    _, bwd = cudnn_rules.forward_and_backward(mod.expr)
    inputs = dict(score=jnp.float32(0.0), b=0, h=0, q_idx=0, kv_idx=0, dP=jnp.float32(1.0))
    assert float(evaluate(bwd, inputs, {})) == grad_at_0
    assert float(jax.grad(lambda s: fn(s, 0, 0, 0, 0))(jnp.float32(0.0))) == grad_at_0
    assert float(mod.grad(jnp.float32(0.0), 0, 0, 0, 0)) == grad_at_0


@pytest.mark.parametrize("fn, why", [
    (lambda s, b, h, q, k: jax.nn.relu6(s), "compares float"),
    (lambda s, b, h, q, k: jnp.where(q // k == 1, s, -jnp.inf), "divisor may be 0"),
    (lambda s, b, h, q, k: s + ((q - k) % (h - 1)), "divisor may be 0"),
])
def test_fused_path_refuses_what_it_cannot_match(fn, why):
    from scoremod.lowering.cudnn import rules as cudnn_rules

    mod = scoremod.trace(fn)
    with pytest.raises(scoremod.UnsupportedOpError, match=why):
        cudnn_rules.check_supported(mod.expr, mod.sources)


def test_int_ranges_bound_every_value():
    """rewrite.int_range, which every integer simplification relies on, bounds
    the value XLA computes, wrap-around and division by zero included."""
    from scoremod.dsl.rewrite import int_range

    rng = random.Random(7)
    gen = Gen(rng, traced_only=False)
    checked = 0
    with jax.disable_jit():
        while checked < 300:
            js, ts, lit = gen.expr("i", rng.randint(1, 4))
            if lit:
                continue
            node = scoremod.parse(ts, table=TABLE).expr.args[0]  # under the f32 cast
            if node.dtype != "i32":
                continue
            lo, hi = int_range(node)
            fn = eval(f"lambda s, b, h, q, k: {js}", {"jnp": jnp, "jax": jax, "lax": lax,
                                                       "TABLE": TABLE})
            got = np.asarray(fn(*POINTS)).astype(np.int64)
            assert lo <= got.min() and got.max() <= hi, (ts, (lo, hi), got.min(), got.max())
            checked += 1
