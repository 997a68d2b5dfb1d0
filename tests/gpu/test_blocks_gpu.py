"""The block map built on the GPU: sound against brute force (as on CPU), and
the same map as the CPU builds, at a small and a production shape."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scoremod
from scoremod.lowering.block_maps import block_map
from scoremod.lowering.problem import Problem
from tests import test_blocks

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", sorted(test_blocks.MODS))
def test_sound_on_the_gpu(name):
    fn, tight = test_blocks.MODS[name]
    assert jax.devices()[0].platform == "gpu"
    test_blocks.check(scoremod.trace(fn), test_blocks.problem(sq=40, skv=27), 6, 5, tight=tight)


@pytest.mark.parametrize("exact", ["auto", "always"])
def test_gpu_map_equals_cpu_map(exact):
    seq = 4096
    doc = jnp.asarray(np.sort(np.random.default_rng(0).integers(0, 7, (2, seq)), axis=1),
                      jnp.int32)
    mod = scoremod.trace(lambda s, b, h, q, k: jnp.where(
        (doc[b, q] == doc[b, k]) & (q >= k) & ((q - k) % 3 != 1), s, -jnp.inf))
    p = Problem(2, seq, seq, 8, 8, 128, 128, "bfloat16")
    build = jax.jit(lambda ops: block_map(mod.expr, ops, p, 128, 64, exact=exact))
    on_gpu = build(mod.operands)
    cpu = jax.devices("cpu")[0]
    on_cpu = build(jax.device_put(mod.operands, cpu))
    for a, b in zip(on_gpu, on_cpu):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
