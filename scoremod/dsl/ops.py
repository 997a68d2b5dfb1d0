"""The op table: every IR operation defined once.

One ``Op`` entry holds what each layer needs to know about an operation:
its typing, its text syntax, its jax.numpy reference implementation, its
reverse-mode derivative rule and the JAX primitives that trace to it. The
tracer, the printer and parser, the reference evaluator, the derivative and
the cuDNN lowering all read this table; ``docs/ops.md`` is generated from it.

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

from scoremod.dsl.ir import BOOL, F32, I32, Node, const
from scoremod.errors import ScoreModTypeError

# Typing signatures.
#   float : f32 -> f32           num  : T -> T (T in f32, i32)
#   float2: f32, f32 -> f32      num2 : T, T -> T
#   cmp   : T, T -> bool (T any) logic: bool.. -> bool
#   int2  : i32, i32 -> i32      where: bool, T, T -> T
#   cast:X: any -> X             load : operand, i32... -> operand's type
#   with_grad: f32, (f32, f32)... -> f32


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    arity: int
    sig: str
    ref: Callable  # jax.numpy implementation on broadcastable arrays
    vjp: Optional[Callable] = None  # (node, g) -> tuple of cotangents, None = zero
    infix: Optional[str] = None  # text operator, else written as name(args)
    prec: int = 10  # binding strength of the infix/prefix form
    prefix: Optional[str] = None
    prims: tuple = ()  # JAX primitives that trace straight to this op
    doc: str = ""

    @property
    def text(self):
        if self.name == "integer_pow":
            return "a ** n"
        if self.name == "load":
            return "name[i, ...]"
        if self.infix:
            return f"a {self.infix} b"
        if self.prefix:
            sep = " " if self.prefix.isalpha() else ""
            return f"{self.prefix}{sep}a"
        args = ", ".join("abc"[: self.arity]) if self.arity > 0 else "..."
        return f"{self.name}({args})"


OPS: dict[str, Op] = {}


def _op(name, arity, sig, ref, vjp=None, **kw):
    OPS[name] = Op(name, arity, sig, ref, vjp, **kw)


def _b(f):
    """A binary lax op made to broadcast like jax.numpy."""
    return lambda a, b: f(*jnp.broadcast_arrays(a, b))


# --- derivative rules: (node, g) -> one cotangent per argument -------------
# Each computes what jax.grad computes: JAX's jvp rule transposed, factors in
# the same order (so float32 rounding, overflow and 0 * inf agree). They are
# written so the cuDNN backward can be lowered: piecewise ops of a
# float go through relu_grad (never a comparison on floats), and factors reuse
# the primal node (``y``) the forward graph already computes.


def _zero(node, g):
    return (None,) * len(node.args)


def _relu_grad(g, x):
    return apply("relu_grad", g, x)


_RULES = {
    "add": lambda y, g: (g, g),
    "sub": lambda y, g: (g, -g),
    "mul": lambda y, g: (g * y.args[1], g * y.args[0]),
    # JAX's -g * a * b**-2, transposed: so overflow and 0 * inf agree.
    "div": lambda y, g: (g / y.args[1],
                         -((g * apply("integer_pow", y.args[1], attr=-2)) * y.args[0])),
    "neg": lambda y, g: (-g,),
    # JAX: sign(x) with abs'(0) = 1 (select(x >= 0, 1, -1)); -x > 0 is x < 0.
    "abs": lambda y, g: (g - _relu_grad(g + g, -y.args[0]),),
    "exp": lambda y, g: (g * y,),
    "exp2": lambda y, g: ((g * math.log(2.0)) * y,),
    "log": lambda y, g: (g / y.args[0],),
    "log1p": lambda y, g: (g / (y.args[0] + 1.0),),
    "expm1": lambda y, g: (g * (y + 1.0),),
    "tanh": lambda y, g: (g * ((y + 1.0) * (1.0 - y)),),  # JAX's one_minus_square
    "sigmoid": lambda y, g: (g * (y * (1.0 - y)),),
    "sqrt": lambda y, g: (g * (0.5 / y),),
    "rsqrt": lambda y, g: (g * ((y / y.args[0]) * -0.5),),
    "reciprocal": lambda y, g: (g * -apply("integer_pow", y.args[0], attr=-2),),
    "sin": lambda y, g: (g * apply("cos", y.args[0]),),
    "cos": lambda y, g: (-(g * apply("sin", y.args[0])),),
    "erf": lambda y, g: (
        (g * (2.0 / math.sqrt(math.pi))) * apply("exp", -(y.args[0] * y.args[0])),
    ),
    "integer_pow": lambda y, g: (_integer_pow_grad(y, g),),
    # As JAX: d/dy uses log(x) with x == 0 replaced by 1, so pow(0, y)' is 0.
    "pow": lambda y, g: (
        g * (y.args[1] * apply("pow", y.args[0], y.args[1] - 1.0)),
        g * (apply("log", _replace_zero(y.args[0])) * y),
    ),
    "max": lambda y, g: _max_grad(y.args[0], y.args[1], g),
    "min": lambda y, g: _max_grad(y.args[1], y.args[0], g),  # (d/da, d/db) of min(a, b)
    "relu": lambda y, g: (_relu_grad(g, y.args[0]),),
    "relu_grad": lambda y, g: (_relu_grad(g, y.args[1]), None),
    "with_grad": lambda y, g: _with_grad_vjp(y, g),
    # Remainders of floats, as JAX: d/da is 1, d/db the truncated quotient
    # (plus the divisor jnp.remainder adds back when the signs differ).
    "rem": lambda y, g: (g, -(g * _trunc_quotient(*y.args))),
    "mod": lambda y, g: (g, _mod_carry(y, g) - g * _trunc_quotient(*y.args)),
    "where": lambda y, g: (
        None,
        apply("where", y.args[0], g, const(0.0, F32)),
        apply("where", y.args[0], const(0.0, F32), g),
    ),
}


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
    return apply("tangent")


def _with_grad_vjp(y, g):
    # with_grad(value, x1, l1, x2, l2, ...): l_i is the value's tangent for a
    # tangent of x_i, linear in tangent(). The cotangent of x_i is l_i
    # transposed at g (as JAX transposes a custom_jvp rule: a term that does
    # not depend on the tangent, such as c * 0.0, contributes nothing).
    from scoremod.dsl.grad import vjp

    cts = [None]
    for lin in y.args[2::2]:
        cts += [vjp(lin, g, wrt=tangent()), None]
    return tuple(cts)


def _with_grad_ref(value, *pairs):
    shape = jnp.broadcast_shapes(jnp.shape(value), *(jnp.shape(p) for p in pairs))
    return _with_grad_fn(jnp.broadcast_to(value, shape), *pairs)


@jax.custom_jvp
def _with_grad_fn(value, *pairs):
    return value


@_with_grad_fn.defjvp
def _with_grad_jvp(primals, tangents):
    value, *pairs = primals
    out = value
    tangent = jnp.zeros_like(value)
    # The derivatives arrive evaluated at tangent() = 1. A zero one stays zero
    # whatever flows in (as JAX transposes relu's select), not 0 * inf = nan.
    for d, dx in zip(pairs[1::2], tangents[1::2]):
        tangent = tangent + jnp.where(d == 0.0, 0.0, d * dx)
    return out, tangent


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


def _rule(name):
    return (lambda node, g: _RULES[name](node, g)) if name in _RULES else _zero


# --- the table ------------------------------------------------------------

_op("add", 2, "num2", jnp.add, _rule("add"), infix="+", prec=5, prims=("add",),
    doc="addition")
_op("sub", 2, "num2", jnp.subtract, _rule("sub"), infix="-", prec=5, prims=("sub",),
    doc="subtraction")
_op("mul", 2, "num2", jnp.multiply, _rule("mul"), infix="*", prec=6, prims=("mul",),
    doc="multiplication")
_op("div", 2, "float2", jnp.divide, _rule("div"), infix="/", prec=6,
    doc="true division of floats (`/`)")
_op("trunc_div", 2, "int2", _b(lax.div), _zero,
    doc="integer division rounding toward zero (lax.div on ints)")
_op("floordiv", 2, "num2", jnp.floor_divide, _zero, infix="//", prec=6,
    doc="floor division, Python semantics (`//`)")
_op("mod", 2, "num2", jnp.remainder, _rule("mod"), infix="%", prec=6,
    doc="remainder with the sign of the divisor, Python semantics (`%`)")
_op("rem", 2, "num2", _b(lax.rem), _rule("rem"), prims=("rem",),
    doc="remainder with the sign of the dividend (lax.rem, C fmod)")
_op("offset", 2, "int2", jnp.add, _zero,
    doc="an index plus a constant, never simplified (not even `+ 0`): the query-block "
        "split shifts every block's indices with it, so all blocks share one cuDNN graph "
        "structure and cuDNN compiles their kernel once")
_op("neg", 1, "num", jnp.negative, _rule("neg"), prefix="-", prec=7, prims=("neg",),
    doc="negation")
_op("abs", 1, "num", jnp.abs, _rule("abs"), prims=("abs",), doc="absolute value")
_op("sign", 1, "num", jnp.sign, _zero, prims=("sign",), doc="sign (-1, 0, 1)")
_op("exp", 1, "float", jnp.exp, _rule("exp"), prims=("exp",), doc="e**x")
_op("exp2", 1, "float", jnp.exp2, _rule("exp2"), prims=("exp2",), doc="2**x")
_op("log", 1, "float", jnp.log, _rule("log"), prims=("log",), doc="natural logarithm")
_op("log1p", 1, "float", jnp.log1p, _rule("log1p"), prims=("log1p",), doc="log(1 + x)")
_op("expm1", 1, "float", jnp.expm1, _rule("expm1"), prims=("expm1",), doc="exp(x) - 1")
_op("tanh", 1, "float", jnp.tanh, _rule("tanh"), prims=("tanh",),
    doc="hyperbolic tangent")
_op("sigmoid", 1, "float", lax.logistic, _rule("sigmoid"), prims=("logistic",),
    doc="logistic sigmoid (jax.nn.sigmoid)")
_op("sqrt", 1, "float", jnp.sqrt, _rule("sqrt"), prims=("sqrt",), doc="square root")
_op("rsqrt", 1, "float", lax.rsqrt, _rule("rsqrt"), prims=("rsqrt",),
    doc="1 / sqrt(x)")
_op("reciprocal", 1, "float", jnp.reciprocal, _rule("reciprocal"), doc="1 / x")
_op("sin", 1, "float", jnp.sin, _rule("sin"), prims=("sin",), doc="sine")
_op("cos", 1, "float", jnp.cos, _rule("cos"), prims=("cos",), doc="cosine")
_op("erf", 1, "float", lax.erf, _rule("erf"), prims=("erf",), doc="error function")
_op("floor", 1, "float", jnp.floor, _zero, prims=("floor",),
    doc="round down (zero gradient)")
_op("ceil", 1, "float", jnp.ceil, _zero, prims=("ceil",), doc="round up (zero gradient)")
_op("integer_pow", 1, "num", lambda x, n: lax.integer_pow(x, n), _rule("integer_pow"),
    infix="**", prec=8, prims=("integer_pow",),
    doc="x ** n for an integer literal n (jnp.square, x**2)")
_op("pow", 2, "float2", _b(lax.pow), _rule("pow"), prims=("pow",),
    doc="x ** y for a float exponent")
_op("max", 2, "num2", jnp.maximum, _rule("max"), prims=("max",),
    doc="elementwise maximum (jnp.maximum, clip)")
_op("min", 2, "num2", jnp.minimum, _rule("min"), prims=("min",),
    doc="elementwise minimum (jnp.minimum, clip)")
_op("relu", 1, "float", jax.nn.relu, _rule("relu"),
    doc="max(x, 0) with derivative 0 at 0 (jax.nn.relu; `max(x, 0.0)` is the max op, "
        "derivative 0.5 at 0 as in jnp.maximum)")
_op("relu_grad", 2, "float2", lambda g, x: jnp.where(x > 0, g, 0.0), _rule("relu_grad"),
    doc="g where x > 0 else 0: the step used by derivatives of piecewise ops")
_op("lt", 2, "cmp", jnp.less, _zero, infix="<", prec=4, prims=("lt",), doc="a < b")
_op("le", 2, "cmp", jnp.less_equal, _zero, infix="<=", prec=4, prims=("le",),
    doc="a <= b")
_op("gt", 2, "cmp", jnp.greater, _zero, infix=">", prec=4, prims=("gt",), doc="a > b")
_op("ge", 2, "cmp", jnp.greater_equal, _zero, infix=">=", prec=4, prims=("ge",),
    doc="a >= b")
_op("eq", 2, "cmp", jnp.equal, _zero, infix="==", prec=4, prims=("eq",), doc="a == b")
_op("ne", 2, "cmp", jnp.not_equal, _zero, infix="!=", prec=4, prims=("ne",),
    doc="a != b")
_op("and", 2, "logic", jnp.logical_and, _zero, infix="and", prec=2, prims=("and",),
    doc="logical and (`&` on booleans)")
_op("or", 2, "logic", jnp.logical_or, _zero, infix="or", prec=1, prims=("or",),
    doc="logical or (`|` on booleans)")
_op("not", 1, "logic", jnp.logical_not, _zero, prefix="not", prec=3, prims=("not",),
    doc="logical not (`~` on booleans)")
_op("with_grad", -1, "with_grad", _with_grad_ref, _rule("with_grad"),
    doc="with_grad(y, x1, d1, ...): the value y, whose tangent for a tangent() of x_i "
        "is d_i: the rule of a jax.custom_jvp function (jax.nn.relu, jax.nn.softplus, "
        "jnp.logaddexp, ...), differentiated as JAX does")
_op("tangent", 0, "cast:f32", lambda: jnp.float32(1.0), _zero,
    doc="tangent(): the tangent that with_grad's derivatives are linear in; "
        "evaluates to 1.0")
_op("where", 3, "where", jnp.where, _rule("where"),
    doc="where(c, a, b): a if c else b (jnp.where, lax.select_n)")
_op("f32", 1, "cast:f32", lambda x: x.astype(jnp.float32), _zero,
    doc="convert to float32 (from an int: exact below 2**24; from bool: 0/1)")
_op("i32", 1, "cast:i32", lambda x: x.astype(jnp.int32), _zero,
    doc="convert to int32 (from a float: round toward zero)")
_op("bool", 1, "cast:bool", lambda x: x.astype(jnp.bool_), _zero,
    doc="convert to bool (x != 0)")
_op("load", -1, "load", None, _zero,
    doc="name[i, ...]: read a captured array; indices are clamped into range")


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
        if not args or args[0].op != "operand":
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
    from scoremod.dsl.rewrite import simplify

    simpler = simplify(name, args, attr, dtype)
    if simpler is not None:
        return simpler
    return Node(name, tuple(args), attr, dtype)


def rebuild(node: Node, args: tuple) -> Node:
    """``node``'s operation applied to new arguments."""
    return apply(node.op, *args, attr=node.attr)


def evaluate_op(name: str, args: list, attr=None):
    """Run one op's reference implementation on arrays."""
    op = OPS[name]
    if name == "integer_pow":
        return op.ref(args[0], attr)
    return op.ref(*args)


def compile_time_eval():
    return jax.ensure_compile_time_eval()
