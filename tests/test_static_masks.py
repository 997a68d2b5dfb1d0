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
