"""Block sparsity: which (query block, key block) tiles of a call a kernel visits.

A :class:`BlockMap` is computed inside the jitted program (it may depend on
captured arrays, e.g. document ids) and read by block-sparse kernels: per
query block, the key blocks to visit in ascending order, and whether each is
*full* (the mask holds on every entry, so the kernel may skip evaluating it);
and the transpose, per key block the query blocks (for dK and dV). Blocks not
listed are *empty*: every score in them is masked, so they contribute nothing.

Leading axes are ``[Bm, Hm]`` with ``Bm`` in ``{1, B}`` and ``Hm`` in
``{1, Hq}``: 1 where the mask does not depend on the batch or the head.

``block_map`` derives the map of a mod from its IR (``classify_tiles`` the
tile classes, ``block_lists`` the lists); on full tiles a kernel computes
``when_full(expr)``, the mod without its mask conditions. ``dense_block_map``
visits everything and is right for any mod.

    >>> m = dense_block_map(batch=1, heads=1, sq=256, skv=384, block_q=128, block_kv=128)
    >>> m.q_counts.tolist(), m.q_blocks[0, 0, 1].tolist()
    ([[[3, 3]]], [0, 1, 2])
    >>> m.kv_counts.tolist(), m.kv_blocks[0, 0, 2].tolist()
    ([[[2, 2, 2]]], [0, 1])
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scoremod.dsl import ir
from scoremod.dsl.evaluate import evaluate
from scoremod.dsl.ir import (BOOL, CONST, COTANGENT, F32, I32, LOAD, MATERIALIZE, OPERAND, SCORE,
                             VAR, Node)
from scoremod.errors import ScoreModValueError


class BlockMap(NamedTuple):
    """The tiles a kernel visits (a pytree of int32/bool arrays).

    ``q_blocks[b, h, i, :q_counts[b, h, i]]`` are the key blocks of query block
    ``i`` in ascending order; entries past the count repeat the last valid one
    (a kernel that prefetches the next block re-reads a block it has, instead
    of an arbitrary one). ``kv_blocks``/``kv_counts``/``kv_full`` are the same
    per key block, listing query blocks."""

    q_counts: jnp.ndarray  # int32 [Bm, Hm, nq]
    q_blocks: jnp.ndarray  # int32 [Bm, Hm, nq, nk]
    q_full: jnp.ndarray  # bool  [Bm, Hm, nq, nk], aligned with q_blocks
    kv_counts: jnp.ndarray  # int32 [Bm, Hm, nk]
    kv_blocks: jnp.ndarray  # int32 [Bm, Hm, nk, nq]
    kv_full: jnp.ndarray  # bool  [Bm, Hm, nk, nq], aligned with kv_blocks

    @property
    def block_counts(self):
        """(query blocks, key blocks) of the call."""
        return self.q_blocks.shape[-2], self.kv_blocks.shape[-2]


def num_blocks(size: int, block: int) -> int:
    """Blocks of ``block`` entries that cover ``size`` (the last may be partial)."""
    return -(-size // block)


def dense_block_map(*, batch: int = 1, heads: int = 1, sq: int, skv: int, block_q: int,
                    block_kv: int) -> BlockMap:
    """Every tile visited, none full: correct for any mod (a kernel then
    evaluates the whole mod everywhere)."""
    nq, nk = num_blocks(sq, block_q), num_blocks(skv, block_kv)
    lead = (batch, heads)
    return BlockMap(
        q_counts=jnp.full(lead + (nq,), nk, jnp.int32),
        q_blocks=jnp.broadcast_to(jnp.arange(nk, dtype=jnp.int32), lead + (nq, nk)),
        q_full=jnp.zeros(lead + (nq, nk), jnp.bool_),
        kv_counts=jnp.full(lead + (nk,), nq, jnp.int32),
        kv_blocks=jnp.broadcast_to(jnp.arange(nq, dtype=jnp.int32), lead + (nk, nq)),
        kv_full=jnp.zeros(lead + (nk, nq), jnp.bool_),
    )


# --- the tile analysis --------------------------------------------------------
#
# Every node of the mod gets an abstract value per tile: for ints an interval,
# for bools whether it can be true and whether it can be false, for floats an
# interval and whether it can be NaN. Arrays broadcast to [Bm, Hm, nq, nk].
#
# Nodes that do not depend on the score and read at most one of q_idx and
# kv_idx ("separable") are evaluated exactly on every position of their axis
# (O(B*H*S) work) and reduced per block: the ids of a document mask, q // 128
# of a chunked mask, the indices themselves. Nodes mixing q_idx and kv_idx,
# or reading the score, combine their arguments' values by the rules of
# ``RULES`` (interval arithmetic; for q_idx - kv_idx it is exact at the
# corners of the tile). An op without a rule bounds nothing (every value).
# Score-free nodes the classes hinge on (mask conditions, a bias added to the
# score) that mix q_idx and kv_idx through ops the rules bound badly
# (remainders, loads at both indices) are evaluated on every entry of every
# tile instead (``exact``), a batch of query-block rows at a time.

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


def _every(dtype):
    if dtype == I32:
        return Ints(jnp.int32(ir.INT32_MIN), jnp.int32(ir.INT32_MAX))
    if dtype == BOOL:
        return Bools(jnp.bool_(True), jnp.bool_(True))
    return Floats(jnp.float32(-np.inf), jnp.float32(np.inf), jnp.bool_(True))


def _constant(node):
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
                                    if node.dtype == I32 else _every(F32)),
    "trunc_div": _int_div(lambda x, y: lax.div(x, y)),
    "mod": lambda node, a, b: _int_mod(node, a, b) if node.dtype == I32 else _every(F32),
    "rem": lambda node, a, b: _int_mod(node, a, b) if node.dtype == I32 else _every(F32),
    "max": _extreme(jnp.maximum),
    "min": _extreme(jnp.minimum),
    "where": lambda node, c, x, y: _where(c, x, y),
    "and": _logic("and"),
    "or": _logic("or"),
    "not": _logic("not"),
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
# anything else is evaluated per tile when ``exact="auto"``.
_TIGHT = frozenset(RULES) - {"mod", "rem", "floordiv", "trunc_div", "with_grad"}


# --- the driver ---------------------------------------------------------------

_EXACT = ("auto", "always", "never")
_JNP = {F32: jnp.float32, I32: jnp.int32, BOOL: jnp.bool_}
# Elements of one step of the per-tile evaluation (query blocks batched to about this).
_TILE_STEP_ELEMENTS = 2**24


def _dependencies(expr) -> dict:
    """The variables (score, b, h, q_idx, kv_idx, dP) each node reads."""
    deps = {}
    for n in ir.toposort(expr):
        if n.op == VAR:
            deps[n] = frozenset((n.attr,))
        else:
            deps[n] = frozenset().union(*(deps[a] for a in n.args))
    return deps


def _reads_score(d):
    return SCORE in d or COTANGENT in d


def _separable(d):
    """Evaluated exactly along one axis: no score, not both q_idx and kv_idx."""
    return not _reads_score(d) and not ("q_idx" in d and "kv_idx" in d)


def _is_neg_inf(node):
    return node.op == CONST and node.dtype == F32 and node.attr == -math.inf


def is_difference(node) -> bool:
    """``q_idx - kv_idx`` or ``kv_idx - q_idx``."""
    return (node.op == "sub" and all(a.op == VAR for a in node.args)
            and {a.attr for a in node.args} == {"q_idx", "kv_idx"})


def reads_difference_only(*nodes) -> bool:
    """Whether ``nodes`` read both q_idx and kv_idx, and only as ``q_idx - kv_idx``
    (or its negation): a relative position."""
    if not {"q_idx", "kv_idx"} <= ir.variables(*nodes):
        return False
    outside = {n.attr for n in ir.toposort(*nodes, stop=is_difference) if n.op == VAR}
    return not outside & {"q_idx", "kv_idx"}


def difference_form(node) -> Node | None:
    """``node`` as a function of ``b``, ``h`` and ``q_idx`` standing for ``q_idx -
    kv_idx``, where it reads the two indices only as that difference (or its
    negation): a relative position, the same along each diagonal of the score
    matrix (``bias[h, q_idx - kv_idx + S - 1]``); else None.

        >>> import jax.numpy as jnp, scoremod
        >>> t = jnp.zeros((4, 15))
        >>> mod = scoremod.trace(lambda s, b, h, q, k: s + t[h, k - q + 7])
        >>> difference_form(mod.expr.args[1])  # jax.numpy wraps negative indices
        <f32 c0[h, where(-q_idx + 7 < 0, -q_idx + 7 + 15, -q_idx + 7)]>
    """
    if not reads_difference_only(node):
        return None
    q = ir.var("q_idx")
    return ir.substitute(node, {n: q if n.args[0] is q else ir.build("neg", q)
                                for n in ir.toposort(node) if is_difference(n)})


def mask_conditions(expr) -> tuple:
    """``(conditions, conflicting)``: the score-free boolean nodes the mod masks
    with, each with the value it must have for an entry to be kept
    (``where(c, x, -inf)`` needs c true, ``where(c, -inf, x)`` needs c false;
    conjunctions of the first and disjunctions of the second are split).
    ``conflicting``: some node must be both, so no tile is ever full."""
    deps = _dependencies(expr)
    conds, conflicting = {}, False

    def need(c, value):
        nonlocal conflicting
        if c.op == "not":
            need(c.args[0], not value)
        elif (c.op == "and" and value) or (c.op == "or" and not value):
            for a in c.args:
                need(a, value)
        elif c.op != CONST and not _reads_score(deps[c]):
            if conds.setdefault(c, value) != value:
                conflicting = True

    for n in ir.toposort(expr):
        if n.op == "where":
            c, x, y = n.args
            if _is_neg_inf(y):
                need(c, True)
            elif _is_neg_inf(x):
                need(c, False)
    return conds, conflicting


def mask_from_data(expr) -> Node | None:
    """The first mask condition that reads captured arrays and both the query's
    and the key's index (``doc[b, q_idx] == doc[b, kv_idx]``, ``kv_idx >=
    start[doc[q_idx]]``), or None: a mask whose empty tiles only the values
    decide (packed documents empty most of them).

        >>> import jax.numpy as jnp, scoremod
        >>> doc = jnp.array([0, 0, 1, 1])
        >>> mod = scoremod.trace(lambda s, b, h, q, k: jnp.where(doc[q] == doc[k], s, -jnp.inf))
        >>> mask_from_data(mod.expr)
        <bool c0[q_idx] == c0[kv_idx]>
    """
    conds, _ = mask_conditions(expr)
    deps = _dependencies(expr)
    for c in conds:
        if {"q_idx", "kv_idx"} <= deps[c] and any(n.op == LOAD for n in ir.toposort(c)):
            return c
    return None


def when_full(expr: Node) -> Node:
    """``expr`` with its mask conditions (``mask_conditions``) replaced by the
    values a full tile guarantees: what a kernel computes on full tiles.

        >>> import jax.numpy as jnp, scoremod
        >>> mod = scoremod.trace(lambda s, b, h, q, k: jnp.where(q >= k, jnp.tanh(s), -jnp.inf))
        >>> when_full(mod.expr)
        <f32 tanh(score)>
    """
    conds, conflicting = mask_conditions(expr)
    if conflicting or not conds:
        return expr
    return ir.substitute(expr, {c: ir.const(v, BOOL) for c, v in conds.items()})


def map_axes(expr, problem) -> tuple:
    """``(Bm, Hm)``: the batch and head extents the map keeps, 1 where no mask
    condition reads ``b`` (``h``). Other uses of b and h (an ALiBi slope) are
    bounded over all their values."""
    conds, _ = mask_conditions(expr)
    deps = _dependencies(expr)
    read = frozenset().union(*(deps[c] for c in conds))
    return (problem.b if "b" in read else 1, problem.hq if "h" in read else 1)


def _operand_values(expr, operands) -> dict:
    nodes = ir.operands_of(expr)
    if isinstance(operands, dict):
        return dict(operands)
    operands = tuple(operands or ())
    if len(operands) != len(nodes):
        raise ScoreModValueError(f"the mod has {len(nodes)} operands, {len(operands)} were given")
    return {n.attr[0]: v for n, v in zip(nodes, operands)}


class _Tiles:
    """Shapes of one call's tiles and the exact reductions onto them."""

    def __init__(self, problem, block_q, block_kv, bm, hm, operands):
        self.problem, self.block_q, self.block_kv = problem, block_q, block_kv
        self.nq, self.nk = num_blocks(problem.sq, block_q), num_blocks(problem.skv, block_kv)
        self.bm, self.hm, self.operands = bm, hm, operands

    def evaluate(self, node, b, h, q, kv):
        inputs = {"b": b, "h": h, "q_idx": q, "kv_idx": kv}
        return evaluate(node, inputs, self.operands)

    def _along(self, node, deps, q, kv, size, ok=True) -> tuple:
        """The parts of ``node`` at query and key positions ``q`` and ``kv`` (``[1, 1,
        size]`` arrays or scalars), for every batch and head it reads, reduced over
        those the map does not keep: ``[Bm or 1, Hm or 1, size]`` each (entries where
        ``ok`` is false left out)."""
        p = self.problem
        b = jnp.arange(p.b if "b" in deps else 1, dtype=jnp.int32)[:, None, None]
        h = jnp.arange(p.hq if "h" in deps else 1, dtype=jnp.int32)[None, :, None]
        value = jnp.broadcast_to(self.evaluate(node, b, h, q, kv),
                                 (b.shape[0], h.shape[1], size))
        parts = _parts(node.dtype, value, ok)
        if "b" in deps and self.bm == 1:
            parts = _reduce(node.dtype, parts, 0)
        if "h" in deps and self.hm == 1:
            parts = _reduce(node.dtype, parts, 1)
        return parts

    def separable(self, node, deps) -> tuple:
        """The exact value of a separable node, reduced onto the tiles."""
        p = self.problem
        seq_axis = "q_idx" if "q_idx" in deps else ("kv_idx" if "kv_idx" in deps else None)
        size = {"q_idx": p.sq, "kv_idx": p.skv, None: 1}[seq_axis]
        seq = jnp.arange(size, dtype=jnp.int32)[None, None, :]
        zero = jnp.zeros((1, 1, 1), jnp.int32)
        parts = self._along(node, deps, seq if seq_axis == "q_idx" else zero,
                            seq if seq_axis == "kv_idx" else zero, size)
        if seq_axis is not None:
            block = self.block_q if seq_axis == "q_idx" else self.block_kv
            n = num_blocks(size, block)
            pad = [(0, 0), (0, 0), (0, n * block - size)]
            parts = tuple(jnp.pad(x, pad, mode="edge").reshape(x.shape[:2] + (n, block))
                          for x in parts)
            parts = _reduce(node.dtype, parts, 3, keepdims=False)
        where = 2 if seq_axis == "kv_idx" else 3  # the tile axis it does not vary along
        return _abstract(node.dtype, tuple(jnp.expand_dims(x, where) for x in parts))

    def load_anywhere(self, node) -> tuple:
        """Every value of the array a load reads (its indices are not bounded)."""
        array = jnp.asarray(self.operands[node.args[0].attr[0]]).astype(_JNP[node.dtype])
        parts = _parts(node.dtype, array.reshape(1, -1))
        return _abstract(node.dtype, _reduce(node.dtype, parts, 1, keepdims=False))

    def diagonal(self, node, deps) -> tuple:
        """A node that reads q_idx and kv_idx only as q_idx - kv_idx
        (``difference_form``), bounded per tile from its values on the tile's
        diagonals: evaluated once per diagonal (at q_idx = the difference,
        kv_idx = 0), O((Sq + Skv) * B * H), then reduced over the diagonals each
        tile crosses (its real entries': padded rows and columns left out) in
        chunks of gcd(block_q, block_kv), so a few per tile; a chunk may reach up
        to gcd - 1 diagonals past the tile's: looser, never wrong."""
        p, bq, bk = self.problem, self.block_q, self.block_kv
        g = math.gcd(bq, bk)
        lo = -self.nk * bk  # below the last key against the first query
        chunks = (self.nq * bq - lo) // g
        diff = lo + jnp.arange(chunks * g, dtype=jnp.int32)[None, None, :]
        real = (diff > -p.skv) & (diff < p.sq)  # some real query and key are that far apart
        parts = self._along(node, deps, diff, jnp.int32(0), chunks * g, real)
        parts = _reduce(node.dtype, tuple(x.reshape(x.shape[:2] + (chunks, g)) for x in parts),
                        3, keepdims=False)
        # Tile (i, j)'s real entries see q - kv from its first query less its last
        # real key to its last real query less its first key.
        q0, k0 = np.arange(self.nq)[:, None] * bq, np.arange(self.nk)[None, :] * bk
        first = (q0 - (np.minimum(k0 + bk, p.skv) - 1) - lo) // g
        last = (np.minimum(q0 + bq, p.sq) - 1 - k0 - lo) // g
        span = int((last - first).max()) + 1
        index = np.minimum(first[..., None] + np.arange(span), last[..., None])
        parts = tuple(x[:, :, index] for x in parts)  # [Bm, Hm, nq, nk, span]
        return _abstract(node.dtype, _reduce(node.dtype, parts, 4, keepdims=False))

    def per_tile(self, nodes, deps) -> list:
        """Score-free nodes evaluated on every entry of every tile, reduced per
        tile: one (batch, head, query block) row of tiles per step (a node
        reading b or h where the map keeps no such axis, over all of them),
        steps batched to about ``_TILE_STEP_ELEMENTS`` entries."""
        p, bq, bk, nk = self.problem, self.block_q, self.block_kv, self.nk
        kv = jnp.arange(nk * bk, dtype=jnp.int32)
        kv_ok = (kv < p.skv).reshape(nk, bk)
        every_b = "b" if self.bm == 1 and p.b > 1 else None
        every_h = "h" if self.hm == 1 and p.hq > 1 else None
        spread = {n: ((p.b if every_b in deps[n] else 1), (p.hq if every_h in deps[n] else 1))
                  for n in nodes}

        def step(row):
            b, h, i = row
            q = i * bq + jnp.arange(bq, dtype=jnp.int32)
            ok = (q < p.sq)[:, None, None] & kv_ok[None]  # [bq, nk, bk]
            out = []
            for node in nodes:
                nb, nh = spread[node]
                bs = jnp.arange(nb, dtype=jnp.int32)[:, None, None, None] if nb > 1 else b
                hs = jnp.arange(nh, dtype=jnp.int32)[None, :, None, None] if nh > 1 else h
                v = self.evaluate(node, bs, hs, q[:, None], kv[None, :])
                v = jnp.broadcast_to(v, (nb, nh, bq, nk * bk)).reshape(nb, nh, bq, nk, bk)
                parts = _parts(node.dtype, v, ok)
                out.append(_reduce(node.dtype, parts, (0, 1, 2, 4), keepdims=False))
            return out

        rows = [x.reshape(-1).astype(jnp.int32)
                for x in jnp.indices((self.bm, self.hm, self.nq))]
        widest = max(nb * nh for nb, nh in spread.values())
        batch = max(1, _TILE_STEP_ELEMENTS // (widest * bq * nk * bk))
        stacked = lax.map(step, tuple(rows), batch_size=batch)
        shape = (self.bm, self.hm, self.nq, nk)
        return [_abstract(n.dtype, tuple(x.reshape(shape) for x in parts))
                for n, parts in zip(nodes, stacked)]


def _parts(dtype, value, ok=True):
    """The arrays whose reductions bound ``value`` (entries where ``ok`` is
    false left out): any/any, min/max, min/max/any-NaN."""
    if dtype == BOOL:
        return value & ok, ~value & ok
    if dtype == I32:
        return jnp.where(ok, value, _I32_MAX), jnp.where(ok, value, _I32_MIN)
    nan = jnp.isnan(value)
    real = ~nan & ok
    return jnp.where(real, value, _INF), jnp.where(real, value, -_INF), nan & ok


def _reduce(dtype, parts, axis, keepdims=True):
    ops = {BOOL: (jnp.any, jnp.any), I32: (jnp.min, jnp.max),
           F32: (jnp.min, jnp.max, jnp.any)}[dtype]
    return tuple(op(x, axis=axis, keepdims=keepdims) for op, x in zip(ops, parts))


def _abstract(dtype, parts):
    return {BOOL: Bools, I32: Ints, F32: Floats}[dtype](*parts)


def _mixed_uses(expr, conds, deps) -> list:
    """Score-free nodes mixing q_idx and kv_idx that the classes hinge on: the
    mask conditions, and the score-free arguments of nodes reading the score
    (a captured bias of -inf blocks added to it)."""
    out = {c: None for c in conds}
    for n in ir.toposort(expr):
        if _reads_score(deps[n]):
            out.update((a, None) for a in n.args if not _reads_score(deps[a]))
    return [n for n in out if not _separable(deps[n]) and n.op != CONST]


def _tight(cond, deps) -> bool:
    """Whether the rules bound ``cond`` well: every node of it mixing q_idx and
    kv_idx is an op of ``_TIGHT``."""
    for n in ir.toposort(cond, stop=lambda m: _separable(deps[m])):
        if not _separable(deps[n]) and n.op not in _TIGHT:
            return False
    return True


def classify_tiles(expr, operands, problem, block_q: int, block_kv: int, *,
                   exact: str = "auto") -> tuple:
    """``(visited, full)``, bool ``[Bm, Hm, nq, nk]``: the tiles where the mod
    is not -inf everywhere (whatever the finite score), and those where its
    mask conditions hold everywhere (there it equals ``when_full(expr)``).

    ``exact`` says which score-free nodes mixing q_idx and kv_idx (mask
    conditions, and score-free arguments of nodes reading the score, such as
    a captured bias) are evaluated on every entry of every tile, a batch of
    (batch, head, query block) rows per step of about 2**24 entries
    (O(B*H*Sq*Skv) work): "auto" those the interval rules bound loosely
    (remainders, loads indexed by both), "always" all, "never" none. Under
    "auto", those of them reading q_idx and kv_idx only as their difference
    (``difference_form``: a relative table) are evaluated once per diagonal.
    Everything else costs O(B*H*S) (separable parts) plus O(Bm*Hm*nq*nk)
    (the rules)."""
    if exact not in _EXACT:
        raise ScoreModValueError(f"exact={exact!r}; expected one of {_EXACT}")
    operands = _operand_values(expr, operands)
    deps = _dependencies(expr)
    conds, conflicting = mask_conditions(expr)
    bm, hm = map_axes(expr, problem)
    tiles = _Tiles(problem, block_q, block_kv, bm, hm, operands)
    exact_nodes = [n for n in _mixed_uses(expr, conds, deps)
                   if exact == "always" or (exact == "auto" and not _tight(n, deps))]
    # Relative positions among them (a table at q_idx - kv_idx): bounded per tile
    # from their diagonals instead, O(S) (a table's -inf entries still skip tiles).
    diagonal = [] if exact == "always" else [
        n for n in exact_nodes if difference_form(n) is not None]
    exact_nodes = [n for n in exact_nodes if n not in diagonal]
    values = dict(zip(exact_nodes, tiles.per_tile(exact_nodes, deps))) if exact_nodes else {}
    values.update({n: tiles.diagonal(n, deps[n]) for n in diagonal})

    def leaf(n):
        return n in values or n.op == CONST or _separable(deps[n]) or n.op not in RULES

    for n in ir.toposort(expr, *conds, stop=leaf):
        if n in values or n.op == OPERAND:
            continue
        if n.op == CONST:
            values[n] = _constant(n)
        elif _separable(deps[n]):
            values[n] = tiles.separable(n, deps[n])
        elif n.op == VAR:  # the score (or dP): any finite float
            values[n] = Floats(jnp.float32(-F32_MAX), jnp.float32(F32_MAX), jnp.bool_(False))
        elif n.op == LOAD:
            values[n] = tiles.load_anywhere(n)
        elif n.op in RULES:
            values[n] = RULES[n.op](n, *(values[a] for a in n.args))
        else:
            values[n] = _every(n.dtype)
    shape = (bm, hm, tiles.nq, tiles.nk)
    out = values[expr]
    visited = ~((out.hi == -_INF) & ~out.nan)
    full = jnp.bool_(not conflicting)
    for c, value in conds.items():
        full = full & ~(values[c].can_false if value else values[c].can_true)
    visited = jnp.broadcast_to(visited, shape)
    return visited, jnp.broadcast_to(full, shape) & visited


def block_lists(visited, full) -> BlockMap:
    """The BlockMap of tile classes ``visited``/``full`` ([Bm, Hm, nq, nk])."""
    q = _lists(visited, full)
    kv = _lists(jnp.swapaxes(visited, -1, -2), jnp.swapaxes(full, -1, -2))
    return BlockMap(*q, *kv)


def _lists(visited, full):
    n = visited.shape[-1]
    counts = jnp.sum(visited, axis=-1, dtype=jnp.int32)
    # Each visited block goes to its rank among the visited ones of its row (a
    # scatter, cheaper than a sort); the rest fall off the end.
    rank = jnp.where(visited, jnp.cumsum(visited, axis=-1, dtype=jnp.int32) - 1, n)
    index = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), visited.shape)
    rows = jnp.indices(visited.shape[:-1], sparse=True)
    packed = jnp.zeros(visited.shape, jnp.int32).at[(*(r[..., None] for r in rows), rank)].set(
        index, mode="drop")
    last = jnp.maximum(counts - 1, 0)[..., None]
    blocks = jnp.take_along_axis(packed, jnp.minimum(jnp.arange(n, dtype=jnp.int32), last), -1)
    return counts, blocks, jnp.take_along_axis(full, blocks, -1)


def block_map(expr, operands, problem, block_q: int, block_kv: int, *,
              exact: str = "auto") -> BlockMap:
    """The tiles a block-sparse kernel visits for ``expr`` on ``problem``,
    computed from the IR with jax.numpy (jit-able: ``operands``, the captured
    arrays by name or in ``ir.operands_of`` order, may be traced). Full
    tiles run ``when_full(expr)``. See ``classify_tiles`` for ``exact``
    and the cost.

        >>> import jax.numpy as jnp, scoremod
        >>> from scoremod.lowering.problem import Problem
        >>> causal = scoremod.trace(lambda s, b, h, q, k: jnp.where(q >= k, s, -jnp.inf))
        >>> m = block_map(causal.expr, (), Problem(2, 384, 384, 4, 4, 64, 64, "float16"), 128, 128)
        >>> m.q_counts.tolist(), m.q_blocks[0, 0, 1].tolist(), m.q_full[0, 0, 2].tolist()
        ([[[1, 2, 3]]], [0, 1, 1], [True, True, False])
    """
    return block_lists(*classify_tiles(expr, operands, problem, block_q, block_kv, exact=exact))
