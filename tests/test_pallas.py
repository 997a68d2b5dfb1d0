"""The Pallas backend on the CPU, in Pallas's interpret mode, against the reference path.

Forward (O, LSE) and backward (dQ, dK, dV, the LSE's gradient, and the
gradients of captured arrays) for masks, modifiers, gathers and learned
parameters, with grouped-query heads, Sq != Skv and lengths that are not
whole tiles, on the dense block map and on one that skips every masked tile.
Small tiles (16 and 32) so that each call has several blocks of each kind.
The Triton lowering itself is checked too (every op of the table lowers to
Triton IR, no GPU needed); tests/gpu/test_pallas_gpu.py runs the kernels.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from scoremod.dsl import ir, ops
from scoremod.dsl.evaluate import evaluate
from scoremod.dsl.ir import I32
from scoremod.dsl.scoremod import ScoreMod
from scoremod.errors import ScoreModError
from scoremod.lowering import registry
from scoremod.lowering.backend import execute
from scoremod.lowering.pallas import codegen
from scoremod.lowering.pallas.backend import PALLAS
from scoremod.lowering.problem import Problem
from tests import pallas_cases as pc
from tests.pallas_cases import quiet  # noqa: F401 - the autouse fixture

# The Triton engine's kernels (the default engine, "auto", takes Mosaic GPU's on Hopper).
TRITON = scoremod.LoweringOptions(pallas_engine="triton")
SMALL = TRITON.replace(pallas_block_q=32, pallas_block_kv=16,
                       pallas_backward_block_q=16, pallas_backward_block_kv=32)
TOL = 2e-5  # float32 inputs: relative to each result's largest magnitude


def _check(got, want, tol=TOL):
    errs = pc.relative_errors(got, want)
    # An operand's gradient sums every score's share: summed in another order,
    # with cancellation, its float32 rounding is larger than the arrays'.
    bad = {k: e for k, e in errs.items() if not e <= (tol if k[0] != "d" or k in (
        "dQ", "dK", "dV") else max(tol, 1e-3))}
    assert not bad, f"errors {errs}"
    return errs


DENSE_TOO = ("softcap", "relative_bias", "document")  # the dense map (every tile), too


@pytest.mark.parametrize("case,skip", [(c, True) for c in sorted(pc.CASES)]
                         + [(c, False) for c in DENSE_TOO])
def test_matches_reference(case, skip):
    q, k, v, do = pc.inputs()
    got, want = pc.both(case, q, k, v, do, SMALL, skip=skip)
    _check(got, want)
    if case in ("alibi", "relative_bias", "learnable_softcap", "batch_scale"):
        assert got[5][0] is not None and float(jnp.abs(want[5][0]).max()) > 0


@pytest.mark.parametrize("case", sorted(pc.WHEN_FULL))
def test_full_tiles(case):
    """On tiles the map marks full the kernels run the mod without its mask."""
    q, k, v, do = pc.inputs()
    got, want = pc.both(case, q, k, v, do, SMALL, skip=True, full=pc.WHEN_FULL[case])
    _check(got, want)


def test_full_tiles_take_the_full_expression():
    """A wrong expression for full tiles shows in the results: the flag is read."""
    q, k, v, do = pc.inputs()
    got, want = pc.both("causal", q, k, v, do, SMALL, skip=True,
                        full=lambda: ir.var("score") + 1.0)
    errs = pc.relative_errors(got, want)
    assert errs["LSE"] > 1e-3 and errs["dQ"] > 1e-3, errs


def test_skipping_map_skips():
    """The causal map used above leaves tiles out (so the skipping runs differ from dense)."""
    q, k, v, _ = pc.inputs()
    mod, operands = pc.traced("causal", q, k)
    m = pc.mask_block_map(mod, operands, Problem.of(q, k, v), 32, 16)
    assert int(m.q_counts.sum()) < m.q_blocks.size


def test_masked_rows_are_zero():
    q, k, v, do = pc.inputs()
    (o, lse, dq, *_), _ = pc.both("masked_rows", q, k, v, do, SMALL, skip=True)
    assert np.all(np.asarray(o[:, :21]) == 0) and np.all(np.isneginf(np.asarray(lse[:, :, :21])))
    assert np.all(np.asarray(dq[:, :21]) == 0)


def test_tile_list_on_its_own_map():
    """A tile list's ``.any()`` (video sparse attention, -1 for an empty slot) on the
    map the plan computes from the IR: tiles two listed tiles fill together are full
    (the forward's query blocks span two query tiles, the backward's key blocks two
    key tiles), where the kernels drop the mask; the results are the reference's."""
    from scoremod.lowering.block_maps import classify_tiles
    from scoremod.lowering.reference import REFERENCE

    q, k, v, do = pc.inputs(b=2, sq=64, skv=64, hq=2, hkv=2)
    rng = np.random.default_rng(0)
    topk = jnp.asarray(np.where(rng.random((2, 2, 4, 3)) < 0.2, -1,
                                rng.integers(0, 4, (2, 2, 4, 3))), jnp.int32)
    mod = scoremod.trace(lambda s, b, h, qi, ki: jnp.where(
        (topk[b, h, qi // 16] == ki // 16).any(), s, -jnp.inf))
    operands = tuple(mod.operands)
    plan = pc.pallas_plan(mod, q, k, v, SMALL)
    for bq, bk in (plan.forward_blocks, plan.backward_blocks):
        visited, full = classify_tiles(mod.expr, operands, plan.problem, bq, bk)
        assert bool(full.any()) and not bool(visited.all())
    got = pc.run(PALLAS, plan, q, k, v, do, operands)
    want = pc.run(REFERENCE, REFERENCE.plan(plan.problem, mod, plan.scale, SMALL, True),
                  q, k, v, do, operands)
    _check(got, want)


@pytest.mark.parametrize("shape", [dict(sq=48, skv=96, hq=4, hkv=1), dict(sq=96, skv=40, hq=2, hkv=2),
                                   dict(sq=64, skv=64, hq=4, hkv=4, d=128, dv=64)],
                         ids=["mqa-short-q", "long-q", "d128-dv64"])
def test_shapes(shape):
    q, k, v, do = pc.inputs(b=1, **shape)
    got, want = pc.both("alibi", q, k, v, do, SMALL, skip=True)
    _check(got, want)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision(dtype):
    q, k, v, do = pc.inputs(dtype=dtype)
    got, want = pc.both("relative_bias", q, k, v, do, SMALL, skip=True)
    _check(got, want, tol=3e-2)


def test_deterministic():
    """Two runs give the same bits (no atomics: per-program partials summed by XLA)."""
    q, k, v, do = pc.inputs()
    runs = [pc.both("relative_bias", q, k, v, do, SMALL, skip=True)[0] for _ in range(2)]
    for a, b in zip(jax.tree.leaves(runs[0]), jax.tree.leaves(runs[1])):
        assert np.array_equal(np.asarray(a), np.asarray(b), equal_nan=True)


def test_through_attention_jit_grad_remat():
    """implementation="pallas" through scoremod.attention: jit, grad (operands
    included, no fallback warning), return_lse, jax.checkpoint, jax.vmap."""
    q, k, v, do = pc.inputs(b=1, sq=40, skv=48, hq=2, hkv=1)
    slopes = jnp.asarray([0.5, 0.25], jnp.float32)

    def loss(impl, q, k, v, slopes):
        mod = lambda s, b, h, qi, ki: jnp.where(qi >= ki, s + slopes[h] * (ki - qi), -jnp.inf)
        o, lse = scoremod.attention(q, k, v, mod, implementation=impl, return_lse=True,
                                    options=SMALL)
        return jnp.sum(o * do) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    want = jax.jit(jax.grad(lambda *a: loss("xla", *a), argnums=(0, 1, 2, 3)))(q, k, v, slopes)
    f = jax.jit(jax.grad(jax.checkpoint(lambda *a: loss("pallas", *a)), argnums=(0, 1, 2, 3)))
    got = f(q, k, v, slopes)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
    # vmap over a leading axis (Pallas batches its calls).
    qs, ks, vs = (jnp.stack([x, 2 * x]) for x in (q, k, v))
    mod = lambda s, b, h, qi, ki: jnp.where(qi >= ki, s, -jnp.inf)
    f = lambda impl: jax.jit(jax.vmap(lambda q, k, v: scoremod.attention(
        q, k, v, mod, implementation=impl, options=SMALL)))(qs, ks, vs)
    np.testing.assert_allclose(np.asarray(f("pallas")), np.asarray(f("xla")), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("tiles", ["dense", "analysed"])
def test_masked_keys_never_contribute(bad, tiles):
    """The masked-key rule (lowering/nonfinite.py; LoweringOptions.check_values)
    on the Pallas kernels: a non-finite V at a causally masked key leaves the rows before it finite
    and makes the rows after it NaN; O, LSE and the gradients equal the
    reference path's (NaN where it is NaN), on the dense map (the kernel
    multiplies the masked part of a tile by V) and on the IR's own map."""
    from scoremod.lowering.pallas.backend import dense_map
    from scoremod.lowering.reference import REFERENCE

    q, k, v, do = pc.inputs(b=1, sq=64, skv=64, hq=2, hkv=1)
    v = v.at[0, 40].set(bad)
    mod, operands = pc.traced("causal", q, k)

    def plan(options):
        p = pc.pallas_plan(mod, q, k, v, options)
        return dataclasses.replace(p, block_map=dense_map) if tiles == "dense" else p

    checked = dataclasses.replace(SMALL, check_values=True)
    got = pc.run(PALLAS, plan(checked), q, k, v, do, operands, options=checked)
    want = pc.run(REFERENCE, REFERENCE.plan(Problem.of(q, k, v), mod, plan(SMALL).scale, SMALL,
                                            True), q, k, v, do, operands)
    o = np.asarray(got[0])
    assert np.isfinite(o[0, :40]).all() and np.isnan(o[0, 40:]).all()
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        np.testing.assert_allclose(np.nan_to_num(g), np.nan_to_num(w), rtol=1e-4, atol=1e-4)
    if tiles == "dense":
        # Without the rule (check_values=False) the masked part of the tile
        # holding key 40 multiplies the non-finite value: NaN rows before it.
        unchecked = dataclasses.replace(SMALL, check_values=False)
        o = pc.run(PALLAS, plan(unchecked), q, k, v, do, operands, options=unchecked)[0]
        assert np.isnan(np.asarray(o)[0, :40]).any()


def test_tried_after_cudnn_and_before_the_reference_path():
    names = [b.name for b in registry.backends()]
    assert names.index("cudnn") < names.index("pallas") < names.index("xla")
    # Automatically only on a GPU, and not for float32 inputs.
    why = PALLAS.why_not(_problem(dtype="bfloat16"), None, automatic=True)
    assert why is not None and "interpret mode" in why  # this machine has no GPU
    assert PALLAS.why_not(_problem(dtype="bfloat16"), None, automatic=False) is None
    assert "float32" in PALLAS.why_not(_problem(dtype="float32"), None, automatic=True)


def _problem(d=64, dv=64, dtype="float32"):
    return Problem(b=1, sq=64, skv=64, hq=2, hkv=1, d=d, dv=dv, dtype=dtype)


def test_refusals():
    erf = scoremod.trace(lambda s, b, h, q, k: s + jax.scipy.special.erf(s))
    why = PALLAS.why_not(_problem(), erf, automatic=False)
    assert "`erf`" in why and "Triton" in why and "test_pallas.py" in why  # the user's line
    assert "head dims" in PALLAS.why_not(_problem(d=96, dv=96), None, automatic=False)
    assert "float16" in PALLAS.why_not(_problem(dtype="int8"), None, automatic=False)
    q = jnp.ones((1, 64, 2, 96), jnp.float32)
    with pytest.raises(ScoreModError, match="head dims"):
        scoremod.attention(q, q, q, implementation="pallas")


def test_bool_flags_read_along_one_tile_axis_are_refused():
    """The H200 gave wrong gradients for `g[q_idx]`, `g[kv_idx]` of a bool array
    (codegen.ONE_AXIS_BOOL_READ): refused, naming the read and the user's line;
    bool arrays read along both axes and int arrays along one are not."""
    flags = jnp.arange(64) % 7 == 0
    ids = jnp.arange(64, dtype=jnp.int32) // 16
    tile_map = jnp.eye(4, dtype=bool)
    refused = {
        "at q": lambda s, b, h, q, k: jnp.where(flags[q] | (q >= k), s, -jnp.inf),
        "at kv": lambda s, b, h, q, k: jnp.where(flags[k], s, -jnp.inf),
        "at kv, shifted": lambda s, b, h, q, k: s + jnp.where(flags[k // 2 + 3], 1.0, 0.0)}
    taken = {
        "bool tile map": lambda s, b, h, q, k: jnp.where(tile_map[q // 16, k // 16], s, -jnp.inf),
        "int ids at q": lambda s, b, h, q, k: jnp.where(ids[q] == ids[k], s, -jnp.inf),
        "bool per head": lambda s, b, h, q, k: jnp.where(flags[h], s, -jnp.inf)}
    for name, fn in refused.items():
        why = PALLAS.why_not(_problem(), scoremod.trace(fn), automatic=False)
        assert why and codegen.ONE_AXIS_BOOL_READ in why and "`load`" in why, name
        assert "test_pallas.py" in why, name  # the user's line
    for name, fn in taken.items():
        assert PALLAS.why_not(_problem(), scoremod.trace(fn), automatic=False) is None, name
    q = jnp.ones((1, 64, 2, 64), jnp.float32)
    with pytest.raises(ScoreModError, match="read along one tile axis"):
        scoremod.attention(q, q, q, refused["at q"], implementation="pallas")


def test_jvp_refused_clearly():
    q, k, v, _ = pc.inputs(b=1, sq=32, skv=32, hq=2, hkv=1)
    f = lambda q: scoremod.attention(q, k, v, implementation="pallas", options=SMALL)
    with pytest.raises(ScoreModError, match="forward-mode"):
        jax.jvp(f, (q,), (q,))


def test_bucketed_relative_table_learns():
    """T5's bucketed table, `table[bucket[kv - q + n - 1], h]` with int buckets: its
    gradient from the kernels (17 entries, 12 of them read here) matches the reference's."""
    n, hq = 96, 2
    q, k, v, _ = pc.inputs(b=1, sq=n, skv=n, hq=hq, hkv=hq, dtype=jnp.float32)
    buckets = jnp.asarray(np.clip(np.arange(-n + 1, n) // 16, -8, 8) + 8, jnp.int32)
    table = jax.random.normal(jax.random.PRNGKey(3), (17, hq), jnp.float32)

    def loss(t, impl):
        mod = lambda s, b, h, qi, ki: s + t[buckets[ki - qi + n - 1], h]
        return jnp.sum(scoremod.attention(q, k, v, mod, implementation=impl,
                                          options=SMALL if impl == "pallas" else None) ** 2)
    got, want = jax.grad(loss)(table, "pallas"), jax.grad(loss)(table, "xla")
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(jnp.abs(want).max()))
    used = np.unique(np.asarray(buckets))  # 2..13 at this length: the rest get no gradient
    assert float(jnp.abs(want[used]).min()) > 0 and len(used) == 12


def test_relative_table_too_long_to_learn_says_so():
    """A relative table read at q_idx - kv_idx for seq over 32768 (a row over 65536
    entries) is refused when learned, by name, with the seq it would take; traced
    only (no kernel runs)."""
    s = 32769
    q = jax.ShapeDtypeStruct((1, s, 1, 64), jnp.bfloat16)
    table = jnp.zeros((1, 2 * s - 1), jnp.float32)
    loss = lambda q, table: scoremod.attention(
        q, q, q, lambda sc, b, h, qi, ki: sc + table[h, qi - ki + s - 1],
        implementation="pallas").astype(jnp.float32).sum()
    with pytest.raises(ScoreModError, match="up to seq 32768") as refused:
        jax.jit(jax.grad(loss, argnums=1)).trace(q, table)
    message = str(refused.value)
    assert "[1, 65537] read in `c0[0, " in message and "test_pallas.py:" in message, message


def test_large_operand_gradient_refused():
    q, k, v, _ = pc.inputs(b=1, sq=32, skv=32, hq=2, hkv=1)
    bias = jnp.zeros((300, 300), jnp.float32)
    loss = lambda bias: scoremod.attention(
        q, k, v, lambda s, b, h, qi, ki: s + bias[qi, ki], implementation="pallas",
        options=SMALL).sum()
    with pytest.raises(ScoreModError, match="at most 65536 elements") as refused:
        jax.grad(loss)(bias)
    # It names the read and the user's line, and says what runs the call.
    message = str(refused.value)
    assert "[300, 300] read in `c0[q_idx, kv_idx]` at " in message, message
    assert "test_pallas.py:" in message and "share has 90000" in message, message
    assert "stop_gradient" in message and "implementation=\"xla\"" in message, message
    # Without its gradient the same mod runs.
    assert np.isfinite(np.asarray(jax.jit(jax.grad(lambda q: scoremod.attention(
        q, k, v, lambda s, b, h, qi, ki: s + bias[qi, ki], implementation="pallas",
        options=SMALL).sum()))(q))).all()


# --------------------------------------------------------------------------- #
# every op of the table: numbers in interpret mode, and the Triton lowering


def _examples(name, positive=False):
    """Mods that use op ``name`` on floats and on ints (as its signature allows);
    ``positive``: float arguments in [0.5, 2] (inside every op's domain) and
    integer results taken modulo 251 before they join the score: a logical
    right shift of a negative index is near 2**30, and a float32 kernel's
    softmax of scores that large is off by their rounding (exp2(s * log2 e)),
    in any kernel, which is not what these mods test."""
    op = ops.OPS[name]
    s, qi, ki = ir.var("score"), ir.var("q_idx"), ir.var("kv_idx")
    f, g = s / 7.0 + 0.5, s / 5.0 - 0.25
    if positive:
        f = ops.apply("sigmoid", s) + 0.5
        g = f * f + 0.25
    i1, i2 = qi - ki + 3, ops.apply("mod", ki, ir.const(5, I32)) + 1
    as_f = lambda x: ops.apply("f32", x)  # noqa: E731
    if positive:
        as_f = lambda x: ops.apply(  # noqa: E731
            "f32", ops.apply("mod", x, ir.const(251, I32)) if x.dtype == I32 else x)
    sel = lambda c: ops.apply("where", c, s, -s)  # noqa: E731
    attr = dict(attr=3) if name == "integer_pow" else {}
    out = {
        "float": lambda: [ops.apply(name, f)],
        "float2": lambda: [ops.apply(name, f, g)],
        "num": lambda: [ops.apply(name, f, **attr), as_f(ops.apply(name, i1, **attr))],
        "num2": lambda: [ops.apply(name, f, g), as_f(ops.apply(name, i1, i2))],
        "int": lambda: [as_f(ops.apply(name, i1))],
        "int2": lambda: [as_f(ops.apply(name, i1, i2))],
        "cmp": lambda: [sel(ops.apply(name, f, g)), sel(ops.apply(name, i1, i2))],
        "logic": lambda: [sel(ops.apply(name, *[ops.apply("lt", f, g),
                                                 ops.apply("gt", i1, i2)][:op.arity]))],
        "where": lambda: [ops.apply(name, ops.apply("lt", f, g), f, g)],
    }.get(op.sig)
    if op.sig.startswith("cast:") and op.arity:
        out = lambda: [as_f(ops.apply(name, f)), as_f(ops.apply(name, i1))]  # noqa: E731
    if name == "with_grad":  # softplus: a custom_jvp function
        return [scoremod.trace(lambda s, b, h, q, k: jax.nn.softplus(s)).expr]
    return [e + s for e in out()] if out else []


TABLE_OPS = [n for n in ops.OPS if _examples(n)]
LOWERABLE = [name for name in TABLE_OPS if name not in codegen.NOT_LOWERABLE]
# Ops in groups, one mod each (tests/gpu/test_pallas_gpu.py compiles each
# group: one mod of every op took Triton past the per-test limit).
OP_GROUPS = [LOWERABLE[i:i + 8] for i in range(0, len(LOWERABLE), 8)]


def summed(examples):
    """One mod: the score plus 0.05 of each example's difference from it."""
    expr = ir.var("score")
    for e in examples:
        expr = expr + 0.05 * (e - ir.var("score"))
    return expr


def test_every_op_has_an_example():
    assert set(ops.OPS) - set(TABLE_OPS) <= {ir.LOAD, ops.TANGENT}  # load: the cases above


@pytest.mark.parametrize("name", TABLE_OPS)
def test_op_table_on_tiles(name):
    """Each op evaluated on a tile as the kernels do (iotas for the indices, the
    symbolic derivative for the backward) matches the reference evaluator and
    JAX's own derivative of it. The kernels are the same for every op, so this
    and the Triton lowering test below cover the table without a kernel run per op."""
    rng = np.random.default_rng(0)
    s = jnp.asarray(rng.normal(size=(8, 16)) * 3, jnp.float32)
    dp = jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)
    index = {"b": jnp.int32(1), "h": jnp.int32(0),
             "q_idx": 5 + jax.lax.broadcasted_iota(jnp.int32, (8, 1), 0),
             "kv_idx": 3 + jax.lax.broadcasted_iota(jnp.int32, (1, 16), 1)}
    for expr in _examples(name):
        d = codegen.derivatives(expr)
        value, grad = codegen.evaluate_tile([expr, d.score], dict(index, score=s, dP=dp), {})
        want, vjp = jax.vjp(lambda s: jnp.broadcast_to(
            evaluate(expr, dict(index, score=s), {}), s.shape), s)
        np.testing.assert_allclose(np.broadcast_to(value, s.shape), want, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(np.broadcast_to(grad, s.shape), vjp(dp)[0], rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("names", OP_GROUPS, ids=lambda names: f"{names[0]}..{names[-1]}")
def test_op_groups_through_the_kernels(names):
    """The groups the GPU test compiles, run by the kernels in interpret mode:
    each op's values through the kernels' own arithmetic (the score in log2
    units, the backward's recomputed probabilities), forward and backward."""
    q, k, v, do = pc.inputs(b=1, sq=64, skv=48, hq=2, hkv=1, d=16)
    mod = ScoreMod(summed(e for name in names for e in _examples(name, positive=True)))
    got = pc.run(PALLAS, pc.pallas_plan(mod, q, k, v, SMALL), q, k, v, do, ())
    want = registry.REFERENCE.plan(Problem.of(q, k, v), mod, 0.25, SMALL, True)
    _check(got, pc.run(registry.REFERENCE, want, q, k, v, do, ()), tol=1e-4)


def _morton_natten(sq):
    """The catalogue's Morton-order NATTEN (bit operations decode the pixels)."""
    from tests.catalogue.mods import CATALOGUE, Shape

    entry = CATALOGUE["morton_natten"]
    env = entry.env(Shape(1, 1, sq, sq))
    return scoremod.trace(entry.build(env)), entry, env


def test_bit_operations_through_the_kernels():
    """A mask decoded with bit operations (the catalogue's Morton-order NATTEN, 16 x
    16 pixels) and a bias shifted by amounts outside [0, 31] (XLA's 0, or the
    sign for >>), run by the kernels in interpret mode on the plan's own block
    map, forward and backward, equal the reference path; that map visits
    exactly the tiles that hold a live score."""
    q, k, v, do = pc.inputs(b=1, sq=256, skv=256, hq=2, hkv=1, d=16)
    morton, entry, env = _morton_natten(256)
    shifted = scoremod.trace(lambda s, b, h, qi, ki: s + 0.1 * (
        (((qi * 7919 - 5000) >> (ki % 40 - 4)) & 15)
        + (((qi + 1) << (ki % 40 - 4)) & 15)
        + (jax.lax.shift_right_logical(qi - 100, ki % 40 - 4) & 15)).astype(jnp.float32))
    problem = Problem.of(q, k, v)
    for mod in (morton, shifted):
        plan = pc.pallas_plan(mod, q, k, v, SMALL)
        got = pc.run(PALLAS, plan, q, k, v, do, ())
        ref = registry.REFERENCE.plan(problem, mod, plan.scale, SMALL, True)
        _check(got, pc.run(registry.REFERENCE, ref, q, k, v, do, ()))
    grid = type("Grid", (), dict(b=0, h=0, q=np.arange(256)[:, None], k=np.arange(256)[None]))
    live = np.isfinite(entry.reference(np.zeros((1, 1, 256, 256)), grid, env))[0, 0]
    plan = pc.pallas_plan(morton, q, k, v, SMALL)
    for bq, bk in (plan.forward_blocks, plan.backward_blocks):
        bmap = plan.block_map(problem, bq, bk, {})
        tiles = live.reshape(256 // bq, bq, 256 // bk, bk).any(axis=(1, 3))
        assert np.asarray(bmap.q_counts)[0, 0].tolist() == tiles.sum(1).tolist()
        assert 0 < tiles.mean() < 0.5


def test_shifts_on_tiles_take_no_amount_outside_0_to_31(monkeypatch):
    """Shifts on a tile, by constants and by values in and outside [0, 31], give
    XLA's values (the reference evaluator's), on both engines' rules, and never
    hand the shift an amount outside [0, 31]: both engines lower lax's shifts
    to MLIR's shli / shrsi / shrui, where such an amount is poison."""
    from scoremod.lowering.pallas import mosaic

    index = {"b": jnp.int32(0), "h": jnp.int32(0),
             "q_idx": 5 + jax.lax.broadcasted_iota(jnp.int32, (8, 1), 0),
             "kv_idx": 3 + jax.lax.broadcasted_iota(jnp.int32, (1, 16), 1)}
    qi, ki = ir.var("q_idx"), ir.var("kv_idx")
    x = qi * 100003 - 700000  # both signs
    exprs = [ops.apply(name, x, n)
             for name in ("left_shift", "right_shift", "shift_right_logical")
             for n in (ki * 3 - 20, ir.const(3, I32), ir.const(40, I32), ir.const(-1, I32))]
    wants = [np.broadcast_to(evaluate(e, index, {}), (8, 16)) for e in exprs]
    shifted = []
    for prim in (jax.lax.shift_left_p, jax.lax.shift_right_arithmetic_p,
                 jax.lax.shift_right_logical_p):
        def checked(x, n, _impl=prim.impl, _name=prim.name):  # run eagerly: values
            shifted.append(_name)
            amounts = np.asarray(n)
            assert ((amounts >= 0) & (amounts <= 31)).all(), (_name, amounts)
            return _impl(x, n)
        monkeypatch.setattr(prim, "impl", checked)
    for expr, want in zip(exprs, wants):
        for rules in (None, mosaic.TILE_RULES):
            (got,) = codegen.evaluate_tile([expr], index, {}, rules=rules)
            np.testing.assert_array_equal(np.broadcast_to(got, (8, 16)), want)
    assert len(shifted) == 2 * len(exprs)  # the check saw each tile's shift


def triton_gpu_info():
    """The module whose get_gpu_info tells Triton's lowering the compute capability
    (jax 0.12.1 moved it from pallas.triton to jax._src); a skip where neither has it."""
    import importlib

    for name in ("jax._src.gpu_info", "jax._src.pallas.triton.gpu_info"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "get_gpu_info"):
            return module
    pytest.skip("this jax's Triton lowering does not take the GPU's version from gpu_info")


@pytest.fixture
def fake_hopper(monkeypatch):
    """Lower Pallas calls for CUDA on this machine: Triton's lowering asks only the compute capability."""
    from types import SimpleNamespace

    monkeypatch.setattr(triton_gpu_info(), "get_gpu_info", lambda *a, **k: SimpleNamespace(
        compute_capability=90))
    try:  # plain attention: what every test below lowers at the least
        _lower_for_cuda(None, jnp.zeros((1, 64, 1, 64), jnp.bfloat16))
    except Exception as e:  # noqa: BLE001 - a jax that cannot lower for CUDA here
        pytest.skip(f"this jax cannot lower Pallas calls to Triton without a GPU: {e}")


def _lower_for_cuda(mod, q, operands=(), full_expr=None):
    from jax import export

    plan = dataclasses.replace(pc.pallas_plan(mod, q, q, q, TRITON,
                                              full_expr=full_expr), interpret=False)

    def grads(q, k, v, ops):  # every gradient the backward computes, operands' too
        learn = [i for i, x in enumerate(ops) if jnp.issubdtype(x.dtype, jnp.floating)]

        def loss(q, k, v, floats):
            merged = list(ops)
            for i, x in zip(learn, floats):
                merged[i] = x
            return execute(pc.call(PALLAS, plan, q, k, v, TRITON), q, k, v,
                           tuple(merged))[0].astype(jnp.float32).sum()

        return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, tuple(ops[i] for i in learn))

    shapes = jax.ShapeDtypeStruct(q.shape, q.dtype)
    ops_ = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in operands)
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    return export.export(jax.jit(grads), platforms=["cuda"], disabled_checks=checks)(
        shapes, shapes, shapes, ops_)


@pytest.mark.parametrize("name", TABLE_OPS)
def test_op_table_lowers_to_triton(name, fake_hopper):
    """Every op lowers through Pallas's Triton lowering (forward and backward
    kernels), except those the backend refuses, which fail there."""
    q = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
    for expr in _examples(name):
        if name in codegen.NOT_LOWERABLE:
            with pytest.raises(NotImplementedError):
                _lower_for_cuda(ScoreMod(expr), q)
        else:
            _lower_for_cuda(ScoreMod(expr), q)


@pytest.mark.parametrize("case", ["relative_bias", "document", "learnable_softcap"])
def test_cases_lower_to_triton(case, fake_hopper):
    """Gathers from tables, int arrays, scalars and their gradients, and the
    full-tile branch, lower to Triton."""
    q = jnp.zeros((2, 128, 4, 64), jnp.bfloat16)
    mod, operands = pc.traced(case, q, q)
    _lower_for_cuda(mod, q, operands)
    if case == "document":
        _lower_for_cuda(mod, q, operands, full_expr=ir.var("score"))


def test_backward_protocol():
    """Backend.backward (dQ, dK, dV from O, LSE and dO; no operand asked for)
    is what JAX's gradient of the call runs (the pipeline transposes it into
    the backend's backward), and it agrees with the reference's."""
    q, k, v, do = pc.inputs(b=1, sq=40, skv=48, hq=2, hkv=1)
    mod, _ = pc.traced("softcap_causal", q, k)
    plan = pc.pallas_plan(mod, q, k, v, SMALL)
    call = pc.call(PALLAS, plan, q, k, v, SMALL)
    o, lse = PALLAS.forward(plan, q, k, v, ())
    got = jax.jit(lambda *a: PALLAS.backward(plan, *a, ()))(q, k, v, o, lse, do)
    assert got[3] == {}
    _, vjp = jax.vjp(lambda q, k, v: execute(call, q, k, v, ())[0], q, k, v)
    for a, b in zip(got[:3], vjp(do)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_vmap_lowers_to_triton(fake_hopper):
    """Under jax.vmap the forward folds the mapped axis into the batch (a call
    planned again); the backward that learns the slopes is batched by Pallas,
    which adds a grid axis to the kernels' three (block, batch, head): the
    Triton lowering folds it into Triton's three launch axes."""
    from jax import export

    q = jnp.zeros((2, 1, 128, 2, 64), jnp.bfloat16)
    mod, operands = pc.traced("alibi", q[0], q[0])
    plan = dataclasses.replace(pc.pallas_plan(mod, q[0], q[0], q[0], TRITON),
                               interpret=False)

    call = pc.call(PALLAS, plan, q[0], q[0], q[0], TRITON)

    def grads(q, k, v, slopes):
        loss = lambda *a: execute(call, *a[:3], (a[3],))[0].astype(jnp.float32).sum()  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, slopes)

    shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    slopes = jax.ShapeDtypeStruct((2,) + operands[0].shape, operands[0].dtype)
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    export.export(jax.jit(jax.vmap(grads)), platforms=["cuda"], disabled_checks=checks)(
        shape, shape, shape, slopes)
