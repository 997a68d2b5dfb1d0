"""Positions and lengths of a call: queries that start past position 0, rows
with fewer keys than the key array holds, and a paged KV cache.

``scoremod.attention(..., q_offset=, kv_lengths=, page_table=)``:

- ``q_offset`` int32 [batch]: the position of each row's first query, so the
  mod's ``q_idx`` is ``q_offset[b] + i`` (a chunk of a long sequence, a
  decode step).
- ``kv_lengths`` int32 [batch]: keys at or past it are masked.
- ``page_table`` int32 [batch, pages_per_row], with ``key`` and ``value`` as
  [num_pages, page_size, kv_heads, head_dim]: row ``b``'s logical key
  position ``j`` is ``key[page_table[b, j // page_size], j % page_size]``.

All three may be traced values: they are operands of the mod (their shapes and
dtypes are in the cache key, their values are not), so a decode loop at a new
position never recompiles. The offset and the lengths become part of the mod
(``q_idx`` replaced by ``q_idx + q_offset[b]``, and ``where(kv_idx <
kv_lengths[b], ..., -inf)`` around it), so every backend takes them with
every mod it takes; the pages are gathered into one key and value array per
row first.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from scoremod.dsl import ir
from scoremod.dsl.ir import F32, const
from scoremod.dsl.ops import apply
from scoremod.dsl.scoremod import ScoreMod, fresh_operand_name
from scoremod.errors import ScoreModTypeError


def _per_row(x, name, b):
    """``x`` as int32 [b] (a scalar broadcasts), or the error saying what it needs."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ScoreModTypeError(f"{name} must be an integer array (int32 [batch]), got dtype "
                                f"{x.dtype}")
    if x.shape not in ((), (b,), (1,)):
        raise ScoreModTypeError(f"{name} must have shape [batch] = [{b}] (or be a scalar), got "
                                f"shape {tuple(x.shape)}")
    return jnp.broadcast_to(x.astype(jnp.int32), (b,))


def gather_pages(key, value, page_table):
    """``(key, value)`` as [batch, pages_per_row * page_size, kv_heads, head_dim]
    from a paged cache ([num_pages, page_size, kv_heads, head_dim] each) and its
    int32 [batch, pages_per_row] page table."""
    table = check_pages(key, value, page_table)
    b, pages = table.shape

    def rows(x):
        _, page, h, d = x.shape
        return jnp.take(x, table, axis=0, mode="clip").reshape(b, pages * page, h, d)

    return rows(key), rows(value)


def paged_rows(x, table):
    """The shape and dtype (``jax.ShapeDtypeStruct``) of paged cache ``x`` gathered
    into rows by ``table`` (checked: ``check_pages``)."""
    _, page, h, d = x.shape
    return jax.ShapeDtypeStruct((table.shape[0], table.shape[1] * page, h, d), x.dtype)


def check_pages(key, value, page_table):
    """``page_table`` as int32 [batch, pages_per_row], after checking it and the
    paged cache's shapes (a ScoreModTypeError saying what is wrong)."""
    table = jnp.asarray(page_table)
    if not jnp.issubdtype(table.dtype, jnp.integer) or table.ndim != 2:
        raise ScoreModTypeError(
            f"page_table must be an integer array [batch, pages_per_row], got "
            f"{table.dtype.name} of shape {tuple(table.shape)}")
    for name, x in (("key", key), ("value", value)):
        if x.ndim != 4:
            raise ScoreModTypeError(
                f"with a page_table, {name} must be a paged cache [num_pages, page_size, "
                f"kv_heads, head_dim], got shape {tuple(x.shape)}")
    if key.shape[:3] != value.shape[:3]:
        raise ScoreModTypeError(f"paged key {tuple(key.shape)} and value {tuple(value.shape)} "
                                "must agree on pages, page size and heads")
    return table.astype(jnp.int32)


def apply_positions(mod: ScoreMod | None, b: int, q_offset=None, kv_lengths=None):
    """``mod`` with ``q_idx`` read as ``q_idx + q_offset[b]`` and the keys at or
    past ``kv_lengths[b]`` masked (each None: left as is); the checked arrays
    become its operands. Returns ``mod`` itself when both are None."""
    if q_offset is None and kv_lengths is None:
        return mod
    expr = ir.var(ir.SCORE) if mod is None else mod.expr
    values = {} if mod is None else dict(zip(mod.operand_names, mod.operands))
    if q_offset is not None:
        name = fresh_operand_name("q_offset", values)
        values[name] = _per_row(q_offset, "q_offset", b)
        node = ir.operand(name, (b,), np.dtype(np.int32))
        q = ir.var("q_idx")
        expr = ir.substitute(expr, {q: apply("add", q, apply(ir.LOAD, node, ir.var("b")))})
    if kv_lengths is not None:
        name = fresh_operand_name("kv_lengths", values)
        values[name] = _per_row(kv_lengths, "kv_lengths", b)
        node = ir.operand(name, (b,), np.dtype(np.int32))
        kept = apply("lt", ir.var("kv_idx"), apply(ir.LOAD, node, ir.var("b")))
        expr = apply("where", kept, expr, const(-math.inf, F32))
    return ScoreMod(expr, tuple(values[n.attr[0]] for n in ir.operands_of(expr)))
