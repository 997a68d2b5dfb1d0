"""Which change made softcap+causal fwd+bwd slower: one variant per process.

    python benchmarks/probes/split_variants.py            # all variants, twice each, interleaved
    python benchmarks/probes/split_variants.py --variant tanh-1-y2   # one, in this process

Variants (each undoes one change of the lowering, in this process only):
  current      the lowering as it is
  tanh-1-y2    tanh's derivative written g * (1 - y*y) instead of g * ((y + 1) * (1 - y))
  unwrapped    the fused calls without lowering.sharding's custom_partitioning / custom_vmap
  both         the two above together
Each process times scoremod and jax.nn's cuDNN (is_causal) fwd+bwd at b4 h16 s4096 d128 bf16,
median and min of --reps repetitions, and prints one line; the plan cache is off.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

VARIANTS = ("current", "tanh-1-y2", "unwrapped", "both")


def patch(variant):
    import dataclasses

    from scoremod.dsl import ops

    if variant in ("tanh-1-y2", "both"):
        old = ops.OPS["tanh"]
        ops.OPS["tanh"] = dataclasses.replace(old, vjp=lambda y, g: (g * (1.0 - y * y),))
    if variant in ("unwrapped", "both"):
        from scoremod.lowering import sharding

        sharding.forward = lambda st, q, k, v, opr: st.backend.forward(st.plan, q, k, v, opr)
        sharding.backward = lambda st, q, k, v, o, lse, do, opr: tuple(
            st.backend.backward(st.plan, q, k, v, o, lse, do, opr))


def one(variant, reps, iters):
    patch(variant)
    import jax
    import jax.numpy as jnp

    import scoremod

    b, h, s, d = 4, 16, 4096, 128
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(x, (b, s, h, d), jnp.bfloat16) for x in keys)

    def mod(sc, b, h, qi, ki):
        return jnp.where(qi >= ki, 30.0 * jnp.tanh(sc / 30.0), -jnp.inf)

    def steps(fn):
        def step(q, k, v, do):
            o, vjp = jax.vjp(fn, q, k, v)
            return (o, *vjp(do))
        return jax.jit(step)

    calls = {
        "scoremod": steps(lambda q, k, v: scoremod.attention(q, k, v, mod, implementation="cudnn")),
        "jax-cudnn": steps(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn")),
    }
    out = {"variant": variant}
    for name, f in calls.items():
        jax.block_until_ready(f(q, k, v, do))
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(iters):
                r = f(q, k, v, do)
            jax.block_until_ready(r)
            times.append((time.perf_counter() - t0) / iters * 1e3)
        times.sort()
        out[name] = {"median": times[len(times) // 2], "min": times[0]}
    if variant == "current" or variant == "unwrapped":
        hlo = calls["scoremod"].lower(q, k, v, do).compile().as_text()
        out["hlo_custom_calls"] = hlo.count("custom-call(")
        out["hlo_fusions"] = hlo.count(" fusion(")
        out["hlo_copies"] = hlo.count(" copy(")
    print(json.dumps(out), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", choices=VARIANTS)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    if a.variant:
        return one(a.variant, a.reps, a.iters)
    env = dict(os.environ, SCOREMOD_PLAN_CACHE="0")
    for _ in range(a.rounds):
        for variant in VARIANTS:
            subprocess.run([sys.executable, __file__, "--variant", variant, "--reps", str(a.reps),
                            "--iters", str(a.iters)], env=env, check=False)


if __name__ == "__main__":
    main()
