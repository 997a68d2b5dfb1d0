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
from scoremod.dsl.ir import CONST, F32, LOAD, VAR, Node
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


def _terms(node: Node):
    """The summands of an add chain."""
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        if n.op == "add" and n.dtype == F32:
            stack.extend(reversed(n.args))
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


def _column(term: Node):
    """(query-side load, key-side load) of a product of two loads, else None."""
    if term.op != "mul" or any(a.op != LOAD for a in term.args):
        return None
    x, y = term.args
    sx, sy = _side(x), _side(y)
    if sx is None or sy is None:
        return None
    for qs, ks, (sq, sk) in ((x, y, (sx, sy)), (y, x, (sy, sx))):
        if sq <= _QUERY_SIDE and sk <= _KEY_SIDE and "kv_idx" not in sq and "q_idx" not in sk:
            return qs, ks
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
    cols = [_column(t) for t in _terms(bias)]
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
    """[batch, seq, heads, len(loads)] float32: each load over the index grid."""
    grid = {"b": jnp.arange(batch, dtype=jnp.int32)[:, None, None],
            seq_var: jnp.arange(seq, dtype=jnp.int32)[None, :, None],
            "h": jnp.arange(heads, dtype=jnp.int32)[None, None, :]}
    return jnp.stack([jnp.broadcast_to(evaluate(load, grid, operands).astype(jnp.float32),
                                       (batch, seq, heads)) for load in loads], axis=-1)


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
