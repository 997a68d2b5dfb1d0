"""Probe: the cost of building a block map (scoremod/lowering/block_maps.py).

Times ``block_map`` under ``jax.jit`` (operands as arguments, after a warm-up
call) for the masks of the block-sparse backend at several sequence lengths,
and prints milliseconds per build with the share of tiles visited and full.
Run on a GPU it times the GPU (the map is built where the attention runs);
``--exact`` also times the per-tile evaluation (``exact="always"``), the
O(S^2) path of masks the interval rules bound loosely.

    python benchmarks/probes/block_map_cost.py [--seq 4096 32768] [--block 128] [--exact]
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import scoremod
from scoremod.lowering.block_maps import block_map
from scoremod.lowering.problem import Problem


def mods(seq, batch):
    doc = jnp.asarray(np.repeat(np.arange(4), -(-seq // 4))[None, :seq].repeat(batch, 0),
                      jnp.int32)
    neg = -jnp.inf
    return {
        "causal": scoremod.trace(lambda s, b, h, q, k: jnp.where(q >= k, s, neg)),
        "sliding_window_1024": scoremod.trace(
            lambda s, b, h, q, k: jnp.where((q >= k) & (q - k < 1024), s, neg)),
        "document_4": scoremod.trace(
            lambda s, b, h, q, k: jnp.where(doc[b, q] == doc[b, k], s, neg)),
        "document_4_causal": scoremod.trace(
            lambda s, b, h, q, k: jnp.where((doc[b, q] == doc[b, k]) & (q >= k), s, neg)),
        "prefix_lm_1024": scoremod.trace(
            lambda s, b, h, q, k: jnp.where((k < 1024) | (q >= k), s, neg)),
    }


def time_build(mod, problem, block, exact, repeats):
    fn = jax.jit(lambda ops: block_map(mod.expr, ops, problem, block, block, exact=exact))
    m = jax.block_until_ready(fn(mod.operands))  # compile and warm up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(mod.operands))
        times.append(time.perf_counter() - t)
    tiles = m.q_blocks.size
    visited = int(m.q_counts.sum())
    full = int(jnp.sum(m.q_full & (jnp.arange(m.q_full.shape[-1]) < m.q_counts[..., None])))
    return 1e3 * min(times), 1e3 * float(np.median(times)), visited / tiles, full / tiles


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--exact", action="store_true", help="also time exact='always'")
    args = parser.parse_args()
    print(f"device: {jax.devices()[0].device_kind}; batch {args.batch}, heads {args.heads}, "
          f"block {args.block}")
    print(f"{'mod':22} {'seq':>6} {'exact':>6} {'map':>12} {'min ms':>8} {'median ms':>9} "
          f"{'visited':>8} {'full':>6}")
    for seq in args.seq:
        problem = Problem(args.batch, seq, seq, args.heads, args.heads, 128, 128, "bfloat16")
        for name, mod in mods(seq, args.batch).items():
            for exact in ("auto", "always") if args.exact else ("auto",):
                best, median, visited, full = time_build(mod, problem, args.block, exact,
                                                         args.repeats)
                m = jax.eval_shape(lambda ops: block_map(mod.expr, ops, problem, args.block,
                                                         args.block), mod.operands)
                print(f"{name:22} {seq:>6} {exact:>6} {str(m.q_blocks.shape):>12} {best:8.3f} "
                      f"{median:9.3f} {visited:8.3f} {full:6.3f}")


if __name__ == "__main__":
    main()
