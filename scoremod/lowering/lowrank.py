"""Low-rank additive biases folded into the head dimension.

A mod ``f(score + sum_j a[.., q_idx, j] * c[.., kv_idx, j])`` (MLA's
decoupled RoPE ``q_pe . k_pe``, a learned low-rank relative bias) has the
bias of a matmul: with ``scale`` the softmax scale,

    scale * (q . k) + a_q . c_k  =  scale * ([q, a_q / scale] . [k, c_k])

so appending the columns ``a / scale`` to q and ``c`` to k computes the bias
inside QK^T, and the mod becomes ``f(score)``. The concatenation is plain JAX
outside every backend, so the gradients of ``a`` and ``c`` come from JAX
through it, and every backend (the reference path included) runs the same
augmented problem.

    >>> import jax.numpy as jnp, scoremod
    >>> a, c = jnp.ones((8, 4)), jnp.ones((8, 4))
    >>> mod = scoremod.trace(lambda s, b, h, q, k: jnp.tanh(s + jnp.dot(a[q], c[k])))
    >>> from scoremod.lowering.problem import Problem
    >>> found = find(mod, Problem(1, 8, 8, 2, 2, 64, 64, "bfloat16"), 0.125)
    >>> found.rank, str(found.mod)
    (4, 'tanh(score)')
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from scoremod.dsl import ir
from scoremod.dsl.evaluate import evaluate
from scoremod.dsl.ir import CONST, F32, I32, LOAD, VAR, Node, is_const
from scoremod.dsl.ops import apply
from scoremod.dsl.scoremod import ScoreMod

# cuDNN's largest head dim (Hopper, cuDNN 9.x): past it the augmented call could
# not run fused, so the bias stays in the mod (read or computed ahead by XLA).
MAX_HEAD_DIM = 256
_QUERY_SIDE = frozenset(("b", "h", "q_idx"))
_KEY_SIDE = frozenset(("b", "h", "kv_idx"))


@dataclasses.dataclass(frozen=True)
class LowRank:
    """A recognized low-rank bias: the mod without it, and its columns."""

    mod: ScoreMod  # f(score): the mod with score + bias replaced by the score
    query_cols: tuple  # per column, the load read at (b, h, q_idx)
    key_cols: tuple  # per column, the load read at (b, h, kv_idx)
    pad: int  # zero columns that keep the augmented head dim a multiple of 8

    @property
    def rank(self) -> int:
        return len(self.query_cols)


@dataclasses.dataclass(frozen=True)
class NotFolded:
    """A low-rank bias that is left in the mod, and why."""

    reason: str


def _terms(node: Node, factor: float = 1.0):
    """(summand, constant factor) of an add chain, looking through constant
    factors of sums (``0.5 * (a0 * c0 + a1 * c1)``)."""
    out, stack = [], [(node, factor)]
    while stack:
        n, f = stack.pop()
        if n.op == "add" and n.dtype == F32:
            stack.extend((a, f) for a in reversed(n.args))
        elif n.op == "mul" and n.dtype == F32 and any(is_const(a) for a in n.args):
            c, x = n.args if is_const(n.args[0]) else n.args[::-1]
            stack.append((x, f * float(c.attr)))
        else:
            out.append((n, f))
    return out


def _factors(node: Node):
    """The factors of a product chain."""
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        if n.op == "mul" and n.dtype == F32:
            stack.extend(n.args)
        else:
            out.append(n)
    return out


def _side(load: Node):
    """The index variables a load reads at, or None when an index is neither a
    variable nor a constant (or a variable repeats)."""
    names = []
    for i in load.args[1:]:
        if i.op == VAR:
            names.append(i.attr)
        elif i.op != CONST:
            return None
    return frozenset(names) if len(names) == len(set(names)) else None


def _column(term: Node, factor: float):
    """(query-side column, key-side load) of a product of two loads and
    constants, else None; the constants go to the query side."""
    factors = _factors(term)
    loads = [f for f in factors if f.op == LOAD]
    consts = [f for f in factors if is_const(f)]
    if len(loads) != 2 or len(loads) + len(consts) != len(factors):
        return None
    for c in consts:
        factor *= float(c.attr)
    x, y = loads
    sx, sy = _side(x), _side(y)
    if sx is None or sy is None:
        return None
    for qs, ks, (sq, sk) in ((x, y, (sx, sy)), (y, x, (sy, sx))):
        if sq <= _QUERY_SIDE and sk <= _KEY_SIDE and "kv_idx" not in sq and "q_idx" not in sk:
            return (qs if factor == 1.0 else apply("mul", qs, ir.const(factor, F32))), ks
    return None


def _varies_with_head(load: Node) -> bool:
    shape = load.args[0].attr[1]
    return any(i.op == VAR and i.attr == "h" and n > 1 for i, n in zip(load.args[1:], shape))


def find(mod, problem, scale):
    """A :class:`LowRank` when ``mod`` is ``f(score + low-rank bias)`` and the
    augmented call fits; a :class:`NotFolded` (its reason) when it has such a
    bias that is left in the mod; None when it has none."""
    if mod is None:
        return None
    score = ir.var(ir.SCORE)
    uses = [n for n in ir.toposort(mod.expr) if score in n.args]
    if len(uses) != 1 or uses[0].op != "add":
        return None
    (use,) = uses
    bias = use.args[1] if use.args[0] is score else use.args[0]
    if score in ir.toposort(bias):
        return None
    # A 0.0 summand (Python's sum() starts from 0) adds nothing to the score.
    cols = [_column(t, f) for t, f in _terms(bias) if not (is_const(t) and t.attr == 0.0)]
    if not cols or any(c is None for c in cols):
        return None
    rest = ir.substitute(mod.expr, {use: score})
    if bias in set(ir.toposort(rest)):
        return NotFolded("the bias is also used apart from `score + bias`, so it would be "
                         "computed anyway")
    rank = len(cols)
    if isinstance(scale, jax.core.Tracer) or float(scale) == 0.0:
        return NotFolded("the scale is traced or 0, and the query columns are divided by it")
    if problem.hq != problem.hkv and any(_varies_with_head(k) for _, k in cols):
        return NotFolded("the key-side array varies with the query head in a grouped-query "
                         "call, and keys are shared by a group of query heads")
    pad = -(problem.d + rank) % 8 if problem.d % 8 == 0 else 0
    if problem.d + rank + pad > MAX_HEAD_DIM:
        return NotFolded(f"head dim {problem.d} plus rank {rank} is more than {MAX_HEAD_DIM}, "
                         "cuDNN's largest head dim")
    values = dict(zip(mod.operand_names, mod.operands))
    kept = ScoreMod(rest, tuple(values[n.attr[0]] for n in ir.operands_of(rest)))
    return LowRank(kept, tuple(q for q, _ in cols), tuple(k for _, k in cols), pad)


def _columns(loads, operands, batch, seq, heads, seq_var):
    """[batch, seq, heads, len(loads)] float32: each load over the index grid.

    Runs of columns that read one operand at consecutive positions of one axis
    (MLA's ``q_pe[b, q_idx, h, 0..63]``) are taken as one slice of it: column
    by column, XLA builds the result from 64 slices, a fusion that cost the
    H200 about 0.1 ms of MLA's forward."""
    sizes = {"b": batch, seq_var: seq, "h": heads}
    grid = {"b": jnp.arange(batch, dtype=jnp.int32)[:, None, None],
            seq_var: jnp.arange(seq, dtype=jnp.int32)[None, :, None],
            "h": jnp.arange(heads, dtype=jnp.int32)[None, None, :]}
    blocks = []
    for axis, run in _runs(loads):
        values = None
        if len(run) > 1:
            values = _sliced(run[0], operands, sizes, (axis, len(run)))
        if values is None:
            columns = []
            for load in run:
                column = _sliced(load, operands, sizes)
                if column is None:
                    column = evaluate(load, grid, operands)
                columns.append(jnp.broadcast_to(column.astype(jnp.float32),
                                                (batch, seq, heads)))
            values = jnp.stack(columns, axis=-1)
        blocks.append(jnp.broadcast_to(values, (batch, seq, heads, len(run))))
    return blocks[0] if len(blocks) == 1 else jnp.concatenate(blocks, axis=-1)


def _runs(loads):
    """``loads`` cut into runs ``(axis, [load, ...])`` that read one operand at
    the same indices but the one along ``axis``, a constant counting up by one
    (each run at least one load; ``axis`` None for a run of one)."""
    runs = []
    for load in loads:
        axis = _run_axis(runs[-1][1][-1], load) if runs else None
        if axis is not None and runs[-1][0] in (None, axis):
            runs[-1] = (axis, runs[-1][1] + [load])
        else:
            runs.append((None, [load]))
    return runs


def _run_axis(prev: Node, load: Node):
    """The index axis along which ``load`` reads the position after ``prev``'s
    (the same operand, every other index the same), or None."""
    if prev.op != LOAD or load.op != LOAD or prev.args[0] is not load.args[0]:
        return None
    differ = [i for i, (a, b) in enumerate(zip(prev.args[1:], load.args[1:])) if a is not b]
    if len(differ) != 1:
        return None
    a, b = prev.args[1 + differ[0]], load.args[1 + differ[0]]
    if a.op == CONST == b.op and a.dtype == I32 == b.dtype and b.attr == a.attr + 1:
        return differ[0]
    return None


def _sliced(load, operands, sizes: dict, run=None):
    """The load over the grid by slicing, where its indices are the grid's
    variables (each once, spanning its whole axis, in any order) and
    in-range constants, as in ``q_pe[b, q_idx, h, 3]``; else None. The
    general evaluation gathers on iota indices, which XLA keeps as gathers:
    one per column, 64 for a rank-64 bias. A column may be a load times a
    constant (the bias's constant factors go to the query side).

    With ``run = (axis, n)``, the ``n`` columns from this load on, whose
    index along ``axis`` counts up from this load's (a run of ``_runs``), as
    one slice whose last axis is the columns."""
    if load.op == "mul" and load.dtype == F32 and any(is_const(a) for a in load.args):
        if run:
            return None
        c, x = load.args if is_const(load.args[0]) else load.args[::-1]
        values = _sliced(x, operands, sizes)
        return None if values is None else values * jnp.float32(c.attr)
    if load.op != LOAD:
        return None
    name, shape, _ = load.args[0].attr
    index, axes = [], []
    for position, (i, n) in enumerate(zip(load.args[1:], shape)):
        if i.op == VAR and i.attr in sizes and n == sizes[i.attr]:
            index.append(slice(None))
            axes.append(i.attr)
        elif run and position == run[0]:
            if not 0 <= i.attr <= n - run[1]:  # past the end: reads clamp, column by column
                return None
            index.append(slice(i.attr, i.attr + run[1]))
            axes.append("columns")
        elif i.op == CONST and i.dtype == I32 and 0 <= i.attr < n:
            index.append(i.attr)
        else:
            return None
    order = [a for a in sizes if a in axes] + (["columns"] if run else [])  # the grid's order
    if len(set(axes)) != len(axes):  # a variable read twice (a diagonal): not a slice
        return None
    values = jnp.asarray(operands[name])[tuple(index)].astype(jnp.float32)
    values = jnp.transpose(values, [axes.index(a) for a in order])
    return values.reshape([sizes[a] if a in axes else 1 for a in sizes] + ([run[1]] if run else []))


def augment(found: LowRank, query, key, operands: dict, scale):
    """(query, key) with the bias's columns appended: ``a / scale`` to the
    queries and ``c`` to the keys (zero columns after them up to ``pad``)."""
    b, sq, hq, _ = query.shape
    _, skv, hkv, _ = key.shape
    a = _columns(found.query_cols, operands, b, sq, hq, "q_idx") / jnp.float32(scale)
    c = _columns(found.key_cols, operands, b, skv, hkv, "kv_idx")
    if found.pad:
        a = jnp.pad(a, [(0, 0)] * 3 + [(0, found.pad)])
        c = jnp.pad(c, [(0, 0)] * 3 + [(0, found.pad)])
    return (jnp.concatenate([query, a.astype(query.dtype)], axis=-1),
            jnp.concatenate([key, c.astype(key.dtype)], axis=-1))
