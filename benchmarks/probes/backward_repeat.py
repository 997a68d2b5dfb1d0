"""Which gradients repeat bitwise, run after run, on each fused route: cuDNN's
score_mod graphs, jax.nn's cuDNN attention (as a baseline for cuDNN itself), and the
Pallas kernels' Mosaic GPU engine, with and without sinks. One line per case: the
arrays that differed between 5 runs and the largest difference.

    python benchmarks/probes/backward_repeat.py
"""

import jax
import jax.numpy as jnp
import numpy as np

import scoremod

RUNS = 5


def main():
    b, hq, d = 2, 8, 128
    routes = {"cudnn": ("cudnn", None),
              "mosaic": ("pallas", scoremod.LoweringOptions(pallas_engine="mosaic"))}
    for sq, skv in ((512, 512), (256, 640), (4096, 4096)):
        ks = jax.random.split(jax.random.PRNGKey(sq + skv), 4)
        q = jax.random.normal(ks[0], (b, sq, hq, d), jnp.float32).astype(jnp.bfloat16)
        k, v = (jax.random.normal(kk, (b, skv, hq, d), jnp.float32).astype(jnp.bfloat16)
                for kk in ks[1:3])
        do = jax.random.normal(ks[3], (b, sq, hq, d), jnp.float32).astype(jnp.bfloat16)
        off = skv - sq
        mods = {"causal": lambda s, bi, h, qi, ki: jnp.where(qi + off >= ki, s, -jnp.inf),
                "softcap": lambda s, bi, h, qi, ki: 30 * jnp.tanh(s / 30)}
        cases = []
        for name, fn in mods.items():
            mod = scoremod.trace(fn)
            for route, (impl, opts) in routes.items():
                for sinks in (None, jnp.zeros((hq,), jnp.float32)):
                    def loss(q, k, v, mod=mod, impl=impl, opts=opts, sinks=sinks):
                        o = scoremod.attention(q, k, v, mod, implementation=impl, options=opts,
                                               sinks=sinks)
                        return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))
                    cases.append((f"{route} {name}{' sinks' if sinks is not None else ''}", loss))
        def plain(q, k, v):
            o = jax.nn.dot_product_attention(q, k, v, is_causal=sq == skv,
                                             implementation="cudnn")
            return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))
        cases.append(("jax.nn cudnn" + (" causal" if sq == skv else ""), plain))
        for label, loss in cases:
            g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
            try:
                runs = [[np.asarray(x, np.float32) for x in g(q, k, v)] for _ in range(RUNS)]
            except Exception as e:  # a route that refuses the case
                print(f"s{sq}x{skv} {label}: refused ({type(e).__name__})", flush=True)
                continue
            diff = []
            for i, n in enumerate(("dQ", "dK", "dV")):
                m = max(float(np.max(np.abs(r[i] - runs[0][i]))) for r in runs[1:])
                if m:
                    diff.append(f"{n} {m:.2e}")
            print(f"s{sq}x{skv} {label}: " + (", ".join(diff) if diff else "bitwise equal"),
                  flush=True)


if __name__ == "__main__":
    main()
