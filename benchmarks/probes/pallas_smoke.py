"""Probe: the Pallas backend on a GPU: compile, time, and check against the reference.

    python benchmarks/probes/pallas_smoke.py [--seq 4096] [--reps 10]

1. Errors at a small shape (b2 h4 s512 d128 bfloat16, GQA 2:1): O, LSE, dQ, dK,
   dV of softcap and causal (on the dense map and on a causal map that skips
   the masked tiles) relative to each reference result's largest magnitude.
2. Times at b4 h16 s4096 d128 bfloat16 (median of --reps calls after one
   warm-up; first call timed apart): forward and forward+backward (one jax.vjp
   and its pullback in one jit) of softcap and causal on Pallas, with cuDNN
   (scoremod's fused path and jax.nn.dot_product_attention) beside it.
   TF/s count dense FLOPs (4*B*H*S*S*D forward, 3.5x that for fwd+bwd).
3. With --sweep: softcap's forward and forward+backward at that shape for
   several tiles, warps and pipeline depths (LoweringOptions' pallas_* fields).
"""

import argparse
import dataclasses
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import scoremod
from scoremod.lowering.block_maps import BlockMap, num_blocks
from scoremod.lowering.pallas.backend import PALLAS
from scoremod.lowering.problem import Problem

warnings.simplefilter("ignore")

MODS = {
    "softcap": lambda s, b, h, q, k: 30.0 * jnp.tanh(s / 30.0),
    "causal": lambda s, b, h, q, k: jnp.where(q >= k, s, -jnp.inf),
}


def causal_map(problem, block_q, block_kv, operands):
    """The tiles with some q >= k (top-left aligned, as the mod)."""
    del operands
    nq, nk = num_blocks(problem.sq, block_q), num_blocks(problem.skv, block_kv)
    i = jnp.arange(nq, dtype=jnp.int32)[:, None]
    j = jnp.arange(nk, dtype=jnp.int32)[:, None]
    q_counts = jnp.minimum(nk, ((i[:, 0] + 1) * block_q - 1) // block_kv + 1)
    q_blocks = jnp.minimum(jnp.arange(nk, dtype=jnp.int32)[None, :], q_counts[:, None] - 1)
    first = (j[:, 0] * block_kv) // block_q
    kv_counts = jnp.maximum(nq - first, 0)
    kv_blocks = jnp.minimum(first[:, None] + jnp.arange(nq, dtype=jnp.int32)[None, :], nq - 1)
    lead = lambda x: x[None, None]  # noqa: E731
    return BlockMap(lead(q_counts), lead(q_blocks), lead(jnp.zeros((nq, nk), bool)),
                    lead(kv_counts), lead(kv_blocks), lead(jnp.zeros((nk, nq), bool)))


def pallas_fn(name, q, k, v, skip, options=None):
    mod = scoremod.trace(MODS[name])
    plan = PALLAS.plan(Problem.of(q, k, v), mod, 1 / np.sqrt(q.shape[-1]),
                       options or scoremod.LoweringOptions(), True)
    if skip:
        plan = dataclasses.replace(plan, block_map=causal_map)
    return lambda q, k, v: PALLAS.forward(plan, q, k, v, ())


def reference_fn(name):
    return lambda q, k, v: scoremod.attention(q, k, v, MODS[name], implementation="xla",
                                              return_lse=True)


def inputs(b, s, hq, hkv, d, dtype=jnp.bfloat16):
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    return tuple(jax.random.normal(key, shape, jnp.float32).astype(dtype) for key, shape in
                 zip(ks, [(b, s, hq, d), (b, s, hkv, d), (b, s, hkv, d), (b, s, hq, d)]))


def results(fn, q, k, v, do):
    (o, lse), vjp = jax.vjp(fn, q, k, v)
    return (o, lse) + tuple(vjp((do, jnp.zeros_like(lse))))


def errors():
    q, k, v, do = inputs(2, 512, 4, 2, 128)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    for name in MODS:
        want = jax.jit(lambda *a: results(reference_fn(name), *a))(f32(q), f32(k), f32(v), f32(do))
        for skip in ((False, True) if name == "causal" else (False,)):
            got = jax.jit(lambda *a: results(pallas_fn(name, q, k, v, skip), *a))(q, k, v, do)
            errs = {}
            for label, a, b in zip(("O", "LSE", "dQ", "dK", "dV"), got, want):
                a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
                fin = np.isfinite(b)
                errs[label] = float(np.max(np.abs(a[fin] - b[fin])) / np.max(np.abs(b[fin])))
            print(f"errors {name}{' (causal map)' if skip else ''}: "
                  + ", ".join(f"{k} {e:.2e}" for k, e in errs.items()), flush=True)


def timed(f, args, reps):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    first = time.perf_counter() - t
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return first, float(np.median(times))


def speeds(seq, reps):
    b, h, d = 4, 16, 128
    q, k, v, do = inputs(b, seq, h, h, d)
    flops = 4 * b * h * seq * seq * d
    for name in MODS:
        impls = {"pallas": pallas_fn(name, q, k, v, False)}
        if name == "causal":
            impls["pallas (causal map)"] = pallas_fn(name, q, k, v, True)
        impls["cudnn (scoremod)"] = lambda q, k, v, name=name: (
            scoremod.attention(q, k, v, MODS[name], implementation="cudnn"), None)
        impls["jax.nn cudnn"] = lambda q, k, v, name=name: (jax.nn.dot_product_attention(
            q, k, v, implementation="cudnn", is_causal=name == "causal"), None)
        for label, fn in impls.items():
            fwd = jax.jit(lambda q, k, v, fn=fn: fn(q, k, v)[0])

            def step(q, k, v, do, fn=fn):
                o, vjp = jax.vjp(lambda q, k, v: fn(q, k, v)[0], q, k, v)
                return (o, *vjp(do))

            for direction, f, args, factor in (("fwd", fwd, (q, k, v), 1.0),
                                               ("fwd+bwd", jax.jit(step), (q, k, v, do), 3.5)):
                try:
                    first, t = timed(f, args, reps)
                    print(f"time {name:8s} {label:22s} {direction:8s} {t * 1e3:8.3f} ms "
                          f"{factor * flops / t / 1e12:6.1f} TF/s (first call {first:.1f} s)",
                          flush=True)
                except Exception as e:  # keep going: one failing kernel must not hide the rest
                    print(f"time {name:8s} {label:22s} {direction:8s} FAILED: "
                          f"{type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)


SWEEP_FORWARD = [dict(pallas_block_q=bq, pallas_block_kv=bk, pallas_num_warps=w, pallas_num_stages=st)
                 for bq, bk, w, st in ((128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 4, 2),
                                       (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 2),
                                       (64, 128, 4, 3), (64, 128, 8, 2))]
SWEEP_BACKWARD = [dict(pallas_backward_block_q=bq, pallas_backward_block_kv=bk, pallas_num_warps=w,
                       pallas_num_stages=st)
                  for bq, bk, w, st in ((64, 64, 8, 2), (64, 64, 4, 2), (64, 64, 8, 3),
                                        (32, 64, 4, 2), (64, 128, 8, 2), (128, 64, 8, 2),
                                        (32, 128, 8, 2), (128, 128, 8, 2))]


def sweep(seq, reps):
    b, h, d = 4, 16, 128
    q, k, v, do = inputs(b, seq, h, h, d)
    flops = 4 * b * h * seq * seq * d
    for direction, configs in (("fwd", SWEEP_FORWARD), ("fwd+bwd", SWEEP_BACKWARD)):
        for changes in configs:
            fn = pallas_fn("softcap", q, k, v, False, scoremod.LoweringOptions(**changes))
            if direction == "fwd":
                f, args, factor = jax.jit(lambda q, k, v, fn=fn: fn(q, k, v)[0]), (q, k, v), 1.0
            else:
                def step(q, k, v, do, fn=fn):
                    o, vjp = jax.vjp(lambda q, k, v: fn(q, k, v)[0], q, k, v)
                    return (o, *vjp(do))

                f, args, factor = jax.jit(step), (q, k, v, do), 3.5
            label = " ".join(f"{k.replace('pallas_', '')}={x}" for k, x in changes.items())
            try:
                _, t = timed(f, args, reps)
                print(f"sweep {direction:8s} {label:70s} {t * 1e3:8.3f} ms "
                      f"{factor * flops / t / 1e12:6.1f} TF/s", flush=True)
            except Exception as e:  # a config Triton cannot compile is a result too
                print(f"sweep {direction:8s} {label:70s} FAILED: {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:200]}", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--skip-errors", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time softcap over tiles/warps/stages")
    args = ap.parse_args()
    print(jax.devices(), jax.__version__, flush=True)
    if not args.skip_errors:
        errors()
    speeds(args.seq, args.reps)
    if args.sweep:
        sweep(args.seq, args.reps)
