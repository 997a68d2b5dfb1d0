"""Segment (packed-document) masks recognized in the IR.

A mod whose score part is the plain score and whose mask says "a query sees
only keys of its own segment" is attention over variable-length sequences:
each run of equal ids in a row is one sequence. This module reads such masks
off the IR (nothing here knows cuDNN); the ``cudnn_varlen`` backend turns the
description into ragged sequences.

Recognized, as conjuncts of one mask (``where(mask, score, -inf)``, nested
wheres, ``where(not mask, -inf, score)``, or ``score + where(mask, 0, -inf)``):

- segment equality ``seg_q[b, q_idx] == seg_kv[b, kv_idx]`` (required), with
  captured integer arrays ``[B, S]`` (or ``[1, S]``, or ``[S]``, shared by
  the rows); one array for self-attention, two for cross-attention;
- key padding ``kv_idx < length[b]`` (``length`` a ``[B]`` array or a
  constant), and pad ids ``seg[b, kv_idx] != PAD`` (or on the query side);
- for self-attention only (one array, Sq == Skv), a band in ``kv_idx -
  q_idx`` that cuDNN applies inside every sequence: causal (right bound 0),
  optionally with a sliding window (a left bound).

    >>> import jax.numpy as jnp, scoremod
    >>> from scoremod.lowering.problem import Problem
    >>> doc = jnp.zeros((2, 256), jnp.int32)
    >>> mod = scoremod.trace(lambda s, b, h, q, k: jnp.where((doc[b, q] == doc[b, k]) & (q >= k), s, -jnp.inf))
    >>> recognize(mod.expr, Problem(2, 256, 256, 4, 4, 64, 64, "bfloat16"))
    Segments(q_array=Side(operand='c0', batched=True), kv_array=Side(operand='c0', batched=True), self_attention=True, causal=True, window=None, length=None, pad_q=None, pad_kv=None)
"""

from __future__ import annotations

import dataclasses
import math

from scoremod.dsl import ir
from scoremod.dsl.ir import I32, Node
from scoremod.dsl.ops import apply
from scoremod.dsl.text import format_expr
from scoremod.lowering.cudnn.masks import difference_bound
from scoremod.lowering.patterns import FLIPPED, conjuncts

_NEGATED = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt", "eq": "ne", "ne": "eq"}
_INTS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32")


@dataclasses.dataclass(frozen=True)
class Side:
    """The id array of one side: the operand's name, and whether it has a
    batch axis indexed by ``b`` (False: one row shared by every batch)."""

    operand: str
    batched: bool
    row: int = 0  # the row read when not batched by b (seg[0, q_idx])

    def __repr__(self):
        return f"Side(operand={self.operand!r}, batched={self.batched})"


@dataclasses.dataclass(frozen=True)
class Length:
    """Key padding ``kv_idx < length``: an operand read at ``b`` (or its one
    entry), or a constant."""

    operand: str | None
    constant: int | None = None
    batched: bool = True


@dataclasses.dataclass(frozen=True)
class Segments:
    """A segment mask: sequences are the runs of equal ids of each row."""

    q_array: Side
    kv_array: Side
    self_attention: bool  # one array for both sides and Sq == Skv: runs match by position
    causal: bool  # kv_idx <= q_idx inside a segment
    window: int | None  # and q_idx - kv_idx < window
    length: Length | None
    pad_q: int | None  # query tokens with this id see nothing
    pad_kv: int | None  # key tokens with this id are seen by nobody

    @property
    def pads_tokens(self) -> bool:
        """Whether some tokens may belong to no sequence (their O, dQ, dK, dV are
        zeros that the kernels do not write)."""
        return (not self.self_attention or self.length is not None or self.pad_q is not None
                or self.pad_kv is not None)


def recognize(expr: Node, problem) -> Segments | str:
    """The segment mask ``expr`` is, or a sentence saying why it is not one."""
    conds, body = _peel(expr)
    if body is not ir.var(ir.SCORE):
        why = ("its score part is not the plain score: cuDNN 9.19 refuses a score_mod "
               "together with sequence lengths" if conds else "it is not a mask")
        return f"the mod is not a segment mask ({why})"
    atoms = [a for c in conds for a in conjuncts(c)]
    pairs, lo, hi, length, pad_q, pad_kv, seg_names = [], -math.inf, math.inf, None, None, None, set()
    for atom in atoms:
        pair = _equality(atom)
        if pair is not None:
            pairs.append(pair)
            continue
        bound = difference_bound(atom) if atom.op in FLIPPED else None
        if bound is not None:
            lo, hi = max(lo, bound[0]), min(hi, bound[1])
            continue
        found = _length(atom)
        if found is not None:
            if length is not None and found != length:
                return f"the mod has two key lengths ({format_expr(atom)})"
            length = found
            continue
        pad = _pad(atom)
        if pad is not None:
            seg_names.add(pad)
            continue
        return (f"`{format_expr(atom)}` is not part of a segment mask (segment equality, "
                "causal or sliding-window band, key length, pad id)")
    if len(set(pairs)) != 1:
        return ("the mod is not a segment mask (it needs exactly one "
                "`seg_q[b, q_idx] == seg_kv[b, kv_idx]`)" if not pairs else
                "the mod compares two different pairs of segment arrays")
    q_side, kv_side = pairs[0]
    for side, value, array in seg_names:
        if array != (q_side if side == "q" else kv_side):
            return "a pad id is tested on an array that is not the segment array of its side"
        if (pad_q if side == "q" else pad_kv) is not None:
            return "the mod tests two pad ids on one side"
        if side == "q":
            pad_q = value
        else:
            pad_kv = value
    same = q_side == kv_side and problem.sq == problem.skv
    causal, window = False, None
    if (lo, hi) != (-math.inf, math.inf):
        if not same:
            return ("a band in kv_idx - q_idx is applied inside segments only for "
                    "self-attention (one segment array, equal query and key lengths)")
        if hi != 0:
            return ("only causal bands (keys up to the query, kv_idx <= q_idx) and sliding "
                    "windows inside them run on the ragged kernels")
        causal = True
        if lo != -math.inf:
            if lo > 0:
                return "the band leaves no key to any query"
            window = int(1 - lo)
    return Segments(q_side, kv_side, same, causal, window, length, pad_q, pad_kv)


def _peel(expr):
    """(conditions, body) of ``where(c, body, -inf)`` chains and their spellings."""
    conds = []
    while True:
        if expr.op == "where" and _neg_inf(expr.args[2]):
            conds.append(expr.args[0])
            expr = expr.args[1]
        elif expr.op == "where" and _neg_inf(expr.args[1]):
            conds.append(_negate(expr.args[0]))
            expr = expr.args[2]
        elif expr.op == "add" and any(_zero_or_neg_inf(a) is not None for a in expr.args):
            i = 0 if _zero_or_neg_inf(expr.args[0]) is not None else 1
            conds.append(_zero_or_neg_inf(expr.args[i]))
            expr = expr.args[1 - i]
        else:
            return conds, expr


def _zero_or_neg_inf(node):
    """The condition of ``where(c, 0, -inf)`` (or ``where(c, -inf, 0)`` negated), else None."""
    if node.op != "where":
        return None
    c, a, b = node.args
    if _is_const(a, 0.0) and _neg_inf(b):
        return c
    if _neg_inf(a) and _is_const(b, 0.0):
        return _negate(c)
    return None


def _is_const(node, value):
    return node.op == ir.CONST and node.attr == value


def _neg_inf(node):
    return node.op == ir.CONST and node.attr == -math.inf


def _negate(cond):
    if cond.op == "not":
        return cond.args[0]
    if cond.op in _NEGATED and cond.args[0].dtype == I32:  # exact on integers
        return apply(_NEGATED[cond.op], *cond.args)
    if cond.op == "or":  # not (a or b) = not a and not b
        return apply("and", _negate(cond.args[0]), _negate(cond.args[1]))
    return apply("not", cond)


def _side(node, axis):
    """The Side of ``node`` when it reads an integer id array at ``axis`` (q_idx or kv_idx)."""
    if node.op != ir.LOAD:
        return None
    name, shape, dtype = node.args[0].attr
    idx = node.args[1:]
    if dtype not in _INTS or not idx or idx[-1] is not ir.var(axis):
        return None
    if len(idx) == 1:
        return Side(name, False)
    if len(idx) != 2:
        return None
    first = idx[0]
    if first is ir.var("b"):
        return Side(name, shape[0] != 1)
    if first.op == ir.CONST and first.dtype == I32 and 0 <= first.attr < shape[0]:
        return Side(name, False, int(first.attr))
    return None


def _equality(atom):
    if atom.op != "eq":
        return None
    a, b = atom.args
    for x, y in ((a, b), (b, a)):
        qs, ks = _side(x, "q_idx"), _side(y, "kv_idx")
        if qs is not None and ks is not None:
            return qs, ks
    return None


def _length(atom):
    """Length of ``kv_idx < n`` (or ``n > kv_idx``), else None."""
    if atom.op not in ("lt", "gt"):
        return None
    a, b = atom.args if atom.op == "lt" else atom.args[::-1]
    if a is not ir.var("kv_idx"):
        return None
    if b.op == ir.CONST and b.dtype == I32:
        return Length(None, int(b.attr))
    if b.op == ir.LOAD and b.args[0].attr[2] in _INTS:
        name, shape, _ = b.args[0].attr
        idx = b.args[1:]
        if len(idx) == 1 and idx[0] is ir.var("b"):
            return Length(name, None, shape[0] != 1)
        if len(idx) == 1 and idx[0].op == ir.CONST and idx[0].attr == 0 and shape[0] == 1:
            return Length(name, None, False)
    return None


def _pad(atom):
    """(side, pad id, Side) of ``seg[b, kv_idx] != PAD`` (or on q_idx), else None."""
    if atom.op != "ne":
        return None
    a, b = atom.args
    for x, c in ((a, b), (b, a)):
        if c.op != ir.CONST or c.dtype != I32:
            continue
        for side, axis in (("q", "q_idx"), ("kv", "kv_idx")):
            s = _side(x, axis)
            if s is not None:
                return side, int(c.attr), s
    return None
