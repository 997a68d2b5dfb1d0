"""Interval analysis of the IR: an abstract value per node over a set of inputs.

For ints an interval, for bools whether the value can be true and whether it
can be false, for floats an interval and whether it can be NaN; each part an
array, so one evaluation bounds a node over many sets at once (every tile of
a call: ``lowering.block_maps``). ``RULES`` combine the abstract values of
an op's arguments into the op's (interval arithmetic; exact at the corners
for ``q_idx - kv_idx``); an op without a rule bounds nothing (``every``).
``value_parts``, ``reduce_parts`` and ``from_parts`` bound concrete values:
the values of a node evaluated exactly, reduced onto the sets.

Bounds over-approximate, never under: int32 arithmetic that may wrap gives
every int32, and float bounds computed with rounding are widened.

    >>> import jax.numpy as jnp, scoremod
    >>> from scoremod.dsl import ir
    >>> q, k = ir.var("q_idx"), ir.var("kv_idx")
    >>> d = RULES["sub"](q - k, Ints(jnp.int32(0), jnp.int32(9)), Ints(jnp.int32(3), jnp.int32(3)))
    >>> int(d.lo), int(d.hi)
    (-3, 6)
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scoremod.dsl import ir
from scoremod.dsl.ir import BOOL, F32, I32, MATERIALIZE

F32_MAX = float(np.finfo(np.float32).max)
_I32_MIN, _I32_MAX = np.int32(ir.INT32_MIN), np.int32(ir.INT32_MAX)
# |a * b| at or above this in float32 may not fit int32 (float32 rounding of
# the operands and the product is well below 4096 at 2**31).
_MUL_LIMIT = np.float32(2.0**31 - 4096)


class Ints(NamedTuple):
    lo: jnp.ndarray
    hi: jnp.ndarray


class Bools(NamedTuple):
    can_true: jnp.ndarray
    can_false: jnp.ndarray


class Floats(NamedTuple):
    lo: jnp.ndarray  # bounds of the non-NaN values (lo > hi: there are none)
    hi: jnp.ndarray
    nan: jnp.ndarray  # may be NaN


def every(dtype):
    """The abstract value bounding nothing: every value of ``dtype``."""
    if dtype == I32:
        return Ints(jnp.int32(ir.INT32_MIN), jnp.int32(ir.INT32_MAX))
    if dtype == BOOL:
        return Bools(jnp.bool_(True), jnp.bool_(True))
    return Floats(jnp.float32(-np.inf), jnp.float32(np.inf), jnp.bool_(True))


def constant(node):
    """The abstract value of a CONST node: that value alone."""
    v = node.attr
    if node.dtype == I32:
        return Ints(jnp.int32(v), jnp.int32(v))
    if node.dtype == BOOL:
        return Bools(jnp.bool_(v), jnp.bool_(not v))
    if math.isnan(v):
        return Floats(jnp.float32(np.inf), jnp.float32(-np.inf), jnp.bool_(True))
    return Floats(jnp.float32(v), jnp.float32(v), jnp.bool_(False))


# int32 interval arithmetic: a bound that wraps makes the result every int32
# (the values in between may wrap too); bounds that fit mean no value wraps.


def _ints(lo, hi, wrapped):
    return Ints(jnp.where(wrapped, _I32_MIN, lo), jnp.where(wrapped, _I32_MAX, hi))


def _add_wraps(a, b, r):
    return ((a >= 0) == (b >= 0)) & ((r >= 0) != (a >= 0))


def _sub_wraps(a, b, r):
    return ((a >= 0) != (b >= 0)) & ((r >= 0) != (a >= 0))


def _int_add(a, b):
    lo, hi = a.lo + b.lo, a.hi + b.hi
    return _ints(lo, hi, _add_wraps(a.lo, b.lo, lo) | _add_wraps(a.hi, b.hi, hi))


def _int_sub(a, b):
    lo, hi = a.lo - b.hi, a.hi - b.lo
    return _ints(lo, hi, _sub_wraps(a.lo, b.hi, lo) | _sub_wraps(a.hi, b.lo, hi))


def _int_mul(a, b):
    corners = [x * y for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    big = [jnp.abs(x.astype(jnp.float32) * y.astype(jnp.float32)) >= _MUL_LIMIT
           for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    return _ints(_min(*corners), _max(*corners), _any(*big))


def _int_neg(a):
    return _ints(-a.hi, -a.lo, a.lo == _I32_MIN)


def _int_abs(a):
    lo = jnp.where((a.lo <= 0) & (a.hi >= 0), 0, jnp.minimum(jnp.abs(a.lo), jnp.abs(a.hi)))
    return _ints(lo, jnp.maximum(jnp.abs(a.lo), jnp.abs(a.hi)), a.lo == _I32_MIN)


def _int_div(fn):
    # A positive divisor: the quotient is monotone in each argument for a fixed
    # sign of the other, so its extremes are at the corners. Else every int.
    def rule(node, a, b):
        corners = [fn(x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
        return _ints(_min(*corners), _max(*corners), b.lo <= 0)

    return rule


def _int_mod(node, a, b):
    # A positive divisor d and a dividend within one period: exact; else [0, d - 1].
    # (rem is mod for a dividend >= 0; else every int.)
    one_period = (b.lo == b.hi) & (jnp.floor_divide(a.lo, jnp.maximum(b.lo, 1))
                                   == jnp.floor_divide(a.hi, jnp.maximum(b.lo, 1)))
    d = jnp.maximum(b.lo, 1)
    lo = jnp.where(one_period, jnp.remainder(a.lo, d), 0)
    hi = jnp.where(one_period, jnp.remainder(a.hi, d), b.hi - 1)
    bad = b.lo <= 0
    if node.op == "rem":
        bad = bad | (a.lo < 0)
    return _ints(lo, hi, bad)


def _min(*xs):
    out = xs[0]
    for x in xs[1:]:
        out = jnp.minimum(out, x)
    return out


def _max(*xs):
    out = xs[0]
    for x in xs[1:]:
        out = jnp.maximum(out, x)
    return out


def _any(*xs):
    out = xs[0]
    for x in xs[1:]:
        out = out | x
    return out


# float32 intervals. A bound computed with rounding is widened by two ulps
# (finite bounds only: -inf stays -inf), so a kernel that rounds differently
# (a fused multiply-add) stays inside; results whose bound is NaN are
# unbounded.

_INF = np.float32(np.inf)


def _widen(lo, hi):
    lo = jnp.where(jnp.isfinite(lo), jnp.nextafter(jnp.nextafter(lo, -_INF), -_INF), lo)
    hi = jnp.where(jnp.isfinite(hi), jnp.nextafter(jnp.nextafter(hi, _INF), _INF), hi)
    return lo, hi


def _floats(lo, hi, nan, widen=True):
    bad = jnp.isnan(lo) | jnp.isnan(hi)
    lo, hi = jnp.where(bad, -_INF, lo), jnp.where(bad, _INF, hi)
    if widen:
        lo, hi = _widen(lo, hi)
    return Floats(lo, hi, nan)


def _can_inf(a, sign):
    return (a.hi == _INF) if sign > 0 else (a.lo == -_INF)


def _float_add(a, b):
    nan = a.nan | b.nan | (_can_inf(a, 1) & _can_inf(b, -1)) | (_can_inf(a, -1) & _can_inf(b, 1))
    return _floats(a.lo + b.lo, a.hi + b.hi, nan)


def _float_neg(a):
    return Floats(-a.hi, -a.lo, a.nan)


def _can_zero(a):
    return (a.lo <= 0) & (a.hi >= 0)


def _can_any_inf(a):
    return _can_inf(a, 1) | _can_inf(a, -1)


def _float_mul(a, b):
    corners = [x * y for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    nan = a.nan | b.nan | (_can_zero(a) & _can_any_inf(b)) | (_can_zero(b) & _can_any_inf(a))
    lo, hi = _min(*corners), _max(*corners)
    some_nan = _any(*(jnp.isnan(c) for c in corners))
    return _floats(jnp.where(some_nan, np.nan, lo), hi, nan)


def _float_div(a, b):
    corners = [x / y for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    zero_den = _can_zero(b)
    nan = (a.nan | b.nan | zero_den | (_can_any_inf(a) & _can_any_inf(b)))
    lo, hi = _min(*corners), _max(*corners)
    unbounded = zero_den | _any(*(jnp.isnan(c) for c in corners))
    return _floats(jnp.where(unbounded, np.nan, lo), hi, nan)


def _monotone(fn, nan_below=None):
    """A nondecreasing float function; NaN for arguments below ``nan_below``."""
    def rule(node, a):
        nan = a.nan if nan_below is None else a.nan | (a.lo < nan_below)
        lo = fn(a.lo) if nan_below is None else fn(jnp.maximum(a.lo, np.float32(nan_below)))
        return _floats(lo, fn(a.hi), nan)

    return rule


def _where(c, x, y):
    take_x, take_y = c.can_true, c.can_false
    if isinstance(x, Bools):
        return Bools((take_x & x.can_true) | (take_y & y.can_true),
                     (take_x & x.can_false) | (take_y & y.can_false))
    # The hull of the branches that can be taken.
    lo = jnp.minimum(jnp.where(take_x, x.lo, _top(x)), jnp.where(take_y, y.lo, _top(y)))
    hi = jnp.maximum(jnp.where(take_x, x.hi, _bottom(x)), jnp.where(take_y, y.hi, _bottom(y)))
    if isinstance(x, Ints):
        return Ints(lo, hi)
    return Floats(lo, hi, (take_x & x.nan) | (take_y & y.nan))


def _top(v):
    return _I32_MAX if isinstance(v, Ints) else _INF


def _bottom(v):
    return _I32_MIN if isinstance(v, Ints) else -_INF


def _compare(op):
    # Tri-state of a comparison of intervals. NaN compares false (true for !=).
    def rule(node, a, b):
        if isinstance(a, Bools):
            return _compare_bools(op, a, b)
        if op in ("lt", "gt"):
            x, y = (a, b) if op == "lt" else (b, a)
            can_true, can_false = x.lo < y.hi, x.hi >= y.lo
        elif op in ("le", "ge"):
            x, y = (a, b) if op == "le" else (b, a)
            can_true, can_false = x.lo <= y.hi, x.hi > y.lo
        else:
            overlap = (a.lo <= b.hi) & (b.lo <= a.hi)
            same_point = (a.lo == a.hi) & (b.lo == b.hi) & (a.lo == b.lo)
            can_true, can_false = (overlap, ~same_point) if op == "eq" else (~same_point, overlap)
        if isinstance(a, Floats):
            nan = a.nan | b.nan
            if op == "ne":
                can_true = can_true | nan
            else:
                can_false = can_false | nan
        return Bools(can_true, can_false)

    return rule


_PY_COMPARE = {"lt": lambda x, y: x < y, "le": lambda x, y: x <= y, "gt": lambda x, y: x > y,
               "ge": lambda x, y: x >= y, "eq": lambda x, y: x == y, "ne": lambda x, y: x != y}


def _compare_bools(op, a, b):
    can = {True: jnp.bool_(False), False: jnp.bool_(False)}
    for x in (False, True):
        for y in (False, True):
            possible = (a.can_true if x else a.can_false) & (b.can_true if y else b.can_false)
            result = _PY_COMPARE[op](x, y)
            can[result] = can[result] | possible
    return Bools(can[True], can[False])


def _cast(node, a):
    to = node.dtype
    if isinstance(a, Bools):
        if to == BOOL:
            return a
        one, zero = (1, 0) if to == I32 else (np.float32(1.0), np.float32(0.0))
        lo = jnp.where(a.can_false, zero, one)
        hi = jnp.where(a.can_true, one, zero)
        return Ints(lo.astype(jnp.int32), hi.astype(jnp.int32)) if to == I32 else Floats(
            lo.astype(jnp.float32), hi.astype(jnp.float32), jnp.bool_(False))
    if to == BOOL:
        can_false = _can_zero(a) if isinstance(a, Floats) else (a.lo <= 0) & (a.hi >= 0)
        can_true = ~((a.lo == 0) & (a.hi == 0))
        if isinstance(a, Floats):
            can_true = can_true | a.nan
        return Bools(can_true, can_false)
    if isinstance(a, Ints):
        if to == I32:
            return a
        return Floats(a.lo.astype(jnp.float32), a.hi.astype(jnp.float32), jnp.bool_(False))
    if to == F32:
        return a
    # float -> int rounds toward zero (monotone) where the value fits int32.
    fits = ~a.nan & (a.lo > -2.0**31) & (a.hi < 2.0**31)
    lo = jnp.where(fits, jnp.trunc(jnp.clip(a.lo, -2.0**31 + 128, 2.0**31 - 128)), 0)
    hi = jnp.where(fits, jnp.trunc(jnp.clip(a.hi, -2.0**31 + 128, 2.0**31 - 128)), 0)
    return _ints(lo.astype(jnp.int32), hi.astype(jnp.int32), ~fits)


def _by_dtype(int_rule, float_rule):
    def rule(node, *args):
        return (int_rule if node.dtype == I32 else float_rule)(*args)

    return rule


def _extreme(f):
    def rule(node, a, b):
        if isinstance(a, Ints):
            return Ints(f(a.lo, b.lo), f(a.hi, b.hi))
        return Floats(f(a.lo, b.lo), f(a.hi, b.hi), a.nan | b.nan)

    return rule


def _logic(op):
    def rule(node, *args):
        if op == "not":
            (a,) = args
            return Bools(a.can_false, a.can_true)
        a, b = args
        if op == "and":
            return Bools(a.can_true & b.can_true, a.can_false | b.can_false)
        return Bools(a.can_true | b.can_true, a.can_false & b.can_false)

    return rule


def _float_abs(a):
    lo = jnp.where(_can_zero(a), np.float32(0.0), jnp.minimum(jnp.abs(a.lo), jnp.abs(a.hi)))
    return Floats(lo, jnp.maximum(jnp.abs(a.lo), jnp.abs(a.hi)), a.nan)


def _sign(node, a):
    if isinstance(a, Ints):
        return Ints(jnp.sign(a.lo), jnp.sign(a.hi))
    return Floats(jnp.sign(a.lo), jnp.sign(a.hi), a.nan)


# Integer bit operations. Bounds from the arguments' signs: x & y with x >= 0
# lies in [0, x]; x | y and x ^ y of non-negative values set no bit above the
# highest either can have; ~x is -x - 1. Shifts are monotone in the shifted
# value and, for its sign, in the amount; an amount outside [0, 31] gives what
# XLA gives (0, or the sign for >>). Cases left over bound nothing.


def _ones_through(x):
    """For ``x >= 0``: every bit up to x's highest set, 2**k - 1 >= x."""
    for s in (1, 2, 4, 8, 16):
        x = x | (x >> s)
    return x


def _bitwise_and(node, a, b):
    a_pos, b_pos = a.lo >= 0, b.lo >= 0
    pos_hi = jnp.where(a_pos & b_pos, jnp.minimum(a.hi, b.hi), jnp.where(a_pos, a.hi, b.hi))
    # Both negative: the sign stays and no bit is added, so at most the smaller.
    neg_hi = jnp.where((a.hi < 0) & (b.hi < 0), jnp.minimum(a.hi, b.hi), _I32_MAX)
    some_pos = a_pos | b_pos
    return Ints(jnp.where(some_pos, 0, _I32_MIN).astype(jnp.int32),
                jnp.where(some_pos, pos_hi, neg_hi).astype(jnp.int32))


def _bitwise_or(node, a, b):
    pos = (a.lo >= 0) & (b.lo >= 0)
    a_neg, b_neg = a.hi < 0, b.hi < 0
    # A negative argument keeps the sign, and bits added to a value of one sign raise it.
    neg_lo = jnp.where(a_neg & b_neg, jnp.maximum(a.lo, b.lo),
                       jnp.where(a_neg, a.lo, jnp.where(b_neg, b.lo, _I32_MIN)))
    lo = jnp.where(pos, jnp.maximum(a.lo, b.lo), neg_lo)
    hi = jnp.where(pos, _ones_through(jnp.maximum(a.hi, b.hi)),
                   jnp.where(a_neg | b_neg, -1, _I32_MAX))
    return Ints(lo.astype(jnp.int32), hi.astype(jnp.int32))


def _bitwise_xor(node, a, b):
    pos = (a.lo >= 0) & (b.lo >= 0)
    hi = jnp.where(pos, _ones_through(jnp.maximum(a.hi, b.hi)), _I32_MAX)
    return Ints(jnp.where(pos, 0, _I32_MIN).astype(jnp.int32), hi.astype(jnp.int32))


def _invert(node, a):
    return Ints(jnp.invert(a.hi), jnp.invert(a.lo))  # -x - 1: decreasing, never wraps


def _amounts(b):
    """``(lo, hi, empty, outside)``: the shift amounts in [0, 31] that ``b`` can
    take (none where ``empty``), and whether it can take one outside."""
    lo, hi = jnp.clip(b.lo, 0, 31), jnp.clip(b.hi, 0, 31)
    return lo, hi, (b.hi < 0) | (b.lo > 31), (b.lo < 0) | (b.hi > 31)


def _right_shift(node, a, b):
    # An amount outside [0, 31] fills with the sign, as a shift by 31 does.
    lo, hi, empty, outside = _amounts(b)
    lo, hi = jnp.where(empty, 31, lo), jnp.where(outside, 31, hi)
    return Ints(jnp.minimum(a.lo >> lo, a.lo >> hi), jnp.maximum(a.hi >> lo, a.hi >> hi))


def _shift_right_logical(node, a, b):
    # Of a value >= 0 as >>, with 0 for an amount outside [0, 31]; a negative value
    # becomes a large positive one (bounded by nothing here).
    lo, hi, empty, outside = _amounts(b)
    pos = a.lo >= 0
    out_lo = jnp.where(empty | outside, 0, a.lo >> hi)
    out_hi = jnp.where(empty, 0, a.hi >> lo)
    return Ints(jnp.where(pos, out_lo, _I32_MIN).astype(jnp.int32),
                jnp.where(pos, out_hi, _I32_MAX).astype(jnp.int32))


def _left_shift(node, a, b):
    # x * 2**n: the extremes at the corners, none of which wraps where the largest
    # amount wraps neither end; an amount outside [0, 31] gives 0.
    lo, hi, empty, outside = _amounts(b)
    corners = [x << n for x in (a.lo, a.hi) for n in (lo, hi)]
    wrapped = ~empty & (((a.lo << hi) >> hi != a.lo) | ((a.hi << hi) >> hi != a.hi))
    out_lo = jnp.where(empty, 0, _min(*corners))
    out_hi = jnp.where(empty, 0, _max(*corners))
    out_lo = jnp.where(outside, jnp.minimum(out_lo, 0), out_lo)
    out_hi = jnp.where(outside, jnp.maximum(out_hi, 0), out_hi)
    return _ints(out_lo.astype(jnp.int32), out_hi.astype(jnp.int32), wrapped)


# op -> rule(node, *abstract arguments). An op not listed bounds nothing.
RULES = {
    "add": _by_dtype(_int_add, _float_add),
    "offset": lambda node, a, b: _int_add(a, b),
    "sub": _by_dtype(_int_sub, lambda a, b: _float_add(a, _float_neg(b))),
    "mul": _by_dtype(_int_mul, _float_mul),
    "neg": _by_dtype(_int_neg, _float_neg),
    "abs": _by_dtype(_int_abs, _float_abs),
    "sign": _sign,
    "div": lambda node, a, b: _float_div(a, b),
    "floordiv": lambda node, a, b: (_int_div(jnp.floor_divide)(node, a, b)
                                    if node.dtype == I32 else every(F32)),
    "trunc_div": _int_div(lambda x, y: lax.div(x, y)),
    "mod": lambda node, a, b: _int_mod(node, a, b) if node.dtype == I32 else every(F32),
    "rem": lambda node, a, b: _int_mod(node, a, b) if node.dtype == I32 else every(F32),
    "max": _extreme(jnp.maximum),
    "min": _extreme(jnp.minimum),
    "where": lambda node, c, x, y: _where(c, x, y),
    "and": _logic("and"),
    "or": _logic("or"),
    "not": _logic("not"),
    "bitwise_and": _bitwise_and,
    "bitwise_or": _bitwise_or,
    "bitwise_xor": _bitwise_xor,
    "invert": _invert,
    "left_shift": _left_shift,
    "right_shift": _right_shift,
    "shift_right_logical": _shift_right_logical,
    "f32": _cast,
    "i32": _cast,
    "bool": _cast,
    "exp": _monotone(jnp.exp),
    "exp2": _monotone(jnp.exp2),
    "expm1": _monotone(jnp.expm1),
    "tanh": _monotone(jnp.tanh),
    "sigmoid": _monotone(lax.logistic),
    "atan": _monotone(jnp.arctan),
    "erf": _monotone(lax.erf),
    "floor": _monotone(jnp.floor),
    "ceil": _monotone(jnp.ceil),
    "relu": _monotone(jax.nn.relu),
    "log": _monotone(jnp.log, 0.0),
    "log2": _monotone(jnp.log2, 0.0),
    "log1p": _monotone(jnp.log1p, -1.0),
    "sqrt": _monotone(jnp.sqrt, 0.0),
    # with_grad computes its first argument.
    "with_grad": lambda node, value, *rest: value,
    MATERIALIZE: lambda node, a: a,
}
RULES.update({op: _compare(op) for op in ("lt", "le", "gt", "ge", "eq", "ne")})
# Ops whose rule bounds a mix of q_idx and kv_idx tightly (interval arithmetic
# is exact for each index used once); a mask condition mixing them through
# anything else is evaluated per tile when ``exact="auto"`` (the bit operations'
# rules bound by signs and highest bits: loose for a mix of the two).
BIT_OPS = frozenset(("bitwise_and", "bitwise_or", "bitwise_xor", "invert", "left_shift",
                     "right_shift", "shift_right_logical"))
TIGHT = frozenset(RULES) - {"mod", "rem", "floordiv", "trunc_div", "with_grad"} - BIT_OPS


# --- bounds of concrete values ------------------------------------------------


def value_parts(dtype, value, ok=True):
    """The arrays whose reductions bound ``value`` (entries where ``ok`` is
    false left out): any/any, min/max, min/max/any-NaN."""
    if dtype == BOOL:
        return value & ok, ~value & ok
    if dtype == I32:
        return jnp.where(ok, value, _I32_MAX), jnp.where(ok, value, _I32_MIN)
    nan = jnp.isnan(value)
    real = ~nan & ok
    return jnp.where(real, value, _INF), jnp.where(real, value, -_INF), nan & ok


def reduce_parts(dtype, parts, axis, keepdims=True):
    """``value_parts`` reduced over ``axis``: still the parts of one bound."""
    ops = {BOOL: (jnp.any, jnp.any), I32: (jnp.min, jnp.max),
           F32: (jnp.min, jnp.max, jnp.any)}[dtype]
    return tuple(op(x, axis=axis, keepdims=keepdims) for op, x in zip(ops, parts))


def from_parts(dtype, parts):
    """The abstract value of ``dtype`` whose fields are the reduced ``parts``."""
    return {BOOL: Bools, I32: Ints, F32: Floats}[dtype](*parts)
