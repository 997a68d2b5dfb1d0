"""What the sinks' gradient costs beside a fused backward, and whether another
form of the same sum runs faster: ``lowering/sinks.gradient`` (one fused
reduction of dO * O over the head dim, then of P_sink * D over the queries),
the same with D = rowsum(dO * O) [b, s, h] materialized first (a row reduction
over the contiguous head dim, then a small one), and with P_sink moved into D's
[b, s, h] layout instead of D into [b, h, s], each against a float64 sum.

    python benchmarks/probes/sinks_gradient.py [--reps 5]

At b4 h16 s4096 d128 bfloat16, each form alone under jit, median over --reps
runs of 20 calls after a warm-up (``pallas_mgpu_smoke.timed``), with the GB/s of
its reads (dO and O).
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import pallas_mgpu_smoke as smoke  # this folder's (a script's folder is on sys.path)
from scoremod.lowering import sinks as attention_sinks

F32 = jnp.float32


def two_step(o, lse, do, dlse, sinks):
    """D materialized as [b, h, s] float32 before the sum over the queries."""
    s = sinks.astype(F32)[:, :, None]
    p_sink = jnp.where(s == -jnp.inf, 0.0, jnp.exp(s - lse.astype(F32)))
    o32 = jnp.where(jnp.isnan(o), 0.0, o.astype(F32))
    d = jnp.sum(do.astype(F32) * o32, axis=-1)  # [b, s, h]: a row reduction
    d = jax.lax.optimization_barrier(jnp.swapaxes(d, 1, 2))  # not fused into the next sum
    if dlse is not None:
        d = d - dlse.astype(F32)
    return jnp.sum(p_sink * -d, axis=-1)


def rows_layout(o, lse, do, dlse, sinks):
    """D kept in dO's [b, s, h] layout, P_sink moved there instead (a [b, h, s]
    float32, 1/64 of dO's bytes): one reduction over the head dim, then over s."""
    s = sinks.astype(F32)[:, None, :]
    p_sink = jnp.where(s == -jnp.inf, 0.0, jnp.exp(s - jnp.swapaxes(lse.astype(F32), 1, 2)))
    o32 = jnp.where(jnp.isnan(o), 0.0, o.astype(F32))
    d = jnp.sum(do.astype(F32) * o32, axis=-1)  # [b, s, h]
    if dlse is not None:
        d = d - jnp.swapaxes(dlse.astype(F32), 1, 2)
    return jnp.sum(p_sink * -d, axis=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    b, s, h, d = 4, 4096, 16, 128
    ks = jax.random.split(jax.random.key(0), 4)
    o, do = (jax.random.normal(x, (b, s, h, d), jnp.bfloat16) for x in ks[:2])
    lse = jax.random.normal(ks[2], (b, h, s), F32) + 8.0
    sinks = jax.random.normal(ks[3], (b, h), F32)
    o64, do64 = np.asarray(o, np.float64), np.asarray(do, np.float64)
    want = -(np.exp(np.asarray(sinks, np.float64)[:, :, None] - np.asarray(lse, np.float64))
             * np.einsum("bshd,bshd->bhs", do64, o64)).sum(-1)
    gbytes = 2 * o.size * 2 / 1e9
    for name, fn in (("sinks.gradient", attention_sinks.gradient), ("two steps", two_step),
                     ("rows layout", rows_layout)):
        f = jax.jit(lambda o, lse, do, sinks, fn=fn: fn(o, lse, do, None, sinks))
        _, t = smoke.timed(f, (o, lse, do, sinks), args.reps, calls=20)
        err = float(np.max(np.abs(np.asarray(f(o, lse, do, sinks), np.float64) - want))
                    / np.max(np.abs(want)))
        print(f"{name:15s} {t * 1e6:8.1f} us, {gbytes / t:7.1f} GB/s of dO and O, "
              f"relative error {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
