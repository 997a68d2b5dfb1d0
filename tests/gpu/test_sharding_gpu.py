"""The fused cuDNN path through the sharding layer, vmap and forward mode, on one GPU.

Several GPUs run the partitioned calls themselves (docs/validation.md); here
the pieces they are made of: a shard's call (its rows, the mod shifted to the
shard's global indices with the ``offset`` op), the call on a one-device mesh,
vmap over two leading axes, and forward mode.
"""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import scoremod
from scoremod import CudnnUnavailableError, ScoreModError
from scoremod.lowering import sharding
from tests.gpu.test_fused import TOL, _inputs, _rel_err

pytestmark = pytest.mark.gpu

SLOPES = jnp.linspace(0.05, 0.4, 4)
MODS = {
    "softcap_causal": lambda s, b, h, q, k: jnp.where(q >= k, 30 * jnp.tanh(s / 30), -jnp.inf),
    "alibi_batch": lambda s, b, h, q, k: s + SLOPES[h] * (k - q) + 0.25 * b,
}


def _grads(impl, mod, q, k, v, do):
    def f(q, k, v):
        return scoremod.attention(q, k, v, mod, implementation=impl)

    o, vjp = jax.vjp(f, q, k, v)
    return (o,) + vjp(do)


def _check(got, want, dtype=jnp.bfloat16):
    for name, g, w in zip(("O", "dQ", "dK", "dV"), got, want):
        assert _rel_err(g, w) < TOL[dtype], (name, _rel_err(g, w))


@pytest.mark.parametrize("name", sorted(MODS))
def test_a_shards_call_with_global_offsets(name):
    """What one device runs under context and batch/head parallelism: its rows
    (queries 128..255 of 256, batch 1 of 2, heads 2..3 of 4) against all keys,
    with the mod's q_idx, b and h shifted to global values by ``offset``."""
    mod = scoremod.trace(MODS[name])
    q, k, v, do = _inputs(2, 256, 256, 4, 4, 64, jnp.bfloat16)
    rows = (slice(1, 2), slice(128, 256), slice(2, 4))
    expr = sharding.shifted(mod.expr, {"b": 1, "h": 2, "q_idx": 128},
                            keep=set())  # operands read at global indices
    shard_mod = mod.derived(expr)
    kv = (slice(1, 2), slice(None), slice(2, 4))
    got = jax.jit(lambda *a: _grads("cudnn", shard_mod, *a))(q[rows], k[kv], v[kv], do[rows])
    want = jax.jit(lambda *a: _grads("xla", mod, *a))(q, k, v, do)
    o, dq = want[0][rows], want[1][rows]
    # dK and dV of the shard are its rows' contribution: compare against the
    # reference restricted to those rows (do zero elsewhere).
    mask = jnp.zeros_like(do).at[rows].set(1)
    part = jax.jit(lambda *a: _grads("xla", mod, *a))(q, k, v, do * mask)
    _check(got, (o, dq, part[2][kv], part[3][kv]))


def test_training_step_on_a_one_device_mesh():
    mesh = Mesh(np.array(jax.devices()[:1]), ("x",))
    mod = scoremod.trace(MODS["softcap_causal"])
    q, k, v, do = _inputs(2, 256, 256, 4, 2, 128, jnp.bfloat16)
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("x")))  # noqa: E731
    got = jax.jit(lambda *a: _grads("cudnn", mod, *a))(*map(put, (q, k, v, do)))
    want = jax.jit(lambda *a: _grads("xla", mod, *a))(q, k, v, do)
    _check(got, want)


def test_vmap_over_two_leading_axes():
    mod = scoremod.trace(MODS["alibi_batch"])
    q, k, v, do = _inputs(2 * 3 * 2, 128, 128, 4, 4, 64, jnp.bfloat16)
    shape = lambda x: x.reshape((2, 3, 2) + x.shape[1:])  # noqa: E731
    q, k, v, do = map(shape, (q, k, v, do))

    def run(impl):
        f = jax.vmap(jax.vmap(lambda q, k, v, do: _grads(impl, mod, q, k, v, do)))
        return jax.jit(f)(q, k, v, do)

    _check(run("cudnn"), run("xla"))


def test_jvp():
    mod = scoremod.trace(MODS["softcap_causal"])
    q, k, v, _ = _inputs(1, 128, 128, 2, 2, 64, jnp.bfloat16)
    f = lambda impl: lambda q: scoremod.attention(q, k, v, mod, implementation=impl)  # noqa: E731
    assert scoremod.which_implementation(q, k, v, mod)[0] == "cudnn"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = jax.jvp(f(None), (q,), (v,))
    assert any("jax.jvp" in str(w.message) for w in caught)
    want = jax.jvp(f("xla"), (q,), (v,))
    assert _rel_err(got[1], want[1]) < 1e-6
    with pytest.raises(CudnnUnavailableError, match="implementation=None"):
        jax.jvp(f("cudnn"), (q,), (v,))


def _loss(impl, mod, k, v, w):
    return lambda q: jnp.sum(scoremod.attention(q, k, v, mod, implementation=impl) * w)


def test_linearize_jvp_of_jit_and_hessian_vector_products():
    """jax.linearize, jax.jvp of a jitted function and forward over reverse
    (a Hessian-vector product): tangents from the reference path with
    implementation=None, with a warning; by name, a ScoreModError."""
    mod = scoremod.trace(MODS["softcap_causal"])
    q, k, v, w = _inputs(1, 128, 128, 2, 2, 64, jnp.bfloat16)
    f = lambda impl: lambda q: scoremod.attention(q, k, v, mod, implementation=impl)  # noqa: E731
    hvp = lambda impl: jax.jit(lambda q, t: jax.jvp(  # noqa: E731
        jax.grad(_loss(impl, mod, k, v, w)), (q,), (t,)))
    runs = {
        "linearize": lambda impl: (lambda y, lin: (y, lin(v)))(*jax.linearize(f(impl), q)),
        "jvp_of_jit": lambda impl: jax.jvp(jax.jit(f(impl)), (q,), (v,)),
        "hvp": lambda impl: hvp(impl)(q, v),
    }
    for name, run in runs.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = run(None)
        assert any("falls back" in str(m.message) for m in caught), name
        want = run("xla")
        for g, x in zip(got, want):
            assert _rel_err(g, x) < TOL[jnp.bfloat16], (name, _rel_err(g, x))
        with pytest.raises(ScoreModError, match="implementation=None"):
            jax.block_until_ready(run("cudnn"))


def _ops(hlo):
    """(cuDNN graph calls, matrix products) in compiled HLO text."""
    return (len(re.findall(r"custom_call_target=\"scoremod_cudnn_execute\"", hlo)),
            len(re.findall(r" dot\(|__cublas", hlo)))


def test_gradient_compiles_to_the_fused_kernels_only():
    """jax.grad runs the fused forward and the fused backward: no matrix product
    beside the kernels (the reference path's backward would add several)."""
    mod = scoremod.trace(MODS["softcap_causal"])
    q, k, v, w = _inputs(2, 256, 256, 4, 2, 64, jnp.bfloat16)
    forward = jax.jit(_loss("cudnn", mod, k, v, w)).lower(q).compile().as_text()
    grad = jax.jit(jax.grad(_loss("cudnn", mod, k, v, w))).lower(q).compile().as_text()
    reference = jax.jit(jax.grad(_loss("xla", mod, k, v, w))).lower(q).compile().as_text()
    (kernels_f, products_f), (kernels_g, products_g) = _ops(forward), _ops(grad)
    assert kernels_g > kernels_f > 0, (kernels_f, kernels_g)
    assert products_g == products_f, (products_f, products_g)
    assert _ops(reference)[1] > 0  # the count sees the reference's products
