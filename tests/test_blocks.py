"""Block sparsity from the IR (lowering/block_maps.py) against brute force.

Every tile the map skips must be -inf on every entry for every score tried
(huge, zero, signed), and on every tile it calls full, ``when_full(expr)``
must equal the mod bit for bit. For the masks the analysis reads exactly
(bands, documents, chunks, captured id arrays), the classes must also be the
true ones: no partial tile that is really empty or full.
"""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import scoremod
from scoremod import positions
from scoremod.dsl import ir, ops
from scoremod.dsl.evaluate import evaluate
from scoremod.lowering import block_maps, intervals
from scoremod.lowering.block_maps import block_lists, block_map, classify_tiles, map_axes
from scoremod.lowering.pallas import mosaic, mosaic_backward
from scoremod.lowering.patterns import mask_conditions, when_full
from scoremod.lowering.problem import Problem
from tests import test_differential as differential
from tests import test_properties as properties
from tests import tiers
from tests.catalogue import verdict as catalogue_verdict
from tests.catalogue.mods import CATALOGUE

NEG_INF = -jnp.inf
F32_MAX = float(np.finfo(np.float32).max)


def problem(b=2, sq=40, skv=40, h=3):
    return Problem(b, sq, skv, h, h, 8, 8, "float32")


def _grid(p):
    return (jnp.arange(p.b, dtype=jnp.int32)[:, None, None, None],
            jnp.arange(p.hq, dtype=jnp.int32)[None, :, None, None],
            jnp.arange(p.sq, dtype=jnp.int32)[None, None, :, None],
            jnp.arange(p.skv, dtype=jnp.int32)[None, None, None, :])


def _scores(p, seed=0):
    """Finite scores of every kind: normal, huge of both signs, zeros, ties."""
    rng = np.random.default_rng(seed)
    shape = (p.b, p.hq, p.sq, p.skv)
    out = [rng.normal(0, 3, shape), rng.normal(0, 1, shape) * 1e30, np.zeros(shape),
           np.where(rng.random(shape) < 0.5, -F32_MAX, F32_MAX),
           rng.integers(-3, 4, shape) * 0.5]
    return [jnp.asarray(x, jnp.float32) for x in out]


def _values(exprs, mod, p, scores):
    """Each of ``exprs`` on every entry of ``p``, once per score array: one jitted
    program. Arrays [len(scores), B, H, Sq, Skv]."""
    shape = (p.b, p.hq, p.sq, p.skv)

    def one(s, ops):
        b, h, q, k = _grid(p)
        inputs = {"score": s, "b": b, "h": h, "q_idx": q, "kv_idx": k}
        named = dict(zip(mod.operand_names, ops))
        return [jnp.broadcast_to(evaluate(e, inputs, named), shape) for e in exprs]

    out = jax.jit(jax.vmap(one, in_axes=(0, None)))(jnp.stack(scores), tuple(mod.operands))
    return [np.asarray(x) for x in out]


def _tiles(p, bq, bk):
    for i in range(-(-p.sq // bq)):
        for j in range(-(-p.skv // bk)):
            yield i, j, (slice(i * bq, (i + 1) * bq), slice(j * bk, (j + 1) * bk))


def _expand(x, p):
    return np.broadcast_to(np.asarray(x), (p.b, p.hq) + x.shape[2:])


def check(mod, p, bq, bk, *, tight=False, exact="auto", seed=0):
    """Soundness (and with ``tight``, exactness) of the map of ``mod`` on ``p``."""
    expr = mod.expr
    visited, full = jax.jit(lambda ops: classify_tiles(expr, ops, p, bq, bk, exact=exact))(
        mod.operands)
    bm, hm = map_axes(expr, p)
    assert visited.shape == (bm, hm, -(-p.sq // bq), -(-p.skv // bk))
    visited, full = _expand(visited, p), _expand(full, p)
    scores = _scores(p, seed)
    conds, conflicting = mask_conditions(expr)
    outs, fulls, *cond_values = _values([expr, when_full(expr), *conds], mod, p, scores)
    masked = np.all(outs == -np.inf, axis=0)
    kept = np.ones(masked.shape, bool) & (not conflicting)
    for v, value in zip(cond_values, conds.values()):
        kept &= v[0] == value
    for i, j, (rows, cols) in _tiles(p, bq, bk):
        tile_masked = masked[:, :, rows, cols].all(axis=(2, 3))
        tile_kept = kept[:, :, rows, cols].all(axis=(2, 3))
        skipped = ~visited[:, :, i, j]
        assert not (skipped & ~tile_masked).any(), f"tile {(i, j)} skipped but not all -inf"
        for o, f in zip(outs, fulls):
            same = (o[:, :, rows, cols] == f[:, :, rows, cols]) | (
                np.isnan(o[:, :, rows, cols]) & np.isnan(f[:, :, rows, cols]))
            bad = full[:, :, i, j] & ~same.all(axis=(2, 3))
            assert not bad.any(), f"tile {(i, j)} full but when_full differs"
        if tight:
            np.testing.assert_array_equal(skipped, tile_masked, err_msg=f"tile {(i, j)} empty?")
            np.testing.assert_array_equal(full[:, :, i, j], tile_kept & ~tile_masked,
                                          err_msg=f"tile {(i, j)} full?")
    return visited, full


def trace(fn):
    return scoremod.trace(fn)


RNG = np.random.default_rng(1)
DOC = jnp.asarray(np.sort(RNG.integers(0, 4, (2, 40)), axis=1), jnp.int32)
# A tile list (video sparse attention): query tile q // 4 sees the key tiles it lists;
# padded with -1 where it lists fewer; key tile kv // 4 listing the query tiles it serves.
TOPK = jnp.asarray(np.random.default_rng(7).integers(0, 10, (2, 3, 10, 2)), jnp.int32)
_LISTS = np.random.default_rng(8)
TOPK_PADDED = jnp.asarray(np.where(_LISTS.random((2, 3, 10, 3)) < 0.3, -1,
                                   _LISTS.integers(0, 10, (2, 3, 10, 3))), jnp.int32)
KEY_LISTS = jnp.asarray(_LISTS.integers(0, 10, (2, 10, 3)), jnp.int32)
# Each document's first position: local positions q - OFFSETS[b, DOC[b, q]]; shifted
# so far that q - offset wraps (int32) from each document's sixth position on: the
# first five then compare above all later ones, keys after the query included.
OFFSETS = jnp.asarray(np.stack([np.searchsorted(np.asarray(row), np.arange(4))
                                for row in DOC]), jnp.int32)
OFFSETS_WRAPPING = jnp.asarray(np.asarray(OFFSETS).astype(np.int64) + 5 - 2**31, jnp.int32)
DOC_SHUFFLED = jnp.asarray(RNG.integers(0, 3, (2, 40)), jnp.int32)
MASK = jnp.asarray(RNG.random((2, 40, 40)) < 0.3)
BLOCKY = jnp.asarray(np.kron(RNG.random((5, 5)) < 0.5, np.ones((8, 8), bool)))
SLOPES = jnp.asarray([0.5, 0.25, 0.125], jnp.float32)
WINDOWS = jnp.asarray([4, 9, 40], jnp.int32)
BIAS = jnp.asarray(np.where(np.kron(RNG.random((5, 5)) < 0.4, np.ones((8, 8))) > 0,
                            -np.inf, RNG.normal(size=(40, 40))), jnp.float32)
# Relative positions: a table per head over q - kv with -inf runs (skipped diagonals),
# T5-style buckets at kv - q indexing a float table.
REL = jnp.asarray(np.where(np.repeat(RNG.random((3, 10)) < 0.3, 8, axis=1)[:, :79] > 0,
                           -np.inf, RNG.normal(size=(3, 79))), jnp.float32)
BUCKETS = jnp.asarray(np.clip(np.arange(-39, 40) // 6, -4, 4) + 4, jnp.int32)
BUCKET_BIAS = jnp.asarray(RNG.normal(size=(9, 3)), jnp.float32)


def _spread(x):
    """The even bits of x packed together: a Morton code's column (of x >> 1, its row)."""
    x = x & 0x55555555
    x = (x | (x >> 1)) & 0x33333333
    x = (x | (x >> 2)) & 0x0F0F0F0F
    return (x | (x >> 4)) & 0x00FF00FF


# name -> (mod, whether the analysis is exact for it)
MODS = {
    "causal": (lambda s, b, h, q, k: jnp.where(q >= k, s, NEG_INF), True),
    "sliding_window": (lambda s, b, h, q, k: jnp.where((q >= k) & (q - k < 10), s, NEG_INF), True),
    "chunked": (lambda s, b, h, q, k: jnp.where(q // 12 == k // 12, s, NEG_INF), True),
    "prefix_lm": (lambda s, b, h, q, k: jnp.where((k < 13) | (q >= k), s, NEG_INF), True),
    "document": (lambda s, b, h, q, k: jnp.where(DOC[b, q] == DOC[b, k], s, NEG_INF), True),
    "document_causal": (lambda s, b, h, q, k: jnp.where((DOC[b, q] == DOC[b, k]) & (q >= k),
                                                        s, NEG_INF), False),
    # Causal within each document through its local positions: the offsets cancel
    # where the documents are equal (block_maps.congruent), unless the local positions
    # may wrap (then the map is the one of the mod as written).
    "document_local_causal": (lambda s, b, h, q, k: jnp.where(
        (DOC[b, q] == DOC[b, k]) & (q - OFFSETS[b, DOC[b, q]] >= k - OFFSETS[b, DOC[b, k]]),
        s, NEG_INF), False),
    "document_local_causal_wrapping": (lambda s, b, h, q, k: jnp.where(
        (DOC[b, q] == DOC[b, k])
        & (q - OFFSETS_WRAPPING[b, DOC[b, q]] >= k - OFFSETS_WRAPPING[b, DOC[b, k]]),
        s, NEG_INF), False),
    "alibi_causal": (lambda s, b, h, q, k: jnp.where(q >= k, s + SLOPES[h] * (k - q), NEG_INF),
                     True),
    "softcap": (lambda s, b, h, q, k: 30.0 * jnp.tanh(s / 30.0), True),
    "additive_causal": (lambda s, b, h, q, k: s + jnp.where(q >= k, 0.0, NEG_INF), True),
    "negated_window": (lambda s, b, h, q, k: jnp.where((q < k) | (q - k >= 7), NEG_INF, s), True),
    "head_windows": (lambda s, b, h, q, k: jnp.where((q >= k) & (q - k < WINDOWS[h]), s, NEG_INF),
                     True),
    "shuffled_document": (lambda s, b, h, q, k: jnp.where(
        DOC_SHUFFLED[b, q] == DOC_SHUFFLED[b, k], s, NEG_INF), False),
    "captured_mask": (lambda s, b, h, q, k: jnp.where(MASK[b, q, k], s, NEG_INF), True),
    "blocky_mask": (lambda s, b, h, q, k: jnp.where(BLOCKY[q, k] & (k <= q + 20), s, NEG_INF),
                    False),
    "stride_mask": (lambda s, b, h, q, k: jnp.where((q - k) % 4 == 0, s, NEG_INF), True),
    "head_stride_mask": (lambda s, b, h, q, k: jnp.where(
        ((q - k) % (WINDOWS[h] + b) == 0) | (q < 3), s, NEG_INF), True),
    "bias_with_inf": (lambda s, b, h, q, k: s + BIAS[q, k], True),
    "batch_bias_causal": (lambda s, b, h, q, k: jnp.where(
        q + 5 >= k, s + BIAS[q, k] * (b + 1), NEG_INF), True),
    "score_condition": (lambda s, b, h, q, k: jnp.where((q >= k) & (s > 0.5), s, NEG_INF),
                        False),
    "masked_then_softcap": (lambda s, b, h, q, k: 5.0 * jnp.tanh(
        jnp.where(q >= k, s, NEG_INF) / 5.0), True),
    # Bounded per tile from their diagonals (a chunk may reach past the tile: not tight).
    "relative_bias_inf": (lambda s, b, h, q, k: s + REL[h, q - k + 39], False),
    "relative_condition": (lambda s, b, h, q, k: jnp.where(REL[h, k - q + 39] > 0.2, s,
                                                           NEG_INF), False),
    "relative_buckets": (lambda s, b, h, q, k: s + BUCKET_BIAS[BUCKETS[k - q + 39], h], False),
    # Per tile, whether the listed tiles meet the keys' (counts per tile and value): a
    # tile the lists fill between them is full; -1 slots meet nothing. The `and` with
    # q >= k is bounded by its rule (each may hold in a tile where both never do).
    "tile_list": (lambda s, b, h, q, k: jnp.where(
        (TOPK[b, h, q // 4, 0] == k // 4) | (TOPK[b, h, q // 4, 1] == k // 4), s, NEG_INF), True),
    "tile_list_any": (lambda s, b, h, q, k: jnp.where(
        (TOPK_PADDED[b, h, q // 4] == k // 4).any(), s, NEG_INF), True),
    "tile_list_all_differ": (lambda s, b, h, q, k: jnp.where(
        (TOPK_PADDED[b, h, q // 4] != k // 4).all(), NEG_INF, s), True),
    "key_tile_list": (lambda s, b, h, q, k: jnp.where(
        (KEY_LISTS[b, k // 4] == q // 4).any(), s, NEG_INF), True),
    # The captured side shared, the known ones listed: values outside their range (-1).
    "known_lists": (lambda s, b, h, q, k: jnp.where(
        (DOC_SHUFFLED[b, k] * 3 - 1 == q // 8) | (DOC_SHUFFLED[b, k] * 3 - 1 == q // 8 + 2),
        s, NEG_INF), True),
    "tile_list_not": (lambda s, b, h, q, k: jnp.where(
        (TOPK[b, h, q // 4, 0] != k // 4) & (q >= k), s, NEG_INF), False),
    # Bit operations: per-axis decodes (evaluated exactly along their axis) and
    # conditions mixing the indices through them (per tile under "auto"). Morton
    # rows and columns are bounded apart: exact on tiles of aligned powers of two
    # (test_static_masks), not on these.
    "morton_window": (lambda s, b, h, q, k: jnp.where(
        (jnp.abs(_spread(q >> 1) - _spread(k >> 1)) <= 1)
        & (jnp.abs(_spread(q) - _spread(k)) <= 1), s, NEG_INF), False),
    "xor_bits": (lambda s, b, h, q, k: jnp.where(((q ^ k) & 12) == 0, s, NEG_INF), True),
    "shifted_band": (lambda s, b, h, q, k: jnp.where(((q - k) >> 3) == 0, s, NEG_INF), True),
}


@pytest.mark.parametrize("name", sorted(MODS))
@pytest.mark.parametrize("sq,skv,bq,bk", [(40, 40, 8, 8), (33, 40, 8, 16),
                                         (40, 27, 6, 5)])
def test_sound_and_tight(name, sq, skv, bq, bk):
    fn, tight = MODS[name]
    p = problem(sq=sq, skv=skv)
    check(trace(fn), p, bq, bk, tight=tight)


def test_document_offsets_cancel_within_a_document():
    """document causal through local positions (attention-gym's document mask):
    the map equals the one of ``doc[q] == doc[kv] & q >= kv`` (where each side's
    offsets spanned two documents, the bounds visited tiles with no key), and
    where the local positions may wrap, the mod's own map (which visits more)."""
    p = problem(sq=40, skv=40)
    maps = {name: check(trace(MODS[name][0]), p, 8, 8)[0]
            for name in ("document_local_causal", "document_causal",
                         "document_local_causal_wrapping")}
    np.testing.assert_array_equal(maps["document_local_causal"], maps["document_causal"])
    expr = trace(MODS["document_local_causal"][0]).expr
    assert block_maps.congruent(expr)[1], "no offsets cancelled"
    loose = jax.jit(lambda ops: block_maps._classify(
        expr, block_maps._operand_values(expr, ops), p, 8, 8, "auto")[0])(
            trace(MODS["document_local_causal"][0]).operands)
    assert _expand(loose, p).sum() > maps["document_causal"].sum()  # what it gains
    # Wrapping: entries above the diagonal are kept (q - offset wrapped to a large
    # int), so q >= kv would drop live tiles; the map keeps them.
    assert maps["document_local_causal_wrapping"].sum() > maps["document_causal"].sum()


def test_causal_is_the_lower_triangle():
    visited, full = check(trace(MODS["causal"][0]), problem(sq=64, skv=64), 16, 16, tight=True)
    tri = np.tril(np.ones((4, 4), bool))
    np.testing.assert_array_equal(visited[0, 0], tri)
    np.testing.assert_array_equal(full[0, 0], np.tril(tri, -1))


@pytest.mark.parametrize("name", ["causal", "softcap", "natten", "dead", "log_of_zero"])
def test_static_map_is_the_map_as_host_constants(name):
    """A mod of the indices alone gets its map from the host (NumPy, cached: the
    kernels' programs hold it as constants, even while a jit traces), equal to the
    one built in the program (without mask conditions or non-finite constants
    every tile, all full, unanalysed: a mod -inf for every score there, the log
    of 0, is visited needlessly); an expression reading a captured array is
    refused."""
    fn = {"causal": MODS["causal"][0],
          "softcap": lambda s, b, h, q, k: 30.0 * jnp.tanh(s / 30.0),
          "natten": lambda s, b, h, q, k: jnp.where(
              (jnp.abs(q // 16 - k // 16) <= 1) & (jnp.abs(q % 16 - k % 16) <= 2), s, NEG_INF),
          "dead": lambda s, b, h, q, k: jnp.where(q < 0, s, NEG_INF),
          "log_of_zero": lambda s, b, h, q, k: jnp.log(s * 0.0)}[name]
    mod = trace(fn)
    p = problem(sq=200, skv=136)
    want = block_map(mod.expr, {}, p, 64, 128)
    if name == "log_of_zero":
        assert not np.asarray(want.q_counts).any()
        want = block_maps.dense_block_map(sq=200, skv=136, block_q=64, block_kv=128)
        want = want._replace(q_full=~want.q_full, kv_full=~want.kv_full)
    inside = []
    jax.jit(lambda x: inside.append(block_maps.static_block_map(mod.expr, p, 64, 128)) or x)(1)
    for m in (block_maps.static_block_map(mod.expr, p, 64, 128), inside[0]):
        assert all(isinstance(x, np.ndarray) for x in m)
        for a, b in zip(m, want):
            np.testing.assert_array_equal(a, b)
    assert block_maps.static_block_map(mod.expr, p, 64, 128) is inside[0]  # cached


def test_a_static_map_with_captured_arrays_is_refused():
    doc = jnp.array([0, 0, 1, 1])
    ids = scoremod.trace(lambda s, b, h, q, k: jnp.where(doc[q] == doc[k], s, NEG_INF))
    with pytest.raises(scoremod.ScoreModError, match="captured"):
        block_maps.static_block_map(ids.expr, problem(sq=4, skv=4), 2, 2)


def test_document_visits_only_overlapping_documents():
    doc = jnp.asarray(np.repeat([0, 1, 2, 3], 16)[None], jnp.int32)
    mod = trace(lambda s, b, h, q, k: jnp.where(doc[b, q] == doc[b, k], s, NEG_INF))
    visited, full = check(mod, Problem(1, 64, 64, 2, 2, 8, 8, "float32"), 8, 8, tight=True)
    np.testing.assert_array_equal(visited[0, 0], np.kron(np.eye(4, dtype=bool),
                                                         np.ones((2, 2), bool)))
    np.testing.assert_array_equal(full[0, 0], visited[0, 0])


def test_softcap_is_all_full():
    mod = trace(MODS["softcap"][0])
    visited, full = classify_tiles(mod.expr, (), problem(), 8, 8)
    assert visited.shape[:2] == (1, 1) and bool(full.all())
    assert when_full(mod.expr) is mod.expr


def test_map_keeps_the_axes_the_mask_reads():
    p = problem()
    assert map_axes(trace(MODS["causal"][0]).expr, p) == (1, 1)
    assert map_axes(trace(MODS["alibi_causal"][0]).expr, p) == (1, 1)  # h in the score only
    assert map_axes(trace(MODS["document"][0]).expr, p) == (2, 1)
    assert map_axes(trace(MODS["head_windows"][0]).expr, p) == (1, 3)
    assert map_axes(trace(MODS["captured_mask"][0]).expr, p) == (2, 1)


def test_when_full_drops_exactly_the_mask():
    mod = trace(MODS["score_condition"][0])
    s = ir.var("score")
    assert when_full(mod.expr) is ir.build("where", ir.build("gt", s, ir.const(0.5, "f32")), s,
                                           ir.const(-np.inf, "f32"))
    doc_causal = trace(MODS["document_causal"][0])
    assert when_full(doc_causal.expr) is s


def test_per_tile_evaluation_is_used_for_loose_masks():
    """A captured [Sq, Skv] mask: the rules bound a load at both indices by the
    whole array (every tile partial); the per-tile evaluation finds the true
    classes."""
    mod = trace(lambda s, b, h, q, k: jnp.where(BLOCKY[q, k], s, NEG_INF))
    p = problem()
    never, _ = check(mod, p, 8, 8, exact="never")
    auto, _ = check(mod, p, 8, 8, exact="auto", tight=True)
    assert never.all() and not auto.all()


def test_relative_positions_are_bounded_on_their_diagonals(monkeypatch):
    """A table read at q_idx - kv_idx is bounded per tile from its values on the
    tile's diagonals (O(S)), never by evaluating every entry: tiles on -inf
    diagonals only are skipped, and the classes equal the entry-by-entry ones
    wherever the tiles' diagonals are whole chunks (square tiles)."""
    band = np.zeros((2, 127), np.float32)
    band[:, 63 + 16:63 + 40] = -np.inf  # q - kv in [16, 40) masked
    table = jnp.asarray(band)
    mod = trace(lambda s, b, h, q, k: s + table[h, q - k + 63])
    p = Problem(1, 64, 64, 2, 2, 8, 8, "float32")
    exact, _ = classify_tiles(mod.expr, mod.operands, p, 8, 8, exact="always")

    def no_entries(*a, **k):
        raise AssertionError("a relative table was evaluated entry by entry")

    monkeypatch.setattr("scoremod.lowering.block_maps._Tiles.per_tile", no_entries)
    visited, full = classify_tiles(mod.expr, mod.operands, p, 8, 8)
    assert not bool(visited.all())  # the masked band skips tiles
    assert bool((visited | ~exact).all())  # sound: every tile the entries need is visited
    diagonals = np.arange(8)[:, None] * 8 - np.arange(8)[None, :] * 8
    inside = (diagonals - 7 >= 16) & (diagonals + 7 < 40)  # tiles wholly on the band
    np.testing.assert_array_equal(np.asarray(visited[0, 0]), ~inside)


def test_jit_takes_operands_as_arguments():
    mod = trace(MODS["document"][0])
    p = problem()
    f = jax.jit(lambda doc: block_map(mod.expr, (doc,), p, 8, 8))
    text = f.lower(DOC).as_text()
    assert "callback" not in text
    one, other = f(DOC), f(jnp.zeros_like(DOC))
    assert int(other.q_counts.sum()) == p.b * 5 * 5  # one document: everything
    assert int(one.q_counts.sum()) < int(other.q_counts.sum())
    eager = block_map(mod.expr, {"c0": DOC}, p, 8, 8)
    for a, b in zip(one, eager):
        np.testing.assert_array_equal(a, b)


def test_a_tile_list_is_tight_under_jit():
    """The ``.any()`` of equalities of values of the queries (a list padded with -1)
    and one of the keys: the tiles where their sets of values meet and those every
    entry of which meets, from counts per tile and value, with the list a jit argument
    (computed in the program): the classes of the entries, as evaluating each finds."""
    mod = trace(MODS["tile_list_any"][0])
    p = problem()
    # Query blocks of two listed tiles: full where both list the key block's tile.
    exact, exact_full = classify_tiles(mod.expr, mod.operands, p, 8, 4, exact="always")
    got, full = jax.jit(lambda topk: classify_tiles(mod.expr, (topk,), p, 8, 4))(TOPK_PADDED)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(exact))
    np.testing.assert_array_equal(np.asarray(full), np.asarray(exact_full))
    assert np.asarray(full).any() and not np.asarray(full).all()  # some full, not all
    # a range wider than the table takes: the interval rule, sound and looser
    from scoremod.lowering import block_maps

    wide = block_maps._Tiles.values_meet.__defaults__
    try:
        block_maps._Tiles.values_meet.__defaults__ = (3,)
        fallback, _ = classify_tiles(mod.expr, mod.operands, p, 8, 4)
    finally:
        block_maps._Tiles.values_meet.__defaults__ = wide
    assert bool((np.asarray(fallback) | ~np.asarray(exact)).all())
    assert np.asarray(fallback).mean() > np.asarray(exact).mean()


# The tiles the Pallas kernels' maps take: the Triton engine's forward and backward
# (the options' defaults), the Mosaic GPU engine's forward and its backward's kernels.
_OPTS = scoremod.LoweringOptions()
PALLAS_TILES = sorted({(_OPTS.pallas_block_q, _OPTS.pallas_block_kv),
                       (_OPTS.pallas_backward_block_q, _OPTS.pallas_backward_block_kv),
                       (mosaic.TILE_Q, mosaic.BLOCK_KV), mosaic_backward.DKDV_BLOCKS,
                       mosaic_backward.DQ_BLOCKS, mosaic_backward.DIAGONAL_BLOCKS})
# The catalogue's masks the planner gives the Pallas kernels (vsa_topk first: the fast
# tier runs it), and those whose maps are loose there: an `and` (or `or`) of conditions
# each holding somewhere in a tile where they never hold together (a document equality
# and causal order), bounded by its rule.
CATALOGUE_MASKS = sorted((n for n, e in CATALOGUE.items()
                          if e.verdict.startswith("block-sparse Pallas kernels")
                          and "table" not in e.verdict), key=lambda n: (n != "vsa_topk", n))
LOOSE: set = set()  # every catalogue mask visits exactly its live tiles at its GPU shapes
# ... and finds exactly its full tiles, but for these: an `or` of conjunctions, each of
# which holds on part of a tile (no rule finds that they cover it together).
LOOSE_FULL = {"shared_prefix"}


@pytest.mark.parametrize("name", CATALOGUE_MASKS)
def test_catalogue_masks_at_their_gpu_shapes(name):
    """The map of each catalogue mask at its GPU shape and every tile size of the
    Pallas kernels (its arrays traced, as in their program) against the entries its
    NumPy reference keeps: no tile with a kept entry skipped, none called full that
    masks one; outside ``LOOSE``, exactly those tiles (vsa_topk's ``.any()`` of a tile
    list: every tile it visits holds a kept entry, every one it finds full only kept
    entries)."""
    e = CATALOGUE[name]
    shape, env = e.gpu, e.env(e.gpu)
    mod = trace(e.build(env))
    kept = np.isfinite(e.modified_scores(np.zeros((shape.b, shape.h, shape.sq, shape.skv)),
                                         env))
    p = catalogue_verdict.problem(shape)
    for bq, bk in PALLAS_TILES:
        visited, full = jax.jit(lambda ops: classify_tiles(mod.expr, ops, p, bq, bk))(
            tuple(mod.operands))
        visited, full = _expand(visited, p), _expand(full, p)
        nq, nk = visited.shape[2:]
        pad = [(0, 0), (0, 0), (0, nq * bq - shape.sq), (0, nk * bk - shape.skv)]
        live = np.pad(kept, pad).reshape(shape.b, shape.h, nq, bq, nk, bk).any(axis=(3, 5))
        whole = np.pad(kept, pad, constant_values=True).reshape(
            shape.b, shape.h, nq, bq, nk, bk).all(axis=(3, 5)) & live
        where = f"{name} at {bq} x {bk}"
        assert not (live & ~visited).any(), f"{where}: a tile with kept entries skipped"
        assert not (full & ~whole).any(), f"{where}: a tile called full masks an entry"
        if name not in LOOSE:
            np.testing.assert_array_equal(visited, live, err_msg=f"{where}: visited")
        if name not in LOOSE | LOOSE_FULL:
            np.testing.assert_array_equal(full, whole, err_msg=f"{where}: full")


def test_wrong_operand_count_is_refused():
    mod = trace(MODS["document"][0])
    with pytest.raises(scoremod.ScoreModError, match="1 operands, 0 were given"):
        block_map(mod.expr, (), problem(), 8, 8)
    with pytest.raises(scoremod.ScoreModError, match="exact="):
        block_map(mod.expr, (DOC,), problem(), 8, 8, exact="sometimes")


def _check_lists(m, visited, full):
    visited, full = np.asarray(visited), np.asarray(full)
    for blocks_, counts, flags, vis, fl in (
            (m.q_blocks, m.q_counts, m.q_full, visited, full),
            (m.kv_blocks, m.kv_counts, m.kv_full, visited.swapaxes(-1, -2),
             full.swapaxes(-1, -2))):
        blocks_, counts, flags = np.asarray(blocks_), np.asarray(counts), np.asarray(flags)
        for idx in np.ndindex(counts.shape):
            want = np.flatnonzero(vis[idx])
            n = counts[idx]
            assert n == len(want)
            np.testing.assert_array_equal(blocks_[idx][:n], want)
            pad = want[-1] if n else 0
            assert (blocks_[idx][n:] == pad).all()
            np.testing.assert_array_equal(flags[idx], fl[idx][blocks_[idx]])


@pytest.mark.parametrize("name", ["causal", "document_causal", "prefix_lm", "captured_mask"])
def test_lists_and_transpose_match_the_tiles(name):
    mod = trace(MODS[name][0])
    p = problem(sq=40, skv=27)
    visited, full = classify_tiles(mod.expr, mod.operands, p, 6, 5)
    m = block_map(mod.expr, mod.operands, p, 6, 5)
    _check_lists(m, visited, full)
    # The transpose lists, read back, are the forward tiles.
    again = np.zeros(np.asarray(visited).shape, bool)
    kb, kc = np.asarray(m.kv_blocks), np.asarray(m.kv_counts)
    for idx in np.ndindex(kc.shape):
        again[idx[:2] + (slice(None),)][kb[idx][:kc[idx]], idx[2]] = True
    np.testing.assert_array_equal(again, visited)


def test_lists_of_random_tiles():
    rng = np.random.default_rng(5)
    visited = jnp.asarray(rng.random((2, 3, 7, 5)) < 0.4)
    full = visited & jnp.asarray(rng.random((2, 3, 7, 5)) < 0.5)
    _check_lists(block_lists(visited, full), visited, full)


def test_dense_map_lists_every_tile():
    m = block_maps.dense_block_map(batch=1, heads=1, sq=40, skv=27, block_q=6, block_kv=5)
    ones = jnp.ones((1, 1, 7, 6), bool)
    _check_lists(m, ones, ~ones)


def test_interval_rules_handle_wrapping():
    # q * 2**30 wraps: no tile may be skipped on a bound that wrapped.
    mod = trace(lambda s, b, h, q, k: jnp.where(q * 1073741824 - k >= 0, s, NEG_INF))
    check(mod, problem(), 8, 8)
    mod = trace(lambda s, b, h, q, k: jnp.where(q + 2147483600 > k + 2147483600, s, NEG_INF))
    check(mod, problem(), 8, 8)


# --- the bit operations' interval rules ----------------------------------------

_EDGES = np.array([ir.INT32_MIN, ir.INT32_MIN + 1, -2**20, -33, -1, 0, 1, 7, 31, 32, 2**20,
                   ir.INT32_MAX - 1, ir.INT32_MAX], np.int64)


def _intervals(rng, n, amounts=False):
    """``n`` random int32 intervals (lo, hi): ends at int32's edges, anywhere, or
    small; for shift amounts mostly in [-40, 40], outside [0, 31] too."""
    def ends():
        pick = rng.integers(0, 3, n)
        small = rng.integers(-40, 41, n) if amounts else rng.integers(-64, 65, n)
        return np.where(pick == 0, rng.choice(_EDGES, n),
                        np.where(pick == 1, rng.integers(ir.INT32_MIN, ir.INT32_MAX, n,
                                                         endpoint=True), small))
    a, b = ends(), ends()
    return np.minimum(a, b), np.maximum(a, b)


def _inside(rng, lo, hi, m):
    """``m`` values of each interval: its ends and values between."""
    u = rng.random((len(lo), m))
    x = lo[:, None] + np.floor(u * (hi - lo + 1)[:, None]).astype(np.int64)
    x[:, 0], x[:, 1] = lo, hi
    return np.clip(x, lo[:, None], hi[:, None]).astype(np.int32)


@pytest.mark.parametrize("name", sorted(intervals.BIT_OPS))
def test_bit_operation_rules_are_sound(name):
    """Every value of a bit operation on arguments inside their intervals lies in
    the rule's bound (never an under-approximation): random intervals of mixed
    signs, int32's ends, shift amounts outside [0, 31], values at the ends and
    between. The values are the op table's (XLA's) own."""
    rng = np.random.default_rng(sorted(intervals.BIT_OPS).index(name))
    op, n, m = ops.OPS[name], 4000, 24
    shift = "shift" in name
    (alo, ahi), (blo, bhi) = _intervals(rng, n), _intervals(rng, n, amounts=shift)
    xs, ys = _inside(rng, alo, ahi, m), _inside(rng, blo, bhi, m)
    ys = ys[:, rng.permutation(m)]  # pair the ends of one with values inside the other
    q, k = ir.var("q_idx"), ir.var("kv_idx")
    node = ops.apply(name, q) if op.arity == 1 else ops.apply(name, q, k)
    args = [intervals.Ints(jnp.asarray(alo, jnp.int32)[:, None],
                           jnp.asarray(ahi, jnp.int32)[:, None]),
            intervals.Ints(jnp.asarray(blo, jnp.int32)[:, None],
                           jnp.asarray(bhi, jnp.int32)[:, None])][:op.arity]
    bound = intervals.RULES[name](node, *args)
    assert bound.lo.dtype == bound.hi.dtype == jnp.int32
    got = np.asarray(op.evaluate([jnp.asarray(xs), jnp.asarray(ys)][:op.arity]))
    lo, hi = (np.broadcast_to(np.asarray(x), got.shape) for x in (bound.lo, bound.hi))
    bad = (got < lo) | (got > hi)
    i, j = np.argwhere(bad)[0] if bad.any() else (0, 0)
    assert not bad.any(), (f"{name}: {xs[i, j]} in [{alo[i]}, {ahi[i]}], {ys[i, j]} in "
                           f"[{blo[i]}, {bhi[i]}] gives {got[i, j]}, outside "
                           f"[{lo[i, j]}, {hi[i, j]}]")


def test_bit_operation_rules_bound_what_they_should():
    """Where the signs are known the bounds are useful: a mask keeps [0, mask],
    an or of non-negative values stays below the next power of two, ~x and
    shifts by constants are exact."""
    def bound(name, *args):
        node = ops.apply(name, *[ir.var(v) for v in ("q_idx", "kv_idx")[:len(args)]])
        b = intervals.RULES[name](node, *(intervals.Ints(jnp.int32(lo), jnp.int32(hi))
                                          for lo, hi in args))
        return int(b.lo), int(b.hi)

    assert bound("bitwise_and", (-100, 5000), (0x55, 0x55)) == (0, 0x55)
    assert bound("bitwise_and", (3, 900), (0, 0x0F0F)) == (0, 900)
    assert bound("bitwise_and", (-5, -1), (-8, -2)) == (ir.INT32_MIN, -2)
    assert bound("bitwise_or", (3, 5), (8, 9)) == (8, 15)
    assert bound("bitwise_or", (-7, -2), (0, 100)) == (-7, -1)
    assert bound("bitwise_xor", (0, 5), (0, 9)) == (0, 15)
    assert bound("invert", (-3, 5)) == (-6, 2)
    assert bound("right_shift", (-17, 1023), (3, 3)) == (-3, 127)
    assert bound("right_shift", (-17, 1023), (40, 40)) == (-1, 0)  # the sign
    assert bound("shift_right_logical", (0, 1000), (-1, 2)) == (0, 1000)
    assert bound("left_shift", (-3, 5), (2, 4)) == (-48, 80)
    assert bound("left_shift", (1, 1), (31, 31)) == (ir.INT32_MIN, ir.INT32_MAX)  # wraps
    assert bound("left_shift", (5, 9), (32, 40)) == (0, 0)


def test_static_tiles_bound_a_mask_through_a_shift():
    """The planner's tile count (``static_tiles``: the rules alone, no per-tile
    evaluation) of a band written with a shift, ``(q - kv) >> 4 == 0``: the
    diagonal tiles and those just below, as brute force finds (without a rule
    for the shift, every tile)."""
    mod = trace(lambda s, b, h, q, k: jnp.where(((q - k) >> 4) == 0, s, NEG_INF))
    kept = block_maps.static_tiles(mod.expr, 1024, 1024)
    q, k = np.arange(1024)[:, None], np.arange(1024)[None, :]
    live = ((q - k) >> 4) == 0
    np.testing.assert_array_equal(kept, live.reshape(8, 128, 8, 128).any(axis=(1, 3)))
    assert kept.sum() == 8 + 7


# --- random mods ------------------------------------------------------------

SETTINGS = settings(max_examples=tiers.examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(properties.SPECS, st.integers(0, 2**16))
def test_random_property_mods(spec, seed):
    fn = properties._as_fn(spec)
    mod = trace(lambda s, b, h, q, k: jnp.where(q >= k - 3, fn(s, b, h, q, k), NEG_INF))
    p = Problem(2, 9, 11, 8, 8, 4, 4, "float32")
    check(mod, p, 3, 4, seed=seed)


@pytest.mark.parametrize("seed", range(18))
def test_random_congruences(seed):
    """Within doc[q] == doc[kv], a comparison of two positions less (or plus) a
    table read at each side's document (``block_maps.congruent``): documents in
    runs or scattered, tables near either int32 edge or not (the sides wrap or
    not), each comparison and form, with another condition beside: sound against
    brute force, the rewrite taking part (but for ``==``, a meet of its own)."""
    rng = np.random.default_rng(seed)
    docs = rng.integers(0, 4, (2, 24))
    docs = jnp.asarray(np.sort(docs, axis=1) if seed % 2 else docs, jnp.int32)
    edge = (0, 2**31 - 25, -2**31 + 3)[seed % 3]
    table = jnp.asarray((rng.integers(-5, 30, (2, 4)) + edge + 2**31) % 2**32 - 2**31, jnp.int32)
    compare = ("__ge__", "__gt__", "__le__", "__lt__", "__eq__", "__ne__")[seed % 6]
    form = seed // 6  # 0: q - t >= kv - t, 1: t + q >= kv + t, 2: the equality reversed

    def mod(s, b, h, q, k):
        tq, tk = table[b, docs[b, q]], table[b, docs[b, k]]
        same = docs[b, k] == docs[b, q] if form == 2 else docs[b, q] == docs[b, k]
        sides = (tq + q, k + tk) if form == 1 else (q - tq, k - tk)
        return jnp.where(same & getattr(sides[0], compare)(sides[1]) & (q + 7 >= k), s, NEG_INF)

    traced = trace(mod)
    # (An equality of the two sides is itself one of a query value and a key value.)
    assert bool(block_maps.congruent(traced.expr)[1]) == (compare != "__eq__")
    check(traced, problem(sq=24, skv=20), 4, 3, seed=seed)


@pytest.mark.parametrize("seed", range(16))
def test_random_row_intervals(seed):
    """An `and` of conditions on one index alone and bounds of the other index by
    values of the first (``_Tiles.intervals``): random bounds per batch row and
    position, near the int32 edges or not, each comparison either way round,
    bounds of kv_idx by the queries or of q_idx by the keys, with conditions on
    either side: sound against brute force, and the tiles visited exactly those
    with a kept entry."""
    rng = np.random.default_rng(100 + seed)
    edge = (0, 0, ir.INT32_MAX - 3, ir.INT32_MIN + 3)[seed % 4]
    lo, hi = (jnp.asarray(np.clip(rng.integers(-6, 34, (2, 40)).astype(np.int64) + edge,
                                  ir.INT32_MIN, ir.INT32_MAX), jnp.int32) for _ in range(2))
    keep_row, keep_col = (jnp.asarray(rng.random((2, 40)) < 0.7) for _ in range(2))
    ops = ("__ge__", "__gt__", "__le__", "__lt__")
    first, second = ops[seed // 4], ops[(seed + seed // 4) % 4]  # with each edge
    keys_bounded = (seed // 2) % 2 == 0  # else q_idx is bounded by values of the keys

    def mod(s, b, h, q, k):
        this, that = (q, k) if keys_bounded else (k, q)
        cond = (getattr(that, first)(lo[b, this]) & getattr(hi[b, this] + h, second)(that)
                & keep_row[b, this] & keep_col[b, that])
        return jnp.where(cond, s, NEG_INF)

    p = problem(sq=33, skv=40)
    traced = trace(mod)
    visited, _ = check(traced, p, 8, 6, seed=seed)
    b, h, q, k = _grid(p)
    live = np.isfinite(np.asarray(mod(jnp.float32(0), b, h, q, k)))
    nq, nk = visited.shape[2:]
    live = np.pad(live, [(0, 0), (0, 0), (0, nq * 8 - p.sq), (0, nk * 6 - p.skv)])
    live = live.reshape(p.b, p.hq, nq, 8, nk, 6).any(axis=(3, 5))
    np.testing.assert_array_equal(visited, live)


@pytest.mark.parametrize("seed", range(20))
def test_random_differential_masks(seed):
    """where(random condition, random body, -inf) from the differential tests'
    generator: int edge values, wrapping products, divisions by zero, tables."""
    rng = random.Random(seed)
    gen = differential.Gen(rng, traced_only=True)
    mod = None
    while mod is None:  # the tracer refuses some (float % has no op): draw again
        conds = []
        while len(conds) < 3:
            c, _, lit = gen.expr("b", rng.randint(1, 4))
            if not lit:
                conds.append(c)
        body, _, _ = gen.expr("f", rng.randint(0, 3))
        js = (f"jnp.where(({conds[0]}) & ({conds[1]}), "
              f"jnp.where({conds[2]}, {body}, -jnp.inf), -jnp.inf)")
        mod = differential._traced(differential._fn(js))
    p = Problem(2, 13, 10, 3, 3, 4, 4, "float32")
    for exact in ("never", "always"):
        check(mod, p, 4, 3, exact=exact, seed=seed)


def test_run_lists_match_the_lists_of_runs():
    """Rows of one run of visited tiles list the same from their first tile onwards
    (``_run_lists``) as through the general lists; a row with gaps lists them too
    (its first to its last tile), and an empty row none."""
    rng = np.random.default_rng(11)
    n = 9
    first = rng.integers(0, n, (2, 3, 5))
    length = rng.integers(0, n + 1, (2, 3, 5))
    at = np.arange(n)
    visited = (at >= first[..., None]) & (at < (first + length)[..., None])
    full = visited & (rng.random(visited.shape) < 0.5)
    runs = block_maps._run_lists(jnp.asarray(visited), jnp.asarray(full))
    for got, want in zip(runs, block_maps._lists(jnp.asarray(visited), jnp.asarray(full))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    gaps = np.zeros((1, 1, 2, n), bool)
    gaps[0, 0, 0, [2, 5, 6]] = True
    counts, blocks, flags = (np.asarray(x) for x in block_maps._run_lists(
        jnp.asarray(gaps), jnp.asarray(gaps)))
    assert counts.tolist() == [[[5, 0]]] and blocks[0, 0, 0, :5].tolist() == [2, 3, 4, 5, 6]
    assert flags[0, 0, 0, :5].tolist() == [True, False, False, True, True]


def test_interval_axes_of_bounds():
    """Rows (columns) are runs where every mask condition on kv_idx (q_idx) bounds
    it and no array read outside them varies with it."""
    bias = jnp.zeros((4, 64), jnp.float32)
    doc = jnp.zeros((1, 64), jnp.int32)
    cases = {
        "causal": (lambda s, b, h, q, k: jnp.where(q >= k, s, -jnp.inf), (True, True)),
        "window": (lambda s, b, h, q, k: jnp.where((q >= k) & (q - k < 16), s, -jnp.inf),
                   (True, True)),
        "alibi causal": (lambda s, b, h, q, k: jnp.where(
            q >= k, s + 0.5 * (k - q).astype(jnp.float32), -jnp.inf), (True, True)),
        "prefix": (lambda s, b, h, q, k: jnp.where((k < 8) | (q >= k), s, -jnp.inf),
                   (False, False)),
        "document": (lambda s, b, h, q, k: jnp.where(doc[b, q] == doc[b, k], s, -jnp.inf),
                     (False, False)),
        "key bias": (lambda s, b, h, q, k: jnp.where(q >= k, s + bias[h, k], -jnp.inf),
                     (False, True)),
        "striped": (lambda s, b, h, q, k: jnp.where(k % 8 < 4, s, -jnp.inf), (False, True)),
        "softcap": (lambda s, b, h, q, k: 30.0 * jnp.tanh(s / 30.0), (True, True)),
    }
    for name, (fn, want) in cases.items():
        assert block_maps.interval_axes(trace(fn).expr) == want, name
    window = trace(cases["window"][0])
    lengths = jnp.asarray([40, 64], jnp.int32)
    placed = positions.apply_positions(window, 2, q_offset=lengths - 1, kv_lengths=lengths)
    assert block_maps.interval_axes(placed.expr) == (True, True)


@pytest.mark.parametrize("seed", range(6))
def test_maps_at_traced_positions_list_runs_as_the_general_lists(seed):
    """A window and causal mask at traced positions and lengths (a decode step, a
    prefill chunk): the map's lists (runs) equal the general lists of its tiles."""
    rng = np.random.default_rng(seed)
    b, sq, skv = 3, int(rng.integers(1, 40)), int(rng.integers(40, 300))
    width = int(rng.integers(1, 100))
    mod = trace(lambda s, b_, h, q, k: jnp.where((q >= k) & (q - k < width), s, -jnp.inf))
    lengths = jnp.asarray(rng.integers(0, skv + 1, b), jnp.int32)
    offsets = jnp.maximum(lengths - sq, 0)
    placed = positions.apply_positions(mod, b, q_offset=offsets, kv_lengths=lengths)
    p = problem(b=b, sq=sq, skv=skv)
    bq, bk = int(rng.choice([8, 16])), int(rng.choice([8, 16, 32]))
    m = jax.jit(lambda ops: block_map(placed.expr, ops, p, bq, bk))(placed.operands)
    visited, full = classify_tiles(placed.expr, placed.operands, p, bq, bk)
    want = block_lists(visited, full)
    for got, expected in zip(m, want):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
