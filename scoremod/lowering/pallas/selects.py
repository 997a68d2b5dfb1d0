"""A captured array read along a short axis at an index the Mosaic GPU kernels
cannot gather, spelled as a chain of ``where``s over that axis's entries.

The Mosaic kernels read arrays at indices built from b, h and constants (a
scalar per program), along one tile axis (a vector), at q_idx - kv_idx or at
whole blocks of positions (``mosaic.read_axis``); they make no other gather per
score. A small table read through other arrays at both tile axes, such as a
bias between token types ``pair[kind[q_idx], kind[kv_idx]]`` (or, after
``gathered.fold``, ``pair_kind[q_idx, kind[kv_idx]]``), reads a few entries
along an axis whose index varies over the tile. :func:`spelled` picks the
entry with comparisons instead: ``where(kind[kv_idx] <= 0, pair[kind[q_idx], 0],
where(kind[kv_idx] == 1, pair[kind[q_idx], 1], ...))``, each entry a read the
kernels make (here a vector along the queries), and each entry's gradient
summed as any such read's is (no atomics: the same bits on every run). The
first comparison and the last entry take the indices past the axis's ends, as
every read clamps them. A chain costs a comparison and a select per entry and
score, and, in the backward, a product and a sum per entry: so only for up to
``mosaic.MAX_PICKED`` entries.

    >>> import jax.numpy as jnp, numpy as np, scoremod
    >>> pair, kind = jnp.zeros((2, 2)), jnp.asarray(np.arange(8) % 2, jnp.int32)
    >>> mod = scoremod.trace(lambda s, b, h, q, k: s + pair[kind[q], kind[k]])
    >>> mosaic.read_axis(mod.expr.args[1])   # pair[..]: a gather on the tile
    False
    >>> chain = spelled(mod.expr).args[1]
    >>> chain.op, [mosaic.read_axis(n) for n in chain.args[1:]]   # pair[.., 0], pair[.., 1]
    ('where', ['q_idx', 'q_idx'])
"""

from __future__ import annotations

import functools
import itertools
import math

from scoremod.dsl import ir
from scoremod.dsl.ops import apply
from scoremod.lowering.pallas import mosaic


@functools.lru_cache(maxsize=256)
def spelled(expr):
    """``expr`` with each read that ``mosaic.read_axis`` cannot make rewritten as a
    chain over its shortest axes that leave reads it can make (``mosaic.MAX_PICKED``
    entries at most); ``expr`` itself where there is none. Bool arrays stay as
    written: their chains' entries would be bool reads along one tile axis, which
    the kernels refuse (``codegen.ONE_AXIS_BOOL_READ``)."""
    if expr is None:
        return None

    def rewrite(node, args):
        if node.op != ir.LOAD or node.dtype == ir.BOOL:
            return None
        read = node if args == node.args else apply(ir.LOAD, *args)
        if read.op != ir.LOAD or mosaic.read_axis(read) is not False:
            return None
        return _chain(read)

    return ir.rebuild(expr, rewrite)


# The kernels' cost of an entry by how it is read: a vector along the queries is
# two registers a thread on a forward or dQ tile (queries down), one along the
# keys 32; so of two chains of as many entries, the one whose entries run along
# the queries.
_ENTRY_COST = {None: 0, "q_idx": 0, mosaic.OFFSET: 1, mosaic.BLOCKS: 1, "kv_idx": 2}


def _chain(read):
    """The chain standing for ``read`` over its fewest (then cheapest) entries, or None."""
    table, index = read.args[0], read.args[1:]
    shape = table.attr[1]
    varying = [a for a, i in enumerate(index) if i.op != ir.CONST and shape[a] > 1]
    choices = []
    for n in range(1, len(varying) + 1):
        for axes in itertools.combinations(varying, n):
            entries = math.prod(shape[a] for a in axes)
            if entries > mosaic.MAX_PICKED:
                continue
            first = list(index)
            for a in axes:
                first[a] = ir.const(0, ir.I32)
            kind = mosaic.read_axis(apply(ir.LOAD, table, *first))
            if kind is not False:
                choices.append((entries, _ENTRY_COST[kind], axes))
    if not choices:
        return None
    _, _, axes = min(choices)
    return _select(table, list(index), axes)


def _select(table, index, axes):
    """The read of ``table`` at ``index`` with each of ``axes`` picked by a chain of
    comparisons of its index (clamped: the first entry below, the last above)."""
    if not axes:
        return apply(ir.LOAD, table, *index)
    axis, rest = axes[0], axes[1:]
    at, n = index[axis], table.attr[1][axis]

    def entry(j):
        fixed = list(index)
        fixed[axis] = ir.const(j, ir.I32)
        return _select(table, fixed, rest)

    out = entry(n - 1)
    for j in range(n - 2, -1, -1):
        test = (apply("le", at, ir.const(0, ir.I32)) if j == 0
                else apply("eq", at, ir.const(j, ir.I32)))
        out = apply("where", test, entry(j), out)
    return out
