"""Query-block splitting of band-masked mods: the same attention, fewer tiles.

The fused path runs each block as an ordinary fused call; here every block
runs on the reference path, which checks the decomposition itself (key
ranges, shifted indices and operands, concatenation, summed key gradients).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from scoremod.lowering import block_maps
from scoremod.lowering.cudnn import split
from scoremod.lowering.cudnn.plan import Plan
from scoremod.lowering.problem import Problem
from scoremod.lowering.cudnn.rules import canonical
from scoremod.lowering.reference import modified_scores, scores_and_lse_reference

NEG = -jnp.inf
SQ = SKV = 512
rng = np.random.default_rng(0)
SLOPES = jnp.asarray([2.0 ** -(i + 1) for i in range(4)], jnp.float32)
Q_BIAS = jnp.asarray(rng.normal(size=1024), jnp.float32)
DOCS = jnp.asarray(np.sort(rng.integers(0, 3, (2, 1024)), axis=1), jnp.int32)

MODS = {
    "softcap_causal": lambda s, b, h, q, k: jnp.where(q >= k, 30 * jnp.tanh(s / 30), NEG),
    "softcap_window": lambda s, b, h, q, k: jnp.where((q >= k) & (q - k < 200), 5 * jnp.tanh(s / 5), NEG),
    "alibi_causal": lambda s, b, h, q, k: jnp.where(q >= k, s + SLOPES[h] * (k - q), NEG),
    "q_bias_causal": lambda s, b, h, q, k: jnp.where(k <= q, s + Q_BIAS[q] - 0.5 * Q_BIAS[k], NEG),
    "document_causal": lambda s, b, h, q, k: jnp.where((q >= k) & (DOCS[b, q] == DOCS[b, k]), s * 0.9, NEG),
    # static masks that are no band: their tiles are classified when planning
    "softcap_prefix_lm": lambda s, b, h, q, k: jnp.where((k < 100) | (q >= k), 30 * jnp.tanh(s / 30), NEG),
    "global_window": lambda s, b, h, q, k: jnp.where(((q >= k) & (q - k < 150)) | (k < 64), 0.8 * s, NEG),
    # pure static masks: a block where the mask is one band (or none) runs natively
    "prefix_lm": lambda s, b, h, q, k: jnp.where((k < 128) | (q >= k), s, NEG),
    "prefix_lm_unaligned": lambda s, b, h, q, k: jnp.where((k < 100) | (q >= k), s, NEG),
}
NARROWED = ("prefix_lm", "prefix_lm_unaligned")  # some blocks take another mod

# mask of each static mod above, in numpy: (q, kv) -> kept
STATIC = {
    "softcap_prefix_lm": lambda q, k: (k < 100) | (q >= k),
    "global_window": lambda q, k: ((q >= k) & (q - k < 150)) | (k < 64),
    "prefix_lm_doc": lambda q, k: (k < 700) | (q >= k),
}


def inputs(sq, skv, hq=4, hkv=2, d=32):
    ks = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(ks[0], (2, sq, hq, d), jnp.float32)
    k = jax.random.normal(ks[1], (2, skv, hkv, d), jnp.float32)
    v = jax.random.normal(ks[2], (2, skv, hkv, d), jnp.float32)
    return q, k, v


def reference(q, k, v, mod):
    return scores_and_lse_reference(q, k, v, mod, 1 / math.sqrt(q.shape[-1]), True)


@pytest.mark.parametrize("sq,skv", [(512, 512), (384, 640)])
@pytest.mark.parametrize("name", sorted(MODS))
def test_blocks_compute_the_same_attention_and_gradients(name, sq, skv):
    mod = scoremod.trace(MODS[name])
    if skv > sq:  # bottom-right: every row sees skv - sq more keys
        off = skv - sq
        mod = scoremod.trace(lambda s, b, h, q, k: MODS[name](s, b, h, q + off, k))
    blocks = split.plan(canonical(mod.expr), sq, skv, blocks=4, sms=1)
    assert blocks is not None and len(blocks) >= 3
    q, k, v = inputs(sq, skv)

    def whole(q, k, v):
        return reference(q, k, v, mod)

    def parts(q, k, v):
        return split.blockwise(q, k, v, mod, blocks, reference)

    (o1, l1), (o2, l2) = jax.jit(whole)(q, k, v), jax.jit(parts)(q, k, v)
    np.testing.assert_allclose(o2, o1, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(l2, l1, atol=1e-5, rtol=1e-5)
    w = jax.random.normal(jax.random.key(3), o1.shape)
    g1 = jax.grad(lambda *a: jnp.sum(whole(*a)[0] * w), (0, 1, 2))(q, k, v)
    g2 = jax.grad(lambda *a: jnp.sum(parts(*a)[0] * w), (0, 1, 2))(q, k, v)
    for a, b in zip(g2, g1):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_plan_covers_every_visible_key_and_skips_the_rest():
    expr = canonical(scoremod.trace(MODS["softcap_window"]).expr)
    blocks = split.plan(expr, 2048, 2048, blocks=8, sms=1)
    assert [b.q0 for b in blocks] == list(range(0, 2048, 256))
    for b in blocks:
        # rows [q0, q1) see keys [q - 199, q]: all inside [k0, k1), tile-aligned
        assert b.k0 <= max(0, b.q0 - 199) and b.k1 >= b.q1 and b.k0 % 128 == 0
        assert b.k1 - b.k0 <= 256 + 199 + 128
    visited = sum((b.q1 - b.q0) * (b.k1 - b.k0) for b in blocks)
    assert visited < 0.25 * 2048 * 2048


@pytest.mark.parametrize("name", sorted(STATIC))
def test_static_masks_split_and_every_visible_key_is_inside_its_block(name):
    """A static mask that is no band (prefix-LM, global tokens + window, and one
    that also reads captured arrays, which count as true): each block's key
    range is the tightest tile-aligned one that holds every key its rows see
    under the static conditions."""
    docs = DOCS
    fns = {"prefix_lm_doc": lambda s, b, h, q, k: jnp.where(
        ((k < 700) | (q >= k)) & (docs[b, q] == docs[b, k]), s, NEG)}
    mod = scoremod.trace(fns.get(name) or MODS[name])
    n = 2048
    blocks = split.plan(canonical(mod.expr), n, n, blocks=8, sms=1)
    assert blocks is not None and len(blocks) == 8, blocks
    q, k = np.arange(n)[:, None], np.arange(n)[None, :]
    kept = STATIC[name](q, k)
    for b in blocks:  # the tightest tile-aligned range that holds every visible key
        seen = np.flatnonzero(kept[b.q0:b.q1].any(axis=0))
        assert (b.k0, b.k1) == (seen[0] // 128 * 128, min(n, (seen[-1] // 128 + 1) * 128)), b


def _mask_values(expr, q0, q1, k0, k1):
    from scoremod.dsl.evaluate import evaluate

    grids = {"score": jnp.zeros((1, 1)), "b": 0, "h": 0,
             "q_idx": jnp.arange(q0, q1)[:, None], "kv_idx": jnp.arange(k0, k1)[None, :]}
    return np.broadcast_to(np.asarray(evaluate(expr, grids, {})) == 0, (q1 - q0, k1 - k0))


# Pure static masks: (fn, whether some block of BOXES narrows it; one with a hole or
# global keys narrows only on the blocks that do not hold them)
PURE = [
    (lambda q, k: (k < 100) | (q >= k), True),                      # prefix-LM
    (lambda q, k: (k < 128) | (q >= k), True),
    (lambda q, k: (q >= k) & (q - k < 200), True),                  # a band as written
    (lambda q, k: ((q >= k) & (q - k < 150)) | (k < 64), True),      # global tokens + window
    (lambda q, k: (q >= k) | (q < 300), True),                      # the first rows see everything
    (lambda q, k: ~(k > q) & (k >= 50), True),                       # keys from 50, causal
    (lambda q, k: (q >= k) & ((k < 32) | (k >= 40)), True),          # a hole in the keys
    (lambda q, k: (q + k < 700) | (q >= k), False),                 # not linear in kv - q
    (lambda q, k: (k - q <= 5) | (k == 0), True),
    (lambda q, k: (q == k) | (k < 0), True),                         # the diagonal only
]
BOXES = [(0, 128, 0, 128), (128, 256, 0, 256), (256, 512, 0, 512), (384, 512, 128, 512),
         (0, 512, 0, 640), (300, 301, 0, 400), (512, 1024, 0, 1024)]


@pytest.mark.parametrize("i", range(len(PURE)))
def test_narrowed_masks_equal_the_mask_on_every_position_of_the_block(i):
    """split.narrowed rewrites a pure static mask as one band (or no mask) only where
    that equals the mask at every (q, kv) of the block, checked here position by
    position; and it does narrow where it should."""
    fn, narrows = PURE[i]
    mod = scoremod.trace(lambda s, b, h, q, k: jnp.where(fn(q, k), s, NEG))
    changed = 0
    for q0, q1, k0, k1 in BOXES:
        got = split.narrowed(mod, split.Block(q0, q1, k0, k1))
        if got is mod:
            continue
        changed += 1
        qs, ks = np.arange(q0, q1)[:, None], np.arange(k0, k1)[None, :]
        want = np.broadcast_to(np.asarray(fn(qs, ks)), (q1 - q0, k1 - k0))
        if got is None:
            assert want.all(), (i, q0, k0)
        else:
            np.testing.assert_array_equal(_mask_values(got.expr, q0, q1, k0, k1), want)
            assert split.masks.band_of(got.expr)[3] == ()  # nothing but a band
    assert (changed > 0) == narrows, (i, changed)


def test_narrowed_blocks_compute_the_same_attention():
    """Prefix-LM split with its blocks narrowed (the first as plain attention, the
    rest causal): the same O, LSE and dQ as one call (the fast tier's check; the
    full tier runs every mod through test_blocks_compute_the_same_attention_and_gradients)."""
    mod = scoremod.trace(MODS["prefix_lm"])
    blocks = split.plan(canonical(mod.expr), 512, 512, blocks=4, sms=1)
    mods = split.block_mods(mod, blocks)
    assert mods[0] is None and all("kv_idx < 128" not in str(m) for m in mods[1:])
    q, k, v = inputs(512, 512)
    whole = jax.jit(lambda q: reference(q, k, v, mod))
    parts = jax.jit(lambda q: split.blockwise(q, k, v, mod, blocks, reference))
    for a, b in zip(parts(q), whole(q)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    g1, g2 = (jax.grad(lambda q: jnp.sum(f(q)[0] ** 2))(q) for f in (whole, parts))
    np.testing.assert_allclose(g2, g1, atol=1e-5, rtol=1e-5)


def test_prefix_lm_blocks_run_natively_past_the_prefix():
    """Pure prefix-LM by query blocks (split.by_structure: the plan's way where the
    prefix is off a tile edge): two blocks at any length, the prefix's rows as plain
    attention (with the score_mod where the prefix ends inside the first tile row),
    the rest under cuDNN's native causal mask (bottom-right in its own keys). With a
    softcap, or with native masks off, the blocks of the cost model, each with the
    score_mod."""
    for s, prefix in ((4096, 512), (32768, 4096), (1000, 100), (4096, 500)):
        pure = scoremod.trace(lambda x, b, h, q, k: jnp.where((k < prefix) | (q >= k), x, NEG))
        cut = -(-prefix // 128) * 128
        blocks = split.by_structure(pure, s, s, 8)
        assert blocks == (split.Block(0, cut, 0, cut), split.Block(cut, s, 0, s)), blocks
        first, rest = split.block_mods(pure, blocks)
        assert (first is None) == (prefix % 128 == 0), first
        band = split.masks.native_band(canonical(rest.expr), s - cut, s)
        assert band is not None and band.alignment == "BOTTOM_RIGHT"
    shape = Problem(4, 4096, 4096, 16, 16, 128, 128, "bfloat16")
    unaligned = scoremod.trace(lambda s, b, h, q, k: jnp.where((k < 500) | (q >= k), s, NEG))
    plan = Plan(unaligned, shape, 0.088, scoremod.LoweringOptions(sms=132))
    assert not plan.key_split and plan.blocks == split.by_structure(unaligned, 4096, 4096, 8)
    assert "1 of them as plain attention or under cuDNN's native mask" in plan.describe()
    pure = scoremod.trace(lambda s, b, h, q, k: jnp.where((k < 512) | (q >= k), s, NEG))
    soft = scoremod.trace(lambda s, b, h, q, k: jnp.where((k < 512) | (q >= k),
                                                          30 * jnp.tanh(s / 30), NEG))
    for mod, options in ((soft, scoremod.LoweringOptions(sms=132)),
                         (pure, scoremod.LoweringOptions(sms=132, native_masks=False))):
        plan = Plan(mod, shape, 0.088, options)
        assert len(plan.blocks) == 8 and all(p.fwd is not None for p in plan.parts)


def test_merged_joins_native_neighbours_only():
    """split.merged joins neighbouring blocks that run natively when their union
    does too (prefix-LM's blocks past the prefix: one causal call), never a
    score_mod block with a native one, and keeps the rows and keys covered."""
    pure = scoremod.trace(MODS["prefix_lm_unaligned"])  # kv < 100: the first tile row straddles
    blocks = tuple(split.Block(q0, q0 + 128, 0, q0 + 128) for q0 in range(0, 512, 128))
    got = split.merged(pure, blocks)
    assert got == (split.Block(0, 128, 0, 128), split.Block(128, 512, 0, 512)), got
    soft = scoremod.trace(MODS["softcap_prefix_lm"])
    assert split.merged(soft, blocks) == blocks
    assert split.merged(soft, blocks, joined_score_mods=True) == (split.Block(0, 512, 0, 512),)


def test_a_static_condition_on_the_head_or_batch_is_not_narrowed_to_head_zero():
    """Every block serves every batch and head: a condition that also reads h (head
    1 sees all keys) must not narrow the blocks to what head 0 sees; with no
    other condition, no split by tiles at all."""
    for fn in (lambda s, b, h, q, k: jnp.where((k < 100) | (q >= k) | (h == 1), s * 0.5, NEG),
               lambda s, b, h, q, k: jnp.where((k < 100) | (q >= k) | (b == 1), s * 0.5, NEG)):
        expr = canonical(scoremod.trace(fn).expr)
        assert block_maps.static_tiles(expr, 2048, 2048) is None
        assert split.plan(expr, 2048, 2048, blocks=8, sms=1) is None


@pytest.mark.parametrize("fn,sq", [
    (lambda s, b, h, q, k: 30 * jnp.tanh(s / 30), 4096),                        # no band
    (MODS["softcap_causal"], 128),                                               # one tile
    (lambda s, b, h, q, k: jnp.where(q - k < 4000, s * 2, NEG), 4096),           # nearly all visible
    (lambda s, b, h, q, k: jnp.where((q >= k) & (q - k > 600), s * 2, NEG), 512),  # early rows see nothing
])
def test_no_split_when_it_does_not_pay(fn, sq):
    assert split.plan(canonical(scoremod.trace(fn).expr), sq, sq, blocks=4, sms=1) is None


def test_shifted_mod_reads_operands_at_the_right_rows():
    mod = scoremod.trace(MODS["q_bias_causal"])
    shifted = split.shifted(mod, 256, 128)
    assert "q_idx + 256" in str(shifted) and "kv_idx + 128" in str(shifted)
    s = jnp.zeros((1, 1, 4, 4))
    i = jnp.arange(4)
    got = shifted(s, 0, 0, i[:, None] + 200, i[None, :])   # rows 456.., keys 128..
    want = mod(s, 0, 0, i[:, None] + 456, i[None, :] + 128)
    np.testing.assert_allclose(got, want)


def test_offset_is_never_simplified_and_round_trips_through_text():
    from scoremod.dsl import ir, ops
    from scoremod.dsl.text import format_expr, parse_expr

    q = ir.var("q_idx")
    zero = ops.apply("offset", q, ir.const(0, ir.I32))
    assert zero.op == "offset" and ops.apply("add", q, ir.const(0, ir.I32)) is q
    mod = split.shifted(scoremod.trace(MODS["softcap_causal"]), 0, 0, uniform=("q_idx",))
    assert canonical(mod.expr) is not None and "offset(q_idx, 0)" in format_expr(canonical(mod.expr))
    assert parse_expr(format_expr(mod.expr), {})[0] is mod.expr
    # the analyses that read index arithmetic read it as an addition
    from scoremod.dsl.rewrite import nonneg
    from scoremod.lowering.cudnn import masks

    assert nonneg(zero)
    pure = scoremod.trace(lambda s, b, h, q, k: jnp.where(q >= k, s, NEG))
    for q0 in (0, 256):
        part = canonical(split.shifted(pure, q0, 0, uniform=("q_idx",)).expr)
        want = canonical(split.shifted(pure, q0, 0).expr)
        assert masks.band_of(part) == masks.band_of(want) is not None


def _structure(root):
    """The expression's DAG with constant values left out: what a cuDNN graph's
    structure (and so its compiled kernel) depends on."""
    from scoremod.dsl import ir

    order = ir.toposort(root)
    at = {n: i for i, n in enumerate(order)}
    return [(n.op, n.dtype, None if n.op == "const" else n.attr, tuple(at[a] for a in n.args))
            for n in order]


@pytest.mark.parametrize("name", sorted(set(MODS) - set(NARROWED)))
def test_every_block_of_a_split_has_one_graph_structure(name):
    # cuDNN compiles a kernel per graph structure (measured on the H200: 1.4 s for
    # the first block, 0.9 s for the second, whose indices were shifted, 0.07 s
    # for each later one); with every block shifted alike, one compile serves all.
    mod = scoremod.trace(MODS[name])
    blocks = split.plan(canonical(mod.expr), 1024, 1024, blocks=8, sms=1)
    assert blocks is not None and len(blocks) >= 4
    sp = Plan(mod, Problem(2, 1024, 1024, 4, 2, 32, 32, "bfloat16"), 0.2,
              scoremod.LoweringOptions(split_blocks=8, sms=1))
    assert sp.blocks == blocks
    # Equal shifts are one hash-consed constant, so a block whose query and key
    # shifts are both 0 (the first block of a sliding window) feeds one scalar to
    # both: a second structure, as many compiles as before the offsets.
    both_zero = [b.q0 == b.k0 and "kv_idx" in split.shifted_indices(blocks) for b in blocks]
    assert both_zero == [name == "softcap_window"] + [False] * (len(blocks) - 1)
    for graph in ("fwd", "bwd"):
        first, *rest = [_structure(getattr(p, graph)) for p, same in zip(sp.parts, both_zero)
                        if not same]
        assert all(r == first for r in rest), graph
    assert len({tuple(l.spec.dtype for l in p.loads) for p in sp.parts}) == 1
    assert "offset(q_idx, 0)" in str(sp.parts[0].mod)  # the first block too, shifted by 0


@pytest.mark.parametrize("batch_heads,seq,count", [
    (64, 4096, 8),     # measured on the H200: 8 blocks 6-9% faster than 4 (forward)
    (64, 16384, 8),
    (64, 1024, 4),     # 8 blocks of one tile each would leave most of the GPU idle
    (8, 4096, 2),
    (1, 4096, None),   # one call already runs in one partial wave: splitting only adds waves
])
def test_block_count_follows_the_wave_model(batch_heads, seq, count):
    expr = canonical(scoremod.trace(MODS["softcap_causal"]).expr)
    blocks = split.plan(expr, seq, seq, blocks=8, batch_heads=batch_heads, sms=132)
    assert (None if blocks is None else len(blocks)) == count


def test_fused_path_splits_only_when_enabled():
    from scoremod.lowering.cudnn.plan import split_blocks

    mod = scoremod.trace(MODS["softcap_causal"])
    shape = Problem(4, 4096, 4096, 16, 16, 64, 64, "bfloat16")  # 64 batch-heads
    options = scoremod.LoweringOptions(sms=132)
    assert split_blocks(mod, shape, options.replace(split_blocks=0)) is None
    assert len(split_blocks(mod, shape, options.replace(split_blocks=4))) == 4
    pure = scoremod.trace(lambda s, b, h, q, k: jnp.where(q >= k, s, NEG))
    assert split_blocks(pure, shape, options) is None  # the native mask is better
    assert len(split_blocks(pure, shape, options.replace(native_masks=False))) == 8


@pytest.mark.parametrize("prefix,s", [(128, 512), (256, 512), (128, 640), (100, 512), (3, 256)])
def test_key_blocks_compute_the_same_attention_and_gradients(prefix, s):
    """Prefix-LM as key blocks (split.by_keys): every row against the prefix's
    keys as plain attention, the rest a square causal block; joined by their
    LSEs, the same O and LSE as one call, and each block's backward on the joined
    O and LSE (the fused path's: its probabilities are the row's on its keys)
    gives the gradients of one call once dQ is summed."""
    mod = scoremod.trace(lambda x, b, h, q, k: jnp.where((k < prefix) | (q >= k), x, NEG))
    blocks = split.by_keys(mod, s, s)
    assert blocks == (split.Block(0, s, 0, prefix), split.Block(prefix, s, prefix, s))
    first, rest = split.block_mods(mod, blocks)
    assert first is None and "<= 0" in str(rest), rest  # plain; causal in its own indices
    q, k, v = inputs(s, s)
    do = jax.random.normal(jax.random.PRNGKey(7), q.shape)

    def backward(q, k, v, m, o, lse, do):
        # softmax's backward from the given O and LSE: P = exp(S - LSE), D = rowsum(dO O)
        hi = jax.lax.Precision.HIGHEST
        sc, vjp = jax.vjp(lambda q, k: modified_scores(q, k, m, 1 / math.sqrt(q.shape[-1])), q, k)
        p = jnp.where(sc == -jnp.inf, 0.0, jnp.exp(sc - lse[..., None]))
        g = q.shape[2] // v.shape[2]
        vv = jnp.repeat(v, g, axis=2)
        dp = jnp.einsum("bqhd,bkhd->bhqk", do, vv, precision=hi)
        delta = jnp.einsum("bqhd,bqhd->bhq", do, o, precision=hi)
        dq, dk = vjp(p * (dp - delta[..., None]))
        dv = jnp.einsum("bhqk,bqhd->bkhd", p, do, precision=hi)
        dv = dv.reshape(dv.shape[:2] + (v.shape[2], g) + dv.shape[3:]).sum(3)
        return dq, dk, dv

    (o, lse), grads = split.keywise(q, k, v, mod, blocks, reference, backward, do)
    want_o, want_lse = reference(q, k, v, mod)
    np.testing.assert_allclose(o, want_o, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(lse, want_lse, atol=2e-5, rtol=2e-5)
    want = jax.grad(lambda q, k, v: jnp.sum(reference(q, k, v, mod)[0] * do), argnums=(0, 1, 2))(
        q, k, v)
    for got, w in zip(grads, want):
        np.testing.assert_allclose(got, w, atol=5e-5, rtol=5e-5)


def test_key_blocks_for_the_backward_of_pure_masks():
    """Plan: a pure prefix-LM (its prefix on a tile edge or not) runs its forward by
    query blocks and its backward by two key blocks (a square top-left causal
    block for the rest); a window with global keys too (the rest a band). With a
    softcap, or native masks off, no key blocks."""
    shape = Problem(4, 4096, 4096, 16, 16, 128, 128, "bfloat16")
    options = scoremod.LoweringOptions(sms=132)
    for prefix in (512, 500):
        pure = scoremod.trace(lambda s, b, h, q, k: jnp.where((k < prefix) | (q >= k), s, NEG))
        plan = Plan(pure, shape, 0.088, options)
        assert not plan.key_split and plan.split and len(plan.blocks) == 2
        back = plan.backward_plan
        assert back.key_split and back.blocks == (
            split.Block(0, 4096, 0, prefix), split.Block(prefix, 4096, prefix, 4096))
        assert [p.fwd is None for p in back.parts] == [True, True]
        assert back.parts[1].band.alignment == "TOP_LEFT", back.parts[1].band
        assert "the backward in 2 key blocks" in plan.describe()
    window = scoremod.trace(lambda s, b, h, q, k: jnp.where(((q >= k) & (q - k < 150)) | (k < 32),
                                                            s, NEG))
    back = Plan(window, shape, 0.088, options).backward_plan
    assert back.key_split and back.blocks[1] == split.Block(32, 4096, 32, 4096)
    assert back.parts[1].band.left_bound is not None
    soft = scoremod.trace(lambda s, b, h, q, k: jnp.where((k < 512) | (q >= k),
                                                          30 * jnp.tanh(s / 30), NEG))
    pure = scoremod.trace(lambda s, b, h, q, k: jnp.where((k < 512) | (q >= k), s, NEG))
    for mod, opts in ((soft, options), (pure, options.replace(native_masks=False))):
        plan = Plan(mod, shape, 0.088, opts)
        assert not plan.key_split and plan.backward_plan is plan


def test_none_kept_is_exact():
    """split._none_kept against the mask evaluated at every position of small blocks."""
    masks = [lambda q, k: (k < 100) | (q >= k), lambda q, k: ((q >= k) & (q - k < 150)) | (k < 32),
             lambda q, k: (q >= k) & (k >= 40)]
    for fn in masks:
        mod = scoremod.trace(lambda s, b, h, q, k: jnp.where(fn(q, k), s, NEG))
        for blk in (split.Block(0, 100, 100, 300), split.Block(0, 99, 100, 300),
                    split.Block(0, 40, 30, 300), split.Block(10, 20, 0, 5), split.Block(0, 0, 0, 5)):
            q = np.arange(blk.q0, blk.q1)[:, None]
            k = np.arange(blk.k0, blk.k1)[None]
            want = not np.asarray(fn(q, k)).any()
            assert split._none_kept(mod, blk) == want, (blk, want)


@pytest.mark.parametrize("sq,skv", [(256, 640), (512, 640), (640, 640), (1024, 1024)])
def test_key_blocks_trace_through_the_fused_pipeline(stand_in_h200, monkeypatch, sq, skv):
    """The cuDNN path's forward and backward of key blocks, with and without sinks
    (their gradient summed by cuDNN's backward: Cudnn.backward_with_sinks, once),
    trace under jit and grad through lowering.sharding's custom_partitioning (which
    refuses a body with constants: `.at[].set` over every row made one) on a faked
    H200 whose graphs and FFI calls are stand-ins returning zeros."""
    mod = lambda s, b, h, q, k: jnp.where((k < 128) | (q + skv - sq >= k), s, NEG)  # noqa: E731
    q = jnp.zeros((2, sq, 8, 64), jnp.bfloat16)
    k = jnp.zeros((2, skv, 2, 64), jnp.bfloat16)
    plan = Plan(scoremod.trace(mod), Problem.of(q, k, k), 0.125, scoremod.LoweringOptions())
    assert plan.backward_plan.key_split
    for keyed in (plan.backward_plan, Plan(scoremod.trace(mod), Problem.of(q, k, k), 0.125,
                                          scoremod.LoweringOptions(), key_split=plan.backward_plan.blocks)):
        assert keyed.key_split
    # and query blocks of a score_mod (softcap + causal), for the same pipeline
    softcap = lambda s, b, h, q, k: jnp.where(q + skv - sq >= k, 30 * jnp.tanh(s / 30), NEG)  # noqa: E731
    four = scoremod.LoweringOptions(split_blocks=4, sms=1)
    assert Plan(scoremod.trace(softcap), Problem.of(q, k, k), 0.125, four).split or sq < 1024
    from scoremod.lowering.cudnn import backend as cudnn_backend

    summed = []
    monkeypatch.setattr(cudnn_backend, "SINK_GRADIENT_IN_GRAPH", True)
    with_sinks = cudnn_backend.Cudnn.backward_with_sinks
    monkeypatch.setattr(cudnn_backend.Cudnn, "backward_with_sinks",
                        lambda self, plan, *a: summed.append(plan) or with_sinks(self, plan, *a))
    for m, options in ((mod, None), (softcap, four)):
        for sinks in (None, jnp.zeros(8)):
            def loss(q, k, s):
                o = scoremod.attention(q, k, k, m, sinks=s, implementation="cudnn",
                                       options=options)
                return jnp.sum(o.astype(jnp.float32))
            jax.jit(loss).lower(q, k, sinks)
            # with the sinks' gradient: cuDNN's backward sums it (a backward_sinks call)
            argnums = (0, 1) if sinks is None else (0, 1, 2)
            summed.clear()
            jax.jit(jax.grad(loss, argnums=argnums)).lower(q, k, sinks)
            assert len(summed) == (sinks is not None), summed
