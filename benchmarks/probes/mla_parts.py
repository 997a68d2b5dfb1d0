"""Where MLA's forward time goes (needs an NVIDIA GPU): the whole call, the fold's
concatenation alone, scoremod's cuDNN call on q and k already augmented, and JAX's
cuDNN call (v at head dim D) on the same arrays, with the cuDNN plan names.

    python benchmarks/probes/mla_parts.py [--seq 4096]
"""

import argparse
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ffi_overhead import shape_arguments, time_jax  # noqa: E402

import scoremod  # noqa: E402
from scoremod.lowering import lowrank  # noqa: E402
from scoremod.lowering.cudnn import graph as cudnn_graph  # noqa: E402
from scoremod.lowering.problem import Problem  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shape_arguments(ap)
    a = ap.parse_args(argv)
    b, s, h, d, r = a.batch, a.seq, a.heads, a.head_dim, 64
    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    q, k, v = (jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(jnp.bfloat16)
               for kk in ks[:3])
    q_pe = jax.random.normal(ks[3], (b, s, h, r), jnp.float32).astype(jnp.bfloat16)
    k_pe = jax.random.normal(ks[4], (b, s, r), jnp.float32).astype(jnp.bfloat16)
    mla = scoremod.trace(lambda sc, bi, hi, qi, ki: jnp.where(qi >= ki, sc + jnp.dot(
        q_pe[bi, qi, hi].astype(jnp.float32), k_pe[bi, ki].astype(jnp.float32)), -jnp.inf))
    causal = scoremod.trace(lambda sc, bi, hi, qi, ki: jnp.where(qi >= ki, sc, -jnp.inf))
    scale = 1.0 / math.sqrt(d)
    found = lowrank.find(mla, Problem.of(q, k, v), scale)  # what the route moves into q and k
    operands = dict(zip(mla.operand_names, (jnp.asarray(x) for x in mla.operands)))
    fold = jax.jit(lambda q, k: lowrank.augment(found, q, k, operands, scale))
    qa, ka = jax.block_until_ready(fold(q, k))
    print(f"augmented q {qa.shape} k {ka.shape}")

    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    rows = {
        "scoremod MLA (fold + cuDNN)": (jax.jit(lambda q, k, v: scoremod.attention(
            q, k, v, mla, implementation="cudnn")), (q, k, v)),
        "fold alone (concatenations)": (fold, (q, k)),
        "scoremod causal on augmented q, k": (jax.jit(lambda q, k, v: scoremod.attention(
            q, k, v, causal, scale=scale, implementation="cudnn")), (qa, ka, v)),
        "scoremod causal as a score_mod (no native mask)": (jax.jit(
            lambda q, k, v: scoremod.attention(
                q, k, v, causal, scale=scale, implementation="cudnn",
                options=scoremod.LoweringOptions(native_masks=False))), (qa, ka, v)),
        "JAX cuDNN, v at D, causal": (jax.jit(lambda q, k, v: dot_product_attention(
            q, k, v, scale=scale, mask_type=MaskType.CAUSAL)), (qa, ka, v)),
        "JAX cuDNN at D=128, causal (no rope)": (jax.jit(lambda q, k, v: dot_product_attention(
            q, k, v, scale=scale, mask_type=MaskType.CAUSAL)), (q, k, v)),
        "scoremod causal at D=128 (no rope)": (jax.jit(lambda q, k, v: scoremod.attention(
            q, k, v, causal, scale=scale, implementation="cudnn")), (q, k, v)),
    }
    for name, (fn, args) in rows.items():
        med, lo, hi = time_jax(fn, *args)
        print(f"  {name:50s} {med:7.3f} ms ({lo:.3f}-{hi:.3f})")
    for key, built in cudnn_graph.cache_entries().items():
        print(f"  graph {key[0]}: plan {built.plan}, workspace {built.workspace}")


if __name__ == "__main__":
    main()
