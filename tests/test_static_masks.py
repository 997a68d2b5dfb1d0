"""Static masks skip their empty tiles: the tiles each backend's plan computes
(``Backend.tile_share``) counted on a faked H200, and the Pallas kernels' claim
of the masks whose block map keeps far fewer tiles than cuDNN's plan computes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from scoremod import support
from scoremod.lowering import block_maps
from scoremod.lowering.cudnn.backend import CUDNN
from scoremod.lowering.pallas.backend import CLAIM_MARGIN, MOSAIC_TILE_COST, PALLAS
from scoremod.lowering.problem import Problem
from tests.test_route import h200  # noqa: F401 - the fixture

NEG = -jnp.inf
S = 4096
P = Problem(4, S, S, 16, 16, 128, 128, "bfloat16")
OPTS = scoremod.LoweringOptions()
TILES = (S // 128) ** 2


def _natten(side=64, kr=5, kc=7):
    """The catalogue's NATTEN kernel (5 x 7) on a 64 x 64 canvas."""
    def mod(sc, b, h, q, kv):
        qr, qc, r, c = q // side, q % side, kv // side, kv % side
        cr = jnp.clip(qr, kr // 2, side - 1 - kr // 2)
        cc = jnp.clip(qc, kc // 2, side - 1 - kc // 2)
        return jnp.where((jnp.abs(cr - r) <= kr // 2) & (jnp.abs(cc - c) <= kc // 2), sc, NEG)
    return mod


MODS = {
    "dense": lambda s, b, h, q, k: 30.0 * jnp.tanh(s / 30.0),
    "causal": lambda s, b, h, q, k: jnp.where(q >= k, s, NEG),
    "softcap_causal": lambda s, b, h, q, k: jnp.where(q >= k, 30.0 * jnp.tanh(s / 30.0), NEG),
    "prefix_lm": lambda s, b, h, q, k: jnp.where((k < S // 8) | (q >= k), s, NEG),
    "natten": _natten(),
    "natten_7x7": _natten(kr=7),
    "batchify": lambda s, b, h, q, k: jnp.where((q // 128 == k // 128) & (q % 128 >= k % 128),
                                                s, NEG),
}


def _kept(name):
    return block_maps.static_tiles(scoremod.trace(MODS[name]).expr, S, S)


def test_the_tiles_each_plan_computes():
    """cuDNN: a native mask computes the tiles it keeps, a score_mod block its whole
    rectangle (the backward's own plan weighted 2.5); the Pallas kernels: the tiles
    their block map keeps."""
    dense, causal = (scoremod.trace(MODS[n]) for n in ("dense", "causal"))
    assert CUDNN.tile_share(P, dense, OPTS) == PALLAS.tile_share(P, dense, OPTS) == 1.0
    kept = _kept("causal").sum() / TILES  # 528 of 1024: the diagonal's tiles are kept
    assert kept == pytest.approx(528 / 1024)
    assert CUDNN.tile_share(P, causal, OPTS) == PALLAS.tile_share(P, causal, OPTS) == kept
    # softcap + causal in query blocks: each block's rectangle up to its last row
    split = CUDNN.tile_share(P, scoremod.trace(MODS["softcap_causal"]), OPTS)
    assert kept < split < 0.6
    assert CUDNN.tile_share(P, scoremod.trace(MODS["softcap_causal"]),
                            OPTS.replace(split_blocks=0)) == 1.0
    # natten: the query blocks take the keys from each block's first to its last
    # live tile, about twice the tiles its block map keeps
    natten = scoremod.trace(MODS["natten"])
    ours, theirs = PALLAS.tile_share(P, natten, OPTS), CUDNN.tile_share(P, natten, OPTS)
    assert ours == _kept("natten").mean() < 0.1 and 1.5 * ours < theirs < 0.2


@pytest.mark.parametrize("name,claimed", [("dense", False), ("causal", False),
                                          ("softcap_causal", False), ("prefix_lm", False),
                                          ("natten", True), ("batchify", True),
                                          ("natten_7x7", False)])
def test_the_pallas_kernels_claim_sparse_static_masks(h200, name, claimed):  # noqa: F811
    q = jnp.zeros((P.b, S, P.hq, P.d), jnp.bfloat16)
    mod = scoremod.trace(MODS[name])
    choice = scoremod.which_implementation(q, q, q, mod)
    ours, theirs = PALLAS.tile_share(P, mod, OPTS), CUDNN.tile_share(P, mod, OPTS)
    assert (ours * MOSAIC_TILE_COST <= CLAIM_MARGIN * theirs) == claimed
    if claimed and support.mosaic_missing():  # a jax without the Mosaic GPU engine
        assert choice.implementation == "cudnn", choice
    elif claimed:
        assert choice.implementation == "pallas", choice
        assert f"keeps {ours:.0%} of the tiles, where cudnn's plan computes {theirs:.0%}" in (
            choice.reason)
        # the kernels then compute no tile their block map marks empty
        assert PALLAS.tile_share(P, mod, OPTS) == _kept(name).mean()
    else:
        assert choice.implementation == "cudnn", choice
    # the Triton engine is not the one measured: it claims no static mask
    triton = scoremod.LoweringOptions(pallas_engine="triton")
    assert scoremod.which_implementation(q, q, q, mod, options=triton).implementation == "cudnn"


def test_static_tiles_are_cached_and_read_only():
    expr = scoremod.trace(MODS["causal"]).expr
    a, b = block_maps.static_tiles(expr, S, S), block_maps.static_tiles(expr, S, S)
    assert a is b and not a.flags.writeable
    np.testing.assert_array_equal(a, np.tril(np.ones((32, 32), bool)))
    assert jax.numpy.asarray(a).shape == (32, 32)


def _morton(side):
    """The catalogue's Morton-order NATTEN (5 x 5) on a side x side canvas: pixel
    coordinates decoded from the position with bit operations."""
    from tests.catalogue.mods import CATALOGUE

    entry = CATALOGUE["morton_natten"]
    env = {"R": side, "C": side, "KR": 5, "KC": 5}
    return scoremod.trace(entry.build(env)), entry, env


@pytest.mark.parametrize("tiles", [(128, 128), (64, 128), (128, 64), (64, 64)])
def test_the_morton_map_keeps_exactly_the_live_tiles(tiles):
    """At the catalogue's GPU shape (a 32 x 32 canvas) the block map of Morton-order
    NATTEN keeps exactly the tiles that hold a live pair, at the kernels' tiles
    (forward 128 x 128, backward 64 x 128 and 128 x 64, Triton's 64): the decodes
    read one index each, so they are evaluated exactly along their axis, and
    Morton tiles of powers of two are canvas rectangles, which the comparisons'
    interval rules bound exactly. None is full (a 5 x 5 window)."""
    mod, entry, env = _morton(32)
    problem = Problem(1, 1024, 1024, 1, 1, 128, 128, "bfloat16")
    visited, full = block_maps.classify_tiles(mod.expr, (), problem, *tiles)
    grid = type("Grid", (), dict(b=0, h=0, q=np.arange(1024)[:, None], k=np.arange(1024)[None]))
    live = np.isfinite(entry.reference(np.zeros((1, 1, 1024, 1024)), grid, env))[0, 0]
    bq, bk = tiles
    truth = live.reshape(1024 // bq, bq, 1024 // bk, bk).any(axis=(1, 3))
    np.testing.assert_array_equal(np.asarray(visited)[0, 0], truth)
    assert not np.asarray(full).any()
    if tiles == (128, 128):  # the planner's count: 40 of the 64 tiles
        assert block_maps.static_tiles(mod.expr, 1024, 1024).sum() == truth.sum() == 40


@pytest.mark.parametrize("seq,rule", [(1024, "computed ahead"), (4096, "tile counts")])
def test_the_pallas_kernels_claim_a_static_mask_cudnn_computes_ahead(h200, seq, rule):  # noqa: F811
    """Morton-order NATTEN decodes pixels with bit operations, which cuDNN's graphs
    lack: its plan computes the mask ahead, a [1, 1, S, S] tensor, and visits every
    tile. At 1024 the block map keeps 62.5% of the tiles (x 1.32: 0.82 of cuDNN's
    tiles, above the 0.8 the tile counts alone ask), and the kernels claim the call
    for the tensor they spare; at 4096 the tile counts alone claim it."""
    mod, _, _ = _morton(int(np.sqrt(seq)))
    p = Problem(2, seq, seq, 4, 4, 128, 128, "bfloat16")
    ahead = CUDNN.static_tensor_ahead(p, mod, OPTS)
    assert ahead is not None and "bitwise or shift" in ahead and f"[1,1,{seq},{seq}]" in ahead
    ours, theirs = PALLAS.tile_share(p, mod, OPTS), CUDNN.tile_share(p, mod, OPTS)
    assert theirs == 1.0 and (ours == 0.625 if seq == 1024 else ours < 0.3)
    q = jnp.zeros((p.b, seq, p.hq, p.d), jnp.bfloat16)
    choice = scoremod.which_implementation(q, q, q, mod)
    if support.mosaic_missing():  # a jax without the Mosaic GPU engine
        assert choice.implementation == "cudnn", choice
    else:
        assert choice.implementation == "pallas", choice
        said = "cudnn's graphs lack" if rule == "computed ahead" else "its block map of the mask"
        assert said in choice.reason and "keeps" in choice.reason, choice.reason
    # the Triton engine is not the one measured: it claims no static mask
    triton = scoremod.LoweringOptions(pallas_engine="triton")
    assert scoremod.which_implementation(q, q, q, mod, options=triton).implementation == "cudnn"


@pytest.mark.parametrize("name", ["xor_bias", "parity_mask"])
def test_a_static_tensor_ahead_is_not_claimed_where_the_kernels_visit_more(h200, name):  # noqa: F811
    """A bias, or a mask that keeps every tile, through bit operations: cuDNN
    computes it ahead too, but the kernels would visit every tile at 1.32x cuDNN's
    time per tile, so cuDNN keeps the call."""
    fn = {"xor_bias": lambda s, b, h, q, k: s + ((q ^ k) & 7).astype(jnp.float32),
          "parity_mask": lambda s, b, h, q, k: jnp.where(((q ^ k) & 1) == 0, s, NEG)}[name]
    mod = scoremod.trace(fn)
    p = Problem(2, 1024, 1024, 4, 4, 128, 128, "bfloat16")
    assert CUDNN.static_tensor_ahead(p, mod, OPTS) is not None
    assert PALLAS.tile_share(p, mod, OPTS) == 1.0
    q = jnp.zeros((p.b, 1024, p.hq, p.d), jnp.bfloat16)
    assert scoremod.which_implementation(q, q, q, mod).implementation == "cudnn"


def test_no_static_tensor_ahead_for_what_cudnn_computes_in_its_graphs():
    """Chunks written with // and NATTEN with // and % (cuDNN's graphs compute them
    unsplit; split into query blocks, NATTEN's shifted remainders are computed
    ahead, but each block's tensor covers the tiles it computes, which tile_share
    counts, not the whole matrix), and a mask of captured arrays (claimed by its
    form, not by this), have no static tensor ahead."""
    chunks = scoremod.trace(lambda s, b, h, q, k: jnp.where(q // 64 == k // 64, s, NEG))
    assert CUDNN.static_tensor_ahead(P, chunks, OPTS) is None
    natten = scoremod.trace(MODS["natten"])
    for options in (OPTS, OPTS.replace(split_blocks=0)):
        assert CUDNN.static_tensor_ahead(P, natten, options) is None
    doc = jnp.repeat(jnp.arange(4, dtype=jnp.int32), 256)
    data = scoremod.trace(lambda s, b, h, q, k: jnp.where(doc[q] == doc[k], s, NEG))
    assert CUDNN.static_tensor_ahead(Problem(1, 1024, 1024, 2, 2, 64, 64, "bfloat16"), data,
                                     OPTS) is None
