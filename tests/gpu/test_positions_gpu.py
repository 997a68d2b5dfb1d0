"""Positions and lengths on the GPU: decode steps (one and four query rows at
traced offsets, ragged lengths, a paged cache) and a prefill chunk's gradients,
on each fused backend, against the reference path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from tests.pallas_cases import quiet  # noqa: F401 - the autouse fixture

pytestmark = pytest.mark.gpu

TOL = 3e-2
B, HQ, HKV, D, SKV, PAGE = 4, 8, 2, 128, 2048, 64
SLOPES = jnp.asarray([2.0 ** (-(i + 1)) for i in range(HQ)], jnp.float32)
MODS = {
    "softcap": lambda s, b, h, q, k: jnp.where(q >= k, 30.0 * jnp.tanh(s / 30.0), -jnp.inf),
    "window": lambda s, b, h, q, k: jnp.where((q >= k) & (q - k < 512), s, -jnp.inf),
    "alibi": lambda s, b, h, q, k: jnp.where(q >= k, s + SLOPES[h] * (k - q), -jnp.inf),
}
ROUTES = {"pallas": ("pallas", scoremod.LoweringOptions(pallas_engine="mosaic")),
          "cudnn": ("cudnn", None), "auto": (None, None)}


def _skip_unless_hopper(impl):
    from scoremod import device

    if impl == "pallas" and device.current().family != 9:
        pytest.skip("the Mosaic GPU engine runs on Hopper GPUs only")


def _inputs(sq, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    return tuple(jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)
                 for key, shape in zip(ks, [(B, sq, HQ, D), (B, SKV, HKV, D), (B, SKV, HKV, D),
                                            (B, sq, HQ, D)]))


def _err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_array_equal(np.isneginf(a), np.isneginf(b))
    fin = np.isfinite(b)
    assert np.isfinite(a[fin]).all()
    return np.max(np.abs(a[fin] - b[fin]), initial=0) / (np.max(np.abs(b[fin]), initial=0) + 1e-6)


def _paged(k, v, seed=1, page=PAGE):
    """The cache as shuffled pages, and its page table."""
    pages = SKV // page
    order = np.random.default_rng(seed).permutation(B * pages).reshape(B, pages)
    cache = [np.zeros((B * pages, page, HKV, D), np.float32) for _ in range(2)]
    for b in range(B):
        for p in range(pages):
            for c, x in zip(cache, (k, v)):
                c[order[b, p]] = np.asarray(x[b, p * page:(p + 1) * page], np.float32)
    return (*(jnp.asarray(c, jnp.bfloat16) for c in cache), jnp.asarray(order, jnp.int32))


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("sq", [1, 4])
@pytest.mark.parametrize("name", sorted(MODS))
@pytest.mark.parametrize("route", sorted(ROUTES))
def test_decode_steps_match_the_reference(route, name, sq, paged):
    impl, options = ROUTES[route]
    _skip_unless_hopper(impl)
    q, k, v, _ = _inputs(sq)
    lengths = jnp.asarray([1000, SKV, 17, 1500], jnp.int32)
    offsets = lengths - sq
    table = None
    if paged:
        k, v, table = _paged(k, v)

    def run(impl, options):
        return jax.jit(lambda q, k, v, off, n: scoremod.attention(
            q, k, v, MODS[name], implementation=impl, options=options, return_lse=True,
            q_offset=off, kv_lengths=n, page_table=table))(q, k, v, offsets, lengths)

    want = run("xla", None)
    got = run(impl, options)
    for a, b in zip(got, want):
        assert _err(a, b) < TOL
    # the next step, at new positions: the same compiled call
    again = run(impl, options)
    np.testing.assert_array_equal(np.asarray(again[0]), np.asarray(got[0]))


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_speculative_tree_mask_matches_the_reference(route):
    """Four draft queries with a tree mask per query and key (Flax's [B, 1, Sq, Skv]
    mask, read per score; on the Mosaic engine with the query heads packed into
    the rows) and a softcap, at traced offsets: O and LSE against the reference."""
    impl, options = ROUTES[route]
    _skip_unless_hopper(impl)
    sq = 4
    q, k, v, _ = _inputs(sq)
    lengths = jnp.asarray([1000, SKV, 17, 1500], jnp.int32)
    rng = np.random.default_rng(3)
    tree = rng.random((B, 1, sq, SKV)) < 0.5
    tree |= np.arange(SKV) < (np.asarray(lengths)[:, None, None, None] - sq)  # the prefix
    for b, n in enumerate(np.asarray(lengths)):  # each draft sees its ancestors and itself
        tree[b, 0, :, n - sq:n] &= np.tril(np.ones((sq, sq), bool))
        tree[b, 0, np.arange(sq), n - sq + np.arange(sq)] = True
    tree = jnp.asarray(tree)

    def mod(s, b, h, qi, ki):  # qi, ki from 0: the mask is laid out by the row's positions
        return jnp.where(tree[b, 0, qi, ki], 30.0 * jnp.tanh(s / 30.0), -jnp.inf)

    def run(impl, options):
        return jax.jit(lambda q, k, v, n: scoremod.attention(
            q, k, v, mod, implementation=impl, options=options, return_lse=True,
            kv_lengths=n))(q, k, v, lengths)

    if impl == "pallas":
        assert "packed" in scoremod.which_implementation(
            q, k, v, mod, implementation=impl, options=options, kv_lengths=lengths).variant
    for a, b in zip(run(impl, options), run("xla", None)):
        assert _err(a, b) < TOL


@pytest.mark.parametrize("page", [64, 128, 256])
@pytest.mark.parametrize("route", ["auto", "pallas"])
def test_the_kernel_reads_the_pages(route, page):
    """On Hopper a decode step on a paged cache runs the Mosaic kernel on the pages
    (which_implementation says so): O and LSE bitwise those of the same call on the
    rows, and its gradients (through the gathered rows) the reference path's."""
    impl, options = ROUTES[route]
    _skip_unless_hopper("pallas")
    q, k, v, do = _inputs(1)
    kp, vp, table = _paged(k, v, page=page)
    lengths = jnp.asarray([1000, SKV, 17, 1500], jnp.int32)
    kw = dict(q_offset=lengths - 1, kv_lengths=lengths)
    for name in sorted(MODS):
        choice = scoremod.which_implementation(q, kp, vp, MODS[name], implementation=impl,
                                               options=options, page_table=table, **kw)
        assert "through the page table" in (choice.pages or ""), (name, choice.pages)

        def run(k, v, table, impl=impl, options=options):
            return jax.jit(lambda q, k, v: scoremod.attention(
                q, k, v, MODS[name], implementation=impl, options=options, return_lse=True,
                page_table=table, **kw))(q, k, v)

        for a, b in zip(run(kp, vp, table), run(k, v, None)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

        def grads(impl, options, k, v, table):
            def loss(q, k, v):
                o = scoremod.attention(q, k, v, MODS[name], implementation=impl,
                                       options=options, page_table=table, **kw)
                return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

            return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

        for a, b in zip(grads(impl, options, kp, vp, table), grads("xla", None, kp, vp, table)):
            assert _err(a, b) < TOL, name


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_prefill_chunk_has_the_reference_gradients(route):
    impl, options = ROUTES[route]
    _skip_unless_hopper(impl)
    q, k, v, do = _inputs(256)
    offsets = jnp.asarray([0, 512, 1024, 1792], jnp.int32)
    lengths = offsets + 256

    def grads(impl, options):
        def loss(q, k, v):
            o = scoremod.attention(q, k, v, MODS["softcap"], implementation=impl,
                                   options=options, q_offset=offsets, kv_lengths=lengths)
            return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    for a, b in zip(grads(impl, options), grads("xla", None)):
        assert _err(a, b) < TOL


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("splits", [None, 1])  # None: 8 chunks of 1024 here
@pytest.mark.parametrize("name", sorted(MODS))
@pytest.mark.parametrize("route", ["cudnn", "pallas"])
def test_folded_decode_matches_the_reference_with_gradients(route, name, splits, dtype):
    """Short queries folded (lowering/decode.py: a group's query heads packed into
    rows, the keys in chunks folded into the batch; None: the library's count): O,
    LSE, dQ, dK and dV against the reference path, the fold named by the route, and
    bitwise the same on a second run."""
    impl, options = ROUTES[route]
    _skip_unless_hopper(impl)
    options = (options or scoremod.LoweringOptions()).replace(decode_splits=splits)
    skv, sq = 8192, 2
    ks = jax.random.split(jax.random.PRNGKey(3), 4)
    q, k, v, do = (jax.random.normal(key, shape, jnp.float32).astype(dtype) for key, shape in zip(
        ks, [(B, sq, HQ, D), (B, skv, HKV, D), (B, skv, HKV, D), (B, sq, HQ, D)]))
    offsets = jnp.asarray([skv - sq, 5000, 300, 8000], jnp.int32)
    choice = scoremod.which_implementation(q, k, v, MODS[name], implementation=impl,
                                           options=options, q_offset=offsets)
    assert "short queries folded" in (choice.variant or ""), choice.variant

    def run(impl, options):
        def loss(q, k, v):
            o, lse = scoremod.attention(q, k, v, MODS[name], implementation=impl,
                                        options=options, return_lse=True, q_offset=offsets)
            return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)), (o, lse)

        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
            q, k, v)
        return (*out, *grads)

    got, want = run(impl, options), run("xla", None)
    for a, b in zip(got, want):
        assert _err(a, b) < TOL
    for a, b in zip(run(impl, options.replace(deterministic=True)),
                    run(impl, options.replace(deterministic=True))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("splits", [0, 1, None])
@pytest.mark.parametrize("sq", [1, 4])
@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("b,hq,hkv", [(2, 8, 2), (8, 32, 8)], ids=["b2h8on2", "b8h32on8"])
def test_static_position_alibi_decode_matches_the_reference(route, sq, splits, b, hq, hkv):
    """ALiBi at a static position deep in a long cache (the decode probe's form: the
    bias reaches -27000), unfolded, packed and split: O and LSE against the
    reference path. The probe (2026-12-05, b8 hq32 hkv8, 32768 keys) saw cuDNN's
    unfolded and folded calls differ by 3.5 in O at one query row (agreeing at
    four), the Pallas kernels' agree. On 2026-12-06 (cuDNN 9.19) cuDNN's unfolded call
    at one row of the second shape was the wrong one (O off by 1.35); cuDNN now
    refuses one query row with a captured array unless the fold packs rows, and
    implementation=None takes the Pallas kernels there."""
    impl, options = ROUTES[route]
    _skip_unless_hopper(impl)
    options = (options or scoremod.LoweringOptions()).replace(decode_splits=splits)
    if impl == "cudnn" and sq == 1 and splits == 0:
        q = jnp.zeros((b, 1, hq, D), jnp.bfloat16)
        w = jnp.linspace(0.1, 1.0, hq)  # captured (jnp.ones(hq)[h] would trace to 1.0)
        with pytest.raises(scoremod.ScoreModError, match="wrongly at one query row"):
            scoremod.attention(q, q, q, lambda s, b, h, qi, ki: s + w[h],
                               implementation="cudnn", options=options)
        return
    skv = 32768
    off = skv - sq
    slopes = jnp.asarray(2.0 ** (-8.0 * np.arange(1, hq + 1) / hq), jnp.float32)
    ks = jax.random.split(jax.random.PRNGKey(5), 3)
    q, k, v = (jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16) for key, shape in
               zip(ks, [(b, sq, hq, D), (b, skv, hkv, D), (b, skv, hkv, D)]))

    def mod(s, b, h, qi, ki):
        return s + slopes[h] * (ki - qi - off).astype(jnp.float32)

    def run(impl, options):
        return jax.jit(lambda q, k, v: scoremod.attention(
            q, k, v, mod, implementation=impl, options=options, return_lse=True))(q, k, v)

    want = run("xla", None)
    for a, b in zip(run(impl, options), want):
        assert _err(a, b) < TOL


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_decode_loop_compiles_once(route):
    """Steps at new traced positions reuse one compiled call on every route (a
    module imported while the first call is traced may add a config state to
    jit's cache key: kernels.py imports the known ones ahead)."""
    impl, options = ROUTES[route]
    _skip_unless_hopper(impl)
    q, k, v, _ = _inputs(1)
    step = jax.jit(lambda q, k, v, pos: scoremod.attention(
        q, k, v, MODS["softcap"], implementation=impl, options=options, q_offset=pos,
        kv_lengths=pos + 1))
    for t in (100, 1000, SKV - 1):
        jax.block_until_ready(step(q, k, v, jnp.full((B,), t, jnp.int32)))
    assert step._cache_size() == 1
