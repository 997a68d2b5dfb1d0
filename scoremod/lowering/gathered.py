"""A float table read through an int array (T5's relative buckets) as one table
read at the int array's own index.

``table[h, bucket[q_idx - kv_idx + c]]`` reads ``table`` at an index that is a
captured array's value. The Pallas kernels learn a table read at ``q_idx -
kv_idx`` directly (a kernel per block diagonal sums its gradient), not one read
through another array. :func:`fold` rewrites such a read as ``gathered[h, q_idx -
kv_idx + c]`` with ``gathered[.., j, ..] = table[.., bucket[j], ..]``, computed in
JAX as a matmul with the one-hot of ``bucket`` (the index clamped into range, as
every read is): the table's gradient is that matmul's transpose, a matmul too, so
it repeats bitwise (a scatter-add of the gathered rows would not, on a GPU). The
rewrite is exact on every backend; JAX carries the gradient from ``gathered`` back
to ``table`` outside the kernels.

    >>> import jax.numpy as jnp, numpy as np, scoremod
    >>> table, bucket = jnp.zeros((2, 8)), jnp.asarray(np.arange(15) // 2, jnp.int32)
    >>> mod = scoremod.trace(lambda s, b, h, q, k: s + table[h, bucket[q - k + 7]])
    >>> str(mod).split('; ')[-1]
    'score + c0[h, where(x1 < 0, x1 + 8, x1)]'
    >>> str(fold(mod)).split('; ')[-1]
    'score + c0_c1[h, where(x0 < 0, x0 + 15, x0)]'
"""

from __future__ import annotations

import numpy as np

from scoremod.dsl import ir
from scoremod.dsl.ops import apply
from scoremod.dsl.scoremod import ScoreMod, fresh_operand_name

# Entries of a one-hot matrix (the int array's length times the table axis it
# picks from) past which the read stays as written.
MAX_ONE_HOT = 1 << 24


def fold(mod: ScoreMod | None) -> ScoreMod | None:
    """``mod`` with each float table read through a 1-D int array rewritten as a read
    of the gathered table (one new operand per (table, axis, int array)); ``mod``
    itself where it has none. Operand values that are unbound stay unbound."""
    if mod is None:
        return None
    values = dict(zip(mod.operand_names, mod.operands if mod.operands is not None
                      else (None,) * len(mod.operand_names)))
    made: dict = {}  # (table, axis, int array, wrapped) -> the gathered table's node

    def rewrite(node, args):
        if node.op != ir.LOAD:
            return None
        found = _through(node)
        if found is None:
            return None
        axis, inner, wrapped = found
        table, bucket = node.args[0], inner.args[0]
        key = (table.attr[0], axis, bucket.attr[0], wrapped)
        if key not in made:
            name = fresh_operand_name(f"{key[0]}_{key[2]}", set(values))
            shape = list(table.attr[1])
            shape[axis] = bucket.attr[1][0]
            made[key] = ir.operand(name, tuple(shape), table.attr[2])
            values[name] = _gathered(values[key[0]], values[key[2]], axis, wrapped)
        idx = list(args[1:])
        idx[axis] = inner.args[1]
        return apply(ir.LOAD, made[key], *idx)

    expr = ir.rebuild(mod.expr, rewrite)
    if not made:
        return mod
    names = [n.attr[0] for n in ir.operands_of(expr)]
    bound = mod.operands is not None
    return ScoreMod(expr, tuple(values[n] for n in names) if bound else None)


def _through(node):
    """``(axis, inner load, wrapped)`` where the float table read ``node`` takes one index from
    a 1-D int array read at an index of the positions alone (as written, or with
    a traced mod's wrap of negative values, ``where(x < 0, x + n, x)``); else None."""
    name, shape, dtype = node.args[0].attr
    if not np.issubdtype(np.dtype(dtype), np.floating):
        return None
    for axis, written in enumerate(node.args[1:]):
        idx = _unwrapped(written, shape[axis])
        if idx.op != ir.LOAD:
            continue
        _, ishape, idtype = idx.args[0].attr
        if (len(ishape) == 1 and np.issubdtype(np.dtype(idtype), np.integer)
                and ishape[0] * shape[axis] <= MAX_ONE_HOT
                and not any(n.op == ir.OPERAND for n in ir.toposort(idx.args[1]))):
            return axis, idx, idx is not written
    return None


def _unwrapped(idx, n):
    """``x`` of ``where(x < 0, x + n, x)`` (how a traced mod reads ``a[x]``), else ``idx``."""
    if idx.op == "where" and len(idx.args) == 3:
        test, wrapped, x = idx.args
        if (test.op == "lt" and test.args[0] is x and ir.is_const(test.args[1], 0)
                and wrapped.op == "add" and wrapped.args[0] is x
                and ir.is_const(wrapped.args[1], n)):
            return x
    return idx


def _gathered(table, bucket, axis, wrapped):
    """``table`` with its ``axis`` picked by ``bucket`` (negative values wrapped where the
    read wraps them, then clamped, as the read does), by a one-hot matmul; None while
    either is unbound."""
    if table is None or bucket is None:
        return None
    import jax
    import jax.numpy as jnp

    table = jnp.asarray(table)
    n = table.shape[axis]
    bucket = jnp.asarray(bucket)
    if wrapped:
        bucket = jnp.where(bucket < 0, bucket + n, bucket)
    bucket = jnp.clip(bucket, 0, n - 1)
    picks = jax.nn.one_hot(bucket, n, dtype=table.dtype)
    out = jnp.tensordot(table, picks, axes=[[axis], [1]],
                        precision=jax.lax.Precision.HIGHEST)  # [..., rest, len(bucket)]
    return jnp.moveaxis(out, -1, axis)
