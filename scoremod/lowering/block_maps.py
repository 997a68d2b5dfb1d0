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
``when_full(expr)`` (``lowering.patterns``), the mod without its mask
conditions. ``dense_block_map`` visits everything and is right for any mod.

    >>> m = dense_block_map(batch=1, heads=1, sq=256, skv=384, block_q=128, block_kv=128)
    >>> m.q_counts.tolist(), m.q_blocks[0, 0, 1].tolist()
    ([[[3, 3]]], [0, 1, 2])
    >>> m.kv_counts.tolist(), m.kv_blocks[0, 0, 2].tolist()
    ([[[2, 2, 2]]], [0, 1])
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scoremod.dsl import ir, ops
from scoremod.dsl.evaluate import evaluate
from scoremod.dsl.ir import BOOL, CONST, F32, I32, LOAD, OPERAND, VAR
from scoremod.errors import ScoreModValueError
from scoremod.lowering.intervals import (F32_MAX, RULES, TIGHT, Bools, Floats, constant, every,
                                         from_parts, reduce_parts, value_parts)
from scoremod.lowering.patterns import (FLIPPED, conjuncts, dependencies, difference_form,
                                        mask_conditions, reads_score)
from scoremod.lowering.problem import Problem


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
    return BlockMap(  # NumPy: constants in a kernel's program
        q_counts=np.full(lead + (nq,), nk, np.int32),
        q_blocks=np.broadcast_to(np.arange(nk, dtype=np.int32), lead + (nq, nk)),
        q_full=np.zeros(lead + (nq, nk), np.bool_),
        kv_counts=np.full(lead + (nk,), nq, np.int32),
        kv_blocks=np.broadcast_to(np.arange(nq, dtype=np.int32), lead + (nk, nq)),
        kv_full=np.zeros(lead + (nk, nq), np.bool_),
    )


# --- the tile analysis --------------------------------------------------------
#
# Every node of the mod gets an abstract value per tile (``lowering.intervals``):
# arrays that broadcast to [Bm, Hm, nq, nk].
#
# Nodes that do not depend on the score and read at most one of q_idx and
# kv_idx ("separable") are evaluated exactly on every position of their axis
# (O(B*H*S) work) and reduced per block: the ids of a document mask, q // 128
# of a chunked mask, the indices themselves. Nodes mixing q_idx and kv_idx,
# or reading the score, combine their arguments' values by the interval
# rules. Score-free nodes the classes hinge on (mask conditions, a bias added
# to the score) that mix q_idx and kv_idx through ops the rules bound badly
# (remainders, loads at both indices) are evaluated on every entry of every
# tile instead (``exact``), a batch of query-block rows at a time.


_EXACT = ("auto", "always", "never")
_JNP = {F32: jnp.float32, I32: jnp.int32, BOOL: jnp.bool_}
# Elements of one step of the per-tile evaluation (query blocks batched to about this).
_TILE_STEP_ELEMENTS = 2**24
_MOST_VALUES = 4096  # the widest value range an equality of queries and keys is tabled over
_MOST_PRODUCT = 2**28  # ... and the most tiles x values its product may take


def _separable(d):
    """Evaluated exactly along one axis: no score, not both q_idx and kv_idx."""
    return not reads_score(d) and not ("q_idx" in d and "kv_idx" in d)


def map_axes(expr, problem) -> tuple:
    """``(Bm, Hm)``: the batch and head extents the map keeps, 1 where no mask
    condition reads ``b`` (``h``). Other uses of b and h (an ALiBi slope) are
    bounded over all their values."""
    conds, _ = mask_conditions(expr)
    deps = dependencies(expr)
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
        parts = value_parts(node.dtype, value, ok)
        if "b" in deps and self.bm == 1:
            parts = reduce_parts(node.dtype, parts, 0)
        if "h" in deps and self.hm == 1:
            parts = reduce_parts(node.dtype, parts, 1)
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
            parts = reduce_parts(node.dtype, parts, 3, keepdims=False)
        where = 2 if seq_axis == "kv_idx" else 3  # the tile axis it does not vary along
        return from_parts(node.dtype, tuple(jnp.expand_dims(x, where) for x in parts))

    def abstract(self, n, deps, values):
        """The abstract value of ``n`` on the tiles from its arguments' ``values``:
        exact along one axis where it is separable, else by its op's rule."""
        if n.op == CONST:
            return constant(n)
        if _separable(deps[n]):
            return self.separable(n, deps[n])
        if n.op == VAR:  # the score (or dP): any finite float
            return Floats(jnp.float32(-F32_MAX), jnp.float32(F32_MAX), jnp.bool_(False))
        if n.op == LOAD:
            return self.load_anywhere(n)
        if n.op in RULES:
            return RULES[n.op](n, *(values[a] for a in n.args))
        return every(n.dtype)

    def intervals(self, terms, deps):
        """bool ``[Bm or 1, Hm or 1, nq, nk]``, or None: for an ``and`` of ``terms``,
        each of one side's index alone or a bound of the other side's index by a
        value of the first (``kv_idx >= off[doc[q_idx]]``, ``q_idx >= kv_idx``,
        ``q_idx >= page[kv_idx // 16] * 16``), whether some entry of each tile
        satisfies them all, exactly: each row's (column's) interval of the other
        index, narrowed to the positions that the other side's terms keep (a prefix
        count and a search), and the tiles it reaches summed per tile of rows (a
        difference array): O(B*H*(S log S + tiles)). None for other terms."""
        for along, other in (("q_idx", "kv_idx"), ("kv_idx", "q_idx")):
            found = self._intervals(terms, deps, along, other)
            if found is not None:
                return found if along == "q_idx" else jnp.swapaxes(found, -1, -2)
        return None

    def _intervals(self, terms, deps, along, other):
        p = self.problem
        size = {"q_idx": p.sq, "kv_idx": p.skv}
        block = {"q_idx": self.block_q, "kv_idx": self.block_kv}
        index = ir.var(other)  # the index the bounds bound
        rows, cols, lower, upper = [], [], [], []
        for t in terms:
            d = deps[t]
            if reads_score(d):
                return None
            bound = _bound(t, index)
            if bound is not None and other not in deps[bound[1]]:
                (lower if bound[0] in ("ge", "gt") else upper).append(bound)
            elif other not in d:
                rows.append(t)
            elif along not in d:
                cols.append(t)
            else:
                return None
        # Pairing decides something only where a row's bound varies with the row
        # beside another condition that varies along either index: one such bound
        # with conditions of b and h alone is what the rules bound exactly already.
        varying = sum(along in deps[v] for _, v in lower + upper)
        own = ir.var(along)
        others = sum(along in deps[t] and not _invariant_bound(t, own, deps) for t in rows)
        others += sum(other in deps[t] for t in cols)
        if varying == 0 or varying + others < 2:
            return None
        n_rows, n_other = size[along], size[other]
        rows_block, other_block = block[along], block[other]
        n_tiles, tiles_other = num_blocks(n_rows, rows_block), num_blocks(n_other, other_block)
        nb = p.b if any("b" in deps[t] for t in terms) else 1
        nh = p.hq if any("h" in deps[t] for t in terms) else 1
        b = jnp.arange(nb, dtype=jnp.int32)[:, None, None]
        h = jnp.arange(nh, dtype=jnp.int32)[None, :, None]

        def on(node, axis, n):  # node's values along ``axis`` (the other index 0)
            seq, zero = jnp.arange(n, dtype=jnp.int32)[None, None, :], jnp.int32(0)
            idx = {along: zero, other: zero, axis: seq}
            v = self.evaluate(node, b, h, idx["q_idx"], idx["kv_idx"])
            return jnp.broadcast_to(v, (nb, nh, n))

        keep = jnp.ones((nb, nh, n_rows), bool)
        for t in rows:
            keep = keep & on(t, along, n_rows)
        lo = jnp.zeros((nb, nh, n_rows), jnp.int32)
        hi = jnp.full((nb, nh, n_rows), n_other, jnp.int32)
        for op, value in lower:  # index >= v, or index > v: index >= v + 1 (none past MAX)
            v = on(value, along, n_rows)
            if op == "gt":
                v = jnp.where(v == ir.INT32_MAX, n_other, v + 1)
            lo = jnp.maximum(lo, jnp.clip(v, 0, n_other))
        for op, value in upper:  # index < v, or index <= v: index < v + 1
            v = on(value, along, n_rows)
            if op == "le":
                v = jnp.where(v == ir.INT32_MAX, n_other, v + 1)
            hi = jnp.minimum(hi, jnp.clip(v, 0, n_other))
        kept = jnp.ones((nb, nh, n_other), bool)
        for t in cols:
            kept = kept & on(t, other, n_other)
        # counts[i]: kept positions before i. A row's first and last kept position in
        # [lo, hi) (the ranks counts[lo] and counts[hi] - 1) bound the tiles it reaches;
        # it reaches every tile between them that holds a kept position.
        counts = jnp.concatenate([jnp.zeros((nb, nh, 1), jnp.int32),
                                  jnp.cumsum(kept, axis=-1, dtype=jnp.int32)], axis=-1)
        if cols:
            at = lambda x: jnp.take_along_axis(counts, x, -1)  # noqa: E731
            reaches = keep & (hi > lo) & (at(hi) > at(jnp.minimum(lo, hi)))
            rank = jax.vmap(jax.vmap(lambda c, r: jnp.searchsorted(c, r, side="left")))
            first = rank(counts[..., 1:], at(lo) + 1) // other_block  # that position's tile
            last = rank(counts[..., 1:], at(hi)) // other_block
        else:  # every position kept: the interval's own ends
            reaches = keep & (hi > lo)
            first, last = lo // other_block, jnp.maximum(hi - 1, 0) // other_block
        # Per row tile, +1 at each reaching row's first tile and -1 past its last: summed
        # along the tiles, how many of its rows reach each one.
        tile_of_row = np.arange(n_rows) // rows_block
        step = jnp.zeros((nb, nh, n_tiles, tiles_other + 1), jnp.int32)
        at_row = (jnp.arange(nb)[:, None, None], jnp.arange(nh)[None, :, None],
                  jnp.asarray(tile_of_row)[None, None, :])
        step = step.at[(*at_row, first)].add(reaches.astype(jnp.int32), mode="drop")
        step = step.at[(*at_row, last + 1)].add(-reaches.astype(jnp.int32), mode="drop")
        reached = jnp.cumsum(step, axis=-1)[..., :tiles_other] > 0
        starts = np.arange(tiles_other) * other_block
        ends = np.minimum(starts + other_block, n_other)
        holds = (counts[..., ends] - counts[..., starts]) > 0  # [nb, nh, tiles_other]
        live = reached & holds[:, :, None, :]
        if nb > 1 and self.bm == 1:
            live = live.any(0, keepdims=True)
        if nh > 1 and self.hm == 1:
            live = live.any(1, keepdims=True)
        return live

    def load_anywhere(self, node) -> tuple:
        """Every value of the array a load reads (its indices are not bounded)."""
        array = jnp.asarray(self.operands[node.args[0].attr[0]]).astype(_JNP[node.dtype])
        parts = value_parts(node.dtype, array.reshape(1, -1))
        return from_parts(node.dtype, reduce_parts(node.dtype, parts, 1, keepdims=False))

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
        parts = reduce_parts(node.dtype, tuple(x.reshape(x.shape[:2] + (chunks, g))
                                               for x in parts), 3, keepdims=False)
        # Tile (i, j)'s real entries see q - kv from its first query less its last
        # real key to its last real query less its first key.
        q0, k0 = np.arange(self.nq)[:, None] * bq, np.arange(self.nk)[None, :] * bk
        first = (q0 - (np.minimum(k0 + bk, p.skv) - 1) - lo) // g
        last = (np.minimum(q0 + bq, p.sq) - 1 - k0 - lo) // g
        span = int((last - first).max()) + 1
        index = np.minimum(first[..., None] + np.arange(span), last[..., None])
        parts = tuple(x[:, :, index] for x in parts)  # [Bm, Hm, nq, nk, span]
        return from_parts(node.dtype, reduce_parts(node.dtype, parts, 4, keepdims=False))

    def values_meet(self, shared, others, deps, most: int = _MOST_VALUES):
        """``(meet, always)``, bool ``[Bm or 1, Hm or 1, nq, nk]``: whether some entry of
        each tile gives the int node ``shared`` (of one of q_idx and kv_idx) the value of
        one of the int nodes ``others`` (of the other), and whether every entry does: an
        equality (one other), or an ``or`` of equalities with a side in common, the
        ``.any()`` of a list (``topk[b, h, q // T] == kv // T``, ``kv // T`` shared).
        A side that reads no captured array (``shared``, or else all of ``others``)
        gives the values that can meet, known when planning: the range (at most
        ``most`` values). Per tile and value, how many of the tile's positions take it
        (one of ``others`` there): a scatter, O(B*H*S*len(others)); then two products
        over the range: some value of the shared side's tile taken somewhere on the
        other's (meet), and none that a position there lacks (always). None where
        neither side is known or the range is wider."""
        p = self.problem
        others = list(dict.fromkeys(others))

        def known(nodes):
            return not any(m.op == OPERAND for m in ir.toposort(*nodes))

        ranged = [shared] if known([shared]) else others if known(others) else None
        if ranged is None:
            return None

        def along(node):
            on_q = "q_idx" in deps[node]
            size = p.sq if on_q else p.skv
            seq = jnp.arange(size, dtype=jnp.int32)[None, None, :]
            zero = jnp.zeros((1, 1, 1), jnp.int32)
            bs = jnp.arange(p.b if "b" in deps[node] else 1, dtype=jnp.int32)[:, None, None]
            hs = jnp.arange(p.hq if "h" in deps[node] else 1, dtype=jnp.int32)[None, :, None]
            v = self.evaluate(node, bs, hs, seq if on_q else zero, zero if on_q else seq)
            return on_q, jnp.broadcast_to(v, (bs.shape[0], hs.shape[1], size))

        with jax.ensure_compile_time_eval():
            static = [np.asarray(along(n)[1]) for n in ranged]
        lo, hi = min(int(v.min()) for v in static), max(int(v.max()) for v in static)
        width = hi - lo + 1
        if width > most or self.nq * self.nk * width > _MOST_PRODUCT:
            return None

        def counts(nodes):
            """(on q_idx, int32 [nb, nh, tiles, range]: the tile's positions where one of
            ``nodes`` takes each value, [tiles] its real positions, bool [nb, nh, tiles]:
            a value outside the range there)"""
            found = [along(n) for n in nodes]
            on_q = found[0][0]
            nb = max(v.shape[0] for _, v in found)
            nh = max(v.shape[1] for _, v in found)
            size = found[0][1].shape[2]
            v = jnp.stack([jnp.broadcast_to(x, (nb, nh, size)) for _, x in found], axis=-1)
            v = jnp.sort(v, axis=-1)  # a value several of them take counts once per position
            first = jnp.concatenate([jnp.ones(v.shape[:-1] + (1,), jnp.int32),
                                     (v[..., 1:] != v[..., :-1]).astype(jnp.int32)], axis=-1)
            block = self.block_q if on_q else self.block_kv
            n = num_blocks(size, block)
            outside = (v < lo) | (v > hi)
            # Out of range to the end explicitly: .at[] would wrap a negative index.
            idx = (jnp.arange(nb)[:, None, None, None], jnp.arange(nh)[None, :, None, None],
                   (jnp.arange(size, dtype=jnp.int32) // block)[None, None, :, None],
                   jnp.where(outside, width, v - lo))
            table = jnp.zeros((nb, nh, n, width), jnp.int32).at[idx].add(first, mode="drop")
            real = np.minimum(block, size - np.arange(n) * block)
            outside = jnp.pad(outside.any(-1), [(0, 0), (0, 0), (0, n * block - size)])
            return on_q, table, real, outside.reshape(nb, nh, n, block).any(axis=-1)

        shared_on_q, ts, _, outside = counts([shared])
        _, to, real, _ = counts(others)  # values outside the range meet nothing

        def product(x, y):  # 0 / 1 entries summed over at most `most` values: exact
            return jnp.matmul(x.astype(jnp.float32), jnp.swapaxes(y, -1, -2).astype(jnp.float32),
                              precision=jax.lax.Precision.HIGHEST) > 0

        ts = ts > 0
        meet = product(ts, to > 0)  # [.., shared tiles, other tiles]
        missed = product(ts, to < real[:, None])  # a value some position there lacks
        always = meet & ~missed & ~outside[..., :, None]
        # Per batch and head, then over those the map does not keep: met in any, always in all.
        if meet.shape[0] > 1 and self.bm == 1:
            meet, always = meet.any(0, keepdims=True), always.all(0, keepdims=True)
        if meet.shape[1] > 1 and self.hm == 1:
            meet, always = meet.any(1, keepdims=True), always.all(1, keepdims=True)
        if not shared_on_q:
            meet, always = jnp.swapaxes(meet, -1, -2), jnp.swapaxes(always, -1, -2)
        return meet, always

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
                parts = value_parts(node.dtype, v, ok)
                out.append(reduce_parts(node.dtype, parts, (0, 1, 2, 4), keepdims=False))
            return out

        rows = [x.reshape(-1).astype(jnp.int32)
                for x in jnp.indices((self.bm, self.hm, self.nq))]
        widest = max(nb * nh for nb, nh in spread.values())
        batch = max(1, _TILE_STEP_ELEMENTS // (widest * bq * nk * bk))
        stacked = lax.map(step, tuple(rows), batch_size=batch)
        shape = (self.bm, self.hm, self.nq, nk)
        return [from_parts(n.dtype, tuple(x.reshape(shape) for x in parts))
                for n, parts in zip(nodes, stacked)]


def _opposite_sides(n, deps) -> bool:
    """Whether ``n`` compares an int of q_idx (not kv_idx) with one of kv_idx (not q_idx)."""
    sides = [frozenset(deps[a]) & {"q_idx", "kv_idx"} for a in n.args]
    return (all(a.dtype == I32 for a in n.args)
            and sorted(map(sorted, sides)) == [["kv_idx"], ["q_idx"]])


def _equalities(n, deps):
    """``(negated, shared, others, inner)`` where ``n`` is an equality of an int of
    q_idx and one of kv_idx, or an ``or`` of such equalities with one side in common
    (``shared``): ``(topk[b, h, q // T] == kv // T).any()``; ``negated`` for ``ne``
    under ``and`` (``.all()`` of ``!=``), which is its negation. ``inner``: the nodes
    of the group below ``n``. None for anything else."""
    test, join = ("ne", "and") if n.op in ("ne", "and") else ("eq", "or")
    leaves, inner, stack = [], set(), [n]
    while stack:
        m = stack.pop()
        if m in inner:
            continue
        inner.add(m)
        if m.op == join:
            stack.extend(m.args)
        elif m.op == test and _opposite_sides(m, deps):
            leaves.append(m)
        else:
            return None
    if not leaves:
        return None
    common = [a for a in leaves[0].args if all(a in leaf.args for leaf in leaves)]
    if not common:
        return None
    shared = common[0]
    others = [a for leaf in leaves for a in leaf.args if a is not shared]
    return test == "ne", shared, others, inner - {n}


def _mixed_uses(expr, conds, deps) -> list:
    """Score-free nodes mixing q_idx and kv_idx that the classes hinge on: the
    mask conditions, and the score-free arguments of nodes reading the score
    (a captured bias of -inf blocks added to it)."""
    out = {c: None for c in conds}
    for n in ir.toposort(expr):
        if reads_score(deps[n]):
            out.update((a, None) for a in n.args if not reads_score(deps[a]))
    return [n for n in out if not _separable(deps[n]) and n.op != CONST]


def _tight(cond, deps) -> bool:
    """Whether the rules bound ``cond`` well: every node of it mixing q_idx and
    kv_idx is an op of ``TIGHT``."""
    for n in ir.toposort(cond, stop=lambda m: _separable(deps[m])):
        if not _separable(deps[n]) and n.op not in TIGHT:
            return False
    return True


def _bound(t, index) -> tuple | None:
    """``(op, value)`` where ``t`` is the int inequality ``index op value`` (either
    way round: ``q_idx >= kv_idx`` bounds kv_idx as ``kv_idx le q_idx``), else None."""
    if t.op not in ("ge", "gt", "le", "lt") or index not in t.args or t.args[0].dtype != I32:
        return None
    x, y = t.args
    return (t.op, y) if x is index else (FLIPPED[t.op], x)


def _invariant_bound(t, index, deps) -> bool:
    """Whether ``t`` bounds ``index`` by a value of neither q_idx nor kv_idx
    (``kv_idx < lengths[b]``): it keeps an interval of positions, the same for
    every position of the other index."""
    bound = _bound(t, index)
    return bound is not None and not {"q_idx", "kv_idx"} & deps[bound[1]]


# --- what holds inside a conjunction: the map's own rewrite ------------------


def _cancelled(node, guards: list):
    """``node`` with each int comparison of two differences with the same
    subtrahend, or two sums with a term in common, made the comparison of the
    other terms (``(a - c) >= (b - c)`` is ``a >= b`` where neither side wraps);
    the two sides go to ``guards``."""
    def fn(m, args):
        if m.op not in ops.COMPARISONS or not all(a.dtype == I32 for a in args):
            return None
        x, y = args
        if x.op == y.op == "sub" and x.args[1] is y.args[1]:
            common, rest = x.args[1], (x.args[0], y.args[0])
        elif x.op == y.op == "add" and set(x.args) & set(y.args):
            common = next(a for a in x.args if a in y.args)
            rest = tuple(a.args[1] if a.args[0] is common else a.args[0] for a in (x, y))
        else:
            return None
        guards.extend((x, y))
        return ops.apply(m.op, *rest)

    return ir.rebuild(node, fn)


def congruent(expr) -> tuple:
    """``(expr', guards)``: ``expr`` for the map, where each conjunction that holds
    an equality of a value of the queries and one of the keys (``doc[q] ==
    doc[kv]``) has the key side replaced by the query side in its other terms
    (equal wherever the conjunction holds), and comparisons of differences with
    the same subtrahend made comparisons of the rest (``_cancelled``): document
    causal's ``q - off[doc[q]] >= kv - off[doc[kv]]`` becomes ``q >= kv``, which
    the tile bounds see exactly (each side's bounds spanning two documents'
    offsets visited tiles with no key). Equal to ``expr`` entry by entry where
    none of the int sums and differences in ``guards`` wraps (``_wraps``);
    ``(expr, [])`` where nothing applies."""
    deps = dependencies(expr)
    guards: list = []

    def fn(m, args):
        if m.op != "and":
            return None
        terms = conjuncts(m)
        equalities = [t for t in terms if t.op == "eq" and _opposite_sides(t, deps)]
        if not equalities:
            return None
        equal = {}  # the key side of each equality -> its query side
        for x, y in (t.args for t in equalities):
            equal.update({y: x} if "q_idx" in deps[x] else {x: y})
        out = None
        for t in terms:
            if t not in equalities:
                t = _cancelled(ir.substitute(t, equal), guards)
            out = t if out is None else ops.apply("and", out, t)
        return out

    rewritten = ir.rebuild(expr, fn, stop=lambda m: m.op == "and")
    return (expr, []) if not guards else (rewritten, guards)


def _wraps(guards, operands, problem) -> jax.Array:
    """Whether an int sum or difference of ``guards`` may wrap anywhere in the
    call: the interval rule on the whole call's bounds of its two arguments."""
    p = problem
    tiles = _Tiles(p, max(p.sq, 1), max(p.skv, 1), 1, 1, operands)
    values = {}
    for node in guards:
        deps = dependencies(node)
        for n in ir.toposort(*node.args, stop=lambda m: _separable(deps[m])):
            if n not in values and n.op != OPERAND:
                values[n] = tiles.abstract(n, deps, values)
    wraps = jnp.bool_(False)
    for node in guards:  # a rule's bounds that wrap are every int32
        r = RULES[node.op](node, *(values[a] for a in node.args))
        wraps = wraps | jnp.any((r.lo == ir.INT32_MIN) & (r.hi == ir.INT32_MAX))
    return wraps


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
    Equalities of a value of the queries and one of the keys (alone or an ``or``
    with a side in common: a tile list's ``.any()``) cost O(B*H*S) per equality
    plus products of O(B*H*nq*nk*values) (``_Tiles.values_meet``). Everything
    else costs O(B*H*S) (separable parts) plus O(Bm*Hm*nq*nk) (the rules)."""
    if exact not in _EXACT:
        raise ScoreModValueError(f"exact={exact!r}; expected one of {_EXACT}")
    operands = _operand_values(expr, operands)
    visited, full = _classify(expr, operands, problem, block_q, block_kv, exact)
    rewritten, guards = congruent(expr)
    if not guards:
        return visited, full
    # Within a document, offsets cancel: the rewritten mod's classes where no
    # int sum or difference it cancelled may wrap (both are sound; the
    # intersection is tighter), the mod's own elsewhere.
    tight_visited, tight_full = _classify(rewritten, operands, problem, block_q, block_kv, exact)
    safe = ~_wraps(guards, operands, problem)
    return visited & (tight_visited | ~safe), full | (tight_full & safe)


def _classify(expr, operands, problem, block_q, block_kv, exact) -> tuple:
    """``classify_tiles`` of ``expr`` as written, ``operands`` by name."""
    deps = dependencies(expr)
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
    # An equality of a value of the queries and one of the keys (a tile list,
    # topk[b, h, q // T, j] == kv // T), or an `or` of them with a side in common (its
    # .any()): per tile, whether their sets of values meet, and whether on every entry
    # (the interval rule sees every value between a tile's least and greatest; the
    # `or` rule finds no tile full that the equalities fill between them).
    def meeting(n):
        group = _equalities(n, deps) if n.op in ("eq", "ne", "or", "and") else None
        if group is None:
            return None
        negated, shared, others, below = group
        found = tiles.values_meet(shared, others, deps)
        if found is None:
            return None
        meet, always = found
        return (Bools(~always, meet) if negated else Bools(meet, ~always)), below

    def leaf(n):
        return n in values or n.op == CONST or _separable(deps[n]) or n.op not in RULES

    inside = set()  # below a group: computed only where something else reads them
    for n in reversed(ir.toposort(expr, *conds, stop=leaf)):  # the widest groups first
        if n not in values and n not in inside and (found := meeting(n)) is not None:
            values[n], below = found
            inside |= below

    for n in ir.toposort(expr, *conds, stop=leaf):
        if n in values or n.op == OPERAND:
            continue
        found = meeting(n) if n in inside else None
        if found is not None:
            values[n] = found[0]
        else:
            values[n] = tiles.abstract(n, deps, values)
        if n.op == "and":  # conditions paired per row: exact where it applies
            paired = tiles.intervals(conjuncts(n), deps)
            if paired is not None:
                values[n] = Bools(values[n].can_true & paired, values[n].can_false)
    shape = (bm, hm, tiles.nq, tiles.nk)
    out = values[expr]
    visited = ~((out.hi == -np.inf) & ~out.nan)
    full = jnp.bool_(not conflicting)
    for c, value in conds.items():
        full = full & ~(values[c].can_false if value else values[c].can_true)
    visited = jnp.broadcast_to(visited, shape)
    return visited, jnp.broadcast_to(full, shape) & visited


def block_lists(visited, full, intervals=(False, False)) -> BlockMap:
    """The BlockMap of tile classes ``visited``/``full`` ([Bm, Hm, nq, nk]);
    ``intervals``: whether each query tile's row (and each key tile's column) of
    visited tiles is known to be one run (``interval_axes``), listed as its first
    tile onwards (``_run_lists``)."""
    q = (_run_lists if intervals[0] else _lists)(visited, full)
    kv = (_run_lists if intervals[1] else _lists)(jnp.swapaxes(visited, -1, -2),
                                                  jnp.swapaxes(full, -1, -2))
    return BlockMap(*q, *kv)


def _run_lists(visited, full):
    """``_lists`` of rows each of one run of visited tiles: its first tile onwards,
    ``first + arange`` (elementwise after one reduction: a map built in the program
    costs a few launches fewer than the general lists' cumsum and scatter). A row
    with gaps would list them too, computed and masked by the mod: right, only slower."""
    n = visited.shape[-1]
    seen = jnp.any(visited, axis=-1)
    first = jnp.argmax(visited, axis=-1).astype(jnp.int32)
    last = jnp.where(seen, n - 1 - jnp.argmax(visited[..., ::-1], axis=-1).astype(jnp.int32),
                     first)
    counts = jnp.where(seen, last - first + 1, 0)
    blocks = jnp.minimum(first[..., None] + jnp.arange(n, dtype=jnp.int32), last[..., None])
    return counts, blocks, jnp.take_along_axis(full, blocks, -1)


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


@functools.lru_cache(maxsize=256)
def static_block_map(expr, problem, block_q: int, block_kv: int) -> BlockMap:
    """``block_map`` of an ``expr`` that reads no captured array, computed once on
    the host into NumPy arrays: a kernel's program then holds the map as
    constants, where a map built in the program costs a few dozen tiny kernels per
    call (XLA does not fold them). A mod without mask conditions or non-finite
    constants visits every tile, all full (no analysis); any other is analysed by
    one small program compiled for the CPU without optimization (about 0.1-0.3 s;
    op by op, each a compile of its own, it took 0.3-1.2 s)."""
    if ir.operands_of(expr):
        raise ScoreModValueError("static_block_map takes an expression without captured arrays")
    if _unmasked(expr):
        dense = dense_block_map(sq=problem.sq, skv=problem.skv, block_q=block_q,
                                block_kv=block_kv)
        return dense._replace(q_full=~dense.q_full, kv_full=~dense.kv_full)
    try:
        host = jax.devices("cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS without cpu: the default device computes it
        host = None
    with jax.default_device(host):  # a program of no arguments runs there
        lowered = jax.jit(lambda: block_map(expr, {}, problem, block_q, block_kv)).trace().lower()
        compiled = lowered.compile() if host is None else lowered.compile(compiler_options={
            "xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True})
        found = compiled()
    return BlockMap(*(np.asarray(x) for x in found))


def _unmasked(expr) -> bool:
    """Whether every tile is visited and full for ``expr`` whatever the problem: no
    mask condition, and no infinite or NaN constant (``classify_tiles`` would
    find the same, or skip a tile where the mod is -inf for every score: a tile
    visited needlessly, never a wrong one)."""
    conds, conflicting = mask_conditions(expr)
    return not conds and not conflicting and all(
        math.isfinite(n.attr) for n in ir.toposort(expr)
        if n.op == CONST and isinstance(n.attr, float))


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
    return block_lists(*classify_tiles(expr, operands, problem, block_q, block_kv, exact=exact),
                       intervals=interval_axes(expr))


@functools.lru_cache(maxsize=256)
def interval_axes(expr) -> tuple:
    """``(rows, columns)``: whether each query tile's visited key tiles (and each key
    tile's query tiles) are one run, for every value of the captured arrays: every
    mask condition that reads kv_idx (q_idx) bounds it (a comparison with kv_idx,
    plus or minus terms without it, on one side: causal, a window, ``kv_idx <
    kv_lengths[b]``, a traced offset), and no read of a captured array outside the
    conditions varies with it (a value per key may be -inf anywhere)."""
    conds, _ = mask_conditions(expr)
    deps = dependencies(expr)
    inside = {n for c in conds for n in ir.toposort(c)}
    loads = [n for n in ir.toposort(expr) if n.op == LOAD and n not in inside]

    def runs(axis):
        return (all(_offset_bound(c, axis, deps) for c in conds if axis in deps[c])
                and not any(axis in deps[n] for n in loads))

    return runs("kv_idx"), runs("q_idx")


def _offset_bound(cond, axis, deps) -> bool:
    """Whether ``cond`` is ``_bound``'s inequality with ``axis`` plus or minus terms
    without it in place of ``axis`` itself (``q_idx - kv_idx < 128``): it holds on a
    run of positions along ``axis``."""
    if cond.op not in ("lt", "le", "gt", "ge"):
        return False
    sides = [a for a in cond.args if axis in deps[a]]
    if len(sides) != 1:
        return False
    node = sides[0]
    while node.op != VAR:
        if node.op not in ("add", "sub") or node.dtype != I32:
            return False
        inner = [a for a in node.args if axis in deps[a]]
        if len(inner) != 1:
            return False
        node = inner[0]
    return node.attr == axis


STATIC_TILE = 128  # cuDNN's query and key tile, and the Pallas kernels' forward query tile


@functools.lru_cache(maxsize=256)
def static_tiles(expr, sq: int, skv: int, tile: int = STATIC_TILE):
    """bool [query tiles, key tiles] (of ``tile``): where the mask conditions
    of ``expr`` that read only q_idx, kv_idx and constants can hold; None when
    it has none. Conditions that read captured arrays (their values are not
    known when planning), the batch or the head (every block serves all of
    them) count as true. Known when the call is planned: the planners count
    the tiles a route computes with it."""
    conds, _ = mask_conditions(expr)
    deps = dependencies(expr)
    static = [c if keep else ops.apply("not", c) for c, keep in conds.items()
              if not any(n.op == OPERAND for n in ir.toposort(c))
              and {"q_idx", "kv_idx"} & deps[c] and not {"b", "h"} & deps[c]]
    if not static:
        return None
    cond = static[0]
    for c in static[1:]:
        cond = ops.apply("and", cond, c)
    mask = ops.apply("where", cond, ir.var(ir.SCORE), ir.const(-math.inf, F32))
    problem = Problem(1, sq, skv, 1, 1, 8, 8, "bfloat16")  # the mask reads neither b nor h
    with jax.ensure_compile_time_eval():
        visited, _ = classify_tiles(mask, (), problem, tile, tile, exact="never")
        out = np.asarray(visited)[0, 0]
    out.setflags(write=False)  # shared by every caller of the cache
    return out
