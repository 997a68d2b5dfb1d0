"""IR patterns the lowerings share: relative positions, mask conditions, the
mod on tiles the mask holds everywhere, the score's constant factor.

Read off a mod's IR, with no array in sight: a block map
(``lowering.block_maps``) and the kernels of each backend ask the same
questions of a mod (which conditions mask it, does it read ``q_idx`` and
``kv_idx`` only as their difference, what constant factor of the score can
join the softmax scale), and take their answers from here.
"""

from __future__ import annotations

import math

from scoremod.dsl import ir
from scoremod.dsl.ir import BOOL, CONST, COTANGENT, F32, LOAD, SCORE, VAR, Node


def dependencies(expr) -> dict:
    """The variables (score, b, h, q_idx, kv_idx, dP) each node reads."""
    deps = {}
    for n in ir.toposort(expr):
        if n.op == VAR:
            deps[n] = frozenset((n.attr,))
        else:
            deps[n] = frozenset().union(*(deps[a] for a in n.args))
    return deps


# A comparison with its sides swapped: ``a op b`` is ``b FLIPPED[op] a``.
FLIPPED = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}


def conjuncts(cond) -> list:
    """The terms of ``cond`` read as an ``and`` of ``and``s, in order (``[cond]``
    where it is no ``and``)."""
    if cond.op == "and":
        return [a for arg in cond.args for a in conjuncts(arg)]
    return [cond]


def reads_score(d) -> bool:
    """Whether a node reading variables ``d`` (``dependencies``) reads the score (or dP)."""
    return SCORE in d or COTANGENT in d


def is_neg_inf(node) -> bool:
    """The constant -inf (float32)."""
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
    deps = dependencies(expr)
    conds, conflicting = {}, False

    def need(c, value):
        nonlocal conflicting
        if c.op == "not":
            need(c.args[0], not value)
        elif (c.op == "and" and value) or (c.op == "or" and not value):
            for a in c.args:
                need(a, value)
        elif c.op != CONST and not reads_score(deps[c]):
            if conds.setdefault(c, value) != value:
                conflicting = True

    for n in ir.toposort(expr):
        if n.op == "where":
            c, x, y = n.args
            if is_neg_inf(y):
                need(c, True)
            elif is_neg_inf(x):
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
    deps = dependencies(expr)
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



def score_factor(expr: Node) -> tuple[Node, float]:
    """``(expr', c)`` with ``expr(score) == expr'(score * c)`` when every use of
    the score is ``score * c`` or ``score / (1 / c)`` for one finite constant
    ``c`` other than 0 and 1; else ``(expr, 1.0)``. A backend folds ``c`` into
    the scale of ``q . k``, where it costs nothing: softcap's ``score / 30``.

        >>> import jax.numpy as jnp, scoremod
        >>> softcap = scoremod.trace(lambda s, b, h, q, k: 30.0 * jnp.tanh(s / 30.0))
        >>> folded, c = score_factor(softcap.expr)
        >>> print(folded, round(1 / c, 6))
        <f32 tanh(score) * 30.0> 30.0
    """
    score = ir.var(SCORE)
    uses = [n for n in ir.toposort(expr) if score in n.args]
    factors = set()
    for n in uses:
        if len(n.args) != 2 or n.args[0] is not score or n.args[1].op != CONST:
            return expr, 1.0  # the score used otherwise (abs(score), score * score, ...)
        c = float(n.args[1].attr)
        if n.op == "mul":
            factors.add(c)
        elif n.op == "div" and c != 0.0:
            factors.add(1.0 / c)
        else:
            return expr, 1.0
    if len(factors) != 1:
        return expr, 1.0
    (c,) = factors
    if c in (0.0, 1.0) or not math.isfinite(c):
        return expr, 1.0
    return ir.substitute(expr, {n: score for n in uses}), c
