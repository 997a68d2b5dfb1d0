"""Attention sinks on the GPU: O, LSE, dQ, dK, dV and d(sinks) on each fused
backend against the reference path, for causal, sliding window, document
masks, softcap + causal and ALiBi, with GQA and Sq != Skv, in bfloat16 and
float16; and on a second run the same O and LSE on every route, the same d(sinks)
where it is one reduction, the same dQ, dK, dV on the Pallas kernels and with
deterministic=True (issue: sinks with any mod)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from scoremod.lowering.pallas import mosaic_backward
from tests import pallas_cases as pc
from tests.pallas_cases import quiet  # noqa: F401 - the autouse fixture

pytestmark = pytest.mark.gpu

TOL = 3e-2  # relative to the largest entry; bfloat16 / float16 inputs
HQ, HKV = 8, 2
SINKS = jnp.asarray([0.5, -1.0, 2.0, -jnp.inf, 0.0, 1.5, -3.0, 4.0], jnp.float32)


def _docs(b, s):
    """Four documents per row, of uneven lengths."""
    cuts = np.array([0, s // 8, s // 2, (3 * s) // 4, s])
    ids = np.zeros((b, s), np.int32)
    for i in range(4):
        ids[:, cuts[i]:cuts[i + 1]] = i
    return jnp.asarray(ids)


def _mods(sq, skv):
    off = skv - sq  # queries are the last sq positions
    slopes = jnp.asarray([2.0 ** (-(i + 1)) for i in range(HQ)], jnp.float32)
    return {
        "causal": lambda s, b, h, q, k: jnp.where(q + off >= k, s, -jnp.inf),
        "window": lambda s, b, h, q, k: jnp.where((q + off >= k) & (q + off - k < 128), s,
                                                  -jnp.inf),
        "softcap_causal": lambda s, b, h, q, k: jnp.where(
            q + off >= k, 30.0 * jnp.tanh(s / 30.0), -jnp.inf),
        "alibi": lambda s, b, h, q, k: s + slopes[h] * (k - q - off),
        # key blocks joined by their LSEs (split.by_keys), the sink in the first's graph
        "prefix_lm": lambda s, b, h, q, k: jnp.where((k < 128) | (q + off >= k), s, -jnp.inf),
        # rows 0-63 see no key: O = 0 and LSE = the sink (-inf for head 3's)
        "masked_rows": lambda s, b, h, q, k: jnp.where((q + off >= k) & (q >= 64), s, -jnp.inf),
    }


# (backend asked for, options): the Pallas kernels on Hopper (Mosaic GPU), cuDNN,
# and implementation=None (cudnn-varlen for the document mask).
ROUTES = {
    "pallas": ("pallas", scoremod.LoweringOptions(pallas_engine="mosaic")),
    "cudnn": ("cudnn", None),
    "auto": (None, None),
    # cuDNN's (or the variable-length route's) backward graphs built with cuDNN's
    # deterministic algorithm
    "deterministic": (None, scoremod.LoweringOptions(deterministic=True)),
    "cudnn-deterministic": ("cudnn", scoremod.LoweringOptions(deterministic=True)),
    # the sinks' gradient summed by cuDNN's backward graphs (dSink_token)
    "cudnn-dsink": ("cudnn", None),
}


def _run(impl, options, mod, q, k, v, do, sinks):
    def loss(q, k, v, s):
        o, lse = scoremod.attention(q, k, v, mod, implementation=impl, options=options,
                                    sinks=s, return_lse=True)
        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32)), (o, lse)

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    (_, (o, lse)), grads = grad(q, k, v, sinks)
    return (o, lse, *grads)


def _check(got, want):
    for name, a, b in zip(("O", "LSE", "dQ", "dK", "dV", "dsinks"), got, want):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_array_equal(np.isneginf(a), np.isneginf(b), err_msg=name)
        fin = np.isfinite(b)
        assert np.isfinite(a[fin]).all(), name
        err = np.max(np.abs(a[fin] - b[fin]), initial=0) / (np.max(np.abs(b[fin]), initial=0)
                                                             + 1e-6)
        assert err < TOL, (name, err)


def _sums_in_graph(monkeypatch):
    """cuDNN's backward graphs sum the sinks' gradient (SINK_GRADIENT_IN_GRAPH on);
    the list of the plans it did so for."""
    from scoremod.lowering.cudnn import backend as cudnn_backend

    summed = []
    with_sinks = cudnn_backend.Cudnn.backward_with_sinks
    monkeypatch.setattr(cudnn_backend, "SINK_GRADIENT_IN_GRAPH", True)
    monkeypatch.setattr(cudnn_backend.Cudnn, "backward_with_sinks",
                        lambda self, plan, *a: summed.append(plan) or with_sinks(self, plan, *a))
    return summed


def _skip_unless_hopper(impl):
    from scoremod import device

    if impl == "pallas" and device.current().family != 9:
        pytest.skip("the Mosaic GPU engine runs on Hopper GPUs only")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("sq,skv", [(512, 512), (256, 640)], ids=["square", "sq<skv"])
@pytest.mark.parametrize("name", ["causal", "window", "softcap_causal", "alibi", "document",
                                  "masked_rows", "prefix_lm"])
@pytest.mark.parametrize("route", sorted(ROUTES))
def test_sinks_match_the_reference_and_repeat(route, name, sq, skv, dtype, monkeypatch):
    impl, options = ROUTES[route]
    _skip_unless_hopper(impl)
    summed = _sums_in_graph(monkeypatch) if route == "cudnn-dsink" else None
    if name == "document" and sq != skv:
        pytest.skip("document ids are per position of one sequence (Sq = Skv)")
    q, k, v, do = pc.inputs(b=2, sq=sq, skv=skv, hq=HQ, hkv=HKV, d=128, dtype=dtype)
    if name == "document":
        docs = _docs(2, sq)
        mod = scoremod.trace(lambda s, b, h, qi, ki: jnp.where(
            (docs[b, qi] == docs[b, ki]) & (qi >= ki), s, -jnp.inf))
    else:
        mod = scoremod.trace(_mods(sq, skv)[name])
    want = _run("xla", None, mod, q, k, v, do, SINKS)
    got = _run(impl, options, mod, q, k, v, do, SINKS)
    _check(got, want)
    assert summed is None or summed, "cuDNN's backward did not sum the sinks' gradient"
    again = _run(impl, options, mod, q, k, v, do, SINKS)
    # The forward and the LSE repeat bitwise on every route; the gradients on the
    # Pallas kernels and wherever deterministic=True. cuDNN's Hopper backward
    # accumulates in an order that varies between runs (last bits, measured), as
    # does dQ fused into the Mosaic dK/dV kernel, and so may its sum of the sinks'
    # gradient (dSink_token, cudnn-dsink); elsewhere that gradient is one reduction.
    names = ("O", "LSE", "dQ", "dK", "dV", "dsinks")
    repeat = names if route in ("pallas", "deterministic", "cudnn-deterministic") else (
        ("O", "LSE") if route == "cudnn-dsink" else ("O", "LSE", "dsinks"))
    if route == "pallas" and mosaic_backward.FUSE_DQ:
        repeat = tuple(n for n in repeat if n != "dQ")
    for name, a, b in zip(names, got, again):
        if name in repeat:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@pytest.mark.parametrize("route", ["cudnn", "auto", "pallas"])
@pytest.mark.parametrize("name", ["causal", "softcap_causal", "window"])
def test_sinks_per_batch_row(route, name):
    """Sinks [batch, q_heads] that differ per row: cuDNN joins them after its forward
    (its sink input is one per head), and the results still match the reference."""
    impl, options = ROUTES[route]
    _skip_unless_hopper(impl)
    q, k, v, do = pc.inputs(b=2, sq=512, skv=512, hq=HQ, hkv=HKV, d=128, dtype=jnp.bfloat16)
    mod = scoremod.trace(_mods(512, 512)[name])
    sinks = jnp.stack([SINKS, SINKS[::-1] + 0.5])
    _check(_run(impl, options, mod, q, k, v, do, sinks), _run("xla", None, mod, q, k, v, do, sinks))
