"""Short queries folded for the kernels: decoding with the same mod.

A call with few query rows per key/value head (a decode step: one row per
sequence, or a few for speculative decoding) gives a fused kernel one query
tile per head holding a handful of live rows; it reads each key/value head's
K and V once per query head of the group, and with few sequences and heads
most of the GPU has no tile to run. :class:`Fold` rewrites such a call into
the same attention on other shapes, for the same kernels:

- **packing**: the ``G = hq // hkv`` query heads of a group become the query
  rows of one head (row ``r`` is row ``r // G`` of query head ``h * G + r % G``):
  K and V are read once per key/value head, and a tile holds G times the rows;
- **key chunks**: the keys are cut into ``n`` equal chunks folded into the
  batch (batch row ``b * n + j`` holds chunk ``j``): n times the tiles run at
  once. The chunks' O and LSE are joined after, in a fixed order (the result
  repeats bitwise).

A backend whose forward spreads a query tile's keys over several programs
itself (``Backend.splits_keys``: the Pallas kernels' Mosaic GPU engine, which
splits each tile's list of key tiles) is only packed; it takes
``decode_splits`` as its parts. On the others, a call whose plan skips tiles
of a static mask (a sliding window at a static position) is not folded: the
chunks' indices read the batch row, which a static block map does not, so
every tile would be computed.

The mod sees the call's own indices: ``b -> b' // n``, ``h -> h' * G + r % G``,
``q_idx -> r // G``, ``kv_idx -> kv' + (b' % n) * chunk``; an array read at
``b`` directly is repeated along that axis, so that its read stays direct.
The backward is each chunk's own backward given the joined O and LSE (the
identity the key-block split rests on, ``cudnn/split.py``): dQ is the sum over
the chunks, dK and dV are the chunks' in order, and the LSE's cotangent is
every chunk's. Exact: only the rounding of each chunk's O to the input dtype
before the join differs from one kernel over all keys.

    >>> from scoremod.lowering.problem import Problem
    >>> p = Problem(b=8, sq=1, skv=32768, hq=32, hkv=8, d=128, dv=128, dtype="bfloat16")
    >>> Fold(group=4, splits=8).problem(p)
    Problem(b=64, sq=4, skv=4096, hq=8, hkv=8, d=128, dv=128, dtype='bfloat16')
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from scoremod import device
from scoremod.dsl import ir, ops
from scoremod.dsl.ir import I32
from scoremod.dsl.scoremod import ScoreMod
from scoremod.lowering.problem import Problem

MAX_QUERIES = 16  # query rows of a short call: a decode step, speculative decoding
MAX_ROWS = 64  # packed query rows per head: one query tile of every fused kernel
MIN_CHUNK = 1024  # keys per chunk: below this a chunk's tiles are too few to hide the join
ALIGN = 128  # chunk lengths on the kernels' key tile, so that no chunk has a padded tile
SMS = 132  # streaming multiprocessors of an H100 / H200 where the device does not say
WAVES = 2  # at least this many waves of tiles over the SMs


@dataclasses.dataclass(frozen=True)
class Fold:
    group: int  # query heads packed into the rows of one key/value head (1: none)
    splits: int  # key chunks folded into the batch (1: none)

    def problem(self, p: Problem) -> Problem:
        return dataclasses.replace(p, b=p.b * self.splits, sq=p.sq * self.group,
                                   hq=p.hq // self.group, skv=p.skv // self.splits)

    def describe(self, p: Problem) -> str:
        parts = []
        if self.group > 1:
            parts.append(f"the {self.group} query heads of each key/value head packed into "
                         f"{p.sq * self.group} query rows")
        if self.splits > 1:
            parts.append(f"the keys in {self.splits} chunks of {p.skv // self.splits} folded "
                         "into the batch and joined by their LSEs")
        return "short queries folded: " + ", ".join(parts)


def short(p: Problem) -> bool:
    """Whether ``p`` is a call of short queries (folded on the fused backends):
    at most ``MAX_QUERIES`` rows, and ``MAX_ROWS`` once a group's heads are packed."""
    return (p.hq % p.hkv == 0 and p.sq <= MAX_QUERIES and p.sq * (p.hq // p.hkv) <= MAX_ROWS
            and p.b * p.sq * p.skv > 0)


def choose(call) -> tuple | None:
    """``(fold, folded call)`` for a routed call (``lowering.backend.Call``) of short
    queries on a fused backend, or None: the call runs as it is. The folded call is
    the same backend's, planned for the folded shapes and mod; a backend that
    refuses the folded mod keeps the call unfolded."""
    if call.options.decode_splits == 0 or call.backend.differentiable:
        return None  # (the reference path's plan may hold a traced scale: not hashable)
    return _choose(call)


@functools.lru_cache(maxsize=256)
def _choose(call):
    # A backend that spreads the keys over programs itself only packs: its folded
    # call, planned for the packed shapes, splits their key lists (a static window
    # too: packing reads no batch row, so the static block map stays).
    folding = _folding(call.backend, call.problem, call.plan.mod, call.options,
                       inside=call.backend.splits_keys(call.plan))
    if folding is None:
        return None
    fold, folded, mod, inner_options = folding
    inner = dataclasses.replace(call, options=inner_options, sinks=False,
                                sinks_inside=False)
    return fold, inner.on(folded, mod, "folded for short queries")


def _folding(backend, p: Problem, mod, options, inside: bool):
    """``(fold, folded problem, folded mod, the folded call's options)`` for a call of
    ``p`` on ``backend`` (``inside``: one that splits a tile's keys over programs
    itself), or None where it runs as it is: not short, nothing to fold, a plan
    that skips tiles already, or a backend that refuses the folded call."""
    if not short(p):
        return None
    group = p.hq // p.hkv
    splits = 1 if inside else _splits(p, group, options)
    if group == 1 and splits == 1:
        return None
    # A call whose plan skips tiles already (a static window under cuDNN's native mask,
    # a block map): the chunks' indices depend on the batch row, which no static block
    # map reads, so the folded call would compute every tile.
    if not inside and _skips_tiles(backend, p, mod, options):
        return None
    fold = Fold(group, splits)
    folded_mod = None if mod is None else ScoreMod(rewrite(mod, fold, p)[0])
    # The folded call is not folded again (its options say so), except that a backend
    # splitting keys itself takes the option's count for its parts.
    inner_options = options if inside else options.replace(decode_splits=0)
    folded = fold.problem(p)
    if backend.why_not(folded, folded_mod, False, inner_options) is not None:
        return None
    return fold, folded, folded_mod, inner_options


def _skips_tiles(backend, p: Problem, mod, options) -> bool:
    """Whether ``backend``'s plan of ``p`` skips tiles already (a static window under
    cuDNN's native mask, a block map)."""
    share = backend.tile_share(p, mod, options)
    return share is not None and share < 1.0


def packs_rows(backend, p: Problem, mod, options) -> bool:
    """Whether a call of ``p`` on ``backend`` (one that does not spread a tile's keys
    itself) runs folded with each group's query heads packed into more query rows:
    ``choose``'s rule, asked before the call is routed."""
    if options.decode_splits == 0 or p.hq == p.hkv:
        return False
    return _folding(backend, p, mod, options, inside=False) is not None


def multiprocessors(options) -> int:
    """The GPU's streaming multiprocessors: ``options.sms``, else the device's, else ``SMS``."""
    return options.sms or device.current().sm_count or SMS


def _splits(p: Problem, group: int, options) -> int:
    """The key chunks: ``options.decode_splits`` if given (the largest count up to it
    that divides the keys), else the fewest that give the SMs ``WAVES`` waves of
    query tiles, each chunk at least ``MIN_CHUNK`` keys on ``ALIGN``."""
    if options.decode_splits is not None:
        return max(n for n in range(1, options.decode_splits + 1) if p.skv % n == 0)
    sms = multiprocessors(options)
    tiles = p.b * p.hkv  # one query tile per (sequence, key/value head) once packed
    n = 1
    while tiles * n < WAVES * sms:
        m = 2 * n
        if p.skv % m or (p.skv // m) % ALIGN or p.skv // m < MIN_CHUNK:
            break
        n = m
    return n


@functools.lru_cache(maxsize=256)
def rewrite(mod: ScoreMod, fold: Fold, p: Problem):
    """``(expr, sources)``: the folded call's mod expression, and for each of its
    operands ``(name, original name, axis)``: the original array, repeated
    ``fold.splits`` times along ``axis`` (None: as it is)."""
    n, g, chunk = fold.splits, fold.group, p.skv // fold.splits
    b, h, q, kv = (ir.var(name) for name in ir.INDEX_VARS)

    def c(x):
        return ir.const(x, I32)

    mapping = {}
    if n > 1:
        mapping[b] = ops.apply("floordiv", b, c(n))
        mapping[kv] = ops.apply("add", kv, ops.apply("mul", ops.apply("mod", b, c(n)), c(chunk)))
    if g > 1:
        mapping[h] = ops.apply("add", ops.apply("mul", h, c(g)), ops.apply("mod", q, c(g)))
        mapping[q] = ops.apply("floordiv", q, c(g))
    sources = {}

    def fold_node(node, args):
        if node in mapping:
            return mapping[node]
        if node.op != ir.LOAD:
            return None
        name, shape, dtype = node.args[0].attr
        axis = next((i for i, a in enumerate(node.args[1:]) if a is b and shape[i] == p.b), None)
        if axis is None or n == 1:
            sources.setdefault(name, (name, name, None))
            return None
        tag = f"{name}_chunks{axis}"
        sources[tag] = (tag, name, axis)
        leaf = ir.operand(tag, shape[:axis] + (shape[axis] * n,) + shape[axis + 1:], dtype)
        idx = [b if i == axis else new for i, new in enumerate(args[1:])]
        return ops.apply(ir.LOAD, leaf, *idx)

    expr = ir.rebuild(mod.expr, fold_node, stop=mapping.__contains__)
    names = [node.attr[0] for node in ir.operands_of(expr)]
    return expr, tuple(sources[name] for name in names)


def operands(mod: ScoreMod, fold: Fold, p: Problem, values, inner_mod) -> tuple:
    """The folded call's operand values in ``inner_mod``'s order (its plan's), from
    ``values`` in ``mod``'s."""
    if inner_mod is None:
        return ()
    given = dict(zip(mod.operand_names, values))
    by_name = {}
    for tag, name, axis in rewrite(mod, fold, p)[1]:
        x = given[name]
        by_name[tag] = x if axis is None else jnp.repeat(x, fold.splits, axis=axis)
    return tuple(by_name[name] for name in inner_mod.operand_names)


# --- the arrays ---------------------------------------------------------------


def fold_queries(x, fold: Fold, hkv: int):
    """[b, sq, hq, d] -> [b * n, sq * G, hkv, d] (row ``i * G + m``: head ``h * G + m``)."""
    b, sq, _, d = x.shape
    g = fold.group
    x = x.reshape(b, sq, hkv, g, d).transpose(0, 1, 3, 2, 4).reshape(b, sq * g, hkv, d)
    return jnp.repeat(x, fold.splits, axis=0) if fold.splits > 1 else x


def fold_keys(x, fold: Fold):
    """[b, skv, hkv, d] -> [b * n, skv / n, hkv, d]: chunk ``j`` of row ``b`` at ``b * n + j``."""
    b, skv, hkv, d = x.shape
    return x.reshape(b * fold.splits, skv // fold.splits, hkv, d)


def fold_lse(x, fold: Fold, hkv: int):
    """[b, hq, sq] -> [b * n, hkv, sq * G], the rows as :func:`fold_queries` packs them."""
    b, _, sq = x.shape
    g = fold.group
    x = x.reshape(b, hkv, g, sq).transpose(0, 1, 3, 2).reshape(b, hkv, sq * g)
    return jnp.repeat(x, fold.splits, axis=0) if fold.splits > 1 else x


def join_by_lse(o, lse, axis: int = 1):
    """Attention over disjoint parts of the keys joined: O [.., n, .., dv] and LSE
    (O's shape without dv) with the n parts along ``axis`` -> O (o's dtype) and LSE
    without that axis; each part weighted by exp(its LSE - the row's largest), summed
    in part order (the same bits on every run). Rows no part sees: O 0, LSE -inf."""
    top = jnp.max(lse, axis=axis, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)  # rows masked in every part
    w = jnp.exp(lse - top)
    total = jnp.sum(w, axis=axis)
    out = jnp.sum(o.astype(jnp.float32) * w[..., None], axis=axis)
    out = out / jnp.where(total > 0, total, 1.0)[..., None]
    return out.astype(o.dtype), jnp.squeeze(top, axis) + jnp.log(total)


def join(o, lse, fold: Fold, p: Problem):
    """The chunks' O [b * n, sq * G, hkv, dv] and LSE [b * n, hkv, sq * G] joined and
    unpacked: O [b, sq, hq, dv] and LSE [b, hq, sq], summed in chunk order."""
    n, g = fold.splits, fold.group
    o = o.reshape(p.b, n, p.sq, g, p.hkv, p.dv)
    lse = lse.reshape(p.b, n, p.hkv, p.sq, g).transpose(0, 1, 3, 4, 2)  # as O's rows
    o, lse = join_by_lse(o, lse) if n > 1 else (o[:, 0], lse[:, 0])
    o = o.astype(p.dtype).transpose(0, 1, 3, 2, 4).reshape(p.b, p.sq, p.hq, p.dv)
    lse = lse.transpose(0, 3, 2, 1).reshape(p.b, p.hq, p.sq)
    return o, lse


def forward(call, fold_and_inner, q, k, v, values, run):
    """``(O, LSE)`` of ``call`` folded: ``run(inner, q, k, v, operands)`` runs the
    folded call's kernels."""
    fold, inner = fold_and_inner
    p = call.problem
    folded = operands(call.plan.mod, fold, p, values, inner.plan.mod)
    o, lse = run(inner, fold_queries(q, fold, p.hkv), fold_keys(k, fold), fold_keys(v, fold),
                 folded)
    return join(o, lse, fold, p)


def unfold_queries(x, fold: Fold, p: Problem):
    """The transpose of :func:`fold_queries`: [b * n, sq * G, hkv, d] -> [b, sq, hq, d],
    the chunks summed in float32, in order."""
    d = x.shape[-1]
    x = x.reshape(p.b, fold.splits, p.sq, fold.group, p.hkv, d)
    x = jnp.sum(x.astype(jnp.float32), axis=1) if fold.splits > 1 else x[:, 0]
    return x.transpose(0, 1, 3, 2, 4).reshape(p.b, p.sq, p.hq, d)


def backward(call, fold_and_inner, q, k, v, o, lse, do, values, dlse, wanted, run):
    """``(dQ, dK, dV, {name: gradient} of the operands named in wanted)`` of ``call``
    folded: every chunk's backward on the joined O and LSE (and the LSE's
    cotangent), ``run(inner, q, k, v, o, lse, do, operands, dlse, wanted)`` (the
    same, by the folded operands' names). dQ is summed over the chunks; a
    repeated operand's gradient comes back summed over its copies (the
    transpose of the repeat)."""
    fold, inner = fold_and_inner
    p, mod = call.problem, call.plan.mod
    names = () if mod is None else mod.operand_names
    learn = [i for i, name in enumerate(names) if name in wanted]

    def fold_operands(learned):
        given = list(values)
        for i, x in zip(learn, learned):
            given[i] = x
        return operands(mod, fold, p, given, inner.plan.mod)

    folded, transpose = jax.vjp(fold_operands, [values[i] for i in learn])
    wanted_inner = tuple(tag for tag, name, _ in rewrite(mod, fold, p)[1]
                         if name in wanted) if wanted else ()
    dq, dk, dv, grads = run(inner, fold_queries(q, fold, p.hkv), fold_keys(k, fold),
                            fold_keys(v, fold), fold_queries(o, fold, p.hkv),
                            fold_lse(lse, fold, p.hkv), fold_queries(do, fold, p.hkv), folded,
                            None if dlse is None else fold_lse(dlse, fold, p.hkv), wanted_inner)
    dq = unfold_queries(dq, fold, p).astype(q.dtype)
    dk, dv = (x.reshape(p.b, p.skv, p.hkv, x.shape[-1]) for x in (dk, dv))
    if not learn:
        return dq, dk, dv, {}
    inner_names = inner.plan.mod.operand_names
    cotangents = tuple(grads[name].astype(x.dtype) if name in grads else jnp.zeros_like(x)
                       for name, x in zip(inner_names, folded))
    (learned,) = transpose(cotangents)
    return dq, dk, dv, {names[i]: g for i, g in zip(learn, learned)}
