"""Segment masks on cuDNN's variable-length attention, on a GPU, against the reference path.

Each case checks O, LSE, dQ, dK and dV three times: through
``scoremod.attention`` with the ids closed over (the route decided when the
call is traced), with the ids as arguments of the jitted function (decided
per call by a ``lax.cond``), and through the ragged route alone (so a
choice that always fell back could not hide a wrong ragged graph). Which route the ids take is asserted from NumPy's
reading of them. Errors are printed (``pytest -s``) and named on failure.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from scoremod.lowering.cudnn import graph as cudnn_graph
from scoremod.lowering.cudnn_varlen import backend as vb
from scoremod.lowering.problem import Problem
from tests.gpu.test_fused import TOL, _inputs

pytestmark = pytest.mark.gpu

NEG = -jnp.inf


def _through_attention(impl, mod, q, k, v, do, options=None):
    def f(q, k, v):
        o, lse = scoremod.attention(q, k, v, mod, implementation=impl, return_lse=True,
                                    options=options)
        return o, jax.lax.stop_gradient(lse)

    (o, lse), vjp = jax.vjp(f, q, k, v)
    return (o, lse) + tuple(vjp((do, jnp.zeros_like(lse))))


def _ragged_only(mod, q, k, v, do, options):
    """The ragged graphs alone, whatever the run-time check would say."""
    plan = vb.CUDNN_VARLEN.plan(Problem.of(q, k, v), mod, 1 / np.sqrt(q.shape[-1]), options, True)
    assert plan.segments is not None, plan.describe()
    layout = plan.layout(mod.operands)
    ragged = plan.ragged_inputs(layout)
    o, lse = vb._forward(plan, q, k, v, ragged, layout.covered_q)
    return (o, lse) + tuple(vb._backward(plan, q, k, v, o, lse, do, ragged)), layout.ok


def _errors(got, want):
    errs = {}
    for name, a, b in zip(("O", "LSE", "dQ", "dK", "dV"), got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if not np.array_equal(np.isneginf(a), np.isneginf(b)):
            errs[name] = float("inf")  # -inf (fully masked rows) in different places
            continue
        fin = np.isfinite(b)
        if not np.isfinite(a[fin]).all():
            errs[name] = float("nan")
            continue
        errs[name] = float(np.max(np.abs(a[fin] - b[fin]), initial=0) / (np.max(np.abs(b[fin]), initial=0) + 1e-6))
    return errs


RAGGED, REORDERED, DENSE = "ragged", "reordered", "dense"


def check(mod, route, dtype=jnp.bfloat16, b=2, sq=512, skv=None, hq=4, hkv=2, d=64, seed=0,
          options=None):
    """Both ways against the reference. ``route``: what the ids should take: RAGGED
    (increasing runs), REORDERED (runs in another order: the second check) or DENSE."""
    options = options or scoremod.LoweringOptions()
    skv = skv or sq
    mod = scoremod.trace(mod) if not isinstance(mod, scoremod.ScoreMod) else mod
    q, k, v, do = _inputs(b, sq, skv, hq, hkv, d, dtype, seed)
    assert scoremod.which_implementation(q, k, v, mod)[0] == "cudnn-varlen"
    want = jax.jit(lambda *a: _through_attention("xla", mod, *a))(q, k, v, do)
    got = jax.jit(lambda *a: _through_attention("cudnn-varlen", mod, *a, options=options))(q, k, v, do)
    errs = _errors(got, want)
    print(f"attention ({route} route): {errs}")
    bad = {n: e for n, e in errs.items() if not e < TOL[dtype]}
    assert not bad, f"through attention: {bad} (all: {errs})"
    traced = jax.jit(lambda q, k, v, do, ops: _through_attention(
        "cudnn-varlen", scoremod.ScoreMod(mod.expr, ops), q, k, v, do, options=options))(
        q, k, v, do, tuple(mod.operands))
    errs = _errors(traced, want)
    print(f"attention, ids traced (lax.cond): {errs}")
    bad = {n: e for n, e in errs.items() if not e < TOL[dtype]}
    assert not bad, f"through attention with traced ids: {bad} (all: {errs})"
    ragged, ok = jax.jit(lambda *a: _ragged_only(mod, *a, options))(q, k, v, do)
    assert bool(ok) == (route == RAGGED), f"the first run-time check says {bool(ok)} for {route} ids"
    if route != DENSE:
        errs = _errors(ragged, want)
        print(f"ragged route alone: {errs}")
        bad = {n: e for n, e in errs.items() if not e < TOL[dtype]}
        assert not bad, f"ragged route alone: {bad} (all: {errs})"
        keys = [k[0] for k in cudnn_graph.cache_entries()]
        assert "varlen-forward" in keys and "varlen-backward" in keys
    return errs


def docs_ids(b, s, lengths_per_row):
    rows = []
    for lens in lengths_per_row:
        assert sum(lens) == s
        rows.append(np.repeat(np.arange(len(lens)), lens))
    return jnp.asarray(np.stack(rows), jnp.int32)


def random_ids(seed, b, s, max_docs):
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(b):
        n = int(rng.integers(1, max_docs + 1))
        cuts = np.sort(rng.choice(np.arange(1, s), n - 1, replace=False))
        rows.append(np.repeat(np.arange(n) * 2 + 1, np.diff(np.concatenate([[0], cuts, [s]]))))
    return jnp.asarray(np.stack(rows), jnp.int32)


def same_doc(ids, causal):
    if causal:
        return lambda s, b, h, q, k: jnp.where((ids[b, q] == ids[b, k]) & (q >= k), s, NEG)
    return lambda s, b, h, q, k: jnp.where(ids[b, q] == ids[b, k], s, NEG)


DTYPES = [jnp.bfloat16, jnp.float16]
dtype_ids = lambda d: d.__name__  # noqa: E731


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
def test_equal_documents(dtype, causal, d):
    check(same_doc(docs_ids(2, 512, [[128] * 4] * 2), causal), RAGGED, dtype, d=d)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
def test_random_lengths(dtype, causal, seed):
    check(same_doc(random_ids(seed, 3, 640, 6), causal), RAGGED, dtype, b=3, sq=640, seed=seed)


def test_length_one_segments_and_one_longer_than_many_tiles():
    ids = docs_ids(2, 1024, [[1, 1, 1, 900, 1, 120], [1000, 1, 23]])
    check(same_doc(ids, True), RAGGED)
    check(same_doc(ids, False), RAGGED, jnp.float16)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
def test_sliding_window_inside_documents(dtype):
    ids = random_ids(5, 2, 512, 4)
    check(lambda s, b, h, q, k: jnp.where((ids[b, q] == ids[b, k]) & (q >= k) & (q - k < 64), s, NEG),
          RAGGED, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
def test_pad_id_and_key_length_and_a_row_of_padding(dtype):
    ids = np.asarray(docs_ids(3, 384, [[100, 200, 84], [384], [50, 50, 284]]))
    ids = np.where(ids == 2, -1, ids)  # the last document of rows 0 and 2 is padding
    ids[1] = -1  # row 1 is all padding
    ids = jnp.asarray(ids)
    length = jnp.array([250, 384, 70], jnp.int32)
    check(lambda s, b, h, q, k: jnp.where((ids[b, q] == ids[b, k]) & (ids[b, k] != -1) & (k < length[b]),
                                          s, NEG), RAGGED, dtype, b=3, sq=384)
    check(lambda s, b, h, q, k: jnp.where((ids[b, q] == ids[b, k]) & (ids[b, q] != -1) & (q >= k), s, NEG),
          RAGGED, dtype, b=3, sq=384)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_ids)
def test_cross_attention_with_other_lengths(dtype):
    ids_q = docs_ids(2, 384, [[100, 150, 134], [384]])
    ids_kv = np.asarray(docs_ids(2, 256, [[60, 100, 96], [200, 56]]))
    ids_kv = np.where(ids_kv == 1, 2, ids_kv)  # query document 1 has no keys
    ids_kv[:, -20:] = -1  # padding keys
    ids_kv = jnp.asarray(ids_kv)
    check(lambda s, b, h, q, k: jnp.where((ids_q[b, q] == ids_kv[b, k]) & (ids_kv[b, k] != -1), s, NEG),
          RAGGED, dtype, sq=384, skv=256)


@pytest.mark.parametrize("hq,hkv", [(8, 1), (8, 8)])
def test_gqa_and_mha(hq, hkv):
    check(same_doc(random_ids(7, 2, 512, 5), True), RAGGED, hq=hq, hkv=hkv)


def test_ids_that_reappear_take_the_dense_route_and_runs_in_any_order_the_ragged_one():
    reappearing = docs_ids(2, 512, [[128] * 4] * 2)
    reappearing = reappearing.at[1, 400:].set(0)  # document 0 again at the end of row 1
    check(same_doc(reappearing, True), DENSE)
    decreasing = 10 - docs_ids(2, 512, [[200, 312]] * 2)
    check(same_doc(decreasing, False), REORDERED, jnp.float16)
    padding_first = docs_ids(2, 512, [[100, 412], [300, 212]]) + 1
    padding_first = padding_first.at[:, 480:].set(0)  # a tail of 0s, not declared a pad id
    check(same_doc(padding_first, True), REORDERED)


def test_cross_attention_ids_not_increasing_take_the_dense_route():
    ids_q = 5 - docs_ids(2, 256, [[100, 156]] * 2)
    ids_kv = 5 - docs_ids(2, 128, [[64, 64]] * 2)
    check(lambda s, b, h, q, k: jnp.where(ids_q[b, q] == ids_kv[b, k], s, NEG), DENSE, sq=256, skv=128)


def test_more_segments_than_the_bound_take_the_dense_route():
    ids = jnp.asarray(np.arange(512)[None].repeat(2, 0) // 32, jnp.int32)  # 16 per row
    check(same_doc(ids, True), DENSE, options=scoremod.LoweringOptions(max_segments=8))
    check(same_doc(ids, True), RAGGED, options=scoremod.LoweringOptions(max_segments=16))


def test_many_slots():
    check(same_doc(random_ids(9, 2, 1024, 40), True), RAGGED,
          options=scoremod.LoweringOptions(max_segments=64), sq=1024)


def test_grad_under_jit_with_ids_as_arguments():
    """The ids are traced arguments: one compiled program serves both routes."""
    q, k, v, do = _inputs(2, 256, 256, 4, 4, 64, jnp.bfloat16)

    @jax.jit
    def loss(q, k, v, ids):
        mod = scoremod.trace(same_doc(ids, True))
        return jnp.sum(scoremod.attention(q, k, v, mod, implementation="cudnn-varlen").astype(jnp.float32) ** 2)

    for ids in (docs_ids(2, 256, [[64] * 4] * 2), 3 - docs_ids(2, 256, [[64] * 4] * 2)):
        got = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, ids)
        want = jax.jit(jax.grad(lambda q, k, v: jnp.sum(scoremod.attention(  # one compile
            q, k, v, same_doc(ids, True), implementation="xla").astype(jnp.float32) ** 2),
            argnums=(0, 1, 2)))(q, k, v)
        for name, a, b in zip(("dQ", "dK", "dV"), got, want):
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            err = np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-6)
            print(name, err)
            assert err < 3e-2, (name, err)
