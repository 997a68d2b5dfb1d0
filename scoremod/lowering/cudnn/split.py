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
(``block_maps.static_tiles``: the mask's conditions that read no
captured array), and each block takes the keys from its first to its last
visited tile. Where such a mask is the whole mod, a block on which it is one
band (prefix-LM's rows past the prefix see ``q_idx >= kv_idx`` only) or no
mask at all (the prefix's rows) runs under cuDNN's native mask or none
(``block_mods``): it skips the masked tiles inside the block too.

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
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np

from scoremod.dsl import ir, ops
from scoremod.dsl.scoremod import ScoreMod
from scoremod.lowering import block_maps, decode
from scoremod.lowering.cudnn import masks, rules
from scoremod.lowering.patterns import is_neg_inf

TILE = 128  # cuDNN's key and query tile: block edges on it waste no tile
MAX_COST = 0.8  # split only when the modelled time is at most this share of one call's


@dataclasses.dataclass(frozen=True)
class Block:
    q0: int
    q1: int
    k0: int
    k1: int


def plan(expr: ir.Node, sq: int, skv: int, blocks: int, batch_heads: int = 1,
         sms: int = decode.SMS) -> tuple[Block, ...] | None:
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
        visited = block_maps.static_tiles(expr, sq, skv, TILE)
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


def block_mods(mod: ScoreMod, blocks, native: bool = True) -> tuple:
    """The mod each block runs (``shifted`` to its first row and key), or None for
    plain attention: with ``native``, a pure static mask narrowed on the block
    (``narrowed``) where that makes it a band cuDNN takes natively or no mask."""
    uniform = shifted_indices(blocks)  # one graph structure for the score_mod blocks
    out = []
    for b in blocks:
        local = _native(mod, b) if native else False
        out.append(shifted(mod, b.q0, b.k0, uniform) if local is False else local)
    return tuple(out)


def merged(mod: ScoreMod, blocks, joined_score_mods: bool = False) -> tuple:
    """``blocks`` with neighbours joined where both run natively (``_native``) and
    so does their union (with ``joined_score_mods``, neighbours that both keep
    the score_mod too). Prefix-LM's blocks past the prefix become one call under
    the causal mask: it skips the tiles the blocks skipped, in one kernel instead
    of seven, and with one key-gradient sum instead of seven."""
    out = list(blocks[:1])
    native = [_native(mod, b) is not False for b in blocks[:1]]
    for b in blocks[1:]:
        a, b_native = out[-1], _native(mod, b) is not False
        union = Block(a.q0, b.q1, min(a.k0, b.k0), max(a.k1, b.k1))
        if native[-1] and b_native and _native(mod, union) is not False:
            out[-1] = union
        elif joined_score_mods and not native[-1] and not b_native:
            out[-1] = union
        else:
            out.append(b)
            native.append(b_native)
    return tuple(out)


def by_structure(mod: ScoreMod, sq: int, skv: int, most: int):
    """Blocks for a pure static mask cut where its form changes: one block per query
    tile, each with the keys from its first to its last visited tile, then
    ``merged``. Prefix-LM at any length is two blocks: the prefix's rows as plain
    attention, the rest under the causal mask (with a prefix off the tile, the
    first block keeps the score_mod). None where that is one block or more than
    ``most``, more than two keep the score_mod, or the mask is not pure."""
    if _pure_mask(mod) is None:
        return None
    visited = block_maps.static_tiles(rules.canonical(mod.expr), sq, skv, TILE)
    if visited is None:
        return None
    rows = [Block(q0, min(sq, q0 + TILE), *_visited_keys(visited, skv, q0, min(sq, q0 + TILE)))
            for q0 in range(0, sq, TILE)]
    out = merged(mod, rows, joined_score_mods=True)
    if not 1 < len(out) <= most or sum(_native(mod, b) is False for b in out) > 2:
        return None
    return out


def by_keys(mod: ScoreMod, sq: int, skv: int):
    """Two blocks that split a pure static mask's keys at K, each run
    natively (``_native``): all rows against keys ``[0, K)``, and the rows from
    the first that sees a key past K against keys ``[K, skv)``. The rows of both
    blocks join their softmaxes by their LSEs (the fused path's forward); each
    block's backward runs on the joined O and LSE, its dQ summed. Prefix-LM's
    rows see every key of the prefix (plain attention) and the rest causally: a
    square top-left causal block, whose backward skips its masked tiles (cuDNN's
    backward of a bottom-right causal block of 3584 x 4096 keys visits them:
    measured 0.89x FlexAttention fwd+bwd at 4096 against 1.2x for causal). K is
    where a comparison of kv_idx alone changes value, the rest's first row where
    one of q_idx alone does (or K, or 0); both blocks are checked exactly, and so
    is that the rows before the rest's see no key past K. None where no K gives
    two such blocks."""
    pure = _pure_mask(mod)
    if pure is None:
        return None
    rows, keys = _cuts(pure[1], Block(0, sq, 0, skv))
    for k in sorted(keys):
        first = Block(0, sq, 0, k)
        if _native(mod, first) is False:
            continue
        # the rest's first row: the first at which the rows before it see no key past k
        for q0 in sorted({0, k} | rows):
            rest = Block(q0, sq, k, skv)
            if (q0 < sq and _none_kept(mod, Block(0, q0, k, skv))
                    and _native(mod, rest) is not False):
                return first, rest
    return None


def _native(mod: ScoreMod, blk: Block):
    """What ``blk`` runs without a score_mod: None for plain attention, its mask
    narrowed to one band and shifted to the block where cuDNN takes that band
    natively; False where the block keeps the score_mod."""
    narrow = narrowed(mod, blk)
    if narrow is None:
        return None
    if narrow is not mod:
        local = shifted(narrow, blk.q0, blk.k0)
        if masks.native_band(rules.canonical(local.expr), blk.q1 - blk.q0, blk.k1 - blk.k0):
            return local
    return False


def narrowed(mod: ScoreMod, blk: Block):
    """``mod`` on the rows and keys of ``blk`` with its mask of the indices alone
    written as one band of ``kv_idx - q_idx`` (None: no mask, plain attention),
    when ``mod`` is ``where(mask, score, -inf)`` and the mask equals such a band
    on every (q_idx, kv_idx) of the block; else ``mod`` itself.

    Exact, not sampled: the mask's comparisons must be linear in q_idx alone,
    kv_idx alone or kv_idx - q_idx. The block is cut where a comparison of one
    index changes value; on each piece those are constants and the mask is a
    function of d = kv_idx - q_idx, evaluated at every d the piece holds.

        >>> import jax.numpy as jnp, scoremod
        >>> prefix_lm = scoremod.trace(lambda s, b, h, q, k: jnp.where((k < 512) | (q >= k), s, -jnp.inf))
        >>> narrowed(prefix_lm, Block(0, 512, 0, 512)) is None      # the prefix sees all its keys
        True
        >>> str(narrowed(prefix_lm, Block(512, 1024, 0, 1024)))      # the rest: causal
        'where(kv_idx - q_idx <= 0, score, -inf)'
    """
    pure = _pure_mask(mod)
    if pure is None:
        return mod
    body = ir.var(ir.SCORE)
    # Per piece, (the first or last kept d, the piece's own first or last d); and
    # the d ranges of the pieces that keep none.
    lows, highs, empty = [], [], []
    for d, kept in _pieces(*pure, blk):
        if not kept.any():
            empty.append((d[0], d[-1]))
            continue
        first, last = np.flatnonzero(kept)[[0, -1]]
        if not kept[first:last + 1].all():
            return mod  # no band on this piece
        lows.append((d[first], d[0]))
        highs.append((d[last], d[-1]))
    band_lo, band_hi = _bound(lows, low=True), _bound(highs, low=False)
    if band_lo is None or band_hi is None:
        return mod
    if any(not (band_hi < a or band_lo > b) for a, b in empty):  # the band would keep some
        return mod
    if band_lo == -math.inf and band_hi == math.inf:
        return None
    d = ops.apply("sub", ir.var("kv_idx"), ir.var("q_idx"))
    parts = ([ops.apply("ge", d, ir.const(int(band_lo), ir.I32))] if band_lo > -math.inf else []) + \
        ([ops.apply("le", d, ir.const(int(band_hi), ir.I32))] if band_hi < math.inf else [])
    band = parts[0] if len(parts) == 1 else ops.apply("and", *parts)
    return mod.derived(ops.apply("where", band, body, ir.const(-math.inf, ir.F32)))


def _pieces(cond, atoms, blk: Block):
    """``(d, kept)`` per piece of ``blk``: the block cut where a comparison of one
    index changes value (``coef * x + c OP 0`` between floor(r) and floor(r) + 1),
    so that on each piece those are constants and ``cond`` is a function of d =
    kv_idx - q_idx; ``d`` every d the piece holds (each occurs), ``kept`` ``cond``
    at each."""
    inner_q, inner_k = _cuts(atoms, blk)
    qs, ks = sorted(inner_q | {blk.q0, blk.q1}), sorted(inner_k | {blk.k0, blk.k1})
    for q0, q1 in zip(qs, qs[1:]):
        for k0, k1 in zip(ks, ks[1:]):
            d = np.arange(k0 - (q1 - 1), k1 - q0)
            yield d, _truth(cond, atoms, q0, k0, d)


def _cuts(atoms, blk: Block):
    """(query rows, keys) strictly inside ``blk`` where a comparison of q_idx alone,
    or of kv_idx alone, changes value (``coef * x + c OP 0`` between floor(r) and
    floor(r) + 1, r = -c / coef)."""
    out = {"q_idx": set(), "kv_idx": set()}
    for kind, (coef, c), _ in atoms.values():
        if kind in out:
            r = math.floor(Fraction(-c, coef))
            start, stop = (blk.q0, blk.q1) if kind == "q_idx" else (blk.k0, blk.k1)
            out[kind].update(x for x in (r, r + 1) if start < x < stop)
    return out["q_idx"], out["kv_idx"]


def _none_kept(mod: ScoreMod, blk: Block) -> bool:
    """Whether the pure static mask of ``mod`` keeps no (q_idx, kv_idx) of ``blk``
    (exact, as ``narrowed``); True for an empty block."""
    if blk.q0 >= blk.q1 or blk.k0 >= blk.k1:
        return True
    return not any(kept.any() for _, kept in _pieces(*_pure_mask(mod), blk))


def _pure_mask(mod: ScoreMod):
    """``(condition, its comparisons by _atoms)`` when ``mod`` is
    ``where(condition, score, -inf)`` (nested wheres joined) with a condition
    of the indices alone that ``_atoms`` reads; else None."""
    conds, body = [], mod.expr
    while body.op == "where" and is_neg_inf(body.args[2]):
        conds.append(body.args[0])
        body = body.args[1]
    if not conds or body.op != ir.VAR or body.attr != ir.SCORE:
        return None
    cond = conds[0]
    for c in conds[1:]:
        cond = ops.apply("and", cond, c)
    atoms = _atoms(cond)
    return None if atoms is None else (cond, atoms)


_COMPARE = {"lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
            "eq": np.equal, "ne": np.not_equal}


def _atoms(cond):
    """{comparison: (kind, (coef, c), op)} for the comparisons of a boolean ``cond``
    built with and / or / not: kind "q_idx" or "kv_idx" (``coef * x + c OP 0``),
    "d" (``coef * (kv_idx - q_idx) + c OP 0``) or "const"; None when another node
    or a comparison of another form occurs."""
    out = {}

    def walk(n):
        if n.op in ("and", "or", "not"):
            return all(walk(a) for a in n.args)
        form = masks.compared_form(n) if n.op in _COMPARE else None
        if form is None:
            return False
        cq, ck, c = form
        if cq == 0 and ck == 0:
            kind, coef = "const", 0
        elif ck == 0:
            kind, coef = "q_idx", cq
        elif cq == 0:
            kind, coef = "kv_idx", ck
        elif cq == -ck:
            kind, coef = "d", ck
        else:
            return False
        out[n] = (kind, (coef, c), n.op)
        return True

    return out if walk(cond) else None


def _truth(cond, atoms, q, kv, d):
    """``cond`` at every d of ``d`` on a piece where q-only and kv-only comparisons
    are constant (their values at ``q``, ``kv``)."""
    if cond.op in ("and", "or"):
        parts = [_truth(a, atoms, q, kv, d) for a in cond.args]
        return functools.reduce(np.logical_and if cond.op == "and" else np.logical_or, parts)
    if cond.op == "not":
        return ~_truth(cond.args[0], atoms, q, kv, d)
    kind, (coef, c), op = atoms[cond]
    x = {"q_idx": q, "kv_idx": kv, "const": 0}.get(kind)
    value = coef * d + c if kind == "d" else np.full(d.shape, coef * x + c)
    return _COMPARE[op](value, 0)


def _bound(seen, low):
    """The band's lower (``low``) or upper bound from the pieces' ``(t, edge)``: t
    where a piece's kept d start (end); t at the piece's own edge says only that the
    bound lies at or past it (unbounded when no piece says more). None where the
    pieces disagree."""
    exact = {int(t) for t, edge in seen if t != edge}
    if len(exact) > 1:
        return None
    if not exact:
        return -math.inf if low else math.inf
    (b,) = exact
    if any((b > edge) if low else (b < edge) for t, edge in seen if t == edge):
        return None
    return b


def joined(outs, blocks):
    """The ``(O, LSE)`` of key blocks (``by_keys``) from each block's ``(O, LSE)``
    (the first's over every row; a later one's on its rows, the rest ignored): each
    row's softmaxes joined by their LSEs."""
    o, lse = outs[0]
    for (ob, lb), blk in zip(outs[1:], blocks[1:]):
        rows = slice(blk.q0, blk.q1)
        la, lb = lse[:, :, rows], lb[:, :, rows]
        total = jnp.logaddexp(la, lb)
        # exp(LSE_block - LSE) per row: 0 for a block the row sees nothing of
        wa = jnp.where(la == -jnp.inf, 0.0, jnp.exp(la - total))
        wb = jnp.where(lb == -jnp.inf, 0.0, jnp.exp(lb - total))
        rows_o = (o[:, rows].astype(jnp.float32) * jnp.swapaxes(wa, 1, 2)[..., None]
                  + ob[:, rows].astype(jnp.float32) * jnp.swapaxes(wb, 1, 2)[..., None])
        # (not .at[].set: over every row it makes a constant, which the fused call's
        # custom_partitioning refuses)
        o = jax.lax.dynamic_update_slice_in_dim(o, rows_o.astype(o.dtype), blk.q0, axis=1)
        lse = jax.lax.dynamic_update_slice_in_dim(lse, total, blk.q0, axis=2)
    return o, lse


def keywise(query, key, value, mod, blocks, run, backward=None, do=None):
    """Attention as key blocks (``by_keys``) as the fused path runs them:
    ``run(q, k, v, mod) -> (out, lse)`` per block on its rows and keys, ``joined``;
    with ``backward(q, k, v, mod, o, lse, do) -> (dq, dk, dv)`` also the
    gradients: each block's backward on the joined O and LSE of its rows, dQ
    summed, dK and dV each block's own keys. Arrays [B, S, H, D], LSE [B, H, Sq]."""
    mods = [ScoreMod(ir.var(ir.SCORE)) if m is None else m for m in block_mods(mod, blocks)]
    outs = []
    for b, m in zip(blocks, mods):
        o, lse = run(query[:, b.q0:b.q1], key[:, b.k0:b.k1], value[:, b.k0:b.k1], m)
        pad = [(0, 0), (b.q0, query.shape[1] - b.q1), (0, 0), (0, 0)]
        outs.append((jnp.pad(o, pad), jnp.pad(lse, pad[:1] + [(0, 0)] + pad[1:2],
                                               constant_values=-jnp.inf)))
    o, lse = joined(outs, blocks)
    if backward is None:
        return o, lse
    dq = jnp.zeros(query.shape, jnp.float32)
    dks, dvs = [], []
    for b, m in zip(blocks, mods):
        rows = slice(b.q0, b.q1)
        bq, bk, bv = backward(query[:, rows], key[:, b.k0:b.k1], value[:, b.k0:b.k1], m,
                              o[:, rows], lse[:, :, rows], do[:, rows])
        dq = dq.at[:, rows].add(bq.astype(jnp.float32))
        dks.append(bk)
        dvs.append(bv)
    return (o, lse), (dq.astype(query.dtype), jnp.concatenate(dks, 1), jnp.concatenate(dvs, 1))


def blockwise(query, key, value, mod, blocks, run):
    """Attention as the concatenation of ``run(q, k, v, mod) -> (out, lse)`` over
    ``blocks`` (arrays [B, S, H, D]; the LSE is [B, H, Sq]): the split's meaning,
    as the fused path runs it (``block_mods``), which the tests check against one
    call."""
    outs, lses = [], []
    for b, m in zip(blocks, block_mods(mod, blocks)):
        o, lse = run(query[:, b.q0:b.q1], key[:, b.k0:b.k1], value[:, b.k0:b.k1],
                     ScoreMod(ir.var(ir.SCORE)) if m is None else m)
        outs.append(o)
        lses.append(lse)
    return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=2)
