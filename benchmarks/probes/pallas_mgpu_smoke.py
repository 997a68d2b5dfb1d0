"""Probe: the Pallas backend's Mosaic GPU engine (pallas_engine="mosaic") on a Hopper GPU.

    python benchmarks/probes/pallas_mgpu_smoke.py [--reps 5] [--seq 4096] [--triton] [--backward]

1. Forward times at b4 h16 s4096 d128 bfloat16 of plain attention, softcap,
   causal (its block map skips the masked tiles) and ALiBi (slopes
   captured, read per head): the mosaic engine and cuDNN (scoremod's
   implementation="cudnn"); for causal also the mosaic engine without the
   branch on the map's full tiles (the whole mod on every tile), and beside
   plain attention jax.nn's cuDNN and JAX's own Mosaic GPU attention
   (attention_mgpu, float16: its kernels are written for it; 64 x 64
   backward tiles). Median over --reps repetitions of 10 calls after a
   warm-up; the first call timed apart. --triton: the Triton engine too;
   --backward: forward + backward too (the mosaic engine's backward kernels:
   no captured array is learned here).
2. Errors against the reference path (implementation="xla", float32 inputs):
   O and LSE of the mosaic forward at b2 hq4 hkv2 d128 bfloat16, s512 and
   s1000 (a tail: 1000 is no whole number of tiles), relative to each
   reference result's largest magnitude; with --backward also dQ, dK, dV.
Every case runs in its own try block: a failure prints its first lines and the
probe goes on. One line per result; about 45 s with the defaults.
"""

import argparse
import dataclasses
import time
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import scoremod
from scoremod.lowering.pallas.backend import PALLAS
from scoremod.lowering.problem import Problem

warnings.simplefilter("ignore")

MOSAIC = scoremod.LoweringOptions(pallas_engine="mosaic")
TRITON = scoremod.LoweringOptions(pallas_engine="triton")


def mods(hq):
    slopes = jnp.asarray([2.0 ** -(8 * (i + 1) / hq) for i in range(hq)], jnp.float32)
    return {
        "plain": None,
        "softcap": lambda s, b, h, q, k: 30.0 * jnp.tanh(s / 30.0),
        "causal": lambda s, b, h, q, k: jnp.where(q >= k, s, -jnp.inf),
        "alibi": lambda s, b, h, q, k: jnp.where(q >= k, s + slopes[h] * (k - q), -jnp.inf),
    }


def inputs(b, s, hq, hkv, d, dtype=jnp.bfloat16):
    ks = jax.random.split(jax.random.PRNGKey(0), 4)
    return tuple(jax.random.normal(key, shape, jnp.float32).astype(dtype) for key, shape in
                 zip(ks, [(b, s, hq, d), (b, s, hkv, d), (b, s, hkv, d), (b, s, hq, d)]))


def attend(mod, impl, options=None):
    return lambda q, k, v: scoremod.attention(q, k, v, mod, implementation=impl,
                                              return_lse=True, options=options)


def without_full_branch(mod, q, k, v):
    """The mosaic forward evaluating the whole mod on every tile (no branch on
    the map's full tiles), as the backend's forward (O, LSE)."""
    traced = scoremod.trace(mod)
    plan = PALLAS.plan(Problem.of(q, k, v), traced, 1 / np.sqrt(q.shape[-1]), MOSAIC, True)
    plan = dataclasses.replace(plan, full_expr=None)
    operands = tuple(jnp.asarray(x) for x in traced.operands)
    return lambda q, k, v: PALLAS.forward(plan, q, k, v, operands)


def jax_mgpu(q, k, v):
    """JAX's Mosaic GPU attention (jax.experimental.pallas.ops.gpu.attention_mgpu)
    on float16 copies of the inputs, as (O, None)."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu as am

    config = am.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, block_q_dkv=64,
                             block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
    f16 = lambda x: x.astype(jnp.float16)  # noqa: E731
    return am.attention(f16(q), f16(k), f16(v), config), None


def with_grads(fn, q, k, v, do):
    (o, lse), vjp = jax.vjp(fn, q, k, v)
    return (o, lse) + tuple(vjp((do, jnp.zeros_like(lse))))


def relative(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    fin = np.isfinite(b)
    if not np.array_equal(np.isfinite(a), fin):
        return float("inf")  # -inf LSE rows must agree
    return float(np.max(np.abs(a[fin] - b[fin])) / max(np.max(np.abs(b[fin])), 1e-30))


def fail(label, e):
    lines = [line for line in "".join(traceback.format_exception_only(type(e), e)).splitlines()
             if line.strip() and not line.startswith(("----", "For simplicity"))]
    print(f"{label}: FAILED: " + " | ".join(line[:400] for line in lines[:4]), flush=True)


def errors(backward):
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    for seq in (512, 1000):
        q, k, v, do = inputs(2, seq, 4, 2, 128)
        for name, mod in mods(4).items():
            label = f"errors {name:8s} s{seq}"
            try:
                if backward:
                    want = jax.jit(lambda *a: with_grads(attend(mod, "xla"), *a))(
                        f32(q), f32(k), f32(v), f32(do))
                    got = jax.jit(lambda *a: with_grads(attend(mod, "pallas", MOSAIC), *a))(
                        q, k, v, do)
                else:
                    want = jax.jit(attend(mod, "xla"))(f32(q), f32(k), f32(v))
                    got = jax.jit(attend(mod, "pallas", MOSAIC))(q, k, v)
                print(f"{label}: " + ", ".join(
                    f"{n} {relative(a, b):.2e}"
                    for n, a, b in zip(("O", "LSE", "dQ", "dK", "dV"), got, want)), flush=True)
            except Exception as e:  # noqa: BLE001 - one failure must not hide the others
                fail(label, e)


def timed(f, args, reps, calls=10):
    """(first call s, median s per call over ``reps`` runs of ``calls`` calls)."""
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    first = time.perf_counter() - t
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(calls):
            out = f(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / calls)
    return first, float(np.median(times))


def speeds(seq, reps, triton, backward):
    b, h, d = 4, 16, 128
    q, k, v, do = inputs(b, seq, h, h, d)
    flops = 4 * b * h * seq * seq * d
    for name, mod in mods(h).items():
        impls = {"mosaic": attend(mod, "pallas", MOSAIC), "cudnn": attend(mod, "cudnn")}
        if name == "causal":
            impls["mosaic, no full-tile branch"] = without_full_branch(mod, q, k, v)
        if name == "plain":  # for scale: cuDNN, and JAX's own Mosaic GPU attention
            impls["jax.nn cudnn"] = lambda q, k, v: (jax.nn.dot_product_attention(
                q, k, v, implementation="cudnn"), None)
            impls["jax attention_mgpu (fp16)"] = jax_mgpu
        if triton:
            impls["triton"] = attend(mod, "pallas", TRITON)
        for label, fn in impls.items():
            steps = [("fwd", jax.jit(lambda q, k, v, fn=fn: fn(q, k, v)[0]), (q, k, v), 1.0)]
            if backward:
                def step(q, k, v, do, fn=fn):
                    o, vjp = jax.vjp(lambda q, k, v: fn(q, k, v)[0], q, k, v)
                    return (o, *vjp(do.astype(o.dtype)))

                steps.append(("fwd+bwd", jax.jit(step), (q, k, v, do), 3.5))
            for direction, f, args, factor in steps:
                line = f"time {name:8s} {label:28s} {direction:8s}"
                try:
                    first, t = timed(f, args, reps)
                    print(f"{line} {t * 1e3:8.3f} ms {factor * flops / t / 1e12:6.1f} TF/s "
                          f"(first call {first:.1f} s)", flush=True)
                except Exception as e:  # noqa: BLE001
                    fail(line, e)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--skip-errors", action="store_true")
    ap.add_argument("--triton", action="store_true", help="time the Triton engine too")
    ap.add_argument("--backward", action="store_true",
                    help="time forward + backward, and check the gradients, too")
    args = ap.parse_args()
    print(jax.devices(), jax.__version__, flush=True)
    start = time.perf_counter()
    speeds(args.seq, args.reps, args.triton, args.backward)
    if not args.skip_errors:
        errors(args.backward)
    print(f"total {time.perf_counter() - start:.0f} s", flush=True)
