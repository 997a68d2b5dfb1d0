"""Which spelling of ALiBi the Mosaic GPU kernels run fastest (needs a Hopper GPU):
whether per-axis vectors or a value per diagonal would bring ALiBi's forward to
the engine's speed without a mod (issue 35: ALiBi at 1.07x FlexAttention's forward,
target 1.2x; FlexAttention 1.263 ms at this shape).

Forms, each on ``implementation="pallas"`` (the Mosaic GPU engine), forward and
fwd+bwd (gradients of q, k, v), with O's largest difference from the first form:

- ``written``: ``s + slope[h] * (kv - q)`` (what users write; per score two index
  tiles, a subtraction, a cast, a multiply, an add);
- ``vectors``: ``s + kb[h, kv] - qb[h, q]`` with ``kb = slope * kv``, ``qb = slope * q``
  computed ahead (two vector reads: a broadcast add each);
- ``keys``: ``s + kb[h, kv]`` (the query's term dropped: each row's softmax is the
  same, its LSE shifts by ``qb``);
- ``diagonal``: ``s + t[h, kv - q + S - 1]`` with ``t = slope * (kv - q)`` per diagonal
  (the relative-bias path);
- ``none``: no mod (the engine's own speed);
- ``fold``: ``implementation=None`` on ALiBi as written (today's route: the low-rank
  fold on cuDNN);
- ``graph``: ``implementation=None`` with the fold off (cuDNN's score_mod graph);
- ``mixed``: the same with ``mosaic_forward=True`` (the Mosaic forward beside cuDNN's
  backward).

    python benchmarks/probes/alibi_forms.py [--seq 4096]
"""

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ffi_overhead import bf16_inputs, shape_arguments, time_jax  # noqa: E402

import scoremod  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shape_arguments(ap)
    a = ap.parse_args(argv)
    b, s, h, d = a.batch, a.seq, a.heads, a.head_dim
    q, k, v = bf16_inputs(b, s, h, d)
    slopes = jnp.asarray([2.0 ** (-8.0 * (i + 1) / h) for i in range(h)], jnp.float32)
    pos = jnp.arange(s, dtype=jnp.float32)
    kb = qb = slopes[:, None] * pos[None, :]
    t = slopes[:, None] * jnp.arange(-(s - 1), s, dtype=jnp.float32)[None, :]
    forms = {
        "written": (lambda sc, bi, hi, qi, ki: sc + slopes[hi] * (ki - qi), "pallas"),
        "vectors": (lambda sc, bi, hi, qi, ki: sc + kb[hi, ki] - qb[hi, qi], "pallas"),
        "keys": (lambda sc, bi, hi, qi, ki: sc + kb[hi, ki], "pallas"),
        "diagonal": (lambda sc, bi, hi, qi, ki: sc + t[hi, ki - qi + s - 1], "pallas"),
        "none": (None, "pallas"),
        "fold": (lambda sc, bi, hi, qi, ki: sc + slopes[hi] * (ki - qi), None),
        "graph": (lambda sc, bi, hi, qi, ki: sc + slopes[hi] * (ki - qi), None),
        "mixed": (lambda sc, bi, hi, qi, ki: sc + slopes[hi] * (ki - qi), None),
    }
    options = {"graph": scoremod.LoweringOptions(low_rank_bias=False),
               "mixed": scoremod.LoweringOptions(low_rank_bias=False, mosaic_forward=True)}
    want = None
    for name, (mod, impl) in forms.items():
        opts = options.get(name)
        try:
            fwd = jax.jit(lambda q, k, v, mod=mod, impl=impl, opts=opts: scoremod.attention(
                q, k, v, mod, implementation=impl, options=opts))
            grad = jax.jit(jax.grad(lambda q, k, v, mod=mod, impl=impl, opts=opts: jnp.sum(
                scoremod.attention(q, k, v, mod, implementation=impl, options=opts).astype(
                    jnp.float32)), argnums=(0, 1, 2)))
            o = fwd(q, k, v).astype(jnp.float32)
            want = o if want is None else want
            err = float(jnp.max(jnp.abs(o - want)))
            f = time_jax(fwd, q, k, v, iters=20, reps=5)[0]
            fb = time_jax(grad, q, k, v, iters=10, reps=5)[0]
            route = scoremod.which_implementation(q, k, v, mod, implementation=impl,
                                                  options=opts)
            print(f"{name:9s} fwd {f:.3f} ms, fwd+bwd {fb:.3f} ms, |O - written| {err:.2e} "
                  f"[{route[0]}: {(route.variant or 'as it is')[:100]}]", flush=True)
        except Exception as e:  # a form a route refuses: say so, go on
            print(f"{name:9s} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
    main()
