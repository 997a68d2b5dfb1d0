"""Short queries folded for the kernels (lowering/decode.py): the fold is the
same attention, through the pipeline as on its own, with its gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from scoremod import positions
from scoremod.errors import ScoreModError
from scoremod.lowering import decode, registry
from scoremod.lowering.backend import Call
from scoremod.lowering.problem import Problem

NEG = -jnp.inf
TRITON = scoremod.LoweringOptions(pallas_engine="triton", decode_splits=4)


def _inputs(b=2, sq=1, hq=8, hkv=2, skv=512, d=64, dtype=jnp.float32, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(ks[0], (b, sq, hq, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, skv, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, skv, hkv, d), jnp.float32).astype(dtype)
    return q, k, v


def _mods(skv, b=2, hq=8):
    """Mods that read every index and arrays at b, at h and at positions."""
    slopes = jnp.linspace(0.01, 0.2, hq)
    bias = jnp.linspace(-1.0, 1.0, b)
    ramp = jnp.sin(jnp.arange(skv, dtype=jnp.float32))
    lengths = jnp.asarray([skv - 37, skv // 3][:b], jnp.int32)
    return {
        "softcap": lambda s, bb, h, q, k: 30.0 * jnp.tanh(s / 30.0),
        "alibi_window": lambda s, bb, h, q, k: jnp.where(
            (q + skv - 4 >= k) & (q + skv - 4 - k < skv // 3),
            s + slopes[h] * (k - q).astype(jnp.float32), NEG),
        "batch_and_keys": lambda s, bb, h, q, k: jnp.where(
            k < lengths[bb], s * (1.0 + 0.1 * h) + bias[bb] + ramp[k], NEG),
        "by_index": lambda s, bb, h, q, k: s + 0.01 * (bb + 2 * h - q).astype(jnp.float32)
                                           + jnp.where(k % 3 == 0, 0.5, 0.0),
    }


def _folded_by_hand(q, k, v, mod, fold):
    """The folded call on the reference path (its rewritten mod and operands),
    joined: what the pipeline runs, without the pipeline."""
    p = Problem.of(q, k, v)
    traced = scoremod.trace(mod)
    expr, _ = decode.rewrite(traced, fold, p)
    inner_mod = scoremod.ScoreMod(expr)
    ops = decode.operands(traced, fold, p, traced.operands, inner_mod)
    fp = fold.problem(p)
    plan = registry.REFERENCE.plan(fp, inner_mod, 1 / np.sqrt(p.d), scoremod.LoweringOptions(),
                                   True)
    o, lse = registry.REFERENCE.forward(plan, decode.fold_queries(q, fold, p.hkv),
                                        decode.fold_keys(k, fold), decode.fold_keys(v, fold),
                                        ops)
    return decode.join(o, lse, fold, p)


@pytest.mark.parametrize("fold", [decode.Fold(4, 1), decode.Fold(1, 4), decode.Fold(4, 8),
                                  decode.Fold(2, 2)])
@pytest.mark.parametrize("name", ["softcap", "alibi_window", "batch_and_keys", "by_index"])
def test_the_fold_is_the_same_attention(fold, name):
    q, k, v = _inputs(hq=8, hkv=8 // fold.group, sq=3)
    mod = _mods(512)[name]
    got = _folded_by_hand(q, k, v, mod, fold)
    want = scoremod.attention(q, k, v, mod, implementation="xla", return_lse=True)
    np.testing.assert_allclose(got[0], want[0], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(got[1], want[1], atol=2e-5, rtol=2e-5)


def test_rows_masked_in_every_chunk_give_zeros_and_minus_inf():
    q, k, v = _inputs(sq=2)
    mod = lambda s, b, h, qi, ki: jnp.where((b == 1) | (qi == 1), NEG, s)  # noqa: E731
    o, lse = _folded_by_hand(q, k, v, mod, decode.Fold(4, 4))
    assert not np.isnan(np.asarray(o)).any()
    np.testing.assert_array_equal(o[1], 0.0)
    np.testing.assert_array_equal(o[0, 1], 0.0)
    assert np.isneginf(np.asarray(lse[1])).all() and np.isneginf(np.asarray(lse[0, :, 1])).all()
    assert np.isfinite(np.asarray(lse[0, :, 0])).all()


def _grads(impl, options, q, k, v, mod_of, learned, sinks=None, **kw):
    def loss(q, k, v, learned, sinks):
        o, lse = scoremod.attention(q, k, v, mod_of(learned), implementation=impl,
                                    options=options, return_lse=True, sinks=sinks, **kw)
        w = jnp.cos(jnp.arange(o.shape[-1], dtype=jnp.float32))
        return jnp.sum(o.astype(jnp.float32) * w) + 0.1 * jnp.sum(jnp.where(
            jnp.isfinite(lse), jnp.sin(lse), 0.0))

    argnums = (0, 1, 2, 3) + ((4,) if sinks is not None else ())
    return jax.value_and_grad(loss, argnums=argnums)(q, k, v, learned, sinks)


def _close(got, want, tol):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   atol=tol, rtol=tol)


def test_the_pipeline_folds_and_learns_on_the_pallas_kernels():
    """Through attention on the Pallas kernels (interpret mode): O, the LSE with its
    cotangent, dQ, dK, dV, a learned per-head array, sinks, traced positions and
    lengths; bitwise the same on a second run."""
    q, k, v = _inputs(sq=2)
    skv = k.shape[1]
    slopes = jnp.linspace(0.01, 0.2, q.shape[2])

    def mod_of(sl):
        return lambda s, b, h, qi, ki: 20.0 * jnp.tanh(s / 20.0) + sl[h] * (ki - qi).astype(
            jnp.float32) / skv

    kw = dict(q_offset=jnp.asarray([skv - 2, 100], jnp.int32),
              kv_lengths=jnp.asarray([skv, 300], jnp.int32),
              sinks=jnp.linspace(-1.0, 1.0, q.shape[2]))
    choice = scoremod.which_implementation(q, k, v, mod_of(slopes), implementation="pallas",
                                           options=TRITON, sinks=kw["sinks"])
    assert "short queries folded" in choice.variant and "4 chunks of 128" in choice.variant
    got = jax.jit(lambda q, k, v, sl, sk, qo, kl: _grads(
        "pallas", TRITON, q, k, v, mod_of, sl, sk, q_offset=qo, kv_lengths=kl))
    args = (q, k, v, slopes, kw["sinks"], kw["q_offset"], kw["kv_lengths"])
    first, again = got(*args), got(*args)
    want = _grads("xla", None, q, k, v, mod_of, slopes, kw["sinks"], q_offset=kw["q_offset"],
                  kv_lengths=kw["kv_lengths"])
    _close(first, want, 2e-4)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_folded_under_vmap_and_packing_only():
    q, k, v = _inputs(sq=1)
    mod = _mods(k.shape[1])["batch_and_keys"]
    packing = TRITON.replace(decode_splits=1)
    for options in (TRITON, packing):
        got = jax.vmap(lambda q, k, v: scoremod.attention(
            q, k, v, mod, implementation="pallas", options=options))(q[None], k[None], v[None])
        want = scoremod.attention(q, k, v, mod, implementation="xla")
        np.testing.assert_allclose(got[0], want, atol=2e-5, rtol=2e-5)


def _call(problem, options, backend="pallas"):
    be = registry.get(backend)
    plan = be.plan(problem, None, 0.125, options, True)
    return Call(be, plan, problem, options)


def test_which_calls_fold():
    p = Problem(b=8, sq=1, skv=32768, hq=32, hkv=8, d=128, dv=128, dtype="bfloat16")
    opts = scoremod.LoweringOptions(pallas_engine="triton", sms=132)
    fold, inner = decode.choose(_call(p, opts))
    # 64 query tiles once packed; 8 chunks give 512 tiles, two waves of 132 SMs
    assert fold == decode.Fold(4, 8) and inner.problem == fold.problem(p)
    assert inner.options.decode_splits == 0 and decode.choose(inner) is None
    assert decode.choose(_call(p, opts.replace(decode_splits=0))) is None
    assert decode.choose(_call(p, opts.replace(decode_splits=1)))[0] == decode.Fold(4, 1)
    assert decode.choose(_call(p, opts.replace(decode_splits=6)))[0] == decode.Fold(4, 4)
    many = Problem(b=64, sq=1, skv=4096, hq=8, hkv=8, d=64, dv=64, dtype="bfloat16")
    assert decode.choose(_call(many, opts)) is None  # 512 tiles already, no group to pack
    long_rows = Problem(b=1, sq=16, skv=8192, hq=16, hkv=2, d=64, dv=64, dtype="bfloat16")
    assert decode.choose(_call(long_rows, opts)) is None  # 128 packed rows: not short
    chunk = Problem(b=1, sq=24, skv=8192, hq=2, hkv=2, d=64, dv=64, dtype="bfloat16")
    assert decode.choose(_call(chunk, opts)) is None  # 24 queries: a prefill chunk
    short_keys = Problem(b=1, sq=1, skv=1000, hq=1, hkv=1, d=64, dv=64, dtype="bfloat16")
    assert decode.choose(_call(short_keys, opts)) is None  # no chunk of 1024 aligned keys
    # the reference path computes every score at once: nothing to fold
    assert decode.choose(_call(p, opts, backend="xla")) is None


def test_a_call_that_skips_tiles_is_not_folded(stand_in_h200):
    """A window at a static position skips its dead tiles (cuDNN's native mask, the
    Pallas block map); folded, its indices would read the batch row and every tile
    would be computed. At a traced position (an operand) it folds."""
    p = Problem(b=8, sq=1, skv=32768, hq=32, hkv=8, d=128, dv=128, dtype="bfloat16")
    opts = scoremod.LoweringOptions(pallas_engine="triton", sms=132)
    window = scoremod.trace(lambda s, b, h, q, k: jnp.where(
        (q + 32767 >= k) & (q + 32767 - k < 4096), s, NEG))
    causal = scoremod.trace(lambda s, b, h, q, k: jnp.where(q + 32767 >= k, s, NEG))
    for name in ("pallas", "cudnn"):
        be = registry.get(name)
        for mod, folds in ((window, False), (causal, True)):
            call = Call(be, be.plan(p, mod, 0.125, opts, True), p, opts)
            assert (decode.choose(call) is not None) == folds, (name, mod)
    q = jnp.zeros((8, 1, 32, 128), jnp.bfloat16)
    k = jnp.zeros((8, 32768, 8, 128), jnp.bfloat16)
    choice = scoremod.which_implementation(  # the offset an operand of the mod
        q, k, k, lambda s, b, h, qi, ki: jnp.where((qi >= ki) & (qi - ki < 4096), s, NEG),
        implementation="pallas", options=opts, q_offset=jnp.full((8,), 32767, jnp.int32))
    assert "short queries folded" in choice.variant


def test_decode_splits_is_checked():
    for bad in (-1, 1.5, True, "4"):
        with pytest.raises(ScoreModError, match="decode_splits"):
            scoremod.LoweringOptions(decode_splits=bad)
    assert scoremod.LoweringOptions.plain().decode_splits == 0


def test_folded_calls_trace_through_the_cudnn_pipeline(stand_in_h200):
    """Decode steps on cuDNN (a faked H200): folded, planned and traced under jit
    and grad through custom_partitioning (which refuses a body with constants),
    with per-head sinks joined around the folded call and positions traced."""
    q = jnp.zeros((8, 1, 32, 128), jnp.bfloat16)
    k = jnp.zeros((8, 32768, 8, 128), jnp.bfloat16)
    slopes = jnp.linspace(0.01, 0.2, 32)
    mods = {"softcap": lambda s, b, h, qi, ki: 30.0 * jnp.tanh(s / 30.0),
            "alibi": lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi).astype(jnp.float32),
            "window": lambda s, b, h, qi, ki: jnp.where(qi - ki < 4096, s, NEG)}
    offset = jnp.full((8,), 32767, jnp.int32)
    for name, mod in mods.items():
        choice = scoremod.which_implementation(q, k, k, mod, sinks=jnp.zeros(32),
                                               q_offset=offset, implementation="cudnn")
        assert "4 query rows, the keys in 8 chunks of 4096" in choice.variant, choice.variant
        assert "after" in choice.sinks, choice.sinks

        def loss(q, k, sinks, offset, mod=mod):
            o = scoremod.attention(q, k, k, mod, sinks=sinks, q_offset=offset,
                                   implementation="cudnn")
            return jnp.sum(o.astype(jnp.float32))

        jax.jit(loss).lower(q, k, jnp.zeros(32), offset)
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, jnp.zeros(32), offset)


@pytest.mark.parametrize("chunk", range(4))
def test_the_fold_is_the_same_attention_on_random_mods(chunk):
    """Random mods of the score and every index (test_differential's generator), at
    random folds: the folded call on the reference path, joined, equals the call."""
    import random

    from tests.test_differential import _fn, _traced, random_exprs

    rng = random.Random(chunk)
    done = 0
    for js, _ in random_exprs(900 + chunk, 40, traced_only=True, depth=3):
        mod = _traced(_fn(js))
        if mod is None:
            continue
        group, splits, sq = rng.choice([1, 2, 4]), rng.choice([1, 2, 4]), rng.choice([1, 3])
        if group == splits == 1:
            continue
        q, k, v = _inputs(sq=sq, hq=8, hkv=8 // group, skv=256, seed=done)
        want = scoremod.attention(q, k, v, mod, implementation="xla", return_lse=True)
        if not all(np.isfinite(np.asarray(x)).all() for x in want):
            continue  # a mod whose rows overflow: nothing to compare
        got = _folded_by_hand(q, k, v, mod, decode.Fold(group, splits))
        for a, b, what in zip(got, want, ("O", "LSE")):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4,
                                       err_msg=f"{what} of {js} at {group}, {splits}, sq {sq}")
        done += 1
        if done == 5:
            break
    assert done == 5


def test_a_folded_decode_loop_compiles_once():
    """Decode steps at new traced positions reuse the one compiled, folded call."""
    q, k, v = _inputs(sq=1)
    causal = lambda s, b, h, qi, ki: jnp.where(qi >= ki, 30.0 * jnp.tanh(s / 30.0), NEG)  # noqa: E731
    step = jax.jit(lambda q, k, v, pos: scoremod.attention(
        q, k, v, causal, implementation="pallas", options=TRITON, q_offset=pos,
        kv_lengths=pos + 1))
    for t in (100, 300, 511):
        pos = jnp.full((q.shape[0],), t, jnp.int32)
        got = step(q, k, v, pos)
        want = scoremod.attention(q, k, v, causal, implementation="xla", q_offset=pos,
                                  kv_lengths=pos + 1)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    assert step._cache_size() == 1
    assert "short queries folded" in scoremod.which_implementation(
        q, k, v, causal, implementation="pallas", options=TRITON, q_offset=pos,
        kv_lengths=pos + 1).variant


def test_mosaic_engine_packs_and_splits_keys_itself(stand_in_h200):
    """On the Pallas kernels' Mosaic GPU engine the fold only packs query heads, and
    the packed call's forward splits each query tile's key list over programs
    (``PallasPlan.key_parts``): a window at a static position too (packing reads
    no batch row, so its static block map stays), with parts of its live tiles;
    ``decode_splits`` gives the parts."""
    from scoremod import support

    if support.mosaic_missing():
        pytest.skip(f"the Mosaic GPU engine is {support.mosaic_missing()}")
    p = Problem(b=8, sq=1, skv=32768, hq=32, hkv=8, d=128, dv=128, dtype="bfloat16")
    opts = scoremod.LoweringOptions(pallas_engine="mosaic", sms=132)
    window = scoremod.trace(lambda s, b, h, q, k: jnp.where(
        (q + 32767 >= k) & (q + 32767 - k < 4096), s, NEG))
    be = registry.get("pallas")
    for mod, parts in ((None, 2), (window, 2)):  # 64 packed tiles; 256 or 33 key tiles
        call = Call(be, be.plan(p, mod, 0.125, opts, True), p, opts)
        fold, inner = decode.choose(call)
        assert fold == decode.Fold(4, 1) and inner.problem == fold.problem(p)
        assert inner.plan.engine == "mosaic" and inner.plan.key_parts == parts, mod
        assert decode.choose(inner) is None  # not folded again
    given = opts.replace(decode_splits=8)
    fold, inner = decode.choose(Call(be, be.plan(p, None, 0.125, given, True), p, given))
    assert fold == decode.Fold(4, 1) and inner.plan.key_parts == 8
    assert decode.choose(_call(p, opts.replace(decode_splits=0))) is None
    # Lengths known at run time (kv_lengths): twice the parts, spread by the rows' lists.
    lengths = jnp.full((8,), 32768, jnp.int32)
    ragged = positions.apply_positions(None, 8, kv_lengths=lengths)
    fold, inner = decode.choose(Call(be, be.plan(p, ragged, 0.125, opts, True), p, opts))
    assert inner.plan.key_parts == 4 and inner.plan.part_spread == 132
    fold, inner = decode.choose(Call(be, be.plan(p, window, 0.125, opts, True), p, opts))
    assert inner.plan.part_spread == 0
    fold, inner = decode.choose(Call(be, be.plan(p, ragged, 0.125, given, True), p, given))
    assert inner.plan.key_parts == 8 and inner.plan.part_spread == 0


def test_pallas_claims_short_queries_on_the_mosaic_engine(stand_in_h200):
    """implementation=None runs short queries on the Pallas kernels' Mosaic GPU
    engine (packed, key parts: faster than cuDNN's fold where measured), not
    with decode_splits=0 (no folding), not for a prefill chunk."""
    from scoremod import support

    if support.mosaic_missing():
        pytest.skip(f"the Mosaic GPU engine is {support.mosaic_missing()}")
    k = jnp.zeros((8, 4096, 8, 128), jnp.bfloat16)
    alibi = lambda s, b, h, q, kv: s + 0.5 * (kv - q).astype(jnp.float32)  # noqa: E731

    def chosen(sq, **kw):
        q = jnp.zeros((8, sq, 32, 128), jnp.bfloat16)
        return scoremod.which_implementation(q, k, k, alibi,
                                             options=scoremod.LoweringOptions(**kw))

    one = chosen(1)
    assert one[0] == "pallas" and "short queries" in one[1], one
    assert "packed" in one.variant, one.variant
    assert chosen(1, decode_splits=0)[0] == "cudnn"
    assert chosen(64)[0] == "cudnn"
