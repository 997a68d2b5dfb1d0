"""Mods that are pure diagonal-band masks run on cuDNN's native mask.

A mod of the form ``where(band(q_idx, kv_idx), score, -inf)``, where the band
is a conjunction of comparisons linear in ``kv_idx - q_idx`` (causal, sliding
window, their bottom-right variants), computes plain attention under a mask.
cuDNN's own diagonal-band mask gives the same numbers and skips the tiles it
masks, where a score_mod mask visits every tile.

    >>> import jax.numpy as jnp, scoremod
    >>> from scoremod.lowering.cudnn.rules import canonical
    >>> window = scoremod.trace(lambda s, b, h, q, k: jnp.where((q >= k) & (q - k < 256), s, -jnp.inf))
    >>> native_band(canonical(window.expr), sq=1024, skv=1024)
    Band(alignment='TOP_LEFT', left_bound=256, right_bound=0)
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

from scoremod.dsl.ir import CONST, MATERIALIZE, SCORE, VAR, Node
from scoremod.lowering.patterns import conjuncts, is_neg_inf

# A linear integer form: {"q_idx": a, "kv_idx": b, 1: c} means a*q + b*kv + c.
_ONE = 1


@dataclasses.dataclass(frozen=True)
class Band:
    """cuDNN's diagonal band: row q sees kv in [q - (left_bound - 1), q + right_bound],
    shifted by Skv - Sq when ``alignment`` is BOTTOM_RIGHT; None is unbounded."""

    alignment: str  # "TOP_LEFT" or "BOTTOM_RIGHT"
    left_bound: int | None
    right_bound: int | None


def band_of(expr: Node):
    """``(lo, hi, body, others)`` when ``expr`` is ``where(conds, body, -inf)``
    (nested wheres included) and some conjuncts of ``conds`` bound
    ``d = kv_idx - q_idx`` to ``[lo, hi]`` (infinite where unbounded);
    ``others`` are the remaining conjuncts. None when no conjunct is a band.
    """
    conds = []
    while True:
        if expr.op == "where" and is_neg_inf(expr.args[2]):
            conds.append(expr.args[0])
            expr = expr.args[1]
            continue
        mask = _materialized_mask(expr)  # x + materialize(where(c, 0, -inf))
        if mask is None:
            break
        conds.append(mask[0])
        expr = mask[1]
    lo, hi, others, banded = -math.inf, math.inf, [], False
    for atom in (a for c in conds for a in conjuncts(c)):
        bound = _d_bound(atom)
        if bound is None:
            others.append(atom)
            continue
        banded = True
        lo, hi = max(lo, bound[0]), min(hi, bound[1])
    return (lo, hi, expr, tuple(others)) if banded else None


def native_band(expr: Node, sq: int, skv: int) -> Band | None:
    """The native mask computing ``expr`` (canonical form) at these sizes, or None.

    None unless ``expr`` is ``score`` under a band mask that cuDNN expresses
    with right bound 0 (the kind its Hopper kernels take) and that leaves every
    query row at least one key (fully masked rows keep the score_mod path,
    whose output for them is tested).
    """
    band = band_of(expr)
    if band is None:
        return None
    lo, hi, body, others = band
    if others or body.op != VAR or body.attr != SCORE:
        return None
    lo = lo if lo > 1 - sq else -math.inf  # binds no row
    # Every row sees a key: row 0 needs hi >= 0, the last row needs lo <= skv - sq.
    if hi < 0 or lo > skv - sq or lo > hi:
        return None
    if hi == 0:
        alignment, shift = "TOP_LEFT", 0
    elif hi == skv - sq:
        alignment, shift = "BOTTOM_RIGHT", skv - sq
    else:
        return None
    left = None if lo == -math.inf else int(1 - (lo - shift))
    return Band(alignment, left, 0)


def _materialized_mask(expr):
    """``(cond, x)`` for ``x + materialize(where(cond, 0, -inf))`` (how the
    canonical form carries a data-dependent mask), else None."""
    if expr.op != "add":
        return None
    for m, x in ((expr.args[1], expr.args[0]), (expr.args[0], expr.args[1])):
        if m.op == MATERIALIZE:
            w = m.args[0]
            if (w.op == "where" and is_neg_inf(w.args[2]) and w.args[1].op == CONST
                    and w.args[1].attr == 0.0):
                return w.args[0], x
    return None


def _linear(node):
    """``node`` as a linear form in q_idx and kv_idx, or None."""
    if node.op == VAR and node.attr in ("q_idx", "kv_idx"):
        return {node.attr: 1}
    if node.op == CONST and isinstance(node.attr, int) and not isinstance(node.attr, bool):
        return {_ONE: node.attr}
    if node.op in ("add", "offset", "sub"):
        a, b = (_linear(x) for x in node.args)
        if a is None or b is None:
            return None
        sign = -1 if node.op == "sub" else 1
        return {k: a.get(k, 0) + sign * b.get(k, 0) for k in set(a) | set(b)}
    if node.op == "neg":
        a = _linear(node.args[0])
        return None if a is None else {k: -v for k, v in a.items()}
    if node.op == "mul":
        a, b = (_linear(x) for x in node.args)
        if a is None or b is None:
            return None
        for x, y in ((a, b), (b, a)):
            if set(y) <= {_ONE}:
                c = y.get(_ONE, 0)
                return {k: v * c for k, v in x.items()}
    return None


def difference_bound(atom):
    """(lo, hi) with lo <= kv_idx - q_idx <= hi equivalent to the comparison
    ``atom`` (infinite where unbounded), or None when it is not such a bound."""
    return _d_bound(atom)


def compared_form(atom):
    """``(cq, ck, c)`` with the comparison ``atom`` equivalent to ``cq * q_idx + ck *
    kv_idx + c OP 0`` (OP its own), or None when a side is not linear in the indices."""
    a, b = (_linear(x) for x in atom.args)
    if a is None or b is None:
        return None
    f = {k: a.get(k, 0) - b.get(k, 0) for k in set(a) | set(b)}
    return f.get("q_idx", 0), f.get("kv_idx", 0), f.get(_ONE, 0)


def _d_bound(atom):
    """(lo, hi) with lo <= kv_idx - q_idx <= hi equivalent to ``atom``, or None."""
    if atom.op not in ("lt", "le", "gt", "ge", "eq"):
        return None
    form = compared_form(atom)
    if form is None:
        return None
    cq, t, c = form
    if t == 0 or cq != -t:  # not a function of kv - q alone
        return None
    x = Fraction(-c, t)  # t*d + c OP 0  <=>  d OP' x, OP' flipped when t < 0
    op = atom.op if t > 0 else {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq"}[atom.op]
    if op == "eq":
        return (x, x) if x.denominator == 1 else (1, 0)  # (1, 0): empty
    if op == "le":
        return (-math.inf, math.floor(x))
    if op == "lt":
        return (-math.inf, math.ceil(x) - 1)
    if op == "ge":
        return (math.ceil(x), math.inf)
    return (math.floor(x) + 1, math.inf)  # gt
