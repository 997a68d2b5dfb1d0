"""Mods, inputs, block maps and comparisons shared by the Pallas backend's CPU
(interpret mode) and GPU (Triton) tests; the reference path is the oracle.

Each case is a function ``(hq, sq, skv) -> (mod_fn, operands)``: ``mod_fn``
takes the operand values as its trailing arguments (so gradients reach them)
and ``operands`` are float32/int32 arrays.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from scoremod.lowering.backend import Call, execute
from scoremod.lowering.block_maps import BlockMap
from scoremod.lowering.pallas.backend import PALLAS
from scoremod.lowering.problem import Problem
from scoremod.lowering.reference import REFERENCE

NEG = -jnp.inf


def softcap(hq, sq, skv):
    return (lambda s, b, h, q, k: 30.0 * jnp.tanh(s / 30.0)), ()


def causal(hq, sq, skv):
    return (lambda s, b, h, q, k: jnp.where(q >= k, s, NEG)), ()


def softcap_causal(hq, sq, skv):
    return (lambda s, b, h, q, k: jnp.where(q >= k, 20.0 * jnp.tanh(s / 20.0), NEG)), ()


def sliding_window(hq, sq, skv):
    return (lambda s, b, h, q, k: jnp.where((q >= k) & (q - k < 24), s, NEG)), ()


def alibi(hq, sq, skv):
    slopes = jnp.asarray([2.0 ** -(i + 1) for i in range(hq)], jnp.float32)
    return (lambda s, b, h, q, k, sl: jnp.where(q >= k, s + sl[h] * (k - q), NEG)), (slopes,)


def relative_bias(hq, sq, skv):
    # A table per head, gathered at a computed index (the relative position).
    n = 2 * 64 - 1
    table = jnp.asarray(np.random.default_rng(3).normal(size=(hq, n)), jnp.float32)
    return (lambda s, b, h, q, k, t: s + t[h, jnp.clip(k - q + 63, 0, n - 1)]), (table,)


def learnable_softcap(hq, sq, skv):
    cap = jnp.asarray(15.0, jnp.float32)
    return (lambda s, b, h, q, k, c: c * jnp.tanh(s / c)), (cap,)


def head_bias(hq, sq, skv):
    # A learned row per head, read at two constant columns (a scale and a bias).
    w = jnp.asarray(np.random.default_rng(7).normal(size=(hq, 3)) * 0.25 + [1.0, 0.0, 0.5],
                    jnp.float32)
    return (lambda s, b, h, q, k, w: s * w[h, 0] + w[h, 2]), (w,)


def batch_scale(hq, sq, skv):
    # A learned factor per batch, shared by the heads (read at h, clamped to its one column).
    w = jnp.asarray([[0.75], [1.25]], jnp.float32)
    return (lambda s, b, h, q, k, w: s * w[b, h]), (w,)


def document(hq, sq, skv):
    # Per-batch document ids (int32): attention within a document, causal.
    rng = np.random.default_rng(5)
    n = max(sq, skv)
    ids = np.sort(rng.integers(0, 4, size=(2, n)), axis=1).astype(np.int32)
    return (lambda s, b, h, q, k, d: jnp.where((d[b, q] == d[b, k]) & (q >= k), s, NEG)), \
        (jnp.asarray(ids),)


def document_softcap(hq, sq, skv):
    # Document masking with a softcap: per-batch ids of random lengths (int32), causal.
    rng = np.random.default_rng(6)
    n = max(sq, skv)
    ids = np.sort(rng.integers(0, 5, size=(2, n)), axis=1).astype(np.int32)
    return (lambda s, b, h, q, k, d: jnp.where((d[b, q] == d[b, k]) & (q >= k),
                                               30.0 * jnp.tanh(s / 30.0), NEG)), \
        (jnp.asarray(ids),)


def float_compare(hq, sq, skv):
    # Comparisons on floats (the score) and a float modulo.
    return (lambda s, b, h, q, k: jnp.where(s > 0.25, s, jnp.where(s < -1.0, 0.5 * s,
                                                                     s % 0.75))), ()


def masked_rows(hq, sq, skv):
    # Rows 0..20 see no key at all (output 0, LSE -inf), the rest causal.
    return (lambda s, b, h, q, k: jnp.where((q > 20) & (q >= k), s, NEG)), ()


def nan_at_score_zero(hq, sq, skv):
    # The score on every real score (none is 0), NaN at score 0, value and
    # derivative (0 * log|0|, 0 / |0|): the padding's score (zero rows and
    # keys), where the kernels must give no gradient. Its derivative is 1
    # elsewhere, so the comparison is as well conditioned as plain attention's
    # (s * log|s| is NaN there too, but its derivative's slope 1/s near 0 makes
    # float32 results differ by more than rounding between XLA versions).
    return (lambda s, b, h, q, k: s + 0.0 * jnp.log(jnp.abs(s))), ()


def nan_past_the_end(hq, sq, skv):
    # Finite on every real (q, kv), NaN past the ends of both, with a learned
    # factor per head: the padding's NaN must reach neither the gradients of
    # q, k, v nor the factor's.
    t = jnp.asarray([0.6 + 0.1 * i for i in range(hq)], jnp.float32)
    return (lambda s, b, h, q, k, t: s * t[h] * jnp.log((skv - k).astype(jnp.float32))
            * jnp.sqrt((sq - q).astype(jnp.float32) / sq)), (t,)


# The mods on full tiles (every score live): the mask conditions dropped, as
# the block analysis's when_full gives them. Arguments: the operand nodes.
def _score():
    from scoremod.dsl import ir

    return ir.var("score")


def _full_softcap_causal():
    return ops_softcap(20.0)


def ops_softcap(cap):
    from scoremod.dsl import ops

    return ops.apply("tanh", _score() / cap) * cap


WHEN_FULL = {
    "causal": lambda: _score(),
    "softcap_causal": _full_softcap_causal,
    "sliding_window": lambda: _score(),
    "document": lambda ids: _score(),
    "document_softcap": lambda ids: ops_softcap(30.0),
    "masked_rows": lambda: _score(),
}

CASES = {f.__name__: f for f in (softcap, causal, softcap_causal, sliding_window, alibi,
                                  relative_bias, learnable_softcap, head_bias, batch_scale,
                                  document, document_softcap, float_compare, masked_rows,
                                  nan_at_score_zero, nan_past_the_end)}


def doc_ids(b, n, docs=4, seed=11):
    """Document ids per batch: sorted random ids, so documents of random lengths."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.sort(rng.integers(0, docs, size=(b, n)), axis=1), jnp.int32)


def vector_mod(name, b, hq, sq, skv):
    """(mod_fn, operands) as CASES gives them, for the mods below and CASES' own:
    reads of captured arrays along one tile axis (the Mosaic GPU engine's vectors)."""
    n = max(sq, skv)
    doc = doc_ids(b, n)
    if name == "document_bidirectional":
        return (lambda s, b, h, q, k, d: jnp.where(d[b, q] == d[b, k], s, -jnp.inf)), (doc,)
    if name == "global_window":  # bool flags at q_idx and at kv_idx (Longformer's globals)
        flags = jnp.arange(n) % 37 == 5
        return (lambda s, b, h, q, k, g: jnp.where((jnp.abs(q - k) <= 16) | g[q] | g[k], s,
                                                   -jnp.inf)), (flags,)
    if name == "global_window_int":  # the same flags as int32, compared with 0 (refused too)
        flags = (jnp.arange(n) % 37 == 5).astype(jnp.int32)
        return (lambda s, b, h, q, k, g: jnp.where((jnp.abs(q - k) <= 16) | (g[q] != 0)
                                                   | (g[k] != 0), s, -jnp.inf)), (flags,)
    if name == "shifted_bias":  # an offset index, and a float vector per head along kv
        bias = jnp.asarray(np.random.default_rng(12).normal(size=(hq, n)), jnp.float32)
        return (lambda s, b, h, q, k, d, w: jnp.where(d[b, q] >= d[b, k + 1], s + w[h, k],
                                                      -jnp.inf)), (doc, bias)
    if name == "alibi_unmasked":  # a term of each position (split, on the tile's vectors)
        slopes = jnp.asarray([2.0 ** -(i + 1) for i in range(hq)], jnp.float32)
        return (lambda s, b, h, q, k, sl: s + sl[h] * (k - q)), (slopes,)
    if name == "log_scaled":  # the score times a factor of the query, causal
        return (lambda s, b, h, q, k: jnp.where(q >= k, s * jnp.log(q + 2.0), -jnp.inf)), ()
    if name == "key_terms":  # terms of the key alone, one through a vector read per head
        bias = jnp.asarray(np.random.default_rng(26).normal(size=(hq, n)), jnp.float32)
        return (lambda s, b, h, q, k, w: s + 0.5 * w[h, k] - 0.1 * jnp.sqrt(k + 1.0)), (bias,)
    if name == "key_chunks":  # a factor per 4 keys, shared by every head: positions repeat
        factor = jnp.asarray(np.random.default_rng(19).normal(size=(-(-n // 4),)) * 0.3,
                             jnp.float32)
        return (lambda s, b, h, q, k, w: s * (1.0 + w[k // 4])), (factor,)
    if name == "query_scale":  # a factor of the score per head and query, under a causal mask
        factor = jnp.asarray(np.random.default_rng(20).normal(size=(hq, n)) * 0.3, jnp.float32)
        return (lambda s, b, h, q, k, w: jnp.where(q >= k, s * (1.0 + w[h, q]), -jnp.inf)
                ), (factor,)
    if name == "grid_bias":  # a 2-D relative position (an 8 x 8 grid): a gather
        table = jnp.asarray(np.random.default_rng(13).normal(size=(hq, 15, 15)), jnp.float32)
        return (lambda s, b, h, q, k, t: s + t[h, q // 8 % 8 - k // 8 % 8 + 7,
                                               q % 8 - k % 8 + 7]), (table,)
    if name == "score_lookup":  # a lookup table [H, 64] of the score, causal
        table = jnp.asarray(np.random.default_rng(44).normal(size=(hq, 64)) * 0.5, jnp.float32)
        return (lambda s, b, h, q, k, t: jnp.where(
            q >= k, s + t[h, jnp.clip((s * 4 + 32).astype(jnp.int32), 0, 63)], -jnp.inf)), \
            (table,)
    if name == "swin_bias":  # Swin's: a learned table [H, 169] at a relative index per score
        rng = np.random.default_rng(43)
        rel = jnp.asarray(rng.integers(0, 169, size=(sq, skv)), jnp.int32)
        table = jnp.asarray(rng.normal(size=(hq, 169)), jnp.float32)
        return (lambda s, b, h, q, k, r, t: s + t[h, r[q, k]]), (rel, table)
    if name == "block_map":  # video sparse attention's tile map, padded keys of the last tile
        rng = np.random.default_rng(21)
        tiles = -(-n // 64)
        keep = rng.random((b, hq, tiles, tiles)) < 0.4
        keep[..., np.arange(tiles), np.arange(tiles)] = True  # no row without a key
        sizes = np.full(tiles, 64, np.int32)
        sizes[-1] = 59
        return (lambda s, b, h, q, k, m, z: jnp.where(m[b, h, q // 64, k // 64]
                                                      & (k % 64 < z[k // 64]), s, -jnp.inf)
                ), (jnp.asarray(keep), jnp.asarray(sizes))
    if name in ("kind_pair", "kind_mask", "kind_query_scale", "kind_key_bias"):  # token kinds
        rng = np.random.default_rng(25)
        kind = jnp.asarray(rng.integers(0, 3, size=(b, n)), jnp.int32)
        if name == "kind_pair":  # a per-head bias of each (query kind, key kind): a gather
            pair = jnp.asarray(rng.normal(size=(hq, 3, 3)), jnp.float32)
            return (lambda s, b, h, q, k, c, t: s + t[h, c[b, q], c[b, k]]), (kind, pair)
        if name == "kind_query_scale":  # a factor per head and query kind, causal
            per_kind = jnp.asarray(1.0 + 0.3 * rng.normal(size=(hq, 3)), jnp.float32)
            return (lambda s, b, h, q, k, c, w: jnp.where(q >= k, s * w[h, c[b, q]], -jnp.inf)
                    ), (kind, per_kind)
        if name == "kind_key_bias":  # a bias per head and key kind
            per_kind = jnp.asarray(rng.normal(size=(hq, 3)), jnp.float32)
            return (lambda s, b, h, q, k, c, w: s + w[h, c[b, k]]), (kind, per_kind)
        # which kinds see which (an int table), causal, and a per-kind-pair scale
        allowed = jnp.asarray([[1, 0, 0], [1, 1, 0], [1, 1, 1]], jnp.int32)
        scale = jnp.asarray(1.0 + 0.2 * rng.normal(size=(3, 3)), jnp.float32)
        return (lambda s, b, h, q, k, c, a, w: jnp.where(
            (a[c[b, q], c[b, k]] != 0) | (q == k), s * w[c[b, q], c[b, k]], -jnp.inf)
                ), (kind, allowed, scale)
    if name == "pair_bias":  # a float bias per score, per batch and head (Flax's ``bias``)
        bias = jnp.asarray(np.random.default_rng(31).normal(size=(b, hq, sq, skv)), jnp.float32)
        return (lambda s, b, h, q, k, t: s + t[b, h, q, k]), (bias,)
    if name == "half_bias":  # a bfloat16 bias per score (kept 16-bit, widened as loaded)
        bias = jnp.asarray(np.random.default_rng(35).normal(size=(b, hq, sq, skv)), jnp.bfloat16)
        return (lambda s, b, h, q, k, t: s + t[b, h, q, k]), (bias,)
    if name == "masked_bias":  # Flax's mask [B, 1, Sq, Skv] (random, causal) and bias per head
        rng = np.random.default_rng(36)
        keep = (rng.random((b, 1, sq, skv)) < 0.7) & (np.arange(sq)[:, None] >= np.arange(skv))
        bias = jnp.asarray(rng.normal(size=(hq, sq, skv)), jnp.float32)
        return (lambda s, b, h, q, k, m, t: jnp.where(m[b, 0, q, k], s + t[h, q, k], -jnp.inf)
                ), (jnp.asarray(keep), bias)
    if name == "head_bias_causal":  # a bias per head shared by the batch, scaled score, causal
        bias = jnp.asarray(np.random.default_rng(32).normal(size=(hq, sq, skv)), jnp.float32)
        return (lambda s, b, h, q, k, t: jnp.where(q >= k, 0.5 * s + t[h, q, k], -jnp.inf)
                ), (bias,)
    if name == "wider_bias":  # longer than the sequences (entries past them unread), head pairs
        bias = jnp.asarray(np.random.default_rng(33).normal(size=(-(-hq // 2), sq + 5, skv + 9)),
                           jnp.float32)
        return (lambda s, b, h, q, k, t: s + t[h // 2, q, k]), (bias,)
    if name == "capped_bias":  # softcap over score and bias: the bias's derivative varies
        bias = jnp.asarray(np.random.default_rng(34).normal(size=(1, hq, sq, skv)) * 3.0,
                           jnp.float32)
        return (lambda s, b, h, q, k, t: 5.0 * jnp.tanh((s + t[0, h, q, k]) / 5.0)), (bias,)
    if name == "transposed_bias":  # a bias stored keys first: bias[h, kv_idx, q_idx], causal
        bias = jnp.asarray(np.random.default_rng(37).normal(size=(hq, skv, sq)), jnp.float32)
        return (lambda s, b, h, q, k, t: jnp.where(q >= k, s + t[h, k, q], -jnp.inf)), (bias,)
    if name == "pair_features":  # pair features [B, Sq, Skv, 3], a head's feature per score
        feats = jnp.asarray(np.random.default_rng(38).normal(size=(b, sq, skv, 3)), jnp.float32)
        return (lambda s, b, h, q, k, t: s + 0.5 * t[b, q, k, h % 3]), (feats,)
    if name == "edge_types":  # an edge type per pair [B, Sq, Skv, 2] picks a learned weight
        rng = np.random.default_rng(39)
        types = jnp.asarray(rng.integers(0, 5, size=(b, sq, skv, 2)), jnp.int32)
        weight = jnp.asarray(rng.normal(size=(hq, 5)), jnp.float32)
        return (lambda s, b, h, q, k, c, w: s + w[h, c[b, q, k, 1]]), (types, weight)
    if name == "query_pairs_bias":  # one row per two queries: t[h, q // 2, kv_idx], causal
        bias = jnp.asarray(np.random.default_rng(40).normal(size=(hq, -(-sq // 2), skv)),
                           jnp.float32)
        return (lambda s, b, h, q, k, t: jnp.where(q >= k, s + t[h, q // 2, k], -jnp.inf)
                ), (bias,)
    if name == "key_pairs_bias":  # one column per two keys, the queries' axis their own
        bias = jnp.asarray(np.random.default_rng(41).normal(size=(b, sq, -(-skv // 2))),
                           jnp.float32)
        return (lambda s, b, h, q, k, t: s + t[b, q, k // 2]), (bias,)
    if name == "wrapped_bias":  # a 64 x 96 bias tiled over the scores: no axis of its own
        bias = jnp.asarray(np.random.default_rng(42).normal(size=(hq, 64, 96)), jnp.float32)
        return (lambda s, b, h, q, k, t: s + t[h, q % 64, k % 96]), (bias,)
    if name == "block_bias":  # a float bias per block of 48 queries by 32 keys (by >> 5)
        table = jnp.asarray(np.random.default_rng(22).normal(size=(hq, -(-n // 48), -(-n // 32))),
                            jnp.float32)
        return (lambda s, b, h, q, k, t: s + t[h, q // 48, k >> 5]), (table,)
    if name == "block_bias64":  # a float bias per block of 64 queries by 32 keys, causal
        table = jnp.asarray(np.random.default_rng(23).normal(size=(hq, -(-n // 64), -(-n // 32))),
                            jnp.float32)
        return (lambda s, b, h, q, k, t: jnp.where(q >= k, s + t[h, q // 64, k >> 5], -jnp.inf)
                ), (table,)
    if name == "block_map_bias":  # a tile map, and a learned bias per batch, head, 128 x 128
        rng = np.random.default_rng(24)
        tiles = -(-n // 64)
        keep = rng.random((b, hq, tiles, tiles)) < 0.5
        keep[..., np.arange(tiles), np.arange(tiles)] = True
        table = jnp.asarray(rng.normal(size=(b, hq, -(-n // 128), -(-n // 128))), jnp.float32)
        return (lambda s, b, h, q, k, m, t: jnp.where(m[b, h, q // 64, k // 64],
                                                      s + t[b, h, q // 128, k // 128], -jnp.inf)
                ), (jnp.asarray(keep), table)
    if name == "relative_softcap":  # relbias's index (jax.numpy wraps negatives) under a softcap
        table = jnp.asarray(np.random.default_rng(14).normal(size=(hq, sq + skv - 1)),
                            jnp.float32)
        return (lambda s, b, h, q, k, t: 20.0 * jnp.tanh((s + t[h, q - k + skv - 1]) / 20.0)
                ), (table,)
    if name == "relative_causal":  # a decoder's: causal, a table of the distance back
        table = jnp.asarray(np.random.default_rng(16).normal(size=(hq, n)), jnp.float32)
        return (lambda s, b, h, q, k, t: jnp.where(q >= k, s + t[h, q - k], -jnp.inf)), (table,)
    if name == "relative_masked":  # -inf runs in the table: the block map skips their tiles
        rng = np.random.default_rng(18)
        table = rng.normal(size=(hq, sq + skv - 1))
        table[:, :skv - 1] = -np.inf  # q < kv: a causal mask written into the table
        table[:, skv - 1 + 200:skv - 1 + 330] = -np.inf  # and a band of distances
        return (lambda s, b, h, q, k, t: s + t[h, q - k + skv - 1]
                ), (jnp.asarray(table, jnp.float32),)
    if name == "relative_document":  # packed documents with a relative table (shared memory)
        table = jnp.asarray(np.random.default_rng(17).normal(size=(hq, sq + skv - 1)),
                            jnp.float32)
        return (lambda s, b, h, q, k, d, t: jnp.where(d[b, q] == d[b, k],
                                                      s + t[h, q - k + skv - 1], -jnp.inf)
                ), (doc, table)
    if name == "relative_buckets":  # T5's: an int bucket table at kv - q, then a float table
        buckets = jnp.asarray(np.clip(np.arange(-n + 1, n) // 16, -8, 8) + 8, jnp.int32)
        table = jnp.asarray(np.random.default_rng(15).normal(size=(17, hq)), jnp.float32)
        return (lambda s, b, h, q, k, u, t: s + t[u[k - q + n - 1], h]), (buckets, table)
    return CASES[name](hq, sq, skv)


def traced_vector_mod(name, q, k):
    fn, operands = vector_mod(name, q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    mod = scoremod.trace(lambda s, b, h, qi, ki: fn(s, b, h, qi, ki, *operands))
    return mod, tuple(mod.operands)


def inputs(b=2, sq=80, skv=72, hq=4, hkv=2, d=64, dv=None, dtype=jnp.float32, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    dv = d if dv is None else dv
    q = jax.random.normal(keys[0], (b, sq, hq, d), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (b, skv, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (b, skv, hkv, dv), jnp.float32).astype(dtype)
    do = jax.random.normal(keys[3], (b, sq, hq, dv), jnp.float32).astype(dtype)
    return q, k, v, do


def traced(case, q, k):
    """(ScoreMod, operand values) of ``case`` at the shapes of q and k."""
    fn, operands = CASES[case](q.shape[2], q.shape[1], k.shape[1])
    mod = scoremod.trace(lambda s, b, h, qi, ki: fn(s, b, h, qi, ki, *operands))
    return mod, tuple(mod.operands)


def mask_block_map(mod, operands, problem, block_q, block_kv) -> BlockMap:
    """The exact tiles to visit: those where the mod leaves some score finite
    (evaluated by the reference path on every entry, scores 0 and 0.5), per batch."""
    bound = mod.bind(**dict(zip(mod.operand_names, operands))) if operands else mod
    bi = np.arange(problem.b)[:, None, None, None]
    hi = np.arange(problem.hq)[None, :, None, None]
    qi = np.arange(problem.sq)[None, None, :, None]
    ki = np.arange(problem.skv)[None, None, None, :]
    shape = (problem.b, problem.hq, problem.sq, problem.skv)
    # Live where the mod is finite at score 0 or 0.5 (s * log|s| is NaN at 0 alone).
    live = functools.reduce(np.logical_or, (np.isfinite(np.broadcast_to(np.asarray(
        bound(jnp.full((), s, jnp.float32), bi, hi, qi, ki)), shape)) for s in (0.0, 0.5)))
    return map_from_mask(live, block_q, block_kv)


def map_from_mask(live, block_q, block_kv) -> BlockMap:
    """A BlockMap visiting the tiles of ``live`` [B, H, Sq, Skv] with any True entry."""
    b, h, sq, skv = live.shape
    nq, nk = -(-sq // block_q), -(-skv // block_kv)
    pad = np.zeros((b, h, nq * block_q, nk * block_kv), bool)
    pad[:, :, :sq, :skv] = live
    tiles = pad.reshape(b, h, nq, block_q, nk, block_kv).any(axis=(3, 5))  # [b, h, nq, nk]
    inside = np.zeros_like(pad)
    inside[:, :, :sq, :skv] = True
    # Full: every score inside the sequences live (padding is masked by the kernels).
    full = (pad | ~inside).reshape(b, h, nq, block_q, nk, block_kv).all(axis=(3, 5)) & tiles

    def listing(t, f):  # t, f [b, h, n, m] -> counts [b, h, n], ids and full flags [b, h, n, m]
        counts = t.sum(-1).astype(np.int32)
        ids = np.zeros(t.shape, np.int32)
        flags = np.zeros(t.shape, bool)
        for idx in np.ndindex(*t.shape[:-1]):
            on = np.flatnonzero(t[idx])
            row = np.full(t.shape[-1], on[-1] if len(on) else 0, np.int32)
            row[:len(on)] = on
            ids[idx] = row
            flags[idx] = f[idx][row]
        return jnp.asarray(counts), jnp.asarray(ids), jnp.asarray(flags)

    qc, qb, qf = listing(tiles, full)
    kc, kb, kf = listing(np.swapaxes(tiles, 2, 3), np.swapaxes(full, 2, 3))
    return BlockMap(qc, qb, qf, kc, kb, kf)


def pallas_plan(mod, q, k, v, options, skip=False, scale=None, full_expr=None):
    """The Pallas plan of ``mod``; ``skip``: visit only live tiles (the map also
    marks full ones), where ``full_expr`` (if given) replaces the mod."""
    problem = Problem.of(q, k, v)
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    plan = PALLAS.plan(problem, mod, scale, options, True)
    if skip:
        plan = dataclasses.replace(plan, block_map=_Skipping(mod, tuple(mod.operands)))
    if full_expr is not None:
        plan = dataclasses.replace(plan, full_expr=full_expr)
    return plan


class _Skipping:
    """A plan's block_map that visits only the tiles the mask leaves live, read
    from the operand values it was made with (concrete: usable under jit)."""

    def __init__(self, mod, operands):
        self.mod, self.operands = mod, tuple(np.asarray(x) for x in operands)

    def __call__(self, problem, block_q, block_kv, operands):
        del operands  # maybe traced; the values given at construction are the same
        with jax.ensure_compile_time_eval():
            return mask_block_map(self.mod, self.operands, problem, block_q, block_kv)


def call(backend, plan, q, k, v, options=None):
    """``plan`` of ``backend`` as ``scoremod.attention`` runs it (the pipeline of
    lowering.backend.execute), under ``options`` (default: LoweringOptions())."""
    return Call(backend, plan, Problem.of(q, k, v),
                scoremod.LoweringOptions() if options is None else options)


def run(backend, plan, q, k, v, do, operands, learn_operands=True, options=None):
    """O, LSE and the gradients of <O, dO> + 0.1 * sum(finite LSE) in q, k, v and
    (with ``learn_operands``) the float operands (the LSE term checks its
    gradient too), jitted; the call runs as ``scoremod.attention`` runs it,
    under ``options``."""
    return _run(call(backend, plan, q, k, v, options), bool(learn_operands), q, k, v, do,
                tuple(operands))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _run(call, learn_operands, q, k, v, do, operands):
    learn = [i for i, x in enumerate(operands)
             if learn_operands and jnp.issubdtype(x.dtype, jnp.floating)]

    def loss(q, k, v, floats):
        ops = list(operands)
        for i, x in zip(learn, floats):
            ops[i] = x
        o, lse = execute(call, q, k, v, tuple(ops))
        lse_term = jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)) + 0.1 * lse_term, (o, lse)

    floats = tuple(operands[i] for i in learn)
    (_, (o, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
        q, k, v, floats)
    op_grads = [None] * len(operands)
    for i, g in zip(learn, grads[3]):
        op_grads[i] = g
    return o, lse, grads[0], grads[1], grads[2], tuple(op_grads)


def both(case, q, k, v, do, options, skip=False, scale=None, full=None, learn_operands=True,
         check_plan=None):
    """(pallas results, reference results) of ``case``; each is
    (O, LSE, dQ, dK, dV, operand gradients). ``full``: a function of the mod's
    operand nodes giving the mod on full tiles (with ``skip``); ``learn_operands``:
    also the float operands' gradients; ``check_plan``: called with the Pallas plan."""
    mod, operands = traced(case, q, k)
    full_expr = None if full is None else full(*mod.operand_nodes)
    plan = pallas_plan(mod, q, k, v, options, skip, scale, full_expr)
    if check_plan is not None:
        check_plan(plan)
    ref_plan = REFERENCE.plan(Problem.of(q, k, v), mod, plan.scale, options, True)
    return (run(PALLAS, plan, q, k, v, do, operands, learn_operands),
            run(REFERENCE, ref_plan, q.astype(jnp.float32), k.astype(jnp.float32),
                v.astype(jnp.float32), do.astype(jnp.float32), operands, learn_operands))


def relative_errors(got, want) -> dict:
    """Max |a - b| / max |b| per result; inf where -inf (masked rows) differ in place."""
    names = ("O", "LSE", "dQ", "dK", "dV")
    pairs = list(zip(names, got[:5], want[:5]))
    pairs += [(f"d_operand{i}", a, b) for i, (a, b) in enumerate(zip(got[5], want[5]))
              if b is not None and jnp.issubdtype(jnp.asarray(b).dtype, jnp.floating)]
    errs = {}
    for name, a, b in pairs:
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if not np.array_equal(np.isneginf(a), np.isneginf(b)):
            errs[name] = float("inf")
            continue
        fin = np.isfinite(b)
        if not np.isfinite(a[fin]).all():
            errs[name] = float("nan")
            continue
        scale = np.max(np.abs(b[fin]), initial=0.0) + 1e-6
        errs[name] = float(np.max(np.abs(a[fin] - b[fin]), initial=0.0) / scale)
    return errs


@pytest.fixture(autouse=True)
def quiet():
    """JAX's and Pallas's deprecation warnings kept out of the Pallas tests'
    output (autouse in every module that imports it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        yield


def same_bits(got, want):
    """bool, elementwise: float32 ``got`` and ``want`` hold the same bits (any NaN
    equal to any NaN)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return (got.view(np.int32) == want.view(np.int32)) | (np.isnan(got) & np.isnan(want))


def not_subnormal(x):
    """bool, elementwise: float32 ``x`` is 0, normal, infinite or NaN."""
    return (np.abs(x) >= np.float32(1.1754944e-38)) | (x == 0) | ~np.isfinite(x)


def tile_rule(rule, a, b, interpret=False):
    """``rule(a, b)`` (a ``mosaic.TILE_RULES`` entry) on float32 tiles [64, 128] in
    a Mosaic GPU kernel, as the kernels evaluate a mod: in registers, in the
    wgmma accumulator's layout, with the kernels' approximate math."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax.experimental import pallas as pl

    def entry(a_ref, b_ref, o_ref):
        def body(a_smem, b_smem, o_smem, barriers):
            for i, (src, dst) in enumerate(((a_ref, a_smem), (b_ref, b_smem))):
                plgpu.copy_gmem_to_smem(src, dst, barriers.at[i])
                plgpu.barrier_wait(barriers.at[i])
            x, y = (plgpu.load(r, layout=plgpu.Layout.WGMMA, optimized=False)
                    for r in (a_smem, b_smem))
            o_smem[...] = rule(x, y)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_ref)
            plgpu.wait_smem_to_gmem(0)

        smem = plgpu.SMEM(a.shape, jnp.float32)
        pl.run_scoped(body, smem, smem, smem, plgpu.Barrier(num_barriers=2))

    return plgpu.kernel(entry, out_type=jax.ShapeDtypeStruct(a.shape, jnp.float32),
                        compiler_params=plgpu.CompilerParams(approx_math=True),
                        interpret=interpret)(a, b)
