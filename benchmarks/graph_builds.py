"""Where a first call's time goes: each cuDNN graph build, in order (needs an NVIDIA GPU).

A split mod builds one forward and one backward graph per query block. cuDNN
compiles a kernel once per graph *structure* and reuses it for graphs that
differ only in shapes or pass-by-value scalars, so the per-graph times show
how many distinct structures a call pays for.

    python benchmarks/graph_builds.py               # softcap+causal, batch 4, 16 heads, d 128
    python benchmarks/graph_builds.py --seqs 4096,8192 --head-dim 64
"""

import argparse
import time

import jax
import jax.numpy as jnp

import scoremod
from scoremod.lowering.cudnn import graph as cudnn_graph


def softcap_causal(score, b, h, q_idx, kv_idx):
    return jnp.where(q_idx >= kv_idx, 30 * jnp.tanh(score / 30), -jnp.inf)


def first_call(seq, head_dim, *, backward, batch=4, heads=16):
    """(seconds of the first call, [(direction, seconds, plan) per graph built by it])."""
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(x, (batch, seq, heads, head_dim), jnp.bfloat16) for x in ks)

    def attend(q, k, v):
        return scoremod.attention(q, k, v, softcap_causal, implementation="cudnn")

    fn = attend
    if backward:
        fn = jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    before = set(cudnn_graph.cache_entries())
    t0 = time.perf_counter()
    jax.block_until_ready(jax.jit(fn)(q, k, v))
    seconds = time.perf_counter() - t0
    built = [(key[0], built) for key, built in cudnn_graph.cache_entries().items() if key not in before]
    return seconds, [(direction, b.seconds, b.plan) for direction, b in built]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="4096,8192", help="comma list, run in this order")
    ap.add_argument("--head-dim", type=int, default=128)
    a = ap.parse_args(argv)
    for seq in (int(s) for s in a.seqs.split(",")):
        for backward in (False, True):  # the forward's graphs are cached when fwd+bwd runs
            try:
                seconds, builds = first_call(seq, a.head_dim, backward=backward)
            except scoremod.CudnnUnavailableError as e:
                raise SystemExit(f"graph_builds.py needs the fused path: {e}") from None
            per_graph = ", ".join(f"{s:.3f}" for _, s, _ in builds)
            plans = sorted({p for _, _, p in builds})
            print(f"seq {seq} d {a.head_dim} {'fwd+bwd' if backward else 'fwd'}: first call "
                  f"{seconds:.2f} s; {len(builds)} graphs built in "
                  f"{sum(s for _, s, _ in builds):.2f} s: [{per_graph}]; plans {plans}", flush=True)


if __name__ == "__main__":
    main()
