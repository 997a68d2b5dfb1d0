"""The catalogue on a CPU: every port against its NumPy reference, and its plan.

Values: ``scoremod.attention(..., implementation="xla")`` (float32) equals a
float64 NumPy attention over the reference's modified scores. Gradients (the
entries marked ``grad``, all of them a bias or a mask): jax.grad of the port
equals jax.grad of plain attention plus the reference's bias. Plans: each
entry's verdict for the fused path at its GPU shape (``verdict.py``).
Entries that need an op the table lacks are strict xfails.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from tests.catalogue import docs
from tests.catalogue.mods import CATALOGUE
from tests.catalogue.verdict import plan_of, verdict
from tests.test_graph_emission import recorder  # noqa: F401  (the fixture)

HEAD_DIM = 32

# Entries whose mask lets every query see every key at the CPU shape, as the
# mod means (a ring shard's keys all precede its queries): no change to plain
# attention is expected of them.
ALL_VISIBLE = {"ring_shard_remote"}


def _params(names):
    return [pytest.param(n, marks=pytest.mark.xfail(
        strict=True, reason=f"needs {CATALOGUE[n].needs}: issue 20's ops"))
            if CATALOGUE[n].needs else n for n in names]


def _inputs(shape, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(0, 1, (shape.b, shape.sq, shape.h, HEAD_DIM)).astype(np.float32)
    k = rng.normal(0, 1, (shape.b, shape.skv, shape.h, HEAD_DIM)).astype(np.float32)
    v = rng.normal(0, 1, (shape.b, shape.skv, shape.h, HEAD_DIM)).astype(np.float32)
    return q, k, v


def numpy_attention(q, k, v, modify):
    """float64 softmax attention over ``modify(scores)``; a row that sees no key is 0."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    s = modify(s)
    top = s.max(-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(top), top, 0.0))
    total = p.sum(-1, keepdims=True)
    p = np.where(total > 0, p / np.where(total > 0, total, 1.0), 0.0)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.mark.parametrize("name", _params(sorted(CATALOGUE)))
def test_port_matches_the_numpy_reference(name):
    entry = CATALOGUE[name]
    env = entry.env(entry.cpu)
    q, k, v = _inputs(entry.cpu)
    got = scoremod.attention(q, k, v, entry.build(env), implementation="xla")
    want = numpy_attention(q, k, v, lambda s: entry.modified_scores(s, env))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=2e-5)
    plain = numpy_attention(q, k, v, lambda s: s)
    assert np.allclose(want, plain) == (name in ALL_VISIBLE), "the mod changes nothing here"


@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_port_run_by_jax_alone_matches_the_reference(name):
    """The port as plain JAX, mapped over every score position with jax.vmap
    (no scoremod), equals the reference: the ports of mods whose ops scoremod
    does not have yet are checked too."""
    entry = CATALOGUE[name]
    shape = entry.cpu
    env = entry.env(shape)
    s = np.random.default_rng(3).normal(0, 2, (shape.b, shape.h, shape.sq, shape.skv))
    grids = np.meshgrid(*(np.arange(n, dtype=np.int32) for n in s.shape), indexing="ij")
    flat = [jnp.asarray(x.ravel()) for x in (s.astype(np.float32), *grids)]
    got = np.asarray(jax.jit(jax.vmap(entry.build(env)))(*flat)).reshape(s.shape)
    want = entry.modified_scores(s.astype(np.float32).astype(np.float64), env)
    assert np.array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=2e-5, atol=2e-5)


def _bias(entry, env, shape):
    """The reference's additive bias (-inf where masked); checks the mod is one."""
    zero = np.zeros((shape.b, shape.h, shape.sq, shape.skv))
    bias = entry.modified_scores(zero, env)
    s = np.random.default_rng(1).normal(0, 1, zero.shape)
    np.testing.assert_allclose(entry.modified_scores(s, env), s + bias, rtol=1e-12, atol=1e-12)
    return bias


def _plain_plus(bias):
    def attend(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1]) + bias
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)
    return attend


@pytest.mark.parametrize("name", _params(sorted(n for n, e in CATALOGUE.items() if e.grad)))
def test_gradients_match_plain_attention_plus_the_reference_bias(name):
    entry = CATALOGUE[name]
    env = entry.env(entry.cpu)
    q, k, v = _inputs(entry.cpu)
    do = np.random.default_rng(2).normal(0, 1, q.shape).astype(np.float32)
    mod = entry.build(env)
    port = lambda q, k, v: scoremod.attention(q, k, v, mod, implementation="xla")  # noqa: E731
    reference = _plain_plus(jnp.asarray(_bias(entry, env, entry.cpu), jnp.float32))
    loss = lambda f: lambda *a: jnp.sum(f(*a) * do)  # noqa: E731
    got = jax.grad(loss(port), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
    for g, w, what in zip(got, want, ("dQ", "dK", "dV")):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=2e-5, err_msg=what)


def test_gradient_reaches_a_captured_table():
    """Graphormer's learned table: the reference path's gradient with respect to
    the captured array equals the one of plain attention plus the gathered bias."""
    entry = CATALOGUE["graphormer_spatial"]
    env = entry.env(entry.cpu)
    q, k, v = _inputs(entry.cpu)
    dist = jnp.asarray(env["dist"])

    def port(table):
        mod = lambda s, b, h, qi, ki: s + table[h, dist[b, qi, ki]]  # noqa: E731
        return jnp.sum(scoremod.attention(q, k, v, mod, implementation="xla") ** 2)

    def reference(table):
        bias = table[:, env["dist"]].transpose(1, 0, 2, 3)  # [B, H, S, S] by NumPy indexing
        return jnp.sum(_plain_plus(bias)(q, k, v) ** 2)

    table = jnp.asarray(env["table"])
    got, want = jax.grad(port)(table), jax.grad(reference)(table)
    assert float(jnp.max(jnp.abs(want))) > 0
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", _params(sorted(CATALOGUE)))
def test_fused_plan_has_the_expected_verdict(name):
    entry = CATALOGUE[name]
    mod = scoremod.trace(entry.build(entry.env(entry.gpu)))
    assert verdict(mod, entry.gpu) == entry.verdict


def test_catalogue_covers_attention_gym():
    """Every mask and mod family of attention-gym named in the catalogue's brief."""
    families = {e.family for e in CATALOGUE.values()}
    assert families == {"causal and windows", "documents and packing", "images and video",
                        "cross-attention and trees", "score mods"}
    assert len(CATALOGUE) >= 40
    origins = " ".join(e.origin for e in CATALOGUE.values())
    for source in ("causal", "sliding_window", "dilated_sliding_window", "global_sliding_window",
                   "prefix_lm", "document_mask", "shared_prefix", "block_diffusion", "batchify",
                   "natten", "sta", "svg", "vsa", "flamingo", "jetspec", "paged_attention",
                   "ring_attention", "softcapping", "alibi", "sandwich", "graphormer",
                   "latent_attention", "activation"):
        assert source in origins, source


def test_docs_catalogue_is_up_to_date():
    assert docs.CATALOGUE_MD.exists(), "docs/catalogue.md is missing; run python -m tests.catalogue.docs"
    assert docs.CATALOGUE_MD.read_text() == docs.catalogue_markdown(), (
        "docs/catalogue.md is stale; regenerate it with python -m tests.catalogue.docs")


@pytest.mark.parametrize("name", _params(sorted(CATALOGUE)))
def test_fused_plan_builds_its_graphs(name, recorder):
    """Every part of the plan builds its forward and backward cuDNN graphs
    (against test_graph_emission's recording stand-in for the frontend), with
    one input tensor per planned load."""
    from scoremod.lowering.cudnn import graph as cg

    entry = CATALOGUE[name]
    plan = plan_of(scoremod.trace(entry.build(entry.env(entry.gpu))), entry.gpu)
    for part in plan.parts:
        if part.fwd is None:  # plain attention, maybe under a native mask: no score_mod graph
            assert part.band is not None or part.mod is None
            continue
        recorder.calls.clear()
        built = cg.build_forward(part.fwd, part.fwd_spec, part.fwd_consts,
                                 [l.node for l in part.fwd_loads], part.describe)
        assert [n for n, _ in recorder.calls].count("sdpa") == 1
        assert len(built.in_uids) == 3 + len(part.fwd_loads)
        recorder.calls.clear()
        built = cg.build_backward(part.fwd, part.bwd, part.spec, part.consts,
                                  [l.node for l in part.loads], part.describe)
        assert [n for n, _ in recorder.calls].count("sdpa_backward") == 1
        assert built.in_uids[len(built.in_uids) - len(part.loads):] == tuple(
            l.spec.uid for l in part.loads)
