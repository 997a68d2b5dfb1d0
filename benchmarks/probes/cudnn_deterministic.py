"""Whether cuDNN's backward repeats bitwise with the frontend's
``sdpa_backward(use_deterministic_algorithm=True)``, and at what cost (needs a GPU
and the cuDNN frontend). scoremod's graphs are built as shipped, each variant in a
fresh process (the graph caches do not know the flag), with the flag added to every
backward graph for the second. One line per case: the dQ/dK/dV differences between
5 runs, and the fwd+bwd time.

    python benchmarks/probes/cudnn_deterministic.py
"""

import os
import subprocess
import sys
from pathlib import Path

RUNS = 5


def child(deterministic):
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from ffi_overhead import time_jax

    import scoremod

    if deterministic:
        import cudnn

        plain = cudnn.pygraph.sdpa_backward

        def sdpa_backward(self, *args, **kwargs):
            return plain(self, *args, use_deterministic_algorithm=True, **kwargs)

        cudnn.pygraph.sdpa_backward = sdpa_backward
    mods = {
        "softcap": lambda s, b, h, q, k: 30 * jnp.tanh(s / 30),
        "causal": lambda s, b, h, q, k: jnp.where(q >= k, s, -jnp.inf),
        "softcap_causal": lambda s, b, h, q, k: jnp.where(q >= k, 30 * jnp.tanh(s / 30), -jnp.inf),
    }
    for b, s, h in ((2, 640, 8), (4, 4096, 16)):
        ks = jax.random.split(jax.random.PRNGKey(s), 4)
        q, k, v, do = (jax.random.normal(x, (b, s, h, 128), jnp.float32).astype(jnp.bfloat16)
                       for x in ks)
        for name, fn in mods.items():
            mod = scoremod.trace(fn)

            def loss(q, k, v, mod=mod):
                o = scoremod.attention(q, k, v, mod, implementation="cudnn")
                return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

            grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            label = f"{'deterministic' if deterministic else 'default'} s{s} {name}"
            try:
                runs = [[np.asarray(x, np.float32) for x in grad(q, k, v)] for _ in range(RUNS)]
            except Exception as e:  # the flag refused by this cuDNN for this graph
                print(f"{label}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            diff = [f"{n} {max(float(np.abs(r[i] - runs[0][i]).max()) for r in runs[1:]):.1e}"
                    for i, n in enumerate(("dQ", "dK", "dV"))]
            ms = time_jax(grad, q, k, v, iters=10, reps=5)[0]
            print(f"{label}: {', '.join(diff)}; fwd+bwd {ms:.3f} ms", flush=True)


def main():
    if len(sys.argv) > 1:
        return child(sys.argv[1] == "1")
    env = dict(os.environ, SCOREMOD_CACHE_DIR="")  # no on-disk graphs from another variant
    for flag in ("0", "1"):
        subprocess.run([sys.executable, __file__, flag], env=env, check=False)


if __name__ == "__main__":
    main()
