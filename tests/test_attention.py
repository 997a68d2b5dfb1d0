"""scoremod.attention(implementation="xla") against an independent naive version."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from scoremod import ScoreModError, ScoreModTypeError, device
from scoremod.lowering import registry
from scoremod.lowering.backend import Backend
from scoremod.lowering.pallas.backend import PALLAS
from scoremod.lowering.reference import REFERENCE
from tests.test_sharding import StandIn  # the stand-in fused backend

B, SQ, SKV, HQ, HKV, D = 2, 24, 40, 4, 2, 16
SLOPES = np.array([2.0 ** (-8 * (i + 1) / HQ) for i in range(HQ)], np.float32)
DOCS = np.array([[0] * 10 + [1] * 20 + [2] * 10, [0] * 5 + [1] * 35], np.int32)


def _idx(b, hq, sq, skv):
    return (np.arange(b)[:, None, None, None], np.arange(hq)[None, :, None, None],
            np.arange(sq)[None, None, :, None], np.arange(skv)[None, None, None, :])


# name -> (jnp mod, numpy float64 score function written independently)
CASES = {
    "identity": (None, lambda s, b, h, q, k: s),
    "softcap": (lambda s, b, h, q, k: 20.0 * jnp.tanh(s / 20.0), lambda s, b, h, q, k: 20 * np.tanh(s / 20)),
    "alibi": (
        lambda s, b, h, q, k: s + jnp.asarray(SLOPES)[h] * (k - q),
        lambda s, b, h, q, k: s + SLOPES[h].astype(np.float64) * (k - q),
    ),
    "causal": (
        lambda s, b, h, q, k: jnp.where(q >= k, s, -jnp.inf),
        lambda s, b, h, q, k: np.where(q >= k, s, -np.inf),
    ),
    "sliding_window": (
        lambda s, b, h, q, k: jnp.where((q >= k) & (q - k < 8), s, -jnp.inf),
        lambda s, b, h, q, k: np.where((q >= k) & (q - k < 8), s, -np.inf),
    ),
    "document": (
        lambda s, b, h, q, k: jnp.where(jnp.asarray(DOCS)[b, q] == jnp.asarray(DOCS)[b, k], s, -jnp.inf),
        lambda s, b, h, q, k: np.where(DOCS[b, np.minimum(q, SKV - 1)] == DOCS[b, k], s, -np.inf),
    ),
    "softcap_causal": (
        lambda s, b, h, q, k: jnp.where(q >= k, 20.0 * jnp.tanh(s / 20.0), -jnp.inf),
        lambda s, b, h, q, k: np.where(q >= k, 20 * np.tanh(s / 20), -np.inf),
    ),
    "prefix_lm": (
        lambda s, b, h, q, k: jnp.where((k < 6) | (q >= k), s, -jnp.inf),
        lambda s, b, h, q, k: np.where((k < 6) | (q >= k), s, -np.inf),
    ),
}


def naive(q, k, v, score_fn, scale):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    k = np.repeat(k, groups, axis=2)
    v = np.repeat(v, groups, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    s = np.broadcast_to(score_fn(s, *_idx(q.shape[0], q.shape[2], q.shape[1], k.shape[1])), s.shape)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    den = p.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", p / np.where(den == 0, 1, den), v)
    lse = np.where(den[..., 0] == 0, -np.inf, np.log(np.where(den == 0, 1, den))[..., 0] + m[..., 0])
    return out, lse


def _inputs(dtype, sq=SQ, skv=SKV, hq=HQ, hkv=HKV, seed=0):
    key = jax.random.PRNGKey(seed)
    ks = jax.random.split(key, 3)
    q = jax.random.normal(ks[0], (B, sq, hq, D), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (B, skv, hkv, D), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (B, skv, hkv, D), jnp.float32).astype(dtype)
    return q, k, v


TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 2e-3}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=lambda d: d.__name__)
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_naive(case, dtype):
    mod, ref = CASES[case]
    q, k, v = _inputs(dtype)
    scale = 0.3
    out, lse = scoremod.attention(q, k, v, mod, scale=scale, implementation="xla", return_lse=True)
    assert out.dtype == dtype and out.shape == q.shape and lse.shape == (B, HQ, SQ)
    want, want_lse = naive(q, k, v, ref, scale)
    np.testing.assert_allclose(np.asarray(out, np.float64), want, atol=TOL[dtype], rtol=TOL[dtype])
    np.testing.assert_allclose(np.asarray(lse, np.float64), want_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("sq, skv, hq, hkv", [(24, 40, 4, 2), (40, 24, 6, 3), (16, 16, 4, 1), (8, 8, 2, 2)])
def test_gqa_and_lengths(sq, skv, hq, hkv):
    q, k, v = _inputs(jnp.float32, sq, skv, hq, hkv, seed=3)
    mod = lambda s, b, h, qi, ki: jnp.where(qi >= ki, s + 0.1 * h, -jnp.inf)  # noqa: E731
    ref = lambda s, b, h, qi, ki: np.where(qi >= ki, s + 0.1 * h, -np.inf)  # noqa: E731
    out = scoremod.attention(q, k, v, mod, implementation="xla")
    want, _ = naive(q, k, v, ref, 1 / math.sqrt(D))
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-5)


def test_default_scale_and_plain_attention_match_jax():
    q, k, v = _inputs(jnp.float32)
    ours = scoremod.attention(q, k, v, implementation="xla")
    theirs = jax.nn.dot_product_attention(q, k, v, implementation="xla")
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), atol=1e-5)


def test_fully_masked_rows_give_zero_output_lse_minus_inf_and_zero_grads():
    q, k, v = _inputs(jnp.bfloat16)
    mod = scoremod.trace(lambda s, b, h, qi, ki: jnp.where((qi >= 10) & (qi >= ki), s, -jnp.inf))
    out, lse = scoremod.attention(q, k, v, mod, implementation="xla", return_lse=True)
    assert np.all(np.asarray(out[:, :10], np.float32) == 0)
    assert np.all(np.isneginf(np.asarray(lse[:, :, :10])))
    assert np.all(np.isfinite(np.asarray(lse[:, :, 10:])))

    def loss(q, k, v):
        return jnp.sum(scoremod.attention(q, k, v, mod, implementation="xla").astype(jnp.float32) ** 2)

    grads = jax.grad(loss, (0, 1, 2))(q, k, v)
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g, np.float32)))
    assert np.all(np.asarray(grads[0][:, :10], np.float32) == 0)


def _pretend_cudnn_is_here(monkeypatch):
    """The fused cuDNN path's checks pass (an H100, the extension and cuDNN
    loaded), though no kernel could run here."""
    import sys
    import types

    from scoremod import kernels_ffi

    monkeypatch.setattr(device, "current", lambda: device.Device("gpu", "pretend H100", 9, 132))
    monkeypatch.setattr(kernels_ffi, "available", lambda: True)
    monkeypatch.setattr(kernels_ffi, "frontend_mismatch", lambda: "")
    monkeypatch.setattr(kernels_ffi, "installed_frontend_version", lambda: 13200)
    monkeypatch.setitem(sys.modules, "cudnn", types.ModuleType("cudnn"))
    monkeypatch.setattr(device, "loaded_cudnn_version", lambda: (91900, "pretend"))


@pytest.mark.parametrize("implementation", [None, "xla", "pallas", "cudnn"])
@pytest.mark.parametrize("b, sq, skv, hq", [(0, 8, 8, 2), (2, 0, 8, 2), (2, 8, 0, 2),
                                           (0, 0, 0, 2), (2, 8, 8, 0)])
def test_a_call_with_nothing_to_compute_gives_the_same_results_on_every_backend(
        monkeypatch, implementation, b, sq, skv, hq):
    """No query row (batch, queries or query heads 0): empty results; no key:
    every row fully masked (zeros, LSE -inf). The gradients of q, k, v and of
    a captured array are zeros of their shapes. The fused backends' kernels
    never see such a call (the Pallas kernels' slices needed a row); cuDNN's
    checks are faked, and it would fail if anything ran."""
    if implementation == "cudnn":
        _pretend_cudnn_is_here(monkeypatch)
    dv = 64
    q = jnp.ones((b, sq, hq, 64), jnp.bfloat16)
    k, v = jnp.ones((b, skv, 2, 64), jnp.bfloat16), jnp.ones((b, skv, 2, dv), jnp.bfloat16)
    slopes = jnp.ones(2, jnp.float32)
    mod = scoremod.trace(lambda s, b, h, qi, ki: jnp.where(qi >= ki, s + slopes[h], -jnp.inf))

    def loss(q, k, v, c0):
        o, lse = scoremod.attention(q, k, v, mod.bind(c0=c0), implementation=implementation,
                                    return_lse=True)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isinf(lse), 0.0, lse))

    o, lse = scoremod.attention(q, k, v, mod, implementation=implementation, return_lse=True)
    assert o.shape == (b, sq, hq, dv) and o.dtype == jnp.bfloat16
    assert lse.shape == (b, hq, sq) and lse.dtype == jnp.float32
    assert np.all(np.asarray(o, np.float32) == 0) and np.all(np.isneginf(np.asarray(lse)))
    grads = jax.grad(loss, (0, 1, 2, 3))(q, k, v, slopes)
    for g, x in zip(grads, (q, k, v, slopes)):
        assert g.shape == x.shape and np.all(np.asarray(g, np.float32) == 0)
    jitted = jax.jit(lambda q, k, v: scoremod.attention(q, k, v, mod,
                                                        implementation=implementation))
    assert jitted(q, k, v).shape == (b, sq, hq, dv)


def test_a_call_with_nothing_to_compute_still_refuses_what_the_backend_refuses():
    q = jnp.ones((0, 8, 2, 16), jnp.float32)  # head dim 16: not one of the Pallas kernels'
    with pytest.raises(scoremod.ScoreModError, match="head dims 64 and 128"):
        scoremod.attention(q, q, q, implementation="pallas")
    with pytest.raises(ScoreModTypeError, match="dtype"):  # nor are the inputs' checks skipped
        scoremod.attention(q.astype(jnp.int32), q, q)


def _plain_jnp(q, k, v, bias_fn, scale):
    """Independent jnp attention with an explicit [B,H,Sq,Skv] bias/mask (float32)."""
    groups = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x.astype(jnp.float32), groups, axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k, precision="highest") * scale
    s = bias_fn(s, *_idx(q.shape[0], q.shape[2], q.shape[1], k.shape[1]))
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v, precision="highest")


def test_gradients_match_an_independent_jnp_implementation():
    q, k, v = _inputs(jnp.float32, seed=5)
    slopes = jnp.asarray(SLOPES)
    mod = lambda s, b, h, qi, ki: jnp.where(qi >= ki, 20.0 * jnp.tanh(s / 20.0) + slopes[h] * (ki - qi), -1e30)  # noqa
    ref = lambda s, b, h, qi, ki: jnp.where(qi >= ki, 20.0 * jnp.tanh(s / 20.0) + slopes[h] * (ki - qi), -1e30)  # noqa
    f = lambda fn: lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)))  # noqa: E731
    ours = jax.grad(f(lambda q, k, v: scoremod.attention(q, k, v, mod, scale=0.25, implementation="xla")), (0, 1, 2))
    theirs = jax.grad(f(lambda q, k, v: _plain_jnp(q, k, v, ref, 0.25)), (0, 1, 2))
    for a, b in zip(ours(q, k, v), theirs(q, k, v)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)


def test_gradient_reaches_operands():
    q, k, v = _inputs(jnp.float32, seed=7)
    bias = jnp.zeros((HQ, SQ, SKV))

    def loss(bias):
        mod = scoremod.trace(lambda s, b, h, qi, ki: s + bias[h, qi, ki])
        return jnp.sum(scoremod.attention(q, k, v, mod, implementation="xla") ** 2)

    def ref(bias):
        return jnp.sum(_plain_jnp(q, k, v, lambda s, b, h, qi, ki: s + bias[None], 1 / math.sqrt(D)) ** 2)

    np.testing.assert_allclose(np.asarray(jax.grad(loss)(bias)), np.asarray(jax.grad(ref)(bias)), atol=1e-5)


def test_jit_and_pytree_mod():
    q, k, v = _inputs(jnp.bfloat16)
    temp = jnp.float32(1.5)
    mod = scoremod.trace(lambda s, b, h, qi, ki: s * temp)
    f = jax.jit(lambda mod, q: scoremod.attention(q, k, v, mod, implementation="xla"))
    a = f(mod, q)
    b = f(mod.bind(c0=jnp.float32(0.5)), q)  # new values, same compiled function
    assert not np.allclose(np.asarray(a, np.float32), np.asarray(b, np.float32))
    g = jax.grad(lambda m: jnp.sum(scoremod.attention(q, k, v, m, implementation="xla").astype(jnp.float32)))(mod)
    assert isinstance(g, scoremod.ScoreMod) and g.operands[0].shape == ()


def test_text_and_callable_mods_are_accepted():
    q, k, v = _inputs(jnp.float32)
    a = scoremod.attention(q, k, v, "where(q_idx >= kv_idx, score, -inf)", implementation="xla")
    b = scoremod.attention(q, k, v, CASES["causal"][0], implementation="xla")
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "shapes, match",
    [
        (((B, SQ, HQ, D), (B, SKV, HKV, D), (B, SKV, HKV, D), "3d"), "batch, seq, heads, head_dim"),
        (((B, SQ, HQ, D), (B, SKV, 3, D), (B, SKV, 3, D), None), "multiple of key/value heads"),
        (((B, SQ, HQ, D), (B, SKV, HKV, 8), (B, SKV, HKV, 8), None), "head_dim"),
        (((B, SQ, HQ, D), (B + 1, SKV, HKV, D), (B + 1, SKV, HKV, D), None), "batch"),
        (((B, SQ, HQ, D), (B, SKV, HKV, D), (B, SKV + 1, HKV, D), None), "must agree"),
    ],
)
def test_bad_shapes(shapes, match):
    qs, ks, vs, flag = shapes
    q, k, v = jnp.ones(qs), jnp.ones(ks), jnp.ones(vs)
    if flag == "3d":
        q = q[0]
    with pytest.raises(ScoreModTypeError, match=match):
        scoremod.attention(q, k, v, implementation="xla")


def test_bad_dtypes():
    q = jnp.ones((1, 4, 2, 8), jnp.int32)
    with pytest.raises(ScoreModTypeError, match="dtype"):
        scoremod.attention(q, q, q)
    a, b = jnp.ones((1, 4, 2, 8), jnp.float16), jnp.ones((1, 4, 2, 8), jnp.bfloat16)
    with pytest.raises(ScoreModTypeError, match="share a dtype"):
        scoremod.attention(a, b, b)


def test_operand_too_small_for_heads_is_an_error():
    q, k, v = _inputs(jnp.float32)
    slopes = jnp.ones(HQ - 1)
    with pytest.raises(ScoreModTypeError, match="slopes|c0"):
        scoremod.attention(q, k, v, lambda s, b, h, qi, ki: s + slopes[h], implementation="xla")
    one = jnp.ones(1)  # size 1 broadcasts
    scoremod.attention(q, k, v, lambda s, b, h, qi, ki: s + one[h], implementation="xla")


def test_inputs_in_the_heads_first_layout_are_named_where_the_mod_reads_disagree():
    """q, k, v given as [batch, heads, seq, head_dim]: the slopes' read at h
    (4 heads, but h runs over the 128 positions) says the layout and the
    transpose; a [B, H, S, S] bias's too. One too small in the right layout
    gets the layout, not the transpose."""
    slopes, bias = jnp.ones(4), jnp.ones((2, 4, 128, 128))
    x = jnp.ones((2, 4, 128, 16))  # heads first
    for mod in (lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi),
                lambda s, b, h, qi, ki: s + bias[b, h, qi, ki]):
        with pytest.raises(ScoreModTypeError, match=(
                r"indexed by h.*the inputs are \[batch, seq, heads, head_dim\], here "
                r"query \(2, 4, 128, 16\).*swap axes 1 and 2.*jnp.swapaxes")):
            scoremod.attention(x, x, x, mod, implementation="xla")
    y = jnp.ones((2, 128, 8, 16))
    with pytest.raises(ScoreModTypeError, match="axis 2 \\(heads\\) of query") as e:
        scoremod.attention(y, y, y, lambda s, b, h, qi, ki: s + slopes[h], implementation="xla")
    assert "swap" not in str(e.value)


def _fused_runs_here(q, k, v, mod=None):
    return scoremod.which_implementation(q, k, v, mod)[0] == "cudnn"


def test_cudnn_request_is_never_silently_served_by_xla():
    q, k, v = _inputs(jnp.bfloat16)
    if _fused_runs_here(q, k, v):
        pytest.skip("the fused path runs here")
    with pytest.raises(scoremod.ScoreModError):
        scoremod.attention(q, k, v, implementation="cudnn")


@pytest.mark.parametrize("name", ["flash", "bogus"])
def test_bad_implementation_name_lists_the_registered_ones(name):
    q = jnp.ones((1, 4, 2, 8))
    with pytest.raises(scoremod.ScoreModError, match=f"unknown implementation '{name}'.*'cudnn', 'pallas', 'xla'"):
        scoremod.attention(q, q, q, implementation=name)


def test_reference_is_an_alias_of_xla():
    q, k, v = _inputs(jnp.float32)
    a = scoremod.attention(q, k, v, CASES["causal"][0], implementation="reference")
    b = scoremod.attention(q, k, v, CASES["causal"][0], implementation="xla")
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_which_implementation_explains_the_choice():
    q, k, v = _inputs(jnp.float32)
    choice = scoremod.which_implementation(q, k, v, CASES["causal"][0])
    impl, reason = choice
    if _fused_runs_here(q, k, v):
        pytest.skip("float32 inputs: the reason differs on a GPU")
    assert impl == "xla" and reason.startswith("xla: no faster backend runs on this machine")
    assert list(choice.verdicts) == [b.name for b in registry.backends()]
    assert choice.verdicts["cudnn"] in reason and choice.verdicts["xla"] is None
    with pytest.raises(ScoreModTypeError):
        scoremod.which_implementation(q[0], k, v)


HOPPER = device.Device("gpu", "pretend H100", 9, 132)


def test_falling_back_on_a_gpu_warns_once(monkeypatch):
    import importlib

    route_module = importlib.import_module("scoremod.route")

    monkeypatch.setattr(device, "current", lambda: HOPPER)  # pretend a Hopper GPU is here
    monkeypatch.setattr(route_module, "_WARNED", set())
    q, k, v = _inputs(jnp.bfloat16)
    mod = lambda s, b, h, qi, ki: jnp.where(s > 0.0, s, 0.0)  # noqa: E731 float compare: refused
    with pytest.warns(UserWarning, match="reference path here: cudnn refuses this call: the fused "
                                         "cuDNN path cannot run `gt`"):
        scoremod.attention(q, k, v, mod)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scoremod.attention(q, k, v, mod)  # the same reason is not repeated
        monkeypatch.setattr(device, "current", lambda: device.Device("cpu", "cpu", None, None))
        scoremod.attention(q, k, v, lambda s, b, h, qi, ki: s * 2.0)  # no GPU: nothing to warn of


def test_an_unvalidated_gpu_family_is_used_only_by_name(monkeypatch):
    import sys
    import types

    from scoremod import kernels_ffi
    from scoremod.lowering.problem import Problem

    monkeypatch.setattr(device, "current", lambda: device.Device("gpu", "pretend", 10, 148))
    monkeypatch.setattr(kernels_ffi, "available", lambda: True)
    monkeypatch.setattr(kernels_ffi, "frontend_mismatch", lambda: "")
    monkeypatch.setattr(kernels_ffi, "installed_frontend_version", lambda: 13200)
    monkeypatch.setitem(sys.modules, "cudnn", types.ModuleType("cudnn"))
    monkeypatch.setattr(device, "loaded_cudnn_version", lambda: (91900, "pretend"))
    q, k, v = _inputs(jnp.bfloat16)
    choice = scoremod.which_implementation(q, k, v)
    assert choice[0] == "xla" and "not validated on this GPU family (sm_10x)" in choice[1]
    assert registry.get("cudnn").why_not(Problem.of(q, k, v), None, automatic=False) is None


@pytest.mark.parametrize("version", [91800, 100000])
def test_a_cudnn_outside_the_supported_range_runs_only_by_name_with_a_warning(monkeypatch, version):
    import sys
    import types
    import warnings

    from scoremod import kernels_ffi
    from scoremod.lowering.problem import Problem

    monkeypatch.setattr(device, "current", lambda: device.Device("gpu", "pretend", 9, 132))
    monkeypatch.setattr(kernels_ffi, "available", lambda: True)
    monkeypatch.setattr(kernels_ffi, "frontend_mismatch", lambda: "")
    monkeypatch.setattr(kernels_ffi, "installed_frontend_version", lambda: 13200)
    monkeypatch.setitem(sys.modules, "cudnn", types.ModuleType("cudnn"))
    monkeypatch.setattr(device, "loaded_cudnn_version", lambda: (version, "pretend"))
    q, k, v = _inputs(jnp.bfloat16)
    text = f"{version // 10000}.{version // 100 % 100}.0"
    choice = scoremod.which_implementation(q, k, v)
    assert choice[0] == "xla" and f"cuDNN {text} is loaded" in choice[1]
    assert "supports cuDNN >= 9.19.0, < 10.0.0" in choice[1] and 'implementation="cudnn"' in choice[1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert registry.get("cudnn").why_not(Problem.of(q, k, v), None, automatic=False) is None
    assert any(f"cuDNN {text} is loaded" in str(w.message) for w in caught)
    monkeypatch.setattr(device, "loaded_cudnn_version", lambda: (91902, "pretend"))
    assert registry.get("cudnn").why_not(Problem.of(q, k, v), None, automatic=True) is None


def test_a_traced_scale_runs_on_the_reference_path_and_is_refused_by_name(monkeypatch):
    q, k, v = _inputs(jnp.bfloat16)
    want = scoremod.attention(q, k, v, scale=0.3, implementation="xla")
    got = jax.jit(lambda s: scoremod.attention(q, k, v, scale=s))(0.3)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=1e-2, atol=1e-2)
    with pytest.raises(scoremod.CudnnUnavailableError, match="scale is a traced value"):
        jax.jit(lambda s: scoremod.attention(q, k, v, scale=s, implementation="cudnn"))(0.3)


def test_reference_path_refuses_a_call_too_big_for_the_device(monkeypatch):
    big = jax.ShapeDtypeStruct((64, 65536, 32, 64), jnp.bfloat16)  # 32 TiB of float32 scores
    with pytest.raises(scoremod.ScoreModError, match=r"at least .* GiB.*implementation=\"cudnn\".*smaller"):
        jax.eval_shape(lambda q: scoremod.attention(q, q, q, implementation="xla"), big)
    with pytest.raises(scoremod.ScoreModError, match="no implementation can run this call"):
        jax.eval_shape(lambda q: scoremod.attention(q, q, q), big)
    monkeypatch.setattr(device, "available_memory", lambda: 2**20)  # 1 MiB free
    q, k, v = _inputs(jnp.float32)  # 2 * 4 * 24 * 40 * 4 B of scores: 30 KiB, fits
    scoremod.attention(q, k, v, implementation="xla")
    q = jnp.ones((1, 512, 2, 8))  # 2 * 512 * 512 * 4 B * 2 = 4 MiB: does not
    with pytest.raises(scoremod.ScoreModError, match="more than the 0.0 GiB"):
        scoremod.attention(q, q, q, implementation="xla")


def test_a_backend_not_validated_on_a_gpu_runs_by_name_only_with_a_warning(monkeypatch):
    import warnings

    from scoremod.lowering.backend import Backend

    class Unvalidated(Backend):
        name = "unvalidated"

        def why_not(self, problem, mod, automatic, options=None):
            return None

    backend = Unvalidated()
    monkeypatch.setattr(registry, "_BY_NAME_ONLY", [backend])
    assert "unvalidated" in registry.names()
    assert "unvalidated" not in [b.name for b in registry.backends()]
    q = jnp.ones((1, 16, 2, 8))
    assert scoremod.which_implementation(q, q, q)[0] != "unvalidated"  # never chosen automatically
    registry._WARNED.discard("unvalidated")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert registry.get("unvalidated") is backend
    assert any("not validated on a GPU" in str(w.message) for w in caught)


class _StandInFused(StandIn):
    """test_sharding's stand-in fused backend (no operand gradients, no forward
    mode: as cuDNN), taking automatic calls too."""

    name, title = "fused-standin", "the stand-in fused kernels"
    partitioned = False

    def why_not(self, problem, mod, automatic, options=None):
        return None


class _PallasHere(type(PALLAS)):
    """The Pallas backend taking automatic calls here (interpret mode, float32)."""

    def why_not(self, problem, mod, automatic, options=None):
        return super().why_not(problem, mod, False, options)


def test_operand_gradients_run_on_the_pallas_kernels_under_grad_and_jit(monkeypatch):
    """implementation=None with a backend first that has no operand gradients
    (as cuDNN): jax.grad and jax.vjp for ALiBi slopes run on the next backend
    that has them, the Pallas kernels (their own backward: the slopes' tangent
    is transposed, never evaluated), jitted or not, under jax.vmap too;
    jax.jvp in the slopes runs on the reference path. Each with a warning.
    The document ids, an int operand, get no gradient and a float0 tangent."""
    import warnings

    monkeypatch.setattr(registry, "_BACKENDS", [_StandInFused(), _PallasHere(), REFERENCE])
    q, k, v = (x[:, :32, :, :].astype(jnp.float32) for x in _inputs(jnp.float32, sq=32, skv=32))
    q, k, v = (jnp.concatenate([x] * 8, axis=-1) for x in (q, k, v))  # head dim 64
    slopes = jnp.linspace(0.1, 0.5, q.shape[2])
    w = jnp.cos(jnp.arange(q.size, dtype=jnp.float32)).reshape(q.shape)

    doc = jnp.arange(q.shape[1], dtype=jnp.int32) // 12  # an int operand beside the slopes

    def loss(q, s, impl=None):
        mod = lambda x, b, h, qi, ki: jnp.where(  # noqa: E731
            (qi >= ki) & (doc[qi] == doc[ki]), x + s[h] * (ki - qi), -jnp.inf)
        return jnp.sum(scoremod.attention(q, k, v, mod, implementation=impl) * w)

    want = jax.grad(lambda q, s: loss(q, s, "xla"), argnums=(0, 1))(q, slopes)
    runs = {"grad": jax.grad(loss, argnums=(0, 1)),
            "jit(grad)": jax.jit(jax.grad(loss, argnums=(0, 1))),
            "vjp": lambda q, s: jax.vjp(loss, q, s)[1](jnp.float32(1.0))}
    for name, run in runs.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = run(q, slopes)
        for g, x in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(x), rtol=2e-4, atol=2e-5,
                                       err_msg=name)
        said = [str(m.message) for m in caught if "operands" in str(m.message)]
        assert said and PALLAS.title in said[0], (name, said)
    per_example = jnp.stack([slopes, 2 * slopes])
    got = jax.vmap(jax.grad(loss, argnums=1), (None, 0))(q, per_example)
    want_vmap = jax.vmap(jax.grad(lambda q, s: loss(q, s, "xla"), argnums=1), (None, 0))(
        q, per_example)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want_vmap), rtol=2e-4, atol=2e-5)
    # grad of vmap: the tangent primitive's batching rule folds the slopes' tangents
    summed = lambda impl: lambda s: jax.vmap(lambda s: loss(q, s, impl))(s).sum()  # noqa: E731
    np.testing.assert_allclose(np.asarray(jax.jit(jax.grad(summed(None)))(per_example)),
                               np.asarray(jax.grad(summed("xla"))(per_example)),
                               rtol=2e-4, atol=2e-5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = jax.jvp(lambda s: loss(q, s), (slopes,), (slopes,))
    want = jax.jvp(lambda s: loss(q, s, "xla"), (slopes,), (slopes,))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-5)
    assert any("reference path" in str(m.message) for m in caught)


def test_what_the_chosen_backend_cannot_do_runs_on_the_next_that_can(monkeypatch):
    """implementation=None: operand gradients go to the first later backend
    that computes them and takes the call (the reference path when it
    declines), jax.jvp to the first later one with forward-mode derivatives;
    each with a warning naming it, and the memory note only for the
    reference path."""
    import warnings

    grads_backend = _WithGradients()
    monkeypatch.setattr(registry, "_BACKENDS", [_StandInFused(), grads_backend, REFERENCE])
    q, k, v = _inputs(jnp.float32)
    slopes = jnp.linspace(0.1, 0.5, q.shape[2])

    def loss(s, impl=None):
        mod = lambda x, b, h, qi, ki: x + s[h] * (ki - qi)  # noqa: E731
        return jnp.sum(scoremod.attention(q, k, v, mod, implementation=impl) ** 2)

    want = jax.grad(lambda s: loss(s, "xla"))(slopes)
    for declines, taker in ((False, "stand-in gradient kernels"), (True, "reference path")):
        grads_backend.declines = declines
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = jax.grad(loss)(slopes)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)
        said = [str(w.message) for w in caught if "operands" in str(w.message)]
        assert said and taker in said[0], said
        assert ("O(S^2) memory" in said[0]) == declines, said[0]
    grads_backend.declines = False
    mod = lambda x, b, h, qi, ki: x * 0.5  # noqa: E731
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.jvp(lambda q: scoremod.attention(q, k, v, mod), (q,), (q,))
    said = [str(w.message) for w in caught if "jax.jvp" in str(w.message)]
    assert said and "reference path" in said[0], said  # the stand-in has no forward mode


class _WithGradients(Backend):
    """The reference's numbers through the pipeline, with operand gradients and a
    repeatable backward (as the Pallas kernels); records what it ran."""

    name, title = "gradients-standin", "the stand-in gradient kernels"
    operand_gradients = True
    repeatable_backward = True
    partitioned = False
    declines = False

    def __init__(self):
        self.ran = []

    def why_not(self, problem, mod, automatic, options=None):
        return "declined" if self.declines else None

    def plan(self, problem, mod, scale, options, return_lse):
        return REFERENCE.plan(problem, mod, scale, options, True)

    def forward(self, plan, q, k, v, operands):
        self.ran.append("forward")
        return REFERENCE.forward(plan, q, k, v, operands)

    def backward(self, plan, q, k, v, o, lse, do, operands, dlse=None, wanted=()):
        self.ran.append("backward")
        return REFERENCE.backward(plan, q, k, v, o, lse, do, operands, dlse, wanted)


class _Unrepeatable(_StandInFused):
    """The stand-in fused backend whose backward does not repeat bitwise (as cuDNN's)."""

    repeatable_backward = False

    def __init__(self):
        self.ran = []

    def forward(self, plan, q, k, v, operands):
        self.ran.append("forward")
        return super().forward(plan, q, k, v, operands)

    def backward(self, plan, q, k, v, o, lse, do, operands, dlse=None, wanted=()):
        self.ran.append("backward")
        return super().backward(plan, q, k, v, o, lse, do, operands, dlse, wanted)


def test_deterministic_runs_the_backward_where_it_repeats(monkeypatch):
    """LoweringOptions(deterministic=True): a call whose forward runs on a backend
    whose backward does not repeat bitwise (as cuDNN) keeps that forward and runs
    its backward on the next backend that repeats (as the Pallas kernels), from
    the forward's O and LSE, silently (the user asked), with the sinks too;
    which_implementation says so. By name, that backend refuses the gradient
    (its forward still runs); without the option its own backward runs."""
    import warnings

    fused, grads = _Unrepeatable(), _WithGradients()
    monkeypatch.setattr(registry, "_BACKENDS", [fused, grads, REFERENCE])
    q, k, v = _inputs(jnp.float32)
    sinks = jnp.linspace(-1.0, 1.0, q.shape[2])
    mod = lambda x, b, h, qi, ki: jnp.where(qi >= ki, 30 * jnp.tanh(x / 30), -jnp.inf)  # noqa: E731
    on = scoremod.LoweringOptions(deterministic=True)

    def loss(q, k, v, s, impl=None, options=None):
        o = scoremod.attention(q, k, v, mod, implementation=impl, options=options, sinks=s)
        return jnp.sum(o * jnp.cos(o))

    want = jax.jit(jax.grad(lambda *a: loss(*a, "xla"), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    for options, forward_on, backward_on in ((on, fused, grads), (None, fused, fused)):
        fused.ran.clear()
        grads.ran.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning: the route the user asked for
            got = jax.jit(jax.grad(lambda *a: loss(*a, options=options), argnums=(0, 1, 2, 3)))(
                q, k, v, sinks)
        for g, x in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(x), rtol=2e-4, atol=2e-5)
        assert "forward" in forward_on.ran and "backward" in backward_on.ran
        other = grads if backward_on is fused else fused
        assert "backward" not in other.ran and "forward" not in grads.ran
    choice = scoremod.which_implementation(q, k, v, mod, options=on)
    assert choice.implementation == fused.name
    assert grads.title in choice.backward and "deterministic=True" in choice.backward
    assert scoremod.which_implementation(q, k, v, mod).backward is None
    assert scoremod.which_implementation(q, k, v, mod, implementation=grads.name,
                                         options=on).backward is None
    by_name = functools.partial(loss, impl=fused.name, options=on)
    jax.jit(by_name)(q, k, v, sinks)  # the forward runs
    with pytest.raises(ScoreModError, match=r"deterministic=True.*implementation=None"):
        jax.grad(by_name)(q, k, v, sinks)
    grads.declines = True  # the fallback is then the reference path: O(S^2) memory, said
    with pytest.warns(UserWarning, match=r"deterministic=True runs this backward on the "
                      r"reference path.*O\(S\^2\) memory"):
        got = jax.jit(jax.grad(lambda *a: loss(*a, options=on), argnums=(0, 1, 2, 3)))(
            q, k, v, sinks)
    for g, x in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(x), rtol=2e-4, atol=2e-5)


class _ForwardClaimer(_WithGradients):
    """Stand-in kernels whose forward claims calls from the fused stand-in under
    LoweringOptions(mosaic_forward=True) (as the Pallas kernels' Mosaic GPU
    forward from cuDNN), their own backward repeatable, with operand gradients."""

    name, title = "forward-standin", "the stand-in forward kernels"

    def claims_forward(self, problem, mod, options, over):
        return "its forward is faster here" if options.mosaic_forward else None


class _RecordingFused(_Unrepeatable):
    """The unrepeatable fused stand-in, recording the LSE its backward is given."""

    def backward(self, plan, q, k, v, o, lse, do, operands, dlse=None, wanted=()):
        jax.debug.callback(lambda x: setattr(self, "lse", np.asarray(x)), lse)
        return super().backward(plan, q, k, v, o, lse, do, operands, dlse, wanted)


def test_a_claimed_forward_keeps_the_backward_it_claims_from(monkeypatch):
    """A later backend that claims the forward (Backend.claims_forward, as the
    Mosaic GPU forward under mosaic_forward=True) runs it, and the backend it
    claims from runs the backward on that forward's O and LSE, a row that sees
    no key given LSE +inf (P = 0 on any backward); gradients as the reference
    path's. A gradient that backward does not compute (a captured array's, the
    LSE's) or repeatable gradients it does not give run on the claiming
    backend's own backward. which_implementation says both; by name, or
    without the option, one backend runs the call."""
    fused, claimer = _RecordingFused(), _ForwardClaimer()
    monkeypatch.setattr(registry, "_BACKENDS", [fused, claimer, REFERENCE])
    q, k, v = _inputs(jnp.float32)
    slopes = jnp.linspace(0.1, 0.4, q.shape[2])
    on = scoremod.LoweringOptions(mosaic_forward=True)

    def mod(x, b, h, qi, ki, s):  # row 3 sees no key
        return jnp.where((qi >= ki) & (qi != 3), 30 * jnp.tanh(x / 30) - s[h] * (qi - ki),
                         -jnp.inf)

    def loss(q, k, v, s, impl=None, options=on, with_lse=False):
        out = scoremod.attention(q, k, v, lambda *a: mod(*a, s), implementation=impl,
                                 options=options, return_lse=with_lse)
        if not with_lse:
            return jnp.sum(out * jnp.cos(out))
        o, lse = out
        return jnp.sum(o * jnp.cos(o)) + 0.5 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    def ran(argnums, **kw):
        fused.ran.clear()
        claimer.ran.clear()
        want = jax.grad(functools.partial(loss, **{**kw, "impl": "xla"}), argnums)(q, k, v,
                                                                                    slopes)
        got = jax.jit(jax.grad(functools.partial(loss, **kw), argnums))(q, k, v, slopes)
        for g, x in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(x), rtol=2e-4, atol=2e-5)
        return ("forward" in fused.ran, "backward" in fused.ran,
                "forward" in claimer.ran, "backward" in claimer.ran)

    assert ran((0, 1, 2)) == (False, True, True, False)
    assert np.all(np.asarray(fused.lse)[:, :, 3] == np.inf)
    assert np.all(np.isfinite(np.asarray(fused.lse)[:, :, 4:]))
    assert ran((0, 3)) == (False, False, True, True)  # the slopes' gradient
    assert ran((0,), with_lse=True) == (False, False, True, True)  # the LSE's cotangent
    assert ran((0,), options=on.replace(deterministic=True)) == (False, False, True, True)
    assert ran((0,), options=scoremod.LoweringOptions()) == (True, True, False, False)
    assert ran((0,), impl=fused.name) == (True, True, False, False)
    # Under jax.vmap the batched call keeps the split (both re-planned for its shapes).
    fused.ran.clear()
    claimer.ran.clear()
    stack = lambda x: jnp.stack([x, 0.5 * x])  # noqa: E731
    got = jax.jit(jax.vmap(jax.grad(loss), in_axes=(0, 0, 0, None)))(
        stack(q), stack(k), stack(v), slopes)
    want = jax.vmap(jax.grad(functools.partial(loss, impl="xla")), in_axes=(0, 0, 0, None))(
        stack(q), stack(k), stack(v), slopes)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-5)
    assert "forward" in claimer.ran and "backward" in fused.ran
    assert "backward" not in claimer.ran and "forward" not in fused.ran

    choice = scoremod.which_implementation(q, k, v, lambda *a: mod(*a, slopes), options=on)
    assert choice.implementation == claimer.name
    assert choice.reason.startswith(f"{claimer.name}: it claims the forward from {fused.name}")
    assert fused.title in choice.backward and "O and LSE" in choice.backward
    assert scoremod.which_implementation(q, k, v, lambda *a: mod(*a, slopes)).backward is None


class _CudnnHere(type(registry.get("cudnn"))):
    """The cuDNN backend's planning rules, taking every call (nothing is run on it)."""

    def why_not(self, problem, mod, automatic, options=None):
        return None


class _CountingPallas(_PallasHere):
    plans = 0

    def plan(self, *args):
        type(self).plans += 1
        return super().plan(*args)


def test_cudnn_yields_masks_of_captured_arrays_to_the_pallas_kernels(monkeypatch):
    """Masks that read captured arrays at the query and the key (packed documents
    with a score_mod, which the variable-length route does not take): cuDNN
    could run them from a mask computed ahead over [Sq, Skv], visiting every
    tile, so implementation=None picks the Pallas kernels, which compute the
    mask in the kernel and skip the tiles it empties; which_implementation
    says so. Dense mods, index masks and masks of captured values read at one
    side only (key padding, a per-head flag) stay on cuDNN, and so does the
    call when the Pallas kernels refuse it."""
    import importlib

    from scoremod.lowering.problem import Problem

    route_module = importlib.import_module("scoremod.route")
    pallas = _CountingPallas()
    monkeypatch.setattr(registry, "_BACKENDS", [_CudnnHere(), pallas, REFERENCE])
    q, k, v = (jnp.concatenate([x] * (64 // x.shape[-1]), axis=-1)  # head dim 64
               for x in _inputs(jnp.float32, sq=64, skv=64))
    doc = jnp.arange(64, dtype=jnp.int32) // 24
    lengths = jnp.array([40, 64], jnp.int32)[: q.shape[0]]
    is_global = jnp.arange(64) % 9 == 0
    softcap = lambda s: 30.0 * jnp.tanh(s / 30.0)  # noqa: E731
    documents = lambda s, b, h, qi, ki: jnp.where(  # noqa: E731
        (qi >= ki) & (doc[qi] == doc[ki]), softcap(s), -jnp.inf)
    not_other = lambda s, b, h, qi, ki: jnp.where(doc[qi] != doc[ki], -jnp.inf, s)  # noqa: E731
    stay = {"dense": lambda s, b, h, qi, ki: softcap(s),
            "causal": lambda s, b, h, qi, ki: jnp.where(qi >= ki, softcap(s), -jnp.inf),
            "key padding": lambda s, b, h, qi, ki: jnp.where(ki < lengths[b], s, -jnp.inf),
            "per-head flag": lambda s, b, h, qi, ki: jnp.where(doc[h] == 0, s, -jnp.inf),
            # refused by the Pallas kernels (a bool array read along one tile axis)
            "global tokens": lambda s, b, h, qi, ki: jnp.where(
                (jnp.abs(qi - ki) <= 4) | (doc[qi] == 0) | is_global[ki], s, -jnp.inf)}
    start = jnp.array([0, 24, 48], jnp.int32)
    from_start = lambda s, b, h, qi, ki: jnp.where(  # noqa: E731
        (ki >= start[doc[qi]]) & (qi >= ki), s, -jnp.inf)
    for name, mod in (("documents", documents), ("written as !=", not_other),
                      ("from the document's start", from_start)):
        choice = scoremod.which_implementation(q, k, v, mod)
        assert choice.implementation == "pallas", (name, choice)
        assert choice.reason.startswith("pallas: it claims the call from cudnn") and "[q_idx]" in choice.reason
        assert choice.verdicts["cudnn"] is None and choice.verdicts["pallas"] is None
        chosen = route_module.route(Problem.of(q, k, v), scoremod.trace(mod), 0.125,
                                    scoremod.LoweringOptions())
        assert chosen.backend is pallas and chosen.warning is None
        # under options whose Pallas engine refuses the call (Mosaic: no Hopper GPU
        # here), it stays on cuDNN
        mosaic = scoremod.LoweringOptions(pallas_engine="mosaic")
        assert route_module.route(Problem.of(q, k, v), scoremod.trace(mod), 0.125,
                                  mosaic).backend.name == "cudnn"
    for name, mod in stay.items():
        choice = scoremod.which_implementation(q, k, v, mod)
        assert choice.implementation == "cudnn" and choice.reason.startswith(
            "cudnn: the first backend in order"), (name, choice)
    before = pallas.plans
    got = scoremod.attention(q, k, v, documents)  # runs on the Pallas kernels (interpret mode)
    assert pallas.plans == before + 1
    want = scoremod.attention(q, k, v, documents, implementation="xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)

    class Refusing(_PallasHere):
        def why_not(self, problem, mod, automatic, options=None):
            return "refused for this test"

    monkeypatch.setattr(registry, "_BACKENDS", [_CudnnHere(), Refusing(), REFERENCE])
    assert scoremod.which_implementation(q, k, v, documents).implementation == "cudnn"


@pytest.mark.parametrize("gpu", ["hopper", "ampere"])
def test_masks_read_per_score_stay_on_cudnn_beside_the_mosaic_engine(monkeypatch, gpu):
    """A mask of captured arrays read per score (a 2-D window of a table, JetSpec's
    tree): where the Mosaic GPU engine runs the problem (Hopper) it reads the mask
    per score, unmeasured against cuDNN's tensor of it, so the planner leaves the
    call to cuDNN, which computes the mask ahead (by name the Pallas kernels take
    it on the Mosaic engine); where the Mosaic engine is missing (an A100) the
    Triton engine claims it as before. A mask the Mosaic engine reads along the
    tile's axes (document ids) is claimed on both."""
    from scoremod import support

    family, name = (9, "NVIDIA H200") if gpu == "hopper" else (8, "NVIDIA A100")
    monkeypatch.setattr(device, "current", lambda: device.Device("gpu", name, family, 132))
    monkeypatch.setattr(support, "mosaic_missing", lambda: None)  # as jax 0.11 or later
    monkeypatch.setattr(registry, "_BACKENDS", [_CudnnHere(), _PallasHere(), REFERENCE])
    q = jnp.zeros((1, 256, 2, 64), jnp.bfloat16)
    kv = jnp.zeros((1, 384, 2, 64), jnp.bfloat16)
    ancestor = jnp.asarray(np.tril(np.ones((256, 256), bool)))
    doc = jnp.arange(384, dtype=jnp.int32) // 100
    tree = lambda s, b, h, qi, ki: jnp.where(  # noqa: E731
        (ki < 128) | ancestor[qi, jnp.clip(ki - 128, 0, 255)], s, -jnp.inf)
    documents = lambda s, b, h, qi, ki: jnp.where(  # noqa: E731
        doc[qi] == doc[ki], s, -jnp.inf)
    choice = scoremod.which_implementation(q, kv, kv, tree)
    assert choice.implementation == ("cudnn" if gpu == "hopper" else "pallas"), choice
    assert choice.verdicts["pallas"] is None
    named = scoremod.which_implementation(q, kv, kv, tree, implementation="pallas")
    engine = "Mosaic GPU" if gpu == "hopper" else "Triton"
    assert named.implementation == "pallas" and engine in named.variant, named
    assert scoremod.which_implementation(q, kv, kv, documents).implementation == "pallas"
