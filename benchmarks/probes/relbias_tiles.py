"""Where a relative-bias table's time goes on the Mosaic GPU engine (needs a Hopper
GPU): relbias forward and fwd+bwd (its table a value per diagonal), the backward
split into its dQ and dK/dV kernels (the gradients of q alone, of k and v alone), ALiBi
on the same engine as the engine's speed without such tiles, and the cost of building them
(one vector per head).

    python benchmarks/probes/relbias_tiles.py [--seq 4096]
"""

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ffi_overhead import time_jax  # noqa: E402

import scoremod  # noqa: E402
from scoremod.lowering.pallas import codegen, mosaic  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=4096)
    a = ap.parse_args(argv)
    b, s, h, d = a.batch, a.seq, a.heads, 128
    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    q, k, v = (jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(jnp.bfloat16)
               for kk in ks[:3])
    table = jax.random.normal(ks[3], (h, 2 * s - 1), jnp.float32)
    slopes = jnp.asarray([2.0 ** -(i + 1) for i in range(h)], jnp.float32)
    mods = {"relbias": lambda sc, bi, hi, qi, ki: sc + table[hi, qi - ki + s - 1],
            "alibi": lambda sc, bi, hi, qi, ki: sc + slopes[hi] * (ki - qi)}

    def grad(mod, argnums):
        return jax.jit(jax.grad(lambda q, k, v: jnp.sum(scoremod.attention(
            q, k, v, mod, implementation="pallas").astype(jnp.float32)), argnums=argnums))

    for name, mod in mods.items():
        fwd = jax.jit(lambda q, k, v: scoremod.attention(q, k, v, mod, implementation="pallas"))
        line = [f"fwd {time_jax(fwd, q, k, v, iters=20, reps=5)[0]:.3f} ms"]
        # The gradient of q alone runs the forward and the dQ kernel, of k and v alone
        # the forward and the dK/dV kernel (XLA drops the kernel whose results go unused).
        for argnums, what in (((0, 1, 2), "fwd+bwd"), ((0,), "fwd+dQ"), ((1, 2), "fwd+dK/dV")):
            med = time_jax(grad(mod, argnums), q, k, v, iters=10, reps=5)[0]
            line.append(f"{what} {med:.3f} ms")
        print(f"{name}: " + ", ".join(line), flush=True)
    read = mosaic.offset_reads(scoremod.trace(mods["relbias"]).expr)
    src = mosaic.offset_sources(read)
    flat = (codegen.kernel_operand(table, scoremod.trace(mods["relbias"]).operand_nodes[0]),)
    for rows, cols, what in ((128, 128, "the forward"), (64, 64, "dQ, dK/dV each")):
        build = jax.jit(lambda t: mosaic.OffsetDiagonals.build(
            src, ("c0",), (t,), 1, h, rows, cols, s, s).arrays[0])
        med, _, _ = time_jax(build, flat[0], iters=20, reps=5)
        print(f"diagonals for {what}: {med:.3f} ms, {build(flat[0]).nbytes / 2**10:.0f} KiB")

if __name__ == "__main__":
    main()
