"""What a relative-bias table costs in GPU memory beyond the tensors of attention itself
(needs a GPU): for each seq, the fwd+bwd program's temporary bytes (XLA's memory
analysis of the compiled program) and the device's peak bytes in use after one run,
against q, k, v, o and their gradients. O(S) per head means the extra grows linearly
with seq (x2 per doubling), never x4. ``--learn-table`` takes the table's gradient too
(its partial sums per key block are O(S^2 / 128) per head).

    python benchmarks/probes/relbias_memory.py [--seqs 16384,32768,65536] [--batch 1] [--learn-table]
"""

import argparse
import json

import jax
import jax.numpy as jnp

import scoremod


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="16384,32768,65536")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--learn-table", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    rows = []
    for s in (int(x) for x in a.seqs.split(",")):
        b, h, d = a.batch, a.heads, 128
        ks = jax.random.split(jax.random.PRNGKey(0), 4)
        q, k, v = (jax.random.normal(kk, (b, s, h, d), jnp.bfloat16) for kk in ks[:3])
        table = jax.random.normal(ks[3], (h, 2 * s - 1), jnp.float32)

        def loss(q, k, v, table):
            mod = lambda sc, bi, hi, qi, ki: sc + table[hi, qi - ki + s - 1]  # noqa: E731
            return jnp.sum(scoremod.attention(q, k, v, mod).astype(jnp.float32))

        step = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3) if a.learn_table else (0, 1, 2)))
        compiled = step.lower(q, k, v, table).compile()
        analysis = compiled.memory_analysis()
        temp = getattr(analysis, "temp_size_in_bytes", None)
        jax.block_until_ready(compiled(q, k, v, table))
        stats = jax.devices()[0].memory_stats() or {}
        tensors = 8 * q.nbytes  # q, k, v, o, dO and dq, dk, dv (dO is the ones of the sum)
        row = dict(seq=s, batch=b, heads=h, learn_table=a.learn_table, temp_bytes=temp,
                   peak_bytes=stats.get("peak_bytes_in_use"), qkvo_and_grads_bytes=tensors,
                   table_bytes=table.nbytes,
                   route=scoremod.which_implementation(q, k, v, lambda sc, bi, hi, qi, ki:
                                                       sc + table[hi, qi - ki + s - 1])[0])
        rows.append(row)
        print(json.dumps(row), flush=True)
        del compiled, step, q, k, v, table
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
