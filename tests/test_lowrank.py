"""Low-rank additive biases folded into the head dim (scoremod.lowering.lowrank), on the CPU.

The reference path runs the augmented problem whenever the bias is found, so
these compare it with the same call under ``low_rank_bias=False``: values,
LSE and the gradients of q, k, v and both factors of the bias.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from scoremod.dsl import ir
from scoremod.dsl.ops import apply
from scoremod.lowering import lowrank
from scoremod.lowering.problem import Problem

B, S, HQ, D, R = 2, 24, 4, 16, 8
_rng = np.random.default_rng(7)


def _arr(*shape):
    return jnp.asarray(_rng.normal(size=shape), jnp.float32)


QPE, KPE = _arr(B, S, HQ, R), _arr(B, S, R)  # MLA: k_pe shared by the heads
A_BH, C_BH = _arr(B, HQ, S, R), _arr(B, HQ, S, R)
A_S, C_S = _arr(S, R), _arr(S, R)  # broadcast over batch and heads
A_HS = _arr(HQ, S, R)  # per head, broadcast over batch


def _mods(a, c):
    """Mods with a low-rank bias, as functions of its factors (a, c): name -> (fn, which)."""
    return {
        "mla_causal": lambda s, b, h, q, k: jnp.where(
            q >= k, s + jnp.dot(a[b, q, h], c[b, k]), -jnp.inf),
        "softcap_of_sum": lambda s, b, h, q, k: 20.0 * jnp.tanh(
            (s + (a[b, q, h] * c[b, k]).sum(-1)) / 20.0),
        "einsum_then_alibi": lambda s, b, h, q, k: s + jnp.einsum(
            "r,r->", a[b, q, h], c[b, k]) + 0.1 * (k - q),
        # constant factors of the sum and of single products (MLA's own scale)
        "scaled_dot": lambda s, b, h, q, k: jnp.where(
            q >= k, s + 0.5 * jnp.dot(a[b, q, h], c[b, k]), -jnp.inf),
        "scaled_terms": lambda s, b, h, q, k: s + sum(
            (j + 1.0) * a[b, q, h, j] * c[b, k, j] for j in range(R)),
    }


CASES = {  # name: (mod factory, a, c, hkv)
    "mla_causal": ("mla_causal", QPE, KPE, HQ),
    "softcap_of_sum": ("softcap_of_sum", QPE, KPE, HQ),
    "einsum_then_alibi": ("einsum_then_alibi", QPE, KPE, HQ),
    "gqa_keys_shared_by_heads": ("mla_causal", QPE, KPE, 2),
    "scaled_dot": ("scaled_dot", QPE, KPE, HQ),
    "scaled_terms": ("scaled_terms", QPE, KPE, HQ),
}


def _other_layouts():
    return {
        "per_bh": lambda a, c: lambda s, b, h, q, k: s + jnp.dot(a[b, h, q], c[b, h, k]),
        "broadcast_s_r": lambda a, c: lambda s, b, h, q, k: jnp.where(
            q >= k, s + jnp.dot(a[q], c[k]), -jnp.inf),
        "query_per_head": lambda a, c: lambda s, b, h, q, k: s + jnp.dot(a[h, q], c[k]),
    }


LAYOUT_ARRAYS = {"per_bh": (A_BH, C_BH), "broadcast_s_r": (A_S, C_S),
                 "query_per_head": (A_HS, C_S)}


def _qkv(hkv, dtype=jnp.float32):
    """q, k, v drawn from their own seed: the same whichever tests ran before
    (under pytest-xdist the order varies)."""
    rng = np.random.default_rng(11)
    return tuple(jnp.asarray(rng.normal(size=(B, S, h, D)), jnp.float32).astype(dtype)
                 for h in (HQ, hkv, hkv))


def _attend(make, q, k, v, a, c, options, scale=None):
    mod = scoremod.trace(make(a, c))
    return scoremod.attention(q, k, v, mod, implementation="xla", return_lse=True,
                              options=options, scale=scale)


ON = scoremod.LoweringOptions()
OFF = scoremod.LoweringOptions(low_rank_bias=False)


def _compare(make, a, c, hkv, scale=None):
    q, k, v = _qkv(hkv)
    weights = jnp.cos(jnp.arange(D, dtype=jnp.float32))

    def loss(options):
        def f(q, k, v, a, c):
            o, lse = _attend(make, q, k, v, a, c, options, scale)
            return jnp.sum(o * weights) + 0.1 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
        return f

    (o1, l1), (o2, l2) = (_attend(make, q, k, v, a, c, opt, scale) for opt in (ON, OFF))
    np.testing.assert_allclose(np.asarray(o1), np.asarray(o2), rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(l1), np.asarray(l2), rtol=1e-5, atol=2e-6)
    g1 = jax.grad(loss(ON), argnums=range(5))(q, k, v, a, c)
    g2 = jax.grad(loss(OFF), argnums=range(5))(q, k, v, a, c)
    for name, x, y in zip("q k v a c".split(), g1, g2):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5,
                                   err_msg=f"d{name}")
        assert float(jnp.abs(y).max()) > 0, f"d{name} is zero: the test would not see a change"


@pytest.mark.parametrize("name", sorted(CASES))
def test_augmented_reference_equals_the_mod_as_written(name):
    kind, a, c, hkv = CASES[name]
    make = lambda a, c: _mods(a, c)[kind]  # noqa: E731
    q, k, v = _qkv(hkv)
    problem = Problem.of(q, k, v)
    found = lowrank.find(scoremod.trace(make(a, c)), problem, 0.25)
    assert isinstance(found, lowrank.LowRank) and found.rank == R
    _compare(make, a, c, hkv)


@pytest.mark.parametrize("name", sorted(LAYOUT_ARRAYS))
def test_factors_broadcast_over_batch_and_heads(name):
    a, c = LAYOUT_ARRAYS[name]
    make = _other_layouts()[name]
    q, k, v = _qkv(HQ)
    assert isinstance(lowrank.find(scoremod.trace(make(a, c)), Problem.of(q, k, v), 0.25),
                      lowrank.LowRank)
    _compare(make, a, c, HQ, scale=0.3)


def test_the_augmented_call_is_what_the_backends_see():
    f = _mods(QPE, KPE)["mla_causal"]
    q, k, v = _qkv(HQ, jnp.bfloat16)
    choice = scoremod.which_implementation(q, k, v, f)
    assert "rank 8" in choice.low_rank_bias and f"head dim {D} becomes {D + R}" in choice.low_rank_bias
    assert "where(q_idx >= kv_idx, score, -inf)" in choice.low_rank_bias
    with scoremod.lowering_options(low_rank_bias=False):
        assert scoremod.which_implementation(q, k, v, f).low_rank_bias is None
    plain = scoremod.which_implementation(q, k, v, lambda s, b, h, qi, ki: s)
    assert plain.low_rank_bias is None


def test_rank_not_a_multiple_of_8_is_padded_with_zero_columns():
    a, c = _arr(S, 5), _arr(S, 5)
    make = lambda a, c: lambda s, b, h, q, k: s + jnp.dot(a[q], c[k])  # noqa: E731
    q, k, v = _qkv(HQ)
    found = lowrank.find(scoremod.trace(make(a, c)), Problem.of(q, k, v), 0.25)
    assert found.rank == 5 and found.pad == 3 and (D + 5 + 3) % 8 == 0
    _compare(make, a, c, HQ)


def _find(fn, d=D, hkv=HQ, scale=0.25):
    return lowrank.find(scoremod.trace(fn), Problem(B, S, S, HQ, hkv, d, d, "bfloat16"), scale)


NOT_LOW_RANK = {  # recognized as no low-rank bias at all
    "bias_not_added": lambda s, b, h, q, k: s * jnp.dot(QPE[b, q, h], KPE[b, k]),
    "score_used_twice": lambda s, b, h, q, k: s + jnp.dot(QPE[b, q, h], KPE[b, k]) + 0.1 * s,
    "score_under_tanh_first": lambda s, b, h, q, k: jnp.tanh(s) + jnp.dot(QPE[b, q, h], KPE[b, k]),
    "both_factors_on_queries": lambda s, b, h, q, k: s + jnp.dot(QPE[b, q, h], QPE[b, q, 0]),
    "a_term_is_not_a_product": lambda s, b, h, q, k: s + (jnp.dot(QPE[b, q, h], KPE[b, k])
                                                          + 0.5 * (k - q)),
    "computed_index": lambda s, b, h, q, k: s + jnp.dot(A_S[q // 2], C_S[k]),
    "no_bias": lambda s, b, h, q, k: jnp.where(q >= k, s, -jnp.inf),
}


@pytest.mark.parametrize("name", sorted(NOT_LOW_RANK))
def test_what_is_not_a_low_rank_bias(name):
    assert _find(NOT_LOW_RANK[name]) is None


def test_a_bias_used_twice_stays_in_the_mod():
    def f(s, b, h, q, k):
        bias = jnp.dot(QPE[b, q, h], KPE[b, k])
        return s + bias + 0.1 * jnp.tanh(bias)

    found = _find(f)
    assert isinstance(found, lowrank.NotFolded) and "also used" in found.reason


def test_a_head_dim_past_cudnns_limit_keeps_the_bias_in_the_mod():
    f = _mods(QPE, KPE)["mla_causal"]
    assert isinstance(_find(f, d=248), lowrank.LowRank)  # 248 + 8 = 256
    found = _find(f, d=256)
    assert isinstance(found, lowrank.NotFolded) and "more than 256" in found.reason
    q = jnp.zeros((1, 8, HQ, 256), jnp.bfloat16)
    choice = scoremod.which_implementation(q, q, q, lambda s, b, h, qi, ki: s + jnp.dot(
        QPE[0, qi, h], KPE[0, ki]))
    assert "stays in the mod" in choice.low_rank_bias and "256" in choice.low_rank_bias


def test_rank_over_256_built_in_the_ir_is_not_folded():
    a = ir.operand("a", (S, 300), "float32")
    c = ir.operand("c", (S, 300), "float32")
    q_idx, kv_idx = ir.var("q_idx"), ir.var("kv_idx")
    bias = None
    for j in range(300):
        t = apply("load", a, q_idx, ir.const(j, "i32")) * apply("load", c, kv_idx, ir.const(j, "i32"))
        bias = t if bias is None else bias + t
    mod = scoremod.ScoreMod(ir.var("score") + bias, (np.zeros((S, 300), np.float32),) * 2)
    found = lowrank.find(mod, Problem(B, S, S, HQ, HQ, 64, 64, "bfloat16"), 0.125)
    assert isinstance(found, lowrank.NotFolded) and "rank 300" in found.reason


def test_keys_varying_per_query_head_in_gqa_are_not_folded():
    f = _other_layouts()["per_bh"](A_BH, C_BH)
    assert isinstance(_find(f, hkv=HQ), lowrank.LowRank)
    found = _find(f, hkv=2)
    assert isinstance(found, lowrank.NotFolded) and "grouped-query" in found.reason
    q, k, v = _qkv(2)
    o1, _ = _attend(_other_layouts()["per_bh"], q, k, v, A_BH, C_BH, ON)
    o2, _ = _attend(_other_layouts()["per_bh"], q, k, v, A_BH, C_BH, OFF)
    np.testing.assert_array_equal(np.asarray(o1), np.asarray(o2))  # not augmented: one path


def test_a_traced_scale_is_not_folded():
    f = _mods(QPE, KPE)["mla_causal"]
    found = _find(f, scale=jnp.float32(0.25))
    assert isinstance(found, lowrank.LowRank)  # a concrete array is a number
    seen = []
    jax.jit(lambda s: seen.append(_find(f, scale=s)) or s)(jnp.float32(0.25))
    assert isinstance(seen[0], lowrank.NotFolded) and "traced" in seen[0].reason


def test_the_text_form_of_a_sum_of_products_is_found_too():
    terms = " + ".join(f"a[q_idx, {j}] * c[kv_idx, {j}]" for j in range(4))
    mod = scoremod.parse(f"where(q_idx >= kv_idx, score + ({terms}), -inf)",
                         a=np.ones((S, 4), np.float32), c=np.ones((S, 4), np.float32))
    found = lowrank.find(mod, Problem(B, S, S, HQ, HQ, D, D, "float32"), 0.25)
    assert found.rank == 4 and str(found.mod) == "where(q_idx >= kv_idx, score, -inf)"


def _case(name):
    """(make, a, c, hkv) of a CASES or LAYOUT_ARRAYS entry."""
    if name in LAYOUT_ARRAYS:
        return (_other_layouts()[name], *LAYOUT_ARRAYS[name], HQ)
    kind, a, c, hkv = CASES[name]
    return (lambda a, c: _mods(a, c)[kind]), a, c, hkv


def _augmented(make, a, c, hkv):
    """augment, jitted, and its arguments (q, k: zeros; the columns are the test)."""
    q, k = jnp.zeros((B, S, HQ, D)), jnp.zeros((B, S, hkv, D))
    mod = scoremod.trace(make(a, c))
    found = lowrank.find(mod, Problem.of(q, k, k), 0.25)
    operands = dict(zip(mod.operand_names, mod.operands))
    return jax.jit(lambda q, k, ops: lowrank.augment(found, q, k, ops, 0.25)), (q, k, operands)


@pytest.mark.parametrize("name", ["mla_causal", "gqa_keys_shared_by_heads"] + sorted(LAYOUT_ARRAYS))
def test_columns_read_by_slicing_equal_the_gathered_ones(name, monkeypatch):
    """Factors laid out as the grid (q_pe[b, q_idx, h, j]) are sliced, others
    gathered: the same columns either way, bit for bit."""
    make, a, c, hkv = _case(name)
    f, args = _augmented(make, a, c, hkv)
    sliced = f(*args)
    monkeypatch.setattr(lowrank, "_sliced", lambda *_: None)
    f, args = _augmented(make, a, c, hkv)
    for x, y in zip(sliced, f(*args)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name", ["mla_causal", "gqa_keys_shared_by_heads", "scaled_terms"]
                         + sorted(LAYOUT_ARRAYS))
def test_runs_of_columns_taken_as_one_slice_equal_column_by_column(name, monkeypatch):
    """Columns reading one operand at consecutive positions (q_pe[b, q_idx, h, 0..R-1])
    are one slice of it; column by column (runs of one) they are the same, bit
    for bit. ``scaled_terms`` (a constant per column) is not a run."""
    make, a, c, hkv = _case(name)
    f, args = _augmented(make, a, c, hkv)
    whole = f(*args)
    hlo = f.lower(*args).compile().as_text()
    slices = hlo.count(" slice(")
    assert slices <= (2 * R if name == "scaled_terms" else 4), slices
    monkeypatch.setattr(lowrank, "_runs", lambda loads: [(None, [x]) for x in loads])
    f, args = _augmented(make, a, c, hkv)
    for x, y in zip(whole, f(*args)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_runs_of_columns():
    """Runs: one operand, every index the same but one constant counting up."""
    a = ir.operand("a", (2, 8), "float32")
    c = ir.operand("c", (2, 8), "float32")
    qv = ir.var("q_idx")

    def load(op, *idx):
        return apply(ir.LOAD, op, *idx)

    def at(op, j, row=qv):
        return load(op, row, ir.const(j, ir.I32))

    loads = [at(a, 0), at(a, 1), at(a, 2), at(a, 4), at(c, 5), at(c, 6), at(a, 7, ir.const(1, ir.I32))]
    runs = lowrank._runs(loads)
    assert [(axis, len(r)) for axis, r in runs] == [(1, 3), (None, 1), (1, 2), (None, 1)]
    # A run stays on one axis: w[q, 0, 0], w[q, 0, 1] then w[q, 1, 1], w[q, 1, 2] are two
    # runs (one slice along the last axis would read w[q, 0, 2] for the third), and the
    # columns are the loads' values.
    w_values = jnp.arange(4 * 3 * 3, dtype=jnp.float32).reshape(4, 3, 3)
    w = ir.operand("w", (4, 3, 3), "float32")
    at3 = [load(w, qv, ir.const(i, ir.I32), ir.const(j, ir.I32))
           for i, j in ((0, 0), (0, 1), (1, 1), (1, 2))]
    assert [(axis, len(r)) for axis, r in lowrank._runs(at3)] == [(2, 2), (2, 2)]
    got = lowrank._columns(at3, {"w": w_values}, 1, 4, 1, "q_idx")
    want = np.stack([np.asarray(w_values)[:, i, j] for i, j in ((0, 0), (0, 1), (1, 1), (1, 2))],
                    axis=-1)
    np.testing.assert_array_equal(np.asarray(got)[0, :, 0], want)
    # A run past the operand's end reads clamped positions, as the reference does.
    past = [load(w, qv, ir.const(0, ir.I32), ir.const(j, ir.I32)) for j in (2, 3)]
    got = lowrank._columns(past, {"w": w_values}, 1, 4, 1, "q_idx")
    np.testing.assert_array_equal(np.asarray(got)[0, :, 0, 1], np.asarray(w_values)[:, 0, 2])


@pytest.mark.parametrize("name", ["mla_causal", "per_bh"])
def test_mla_factors_are_sliced_not_gathered(name):
    """MLA's q_pe[b, q_idx, h, :] and k_pe[b, kv_idx, :] (or q_pe[b, h, q_idx, :])
    become extra head-dim columns by slicing: a gather per column (64 at rank
    64) cost the H200 a tenth of the MLA forward."""
    if name == "per_bh":
        f, args = _augmented(_other_layouts()["per_bh"], A_BH, C_BH, HQ)
    else:
        f, args = _augmented(lambda a, c: _mods(a, c)["mla_causal"], QPE, KPE, HQ)
    hlo = f.lower(*args).compile().as_text()
    assert " gather(" not in hlo
