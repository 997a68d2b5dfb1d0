"""The Pallas backend on a GPU (Pallas's Triton lowering) against the reference path.

The CPU tests (tests/test_pallas.py) run the same kernels in interpret mode;
these compile them with Triton: every case of tests/pallas_cases.py (masks,
modifiers, gathers from tables, learned arrays and scalars, fully masked
rows) forward and backward, on the map that skips masked tiles and on the
dense one, in bfloat16 and float16, head dims 64 and 128, grouped-query heads,
Sq != Skv and lengths that are not whole tiles; then every op of the table.
Errors are relative to each result's largest magnitude (printed with -s).
"""


import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from scoremod.dsl.scoremod import ScoreMod
from scoremod.lowering.pallas import codegen, mosaic
from scoremod.lowering.pallas.backend import PALLAS
from scoremod.lowering.problem import Problem
from scoremod.lowering.reference import REFERENCE
from tests import pallas_cases as pc
from tests.pallas_cases import quiet  # noqa: F401 - the autouse fixture
from tests.test_pallas import OP_GROUPS, TABLE_OPS, _examples, summed

pytestmark = pytest.mark.gpu

TOL = {jnp.bfloat16: 3e-2, jnp.float16: 1e-2, jnp.float32: 1e-3}
OPERAND_TOL = 5e-2  # an operand's gradient sums every score's share, with cancellation
# The Triton engine by name (the default, "auto", takes the Mosaic one on Hopper):
# 128x64 forward, 64x64 backward tiles.
OPTIONS = scoremod.LoweringOptions(pallas_engine="triton")


def _check(got, want, dtype):
    errs = pc.relative_errors(got, want)
    print(errs)
    bad = {k: e for k, e in errs.items()
           if not e <= (OPERAND_TOL if k.startswith("d_operand") else TOL[dtype])}
    assert not bad, f"errors {errs}"


def test_plan_is_compiled():
    """On a GPU the kernels compile with Triton, not interpret mode."""
    q = jnp.zeros((1, 64, 1, 64), jnp.bfloat16)
    assert not PALLAS.plan(Problem.of(q, q, q), None, 0.125, OPTIONS, False).interpret


@pytest.mark.parametrize("dtype,d", [(jnp.bfloat16, 128), (jnp.float16, 64)],
                         ids=["bf16-d128", "fp16-d64"])
@pytest.mark.parametrize("case", sorted(pc.CASES))
def test_cases(case, d, dtype):
    q, k, v, do = pc.inputs(b=2, sq=300, skv=260, hq=4, hkv=2, d=d, dtype=dtype)
    got, want = pc.both(case, q, k, v, do, OPTIONS, skip=True)
    _check(got, want, dtype)


@pytest.mark.parametrize("case", sorted(pc.WHEN_FULL))
def test_full_tiles(case):
    """Tiles the map marks full run the mod without its mask (a branch per tile)."""
    q, k, v, do = pc.inputs(b=2, sq=300, skv=260, hq=4, hkv=2, d=128, dtype=jnp.bfloat16)
    got, want = pc.both(case, q, k, v, do, OPTIONS, skip=True, full=pc.WHEN_FULL[case])
    _check(got, want, jnp.bfloat16)


@pytest.mark.parametrize("case", ["softcap", "relative_bias", "document", "masked_rows"])
def test_dense_map(case):
    q, k, v, do = pc.inputs(b=2, sq=256, skv=384, hq=4, hkv=1, d=128, dtype=jnp.bfloat16)
    got, want = pc.both(case, q, k, v, do, OPTIONS, skip=False)
    _check(got, want, jnp.bfloat16)


@pytest.mark.parametrize("shape", [dict(sq=128, skv=1024, hq=8, hkv=1),
                                   dict(sq=1000, skv=200, hq=2, hkv=2),
                                   dict(sq=256, skv=256, hq=4, hkv=4, d=128, dv=64)],
                         ids=["mqa-short-q", "long-q", "d128-dv64"])
def test_shapes(shape):
    q, k, v, do = pc.inputs(b=1, dtype=jnp.bfloat16, **shape)
    got, want = pc.both("alibi", q, k, v, do, OPTIONS, skip=True)
    _check(got, want, jnp.bfloat16)


def test_deterministic():
    q, k, v, do = pc.inputs(b=2, sq=256, skv=256, hq=4, hkv=2, d=64, dtype=jnp.bfloat16)
    runs = [pc.both("relative_bias", q, k, v, do, OPTIONS, skip=True)[0] for _ in range(2)]
    _same_bits(*runs)


def _learned_slopes_match(seq, options=None):
    """implementation="pallas" under jit + grad of causal ALiBi with learned
    slopes: dQ, dK, dV and the slopes' gradient against the reference path."""
    q, k, v, do = pc.inputs(b=2, sq=seq, skv=seq, hq=4, hkv=2, d=128, dtype=jnp.bfloat16)
    slopes = jnp.asarray([0.5, 0.25, 0.125, 0.0625], jnp.float32)

    def loss(impl, q, k, v, slopes):
        mod = lambda s, b, h, qi, ki: jnp.where(qi >= ki, s + slopes[h] * (ki - qi), -jnp.inf)
        o = scoremod.attention(q, k, v, mod, implementation=impl, options=options)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    want = jax.jit(jax.grad(lambda *a: loss("xla", *a), argnums=(0, 1, 2, 3)))(
        f32(q), f32(k), f32(v), slopes)
    got = jax.jit(jax.grad(lambda *a: loss("pallas", *a), argnums=(0, 1, 2, 3)))(q, k, v, slopes)
    for name, a, b in zip(("dQ", "dK", "dV", "dslopes"), got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        err = np.max(np.abs(a - b)) / np.max(np.abs(b))
        assert err < (OPERAND_TOL if name == "dslopes" else 3e-2), (name, err)


def test_through_attention():
    """implementation="pallas" under jit + grad, operand gradients included."""
    _learned_slopes_match(256)


def _op_check(expr):
    q, k, v, do = pc.inputs(b=1, sq=128, skv=128, hq=2, hkv=1, d=64, dtype=jnp.float32)
    mod = ScoreMod(expr)
    assert PALLAS.why_not(Problem.of(q, k, v), mod, automatic=False) is None
    got = pc.run(PALLAS, pc.pallas_plan(mod, q, k, v, OPTIONS), q, k, v, do, ())
    ref = REFERENCE.plan(Problem.of(q, k, v), mod, 0.125, OPTIONS, True)
    _check(got, pc.run(REFERENCE, ref, q, k, v, do, ()), jnp.float32)


@pytest.mark.parametrize("names", OP_GROUPS, ids=lambda names: f"{names[0]}..{names[-1]}")
def test_op_table(names):
    """Every op of the table the backend does not refuse, compiled by Triton,
    forward and backward, eight ops to a mod (float32 inputs: IEEE float32
    dots; float arguments inside every op's domain)."""
    _table_check({name: _examples(name, positive=True) for name in names}, _op_check)


def _table_check(examples, check, diagnosis_seconds=60):
    """``check`` of one mod summing every example; on a failure each example
    alone, for as long as ``diagnosis_seconds`` allows (each is a compile), and
    the message names the ops that fail and those left unchecked."""
    try:
        check(summed(e for es in examples.values() for e in es))
    except Exception as combined:
        failing, unchecked, start = {}, [], time.monotonic()
        for name, es in examples.items():
            if time.monotonic() - start > diagnosis_seconds:
                unchecked.append(name)
                continue
            for e in es:
                try:
                    check(e)
                except Exception as e_:  # noqa: PERF203 - diagnosis after a failure only
                    failing[name] = f"{type(e_).__name__}: {str(e_)[:200]}"
        raise AssertionError(f"ops failing alone: {failing}; not checked alone "
                             f"(time): {unchecked}") from combined


def test_vmap():
    """jax.vmap of a call (Pallas adds a grid axis), with learned slopes per example."""
    q, k, v, do = pc.inputs(b=1, sq=256, skv=192, hq=4, hkv=2, d=64, dtype=jnp.bfloat16)
    qs, ks, vs, dos = (jnp.stack([x, x[:, ::-1]]) for x in (q, k, v, do))
    slopes = jnp.asarray([[0.5, 0.25, 0.125, 0.0625], [0.1, 0.2, 0.3, 0.4]], jnp.float32)

    def loss(impl, q, k, v, do, slopes):
        mod = lambda s, b, h, qi, ki: jnp.where(qi >= ki, s + slopes[h] * (ki - qi), -jnp.inf)
        o = scoremod.attention(q, k, v, mod, implementation=impl)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

    def grads(impl, *a):
        return jax.jit(jax.vmap(jax.grad(lambda *a: loss(impl, *a), argnums=(0, 1, 2, 4))))(*a)

    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    want = grads("xla", f32(qs), f32(ks), f32(vs), dos, slopes)
    got = grads("pallas", qs, ks, vs, dos, slopes)
    for name, a, b in zip(("dQ", "dK", "dV", "dslopes"), got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        err = np.max(np.abs(a - b)) / np.max(np.abs(b))
        assert err < (OPERAND_TOL if name == "dslopes" else 3e-2), (name, err)


# --------------------------------------------------------------------------- #
# The Mosaic GPU engine (pallas_engine="mosaic", Hopper only): the same cases,
# where the engine runs them. pc.both learns the captured float arrays too: the
# engine reads them at b, h and constants only, so its backward (the Mosaic
# one) learns them; the tests further down check that it runs.

MOSAIC = scoremod.LoweringOptions(pallas_engine="mosaic")
# Every case runs on the engine, a float remainder's (float_compare) too. (relative_bias
# runs, its table a tile per diagonal; pc.both learns the table too.)
MOSAIC_CASES = sorted(pc.CASES)


@pytest.fixture
def hopper():
    from scoremod import device

    if device.current().family != 9:
        pytest.skip("the Mosaic GPU engine runs on Hopper GPUs only")


@pytest.mark.parametrize("dtype,d", [(jnp.bfloat16, 128), (jnp.float16, 64)],
                         ids=["bf16-d128", "fp16-d64"])
@pytest.mark.parametrize("case", MOSAIC_CASES)
def test_mosaic_cases(case, d, dtype, hopper):
    """O, LSE and every gradient, on the map that skips masked tiles; 300 x 260 is
    no whole number of 128-row or 128-key tiles (tails), 4 query heads on 2."""
    q, k, v, do = pc.inputs(b=2, sq=300, skv=260, hq=4, hkv=2, d=d, dtype=dtype)
    got, want = pc.both(case, q, k, v, do, MOSAIC, skip=True)
    _check(got, want, dtype)


@pytest.mark.parametrize("case", sorted(pc.WHEN_FULL))
def test_mosaic_full_tiles(case, hopper):
    """Tiles the map marks full run the mod without its mask (a branch per tile)."""
    q, k, v, do = pc.inputs(b=2, sq=300, skv=260, hq=4, hkv=2, d=128, dtype=jnp.bfloat16)
    got, want = pc.both(case, q, k, v, do, MOSAIC, skip=True, full=pc.WHEN_FULL[case])
    _check(got, want, jnp.bfloat16)


@pytest.mark.parametrize("case", ["softcap", "causal", "alibi", "masked_rows"])
def test_mosaic_analysed_map(case, hopper):
    """The plan's own map (lowering.block_maps from the IR), as scoremod.attention uses it."""
    q, k, v, do = pc.inputs(b=2, sq=512, skv=512, hq=4, hkv=2, d=128, dtype=jnp.bfloat16)
    got, want = pc.both(case, q, k, v, do, MOSAIC, skip=False)
    _check(got, want, jnp.bfloat16)


@pytest.mark.parametrize("shape", [dict(sq=128, skv=1024, hq=8, hkv=1),
                                   dict(sq=1000, skv=200, hq=2, hkv=2),
                                   dict(sq=1000, skv=1000, hq=4, hkv=4)],
                         ids=["mqa-short-q", "long-q", "tail-1000"])
def test_mosaic_shapes(shape, hopper):
    q, k, v, do = pc.inputs(b=1, d=128, dtype=jnp.bfloat16, **shape)
    got, want = pc.both("alibi", q, k, v, do, MOSAIC, skip=True)
    _check(got, want, jnp.bfloat16)


def test_mosaic_through_attention(hopper):
    """implementation="pallas" with the mosaic engine under jit + grad, slopes learned."""
    _learned_slopes_match(512, MOSAIC)


def test_mosaic_refusals(hopper):
    """What the engine refuses (two tables read at q_idx - kv_idx in one mod) the
    Triton engine takes; float32 inputs neither."""
    q, k, v, _ = pc.inputs(b=1, sq=256, skv=256, hq=4, hkv=2, d=128, dtype=jnp.bfloat16)
    t1 = jnp.ones((4, 511), jnp.float32)
    t2 = t1 * 0.5
    mod = scoremod.trace(lambda s, b, h, qi, ki: s + t1[h, qi - ki + 255] + t2[h, qi - ki + 255])
    assert "one array read at q_idx - kv_idx" in PALLAS.why_not(Problem.of(q, k, v), mod, False,
                                                                 MOSAIC)
    assert PALLAS.why_not(Problem.of(q, k, v), mod, False, OPTIONS) is None
    with pytest.raises(scoremod.ScoreModError, match="float16 or bfloat16"):
        x = q.astype(jnp.float32)
        scoremod.attention(x, x, x, implementation="pallas", options=MOSAIC)


def _mosaic_runs(e):
    return not mosaic.refusal(e, {}) and not codegen.refusal(e, {}, ops=False)


# The ops the Mosaic GPU engine takes (erf and erfc too, which the Triton lowering
# lacks), in groups of eight as for Triton (one mod of all of them took its compile
# past the per-test limit).
_MOSAIC_EXAMPLES = {name: [e for e in _examples(name, positive=True) if _mosaic_runs(e)]
                    for name in TABLE_OPS}
# The float remainders (a loop of 13 integer long-division steps each, in the mod and
# its derivative) one to a mod: three in one group compiled past the per-test limit
# while they were unrolled.
_HEAVY = ("floordiv", "mod", "rem")
_MOSAIC_NAMES = [name for name, es in _MOSAIC_EXAMPLES.items() if es and name not in _HEAVY]
_MOSAIC_GROUPS = ([_MOSAIC_NAMES[i:i + 8] for i in range(0, len(_MOSAIC_NAMES), 8)]
                  + [[name] for name in _HEAVY if _MOSAIC_EXAMPLES[name]])


@pytest.mark.parametrize("names", _MOSAIC_GROUPS, ids=lambda names: f"{names[0]}..{names[-1]}")
def test_mosaic_op_table(hopper, names):
    """Every op of the table the Mosaic GPU engine takes, eight to a mod (bfloat16
    inputs, float arguments inside every op's domain), forward and backward."""

    def check(expr):
        q, k, v, do = pc.inputs(b=1, sq=256, skv=256, hq=2, hkv=1, d=64, dtype=jnp.bfloat16)
        got = pc.run(PALLAS, pc.pallas_plan(ScoreMod(expr), q, k, v, MOSAIC), q, k, v, do, ())
        ref = REFERENCE.plan(Problem.of(q, k, v), ScoreMod(expr), 0.125, MOSAIC, True)
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        _check(got, pc.run(REFERENCE, ref, f32(q), f32(k), f32(v), f32(do), ()), jnp.bfloat16)

    _table_check({name: _MOSAIC_EXAMPLES[name] for name in names}, check)


def test_mosaic_float_remainders_are_exact(hopper):
    """The float remainder the kernels evaluate (an integer long division with
    float32 quotient estimates, under the kernels' approximate math) gives C fmod's
    bits on the GPU: random float32 bit patterns (every exponent gap, subnormals,
    infinities, NaN) and scores by a mod's divisors; jnp.remainder's bits (XLA's, on
    the GPU) where no subnormal takes part, and jnp.floor_divide's there too where the
    quotient is below 2**22 (past it a division within 2 ulp may round to another
    float: within 4 ulp there)."""
    rng = np.random.default_rng(11)
    shape = (64, 128)
    bits = rng.integers(0, 2 ** 32, size=(2,) + shape, dtype=np.uint64).astype(np.uint32)
    a, b = bits.view(np.int32).view(np.float32)
    scores = (rng.normal(size=shape) * 20).astype(np.float32)
    divisors = rng.choice(np.float32([0.75, -0.75, 3.0, 0.1, 1e-3, -2.0, 1e-40]), shape)
    same_bits, normal = pc.same_bits, pc.not_subnormal
    for x, y in ((a, b), (scores, divisors), (scores * 1e30, divisors), (divisors, scores)):
        with np.errstate(all="ignore"):
            fmod = np.fmod(x, y)
        got = pc.tile_rule(mosaic._rem, jnp.asarray(x), jnp.asarray(y))
        assert same_bits(got, fmod).all(), (x[~same_bits(got, fmod)][:4],
                                            y[~same_bits(got, fmod)][:4])
        kept = normal(x) & normal(y) & normal(fmod)
        got = pc.tile_rule(mosaic._mod, jnp.asarray(x), jnp.asarray(y))
        assert same_bits(got, jnp.remainder(jnp.asarray(x), jnp.asarray(y)))[kept].all()
        got = np.asarray(pc.tile_rule(mosaic._floordiv, jnp.asarray(x), jnp.asarray(y)))
        want = np.asarray(jnp.floor_divide(jnp.asarray(x), jnp.asarray(y)))
        with np.errstate(all="ignore"):
            small = np.abs(x.astype(np.float64) / y) < 2.0 ** 22
        assert same_bits(got, want)[kept & small].all()
        wide = kept & ~small & np.isfinite(want)
        np.testing.assert_allclose(got[wide], want[wide], rtol=5e-7)


# --------------------------------------------------------------------------- #
# The Mosaic GPU backward (pallas_engine="mosaic": dQ and dK/dV on wgmma), the
# gradients of q, k and v, then those of captured float arrays too: every plan
# asserts that the Mosaic backward runs.

def _mosaic_backward(plan):
    assert plan.engine == "mosaic" and plan.backward_engine == "mosaic", plan.describe()


# Each case at one of the two dtype/head-dim pairs (alternating), so that both
# meet masks, modifiers and scalar reads without doubling the compiles.
_MOSAIC_BACKWARD_CASES = [
    ("softcap", jnp.bfloat16, 128), ("causal", jnp.float16, 64),
    ("softcap_causal", jnp.bfloat16, 128), ("sliding_window", jnp.float16, 64),
    ("alibi", jnp.bfloat16, 128), ("learnable_softcap", jnp.float16, 64),
    ("batch_scale", jnp.bfloat16, 64), ("masked_rows", jnp.float16, 128),
]


@pytest.mark.parametrize("case,dtype,d", _MOSAIC_BACKWARD_CASES,
                         ids=[f"{c}-{jnp.dtype(t).name}-d{d}"
                              for c, t, d in _MOSAIC_BACKWARD_CASES])
def test_mosaic_backward(case, dtype, d, hopper):
    """O, LSE, dQ, dK, dV against the reference path, on the map that skips masked
    tiles; 300 x 260 is no whole number of 64-row tiles (tails on both sides),
    4 query heads on 2 (dK, dV summed per group)."""
    q, k, v, do = pc.inputs(b=2, sq=300, skv=260, hq=4, hkv=2, d=d, dtype=dtype)
    got, want = pc.both(case, q, k, v, do, MOSAIC, skip=True, learn_operands=False,
                        check_plan=_mosaic_backward)
    _check(got, want, dtype)


@pytest.mark.parametrize("case", ["softcap_causal", "masked_rows"])
def test_mosaic_backward_full_tiles(case, hopper):
    """Tiles the map marks full run the mod without its mask and that mod's
    derivative (a branch per tile), at 512 x 512 (the exact map of the mask)."""
    q, k, v, do = pc.inputs(b=1, sq=512, skv=512, hq=4, hkv=1, d=128, dtype=jnp.bfloat16)
    got, want = pc.both(case, q, k, v, do, MOSAIC, skip=True, full=pc.WHEN_FULL[case],
                        learn_operands=False, check_plan=_mosaic_backward)
    _check(got, want, jnp.bfloat16)


@pytest.mark.parametrize("shape", [dict(sq=128, skv=1024, hq=8, hkv=1, d=64),
                                   dict(sq=1000, skv=200, hq=2, hkv=2, d=128),
                                   dict(sq=1000, skv=1000, hq=4, hkv=4, d=128)],
                         ids=["mqa-short-q", "long-q", "causal-1000"])
def test_mosaic_backward_shapes(shape, hopper):
    """Eight query heads on one (MQA), Sq much longer than Skv, causal at 1000
    (the analysed map: its full tiles and the skipped upper triangle)."""
    q, k, v, do = pc.inputs(b=1, dtype=jnp.bfloat16, **shape)
    case = "causal" if shape["sq"] == shape["skv"] else "softcap"
    got, want = pc.both(case, q, k, v, do, MOSAIC, skip=False, learn_operands=False,
                        check_plan=_mosaic_backward)
    _check(got, want, jnp.bfloat16)


def test_mosaic_backward_plain(hopper):
    """No mod: scoremod.attention by name, jitted, against implementation="xla"."""
    q, k, v, do = pc.inputs(b=2, sq=384, skv=256, hq=4, hkv=2, d=128, dtype=jnp.bfloat16)
    plan = PALLAS.plan(Problem.of(q, k, v), None, 0.125, MOSAIC, True)
    _mosaic_backward(plan)

    def grads(impl, *a):
        def loss(q, k, v):
            o = scoremod.attention(q, k, v, implementation=impl, options=MOSAIC)
            return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*a)

    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    want = grads("xla", f32(q), f32(k), f32(v))
    got = grads("pallas", q, k, v)
    for name, a, b in zip(("dQ", "dK", "dV"), got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        err = np.max(np.abs(a - b)) / np.max(np.abs(b))
        assert err < TOL[jnp.bfloat16], (name, err)


def _same_bits(a, b, dq=True):
    """Two runs' (O, LSE, dQ, dK, dV, operand gradients) bitwise equal (dQ too, or not:
    dQ fused into the dK/dV kernel is added up in any order)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if i == 2 and not dq:
            continue
        for u, w in zip(jax.tree.leaves(x), jax.tree.leaves(y)):
            assert np.array_equal(np.asarray(u), np.asarray(w), equal_nan=True), i


def test_mosaic_backward_deterministic(hopper):
    """Two runs give the same bits with deterministic=True (the dQ kernel: each
    program owns its rows); by default every gradient but dQ (fused, added up in
    any order where the plan fuses it)."""
    q, k, v, do = pc.inputs(b=2, sq=256, skv=320, hq=4, hkv=2, d=64, dtype=jnp.bfloat16)
    for options in (MOSAIC.replace(deterministic=True), MOSAIC):
        runs = [pc.both("softcap_causal", q, k, v, do, options, skip=True, learn_operands=False,
                        check_plan=_mosaic_backward)[0] for _ in range(2)]
        _same_bits(*runs, dq=options.deterministic)


# --------------------------------------------------------------------------- #
# Captured arrays read along one tile axis on the Mosaic engine (document ids,
# per-key flags and biases): forward and backward on Mosaic GPU kernels, the
# plan's own map (documents skip tiles), gradients of q, k and v.

_VECTOR_CASES = [
    ("document_softcap", 4, dict(sq=512, skv=512, hq=4, hkv=4, d=128), jnp.bfloat16),
    ("document_softcap", 2, dict(sq=1000, skv=1000, hq=4, hkv=2, d=128), jnp.bfloat16),
    ("document_softcap", 2, dict(sq=300, skv=260, hq=8, hkv=2, d=64), jnp.float16),
    ("document", 2, dict(sq=1000, skv=1000, hq=2, hkv=1, d=64), jnp.float16),
    ("document_bidirectional", 2, dict(sq=640, skv=640, hq=4, hkv=1, d=128), jnp.bfloat16),
    ("document_bidirectional", 1, dict(sq=1000, skv=777, hq=2, hkv=2, d=64), jnp.float16),
    ("shifted_bias", 2, dict(sq=300, skv=260, hq=4, hkv=2, d=128), jnp.bfloat16),
    # reads at whole blocks of positions: a tile map per batch and head, a block bias
    ("block_map", 2, dict(sq=1000, skv=1000, hq=4, hkv=2, d=128), jnp.bfloat16),
    ("block_map", 1, dict(sq=512, skv=777, hq=2, hkv=1, d=64), jnp.float16),
    ("block_bias", 2, dict(sq=300, skv=520, hq=4, hkv=2, d=128), jnp.bfloat16),
    # terms of one position on the forward's vectors (mosaic.axis_parts)
    ("alibi_unmasked", 2, dict(sq=1000, skv=1000, hq=4, hkv=2, d=128), jnp.bfloat16),
    ("log_scaled", 1, dict(sq=700, skv=900, hq=2, hkv=1, d=64), jnp.float16),
    ("key_terms", 2, dict(sq=300, skv=520, hq=4, hkv=2, d=128), jnp.bfloat16),
    ("grid_bias", 2, dict(sq=1000, skv=1000, hq=4, hkv=2, d=128), jnp.bfloat16),
    ("swin_bias", 1, dict(sq=640, skv=777, hq=2, hkv=1, d=64), jnp.float16),
    ("score_lookup", 2, dict(sq=300, skv=520, hq=4, hkv=2, d=128), jnp.bfloat16),
]


@pytest.mark.parametrize(
    "case,b,shape,dtype", _VECTOR_CASES,
    ids=[f"{c}-b{b}-{s['sq']}x{s['skv']}-h{s['hq']}on{s['hkv']}-{jnp.dtype(t).name}-d{s['d']}"
         for c, b, s, t in _VECTOR_CASES])
def test_mosaic_vector_reads(case, b, shape, dtype, hopper):
    """O, LSE, dQ, dK, dV against the reference path: document masks with a softcap,
    causal and not, random document lengths differing per batch, 1000 (no whole
    number of tiles), query heads sharing key heads (GQA, MQA), float16; an offset
    index and a float vector per head; a tile map and a bias read per block of
    positions (``mosaic.block_values``); terms of one position computed on the
    forward's vectors (ALiBi split, a factor of the query, terms of the key); gathers
    read per score at their index evaluated on the tile (a 2-D relative position,
    Swin's table at a relative index read per score, a lookup table of the score)."""
    _vector_mod_against_reference(case, b, shape, dtype)


def _vector_mod_against_reference(case, b, shape, dtype):
    """``case`` (pc.vector_mod's) on the Mosaic kernels, forward and backward,
    against the reference path (O, LSE, dQ, dK, dV)."""
    q, k, v, do = pc.inputs(b=b, dtype=dtype, **shape)
    mod, operands = pc.traced_vector_mod(case, q, k)
    plan = pc.pallas_plan(mod, q, k, v, MOSAIC)
    _mosaic_backward(plan)
    got = pc.run(PALLAS, plan, q, k, v, do, operands, False)
    ref = REFERENCE.plan(Problem.of(q, k, v), mod, plan.scale, MOSAIC, True)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    _check(got, pc.run(REFERENCE, ref, f32(q), f32(k), f32(v), f32(do), operands, False), dtype)


# Relative-position tables (reads at q_idx - kv_idx) on the Mosaic engine: a tile per
# diagonal, forward and backward on Mosaic GPU kernels.

_OFFSET_CASES = [
    ("relative_bias", 2, dict(sq=300, skv=260, hq=4, hkv=2, d=128), jnp.bfloat16),
    ("relative_softcap", 2, dict(sq=1000, skv=1000, hq=4, hkv=1, d=64), jnp.float16),
    ("relative_softcap", 1, dict(sq=384, skv=1024, hq=2, hkv=2, d=128), jnp.bfloat16),
    ("relative_buckets", 2, dict(sq=512, skv=512, hq=8, hkv=2, d=128), jnp.bfloat16),
    ("relative_causal", 2, dict(sq=1000, skv=1000, hq=4, hkv=2, d=128), jnp.bfloat16),
    ("relative_document", 2, dict(sq=1000, skv=1000, hq=4, hkv=2, d=128), jnp.bfloat16),
    ("relative_masked", 1, dict(sq=1000, skv=1000, hq=2, hkv=1, d=128), jnp.bfloat16),
]


@pytest.mark.parametrize(
    "case,b,shape,dtype", _OFFSET_CASES,
    ids=[f"{c}-b{b}-{s['sq']}x{s['skv']}-h{s['hq']}on{s['hkv']}-{jnp.dtype(t).name}-d{s['d']}"
         for c, b, s, t in _OFFSET_CASES])
def test_mosaic_offset_reads(case, b, shape, dtype, hopper):
    """O, LSE, dQ, dK, dV against the reference path: a table per head (grouped
    heads, tails), jax.numpy's wrapped negative index under a softcap (MQA,
    float16 d64 at 1000; Sq < Skv), T5's int buckets indexing a float table, a
    causal table (tiles skipped, full ones without the mask), a table beside
    document ids at head dim 128 (the forward's shared memory holds both), a
    table with -inf runs (the block map skips their tiles, bounded from the
    diagonals)."""
    _vector_mod_against_reference(case, b, shape, dtype)


def test_relative_table_through_attention(hopper):
    """implementation=None runs a relative-bias table (the harness's form, the index
    wrapped by jax.numpy) on the Mosaic engine, jitted, with the table's gradient
    too (the per-block-diagonal kernel, no Triton one), against implementation="xla"."""
    q, k, v, do = pc.inputs(b=2, sq=1024, skv=1024, hq=8, hkv=2, d=128, dtype=jnp.bfloat16)
    table = jax.random.normal(jax.random.PRNGKey(4), (8, 2047), jnp.float32)

    def grads(impl, q, k, v, table, argnums):
        """O and the gradients of <O, dO> (not the loss: its terms cancel to ~1e-3 of
        their magnitudes here, below O's bfloat16 rounding)."""
        def attend(q, k, v, table):
            return scoremod.attention(q, k, v, lambda s, b, h, qi, ki: s + table[h, qi - ki + 1023],
                                      implementation=impl)

        def loss(q, k, v, table):
            return jnp.sum(attend(q, k, v, table).astype(jnp.float32) * do.astype(jnp.float32))
        return jax.jit(attend)(q, k, v, table), jax.jit(jax.grad(loss, argnums=argnums))(
            q, k, v, table)

    choice = scoremod.which_implementation(
        q, k, v, lambda s, b, h, qi, ki: s + table[h, qi - ki + 1023])
    assert choice.implementation == "pallas" and "Mosaic GPU" in choice.variant, choice
    plan = PALLAS.plan(Problem.of(q, k, v), scoremod.trace(
        lambda s, b, h, qi, ki: s + table[h, qi - ki + 1023]), 0.125, MOSAIC, True)
    assert plan.diagonal_operands and not plan.triton_operands, plan.describe()
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    for argnums in ((0, 1, 2), (0, 3)):
        want = grads("xla", f32(q), f32(k), f32(v), table, argnums)
        got = grads(None, q, k, v, table, argnums)
        leaves = list(zip(jax.tree.leaves(got), jax.tree.leaves(want)))
        for i, (g, w) in enumerate(leaves):
            err = float(jnp.max(jnp.abs(f32(g) - w)) / jnp.max(jnp.abs(w)))
            learned = 3 in argnums and i == len(leaves) - 1  # the table's gradient
            assert err < (OPERAND_TOL if learned else TOL[jnp.bfloat16]), (argnums, i, err)


def test_mosaic_document_through_attention(hopper):
    """The motivating mod by scoremod.attention, jitted with gradients, against
    implementation="xla": document ids per batch, causal, softcap 30. O and the
    gradients of <O, dO> are compared, not that sum itself: its terms cancel
    (as in test_relative_table_through_attention), so bfloat16 rounding alone
    can move it past the tolerance."""
    q, k, v, do = pc.inputs(b=2, sq=1000, skv=1000, hq=8, hkv=2, d=128, dtype=jnp.bfloat16)
    doc = pc.doc_ids(2, 1000, docs=6, seed=3)

    def mod(score, b, h, q_idx, kv_idx):
        same = (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)
        return jnp.where(same, 30 * jnp.tanh(score / 30), -jnp.inf)

    def grads(impl, *a):
        def attend(q, k, v):
            return scoremod.attention(q, k, v, mod, implementation=impl, options=MOSAIC)

        def loss(q, k, v):
            return jnp.sum(attend(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))
        return jax.jit(attend)(*a), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*a)

    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    want = grads("xla", f32(q), f32(k), f32(v))
    got = grads("pallas", q, k, v)
    _mosaic_backward(PALLAS.plan(Problem.of(q, k, v), scoremod.trace(mod), 0.125, MOSAIC, True))
    for name, a, b in zip(("O", "dQ", "dK", "dV"), jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        err = np.max(np.abs(a - b)) / np.max(np.abs(b))
        assert err < TOL[jnp.bfloat16], (name, err)


# Gradients of captured float arrays on the Mosaic backward: arrays read at b, h
# and constants (ALiBi's slopes[h] under a causal mask, a learned softcap's
# scalar, two columns of a per-head row w[h, 0], w[h, 2]), summed by its dK/dV
# kernel; the plan asserts that no operand is left to the Triton backward.

def _mosaic_learns(plan):
    _mosaic_backward(plan)
    assert plan.triton_operands == (), plan.describe()
    assert "gradients of captured arrays included" in plan.describe()


_MOSAIC_LEARNED_CASES = [(c, t, d) for c in ("alibi", "learnable_softcap", "head_bias")
                         for t, d in ((jnp.bfloat16, 128), (jnp.float16, 64))]


@pytest.mark.parametrize("case,dtype,d", _MOSAIC_LEARNED_CASES,
                         ids=[f"{c}-{jnp.dtype(t).name}-d{d}"
                              for c, t, d in _MOSAIC_LEARNED_CASES])
def test_mosaic_backward_learns_operands(case, dtype, d, hopper):
    """O, LSE, dQ, dK, dV and the captured arrays' gradients against the reference
    path, on the plan's own map (alibi's full tiles run the mod without its mask,
    the slopes read there too): 333 x 270 (tails on both sides), 8 query heads on
    2. (test_mosaic_cases runs these cases at 300 x 260 on the map that skips
    masked tiles, learning the arrays too.)"""
    q, k, v, do = pc.inputs(b=2, sq=333, skv=270, hq=8, hkv=2, d=d, dtype=dtype)
    got, want = pc.both(case, q, k, v, do, MOSAIC, skip=False, learn_operands=True,
                        check_plan=_mosaic_learns)
    assert all(g is not None for g in got[5]), "no operand gradient"
    _check(got, want, dtype)


_DIAGONAL_CASES = [
    ("relative_bias", dict(sq=300, skv=260, hq=4, hkv=2, d=128), jnp.bfloat16),
    ("relative_softcap", dict(sq=384, skv=1024, hq=2, hkv=2, d=64), jnp.float16),
    ("relative_causal", dict(sq=1000, skv=1000, hq=4, hkv=2, d=128), jnp.bfloat16),
    ("relative_masked", dict(sq=1000, skv=1000, hq=2, hkv=1, d=128), jnp.bfloat16),
    ("relative_document", dict(sq=1000, skv=1000, hq=4, hkv=2, d=128), jnp.bfloat16),
]


@pytest.mark.parametrize("case,shape,dtype", _DIAGONAL_CASES,
                         ids=[f"{c}-{s['sq']}x{s['skv']}-{jnp.dtype(t).name}-d{s['d']}"
                              for c, s, t in _DIAGONAL_CASES])
def test_mosaic_learns_relative_tables(case, shape, dtype, hopper):
    """A learned table read at q_idx - kv_idx: O, LSE, dQ, dK, dV and the table's
    gradient (the per-block-diagonal kernel) against the reference path, no
    Triton kernel in the plan; and the same bits on a second run."""
    def per_diagonal(plan):
        assert plan.diagonal_operands and plan.triton_operands == (), plan.describe()

    _learns_twice(case, shape, dtype, per_diagonal)


@pytest.mark.parametrize("case,shape,dtype", [
    ("shifted_bias", dict(sq=1000, skv=1000, hq=4, hkv=2, d=128), jnp.bfloat16),
    ("key_chunks", dict(sq=384, skv=1024, hq=4, hkv=1, d=64), jnp.float16),
    ("query_scale", dict(sq=1000, skv=1000, hq=4, hkv=2, d=128), jnp.bfloat16),
])
def test_mosaic_learns_position_reads(case, shape, dtype, hopper):
    """A learned array read along the keys or the queries (a per-head key bias under
    a document mask; a factor of the score per 4 keys shared by the heads; a factor
    per head and query under a causal mask): O, LSE, dQ, dK, dV and its gradient
    (the dK/dV kernel's per-key sums, or the dQ kernel's per-query ones, placed
    where read) against the reference path, no Triton kernel in the plan; the same
    bits on a second run."""
    def per_position(plan):
        assert plan.triton_operands == () and not plan.diagonal_operands, plan.describe()

    _learns_twice(case, shape, dtype, per_position)


@pytest.mark.parametrize("case,shape,dtype", [
    ("block_bias64", dict(sq=1000, skv=1000, hq=4, hkv=2, d=128), jnp.bfloat16),
    ("block_map_bias", dict(sq=1024, skv=1536, hq=4, hkv=2, d=128), jnp.bfloat16),
    ("block_map_bias", dict(sq=512, skv=777, hq=2, hkv=1, d=64), jnp.float16),
    ("block_bias", dict(sq=300, skv=520, hq=4, hkv=2, d=128), jnp.bfloat16),
])
def test_mosaic_learns_block_reads(case, shape, dtype, hopper):
    """A learned array read at whole blocks of positions (a bias per 64 x 32 block
    under a causal mask; a bias per batch, head and 128 x 128 block beside a
    video-sparse tile map; a bias per 48 x 32 block, two block rows a step): O, LSE,
    dQ, dK, dV and its gradient (the dK/dV kernel's per-step sums over each block
    row, written through shared memory every step) against the reference path, no
    Triton kernel in the plan; the same bits on a second run."""
    def per_step(plan):
        assert plan.triton_operands == () and not plan.diagonal_operands, plan.describe()

    _learns_twice(case, shape, dtype, per_step)


@pytest.mark.parametrize("case,shape,dtype", [
    ("kind_pair", dict(sq=1000, skv=1000, hq=4, hkv=2, d=128), jnp.bfloat16),
    ("kind_pair", dict(sq=300, skv=777, hq=2, hkv=1, d=64), jnp.float16),
    ("kind_mask", dict(sq=1024, skv=1024, hq=4, hkv=2, d=128), jnp.bfloat16),
    ("kind_query_scale", dict(sq=700, skv=900, hq=4, hkv=2, d=128), jnp.bfloat16),
    ("kind_key_bias", dict(sq=640, skv=1000, hq=4, hkv=4, d=64), jnp.float16),
])
def test_mosaic_learns_short_table_gathers(case, shape, dtype, hopper):
    """A small table read through other arrays at both tile axes (a per-head bias
    between token kinds; a mask of which kinds see which with a scale per kind
    pair, causal; a factor per head and query kind), the tables picked by
    comparisons (``selects``) or read along the queries through the kinds, learned: O, LSE, dQ, dK,
    dV and the table's gradient (each entry's per-key or per-query sums placed by
    the kinds at run time) against the reference path, no Triton kernel in the
    plan; the same bits on a second run."""
    def picked(plan):
        assert plan.triton_operands == (), plan.describe()

    _learns_twice(case, shape, dtype, picked)


@pytest.mark.parametrize("case,shape,dtype", [
    ("pair_bias", dict(sq=1000, skv=1000, hq=4, hkv=2, d=128), jnp.bfloat16),
    ("pair_bias", dict(sq=300, skv=777, hq=2, hkv=1, d=64), jnp.float16),
    ("head_bias_causal", dict(sq=1024, skv=1024, hq=4, hkv=2, d=128), jnp.bfloat16),
    ("wider_bias", dict(sq=700, skv=900, hq=4, hkv=2, d=128), jnp.bfloat16),
    ("capped_bias", dict(sq=640, skv=1000, hq=4, hkv=4, d=64), jnp.float16),
    ("half_bias", dict(sq=512, skv=777, hq=4, hkv=2, d=128), jnp.bfloat16),
    ("masked_bias", dict(sq=1000, skv=1000, hq=4, hkv=2, d=128), jnp.bfloat16),
    ("transposed_bias", dict(sq=700, skv=1000, hq=4, hkv=2, d=128), jnp.bfloat16),
    ("pair_features", dict(sq=512, skv=640, hq=4, hkv=4, d=64), jnp.float16),
    ("edge_types", dict(sq=1000, skv=1000, hq=4, hkv=2, d=128), jnp.bfloat16),
    ("query_pairs_bias", dict(sq=1000, skv=900, hq=4, hkv=2, d=128), jnp.bfloat16),
    ("key_pairs_bias", dict(sq=640, skv=777, hq=2, hkv=2, d=64), jnp.float16),
    ("wrapped_bias", dict(sq=700, skv=900, hq=4, hkv=2, d=128), jnp.bfloat16),
    ("swin_bias", dict(sq=512, skv=640, hq=4, hkv=2, d=64), jnp.float16),
    ("grid_bias", dict(sq=1000, skv=1000, hq=4, hkv=2, d=128), jnp.bfloat16),
])
def test_mosaic_learns_dense_reads(case, shape, dtype, hopper):
    """A learned float array read per score (``bias[b, h, q_idx, kv_idx]``: Flax's
    ``bias``; one per head shared by the batch under a causal mask, whose skipped
    tiles the kernel leaves unwritten; one longer than the sequences; a
    softcap over score and bias; a bfloat16 one, widened as loaded; one beside
    Flax's bool mask per score, read as int8, its empty tiles skipped; one stored
    keys first, causal; pair features [B, Sq, Skv, 3]; an edge type per score picking
    a learned weight per head; a row per two queries; a column per two keys; and,
    summed by the position each score reads, a bias tiled over the scores, Swin's
    table at a relative index per score and a 2-D relative-position table), each thread
    loading its scores' values from
    global memory: O, LSE, dQ, dK, dV and the array's gradient (the dQ kernel's
    tiles, placed by batch and head) against the reference path, no Triton kernel
    in the plan; the same bits on a second run."""
    def per_score(plan):
        assert plan.triton_operands == () and not plan.diagonal_operands, plan.describe()

    _learns_twice(case, shape, dtype, per_score)


def _learns_twice(case, shape, dtype, check_plan):
    """``case`` (pc.vector_mod's, its float operands learned) on the Mosaic kernels,
    forward and backward, twice: ``check_plan(plan)`` on the Mosaic backward's
    plan, O, LSE, dQ, dK, dV and the array's gradient against the reference
    path, and the same bits on the second run."""
    q, k, v, do = pc.inputs(b=2, dtype=dtype, **shape)
    runs = []
    for _ in range(2):
        mod, operands = pc.traced_vector_mod(case, q, k)
        plan = pc.pallas_plan(mod, q, k, v, MOSAIC)
        _mosaic_backward(plan)
        check_plan(plan)
        runs.append(pc.run(PALLAS, plan, q, k, v, do, operands, True))
    ref = REFERENCE.plan(Problem.of(q, k, v), mod, plan.scale, MOSAIC, True)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    want = pc.run(REFERENCE, ref, f32(q), f32(k), f32(v), f32(do), operands, True)
    floats = [i for i, x in enumerate(operands) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert runs[0][5][floats[-1]] is not None, "no gradient of the learned array"
    _check(runs[0], want, dtype)
    _same_bits(*runs, dq=not plan.fused_dq)


def test_mosaic_backward_learned_deterministic(hopper):
    """Two runs with the slopes' gradient give the same bits, the slopes' included
    (no atomics: each program writes its own sums), on the analysed causal map."""
    q, k, v, do = pc.inputs(b=2, sq=512, skv=448, hq=8, hkv=2, d=128, dtype=jnp.bfloat16)
    for options in (MOSAIC.replace(deterministic=True), MOSAIC):
        runs = [pc.both("alibi", q, k, v, do, options, skip=False, learn_operands=True,
                        check_plan=_mosaic_learns)[0] for _ in range(2)]
        assert runs[0][5][0] is not None
        _same_bits(*runs, dq=options.deterministic)


@pytest.mark.parametrize("route", ["pallas", "auto"])
def test_bucketed_table_learns_through_attention(hopper, route):
    """T5's table read through an int bucket array, through scoremod.attention: the
    read folded into a gathered table (lowering.gathered) that the Mosaic GPU
    backward learns per block diagonal (no Triton kernel: no warning of JAX's
    deprecated Triton backend); the table's gradient matches the
    reference path's and repeats bitwise; implementation=None keeps cuDNN's forward
    and runs the gradient on the Pallas kernels."""
    import warnings

    n, hq = 512, 8
    q, k, v, do = pc.inputs(b=2, sq=n, skv=n, hq=hq, hkv=2, d=128, dtype=jnp.bfloat16)
    buckets = jnp.asarray(np.clip(np.arange(-n + 1, n) // 16, -8, 8) + 8, jnp.int32)
    table = jnp.asarray(np.random.default_rng(15).normal(size=(17, hq)), jnp.float32)
    impl, options = ("pallas", MOSAIC) if route == "pallas" else (None, None)

    def loss(t, impl, options):
        mod = lambda s, b, h, qi, ki: s + t[buckets[ki - qi + n - 1], h]  # noqa: E731
        o = scoremod.attention(q, k, v, mod, implementation=impl, options=options)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")  # implementation=None says it falls back for the table
        grad = jax.jit(jax.grad(loss), static_argnums=(1, 2))
        got, again = grad(table, impl, options), grad(table, impl, options)
    assert not [w for w in said if "Triton" in str(w.message)], [str(w.message) for w in said]
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    want = jax.grad(lambda t: jnp.sum(scoremod.attention(
        f32(q), f32(k), f32(v), lambda s, b, h, qi, ki: s + t[buckets[ki - qi + n - 1], h],
        implementation="xla") * f32(do)))(table)
    err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
    assert err < 3e-2, err
    np.testing.assert_array_equal(np.asarray(got), np.asarray(again))


# LoweringOptions(mosaic_forward=True): the Mosaic GPU forward with cuDNN's backward
# on its O and LSE (rows that see no key: LSE -inf there, +inf for cuDNN).

@pytest.mark.parametrize("case", ["softcap_causal", "masked_rows", "alibi", "softcap"])
def test_mosaic_forward_with_the_cudnn_backward(case, hopper):
    """O, LSE (none: return_lse would ask the backward for its cotangent, which cuDNN
    does not take), dQ, dK, dV against the reference path, with the route checked:
    the forward on the Mosaic engine, the backward on cuDNN."""
    q, k, v, do = pc.inputs(b=2, sq=1024, skv=1024, hq=4, hkv=2, d=128, dtype=jnp.bfloat16)
    mod, operands = pc.traced(case, q, k)
    on = scoremod.LoweringOptions(mosaic_forward=True, low_rank_bias=False, sms=16)
    choice = scoremod.which_implementation(q, k, v, mod, options=on)
    assert choice.implementation == "pallas" and "cuDNN" in (choice.backward or ""), choice

    def run(impl, options, dtype):
        f = jax.jit(lambda q, k, v: scoremod.attention(q, k, v, mod, implementation=impl,
                                                       options=options))
        args = [x.astype(dtype) for x in (q, k, v)]
        o, vjp = jax.vjp(f, *args)
        return (o, jnp.zeros((1,)), *vjp(do.astype(dtype)), ())

    _check(run(None, on, jnp.bfloat16), run("xla", None, jnp.float32), jnp.bfloat16)
