"""Masked mods with a modifier, split into query blocks.

cuDNN does not take score_mod together with its native masks, so a mod like
``where(q_idx >= kv_idx, 30 * tanh(score / 30), -inf)`` visits every tile,
masked or not. Split the queries into blocks: a block of rows ``[q0, q1)``
can only see keys ``[q0 + lo, q1 - 1 + hi]`` (``lo <= kv_idx - q_idx <= hi``
is the band), so each block is one fused call on a range of the keys, with
the mod's indices shifted back (``q_idx -> q_idx + q0``). Every row sees all
its keys inside its own call, so the blocks' outputs and LSEs are its rows
of the whole (no softmax merging, no new kernel), and the key gradients of
the blocks add up. ``blockwise`` says this in JAX; the fused path
(``plan.Plan``) does it in place, without slicing.

A mask that is no band but is fixed by the indices alone (prefix-LM's
``kv_idx < P or q_idx >= kv_idx``, a window with global tokens) splits the
same way: its tiles are classified when the call is planned
(``block_maps.classify_tiles`` on the mask's conditions that read no
captured array), and each block takes the keys from its first to its last
visited tile.

    >>> import jax.numpy as jnp, scoremod
    >>> from scoremod.lowering.cudnn.rules import canonical
    >>> mod = scoremod.trace(lambda s, b, h, q, k: jnp.where(q >= k, 30 * jnp.tanh(s / 30), -jnp.inf))
    >>> [(b.q0, b.q1, b.k0, b.k1) for b in plan(canonical(mod.expr), 1024, 1024, blocks=8,
    ...                                           batch_heads=64)]
    [(0, 256, 0, 256), (256, 512, 0, 512), (512, 768, 0, 768), (768, 1024, 0, 1024)]
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
import numpy as np

from scoremod.dsl import ir, ops
from scoremod.dsl.scoremod import ScoreMod
from scoremod.lowering.cudnn import masks

TILE = 128  # cuDNN's key and query tile: block edges on it waste no tile
MAX_COST = 0.8  # split only when the modelled time is at most this share of one call's
SMS = 132  # streaming multiprocessors of an H100 / H200: the default for ``plan``


@dataclasses.dataclass(frozen=True)
class Block:
    q0: int
    q1: int
    k0: int
    k1: int


def plan(expr: ir.Node, sq: int, skv: int, blocks: int, batch_heads: int = 1,
         sms: int = SMS) -> tuple[Block, ...] | None:
    """Query blocks (at most ``blocks``) and the key range each one needs, or
    None when splitting does not pay (no band, too short, or not faster).

    The block count is the one with the least modelled time: each block is a
    kernel of ``batch_heads * query tiles`` tile programs running in waves of
    ``sms``, each program walking the block's key tiles. Splitting skips
    masked tiles but makes smaller kernels, whose last wave may leave the GPU
    half idle (at batch 1, 8 heads, seq 4096 the model rates four blocks
    slower than one call, and picks two). ``sms=1`` counts visited tiles only."""
    if blocks < 2:
        return None
    band = masks.band_of(expr)
    if band is not None:
        keys = functools.partial(_band_keys, band, skv)
    else:
        visited = static_tiles(expr, sq, skv)
        if visited is None:
            return None
        keys = functools.partial(_visited_keys, visited, skv)
    limit = MAX_COST * _cost((Block(0, sq, 0, skv),), batch_heads, sms)
    best, best_cost = None, math.inf
    for n in range(2, blocks + 1):  # fewest blocks among the cheapest
        parts = _blocks(sq, n, keys)
        cost = math.inf if parts is None else _cost(parts, batch_heads, sms)
        if cost <= limit and cost < best_cost:
            best, best_cost = parts, cost
    return best


def _blocks(sq, n, keys):
    """The ``n``-way split of the queries into tile-aligned blocks, each with the
    key range ``keys(q0, q1)`` gives it; None where that is too short to split or
    a block's range is None."""
    size = math.ceil(sq / n / TILE) * TILE
    if size >= sq:
        return None
    out = []
    for q0 in range(0, sq, size):
        q1 = min(sq, q0 + size)
        span = keys(q0, q1)
        if span is None:
            return None
        out.append(Block(q0, q1, *span))
    return tuple(out)


def _band_keys(band, skv, q0, q1):
    """The keys rows ``[q0, q1)`` see under ``lo <= kv_idx - q_idx <= hi``, tile-aligned;
    None for rows that see no key (left to one unsplit call)."""
    lo, hi = band[0], band[1]
    k0 = 0 if lo == -math.inf else max(0, (q0 + lo) // TILE * TILE)
    k1 = skv if hi == math.inf else min(skv, -(-(q1 + hi) // TILE) * TILE)
    return None if k1 <= k0 else (int(k0), int(k1))


def _visited_keys(visited, skv, q0, q1):
    """The keys from the first to the last visited tile of rows ``[q0, q1)`` (one
    tile for rows that see no key: they are fully masked there too)."""
    seen = np.flatnonzero(visited[q0 // TILE:-(-q1 // TILE)].any(axis=0))
    first, last = (seen[0], seen[-1]) if seen.size else (0, 0)
    return int(first * TILE), int(min(skv, (last + 1) * TILE))


def static_tiles(expr, sq: int, skv: int):
    """bool [query tiles, key tiles] (of ``TILE``): where the mask conditions
    of ``expr`` that read only q_idx, kv_idx and constants can hold; None when
    it has none. Conditions that read captured arrays (their values are not
    known when planning), the batch or the head (every block serves all of
    them) count as true."""
    import jax

    from scoremod.lowering import block_maps, patterns
    from scoremod.lowering.problem import Problem

    conds, _ = patterns.mask_conditions(expr)
    deps = patterns.dependencies(expr)
    static = [c if keep else ops.apply("not", c) for c, keep in conds.items()
              if not any(n.op == ir.OPERAND for n in ir.toposort(c))
              and {"q_idx", "kv_idx"} & deps[c] and not {"b", "h"} & deps[c]]
    if not static:
        return None
    cond = static[0]
    for c in static[1:]:
        cond = ops.apply("and", cond, c)
    mask = ops.apply("where", cond, ir.var(ir.SCORE), ir.const(-math.inf, ir.F32))
    problem = Problem(1, sq, skv, 1, 1, 8, 8, "bfloat16")  # the mask reads neither b nor h
    with jax.ensure_compile_time_eval():
        visited, _ = block_maps.classify_tiles(mask, (), problem, TILE, TILE, exact="never")
        return np.asarray(visited)[0, 0]


def _cost(blocks, batch_heads, sms):
    """Modelled time in tile steps: waves of tile programs times key tiles per program."""
    tiles = lambda n: -(-n // TILE)  # noqa: E731
    return sum(-(-batch_heads * tiles(b.q1 - b.q0) // sms) * tiles(b.k1 - b.k0) for b in blocks)


def shifted(mod: ScoreMod, q0: int, k0: int, uniform: tuple = ()) -> ScoreMod:
    """``mod`` for a block whose first query is ``q0`` and first key ``k0``.

    The indices named in ``uniform`` are shifted even by 0, with the ``offset``
    op that no rewrite removes: a split's blocks then have one graph structure,
    and cuDNN compiles one kernel for all of them instead of one for the first
    block and another for the rest (1.4 + 0.9 s of an 8-block first call).
    Equal shift values are one constant node, so a block shifted by 0 on both
    indices (a sliding window's first) still has a structure of its own.

        >>> import scoremod
        >>> mod = scoremod.trace(lambda s, b, h, q, k: s + (k - q))
        >>> str(shifted(mod, 0, 0)), str(shifted(mod, 512, 0, uniform=("q_idx",)))
        ('score + f32(kv_idx - q_idx)', 'score + f32(kv_idx - offset(q_idx, 512))')
    """
    mapping = {}
    for name, offset in (("q_idx", q0), ("kv_idx", k0)):
        var = ir.var(name)
        if name in uniform:
            mapping[var] = ops.apply("offset", var, ir.const(offset, ir.I32))
        elif offset:
            mapping[var] = ops.apply("add", var, ir.const(offset, ir.I32))
    return mod.derived(ir.substitute(mod.expr, mapping) if mapping else mod.expr)


def shifted_indices(blocks) -> tuple:
    """The indices some block of ``blocks`` shifts: the split shifts them in every block."""
    return tuple(name for name, starts in (("q_idx", [b.q0 for b in blocks]),
                                           ("kv_idx", [b.k0 for b in blocks])) if any(starts))


def blockwise(query, key, value, mod, blocks, run):
    """Attention as the concatenation of ``run(q, k, v, mod) -> (out, lse)`` over
    ``blocks`` (arrays [B, S, H, D]; the LSE is [B, H, Sq]): the split's meaning,
    which the tests check against one call."""
    outs, lses = [], []
    uniform = shifted_indices(blocks)  # as the fused path shifts them
    for b in blocks:
        o, lse = run(query[:, b.q0:b.q1], key[:, b.k0:b.k1], value[:, b.k0:b.k1],
                     shifted(mod, b.q0, b.k0, uniform))
        outs.append(o)
        lses.append(lse)
    return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=2)
