"""The op table: every IR operation defined once.

One ``Op`` entry holds what each layer needs to know about an operation:
its typing, its text syntax (and the jax.numpy names and primitives that
reach it), its jax.numpy reference implementation, its reverse-mode
derivative rule and its documentation (``docs/ops.md`` is generated from the
entries). The tracer, the printer and parser, the reference evaluator, the
derivative and the cuDNN lowering all read this table (``ir.OPS``).

    >>> from scoremod.dsl import ir, ops
    >>> s = ir.var("score")
    >>> ops.apply("tanh", s / 30.0)
    <f32 tanh(score / 30.0)>
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax

from scoremod.dsl import ir
from scoremod.dsl.grad import ZERO, vjp
from scoremod.dsl.ir import BOOL, F32, I32, LOAD, OPERAND, TANGENT, WITH_GRAD, Node, const
from scoremod.dsl.rewrite import simplify
from scoremod.errors import ScoreModError, ScoreModTypeError

# Ops other modules name: WITH_GRAD and TANGENT, imported from ir (which
# gives them meaning) and named from here too.

# Typing signatures, in words (``result_dtype`` checks them).
SIGNATURES = {
    "float": "float32 → float32",
    "float2": "float32, float32 → float32",
    "num": "T → T, T float32 or int32",
    "num2": "T, T → T, T float32 or int32",
    "int": "int32 → int32",
    "int2": "int32, int32 → int32",
    "cmp": "T, T → bool, T any type",
    "where": "bool, T, T → T",
    "load": "array, one int32 per dim → the array's element type",
    "with_grad": "float32, then pairs of float32 → float32",
    "cast:f32": "any → float32",
    "cast:i32": "any → int32",
    "cast:bool": "any → bool",
    "logic": "bool... → bool",
}


@dataclasses.dataclass(frozen=True)
class Op:
    """Everything about one operation; ``_op`` below registers one per op."""

    name: str
    arity: int  # -1: any number of arguments
    sig: str  # typing signature, a key of SIGNATURES
    ref: Optional[Callable]  # jax.numpy implementation on broadcastable arrays
    # Reverse-mode rule (node, g) -> one cotangent (or None) per argument;
    # ZERO declares that no gradient flows. None (no rule) makes grad raise.
    vjp: Optional[Callable] = None
    # The rule takes a third argument, which arguments the gradient flows to: where
    # JAX's jvp rule is written otherwise when only one argument has a tangent.
    vjp_live: bool = False
    derivative: str = ""  # the rule in words for docs/ops.md ("0" for ZERO)
    infix: Optional[str] = None  # text operator, else written as name(args)
    prec: int = 10  # binding strength of the infix/prefix form
    prefix: Optional[str] = None
    written: Optional[str] = None  # the text form's spelling, where not derived
    aliases: tuple = ()  # other names the text form accepts (jax.numpy's)
    # For a float op jax.numpy applies to an int and returns an int: that result.
    on_int: Optional[Callable] = None
    prims: tuple = ()  # JAX primitives that trace straight to this op
    spelling: str = ""  # what a user writes in jax.numpy/lax to get it
    doc: str = ""

    @property
    def text(self):
        if self.written:
            return self.written
        if self.infix:
            return f"a {self.infix} b"
        if self.prefix:
            sep = " " if self.prefix.isalpha() else ""
            return f"{self.prefix}{sep}a"
        args = ", ".join("abc"[: self.arity]) if self.arity > 0 else "..."
        return f"{self.name}({args})"

    @property
    def typing(self):
        """The typing signature in words."""
        if self.sig == "logic":
            return ", ".join(["bool"] * self.arity) + " → bool"
        if self.arity == 0:
            return "→ float32"
        return SIGNATURES[self.sig]

    def evaluate(self, args: list, attr=None):
        """The reference implementation on arrays."""
        return self.ref(*args, attr) if self.name == "integer_pow" else self.ref(*args)


OPS = ir.OPS  # name -> Op, in table order


def _op(name, arity, sig, ref, **fields):
    if fields.get("vjp") is ZERO:
        fields.setdefault("derivative", "0")
    OPS[name] = Op(name, arity, sig, ref, **fields)


def _b(f):
    """A binary lax op made to broadcast like jax.numpy."""
    return lambda a, b: f(*jnp.broadcast_arrays(a, b))


# --- helpers of the derivative rules ----------------------------------------
# Each rule computes what jax.grad computes: JAX's jvp rule transposed, factors
# in the same order (so float32 rounding, overflow and 0 * inf agree). They are
# written so the cuDNN backward can be lowered: piecewise ops of a float go
# through relu_grad (never a comparison on floats), and factors reuse the
# primal node (``y``) the forward graph already computes.


def _relu_grad(g, x):
    return apply("relu_grad", g, x)


def _trunc_quotient(a, b):
    q = a / b
    return apply("sign", q) * apply("floor", apply("abs", q))


def _mod_carry(y, g):
    a, b = y.args
    r, zero = apply("rem", a, b), const(0.0, F32)
    carried = apply("and", apply("ne", apply("lt", r, zero), apply("lt", b, zero)),
                    apply("ne", r, zero))
    return apply("where", carried, g, zero)


def _replace_zero(x):
    zero, one = const(0.0, F32), const(1.0, F32)
    return apply("where", apply("eq", x, zero), one, x)


def tangent() -> Node:
    """The tangent inside with_grad's derivatives (1.0 when evaluated)."""
    return apply(TANGENT)


def _with_grad_vjp(y, g):
    # with_grad(value, x1, l1, x2, l2, ...): l_i is the value's tangent for a
    # tangent of x_i, linear in tangent(). The cotangent of x_i is l_i
    # transposed at g (as JAX transposes a custom_jvp rule: a term that does
    # not depend on the tangent, such as c * 0.0, contributes nothing).
    cts = [None]
    for lin in y.args[2::2]:
        cts += [vjp(lin, g, wrt=tangent()), None]
    return tuple(cts)


def _with_grad_ref(value, *pairs):
    # The value only (constant folding): its derivative needs the derivative
    # expressions, not their values, and dsl/evaluate.py evaluates it so.
    shape = jnp.broadcast_shapes(jnp.shape(value), *(jnp.shape(p) for p in pairs))
    return _value_only(jnp.broadcast_to(value, shape), *pairs)


@jax.custom_jvp
def _value_only(value, *pairs):
    return value


@_value_only.defjvp
def _value_only_jvp(primals, tangents):
    raise ScoreModError(
        "with_grad's op-table entry gives its value only; differentiate a mod through "
        "scoremod.dsl.evaluate.evaluate, which evaluates its derivatives at the tangent")


def _integer_pow_grad(y, g):
    n, x = y.attr, y.args[0]
    if n == 0:
        return None
    if n == 1:
        return g
    lower = x if n == 2 else apply("integer_pow", x, attr=n - 1)
    return g * (float(n) * lower)


def _max_grad(a, b, g):
    # d max(a, b) / da is the step of (a - b), built from relu_grad (no float
    # compare). Ties split evenly, as in JAX: (step(a > b) + step(a >= b)) / 2.
    # Each half separately, so an infinite g gives JAX's g * 1 or g * 0.5.
    def half(x, y):
        return _relu_grad(g, x - y) * 0.5 + (g - _relu_grad(g, y - x)) * 0.5

    return (half(a, b), half(b, a))


# --- the table --------------------------------------------------------------
# In ``derivative``, ``g`` is the incoming cotangent, ``y`` the op's result,
# ``a b c`` its arguments; "to a" names the argument a term flows to.

_op("add", 2, "num2", jnp.add, infix="+", prec=5, prims=("add",),
    vjp=lambda y, g: (g, g), derivative="g to a, g to b",
    spelling="`x + y`, `jnp.add`", doc="addition")
_op("sub", 2, "num2", jnp.subtract, infix="-", prec=5, prims=("sub",),
    vjp=lambda y, g: (g, -g), derivative="g to a, -g to b",
    spelling="`x - y`, `jnp.subtract`", doc="subtraction")
_op("mul", 2, "num2", jnp.multiply, infix="*", prec=6, prims=("mul",),
    vjp=lambda y, g: (g * y.args[1], g * y.args[0]), derivative="g * b to a, g * a to b",
    spelling="`x * y`, `jnp.multiply`", doc="multiplication")
_op("div", 2, "float2", jnp.divide, infix="/", prec=6,
    # JAX's (from 0.12.1) d(a / b) = (da - y * db) / b, and y * -(db / b) where a has
    # no tangent, transposed: no b**2, which overflows for |b| > 2**64 and underflows
    # for |b| < 2**-63; y is the forward's.
    vjp=lambda y, g, live: (g / y.args[1], -((g / y.args[1]) * y) if live[0]
                            else -(g * y) / y.args[1]),
    vjp_live=True,
    derivative="g / b to a, -((g / b) * y) to b (-(g * y) / b where a is constant)",
    spelling="`x / y` on floats, `jnp.divide`", doc="true division of floats (`/`)")
_op("trunc_div", 2, "int2", _b(lax.div), vjp=ZERO,
    spelling="`lax.div(i, j)` on ints",
    doc="integer division rounding toward zero (lax.div on ints)")
_op("floordiv", 2, "num2", jnp.floor_divide, infix="//", prec=6, vjp=ZERO,
    spelling="`x // y`, `jnp.floor_divide` (on ints jnp's `//` traces to trunc_div, rem and "
             "where, which simplify to it)",
    doc="floor division, Python semantics (`//`; on floats jnp.floor_divide's values)")
# Remainders of floats, as JAX: d/da is 1, d/db the truncated quotient (plus
# the divisor jnp.remainder adds back when the signs differ).
_op("mod", 2, "num2", jnp.remainder, infix="%", prec=6,
    vjp=lambda y, g: (g, _mod_carry(y, g) - g * _trunc_quotient(*y.args)),
    derivative="floats: g to a, where(a % b was corrected, g, 0) - g * trunc(a / b) to b; "
               "ints: 0",
    spelling="`%` in the text form; jnp `%` traces to rem (and where for signed values)",
    doc="remainder with the sign of the divisor, Python semantics (`%`)")
_op("rem", 2, "num2", _b(lax.rem), prims=("rem",),
    vjp=lambda y, g: (g, -(g * _trunc_quotient(*y.args))),
    derivative="floats: g to a, -(g * trunc(a / b)) to b; ints: 0",
    spelling="`lax.rem`, `jnp.fmod`",
    doc="remainder with the sign of the dividend (lax.rem, C fmod)")
_op("offset", 2, "int2", jnp.add, vjp=ZERO,
    spelling="none: written by the query-block split, or as `offset(q_idx, 512)` in the "
             "text form",
    doc="an index plus a constant, never simplified (not even `+ 0`): the query-block "
        "split shifts every block's indices with it, so all blocks share one cuDNN graph "
        "structure and cuDNN compiles their kernel once")
_op("neg", 1, "num", jnp.negative, prefix="-", prec=7, prims=("neg",),
    vjp=lambda y, g: (-g,), derivative="-g",
    spelling="`-x`, `jnp.negative`", doc="negation")
_op("abs", 1, "num", jnp.abs, prims=("abs",),
    # JAX: sign(x) with abs'(0) = 1 (select(x >= 0, 1, -1)); -x > 0 is x < 0.
    vjp=lambda y, g: (g - _relu_grad(g + g, -y.args[0]),),
    derivative="g - relu_grad(2 * g, -a) (abs'(0) = 1, as in JAX)",
    spelling="`abs(x)`, `jnp.abs`", doc="absolute value")
_op("sign", 1, "num", jnp.sign, prims=("sign",), vjp=ZERO,
    spelling="`jnp.sign`", doc="sign (-1, 0, 1)")
_op("exp", 1, "float", jnp.exp, prims=("exp",),
    vjp=lambda y, g: (g * y,), derivative="g * y", spelling="`jnp.exp`", doc="e**x")
_op("exp2", 1, "float", jnp.exp2, prims=("exp2",),
    vjp=lambda y, g: ((g * math.log(2.0)) * y,), derivative="(g * ln(2)) * y",
    spelling="`jnp.exp2`", doc="2**x")
_op("log", 1, "float", jnp.log, prims=("log",),
    vjp=lambda y, g: (g / y.args[0],), derivative="g / a",
    spelling="`jnp.log`", doc="natural logarithm")
_op("log2", 1, "float", jnp.log2, prims=("log2",),
    vjp=lambda y, g: (g / (y.args[0] * math.log(2.0)),), derivative="g / (a * ln(2))",
    spelling="`jnp.log2` (before jax 0.11 it traces to `log(x) / 0.6931472`)",
    doc="base-2 logarithm")
_op("log1p", 1, "float", jnp.log1p, prims=("log1p",),
    vjp=lambda y, g: (g / (y.args[0] + 1.0),), derivative="g / (a + 1)",
    spelling="`jnp.log1p`", doc="log(1 + x)")
_op("expm1", 1, "float", jnp.expm1, prims=("expm1",),
    vjp=lambda y, g: (g * (y + 1.0),), derivative="g * (y + 1)",
    spelling="`jnp.expm1`", doc="exp(x) - 1")
_op("tanh", 1, "float", jnp.tanh, prims=("tanh",),
    vjp=lambda y, g: (g * ((y + 1.0) * (1.0 - y)),),  # JAX's one_minus_square
    derivative="g * ((y + 1) * (1 - y))", spelling="`jnp.tanh`", doc="hyperbolic tangent")
_op("sigmoid", 1, "float", lax.logistic, prims=("logistic",), aliases=("logistic",),
    vjp=lambda y, g: (g * (y * (1.0 - y)),), derivative="g * (y * (1 - y))",
    spelling="`jax.nn.sigmoid`, `lax.logistic`", doc="logistic sigmoid (jax.nn.sigmoid)")
_op("sqrt", 1, "float", jnp.sqrt, prims=("sqrt",),
    vjp=lambda y, g: (g * (0.5 / y),), derivative="g * (0.5 / y)",
    spelling="`jnp.sqrt`", doc="square root")
_op("rsqrt", 1, "float", lax.rsqrt, prims=("rsqrt",),
    vjp=lambda y, g: (g * ((y / y.args[0]) * -0.5),), derivative="g * ((y / a) * -0.5)",
    spelling="`lax.rsqrt`", doc="1 / sqrt(x)")
_op("reciprocal", 1, "float", jnp.reciprocal,
    vjp=lambda y, g: (g * -apply("integer_pow", y.args[0], attr=-2),),
    derivative="g * -(a ** -2)", doc="1 / x")
_op("sin", 1, "float", jnp.sin, prims=("sin",),
    vjp=lambda y, g: (g * apply("cos", y.args[0]),), derivative="g * cos(a)",
    spelling="`jnp.sin`", doc="sine")
_op("cos", 1, "float", jnp.cos, prims=("cos",),
    vjp=lambda y, g: (-(g * apply("sin", y.args[0])),), derivative="-(g * sin(a))",
    spelling="`jnp.cos`", doc="cosine")
_op("tan", 1, "float", jnp.tan, prims=("tan",),
    vjp=lambda y, g: (g * (apply("integer_pow", y, attr=2) + 1.0),),
    derivative="g * (y ** 2 + 1)", spelling="`jnp.tan`", doc="tangent")
_op("atan", 1, "float", jnp.arctan, prims=("atan",), aliases=("arctan",),
    vjp=lambda y, g: (g / (apply("integer_pow", y.args[0], attr=2) + 1.0),),
    derivative="g / (a ** 2 + 1)", spelling="`jnp.arctan`, `lax.atan`", doc="arctangent")
_op("erf", 1, "float", lax.erf, prims=("erf",),
    vjp=lambda y, g: (
        (g * (2.0 / math.sqrt(math.pi))) * apply("exp", -(y.args[0] * y.args[0])),),
    derivative="(g * 2/sqrt(pi)) * exp(-a*a)",
    spelling="`jax.scipy.special.erf`, `lax.erf`", doc="error function")
_op("erfc", 1, "float", lax.erfc, prims=("erfc",),
    vjp=lambda y, g: (
        (g * (-2.0 / math.sqrt(math.pi))) * apply("exp", -(y.args[0] * y.args[0])),),
    derivative="(g * -2/sqrt(pi)) * exp(-a*a)",
    spelling="`jax.scipy.special.erfc`, `lax.erfc`; `jax.nn.gelu(x, approximate=False)` "
             "traces to it",
    doc="complementary error function, 1 - erf(x)")
_op("floor", 1, "float", jnp.floor, prims=("floor",), vjp=ZERO, on_int=lambda x: x,
    spelling="`jnp.floor`", doc="round down (zero gradient)")
_op("ceil", 1, "float", jnp.ceil, prims=("ceil",), vjp=ZERO, on_int=lambda x: x,
    spelling="`jnp.ceil`", doc="round up (zero gradient)")
_op("integer_pow", 1, "num", lambda x, n: lax.integer_pow(x, n),
    infix="**", prec=8, written="a ** n", prims=("integer_pow",),  # n an integer literal
    vjp=lambda y, g: (_integer_pow_grad(y, g),), derivative="g * n * a ** (n-1)",
    spelling="`x ** n`, `jnp.square`, `lax.integer_pow`",
    doc="x ** n for an integer literal n (jnp.square, x**2)")
# As JAX: d/db uses log(a) with a == 0 replaced by 1, so pow(0, b)' is 0.
_op("pow", 2, "float2", _b(lax.pow), prims=("pow",),
    vjp=lambda y, g: (
        g * (y.args[1] * apply("pow", y.args[0], y.args[1] - 1.0)),
        g * (apply("log", _replace_zero(y.args[0])) * y),
    ),
    derivative="g * (b * pow(a, b - 1)) to a, g * (log(where(a == 0, 1, a)) * y) to b "
               "(pow(0, b)' = 0, as in JAX)",
    spelling="`x ** y` with a float y, `jnp.power`", doc="x ** y for a float exponent")
_op("max", 2, "num2", jnp.maximum, prims=("max",), aliases=("maximum",),
    vjp=lambda y, g: _max_grad(y.args[0], y.args[1], g),
    derivative="relu_grad(g, a - b) / 2 + (g - relu_grad(g, b - a)) / 2 to a, the same "
               "with a, b swapped to b (ties split evenly, as in JAX)",
    spelling="`jnp.maximum`, `jnp.clip`", doc="elementwise maximum (jnp.maximum, clip)")
_op("min", 2, "num2", jnp.minimum, prims=("min",), aliases=("minimum",),
    vjp=lambda y, g: _max_grad(y.args[1], y.args[0], g),  # (d/da, d/db) of min(a, b)
    derivative="relu_grad(g, b - a) / 2 + (g - relu_grad(g, a - b)) / 2 to a, the same "
               "with a, b swapped to b (ties split evenly, as in JAX)",
    spelling="`jnp.minimum`, `jnp.clip`", doc="elementwise minimum (jnp.minimum, clip)")
_op("relu", 1, "float", jax.nn.relu,
    on_int=lambda x: apply("max", x, const(0, I32)),
    vjp=lambda y, g: (_relu_grad(g, y.args[0]),),
    derivative="relu_grad(g, a) (0 at 0, as jax.nn.relu)",
    spelling="`jax.nn.relu` (`jnp.maximum(x, 0.0)` is max)",
    doc="max(x, 0) with derivative 0 at 0 (jax.nn.relu; `max(x, 0.0)` is the max op, "
        "derivative 0.5 at 0 as in jnp.maximum)")
_op("relu_grad", 2, "float2", lambda g, x: jnp.where(x > 0, g, 0.0),
    vjp=lambda y, g: (_relu_grad(g, y.args[1]), None),
    derivative="relu_grad(g, b) to a, none to b", spelling="(made by derivatives)",
    doc="g where x > 0 else 0: the step used by derivatives of piecewise ops")
_op("lt", 2, "cmp", jnp.less, infix="<", prec=4, prims=("lt",), vjp=ZERO,
    spelling="`x < y`", doc="a < b")
_op("le", 2, "cmp", jnp.less_equal, infix="<=", prec=4, prims=("le",), vjp=ZERO,
    spelling="`x <= y`", doc="a <= b")
_op("gt", 2, "cmp", jnp.greater, infix=">", prec=4, prims=("gt",), vjp=ZERO,
    spelling="`x > y`", doc="a > b")
_op("ge", 2, "cmp", jnp.greater_equal, infix=">=", prec=4, prims=("ge",), vjp=ZERO,
    spelling="`x >= y`", doc="a >= b")
_op("eq", 2, "cmp", jnp.equal, infix="==", prec=4, prims=("eq",), vjp=ZERO,
    spelling="`x == y`", doc="a == b")
_op("ne", 2, "cmp", jnp.not_equal, infix="!=", prec=4, prims=("ne",), vjp=ZERO,
    spelling="`x != y`", doc="a != b")
_op("and", 2, "logic", jnp.logical_and, infix="and", prec=2, prims=("and",), vjp=ZERO,
    spelling="`m & n`, `jnp.logical_and`", doc="logical and (`&` on booleans)")
_op("or", 2, "logic", jnp.logical_or, infix="or", prec=1, prims=("or",), vjp=ZERO,
    spelling="`m | n`, `jnp.logical_or`", doc="logical or (`|` on booleans)")
_op("not", 1, "logic", jnp.logical_not, prefix="not", prec=3, prims=("not",), vjp=ZERO,
    spelling="`~m`, `jnp.logical_not`", doc="logical not (`~` on booleans)")
# Integer bitwise ops: jax.numpy's & | ^ ~ on ints (on bools they are the logic
# ops above; the tracer tells them apart by type), and shifts as XLA defines
# them for int32 (a shift by 32 or more, or by a negative amount, gives 0, or
# the sign for >>).
_op("bitwise_and", 2, "int2", _b(lax.bitwise_and), vjp=ZERO,
    spelling="`i & j` on ints, `jnp.bitwise_and`", doc="bitwise and of int32 values")
_op("bitwise_or", 2, "int2", _b(lax.bitwise_or), vjp=ZERO,
    spelling="`i | j` on ints, `jnp.bitwise_or`", doc="bitwise or of int32 values")
_op("bitwise_xor", 2, "int2", _b(lax.bitwise_xor), vjp=ZERO,
    spelling="`i ^ j` on ints, `jnp.bitwise_xor` (`m ^ n` on bools is `m != n`)",
    doc="bitwise exclusive or of int32 values")
_op("invert", 1, "int", lax.bitwise_not, vjp=ZERO, aliases=("bitwise_not", "bitwise_invert"),
    spelling="`~i` on ints, `jnp.invert`", doc="bitwise not of an int32 value (-i - 1)")
_op("left_shift", 2, "int2", _b(lax.shift_left), prims=("shift_left",), vjp=ZERO,
    aliases=("shift_left",),
    spelling="`i << n`, `jnp.left_shift`",
    doc="i shifted left by n bits (0 when n is negative or 32 or more, as XLA)")
_op("right_shift", 2, "int2", _b(lax.shift_right_arithmetic),
    prims=("shift_right_arithmetic",), vjp=ZERO, aliases=("shift_right_arithmetic",),
    spelling="`i >> n`, `jnp.right_shift`",
    doc="i shifted right by n bits, filling with the sign (arithmetic, as jnp's >> on "
        "int32; -1 or 0 when n is negative or 32 or more)")
_op("shift_right_logical", 2, "int2", _b(lax.shift_right_logical),
    prims=("shift_right_logical",), vjp=ZERO,
    spelling="`lax.shift_right_logical`",
    doc="i shifted right by n bits, filling with zeros (0 when n is negative or 32 or more)")
_op(WITH_GRAD, -1, "with_grad", _with_grad_ref, vjp=_with_grad_vjp,
    derivative="d_i transposed at g (d_i with tangent() replaced by g, its terms without "
               "tangent() dropped) to x_i",
    spelling="a `jax.custom_jvp` function: `jax.nn.softplus`, `jnp.logaddexp`, "
             "`jax.nn.relu6`, ... (`jax.nn.relu` becomes relu)",
    doc="with_grad(y, x1, d1, ...): the value y, whose tangent for a tangent() of x_i "
        "is d_i: the rule of a jax.custom_jvp function (jax.nn.relu, jax.nn.softplus, "
        "jnp.logaddexp, ...), differentiated as JAX does")
_op(TANGENT, 0, "cast:f32", lambda: jnp.float32(1.0), vjp=ZERO,
    spelling="none: inside with_grad's derivatives",
    doc="tangent(): the tangent that with_grad's derivatives are linear in; "
        "evaluates to 1.0")
_op("where", 3, "where", jnp.where,
    vjp=lambda y, g: (
        None,
        apply("where", y.args[0], g, const(0.0, F32)),
        apply("where", y.args[0], const(0.0, F32), g),
    ),
    derivative="where(a, g, 0) to b, where(a, 0, g) to c, none to a",
    spelling="`jnp.where(cond, x, y)`, `lax.select`",
    doc="where(c, a, b): a if c else b (jnp.where, lax.select_n)")
_op("f32", 1, "cast:f32", lambda x: x.astype(jnp.float32), vjp=ZERO, aliases=("float32",),
    spelling="`x.astype(jnp.float32)`",
    doc="convert to float32 (from an int: exact below 2**24; from bool: 0/1)")
_op("i32", 1, "cast:i32", lambda x: x.astype(jnp.int32), vjp=ZERO, aliases=("int32",),
    spelling="`x.astype(jnp.int32)`", doc="convert to int32 (from a float: round toward zero)")
_op("bool", 1, "cast:bool", lambda x: x.astype(jnp.bool_), vjp=ZERO,
    spelling="`x.astype(bool)`", doc="convert to bool (x != 0)")
_op(LOAD, -1, "load", None, vjp=ZERO, written="name[i, ...]",  # not callable by name
    spelling="`arr[i, ...]`, `arr[h]`, `lax.dynamic_slice`",
    doc="name[i, ...]: read a captured array; indices are clamped into range")

COMPARISONS = tuple(name for name, op in OPS.items() if op.sig == "cmp")


# --- typing and the smart constructor ---------------------------------------


def _type_error(op, args, want):
    got = ", ".join(a.dtype for a in args)
    return ScoreModTypeError(f"{op}({got}): expects {want}")


def result_dtype(op: Op, args: tuple) -> str:
    """The IR type ``op`` yields on ``args``, or a ScoreModTypeError."""
    sig, ts = op.sig, [a.dtype for a in args]
    if sig.startswith("cast:"):
        return sig[5:]
    if sig == "load":
        if not args or args[0].op != OPERAND:
            raise ScoreModTypeError("load needs a captured array as first argument")
        shape = args[0].attr[1]
        if len(args) - 1 != len(shape):
            raise ScoreModTypeError(
                f"{args[0].attr[0]} has {len(shape)} dims but is indexed with "
                f"{len(args) - 1} indices; index every dim (use 0 for size-1 dims)"
            )
        if any(t != I32 for t in ts[1:]):
            raise ScoreModTypeError(f"indices of {args[0].attr[0]} must be int32")
        return args[0].dtype
    if sig == "float" or sig == "float2":
        if any(t != F32 for t in ts):
            raise _type_error(op.name, args, "float32 arguments")
        return F32
    if sig == "num" or sig == "num2":
        if ts[0] == BOOL or any(t != ts[0] for t in ts):
            raise _type_error(op.name, args, "numbers of one type (float32 or int32)")
        return ts[0]
    if sig == "int":
        if ts[0] != I32:
            raise _type_error(op.name, args, "an int32 argument")
        return I32
    if sig == "int2":
        if any(t != I32 for t in ts):
            raise _type_error(op.name, args, "int32 arguments")
        return I32
    if sig == "cmp":
        if ts[0] != ts[1]:
            raise _type_error(op.name, args, "two arguments of one type")
        return BOOL
    if sig == "logic":
        if any(t != BOOL for t in ts):
            raise _type_error(op.name, args, "booleans")
        return BOOL
    if sig == "with_grad":
        if len(ts) < 3 or len(ts) % 2 == 0 or any(t != F32 for t in ts):
            raise _type_error(op.name, args, "(value, x1, d1, x2, d2, ...), all float32")
        return F32
    if sig == "where":
        if ts[0] != BOOL or ts[1] != ts[2]:
            raise _type_error(op.name, args, "(bool, T, T)")
        return ts[1]
    raise AssertionError(sig)


def apply(name: str, *args: Node, attr=None) -> Node:
    """Build ``name(*args)``: type-check, simplify, intern."""
    op = OPS.get(name)
    if op is None:
        raise KeyError(f"unknown IR op {name!r}")
    if op.arity >= 0 and len(args) != op.arity:
        raise ScoreModTypeError(f"{name} takes {op.arity} arguments, got {len(args)}")
    if name == "integer_pow" and not isinstance(attr, int):
        raise ScoreModTypeError("integer_pow needs an integer exponent")
    dtype = result_dtype(op, args)
    simpler = simplify(op, args, attr, dtype)
    if simpler is not None:
        return simpler
    return Node(name, tuple(args), attr, dtype)


ir.install(apply=apply)
