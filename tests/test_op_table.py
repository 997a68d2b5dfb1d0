"""The op table: one complete entry per op, and a derivative rule or an error."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from scoremod.dsl import ir
from scoremod.dsl.grad import ZERO, vjp
from scoremod.dsl.ops import OPS, SIGNATURES, Op, apply


@pytest.mark.parametrize("name", list(OPS))
def test_every_entry_has_every_field_it_needs(name):
    op = OPS[name]
    assert op.name == name
    assert op.sig in SIGNATURES and op.typing
    assert callable(op.vjp), f"{name} has no derivative rule (vjp=ZERO if none flows)"
    assert op.derivative.strip() and op.doc.strip(), name
    assert (op.derivative == "0") == (op.vjp is ZERO), name
    assert op.text
    assert op.ref is not None or name == ir.LOAD  # a load reads the operand's values
    assert op.arity >= 0 or op.sig in ("load", "with_grad")


def test_every_primitive_traces_to_one_op():
    prims = [p for op in OPS.values() for p in op.prims]
    assert len(prims) == len(set(prims))


@pytest.fixture
def op_without_rule(monkeypatch):
    """A float op registered for one test, with no derivative rule."""
    monkeypatch.setitem(OPS, "twice", Op("twice", 1, "float", lambda x: 2 * x,
                                         derivative="g * 2", doc="2 * x"))
    return "twice"


def test_a_missing_derivative_rule_raises_naming_the_op(op_without_rule):
    s = ir.var(ir.SCORE)
    expr = apply(op_without_rule, s) * 3.0
    with pytest.raises(scoremod.ScoreModError, match="no derivative rule for op 'twice'"):
        vjp(expr, ir.const(1.0, "f32"))
    # the zero rule is declared, never assumed: a ZERO op differentiates to 0
    assert vjp(apply("floor", s), ir.const(1.0, "f32")) is ir.const(0.0, "f32")


def test_a_missing_rule_reaches_mod_grad(op_without_rule):
    mod = scoremod.ScoreMod(apply("f32", apply(op_without_rule, ir.var(ir.SCORE))), ())
    with pytest.raises(scoremod.ScoreModError, match="twice"):
        mod.grad


NEW_OPS = {  # op: (jax.numpy function, points inside its domain)
    "tan": (jnp.tan, [-1.2, -0.5, 0.0, 0.3, 1.0, 1.4]),
    "atan": (jnp.arctan, [-30.0, -1.0, -0.0, 0.0, 0.25, 2.0, 1e6]),
    "log2": (jnp.log2, [1e-30, 0.5, 1.0, 2.0, 3.0, 1024.0, 1e30]),
}


@pytest.mark.parametrize("name", sorted(NEW_OPS))
def test_new_ops_trace_round_trip_and_differentiate_as_jax(name):
    fn, points = NEW_OPS[name]
    mod = scoremod.trace(lambda s, b, h, q, k: fn(s) * 2.0)
    if name == "log2" and not hasattr(jax.lax, "log2"):  # jax < 0.11: log(x) / log(2)
        assert str(mod) == "log(score) / 0.6931472 * 2.0"
        mod = scoremod.parse("log2(score) * 2.0")
    assert str(mod) == f"{name}(score) * 2.0"
    assert scoremod.parse(str(mod)).same_ir(mod)
    assert scoremod.parse(f"{name}(score) * 2.0").same_ir(mod)
    s = jnp.asarray(points, jnp.float32)
    idx = jnp.zeros_like(s, jnp.int32)
    np.testing.assert_array_equal(np.asarray(mod(s, idx, idx, idx, idx)), np.asarray(fn(s) * 2.0))
    want = jax.vmap(jax.grad(lambda x: fn(x) * 2.0))(s)
    got = mod.grad(s, idx, idx, idx, idx)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-7, atol=0)


def test_text_form_takes_jax_numpy_names_of_the_new_ops():
    assert str(scoremod.parse("arctan(score)")) == "atan(score)"
    assert str(scoremod.parse("tan(1)")) == str(scoremod.parse("tan(1.0)"))  # an int becomes a float
