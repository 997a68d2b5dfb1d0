"""The DSL never answers with stale or silently wrong results.

Each class of bug has a test that fails if it comes back: traces replayed
after the traced function's state changed, mods as ``jax.jit`` static
arguments reusing other operand values, narrow-int arithmetic that differs
from jax.numpy, traced mods that stay interned forever, pickles that do not
round-trip (or can forge IR nodes), and pytree rebuilds that change operand
shapes unchecked.
"""

import copy
import gc
import math
import pickle
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import scoremod
from scoremod import ScoreModError, ScoreModTypeError, ScoreModValueError, UnsupportedOpError
from scoremod.dsl import ir
from scoremod.dsl.ir import Node
from tests import tiers
from tests.test_properties import SPECS, _as_fn

SETTINGS = settings(max_examples=tiers.examples(25), deadline=None)
I = jnp.int32

Q = jax.random.normal(jax.random.key(0), (1, 8, 2, 16), jnp.float32)
K = jax.random.normal(jax.random.key(1), (1, 8, 2, 16), jnp.float32)
V = jax.random.normal(jax.random.key(2), (1, 8, 2, 16), jnp.float32)


def attend(mod):
    return np.asarray(scoremod.attention(Q, K, V, mod, implementation="xla"))


# --- 1. re-tracing after the function's state changed ------------------------

STATE = {"cap": 30.0}
CAP = 30.0
BIAS = jnp.arange(8.0) * 0.5


def softcap_from_dict(s, b, h, q, k):
    return STATE["cap"] * jnp.tanh(s / STATE["cap"])


def softcap_from_global(s, b, h, q, k):
    return CAP * jnp.tanh(s / CAP)


def bias_from_global(s, b, h, q, k):
    return s + BIAS[k]


def _same_result_as_fresh(fn, expected_text):
    """The traced mod and attention's output are those of the current state."""
    mod = scoremod.trace(fn)
    assert str(mod) == expected_text
    fresh = scoremod.trace(lambda *a: fn(*a))  # a new function object: never cached
    assert mod == fresh
    np.testing.assert_array_equal(attend(fn), attend(fresh))
    return attend(fn)


def test_retrace_after_dict_entry_changes():
    before = _same_result_as_fresh(softcap_from_dict, "tanh(score / 30.0) * 30.0")
    try:
        STATE["cap"] = 0.5
        after = _same_result_as_fresh(softcap_from_dict, "tanh(score / 0.5) * 0.5")
    finally:
        STATE["cap"] = 30.0
    assert np.abs(after - before).max() > 1e-3


def test_retrace_after_module_global_changes():
    global CAP
    before = _same_result_as_fresh(softcap_from_global, "tanh(score / 30.0) * 30.0")
    try:
        CAP = 0.25
        after = _same_result_as_fresh(softcap_from_global, "tanh(score / 0.25) * 0.25")
    finally:
        CAP = 30.0
    assert np.abs(after - before).max() > 1e-3


def test_retrace_after_nonlocal_cell_changes():
    cap = 30.0

    def mod(s, b, h, q, k):
        return cap * jnp.tanh(s / cap)

    def set_cap(v):
        nonlocal cap
        cap = v

    before = _same_result_as_fresh(mod, "tanh(score / 30.0) * 30.0")
    set_cap(0.5)
    after = _same_result_as_fresh(mod, "tanh(score / 0.5) * 0.5")
    assert np.abs(after - before).max() > 1e-3


def test_retrace_after_callable_object_attribute_changes():
    class Softcap:
        def __init__(self, cap):
            self.cap = cap

        def __call__(self, s, b, h, q, k):
            return self.cap * jnp.tanh(s / self.cap)

    fn = Softcap(30.0)
    before = _same_result_as_fresh(fn, "tanh(score / 30.0) * 30.0")
    fn.cap = 0.5
    after = _same_result_as_fresh(fn, "tanh(score / 0.5) * 0.5")
    assert np.abs(after - before).max() > 1e-3


def test_retrace_after_global_array_rebound_to_new_values_and_shape():
    global BIAS
    first = scoremod.trace(bias_from_global)
    out_first = attend(bias_from_global)
    try:
        BIAS = -jnp.arange(8.0)  # new values, same shape
        second = scoremod.trace(bias_from_global)
        assert second.same_ir(first) and second.operands[0] is BIAS and second != first
        out_second = attend(bias_from_global)
        assert np.abs(out_second - out_first).max() > 1e-3
        np.testing.assert_array_equal(out_second, attend(second))
        BIAS = jnp.arange(16.0)  # a new shape
        third = scoremod.trace(bias_from_global)
        assert str(third) == "c0: float32[16]; score + c0[kv_idx]"
        np.testing.assert_array_equal(attend(bias_from_global), attend(third))
    finally:
        BIAS = jnp.arange(8.0) * 0.5


@SETTINGS
@given(st.lists(st.floats(0.25, 100.0, width=32), min_size=2, max_size=5))
def test_every_trace_sees_the_current_state(caps):
    state = {}

    def mod(s, b, h, q, k):
        return jnp.where(q >= k, state["cap"] * jnp.tanh(s / state["cap"]), -jnp.inf)

    for cap in caps:
        state["cap"] = cap
        want = scoremod.parse("where(q_idx >= kv_idx, c * tanh(score / c), -inf)", c=cap)
        assert scoremod.trace(mod) == want


# --- 3. a ScoreMod as a jax.jit static argument ------------------------------

SLOPES = jnp.asarray([0.5, 0.25])


def alibi_pair():
    one = scoremod.trace(lambda s, b, h, q, k: s + SLOPES[h] * (k - q))
    return one, one.bind(c0=SLOPES * 4)


def test_static_argument_never_reuses_other_operand_values():
    one, four = alibi_pair()
    assert one.same_ir(four) and one.key == four.key and hash(one) == hash(four)
    assert one != four
    f = jax.jit(lambda q, k, v, mod: scoremod.attention(q, k, v, mod, implementation="xla"),
                static_argnums=3)
    np.testing.assert_allclose(np.asarray(f(Q, K, V, one)), attend(one), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(f(Q, K, V, four)), attend(four), rtol=1e-6, atol=1e-6)
    assert np.abs(attend(one) - attend(four)).max() > 1e-3


def test_pytree_argument_shares_one_compilation_across_values():
    one, four = alibi_pair()
    traces = []

    @jax.jit
    def f(mod):
        traces.append(1)
        return scoremod.attention(Q, K, V, mod, implementation="xla")

    np.testing.assert_allclose(np.asarray(f(one)), attend(one), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(f(four)), attend(four), rtol=1e-6, atol=1e-6)
    assert len(traces) == 1


def test_equality_never_reads_tracers():
    one, four = alibi_pair()

    @jax.jit
    def f(mod_a, mod_b):
        assert mod_a == mod_a and mod_a != mod_b  # tracers: equal only to themselves
        assert hash(mod_a) == hash(mod_b)
        return mod_a(0.0, 0, 1, 3, 1)

    assert float(f(one, four)) == -0.5


@SETTINGS
@given(st.lists(st.floats(-4, 4, width=32), min_size=2, max_size=2),
       st.lists(st.floats(-4, 4, width=32), min_size=2, max_size=2))
def test_equal_exactly_when_values_are_bitwise_equal(a, b):
    one, _ = alibi_pair()
    ma, mb = one.bind(c0=jnp.asarray(a, jnp.float32)), one.bind(c0=jnp.asarray(b, jnp.float32))
    same_bits = np.asarray(a, np.float32).tobytes() == np.asarray(b, np.float32).tobytes()
    assert (ma == mb) == same_bits and ma.key == mb.key and hash(ma) == hash(mb)


def test_equality_tells_zero_signs_and_keeps_nan_equal_to_itself():
    one, _ = alibi_pair()
    z, nz = one.bind(c0=jnp.asarray([0.0, 1.0])), one.bind(c0=jnp.asarray([-0.0, 1.0]))
    assert z != nz  # 1 / slope differs
    nan = one.bind(c0=jnp.asarray([np.nan, 1.0]))
    assert nan == one.bind(c0=jnp.asarray([np.nan, 1.0]))
    unbound = scoremod.parse(str(one))
    assert unbound.same_ir(one) and unbound != one and unbound == scoremod.parse(str(one))


# --- 4. narrow ints compute as jax.numpy computes them -----------------------

NARROW = ("uint8", "int8", "uint16", "int16")
EDGE = {d: np.array([np.iinfo(d).min, np.iinfo(d).max, 0, 1, -1 if np.iinfo(d).min else 2,
                     np.iinfo(d).max // 2 + 1, 3], d) for d in NARROW}

NARROW_BODIES = {
    "add": lambda x, y: x + y,
    "sub": lambda x, y: x - y,
    "mul": lambda x, y: x * y,
    "neg": lambda x, y: -x,
    "abs": lambda x, y: jnp.abs(x),
    "floordiv": lambda x, y: x // y,
    "mod": lambda x, y: x % y,
    "square": lambda x, y: x ** 2,
    "cube": lambda x, y: x ** 3,
    "literal": lambda x, y: x + 100,
    "chain": lambda x, y: (x * 3 + y) - x * y,
    "max": lambda x, y: jnp.maximum(x, y) + 1,
    "cmp": lambda x, y: jnp.where(x + y > x, 1, 0),
    "to_uint8": lambda x, y: (x * 7).astype(jnp.uint8),
    "to_int8": lambda x, y: (x + y).astype(jnp.int8),
    "to_int32": lambda x, y: x.astype(jnp.int32) * 1000,
}


def _assert_traced_equals_jnp_on_all_pairs(fn, n):
    """The traced mod of ``fn`` against ``fn`` itself at every (q_idx, kv_idx) < n."""
    mod = scoremod.trace(fn)
    q, k = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
    q, k = jnp.asarray(q.ravel(), I), jnp.asarray(k.ravel(), I)
    zero = jnp.zeros_like(q)
    want = jax.vmap(fn)(jnp.zeros(q.shape), zero, zero, q, k)
    got = jnp.broadcast_to(mod(0.0, zero, zero, q, k), want.shape)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("dtype", NARROW)
@pytest.mark.parametrize("body", sorted(NARROW_BODIES))
def test_narrow_int_arithmetic_matches_jnp(dtype, body):
    values = jnp.asarray(EDGE[dtype])
    op = NARROW_BODIES[body]

    def fn(s, b, h, q, k):
        return s + op(values[q], values[k]).astype(jnp.float32)

    _assert_traced_equals_jnp_on_all_pairs(fn, len(EDGE[dtype]))


def test_uint8_200_plus_200_wraps_as_in_jax():
    a = jnp.asarray([200], jnp.uint8)
    mod = scoremod.trace(lambda s, b, h, q, k: s + (a[0] + a[0]))
    assert float(mod(0.0, 0, 0, 0, 0)) == float(jnp.uint8(200) + jnp.uint8(200)) == 144.0


@pytest.mark.parametrize("dtype", NARROW)
def test_float_to_narrow_int_saturates_as_in_jax(dtype):
    xs = jnp.asarray([300.5, -5.0, np.nan, np.inf, -np.inf, 3e9, -3e9, 127.7, -128.9, 40000.0])
    fn = lambda s, b, h, q, k: (xs[q] * s).astype(dtype).astype(jnp.float32)  # noqa: E731
    mod = scoremod.trace(fn)
    q = jnp.arange(len(xs), dtype=I)
    want = jax.vmap(lambda q: fn(jnp.float32(1.0), 0, 0, q, 0))(q)
    np.testing.assert_array_equal(np.asarray(mod(1.0, 0, 0, q, 0)), np.asarray(want))


def test_narrow_index_arrays_read_like_jnp():
    doc = jnp.asarray([[0, 1, -1, 2]], jnp.int16)
    table = jnp.arange(5.0)
    fn = lambda s, b, h, q, k: s + table[doc[b, q]]  # noqa: E731
    mod = scoremod.trace(fn)
    q = jnp.arange(4, dtype=I)
    want = jax.vmap(lambda q: fn(jnp.float32(0.0), 0, 0, q, 0))(q)
    np.testing.assert_array_equal(np.asarray(mod(0.0, 0, 0, q, 0)), np.asarray(want))


def test_float16_arithmetic_is_refused_loads_and_comparisons_are_exact():
    half = jnp.asarray([0.1, 2.5, -3.0], jnp.float16)

    def rounds(s, b, h, q, k):
        return s + (half[h] + half[h]).astype(jnp.float32)  # the line reported

    line = rounds.__code__.co_firstlineno + 1
    with pytest.raises(UnsupportedOpError, match=rf"add in float16 at .*:{line}.*astype"):
        scoremod.trace(rounds)
    exact = lambda s, b, h, q, k: jnp.where(half[h] > 0.1, s * half[h], -half[h])  # noqa: E731
    mod = scoremod.trace(exact)
    h = jnp.arange(3, dtype=I)
    want = jax.vmap(lambda h: exact(jnp.float32(2.0), 0, h, 0, 0))(h)
    np.testing.assert_array_equal(np.asarray(mod(2.0, 0, h, 0, 0)), np.asarray(want))


# --- 7. traced mods can be collected -----------------------------------------


def test_traced_mods_do_not_stay_interned():
    def make(i):
        c = float(i) + 0.5
        return scoremod.trace(lambda s, b, h, q, k: jnp.where(q >= k, s * c + c, -jnp.inf))

    make(-1)  # warm the interned nodes every mod shares
    gc.collect()
    start = len(Node._interned)
    mods = [make(i) for i in range(2000)]
    assert len(Node._interned) > start + 2000
    assert all(m.sources for m in mods[:3])  # sources are still recorded
    del mods
    gc.collect()
    assert len(Node._interned) <= start + 20


# --- 8. every error a user can trigger is a ScoreModError -------------------


@pytest.mark.parametrize(
    "fn, cls, match",
    [
        (lambda s, b, h, q, k: s + 2 ** 31, ScoreModValueError, "int32"),
        (lambda s, b, h, q, k: s + jnp.zeros((0,))[h], ScoreModTypeError, "at least one entry"),
        (lambda s, b, h, q, k: jnp.sort(s), ScoreModTypeError, "scalars"),
        (lambda s, b, h, q, k: jnp.cumsum(s, axis=1), ScoreModTypeError, "axis"),
    ],
)
def test_trace_errors_are_scoremod_errors(fn, cls, match):
    with pytest.raises(cls, match=match):
        scoremod.trace(fn)


def test_captured_int_outside_int32_is_a_value_error():
    big = np.int32(7)
    assert str(scoremod.trace(lambda s, b, h, q, k: s + big)) == "score + 7.0"
    for value in (2 ** 31, -(2 ** 31) - 1, 2 ** 40):
        with pytest.raises(ScoreModValueError, match="int32"):
            ir.const(value, ir.I32)
    assert ir.const(-(2 ** 31), ir.I32).attr == -(2 ** 31)


@pytest.mark.parametrize(
    "qshape, kshape, match",
    [
        ((1, 8, 2, 16), (1, 8, 0, 16), "key/value heads is 0"),
        ((1, 8, 2, 0), (1, 8, 2, 0), "head_dim is 0"),
    ],
)
def test_empty_dimensions_are_value_errors(qshape, kshape, match):
    with pytest.raises(ScoreModValueError, match=match):
        scoremod.attention(jnp.ones(qshape), jnp.ones(kshape), jnp.ones(kshape),
                           implementation="xla")


@pytest.mark.parametrize(
    "scale, cls",
    [(jnp.ones(2), ScoreModTypeError), (np.ones((1,)), ScoreModTypeError),
     (float("nan"), ScoreModValueError), (float("inf"), ScoreModValueError),
     (jnp.float32(-np.inf), ScoreModValueError), ("0.5", ScoreModTypeError),
     (True, ScoreModTypeError), (1 + 2j, ScoreModTypeError)],
)
def test_bad_scale_is_refused(scale, cls):
    with pytest.raises(cls, match="scale"):
        scoremod.attention(Q, K, V, scale=scale, implementation="xla")


def test_good_scales_still_work_including_traced():
    for scale in (0.5, 2, np.float32(0.5), jnp.asarray(0.5)):
        scoremod.attention(Q, K, V, scale=scale, implementation="xla")
    out = jax.jit(lambda s: scoremod.attention(Q, K, V, scale=s, implementation="xla"))(0.5)
    np.testing.assert_allclose(np.asarray(out), np.asarray(
        scoremod.attention(Q, K, V, scale=0.5, implementation="xla")), rtol=1e-6, atol=1e-6)


def test_bind_with_unknown_names_is_a_value_error():
    one, _ = alibi_pair()
    with pytest.raises(ScoreModValueError, match="unknown operands"):
        one.bind(slopes=SLOPES)
    with pytest.raises(ValueError):  # still a ValueError for existing handlers
        one.bind(slopes=SLOPES)


def test_tree_map_changing_operand_shapes_or_dtypes_is_refused_at_use():
    one, _ = alibi_pair()
    for change in (lambda x: x[None], lambda x: x.astype(jnp.int32), lambda x: x[:1]):
        bad = jax.tree_util.tree_map(change, one)
        with pytest.raises(ScoreModTypeError, match="tree_map"):
            scoremod.attention(Q, K, V, bad, implementation="xla")
        with pytest.raises(ScoreModTypeError, match="must be float32"):
            bad(0.0, 0, 0, 0, 0)


def test_pytree_round_trips_used_by_jax_still_work():
    one, four = alibi_pair()
    leaves, treedef = jax.tree_util.tree_flatten(one)
    for placeholder in (object(), None):  # jax rebuilds trees with sentinels
        rebuilt = jax.tree_util.tree_unflatten(treedef, [placeholder] * len(leaves))
        assert rebuilt.same_ir(one)
    doubled = jax.tree_util.tree_map(lambda x: x * 4, one)
    assert doubled == four
    out = jax.jit(lambda m: scoremod.attention(Q, K, V, m, implementation="xla"))(four)
    np.testing.assert_allclose(np.asarray(out), attend(four), rtol=1e-6, atol=1e-6)
    grads = jax.grad(lambda m: scoremod.attention(Q, K, V, m, implementation="xla").sum())(one)
    assert grads.same_ir(one) and grads.operands[0].shape == (2,)
    ints = scoremod.trace(lambda s, b, h, q, k: s + jnp.asarray([1, 2], I)[h])
    int_grads = jax.grad(lambda m: m(1.0, 0, 1, 0, 0), allow_int=True)(ints)  # float0 leaves
    assert int_grads.same_ir(ints)


# --- 9. pickle and copy -------------------------------------------------------

_PICKLE_IN_CHILD = textwrap.dedent(
    """
    import pickle, sys
    import jax.numpy as jnp, scoremod
    slopes = jnp.asarray([0.5, 0.25, 0.125, 0.0625])
    def alibi(s, b, h, q, k):
        return jnp.where(q >= k, 30 * jnp.tanh(s / 30) + slopes[h] * (k - q), -jnp.inf)
    mod = scoremod.trace(alibi)
    if sys.argv[1] == "dump":
        sys.stdout.buffer.write(pickle.dumps((mod, mod.key, mod.grad)))
    else:
        got, key, grad = pickle.loads(sys.stdin.buffer.read())
        assert got == mod and got.key == key == mod.key and grad == mod.grad, "mismatch"
        assert got.operands[0].tolist() == slopes.tolist()
        print("ok")
    """
)


def _child(mode, data=b""):
    return subprocess.run([sys.executable, "-c", _PICKLE_IN_CHILD, mode], input=data,
                          capture_output=True, check=True, env={"JAX_PLATFORMS": "cpu",
                                                                "PYTHONPATH": ":".join(sys.path)})


def test_pickle_round_trips_across_processes():
    data = _child("dump").stdout
    mod, key, grad = pickle.loads(data)  # made in another process
    slopes = jnp.asarray([0.5, 0.25, 0.125, 0.0625])
    here = scoremod.trace(
        lambda s, b, h, q, k: jnp.where(q >= k, 30 * jnp.tanh(s / 30) + slopes[h] * (k - q),
                                        -jnp.inf))
    assert mod == here and mod.key == key == here.key and grad == here.grad
    np.testing.assert_array_equal(attend(mod), attend(here))
    assert _child("load", pickle.dumps((here, here.key, here.grad))).stdout.strip() == b"ok"


def test_copy_and_deepcopy_round_trip():
    one, _ = alibi_pair()
    assert copy.copy(one) == one
    deep = copy.deepcopy(one)
    assert deep == one and deep.key == one.key and deep.sources == one.sources


def test_deep_expressions_pickle_without_recursion():
    expr = ir.var("score")
    for i in range(3000):
        expr = expr * 1.5 + float(i)
    mod = scoremod.ScoreMod(expr)
    again = pickle.loads(pickle.dumps(mod))
    assert again.expr is expr


class _Crafted:
    """Pickles as the given reduce tuple."""

    def __init__(self, reduce):
        self.reduce = reduce

    def __reduce__(self):
        return self.reduce


@pytest.mark.parametrize(
    "table",
    [
        [("const", (), 0.1, "f32")],  # not rounded to float32: would stand for const(0.1)
        [("const", (), 2 ** 40, "i32")],
        [("const", (), 1.5, "i32")],
        [("const", (), True, "i32")],
        [("var", (), "score", "i32")],
        [("var", (), "score", "f32"), ("var", (), "h", "i32"), ("add", (0, 1), None, "f32")],
        [("var", (), "score", "f32"), ("tanh", (0,), None, "i32")],
        [("var", (), "score", "f32"), ("nonsense", (0,), None, "f32")],
        [("tanh", (0,), None, "f32")],
        [("operand", (), ("x", (0,), "float32"), "f32")],
        [("operand", (), ("x", (4,), "float64"), "f32")],
    ],
)
def test_crafted_pickles_cannot_forge_nodes(table):
    before = dict(Node._interned)
    with pytest.raises(ScoreModValueError):
        pickle.loads(pickle.dumps(_Crafted((ir.from_table, (table,)))))
    with pytest.raises(ScoreModValueError):
        pickle.loads(pickle.dumps(_Crafted((scoremod.dsl.scoremod._unpickle, (table, (), {})))))
    assert ir.const(0.1, ir.F32).attr == float(np.float32(0.1))
    assert set(Node._interned.keys()) - set(before) <= {
        k for k, n in Node._interned.items() if n.op in ("var", "const", "operand")}


def test_direct_node_construction_cannot_intern_non_canonical_constants():
    with pytest.raises(ScoreModValueError):
        Node("const", (), 0.1, "f32")
    with pytest.raises(ScoreModValueError):
        Node("const", (), 2 ** 31, "i32")
    assert ir.const(0.1, ir.F32).attr == float(np.float32(0.1))


# --- 10. messages name the line and the real cause ----------------------------


def _line_of(fn, offset):
    return fn.__code__.co_firstlineno + offset


def test_python_if_names_the_if_line():
    def mod(s, b, h, q, k):
        x = s * 2.0
        if q >= k:  # the line reported
            return x
        return -jnp.inf

    with pytest.raises(ScoreModTypeError) as e:
        scoremod.trace(mod)
    msg = str(e.value)
    assert f"test_trace_soundness.py:{_line_of(mod, 2)}" in msg and "`if`" in msg
    assert "jnp.where" in msg and "`and`" not in msg


def test_python_and_between_masks_names_and_not_if():
    def mod(s, b, h, q, k):
        keep = (q >= k) and (q - k < 4)  # the line reported
        return jnp.where(keep, s, -jnp.inf)

    with pytest.raises(ScoreModTypeError) as e:
        scoremod.trace(mod)
    msg = str(e.value)
    assert f"test_trace_soundness.py:{_line_of(mod, 1)}" in msg
    assert "`and`" in msg and "`&`" in msg and "`if`" not in msg


def test_python_or_and_while_are_named():
    def with_or(s, b, h, q, k):
        return jnp.where((q >= k) or (h == 0), s, 0.0)

    def with_while(s, b, h, q, k):
        while s > 1.0:
            s = s / 2
        return s

    for fn, word in ((with_or, "`or`"), (with_while, "`while`")):
        with pytest.raises(ScoreModTypeError, match=word) as e:
            scoremod.trace(fn)
        assert f":{_line_of(fn, 1)}" in str(e.value)


def _float_of_score(s, b, h, q, k):
    return float(s) * 2


def _int_of_index(s, b, h, q, k):
    return s * int(q)


def _range_of_index(s, b, h, q, k):
    return s * len(range(q))


def _math_tanh(s, b, h, q, k):
    return math.tanh(s)


def _numpy_tanh(s, b, h, q, k):
    return s + np.tanh(s)


@pytest.mark.parametrize(
    "fn, want",
    [(_float_of_score, "`float(...)`"), (_int_of_index, "`int(...)`"),
     (_range_of_index, "`range()`"), (_math_tanh, "jnp.tanh"), (_numpy_tanh, "jax.numpy")],
)
def test_concretization_hints_name_the_real_cause(fn, want):
    with pytest.raises(ScoreModTypeError) as e:
        scoremod.trace(fn)
    msg = str(e.value)
    assert want in msg and "`if`" not in msg and "`and`" not in msg
    assert f"test_trace_soundness.py:{_line_of(fn, 1)}" in msg


def test_type_error_in_the_body_is_not_called_an_arity_error():
    def mod(s, b, h, q, k):
        return s + None  # the line reported

    with pytest.raises(ScoreModTypeError) as e:
        scoremod.trace(mod)
    msg = str(e.value)
    assert "takes exactly" not in msg and "NoneType" in msg
    assert f":{_line_of(mod, 1)}" in msg


def test_real_arity_mismatches_are_called_so():
    class Obj:
        def __call__(self, s, b):
            return s

    for fn in (lambda s: s, lambda s, b, h, q, k, extra: s, Obj()):
        with pytest.raises(ScoreModTypeError, match=r"takes exactly \(score, b, h, q_idx"):
            scoremod.trace(fn)
    # Extra arguments with defaults are fine.
    assert str(scoremod.trace(lambda s, b, h, q, k, c=2.0: s * c)) == "score * 2.0"


def test_users_own_errors_pass_through():
    def mod(s, b, h, q, k):
        raise KeyError("cap")

    with pytest.raises(KeyError):
        scoremod.trace(mod)


def test_narrow_captured_arrays_are_not_called_unsupported_dtypes():
    u8 = jnp.asarray([1, 200, 3], jnp.uint8)
    f16 = jnp.asarray([1.0, 0.5], jnp.float16)
    assert str(scoremod.trace(lambda s, b, h, q, k: jnp.where(u8[h] > 3, s, 0.0))) == (
        "c0: uint8[3]; where(c0[h] > 3, score, 0.0)")
    assert "c0: float16[2]" in str(scoremod.trace(lambda s, b, h, q, k: s * f16[h]))
    with pytest.raises(UnsupportedOpError) as e:
        scoremod.trace(lambda s, b, h, q, k: s * (f16[h] * 2.0))
    assert "dtype" not in str(e.value) and "mul in float16" in str(e.value)


def test_conversion_message_has_no_typo():
    with pytest.raises(UnsupportedOpError) as e:
        scoremod.trace(lambda s, b, h, q, k: s.astype(jnp.bfloat16).astype(jnp.float32))
    assert "conversion to bfloat16 at" in str(e.value) and "to of" not in str(e.value)


def test_nan_constants_share_key_and_equality():
    quiet = np.frombuffer(np.uint32(0x7FC00000).tobytes(), np.float32)[0]
    payload = np.frombuffer(np.uint32(0x7FC00001).tobytes(), np.float32)[0]
    negative = np.frombuffer(np.uint32(0xFFC00000).tobytes(), np.float32)[0]
    mods = [scoremod.trace(lambda s, b, h, q, k, c=c: s + c) for c in (quiet, payload, negative)]
    mods.append(scoremod.parse("score + nan"))
    assert len({m.key for m in mods}) == 1
    assert all(m == mods[0] for m in mods)


def test_all_public_errors_derive_from_scoremod_error():
    for cls in (ScoreModTypeError, ScoreModValueError, UnsupportedOpError,
                scoremod.ScoreModSyntaxError, scoremod.CudnnUnavailableError):
        assert issubclass(cls, ScoreModError)
    assert issubclass(ScoreModValueError, ValueError)


# --- properties over random expressions ----------------------------------------

NARROW_UNARY = {
    "neg": lambda x: -x,
    "abs": jnp.abs,
    "square": lambda x: x * x,
    "plus_lit": lambda x: x + 77,
    "times_lit": lambda x: x * 3,
    "sign": jnp.sign,
    "to_uint8": lambda x: x.astype(jnp.uint8),
    "to_int8": lambda x: x.astype(jnp.int8),
    "to_int16": lambda x: x.astype(jnp.int16),
    "to_uint16": lambda x: x.astype(jnp.uint16),
}
NARROW_BINARY = {
    "add": lambda x, y: x + y.astype(x.dtype),
    "sub": lambda x, y: x - y.astype(x.dtype),
    "mul": lambda x, y: x * y.astype(x.dtype),
    "floordiv": lambda x, y: x // y.astype(x.dtype),
    "mod": lambda x, y: x % y.astype(x.dtype),
    "rem": lambda x, y: jax.lax.rem(x, y.astype(x.dtype)),
    "max": lambda x, y: jnp.maximum(x, y.astype(x.dtype)),
    "where": lambda x, y: jnp.where(x > y.astype(x.dtype), x, y.astype(x.dtype)),
    "promote": lambda x, y: x.astype(jnp.int32) * 40000 + y,
}


def _narrow_specs():
    leaf = st.sampled_from(["q", "k"]).map(lambda v: ("leaf", v))

    def extend(children):
        return st.one_of(
            st.tuples(st.just("un"), st.sampled_from(sorted(NARROW_UNARY)), children),
            st.tuples(st.just("bin"), st.sampled_from(sorted(NARROW_BINARY)), children, children),
        )

    return st.tuples(st.sampled_from(NARROW), st.recursive(leaf, extend, max_leaves=6))


def _render_narrow(spec, arrays):
    if spec[0] == "leaf":
        return lambda q, k: arrays[q] if spec[1] == "q" else arrays[k]
    if spec[0] == "un":
        f, a = NARROW_UNARY[spec[1]], _render_narrow(spec[2], arrays)
        return lambda q, k: f(a(q, k))
    f, a, c = NARROW_BINARY[spec[1]], _render_narrow(spec[2], arrays), _render_narrow(spec[3], arrays)
    return lambda q, k: f(a(q, k), c(q, k))


@settings(max_examples=tiers.examples(60), deadline=None)
@given(_narrow_specs())
def test_random_narrow_int_expressions_match_jnp(dtype_spec):
    dtype, spec = dtype_spec
    values = jnp.asarray(EDGE[dtype])
    body = _render_narrow(spec, values)
    fn = lambda s, b, h, q, k: s + body(q, k).astype(jnp.float32)  # noqa: E731
    _assert_traced_equals_jnp_on_all_pairs(fn, len(EDGE[dtype]))


@settings(max_examples=tiers.examples(60), deadline=None)
@given(SPECS)
def test_random_mods_pickle_and_copy_to_equal_mods(spec):
    mod = scoremod.trace(_as_fn(spec))
    for again in (pickle.loads(pickle.dumps(mod)), copy.deepcopy(mod), copy.copy(mod)):
        assert again == mod and again.key == mod.key and str(again) == str(mod)
        assert again.sources == mod.sources
    grad = pickle.loads(pickle.dumps(mod.grad))
    assert grad == mod.grad


def test_wrong_argument_types_are_scoremod_type_errors():
    for call in (lambda: scoremod.parse(3.0), lambda: scoremod.trace(3.0),
                 lambda: scoremod.attention(Q, K, V, 3.0, implementation="xla")):
        with pytest.raises(ScoreModTypeError):
            call()


def test_non_canonical_constants_are_refused_even_when_the_canonical_node_exists():
    canonical = ir.const(0.1, ir.F32)  # alive: Node("const", ...) with 0.1 finds its key
    with pytest.raises(ScoreModValueError):
        Node("const", (), 0.1, "f32")
    assert canonical.attr == float(np.float32(0.1))
