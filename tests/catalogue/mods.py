"""The score and mask mods of attention-gym (its masks/, mods/ and examples),
written fresh in jax.numpy, each with an independent NumPy reference.

An :class:`Entry` is

- ``code``: Python source defining ``mod(s, b, h, q, k)`` (a lambda or a def),
  run with ``jnp``, ``jax`` and the entry's setup values in scope: this is the
  port, and docs/catalogue.md shows it as it is;
- ``setup(shape, rng)``: the captured arrays and constants at a shape, made
  from a seeded NumPy generator (NumPy arrays; the port sees them as jax
  arrays);
- ``reference(s, g, env)``: the scores ``s`` (float64 [B, H, Sq, Skv]) after
  the mod, computed from what the mod means with NumPy loops and broadcasting
  (never through scoremod or the port's expression); ``g`` holds the index
  grids ``b, h, q, k`` broadcastable against ``s``;
- ``verdict``: what planning the fused path at the GPU shape says (see
  ``verdict.py``): ``fused``, ``native <band>``, ``split into N query blocks``,
  ``materialized [dims]: <why>`` or ``refused: <op>``;
- ``needs``: set while the port uses an op the op table does not have yet
  (its tests are strict xfails: once the op lands they pass, which fails
  them, and ``needs`` is to be deleted and ``verdict`` set to what the plan
  says; the port and its reference are checked against each other already,
  by plain JAX under jax.vmap);
- ``grad``: the mod adds a bias (or a mask) to the score; the CPU test also
  checks its gradients against plain attention plus that bias.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

NEG_INF = -np.inf


@dataclasses.dataclass(frozen=True)
class Shape:
    b: int
    h: int
    sq: int
    skv: int


CPU = Shape(2, 4, 128, 128)
GPU = Shape(2, 4, 1024, 1024)


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    family: str
    what: str
    origin: str  # where attention-gym defines it
    code: str
    setup: Callable  # (Shape, np.random.Generator) -> dict
    reference: Callable  # (s, grids, env) -> modified s
    verdict: str
    cpu: Shape = CPU
    gpu: Shape = GPU
    needs: str | None = None
    grad: bool = False  # also check gradients on the CPU

    def env(self, shape: Shape, seed: int = 0) -> dict:
        return self.setup(shape, np.random.default_rng(seed))

    def build(self, env: dict, namespace=jnp):
        """The port: ``mod`` from ``code`` with ``env``'s arrays as jax arrays (or, with
        another numpy-like ``namespace`` as ``jnp``, its ``asarray``'s: the benchmark
        harness runs the code on torch tensors for FlexAttention)."""
        scope = {"jnp": namespace, "jax": jax}
        scope.update({k: namespace.asarray(v) if isinstance(v, np.ndarray) else v
                      for k, v in env.items()})
        exec(compile(textwrap.dedent(self.code), f"<catalogue {self.name}>", "exec"), scope)
        return scope["mod"]

    def modified_scores(self, s: np.ndarray, env: dict) -> np.ndarray:
        b, h, sq, skv = s.shape
        grids = Grids(np.arange(b).reshape(-1, 1, 1, 1), np.arange(h).reshape(1, -1, 1, 1),
                      np.arange(sq).reshape(1, 1, -1, 1), np.arange(skv).reshape(1, 1, 1, -1))
        out = np.broadcast_to(self.reference(s, grids, env), s.shape)
        return np.asarray(out, np.float64)


@dataclasses.dataclass(frozen=True)
class Grids:
    b: np.ndarray
    h: np.ndarray
    q: np.ndarray
    k: np.ndarray


def masked(s, allowed):
    return np.where(allowed, s, NEG_INF)


def none(shape, rng):
    return {}


CATALOGUE: dict[str, Entry] = {}


def entry(**kw):
    e = Entry(**kw)
    assert e.name not in CATALOGUE, e.name
    CATALOGUE[e.name] = e
    return e


# --- causal and windows -------------------------------------------------------

entry(
    name="causal", family="causal and windows", what="each query sees itself and earlier keys",
    origin="masks/causal.py", setup=none, grad=True,
    code="mod = lambda s, b, h, q, k: jnp.where(q >= k, s, -jnp.inf)",
    reference=lambda s, g, env: masked(s, np.tril(np.ones(s.shape[2:], bool))),
    verdict="native Band(alignment='TOP_LEFT', left_bound=None, right_bound=0)",
)


def _window(shape, rng):
    return {"W": shape.sq // 4}


def _window_ref(s, g, env):
    sq, skv = s.shape[2:]
    allowed = np.zeros((sq, skv), bool)
    for i in range(sq):
        allowed[i, max(0, i - env["W"]):i + 1] = True
    return masked(s, allowed)


entry(
    name="sliding_window", family="causal and windows",
    what="causal, looking back at most W keys", origin="masks/sliding_window.py",
    setup=_window, reference=_window_ref,
    code="mod = lambda s, b, h, q, k: jnp.where((q >= k) & (q - k <= W), s, -jnp.inf)",
    verdict="native Band(alignment='TOP_LEFT', left_bound=257, right_bound=0)",
)


def _dilated(shape, rng):
    return {"W": shape.sq // 8, "D": 3}


def _dilated_ref(s, g, env):
    sq, skv = s.shape[2:]
    allowed = np.zeros((sq, skv), bool)
    for i in range(sq):
        for j in range(-(env["W"] // env["D"]), env["W"] // env["D"] + 1):
            if 0 <= i + j * env["D"] < skv:
                allowed[i, i + j * env["D"]] = True
    return masked(s, allowed)


entry(
    name="dilated_sliding_window", family="causal and windows",
    what="keys within W of the query, every D-th one", origin="masks/dilated_sliding_window.py",
    setup=_dilated, reference=_dilated_ref,
    code="mod = lambda s, b, h, q, k: jnp.where((jnp.abs(q - k) <= W) & (jnp.abs(q - k) % D == 0), s, -jnp.inf)",
    verdict="block-sparse Pallas kernels, static block map",
)


def _global_window(shape, rng):
    return {"W": shape.sq // 16, "is_global": rng.random(shape.sq) < 0.05}


def _global_window_ref(s, g, env):
    sq, skv = s.shape[2:]
    allowed = np.zeros((sq, skv), bool)
    for i in range(sq):
        allowed[i, max(0, i - env["W"]):i + env["W"] + 1] = True
    glob = np.flatnonzero(env["is_global"])
    allowed[glob, :] = True
    allowed[:, glob[glob < skv]] = True
    return masked(s, allowed)


entry(
    name="global_sliding_window", family="causal and windows",
    what="Longformer: a symmetric window plus global tokens that see and are seen by all",
    origin="masks/global_sliding_window.py", setup=_global_window, reference=_global_window_ref,
    code="mod = lambda s, b, h, q, k: jnp.where((jnp.abs(q - k) <= W) | is_global[q] | is_global[k], s, -jnp.inf)",
    verdict="materialized [1,1,Sq,Skv]: data mask",
)


def _prefix(shape, rng):
    return {"P": shape.sq // 8}


def _prefix_ref(s, g, env):
    sq, skv = s.shape[2:]
    allowed = np.tril(np.ones((sq, skv), bool))
    allowed[:, :env["P"]] = True
    return masked(s, allowed)


entry(
    name="prefix_lm", family="causal and windows",
    what="bidirectional over the first P keys, causal after", origin="masks/prefix_lm.py",
    setup=_prefix, reference=_prefix_ref, grad=True,
    code="mod = lambda s, b, h, q, k: jnp.where((k < P) | (q >= k), s, -jnp.inf)",
    verdict="split into 2 query blocks",
)


def _batchify(shape, rng):
    return {"N": 32}


def _batchify_ref(s, g, env):
    sq, skv = s.shape[2:]
    allowed = np.zeros((sq, skv), bool)
    n = env["N"]
    for start in range(0, sq, n):
        allowed[start:start + n, start:start + n] = np.tril(np.ones((n, n), bool))[:sq - start,
                                                                                   :skv - start]
    return masked(s, allowed)


entry(
    name="batchify_causal", family="causal and windows",
    what="causal attention within consecutive chunks of N tokens", origin="masks/batchify.py",
    setup=_batchify, reference=_batchify_ref,
    code="mod = lambda s, b, h, q, k: jnp.where((q // N == k // N) & (q % N >= k % N), s, -jnp.inf)",
    verdict="block-sparse Pallas kernels, static block map",
)


def _ring(q0, k0):
    def setup(shape, rng):
        return {"Q0": q0 * shape.sq, "K0": k0 * shape.skv}
    return setup


def _ring_ref(s, g, env):
    sq, skv = s.shape[2:]
    allowed = np.zeros((sq, skv), bool)
    for i in range(sq):
        for j in range(skv):  # global positions: this shard's rows, the visiting shard's keys
            allowed[i, j] = env["Q0"] + i >= env["K0"] + j
    return masked(s, allowed)


entry(
    name="ring_shard_diagonal", family="causal and windows",
    what="ring attention: a shard's queries against its own keys (global causal)",
    origin="examples/ring_attention.py", setup=_ring(3, 3), reference=_ring_ref,
    code="mod = lambda s, b, h, q, k: jnp.where(q + Q0 >= k + K0, s, -jnp.inf)",
    verdict="native Band(alignment='TOP_LEFT', left_bound=None, right_bound=0)",
)

entry(
    name="ring_shard_remote", family="causal and windows",
    what="ring attention: a shard's queries against an earlier shard's keys (all visible)",
    origin="examples/ring_attention.py", setup=_ring(2, 1), reference=_ring_ref,
    code="mod = lambda s, b, h, q, k: jnp.where(q + Q0 >= k + K0, s, -jnp.inf)",
    verdict="fused",
)


# --- documents and packing ---------------------------------------------------


def _lengths(total, rng, count):
    cuts = np.sort(rng.choice(np.arange(1, total), count - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [total]]))


def _documents(shape, rng):
    lengths = _lengths(shape.sq, rng, 5)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    doc = np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)
    return {"offsets": offsets, "doc": doc, "lengths": lengths}


def _block_diagonal(lengths, causal):
    n = int(sum(lengths))
    allowed = np.zeros((n, n), bool)
    start = 0
    for m in lengths:
        block = np.tril(np.ones((m, m), bool)) if causal else np.ones((m, m), bool)
        allowed[start:start + m, start:start + m] = block
        start += m
    return allowed


entry(
    name="document_causal", family="documents and packing",
    what="packed documents: causal within each document, read through its offsets",
    origin="masks/document_mask.py (generate_doc_mask_mod with causal_mask)",
    setup=_documents, grad=True,
    reference=lambda s, g, env: masked(s, _block_diagonal(env["lengths"], True)),
    code="""
        def mod(s, b, h, q, k):
            q_local, k_local = q - offsets[doc[q]], k - offsets[doc[k]]
            return jnp.where((doc[q] == doc[k]) & (q_local >= k_local), s, -jnp.inf)
        """,
    verdict="block-sparse Pallas kernels, mask in the kernel",
)


def _batch_documents(shape, rng):
    lengths = [_lengths(shape.sq, rng, 3 + i) for i in range(shape.b)]
    doc = np.stack([np.repeat(np.arange(len(m)), m) for m in lengths]).astype(np.int32)
    return {"doc": doc, "lengths": lengths}


entry(
    name="document", family="documents and packing",
    what="packed documents, bidirectional within each, a different packing per batch row",
    origin="masks/document_mask.py (generate_doc_mask_mod with noop_mask)",
    setup=_batch_documents,
    reference=lambda s, g, env: masked(
        s, np.stack([_block_diagonal(m, False) for m in env["lengths"]])[:, None]),
    code="mod = lambda s, b, h, q, k: jnp.where(doc[b, q] == doc[b, k], s, -jnp.inf)",
    verdict="ragged sequences (cudnn-varlen)",
)

entry(
    name="packed_causal_document", family="documents and packing",
    what="packed causal documents as one interval per row: from the document's start to the query",
    origin="masks/document_mask.py (generate_packed_causal_doc_mask_mod)",
    setup=_documents,
    reference=lambda s, g, env: masked(s, _block_diagonal(env["lengths"], True)),
    code="mod = lambda s, b, h, q, k: jnp.where((k >= offsets[doc[q]]) & (q >= k), s, -jnp.inf)",
    verdict="block-sparse Pallas kernels, mask in the kernel",
)


def _shared_prefix(shape, rng):
    # Two samples, each a prompt followed by three continuations of it.
    lengths = _lengths(shape.sq, rng, 8)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    doc = np.repeat(np.arange(8), lengths).astype(np.int32)
    prefix_of = np.array([0, 0, 0, 0, 4, 4, 4, 4], np.int32)
    return {"offsets": offsets, "doc": doc, "prefix_of": prefix_of, "lengths": lengths}


def _shared_prefix_ref(s, g, env):
    lengths, prefix_of = env["lengths"], env["prefix_of"]
    starts = np.concatenate([[0], np.cumsum(lengths)])
    n = int(starts[-1])
    allowed = np.zeros((n, n), bool)
    for d, m in enumerate(lengths):
        a = starts[d]
        allowed[a:a + m, a:a + m] = np.tril(np.ones((m, m), bool))  # causal in itself
        p = prefix_of[d]
        if p != d:  # a continuation reads all of its prompt
            allowed[a:a + m, starts[p]:starts[p + 1]] = True
    return masked(s, allowed)


entry(
    name="shared_prefix", family="documents and packing",
    what="continuations packed after one shared prompt: each reads the whole prompt and itself causally",
    origin="masks/shared_prefix.py", setup=_shared_prefix, reference=_shared_prefix_ref,
    code="""
        def mod(s, b, h, q, k):
            d, p = doc[q], prefix_of[doc[q]]
            own = (k >= offsets[d]) & (q >= k)
            prompt = (d != p) & (k >= offsets[p]) & (k < offsets[p + 1])
            return jnp.where(own | prompt, s, -jnp.inf)
        """,
    verdict="block-sparse Pallas kernels, mask in the kernel",
)


def _block_diffusion(shape, rng):
    return {"L": shape.sq // 2, "BS": 16}


def _block_diffusion_ref(s, g, env):
    n, bs = env["L"], env["BS"]
    allowed = np.zeros((2 * n, 2 * n), bool)
    for i in range(2 * n):
        for j in range(2 * n):
            bi, bj = (i % n) // bs, (j % n) // bs
            if i < n and j < n:  # noised tokens: their own block, both ways
                allowed[i, j] = bi == bj
            elif i < n:  # noised to clean: strictly earlier blocks
                allowed[i, j] = bj < bi
            elif j >= n:  # clean to clean: block causal
                allowed[i, j] = bj <= bi
    return masked(s, allowed)


entry(
    name="block_diffusion", family="documents and packing",
    what="BD3-LM training over [noised | clean]: block-diagonal, offset block-causal and block-causal parts",
    origin="masks/block_diffusion.py", setup=_block_diffusion, reference=_block_diffusion_ref,
    code="""
        def mod(s, b, h, q, k):
            q_noised, k_noised = q < L, k < L
            qb, kb = (q % L) // BS, (k % L) // BS
            diagonal = (qb == kb) & (q_noised == k_noised)
            offset_causal = (qb > kb) & q_noised & ~k_noised
            block_causal = (qb >= kb) & ~q_noised & ~k_noised
            return jnp.where(diagonal | offset_causal | block_causal, s, -jnp.inf)
        """,
    verdict="block-sparse Pallas kernels, static block map",
)


def _paged(shape, rng):
    # Physical key slots in pages of PS; page_table maps each batch row's
    # logical pages to physical ones (a permutation with some pages unused).
    ps = 16
    pages = shape.skv // ps
    used = pages - 2
    logical_of = np.full((shape.b, pages), -1, np.int32)
    for row in range(shape.b):
        physical = rng.permutation(pages)[:used]
        logical_of[row, physical] = np.arange(used)
    return {"PS": ps, "logical_of": logical_of}


def _paged_positions(env, b, skv):
    """[B, Skv] logical position of each physical key slot, -1 where unused."""
    ps, logical_of = env["PS"], env["logical_of"]
    pos = np.full((b, skv), -1)
    for row in range(b):
        for page, logical in enumerate(logical_of[row]):
            if logical >= 0:
                pos[row, page * ps:(page + 1) * ps] = logical * ps + np.arange(ps)
    return pos


def _paged_causal_ref(s, g, env):
    pos = _paged_positions(env, s.shape[0], s.shape[3])[:, None, None, :]
    return masked(s, (pos >= 0) & (g.q >= pos))


entry(
    name="paged_causal", family="documents and packing",
    what="causal attention over a paged KV cache: physical slots mapped back to logical positions",
    origin="examples/paged_attention (PagedAttention.get_mask_mod)",
    setup=_paged, reference=_paged_causal_ref,
    code="""
        def mod(s, b, h, q, k):
            page = logical_of[b, k // PS]
            k_logical = page * PS + k % PS
            return jnp.where((page >= 0) & (q >= k_logical), s, -jnp.inf)
        """,
    verdict="block-sparse Pallas kernels, mask in the kernel",
)


def _paged_alibi(shape, rng):
    env = _paged(shape, rng)
    env["H"] = shape.h
    return env


def _paged_alibi_ref(s, g, env):
    pos = _paged_positions(env, s.shape[0], s.shape[3])[:, None, None, :]
    slope = 2.0 ** (-8.0 * (g.h + 1) / env["H"])
    return np.where(pos >= 0, s + slope * (pos - g.q), NEG_INF)


entry(
    name="paged_alibi", family="documents and packing",
    what="a score_mod (ALiBi) through the paged remap: the bias reads logical positions",
    origin="examples/paged_attention (PagedAttention.get_score_mod)",
    setup=_paged_alibi, reference=_paged_alibi_ref,
    code="""
        def mod(s, b, h, q, k):
            page = logical_of[b, k // PS]
            k_logical = page * PS + k % PS
            slope = jnp.exp2(-(h + 1) * 8.0 / H)
            return jnp.where(page >= 0, s + slope * (k_logical - q), -jnp.inf)
        """,
    verdict="block-sparse Pallas kernels, values from arrays in the kernel",
)


# --- images and video: NATTEN, STA, SVG, VSA ----------------------------------


def _natten(shape, rng):
    rows, cols, k = (8, 16, 5) if shape.sq == 128 else (32, 32, 7)
    return {"R": rows, "C": cols, "KR": k - 2, "KC": k}


def _natten_allowed(rows, cols, kr, kc, coords):
    """allowed[i, j] for pixels numbered by ``coords(i) -> (row, col)``: the
    kr x kc window around the query's pixel, shifted to stay inside the canvas."""
    n = rows * cols
    allowed = np.zeros((n, n), bool)
    where = [coords(i) for i in range(n)]
    for i, (r, c) in enumerate(where):
        r0 = min(max(r - kr // 2, 0), rows - kr)
        c0 = min(max(c - kc // 2, 0), cols - kc)
        for j, (rr, cc) in enumerate(where):
            allowed[i, j] = r0 <= rr < r0 + kr and c0 <= cc < c0 + kc
    return allowed


def _natten_ref(s, g, env):
    cols = env["C"]
    return masked(s, _natten_allowed(env["R"], cols, env["KR"], env["KC"],
                                     lambda i: divmod(i, cols)))


NATTEN_CODE = """
    def mod(s, b, h, q, k):
        q_row, q_col, k_row, k_col = q // C, q % C, k // C, k % C
        center_row = jnp.clip(q_row, KR // 2, R - 1 - KR // 2)
        center_col = jnp.clip(q_col, KC // 2, C - 1 - KC // 2)
        near = (jnp.abs(center_row - k_row) <= KR // 2) & (jnp.abs(center_col - k_col) <= KC // 2)
        return jnp.where(near, s, -jnp.inf)
    """

entry(
    name="natten", family="images and video",
    what="neighborhood attention on a row-major R x C canvas: a KR x KC window clamped inside",
    origin="masks/natten.py (generate_natten)", setup=_natten,
    reference=_natten_ref, code=NATTEN_CODE, grad=True,
    verdict="block-sparse Pallas kernels, static block map",
)


def _tiled_natten(shape, rng):
    rows, cols, tr, tc, k = (8, 16, 4, 4, 5) if shape.sq == 128 else (32, 32, 8, 8, 7)
    return {"R": rows, "C": cols, "TR": tr, "TC": tc, "KR": k, "KC": k}


def _tiled_natten_ref(s, g, env):
    rows, cols, tr, tc = env["R"], env["C"], env["TR"], env["TC"]

    def coords(i):  # tiles in row-major order, pixels row-major inside a tile
        tile, inside = divmod(i, tr * tc)
        trow, tcol = divmod(tile, cols // tc)
        irow, icol = divmod(inside, tc)
        return trow * tr + irow, tcol * tc + icol

    return masked(s, _natten_allowed(rows, cols, env["KR"], env["KC"], coords))


entry(
    name="tiled_natten", family="images and video",
    what="NATTEN with the canvas laid out tile by tile (TR x TC tiles)",
    origin="masks/natten.py (generate_tiled_natten)", setup=_tiled_natten,
    reference=_tiled_natten_ref,
    code="""
        def mod(s, b, h, q, k):
            def pixel(i):
                tile, inside = i // (TR * TC), i % (TR * TC)
                return (tile // (C // TC)) * TR + inside // TC, (tile % (C // TC)) * TC + inside % TC
            (q_row, q_col), (k_row, k_col) = pixel(q), pixel(k)
            center_row = jnp.clip(q_row, KR // 2, R - 1 - KR // 2)
            center_col = jnp.clip(q_col, KC // 2, C - 1 - KC // 2)
            near = (jnp.abs(center_row - k_row) <= KR // 2) & (jnp.abs(center_col - k_col) <= KC // 2)
            return jnp.where(near, s, -jnp.inf)
        """,
    verdict="fused",
)


def _morton(shape, rng):
    side = int(math.isqrt(shape.sq))
    return {"R": side, "C": side, "KR": 5, "KC": 5}


def _morton_ref(s, g, env):
    side = env["R"]

    def coords(i):  # bit 2n of the code is bit n of the column, bit 2n+1 of the row
        row = col = 0
        for bit in range(16):
            col |= ((i >> (2 * bit)) & 1) << bit
            row |= ((i >> (2 * bit + 1)) & 1) << bit
        return row, col

    return masked(s, _natten_allowed(side, side, env["KR"], env["KC"], coords))


entry(
    name="morton_natten", family="images and video",
    what="NATTEN with pixels in Morton (Z-curve) order, decoded by bit de-interleaving",
    origin="masks/natten.py (generate_morton_natten)", setup=_morton, reference=_morton_ref,
    cpu=Shape(2, 4, 256, 256),
    code="""
        def mod(s, b, h, q, k):
            def spread(x):  # keep the even bits of x, packed together
                x = x & 0x55555555
                x = (x | (x >> 1)) & 0x33333333
                x = (x | (x >> 2)) & 0x0F0F0F0F
                x = (x | (x >> 4)) & 0x00FF00FF
                return (x | (x >> 8)) & 0x0000FFFF
            q_row, q_col, k_row, k_col = spread(q >> 1), spread(q), spread(k >> 1), spread(k)
            center_row = jnp.clip(q_row, KR // 2, R - 1 - KR // 2)
            center_col = jnp.clip(q_col, KC // 2, C - 1 - KC // 2)
            near = (jnp.abs(center_row - k_row) <= KR // 2) & (jnp.abs(center_col - k_col) <= KC // 2)
            return jnp.where(near, s, -jnp.inf)
        """,
    verdict="block-sparse Pallas kernels, static mask in the kernel",
)


def _sta_window(q_tile, n_tiles, k_tiles):
    """The k_tiles consecutive tiles around q_tile, shifted to stay inside."""
    start = min(max(q_tile - k_tiles // 2, 0), n_tiles - k_tiles)
    return start, start + k_tiles


def _sta2d(shape, rng):
    if shape.sq == 128:  # canvas 8 x 12 in 4 x 4 tiles, kernel 2 x 2 tiles, 32 text tokens
        return {"CR": 2, "CC": 3, "TR": 4, "TC": 4, "KR": 2, "KC": 2, "TEXT": 32}
    return {"CR": 3, "CC": 4, "TR": 8, "TC": 8, "KR": 3, "KC": 3, "TEXT": 256}


def _sta2d_ref(s, g, env):
    cr, cc, tr, tc, kr, kc = (env[n] for n in ("CR", "CC", "TR", "TC", "KR", "KC"))
    vision, text = cr * cc * tr * tc, env["TEXT"]
    n = vision + text
    allowed = np.zeros((n, n), bool)
    for i in range(n):
        if i >= vision:  # text reads everything
            allowed[i, :] = True
            continue
        allowed[i, vision:] = True  # vision reads the text
        ti = i // (tr * tc)
        r0, r1 = _sta_window(ti // cc, cr, kr)
        c0, c1 = _sta_window(ti % cc, cc, kc)
        for j in range(vision):
            tj = j // (tr * tc)
            allowed[i, j] = r0 <= tj // cc < r1 and c0 <= tj % cc < c1
    return masked(s, allowed)


entry(
    name="sta_2d", family="images and video",
    what="sliding tile attention on an image: windows of whole tiles, plus text tokens",
    origin="masks/sta.py (generate_sta_mask_mod_2d)", setup=_sta2d, reference=_sta2d_ref,
    code="""
        def mod(s, b, h, q, k):
            vision = CR * CC * TR * TC
            qt, kt = q // (TR * TC), k // (TR * TC)
            center_row = jnp.clip(qt // CC, KR // 2, CR - 1 - (KR // 2 + KR % 2 - 1))
            center_col = jnp.clip(qt % CC, KC // 2, CC - 1 - (KC // 2 + KC % 2 - 1))
            rows = (kt // CC >= center_row - KR // 2) & (kt // CC <= center_row + KR // 2 + KR % 2 - 1)
            cols = (kt % CC >= center_col - KC // 2) & (kt % CC <= center_col + KC // 2 + KC % 2 - 1)
            tiles = (q < vision) & (k < vision) & rows & cols
            to_text = (q < vision) & (k >= vision) & (k < vision + TEXT)
            from_text = (q >= vision) & (k < vision + TEXT)
            return jnp.where(tiles | to_text | from_text, s, -jnp.inf)
        """,
    verdict="fused",
)


def _sta3d(shape, rng):
    if shape.sq == 128:  # canvas 4 x 4 x 6 in 2 x 2 x 2 tiles, kernel 2 x 2 x 2 tiles
        return {"CT": 2, "CR": 2, "CC": 3, "TT": 2, "TR": 2, "TC": 2, "KT": 1, "KR": 2, "KC": 2,
                "TEXT": 32}
    return {"CT": 4, "CR": 2, "CC": 3, "TT": 2, "TR": 4, "TC": 4, "KT": 3, "KR": 2, "KC": 3,
            "TEXT": 256}


def _sta3d_ref(s, g, env):
    ct, cr, cc = env["CT"], env["CR"], env["CC"]
    numel = env["TT"] * env["TR"] * env["TC"]
    vision, text = ct * cr * cc * numel, env["TEXT"]
    n = vision + text
    allowed = np.zeros((n, n), bool)
    for i in range(n):
        if i >= vision:
            allowed[i, :] = True
            continue
        allowed[i, vision:] = True
        t, rest = divmod(i // numel, cr * cc)
        windows = [_sta_window(x, size, kernel) for x, size, kernel in
                   ((t, ct, env["KT"]), (rest // cc, cr, env["KR"]), (rest % cc, cc, env["KC"]))]
        for j in range(vision):
            tj, rj = divmod(j // numel, cr * cc)
            allowed[i, j] = all(lo <= x < hi for x, (lo, hi) in zip((tj, rj // cc, rj % cc), windows))
    return masked(s, allowed)


entry(
    name="sta_3d", family="images and video",
    what="sliding tile attention on a video: windows of whole (time, row, col) tiles, plus text",
    origin="masks/sta.py (generate_sta_mask_mod_3d)", setup=_sta3d, reference=_sta3d_ref,
    code="""
        def mod(s, b, h, q, k):
            vision = CT * CR * CC * TT * TR * TC
            def tile(i):
                t = i // (TT * TR * TC)
                return t // (CR * CC), (t % (CR * CC)) // CC, t % CC
            def near(qx, kx, n, kernel):
                left, right = kernel // 2, kernel // 2 + kernel % 2 - 1
                center = jnp.clip(qx, left, n - 1 - right)
                return (kx >= center - left) & (kx <= center + right)
            (qt, qr, qc), (kt, kr, kc) = tile(q), tile(k)
            tiles = near(qt, kt, CT, KT) & near(qr, kr, CR, KR) & near(qc, kc, CC, KC)
            tiles = tiles & (q < vision) & (k < vision)
            to_text = (q < vision) & (k >= vision) & (k < vision + TEXT)
            from_text = (q >= vision) & (k < vision + TEXT)
            return jnp.where(tiles | to_text | from_text, s, -jnp.inf)
        """,
    verdict="fused",
)


def _svg(shape, rng):
    if shape.sq == 128:
        return {"P": 16, "T": 28, "F": 4, "WIDTH": 1, "ROUND": 16, "SINK": 1}
    return {"P": 64, "T": 240, "F": 4, "WIDTH": 2, "ROUND": 128, "SINK": 1}


def _svg_spatial_ref(s, g, env):
    n = s.shape[2]
    band = (env["WIDTH"] * env["T"]) // env["ROUND"] * env["ROUND"]
    allowed = np.zeros((n, n), bool)
    for i in range(n):
        allowed[i, max(0, i - band + 1):i + band] = True
    allowed[:env["P"], :] = True  # the prompt reads everything
    allowed[:, :env["P"] + env["SINK"] * env["T"]] = True  # the prompt (and first frame) is read
    return masked(s, allowed)


entry(
    name="svg_spatial_head", family="images and video",
    what="Sparse VideoGen spatial head: a band of whole frames, prompt rows and columns, an attention sink",
    origin="masks/svg.py (generate_spatial_head_mask_mod)", setup=_svg, reference=_svg_spatial_ref,
    code="""
        def mod(s, b, h, q, k):
            width = (WIDTH * T) // ROUND * ROUND
            return jnp.where((k < P + SINK * T) | (q < P) | (jnp.abs(q - k) < width), s, -jnp.inf)
        """,
    verdict="fused",
)


def _svg_temporal_ref(s, g, env):
    n, p, t = s.shape[2], env["P"], env["T"]
    width = env["WIDTH"] * t // env["F"]
    token = [(i - p) % t for i in range(n)]  # position inside its frame (Python's %)
    allowed = np.zeros((n, n), bool)
    for i in range(n):
        for j in range(n):
            allowed[i, j] = i < p or j < p or abs(token[i] - token[j]) < width
    return masked(s, allowed)


entry(
    name="svg_temporal_head", family="images and video",
    what="Sparse VideoGen temporal head: the same position in every frame, plus the prompt",
    origin="masks/svg.py (generate_temporal_head_mask_mod)", setup=_svg,
    reference=_svg_temporal_ref,
    code="""
        def mod(s, b, h, q, k):
            width = WIDTH * T // F
            near = jnp.abs((q - P) % T - (k - P) % T) < width
            return jnp.where((k < P) | (q < P) | near, s, -jnp.inf)
        """,
    verdict="fused",
)


def _vsa(shape, rng):
    tile = 16 if shape.sq == 128 else 64
    tiles = shape.sq // tile
    top = 3
    scores = rng.random((shape.b, shape.h, tiles, tiles))
    topk = np.sort(np.argsort(-scores, axis=-1)[..., :top], axis=-1).astype(np.int32)
    block_map = np.zeros((shape.b, shape.h, tiles, tiles), bool)
    np.put_along_axis(block_map, topk, True, axis=-1)
    sizes = np.full(tiles, tile, np.int32)
    sizes[-1] = tile - 5  # the last tile is padded
    return {"T": tile, "topk": topk, "block_map": block_map, "sizes": sizes}


def _vsa_tiles_allowed(env, s):
    t = env["T"]
    allowed = np.zeros(s.shape, bool)
    b, h, sq, skv = s.shape
    for bb in range(b):
        for hh in range(h):
            for qt in range(sq // t):
                for kt in env["topk"][bb, hh, qt]:
                    allowed[bb, hh, qt * t:(qt + 1) * t, kt * t:(kt + 1) * t] = True
    return allowed


entry(
    name="vsa_topk", family="images and video",
    what="video sparse attention: each query tile reads its top-k key tiles (a list per tile)",
    origin="masks/vsa.py (generate_vsa_mask_mod)", setup=_vsa,
    reference=lambda s, g, env: masked(s, _vsa_tiles_allowed(env, s)),
    code="mod = lambda s, b, h, q, k: jnp.where((topk[b, h, q // T] == k // T).any(), s, -jnp.inf)",
    verdict="block-sparse Pallas kernels, mask in the kernel",
)

entry(
    name="vsa_block_map", family="images and video",
    what="video sparse attention from a dense tile map, padded key slots of the last tile masked",
    origin="masks/vsa.py (generate_vsa_block_map_mask_mod)", setup=_vsa,
    reference=lambda s, g, env: masked(
        s, _vsa_tiles_allowed(env, s) & (g.k % env["T"] < env["sizes"][g.k // env["T"]])),
    code="mod = lambda s, b, h, q, k: jnp.where(block_map[b, h, q // T, k // T] & (k % T < sizes[k // T]), s, -jnp.inf)",
    verdict="block-sparse Pallas kernels, mask in the kernel",
)


entry(
    name="vsa_padding", family="images and video",
    what="video sparse attention's padding mask: the unused key slots of partly filled tiles",
    origin="masks/vsa.py (generate_vsa_padding_mask_mod)", setup=_vsa,
    reference=lambda s, g, env: masked(s, g.k % env["T"] < env["sizes"][g.k // env["T"]]),
    code="mod = lambda s, b, h, q, k: jnp.where(k % T < sizes[k // T], s, -jnp.inf)",
    verdict="materialized [1,1,Sq,Skv]: data mask",
)


# --- cross-attention, trees ----------------------------------------------------


def _flamingo(shape, rng):
    tokens = 16 if shape.sq == 128 else 64
    images = shape.skv // tokens
    starts = np.sort(rng.choice(np.arange(4, shape.sq), images, replace=False))
    ends = np.minimum(np.append(starts[1:], shape.sq) + rng.integers(0, 8, images), shape.sq)
    intervals = np.stack([starts, ends], axis=1).astype(np.int32)
    return {"L": tokens, "intervals": intervals}


def _flamingo_ref(s, g, env):
    allowed = np.zeros(s.shape[2:], bool)
    for image, (start, end) in enumerate(env["intervals"]):
        allowed[start:end, image * env["L"]:(image + 1) * env["L"]] = True
    return masked(s, allowed)  # text before the first image reads nothing: zero rows


entry(
    name="flamingo_cross_attention", family="cross-attention and trees",
    what="Flamingo: text tokens read the images whose interval they fall in",
    origin="masks/flamingo.py", setup=_flamingo, reference=_flamingo_ref,
    cpu=Shape(2, 4, 128, 64), gpu=Shape(2, 4, 1024, 256),
    code="""
        def mod(s, b, h, q, k):
            image = k // L
            return jnp.where((q >= intervals[image, 0]) & (q < intervals[image, 1]), s, -jnp.inf)
        """,
    verdict="block-sparse Pallas kernels, mask in the kernel",
)


def _jetspec_tree(shape, rng):
    nodes = shape.sq
    parent = np.array([-1] + [int(rng.integers(max(0, i - 8), i)) for i in range(1, nodes)])
    ancestor = np.eye(nodes, dtype=bool)
    for i in range(1, nodes):
        ancestor[i] |= ancestor[parent[i]]
    return {"P": shape.skv - nodes, "N": nodes, "ancestor": ancestor, "parent": parent}


def _jetspec_tree_ref(s, g, env):
    p, n, parent = env["P"], env["N"], env["parent"]
    allowed = np.zeros((n, p + n), bool)
    allowed[:, :p] = True
    for i in range(n):
        node = i
        while node >= 0:  # walk to the root: each node on the path is visible
            allowed[i, p + node] = True
            node = parent[node]
    return masked(s, allowed)


entry(
    name="jetspec_tree", family="cross-attention and trees",
    what="JetSpec tree drafting: a node reads the prefix and its ancestors in the tree",
    origin="masks/jetspec.py (generate_jetspec_tree_causal_mask_mod)",
    setup=_jetspec_tree, reference=_jetspec_tree_ref,
    cpu=Shape(2, 4, 128, 192), gpu=Shape(2, 4, 1024, 1536),
    code="""
        def mod(s, b, h, q, k):
            node = jnp.clip(k - P, 0, N - 1)
            in_tree = (k >= P) & (k < P + N)
            return jnp.where((k < P) | (in_tree & ancestor[q, node]), s, -jnp.inf)
        """,
    verdict="materialized [1,1,Sq,Skv]: data mask",
)


def _jetspec_training(shape, rng):
    return {"P": shape.skv - shape.sq, "BS": 16}


def _jetspec_training_ref(s, g, env):
    p, bs = env["P"], env["BS"]
    sq, skv = s.shape[2:]
    allowed = np.zeros((sq, skv), bool)
    allowed[:, :p] = True
    for block in range(sq // bs):
        rows = slice(block * bs, (block + 1) * bs)
        allowed[rows, p + block * bs:p + (block + 1) * bs] = np.tril(np.ones((bs, bs), bool))
    return masked(s, allowed)


entry(
    name="jetspec_training", family="cross-attention and trees",
    what="JetSpec draft-head training: the prefix, then causal within each sampled block",
    origin="masks/jetspec.py (generate_jetspec_training_mask_mod)",
    setup=_jetspec_training, reference=_jetspec_training_ref,
    cpu=Shape(2, 4, 128, 192), gpu=Shape(2, 4, 1024, 1536),
    code="""
        def mod(s, b, h, q, k):
            j = k - P
            own_block = (k >= P) & (q // BS == j // BS) & (j % BS <= q % BS)
            return jnp.where((k < P) | own_block, s, -jnp.inf)
        """,
    verdict="block-sparse Pallas kernels, static block map",
)


# --- score mods ----------------------------------------------------------------


entry(
    name="softcap", family="score mods",
    what="tanh soft-capping of the logits (Gemma 2, Grok-1)", origin="mods/softcapping.py",
    setup=lambda shape, rng: {"CAP": 30.0},
    reference=lambda s, g, env: env["CAP"] * np.tanh(s / env["CAP"]),
    code="mod = lambda s, b, h, q, k: CAP * jnp.tanh(s / CAP)",
    verdict="fused",
)

entry(
    name="softcap_causal", family="score mods",
    what="soft-capping under a causal mask", origin="mods/softcapping.py with masks/causal.py",
    setup=lambda shape, rng: {"CAP": 30.0},
    reference=lambda s, g, env: masked(env["CAP"] * np.tanh(s / env["CAP"]), g.q >= g.k),
    code="mod = lambda s, b, h, q, k: jnp.where(q >= k, CAP * jnp.tanh(s / CAP), -jnp.inf)",
    gpu=Shape(2, 16, 2048, 2048), verdict="split into 4 query blocks",
)


def _alibi_ref(s, g, env):
    slope = np.array([2.0 ** (-8.0 * (i + 1) / env["H"]) for i in range(s.shape[1])])
    return s + slope.reshape(1, -1, 1, 1) * (g.k - g.q)


entry(
    name="alibi", family="score mods",
    what="ALiBi: a linear distance penalty with a geometric slope per head",
    origin="mods/alibi.py", setup=lambda shape, rng: {"H": shape.h}, reference=_alibi_ref,
    grad=True,
    code="mod = lambda s, b, h, q, k: s + jnp.exp2(-(h + 1) * 8.0 / H) * (k - q)",
    verdict="fused",
)

entry(
    name="alibi_causal", family="score mods",
    what="ALiBi under a causal mask", origin="mods/alibi.py with masks/causal.py",
    setup=lambda shape, rng: {"H": shape.h},
    reference=lambda s, g, env: masked(_alibi_ref(s, g, env), g.q >= g.k),
    code="mod = lambda s, b, h, q, k: jnp.where(q >= k, s + jnp.exp2(-(h + 1) * 8.0 / H) * (k - q), -jnp.inf)",
    gpu=Shape(2, 16, 2048, 2048), verdict="split into 4 query blocks",
)


def _sandwich(shape, rng):
    d_bar = 128
    n = max(shape.sq, shape.skv)
    freqs = 1.0 / 10000 ** (2 * np.arange(d_bar // 2) / d_bar)
    distance = np.arange(2 * n - 1) - (n - 1)
    table = np.cos(np.abs(distance)[:, None] * freqs).sum(-1).astype(np.float32)
    ratio = (shape.h / (8.0 * np.arange(1, shape.h + 1))).astype(np.float32)
    return {"rel": table, "ratio": ratio, "OFF": n - 1, "DBAR": d_bar}


def _sandwich_ref(s, g, env):
    d_bar = env["DBAR"]
    h = s.shape[1]
    m = (g.q - g.k)[..., None].astype(np.float64)  # [1, 1, Sq, Skv, 1]
    w = 1.0 / 10000.0 ** (np.arange(0, d_bar, 2) / d_bar)
    inner = np.cos(m * w).sum(-1)  # <p_m, p_n> of sinusoidal embeddings, summed per pair
    per_head = np.array([h / (8.0 * (i + 1)) for i in range(h)]).reshape(1, -1, 1, 1)
    return s + inner * per_head


entry(
    name="sandwich", family="score mods",
    what="Sandwich: the inner product of sinusoidal position embeddings, scaled per head",
    origin="mods/sandwich.py", setup=_sandwich, reference=_sandwich_ref,
    code="mod = lambda s, b, h, q, k: s + rel[q - k + OFF] * ratio[h]",
    verdict="block-sparse Pallas kernels, table per diagonal",
)


def _graph_distances(rng, b, n, buckets):
    """Shortest-path hop counts of random undirected graphs, capped at buckets - 1."""
    adjacency = rng.random((b, n, n)) < 2.0 / n
    adjacency = (adjacency | adjacency.transpose(0, 2, 1)).astype(np.float32)
    dist = np.full((b, n, n), buckets - 1, np.int32)
    reached = np.broadcast_to(np.eye(n, dtype=bool), (b, n, n)).copy()
    dist[reached] = 0
    frontier = reached.astype(np.float32)
    for hops in range(1, buckets - 1):  # one more hop per step, breadth first
        frontier = ((frontier @ adjacency) > 0) & ~reached
        dist[frontier] = hops
        reached |= frontier
        frontier = frontier.astype(np.float32)
    return dist


def _graphormer_spatial(shape, rng):
    buckets = 6
    return {"table": rng.normal(0, 1, (shape.h, buckets)).astype(np.float32),
            "dist": _graph_distances(rng, shape.b, shape.sq, buckets)}


def _graphormer_spatial_ref(s, g, env):
    out = s.copy()
    b, h, sq, skv = s.shape
    for bb in range(b):
        for hh in range(h):
            out[bb, hh] += env["table"][hh][env["dist"][bb]]
    return out


entry(
    name="graphormer_spatial", family="score mods",
    what="Graphormer spatial encoding: a learned bias per head and shortest-path distance",
    origin="mods/graphormer.py (generate_graphormer_spatial_bias)",
    setup=_graphormer_spatial, reference=_graphormer_spatial_ref, grad=True,
    code="mod = lambda s, b, h, q, k: s + table[h, dist[b, q, k]]",
    verdict="materialized [B,H,Sq,Skv]: computed index",
)


def _graphormer_edge(shape, rng):
    hops, kinds = 3, 5
    return {"edge_bias": rng.normal(0, 1, (shape.h, hops, kinds)).astype(np.float32),
            "path_types": rng.integers(0, kinds, (shape.b, shape.sq, shape.skv, hops)).astype(np.int32),
            "path_len": rng.integers(0, hops + 1, (shape.b, shape.sq, shape.skv)).astype(np.int32),
            "HOPS": hops}


def _graphormer_edge_ref(s, g, env):
    bias, types, length = env["edge_bias"], env["path_types"], env["path_len"]
    b, h, sq, skv = s.shape
    out = s.copy()
    for bb in range(b):
        for hh in range(h):
            total = np.zeros((sq, skv))
            for n in range(env["HOPS"]):  # mean of the per-hop weights along the path
                total += np.where(length[bb] > n, bias[hh, n][types[bb, :, :, n]], 0.0)
            out[bb, hh] += total / np.maximum(length[bb], 1)
    return out


entry(
    name="graphormer_edge", family="score mods",
    what="Graphormer edge encoding: the mean of learned per-hop edge-type weights along the shortest path",
    origin="mods/graphormer.py (generate_graphormer_edge_bias)",
    setup=_graphormer_edge, reference=_graphormer_edge_ref,
    code="""
        def mod(s, b, h, q, k):
            length = path_len[b, q, k]
            total = 0.0
            for n in range(HOPS):
                total = total + jnp.where(length > n, edge_bias[h, n, path_types[b, q, k, n]], 0.0)
            return s + total / jnp.maximum(length, 1)
        """,
    verdict="materialized [B,H,Sq,Skv]: computed from arrays",
)


def _mla(shape, rng):
    rope = 16
    return {"q_rope": rng.normal(0, 0.3, (shape.b, shape.h, shape.sq, rope)).astype(np.float32),
            "k_rope": rng.normal(0, 0.3, (shape.b, 1, shape.skv, rope)).astype(np.float32),
            "H": shape.h, "SCALE": 0.5}


def _mla_ref(s, g, env):
    qr, kr = env["q_rope"].astype(np.float64), env["k_rope"].astype(np.float64)
    out = s.copy()
    for bb in range(s.shape[0]):
        for hh in range(s.shape[1]):
            out[bb, hh] += env["SCALE"] * qr[bb, hh] @ kr[bb, 0].T
    return out


entry(
    name="mla_decoupled_rope", family="score mods",
    what="DeepSeek MLA: the decoupled RoPE term, a dot product of per-position query and key vectors",
    origin="mods/latent_attention.py, examples/mla.py", setup=_mla, reference=_mla_ref,
    code="mod = lambda s, b, h, q, k: s + SCALE * jnp.dot(q_rope[b, h, q], k_rope[b, h // H, k])",
    verdict="low-rank bias of rank 16 in the head dim, fused",
)


def _activation(name, f_np, code_f, verdict="fused", needs=None):
    entry(
        name=f"activation_{name}", family="score mods",
        what=f"softmax replaced by {name}: the score becomes log({name}(s) + 1)",
        origin="mods/activation.py (generate_activation_score_mod)",
        setup=lambda shape, rng: {}, needs=needs,
        reference=lambda s, g, env: np.log(f_np(s) + 1.0),
        code=f"mod = lambda s, b, h, q, k: jnp.log({code_f} + 1.0)",
        verdict=verdict,
    )


def _erf(x):
    return np.vectorize(math.erf)(x)


_activation("gelu_tanh", lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))),
            "jax.nn.gelu(s)")
_activation("gelu_exact", lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2))),
            "jax.nn.gelu(s, approximate=False)")
_activation("relu", lambda x: np.maximum(x, 0.0), "jax.nn.relu(s)")
_activation("sigmoid", lambda x: 1 / (1 + np.exp(-x)), "jax.nn.sigmoid(s)")
