"""The cuDNN lowering's IR rewrites, checked without a GPU.

The canonical forward and backward expressions must (1) compute the same
values as the mod and its derived gradient, (2) respect the measured cuDNN
rules, and (3) use only ops the lowering table knows.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import HealthCheck

import scoremod
from scoremod import UnsupportedOpError
from scoremod.dsl import ir
from scoremod.dsl.evaluate import evaluate
from scoremod.lowering.cudnn.graph import emission_order
from scoremod.lowering.cudnn.rules import DP, canonical, check_supported, forward_and_backward
from scoremod.dsl.ir import CONST, VAR
from scoremod.lowering.cudnn.table import INPUT_TENSORS, TABLE
from tests.test_properties import SPECS, _as_fn, _points
from tests import tiers

_BINARY_FIRST_TENSOR = {"add", "sub", "mul", "div", "pow", "max", "min", "relu_grad", "and", "or",
                        "lt", "le", "gt", "ge", "eq", "ne"}


def _assert_cudnn_shaped(expr):
    for node in emission_order(expr):
        if node.op in (VAR, CONST) + INPUT_TENSORS:
            continue
        assert TABLE[node.op].emit is not None, f"no lowering for {node.op}"
        if node.op in _BINARY_FIRST_TENSOR:
            assert node.args[0].op != "const", f"scalar first in {node}"
        if node.op == "where":
            assert node.args[1].op != "const", f"scalar as input0 in {node}"
        if node.op in ("lt", "le", "gt", "ge", "eq", "ne"):
            assert node.args[0].dtype != "f32", f"float comparison {node}"
        if node.args:  # rule 4: cuDNN finds no engine for a node of inputs alone
            assert any(a.op not in (CONST,) + INPUT_TENSORS for a in node.args), (
                f"node reading only input tensors and scalars: {node}")
    assert expr.op != "const"  # a bare input is returned through identity by the builder


def _eval(expr, pts, mod, dp=None):
    inputs = dict(zip(ir.VAR_NAMES, pts))
    if dp is not None:
        inputs["dP"] = dp
    return np.asarray(jnp.broadcast_to(evaluate(expr, inputs, dict(zip(mod.operand_names, mod.operands))), pts[0].shape))


@settings(max_examples=tiers.examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(SPECS, __import__("hypothesis").strategies.integers(0, 2**16))
# score-free custom_jvp values (softplus): what XLA computes ahead is judged on the
# value alone, and a root read from a tensor is added to score * 0
@example(("un", "atan", ("un", "softplus_t", ("leaf", "alibi"))), 0)
@example(("un", "abs", ("un", "softplus_t", ("leaf", "block_any"))), 0)
def test_canonical_forms_compute_the_same_and_obey_the_rules(spec, seed):
    mod = scoremod.trace(_as_fn(spec))
    try:
        check_supported(mod.expr, mod.sources)
    except UnsupportedOpError as e:
        assert "compares float values" in str(e) or "no cuDNN node" in str(e) or "no exact" in str(e)
        return
    fwd, bwd = forward_and_backward(mod.expr)
    _assert_cudnn_shaped(fwd)
    _assert_cudnn_shaped(bwd)
    pts = _points(seed)
    np.testing.assert_allclose(_eval(fwd, pts, mod), np.asarray(jnp.broadcast_to(mod(*pts), pts[0].shape)),
                               rtol=1e-5, atol=1e-5)
    dp = jnp.asarray(np.random.default_rng(seed).normal(size=pts[0].shape), jnp.float32)
    want = np.asarray(jnp.broadcast_to(mod.grad(*pts), pts[0].shape)) * np.asarray(dp)
    np.testing.assert_allclose(_eval(bwd, pts, mod, dp), want, rtol=1e-4, atol=1e-5)


def test_backward_only_uses_forward_nodes_and_dp():
    mod = scoremod.trace(lambda s, b, h, q, k: 30.0 * jnp.tanh(s / 30.0))
    fwd, bwd = forward_and_backward(mod.expr)
    assert DP in set(ir.toposort(bwd))
    tanh = next(n for n in ir.toposort(fwd) if n.op == "tanh")
    assert tanh in set(ir.toposort(bwd)), "bprop must reuse score_mod's tanh, not recompute it"


def test_loads_are_leaves_for_emission():
    slopes = jnp.ones(4)
    mod = scoremod.trace(lambda s, b, h, q, k: s + slopes[h] * (k - q))
    fwd, _ = forward_and_backward(mod.expr)
    emitted = emission_order(fwd)
    load = next(n for n in emitted if n.op == "load")
    assert load.args[1] not in emitted  # the h index is the tensor's layout, not a node
    table = jnp.ones(16)
    mod = scoremod.trace(lambda s, b, h, q, k: s + table[q - k + 8])
    fwd, _ = forward_and_backward(mod.expr)
    assert [n.op for n in emission_order(fwd)] == ["var", "load", "add"]


# Mods the fused path refuses, with the op the error must name (also used on the GPU).
REFUSED = [
    (lambda s, b, h, q, k: jnp.where(s > 0.3, s, 0.0), "gt"),
    (lambda s, b, h, q, k: s + jnp.sign(s), "sign"),
    (lambda s, b, h, q, k: s + jax.lax.rem(s, 3.0), "rem"),
    (lambda s, b, h, q, k: s + (s * 4).astype(jnp.int32), "i32"),
    (lambda s, b, h, q, k: jnp.arctan(s), "atan"),
]


@pytest.mark.parametrize("fn, op", REFUSED)
def test_refusals_name_op_and_line(fn, op):
    mod = scoremod.trace(fn)
    with pytest.raises(UnsupportedOpError, match=rf"`{op}`.*test_cudnn_rules.py:\d+.*implementation=\"xla\""):
        check_supported(mod.expr, mod.sources)


def test_refusal_of_parsed_mod_names_op():
    mod = scoremod.parse("score + score // 2.0")
    with pytest.raises(UnsupportedOpError, match=r"`floordiv` in `score // 2.0`: floordiv of floats"):
        check_supported(mod.expr, mod.sources)


def test_float_floor_divide_traces_as_floor_division():
    # It was refused as `round` (what jnp's float // ends in); it is the IR's floordiv.
    mod = scoremod.trace(lambda s, b, h, q, k: s + jnp.floor_divide(s, 2.0))
    assert "//" in str(mod)
    s = jnp.asarray([-3.5, -1.0, 0.0, 0.75, 5.0], jnp.float32)
    np.testing.assert_array_equal(np.asarray(mod(s, 0, 0, 0, 0)),
                                  np.asarray(s + jnp.floor_divide(s, 2.0)))


def test_nonnegative_index_arithmetic_is_supported():
    mod = scoremod.trace(lambda s, b, h, q, k: jnp.where((q // 64 == k // 64) & (k % 4 == 0), s, -jnp.inf))
    check_supported(mod.expr, mod.sources)
    fwd, _ = forward_and_backward(mod.expr)
    _assert_cudnn_shaped(fwd)


def test_index_expressions_are_not_held_to_cudnn_rules():
    """A computed index is evaluated by XLA (materialized), so float -> int there is fine."""
    table = jnp.linspace(-1.0, 1.0, 32)

    def t5_like(s, b, h, q, k):
        rel = (k - q).astype(jnp.float32)
        bucket = (jnp.log1p(jnp.abs(rel)) * 4.0).astype(jnp.int32)  # float -> int in the index
        return s + table[bucket]

    mod = scoremod.trace(t5_like)
    check_supported(mod.expr, mod.sources)
    fwd, bwd = forward_and_backward(mod.expr)
    assert [n.op for n in emission_order(fwd)] == ["var", "load", "add"]


def test_index_computed_from_the_score_is_refused():
    table = jnp.linspace(-1.0, 1.0, 32)
    mod = scoremod.trace(lambda s, b, h, q, k: s + table[jnp.clip(s * 4, 0, 31).astype(jnp.int32)])
    with pytest.raises(UnsupportedOpError, match="computed from the score"):
        check_supported(mod.expr, mod.sources)


def test_every_op_of_the_op_table_is_lowered_or_refused_with_a_reason():
    missing = sorted(set(scoremod.OPS) - set(TABLE))
    assert not missing, f"ops without a cuDNN table entry: {missing}"
    for op, entry in TABLE.items():
        assert entry.emit or entry.rewrite or entry.tensor or entry.refusal, op
        if entry.emit is not None:
            assert isinstance(entry.emit.node, str)


def test_an_op_without_an_entry_fails_the_coverage_check(monkeypatch):
    monkeypatch.delitem(TABLE, "tanh")
    with pytest.raises(AssertionError, match="tanh"):
        test_every_op_of_the_op_table_is_lowered_or_refused_with_a_reason()


@pytest.mark.parametrize("fn, ops", [
    (lambda s, b, h, q, k: jnp.tan(jnp.tanh(s)) * 2.0, {"tan"}),
    (lambda s, b, h, q, k: jnp.log2(s * s + 1.0), {"log"}),
])
def test_new_ops_lower_to_cudnn_nodes(fn, ops):
    """tan is cuDNN's TAN pointwise mode; log2 has no node: log(x) * (1 / ln 2)."""
    mod = scoremod.trace(fn)
    check_supported(mod.expr, mod.sources)
    fwd, bwd = forward_and_backward(mod.expr)
    _assert_cudnn_shaped(fwd)
    _assert_cudnn_shaped(bwd)
    assert ops <= {n.op for n in ir.toposort(fwd)} and "log2" not in {n.op for n in ir.toposort(fwd)}
    pts = _points(3)
    np.testing.assert_allclose(_eval(fwd, pts, mod), np.asarray(jnp.broadcast_to(mod(*pts), pts[0].shape)),
                               rtol=1e-6, atol=1e-6)
    dp = jnp.asarray(np.random.default_rng(3).normal(size=pts[0].shape), jnp.float32)
    want = np.asarray(jnp.broadcast_to(mod.grad(*pts), pts[0].shape)) * np.asarray(dp)
    np.testing.assert_allclose(_eval(bwd, pts, mod, dp), want, rtol=1e-5, atol=1e-6)


def test_an_op_with_only_a_refusal_is_always_refused(monkeypatch):
    from scoremod.lowering.cudnn.rules import refusal
    from scoremod.lowering.cudnn.table import Entry

    monkeypatch.setitem(TABLE, "tanh", Entry(refusal="tanh withdrawn for this test"))
    mod = scoremod.trace(lambda s, b, h, q, k: jnp.tanh(s))
    tanh = next(n for n in ir.toposort(mod.expr) if n.op == "tanh")
    assert refusal(tanh) == "tanh withdrawn for this test"


def test_tanh_derivative_is_one_node_shorter_in_the_backward():
    """(1 + t)(1 - t), JAX's spelling of tanh's derivative, becomes 1 - t*t in the
    fused backward (it ran 6% slower with softcap + causal on the H200), with
    values equal to float32 rounding."""
    mod = scoremod.trace(lambda s, b, h, q, k: jnp.where(q >= k, 30.0 * jnp.tanh(s / 30.0), -jnp.inf))
    _, bwd = forward_and_backward(mod.expr)
    text = str(bwd)
    assert "+ 1.0) * (-" not in text and "* tanh(score / 30.0)) + 1.0" in text, text
    s = jnp.linspace(-200.0, 200.0, 4001, dtype=jnp.float32)
    q, k = jnp.ones_like(s, jnp.int32), jnp.zeros_like(s, jnp.int32)
    inputs = {"score": s, "b": 0, "h": 0, "q_idx": q, "kv_idx": k, "dP": jnp.ones_like(s)}
    want = jax.vmap(jax.grad(lambda x: 30.0 * jnp.tanh(x / 30.0)))(s)
    np.testing.assert_allclose(evaluate(bwd, inputs, {}), want, rtol=0, atol=1e-6)


# --- the mask spellings of the attention-gym census -------------------------
# Each is traced, evaluated by the reference evaluator against jax.numpy on the
# same points, checked by the support check, put into canonical form and
# emitted into recorded forward and backward graphs.

CENSUS_MASKS = {
    "where_false_true": lambda s, b, h, q, k: jnp.where(jnp.where(q >= k, False, True), -jnp.inf, s),
    "where_true_false": lambda s, b, h, q, k: jnp.where(jnp.where(q >= k, True, False), s, -jnp.inf),
    "where_true_x": lambda s, b, h, q, k: jnp.where(jnp.where(q >= k, True, h == 1), s, -jnp.inf),
    "where_x_false": lambda s, b, h, q, k: jnp.where(jnp.where(q >= k, h == 1, False), s, -jnp.inf),
    "where_false_x": lambda s, b, h, q, k: jnp.where(jnp.where(q >= k, False, h == 1), s, -jnp.inf),
    "where_x_true": lambda s, b, h, q, k: jnp.where(jnp.where(q >= k, h == 1, True), s, -jnp.inf),
    "eq_false": lambda s, b, h, q, k: jnp.where((q >= k) == False, -jnp.inf, s),  # noqa: E712
    "ne_true": lambda s, b, h, q, k: jnp.where((q >= k) != True, -jnp.inf, s),  # noqa: E712
    "bool_mul": lambda s, b, h, q, k: jnp.where((q >= k) * (h == 0), s, -jnp.inf),
    "bool_add": lambda s, b, h, q, k: jnp.where((q >= k) + (h == 0), s, -jnp.inf),
    "astype_int": lambda s, b, h, q, k: s - 1e9 * (q < k).astype(int),
    "astype_int_scaled": lambda s, b, h, q, k: s - ((q < k).astype(jnp.int32) * 3).astype(jnp.float32),
    # a float comparison of positions alone: computed ahead by XLA, not refused
    "astype_float_compared": lambda s, b, h, q, k: jnp.where(
        (q >= k).astype(jnp.float32) > 0.5, s, -jnp.inf),
    "int_where_consts": lambda s, b, h, q, k: s + jnp.where(q >= k, 3, 5).astype(jnp.float32),
}


@pytest.mark.parametrize("name", sorted(CENSUS_MASKS))
def test_census_mask_spellings_are_right_and_have_canonical_forms(name):
    """(tests/test_graph_emission.py emits their graphs.)"""
    fn = CENSUS_MASKS[name]
    mod = scoremod.trace(fn)
    pts = _points(11)
    want = np.asarray(fn(*pts))
    np.testing.assert_array_equal(np.asarray(jnp.broadcast_to(mod(*pts), pts[0].shape)), want)
    check_supported(mod.expr, mod.sources)
    fwd, bwd = forward_and_backward(mod.expr)
    _assert_cudnn_shaped(fwd)
    _assert_cudnn_shaped(bwd)
    np.testing.assert_array_equal(_eval(fwd, pts, mod), want)
    dp = jnp.asarray(np.random.default_rng(11).normal(size=pts[0].shape), jnp.float32)
    want_bwd = np.asarray(jnp.broadcast_to(mod.grad(*pts), pts[0].shape)) * np.asarray(dp)
    np.testing.assert_array_equal(_eval(bwd, pts, mod, dp), want_bwd)


def test_a_canonicalization_failure_is_a_refusal_not_a_crash(monkeypatch):
    from scoremod.lowering.cudnn import rules
    from scoremod.errors import ScoreModTypeError

    mod = scoremod.trace(lambda s, b, h, q, k: jnp.where(q >= k, s * 2.0, -jnp.inf))

    def broken(expr):
        raise ScoreModTypeError("add(f32, bool): made up for this test")

    monkeypatch.setattr(rules, "forward_and_backward", broken)
    with pytest.raises(UnsupportedOpError, match="could not put .* scoremod bug"):
        check_supported(mod.expr, mod.sources)


@pytest.mark.parametrize("name", sorted(CENSUS_MASKS))
def test_census_mask_spellings_are_not_refused_by_the_fused_path(name):
    """The fused path's only objection on a CPU is the missing GPU (the mod passes)."""
    q = jnp.zeros((1, 16, 2, 16), jnp.bfloat16)
    verdict = scoremod.which_implementation(q, q, q, CENSUS_MASKS[name]).verdicts["cudnn"]
    assert verdict == "no NVIDIA GPU is visible to JAX"


def test_nested_integer_division_is_computed_ahead_not_in_the_graph():
    """Index arithmetic dividing a quotient or remainder that no rewrite turns
    into divisions of one value gave a wrong mask in cuDNN on the H200 (tiled
    NATTEN, O off by 0.9): the fused path leaves it to XLA. A single division
    (chunked masks) stays in the graph."""
    from scoremod.lowering.cudnn.rules import refusal

    nested = scoremod.trace(lambda s, b, h, q, k: jnp.where((q % 7) // 2 == (k % 7) // 2, s, -jnp.inf))
    single = scoremod.trace(lambda s, b, h, q, k: jnp.where(q // 64 == k // 64, s, -jnp.inf))
    reasons = [refusal(n) for n in ir.toposort(nested.expr)]
    assert any(r and "nested index arithmetic" in r for r in reasons), reasons
    cast = scoremod.trace(lambda s, b, h, q, k: s + (jnp.floor(q / 8.0).astype(jnp.int32) // 2) * 0.1)
    assert any(refusal(n) for n in ir.toposort(cast.expr)), cast  # the same graph as (q // 8) // 2
    assert not any(refusal(n) for n in ir.toposort(single.expr))
    check_supported(nested.expr, nested.sources)  # position-only: computed ahead, not refused
    fwd = canonical(nested.expr)
    assert fwd.args[1].op == "materialize", fwd


DIGITS = {  # index decodings the IR's rewrites flatten, and their values
    "tile row": lambda q: (q // 64) // 4 * 8 + (q % 64) // 8,
    "tile col": lambda q: (q // 64) % 4 * 8 + (q % 64) % 8,
    "block": lambda q: (q % 512) // 16,
    "video tile": lambda q: ((q // 32) % 6) // 3 + (q // 32) // 6 * 7,
    "signed": lambda q: ((q - 700) // 8) % 4 + ((q - 700) % 48) // 16,
}


@pytest.mark.parametrize("name", sorted(DIGITS))
def test_decoded_indices_divide_the_index_alone_in_the_graph(name):
    """Pixel and tile decodings ((q // a) // b, (q % m) // a, (q // a) % b) are
    emitted as divisions of the position itself (the forms the H200 ran right),
    none dividing another division's result, and compute jax.numpy's values."""
    from scoremod.dsl.evaluate import evaluate

    fn = DIGITS[name]
    mod = scoremod.trace(lambda s, b, h, q, k: s + (fn(q) - fn(k)).astype(jnp.float32))
    check_supported(mod.expr, mod.sources)
    fwd = canonical(mod.expr)
    nodes = ir.toposort(fwd)
    assert not any(n.op == "materialize" for n in nodes), fwd
    divisions = [n for n in nodes if n.op == "div" and n.dtype == "f32"]
    assert divisions and not any(n.op == "i32" for d in divisions
                                 for n in ir.toposort(d.args[0])), fwd
    q = jnp.arange(0, 2048, dtype=jnp.int32)[:, None]
    k = jnp.arange(0, 2048, 37, dtype=jnp.int32)[None, :]
    s = jnp.zeros(q.shape[:1] + k.shape[1:], jnp.float32)
    inputs = {"score": s, "b": jnp.int32(0), "h": jnp.int32(0), "q_idx": q, "kv_idx": k}
    want = (fn(q) - fn(k)).astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(evaluate(fwd, inputs, {})), np.asarray(want))


# Refused by cuDNN on the H200 ("no engine"), each for a node reading only input
# tensors and scalars (rule 4), and what the graph reads instead.
NODE_OF_INPUTS = {
    "two arrays (sandwich)": (lambda s, b, h, q, k: s + _REL[q - k + 7] * _RATIO[h], 1),
    "array and scalar": (lambda s, b, h, q, k: s + 0.01 * ((q << 1) - (k >> 2)).astype(jnp.float32), 1),
    "sum of array reads (graphormer edge)": (lambda s, b, h, q, k: s + (
        jnp.where(_LEN[q, k] > 0, _EDGE[h, 0], 0.0) + jnp.where(_LEN[q, k] > 1, _EDGE[h, 1], 0.0))
        / jnp.maximum(_LEN[q, k], 1), 1),
    "where with an array branch": (lambda s, b, h, q, k: jnp.where(_LEN[q, k] > 0, s, _RATIO[h]), 2),
    "where with a constant branch": (lambda s, b, h, q, k: jnp.where(_LEN[q, k] > 1, s * 2.0, 0.5), 2),
}
_REL = jnp.linspace(-1.0, 1.0, 15, dtype=jnp.float32)
_RATIO = jnp.asarray([0.5, 0.25, 2.0, 1.0], jnp.float32)
_EDGE = jnp.asarray(np.random.default_rng(0).normal(size=(4, 2)), jnp.float32)
# Path lengths between positions, large enough for the GPU test's 128 x 192 call.
_LEN = jnp.asarray(np.random.default_rng(1).integers(0, 3, (256, 256)), jnp.int32)


@pytest.mark.parametrize("name", sorted(NODE_OF_INPUTS))
def test_no_node_reads_only_input_tensors(name):
    """A value of array reads and scalars alone (rel[q - k] * ratio[h], a
    materialized value times 0.01) is computed ahead as one tensor that the
    graph adds or multiplies: every graph node reads a tensor the graph
    computes; the canonical forms compute the mod."""
    fn, tensors = NODE_OF_INPUTS[name]
    mod = scoremod.trace(fn)
    check_supported(mod.expr, mod.sources)
    fwd, bwd = forward_and_backward(mod.expr)
    _assert_cudnn_shaped(fwd)
    _assert_cudnn_shaped(bwd)
    assert len([n for n in emission_order(fwd) if n.op in INPUT_TENSORS]) == tensors, fwd
    for seed in range(3):
        pts = _points(seed)
        np.testing.assert_allclose(_eval(fwd, pts, mod),
                                   np.asarray(jnp.broadcast_to(mod(*pts), pts[0].shape)),
                                   rtol=1e-5, atol=1e-6)


def _evaluate_dividing_by(expr, inputs, rcp):
    """The canonical form's value with every float division done as cuDNN does
    it, x * rcp (rcp: float32), the rest by the op table."""
    vals = {}
    for node in ir.toposort(expr):
        if node.op == VAR:
            vals[node] = jnp.asarray(inputs[node.attr])
        elif node.op == CONST:
            vals[node] = jnp.asarray(node.attr, {"f32": jnp.float32, "i32": jnp.int32,
                                                 "bool": jnp.bool_}[node.dtype])
        elif node.op == "div":
            vals[node] = vals[node.args[0]].astype(jnp.float32) * rcp
        else:
            vals[node] = ir.OPS[node.op].evaluate([vals[x] for x in node.args], node.attr)
    return np.asarray(vals[expr])


@pytest.mark.parametrize("divisor", [3, 7, 41, 55, 64, 1000, -7, -41])
def test_integer_division_survives_a_reciprocal_division(divisor):
    """cuDNN divides as a * rcp(b) (the int_division probe on the H200: q // 41
    gave 0 at q = 41, (q - k) % 7 gave 7 for 0). The fused forms of // and %
    stay exact with the division done that way, rcp(b) rounded to nearest or
    one ulp either side of 1 / b, for |a| below 2**21."""
    forms = [rules_canonical(lambda s, b, h, q, k: s + ((q - k) // divisor).astype(jnp.float32)),
             rules_canonical(lambda s, b, h, q, k: s + ((q - k) % divisor).astype(jnp.float32))]
    assert any(n.op == "div" for n in ir.toposort(*forms)), "the fused forms divide in float"
    a = np.concatenate([np.arange(-5000, 5000), np.arange(-2**21 + 1, 2**21, 9973),
                        divisor * np.arange(-3000, 3000)]).astype(np.int32)
    zero = np.zeros_like(a)
    inputs = dict(score=np.zeros(a.shape, np.float32), b=zero, h=zero, q_idx=a, kv_idx=zero)
    one = np.float32(1.0) / np.float32(divisor)
    wants = [np.floor_divide(a, divisor), np.remainder(a, divisor)]
    for rcp in (np.nextafter(one, np.float32(-np.inf)), one, np.nextafter(one, np.float32(np.inf))):
        for form, want in zip(forms, wants):
            got = _evaluate_dividing_by(form, inputs, rcp)
            np.testing.assert_array_equal(got, want.astype(np.float32), err_msg=str(form))


def rules_canonical(fn):
    return canonical(scoremod.trace(fn).expr)
