"""Simplifications applied whenever a node is built: a pattern table.

Each pattern is a function ``(args, attr) -> Node | None`` registered for one
op. They keep traced mods small (JAX's negative-index wrapping of ``x[h]``
folds away because indices are never negative) and keep derivatives readable
(``g * 1`` is ``g``). Every rewrite is exact in float32 arithmetic, except
that ``x + 0.0`` drops the sign of a negative zero.
"""

from __future__ import annotations

import math

import numpy as np

from scoremod.dsl.ir import BOOL, F32, I32, Node, const, is_const

PATTERNS: dict[str, list] = {}


def pattern(*ops):
    def register(fn):
        for op in ops:
            PATTERNS.setdefault(op, []).append(fn)
        return fn

    return register


COMMUTATIVE = ("add", "mul", "max", "min", "eq", "ne", "and", "or")


def simplify(name, args, attr, dtype):
    if name != "load" and args and all(a.op == "const" for a in args):
        return _fold(name, args, attr, dtype)
    if name in COMMUTATIVE and args[0].op == "const" and args[1].op != "const":
        # One spelling per value (30 * x is x * 30), and cuDNN wants scalars second.
        from scoremod.dsl.ops import apply

        return apply(name, args[1], args[0], attr=attr)
    for fn in PATTERNS.get(name, ()):
        out = fn(args, attr)
        if out is not None:
            return out
    return None


def _fold(name, args, attr, dtype):
    from scoremod.dsl.ops import compile_time_eval, evaluate_op

    np_types = {F32: np.float32, I32: np.int32, BOOL: np.bool_}
    with compile_time_eval(), np.errstate(all="ignore"):
        vals = [np.asarray(a.attr, np_types[a.dtype]) for a in args]
        out = np.asarray(evaluate_op(name, vals, attr))
    return const(out.item(), dtype)


def nonneg(node: Node) -> bool:
    """True when an int node is provably >= 0 (index variables are)."""
    if node.dtype != I32:
        return False
    if node.op == "var":
        return True
    if node.op == "const":
        return node.attr >= 0
    if node.op in ("add", "offset", "mul", "max", "floordiv", "trunc_div", "rem", "mod",
                   "integer_pow"):
        if node.op == "max":
            return any(nonneg(a) for a in node.args)
        return all(nonneg(a) for a in node.args)
    if node.op in ("min", "where"):
        return all(nonneg(a) for a in node.args if a.dtype == I32)
    if node.op == "abs":
        return True
    return False


@pattern("add")
def _add_zero(args, attr):
    a, b = args
    if is_const(b, 0) or is_const(b, 0.0):
        return a
    if is_const(a, 0) or is_const(a, 0.0):
        return b
    return None


@pattern("sub")
def _sub_const(args, attr):
    from scoremod.dsl.ops import apply

    a, b = args
    if is_const(b, 0) or is_const(b, 0.0):
        return a
    if b.op == "const" and b.dtype == F32 and b.attr < 0:  # x - -c is x + c, exactly
        return apply("add", a, const(-b.attr, F32))
    return None


@pattern("mul")
def _mul_one(args, attr):
    a, b = args
    if is_const(b, 1) or is_const(b, 1.0):
        return a
    if is_const(a, 1) or is_const(a, 1.0):
        return b
    return None


@pattern("div")
def _div_one(args, attr):
    return args[0] if is_const(args[1], 1.0) else None


def _double_negation(op):
    def rule(args, attr):
        (a,) = args
        return a.args[0] if a.op == op else None

    return rule


PATTERNS["neg"] = [_double_negation("neg")]
PATTERNS["not"] = [_double_negation("not")]


def _compare_nonneg_with_zero(result):
    # JAX wraps negative indices: where(i < 0, i + n, i). Indices are >= 0.
    def rule(args, attr):
        a, b = args
        if is_const(b, 0) and nonneg(a):
            return const(result, BOOL)
        return None

    return rule


PATTERNS["lt"] = [_compare_nonneg_with_zero(False)]
PATTERNS["ge"] = [_compare_nonneg_with_zero(True)]


@pattern("where")
def _where_known(args, attr):
    c, a, b = args
    if c.op == "const":
        return a if c.attr else b
    if a is b:
        return a
    return None


@pattern("where")
def _floor_divide(args, attr):
    # jnp.floor_divide on ints traces to this correction of lax.div; name it.
    from scoremod.dsl.ops import apply

    c, t, f = args
    if f.op != "trunc_div" or t.op != "sub" or f.dtype != I32:
        return None
    a, b = f.args
    want = apply("and", apply("ne", apply("sign", a), apply("sign", b)),
                 apply("ne", apply("rem", a, b), const(0, I32)))
    if c is want and t is apply("sub", f, const(1, I32)):
        return apply("floordiv", a, b)
    return None


@pattern("where")
def _remainder(args, attr):
    # jnp.remainder on ints traces to this correction of lax.rem; name it.
    from scoremod.dsl.ops import apply

    c, t, f = args
    if f.op != "rem" or t.op != "add" or f.dtype != I32:
        return None
    a, b = f.args
    zero = const(0, I32)
    want = apply("and", apply("ne", apply("lt", f, zero), apply("lt", b, zero)),
                 apply("ne", f, zero))
    if c is want and t is apply("add", f, b):
        return apply("mod", a, b)
    return None


def _bool_const_compare(negate_on_true):
    def rule(args, attr):
        from scoremod.dsl.ops import apply

        a, b = args
        if a.dtype != BOOL or b.op != "const":
            return None
        return a if b.attr != negate_on_true else apply("not", a)

    return rule


PATTERNS["ne"] = [_bool_const_compare(True)]  # x != False is x; x != True is not x
PATTERNS["eq"] = [_bool_const_compare(False)]  # x == True is x; x == False is not x


@pattern("max")
def _max_zero_is_relu(args, attr):
    from scoremod.dsl.ops import apply

    a, b = args
    if a.dtype != F32:
        return None
    if is_const(b, 0.0) and math.copysign(1.0, b.attr) > 0:
        return apply("relu", a)
    if is_const(a, 0.0) and math.copysign(1.0, a.attr) > 0:
        return apply("relu", b)
    return None


@pattern("and")
def _and_const(args, attr):
    a, b = args
    for x, y in ((a, b), (b, a)):
        if x.op == "const":
            return y if x.attr else x
    return a if a is b else None


@pattern("or")
def _or_const(args, attr):
    a, b = args
    for x, y in ((a, b), (b, a)):
        if x.op == "const":
            return x if x.attr else y
    return a if a is b else None


def _cast_to(dtype):
    def rule(args, attr):
        (a,) = args
        return a if a.dtype == dtype else None

    return rule


PATTERNS["f32"] = [_cast_to(F32)]
PATTERNS["i32"] = [_cast_to(I32)]
PATTERNS["bool"] = [_cast_to(BOOL)]


@pattern("load")
def _drop_redundant_clamp(args, attr):
    # A load clamps its indices, so clamping them first is a no-op. (The
    # reference evaluator clamps explicitly; tracing a call of one mod inside
    # another must give the same IR back.)
    from scoremod.dsl.ops import apply

    array, idx = args[0], args[1:]
    new = list(idx)
    for i, (x, n) in enumerate(zip(idx, array.attr[1])):
        inner = _clamp_arg(x, n)
        if inner is not None:
            new[i] = inner
    return apply("load", array, *new) if new != list(idx) else None


def _clamp_arg(x, n):
    """y when x is min(max(y, 0), n - 1) or max(min(y, n - 1), 0), else None."""
    lo, hi = const(0, I32), const(n - 1, I32)
    if x.op == "min" and x.args[1] is hi and x.args[0].op == "max" and x.args[0].args[1] is lo:
        return x.args[0].args[0]
    if x.op == "max" and x.args[1] is lo and x.args[0].op == "min" and x.args[0].args[1] is hi:
        return x.args[0].args[0]
    return None
