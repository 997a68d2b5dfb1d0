"""The fused cuDNN path against the reference path, on a GPU.

Every op of the table alone, then realistic mods across dtypes, head dims,
Sq != Skv and GQA: output, LSE, dQ, dK and dV all checked (cuDNN can accept a
graph and still compute dV wrong).
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from scoremod import CudnnUnavailableError
from scoremod import LoweringOptions
from scoremod.lowering.cudnn import graph as cudnn_graph
from scoremod.lowering.cudnn import masks
from scoremod.lowering.cudnn.plan import Part, Plan
from scoremod.lowering.problem import Problem
from tests.test_cudnn_rules import NODE_OF_INPUTS, REFUSED

pytestmark = pytest.mark.gpu


def _inputs(b, sq, skv, hq, hkv, d, dtype, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(ks[0], (b, sq, hq, d), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, skv, hkv, d), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, skv, hkv, d), jnp.float32).astype(dtype)
    do = jax.random.normal(ks[3], (b, sq, hq, d), jnp.float32).astype(dtype)
    return q, k, v, do


def _run(impl, mod, q, k, v, do, scale=None, options=None):
    def f(q, k, v):
        o, lse = scoremod.attention(q, k, v, mod, scale=scale, implementation=impl, return_lse=True,
                                    options=options)
        return o, jax.lax.stop_gradient(lse)  # the fused path does not differentiate the LSE

    (o, lse), vjp = jax.vjp(f, q, k, v)
    dq, dk, dv = vjp((do, jnp.zeros_like(lse)))
    return o, lse, dq, dk, dv


def _rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    both_inf = np.isneginf(a) & np.isneginf(b)
    a, b = np.where(both_inf, 0, a), np.where(both_inf, 0, b)
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-6))


TOL = {jnp.bfloat16: 3e-2, jnp.float16: 1e-2}


def check(mod, dtype=jnp.bfloat16, b=2, sq=128, skv=192, hq=4, hkv=2, d=64, scale=None, seed=0,
          options=None):
    q, k, v, do = _inputs(b, sq, skv, hq, hkv, d, dtype, seed)
    got = jax.jit(lambda *a: _run("cudnn", mod, *a, scale=scale, options=options))(q, k, v, do)
    want = jax.jit(lambda *a: _run("xla", mod, *a, scale=scale))(q, k, v, do)
    errs = {n: _rel_err(g, w) for n, g, w in zip(("O", "LSE", "dQ", "dK", "dV"), got, want)}
    for name, err in errs.items():
        assert np.isfinite(err) and err < TOL[dtype], f"{name} off by {err:.3g} (all: {errs})"
    return errs


S = jnp.float32

# Key blocks of 64 each query block of 64 sees (2 x 4 heads x 2 query blocks x 2 of 3
# key blocks), as top-k block masks store them.
_TOPK_BLOCKS = jnp.asarray(np.random.default_rng(0).permutation(3)[None, None, None, :2]
                           * np.ones((2, 4, 2, 1), np.int32), jnp.int32)

# One mod per op of the table the fused path runs (the score kept in range).
OP_MODS = {
    "add": lambda s, b, h, q, k: s + 0.5,
    "sub": lambda s, b, h, q, k: 0.5 - s,
    "mul": lambda s, b, h, q, k: s * 1.5,
    "div": lambda s, b, h, q, k: s / 1.7,
    "div_by_score": lambda s, b, h, q, k: 1.0 / (s * s + 1.0),
    "neg": lambda s, b, h, q, k: -s,
    "abs": lambda s, b, h, q, k: jnp.abs(s),
    "exp": lambda s, b, h, q, k: jnp.exp(jnp.tanh(s)),
    "exp2": lambda s, b, h, q, k: jnp.exp2(jnp.tanh(s)),
    "log": lambda s, b, h, q, k: jnp.log(s * s + 1.0),
    "log1p": lambda s, b, h, q, k: jnp.log1p(jnp.abs(s)),
    "expm1": lambda s, b, h, q, k: jnp.expm1(jnp.tanh(s)),
    "tanh": lambda s, b, h, q, k: 5.0 * jnp.tanh(s / 5.0),
    "sigmoid": lambda s, b, h, q, k: 4.0 * jax.nn.sigmoid(s),
    "sqrt": lambda s, b, h, q, k: jnp.sqrt(s * s + 1.0),
    "rsqrt": lambda s, b, h, q, k: 2.0 * jax.lax.rsqrt(s * s + 1.0),
    "reciprocal": lambda s, b, h, q, k: jnp.reciprocal(s * s + 2.0) * 3.0,
    "sin": lambda s, b, h, q, k: jnp.sin(s),
    "cos": lambda s, b, h, q, k: jnp.cos(s),
    "erf": lambda s, b, h, q, k: 2.0 * jax.lax.erf(s),
    "tan": lambda s, b, h, q, k: jnp.tan(jnp.tanh(s)),
    "log2": lambda s, b, h, q, k: jnp.log2(s * s + 1.0),
    "floor": lambda s, b, h, q, k: s + jnp.floor(s),
    "ceil": lambda s, b, h, q, k: s - jnp.ceil(s),
    "integer_pow": lambda s, b, h, q, k: 0.1 * s**3 - 0.2 * s**2,
    "integer_pow_neg": lambda s, b, h, q, k: (s * s + 1.0) ** -2,
    "pow": lambda s, b, h, q, k: jnp.power(s * s + 1.0, 0.75),
    "max": lambda s, b, h, q, k: jnp.maximum(s, -0.5),
    "min": lambda s, b, h, q, k: jnp.minimum(s, 0.5),
    "clip": lambda s, b, h, q, k: jnp.clip(s, -1.0, 1.0) * 2.0,
    "relu": lambda s, b, h, q, k: jax.nn.relu(s) * 2.0,
    "softplus": lambda s, b, h, q, k: jax.nn.softplus(s),
    "gelu": lambda s, b, h, q, k: jax.nn.gelu(s),
    "score_twice": lambda s, b, h, q, k: s * jnp.tanh(s),
    "lt_le_gt_ge": lambda s, b, h, q, k: jnp.where((q < k + 8) & (q <= k + 16) & (q > k - 64) & (q >= k - 72), s, -jnp.inf),
    "eq_ne": lambda s, b, h, q, k: jnp.where((h == 1) | (q != k), s, -jnp.inf),
    "and_or_not": lambda s, b, h, q, k: jnp.where(~((q < 4) & (k > 100)) | (b == 0), s, -jnp.inf),
    "where": lambda s, b, h, q, k: jnp.where(q >= k, s, 0.5 * s),
    "f32": lambda s, b, h, q, k: s + 0.01 * (q - k),
    "floordiv": lambda s, b, h, q, k: jnp.where(q // 32 == k // 32, s, -jnp.inf),
    "mod": lambda s, b, h, q, k: jnp.where((k % 4) == (q % 4), s, -jnp.inf),
    "mod_signed": lambda s, b, h, q, k: jnp.where((q - k) % 4 == 0, s, -jnp.inf),
    "load": lambda s, b, h, q, k: s + jnp.asarray([0.5, -0.5, 1.0, 0.0])[h] * 1.0,
    "identity": lambda s, b, h, q, k: s,
    "constant": lambda s, b, h, q, k: 0.01 * (k - q) * 1.0,
    "erfc": lambda s, b, h, q, k: 2.0 * jax.scipy.special.erfc(s),
    "gelu_exact": lambda s, b, h, q, k: jax.nn.gelu(s, approximate=False),
    # integer bit operations: computed ahead by XLA (materialized), never in the graph
    "bitwise": lambda s, b, h, q, k: jnp.where(((q ^ k) & 7) != 3, s, -jnp.inf),
    "invert_or": lambda s, b, h, q, k: jnp.where(((~q) & 3) == ((k | 4) & 3), s, -jnp.inf),
    "shifts": lambda s, b, h, q, k: s + 0.01 * (((q << 1) >> 2) - jax.lax.shift_right_logical(
        k, 2)).astype(jnp.float32),
    # a reduction over a captured array's static axis (unrolled), a top-k block mask
    "block_any": lambda s, b, h, q, k: jnp.where(
        (_TOPK_BLOCKS[b, h, q // 64, :] == k // 64).any(), s, -jnp.inf),
}


# Ops no jax.numpy function traces to, written in the text form.
TEXT_MODS = {
    # the split's index shift (every block's q_idx or kv_idx), here outside a split
    "offset": "score + 0.01 * f32(kv_idx - offset(q_idx, 37))",
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("name", sorted(OP_MODS))
def test_each_op(name, dtype):
    check(scoremod.trace(OP_MODS[name]), dtype=dtype)


@pytest.mark.parametrize("name", sorted(NODE_OF_INPUTS))
def test_values_of_input_tensors_alone_run_as_one_tensor(name):
    """cuDNN found no engine for a graph node reading only input tensors and
    scalars (sandwich's rel[q - k] * ratio[h], shifts' computed value * 0.01);
    the lowering computes such a value ahead as one tensor (rule 4)."""
    check(scoremod.trace(NODE_OF_INPUTS[name][0]))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("name", sorted(TEXT_MODS))
def test_each_op_in_text(name, dtype):
    mod = scoremod.parse(TEXT_MODS[name])
    assert name in {n.op for n in scoremod.dsl.ir.toposort(mod.expr)}
    check(mod, dtype=dtype)


def test_op_table_is_covered():
    """Every op is either exercised above or refused with a clear error."""
    seen = set()
    for mod in [*map(scoremod.trace, OP_MODS.values()), *map(scoremod.parse, TEXT_MODS.values())]:
        from scoremod.lowering.cudnn.rules import forward_and_backward

        fwd, bwd = forward_and_backward(mod.expr)
        seen |= {n.op for n in scoremod.dsl.ir.toposort(mod.expr, fwd, bwd)}
    refused = {"trunc_div", "rem", "sign", "i32", "bool", "atan"}
    missing = set(scoremod.OPS) - seen - refused
    assert not missing, f"no GPU test for {sorted(missing)}"


@pytest.mark.parametrize("fn, op", REFUSED)
def test_refused_ops_name_the_op_and_line(fn, op):
    q, k, v, _ = _inputs(1, 64, 64, 2, 2, 64, jnp.bfloat16)
    with pytest.raises(CudnnUnavailableError, match=rf"`{op}`.*test_cudnn_rules.py:\d+"):
        scoremod.attention(q, k, v, fn, implementation="cudnn")
    out = scoremod.attention(q, k, v, fn)  # None picks another path
    assert out.shape == q.shape


SLOPES = jnp.asarray([2.0 ** (-8 * (i + 1) / 4) for i in range(4)], jnp.float32)


def realistic_mods(b, sq, skv, hq):
    rng = np.random.default_rng(0)
    docs = jnp.asarray(np.sort(rng.integers(0, 3, (b, max(sq, skv))), axis=1), jnp.int32)
    bias = jnp.asarray(rng.normal(0, 1, (hq, sq, skv)), jnp.float32)
    slopes = jnp.asarray([2.0 ** (-8 * (i + 1) / hq) for i in range(hq)], jnp.float32)
    temp = jnp.float32(0.7)
    table = jnp.asarray(rng.normal(0, 1, (2 * max(sq, skv) + 1,)), jnp.float32)
    off = max(sq, skv)
    return {
        "softcap": lambda s, b, h, q, k: 30.0 * jnp.tanh(s / 30.0),
        "softcap_causal": lambda s, b, h, q, k: jnp.where(q >= k, 30.0 * jnp.tanh(s / 30.0), -jnp.inf),
        "alibi": lambda s, b, h, q, k: s + slopes[h] * (k - q),
        "alibi_causal": lambda s, b, h, q, k: jnp.where(q >= k, s + slopes[h] * (k - q), -jnp.inf),
        "sliding_window": lambda s, b, h, q, k: jnp.where((q >= k) & (q - k < 32), s, -jnp.inf),
        "document": lambda s, b, h, q, k: jnp.where(docs[b, q] == docs[b, k], s, -jnp.inf),
        "prefix_lm": lambda s, b, h, q, k: jnp.where((k < 16) | (q >= k), s, -jnp.inf),
        "relative_bias_tensor": lambda s, b, h, q, k: s + bias[h, q, k],
        "learnable_scalar": lambda s, b, h, q, k: s * temp,
        "t5_bucket_table": lambda s, b, h, q, k: s + table[q - k + off],
        "softcap_alibi_causal": lambda s, b, h, q, k: jnp.where(q >= k, 20.0 * jnp.tanh(s / 20.0) + slopes[h] * (k - q), -jnp.inf),
    }


CONFIGS = [
    dict(dtype=jnp.bfloat16, d=64, sq=128, skv=192, hq=4, hkv=2),
    dict(dtype=jnp.bfloat16, d=128, sq=256, skv=128, hq=4, hkv=1),
    dict(dtype=jnp.float16, d=64, sq=192, skv=192, hq=4, hkv=4),
    dict(dtype=jnp.float16, d=128, sq=128, skv=320, hq=4, hkv=2),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c['dtype'].__name__}-d{c['d']}-q{c['sq']}kv{c['skv']}-h{c['hq']}/{c['hkv']}")
@pytest.mark.parametrize("name", sorted(realistic_mods(2, 8, 8, 4)))
def test_realistic(name, cfg):
    mods = realistic_mods(2, cfg["sq"], cfg["skv"], cfg["hq"])
    check(scoremod.trace(mods[name]), **cfg)


def test_dangling_branch_regression():
    """Mods whose derivative needs factors (sigmoid, tanh): the probes saw cuDNN
    accept a score_mod holding such a factor and return dV 50-100x off. The
    lowering must keep score_mod to the primal; dV is the witness."""
    for fn in (lambda s, b, h, q, k: 4.0 * jax.nn.sigmoid(s), lambda s, b, h, q, k: 20.0 * jnp.tanh(s / 20.0),
               lambda s, b, h, q, k: jax.nn.softplus(s)):
        errs = check(scoremod.trace(fn), seed=3)
        assert errs["dV"] < 3e-2


def test_fully_masked_rows_agree_with_reference():
    mod = scoremod.trace(lambda s, b, h, q, k: jnp.where((q >= 16) & (q >= k), s, -jnp.inf))
    q, k, v, do = _inputs(1, 64, 64, 2, 2, 64, jnp.bfloat16)
    o, lse, dq, dk, dv = jax.jit(lambda *a: _run("cudnn", mod, *a))(q, k, v, do)
    assert np.all(np.asarray(o[:, :16], np.float32) == 0)
    assert np.all(np.isneginf(np.asarray(lse[:, :, :16])))
    for g in (dq, dk, dv):
        assert np.all(np.isfinite(np.asarray(g, np.float32)))
    check(mod, b=1, sq=64, skv=64, hq=2, hkv=2)


def test_graph_cache_counts_builds_and_operands_change_without_rebuild():
    cudnn_graph.cache_clear()
    q, k, v, _ = _inputs(1, 128, 128, 4, 4, 64, jnp.bfloat16)
    f = jax.jit(lambda q, m: scoremod.attention(q, k, v, m, implementation="cudnn"))
    m1 = scoremod.trace(lambda s, b, h, qi, ki: s + SLOPES[h] * (ki - qi))
    a = f(q, m1)
    assert cudnn_graph.cache_info()["builds"] == 1
    m2 = m1.bind(c0=SLOPES * 2)
    b_ = f(q, m2)
    assert cudnn_graph.cache_info()["builds"] == 1  # new values, same graph
    assert not np.allclose(np.asarray(a, np.float32), np.asarray(b_, np.float32))
    other = scoremod.trace(lambda s, b, h, qi, ki: s - SLOPES[h] * (ki - qi))
    f(q, other)
    assert cudnn_graph.cache_info()["builds"] == 2  # a different mod never shares a graph


def test_grad_value_and_grad_and_remat():
    mod = scoremod.trace(lambda s, b, h, q, k: jnp.where(q >= k, 30.0 * jnp.tanh(s / 30.0), -jnp.inf))
    q, k, v, _ = _inputs(2, 128, 128, 4, 2, 64, jnp.bfloat16)

    def loss(q, k, v, impl):
        o = scoremod.attention(q, k, v, mod, implementation=impl)
        return jnp.sum(o.astype(jnp.float32) ** 2)

    g_ref = jax.grad(loss, (0, 1, 2))(q, k, v, "xla")
    for fn in (jax.jit(jax.grad(loss, (0, 1, 2)), static_argnums=3),
               jax.jit(lambda *a: jax.value_and_grad(loss, (0, 1, 2))(*a)[1], static_argnums=3),
               jax.jit(jax.grad(jax.checkpoint(loss, static_argnums=(3,)), (0, 1, 2)), static_argnums=3)):
        for a, b in zip(fn(q, k, v, "cudnn"), g_ref):
            assert _rel_err(a, b) < 3e-2


def test_operand_gradients_are_refused_explicitly_and_fall_back_automatically():
    q, k, v, _ = _inputs(1, 64, 64, 4, 4, 64, jnp.bfloat16)

    def loss(slopes, impl):
        mod = scoremod.trace(lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi))
        return jnp.sum(scoremod.attention(q, k, v, mod, implementation=impl).astype(jnp.float32))

    with pytest.raises(scoremod.ScoreModError, match="operands"):
        jax.grad(loss)(SLOPES, "cudnn")
    # implementation=None: the slopes' gradient from the next backend that computes
    # operand gradients (the Pallas kernels' backward), jitted or not.
    for run in (jax.grad(loss), jax.jit(jax.grad(loss), static_argnums=1)):
        with pytest.warns(UserWarning, match="Pallas"):
            g = run(SLOPES, None)
        want = jax.grad(loss)(SLOPES, "xla")
        assert _rel_err(g, want) < 5e-2, _rel_err(g, want)


def test_lse_gradient_is_refused_not_wrong():
    q, k, v, _ = _inputs(1, 64, 64, 2, 2, 64, jnp.bfloat16)

    def loss(q):
        o, lse = scoremod.attention(q, k, v, implementation="cudnn", return_lse=True)
        return jnp.sum(lse)

    with pytest.raises(scoremod.ScoreModError, match="LSE"):
        jax.grad(loss)(q)


def test_plain_attention_without_mod():
    q, k, v, do = _inputs(2, 128, 128, 4, 2, 128, jnp.bfloat16)
    got = _run("cudnn", None, q, k, v, do)
    want = _run("xla", None, q, k, v, do)
    for a, b in zip(got, want):
        assert _rel_err(a, b) < 3e-2


def test_bad_inputs_for_the_fused_path():
    q, k, v, _ = _inputs(1, 64, 64, 2, 2, 64, jnp.float32)
    with pytest.raises(CudnnUnavailableError, match="float16 or bfloat16"):
        scoremod.attention(q, k, v, implementation="cudnn")
    q, k, v, _ = _inputs(1, 64, 64, 2, 2, 60, jnp.bfloat16)
    with pytest.raises(CudnnUnavailableError, match="multiples of 8"):
        scoremod.attention(q, k, v, implementation="cudnn")


# --- native masks and the key padding of the last tile --------------------------

NATIVE = {
    "causal": lambda s, b, h, q, k: jnp.where(q >= k, s, -jnp.inf),
    "window": lambda s, b, h, q, k: jnp.where((q >= k) & (q - k < 48), s, -jnp.inf),
    "bottom_right_causal": lambda s, b, h, q, k: jnp.where(k <= q + 64, s, -jnp.inf),
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("name", sorted(NATIVE))
def test_pure_masks_run_on_the_native_mask(name, dtype):
    native = LoweringOptions(native_masks=True)
    sq, skv = 192, 256  # bottom_right_causal's offset is skv - sq
    mod = scoremod.trace(NATIVE[name])
    part = Part(mod, Problem(2, sq, skv, 4, 2, 64, 64, np.dtype(dtype).name), 0.125, native)
    assert isinstance(part.band, masks.Band) and part.fwd is None
    check(mod, dtype=dtype, sq=sq, skv=skv, options=native)
    check(mod, dtype=dtype, sq=256, skv=256, d=128, options=native)  # native at Sq == Skv too


KV_RAMP = jnp.asarray(0.25 * np.arange(320), jnp.float32)
GROWING = {  # scores that grow along kv_idx (or q_idx): the padding of the last tile overflows
    "kv_ramp": lambda s, b, h, q, k: s + 0.25 * k,
    "alibi": lambda s, b, h, q, k: s + SLOPES[h] * (k - q),
    "kv_vector_load": lambda s, b, h, q, k: s + KV_RAMP[k],
    "q_ramp": lambda s, b, h, q, k: s + 0.25 * q,
}


@pytest.mark.parametrize("sq,skv", [(192, 192), (128, 320), (256, 256)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("name", sorted(GROWING))
def test_scores_growing_into_the_padding_of_the_last_tile(name, dtype, sq, skv):
    check(scoremod.trace(GROWING[name]), dtype=dtype, sq=sq, skv=skv, hq=4, hkv=4)


# --- band-masked mods split into query blocks ----------------------------------

DOC_IDS = jnp.asarray(np.sort(np.random.default_rng(1).integers(0, 4, (2, 512)), axis=1), jnp.int32)
SPLIT = {
    "document": lambda s, b, h, q, k: jnp.where((DOC_IDS[b, q] == DOC_IDS[b, k]) & (q >= k), s, -jnp.inf),
    "softcap_causal": lambda s, b, h, q, k: jnp.where(q >= k, 30.0 * jnp.tanh(s / 30.0), -jnp.inf),
    "alibi_causal": lambda s, b, h, q, k: jnp.where(q >= k, s + SLOPES[h] * (k - q), -jnp.inf),
    "softcap_window": lambda s, b, h, q, k: jnp.where((q >= k) & (q - k < 200), 20.0 * jnp.tanh(s / 20.0), -jnp.inf),
    # static masks that are no band: split by their tiles (split.static_tiles)
    "softcap_prefix_lm": lambda s, b, h, q, k: jnp.where((k < 64) | (q >= k), 30.0 * jnp.tanh(s / 30.0), -jnp.inf),
    "global_window": lambda s, b, h, q, k: jnp.where(((q >= k) & (q - k < 150)) | (k < 32), s * 0.8, -jnp.inf),
    # pure prefix-LM: a prefix on a tile edge as two key blocks (split.by_keys: every
    # row against the prefix as plain attention, the rest a square causal block, joined
    # by their LSEs); off it, two query blocks (split.by_structure), the prefix's as
    # plain attention, the rest under the native causal mask (split.narrowed); with the
    # prefix inside the first tile row, that block keeps the score_mod
    "prefix_lm": lambda s, b, h, q, k: jnp.where((k < 128) | (q >= k), s, -jnp.inf),
    "prefix_lm_256": lambda s, b, h, q, k: jnp.where((k < 256) | (q >= k), s, -jnp.inf),
    "prefix_lm_straddling": lambda s, b, h, q, k: jnp.where((k < 64) | (q >= k), s, -jnp.inf),
}
# (blocks, of them native) where not (4, 0)
BLOCKS = {"prefix_lm": (2, 2), "prefix_lm_256": (2, 2), "prefix_lm_straddling": (2, 1)}
KEY_SPLIT = ("prefix_lm", "prefix_lm_256", "prefix_lm_straddling")  # their backward


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("name", sorted(SPLIT))
def test_split_into_query_blocks_matches_reference(name, dtype):
    four = LoweringOptions(split_blocks=4, sms=1)  # sms=1: split these small shapes too
    mod = scoremod.trace(SPLIT[name])
    plan = Plan(mod, Problem(2, 512, 512, 4, 2, 64, 64, np.dtype(dtype).name), 0.125, four)
    assert (len(plan.blocks), sum(p.fwd is None for p in plan.parts)) == BLOCKS.get(name, (4, 0))
    assert plan.backward_plan.key_split == (name in KEY_SPLIT)
    check(mod, dtype=dtype, sq=512, skv=512, hq=4, hkv=2, options=four)


@pytest.mark.parametrize("sq,skv", [(1000, 1000), (384, 640)])
def test_split_into_eight_uneven_blocks_matches_reference(sq, skv):
    """Eight blocks, a last block shorter than a tile, Skv off the tile, and
    bottom-right alignment (Sq < Skv): every block's byte offsets and in-place rows."""
    eight = LoweringOptions(split_blocks=8, sms=1)
    off = skv - sq
    mod = scoremod.trace(lambda s, b, h, q, k: jnp.where(q + off >= k, 30.0 * jnp.tanh(s / 30.0),
                                                         -jnp.inf))
    plan = Plan(mod, Problem(2, sq, skv, 4, 2, 64, 64, "bfloat16"), 0.125, eight)
    assert plan.split and len(plan.blocks) >= 3
    check(mod, sq=sq, skv=skv, hq=4, hkv=2, options=eight)


# --- a constant factor of the score folded into attn_scale ------------------------

FOLD = {
    "softcap": lambda s, b, h, q, k: 30.0 * jnp.tanh(s / 30.0),
    "softcap_causal": lambda s, b, h, q, k: jnp.where(q >= k, 5.0 * jnp.tanh(s / 5.0), -jnp.inf),
    "two_uses": lambda s, b, h, q, k: s * 0.5 + jnp.tanh(s * 0.5),
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("name", sorted(FOLD))
def test_scale_folding_matches_reference(name, dtype):
    fold = LoweringOptions(fold_scale=True)
    mod = scoremod.trace(FOLD[name])
    part = Part(mod, Problem(2, 128, 192, 4, 2, 64, 64, np.dtype(dtype).name), 0.125, fold)
    assert part.spec.scale != 0.125  # folded
    check(mod, dtype=dtype, options=fold)
    check(mod, dtype=dtype, scale=0.3, options=fold)


# --- the same mods with the three lowerings above switched off ---------------------

OFF = {**{f"native_{n}": (f, dict(sq=192, skv=256)) for n, f in NATIVE.items()},
       **{f"split_{n}": (f, dict(sq=512, skv=512)) for n, f in SPLIT.items()},
       **{f"fold_{n}": (f, {}) for n, f in FOLD.items()}}


@pytest.mark.parametrize("name", sorted(OFF))
def test_native_split_and_folding_switched_off_match_reference(name):
    """The plain score_mod lowering (LoweringOptions.plain(): no native mask, no
    split, no folding) stays correct: it is the escape hatch and the benchmarks' baseline."""
    plain = LoweringOptions.plain().replace(sms=1)
    fn, sizes = OFF[name]
    mod = scoremod.trace(fn)
    sq, skv = sizes.get("sq", 128), sizes.get("skv", 192)
    plan = Plan(mod, Problem(2, sq, skv, 4, 2, 64, 64, "bfloat16"), 0.125, plain)
    assert not plan.split and plan.parts[0].band is None and plan.parts[0].spec.scale == 0.125
    check(mod, **sizes, options=plain)
