"""Where the Mosaic GPU backward's time goes: its dQ and dK/dV kernels timed apart.

    python benchmarks/probes/mosaic_backward_kernels.py [--seq 4096] [--reps 5]
        [--variants N] [--mods plain,softcap,causal]

At b4 h16 d128 bfloat16, for plain attention, softcap and causal (the block map
skips the masked tiles), each kernel alone under jit on the plan the backend makes
(its block maps, padding and spec), with TF/s counted from its own products (dQ
three per tile: S, dP, dQ; dK/dV four: S, dP, dV, dK; dense, masked tiles counted
too) and from the backward's usual dense count (2.5x the forward's 4*B*H*S*S*D,
the five products of a fused backward), beside cuDNN's whole backward
(scoremod's implementation="cudnn", fwd+bwd less fwd), and the whole Mosaic backward
with dQ in its own kernel and in the dK/dV kernel (``dkdvdq``, five products:
``mosaic_backward.FUSE_DQ``). Median over --reps runs
of 10 calls after a warm-up. Each kernel runs in each of its ``VARIANTS`` (tuning
constants of ``mosaic_backward`` set while it is traced), and each variant's
outputs are compared with the first's (the same operations per element: they
should be equal).
"""

import argparse
import functools

import jax
import jax.numpy as jnp

import pallas_mgpu_smoke as smoke  # this folder's (a script's folder is on sys.path)
import scoremod
from scoremod.lowering.pallas import backend as pallas_backend
from scoremod.lowering.pallas import mosaic_backward
from scoremod.lowering.pallas.backend import PALLAS
from scoremod.lowering.problem import Problem

MOSAIC = scoremod.LoweringOptions(pallas_engine="mosaic")
# Per kernel: tuning constants of ``mosaic_backward`` set while it is traced.
# STAGES 3: a third streamed tile in flight (it lowers; whether shared memory holds it
# and whether it pays is for the GPU to say).
VARIANTS = {"dq": ({}, {"STAGES": 3}),
            "dkdv": ({}, {"TURNS": False}, {"TURNS": True}, {"STAGES": 3}),
            "dkdvdq": ({}, {"COMPUTE_REGISTERS": 240, "MEMORY_REGISTERS": 24},
                       {"TURNS": False}, {"TURNS": True})}


def timed(f, args, reps):
    """Median seconds per call (``pallas_mgpu_smoke.timed``'s, its first call left out)."""
    return smoke.timed(f, args, reps)[1]


def mods():
    return {"plain": None,
            "softcap": lambda s, b, h, q, k: 30.0 * jnp.tanh(s / 30.0),
            "causal": lambda s, b, h, q, k: jnp.where(q >= k, s, -jnp.inf)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--variants", type=int, default=None,
                    help="the first N variants of each kernel only (compiles take the time)")
    ap.add_argument("--mods", default=",".join(mods()), help="comma-separated: " + ",".join(mods()))
    args = ap.parse_args()
    if args.variants is not None:
        for kernel, variants in VARIANTS.items():
            VARIANTS[kernel] = variants[:args.variants]
    b, h, d, s = 4, 16, 128, args.seq
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(x, (b, s, h, d), jnp.bfloat16) for x in keys)
    dense = 4 * b * h * s * s * d
    for name in args.mods.split(","):
        fn = mods()[name]
        try:
            run(name, fn, q, k, v, do, dense, args.reps)
        except Exception as e:  # noqa: BLE001 - one failure must not hide the others
            print(f"{name:8s} FAILED: {str(e).splitlines()[0][:300]}")


def run(name, fn, q, k, v, do, dense, reps):
    d = q.shape[-1]
    mod = None if fn is None else scoremod.trace(fn)
    plan = PALLAS.plan(Problem.of(q, k, v), mod, d ** -0.5, MOSAIC, True)
    assert plan.backward_engine == "mosaic", plan.describe()
    spec = plan.mosaic_backward_spec()
    o, lse = jax.jit(lambda q, k, v: scoremod.attention(
        q, k, v, fn, implementation="pallas", options=MOSAIC, return_lse=True))(q, k, v)
    delta = jnp.einsum("bqhd,bqhd->bhq", do.astype(jnp.float32), o.astype(jnp.float32))
    lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse * jnp.float32(mosaic_backward.LOG2E))
    fused = functools.partial(mosaic_backward.dkdv, with_dq=True)
    fused.__name__ = "dkdvdq"
    for kernel, blocks, products in ((mosaic_backward.dq, mosaic_backward.DQ_BLOCKS, 3),
                                     (mosaic_backward.dkdv, mosaic_backward.DKDV_BLOCKS, 4),
                                     (fused, mosaic_backward.DKDV_BLOCKS, 5)):
        bmap = pallas_backend._map(plan, blocks, ())
        outs = []
        for variant in VARIANTS[kernel.__name__]:
            saved = {key: getattr(mosaic_backward, key) for key in variant}
            for key, value in variant.items():  # read when the kernel is traced, below
                setattr(mosaic_backward, key, value)
            f = jax.jit(lambda q, k, v, do, lse2, delta, kernel=kernel, bmap=bmap: kernel(
                spec, bmap, q, k, v, do, lse2, delta, ()))
            label = f"{kernel.__name__:5s} " + ",".join(f"{k}={v}" for k, v in variant.items())
            try:
                t = timed(f, (q, k, v, do, lse2, delta), reps)
                out = f(q, k, v, do, lse2, delta)
                outs.append(out)
                diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                           for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(out)))
                print(f"{name:8s} {label:30s} {t * 1e3:8.3f} ms "
                      f"{products * 2 * dense / 4 / t / 1e12:6.1f} TF/s of its products "
                      f"(max |difference| from the first {diff:.3g})", flush=True)
            except Exception as e:  # noqa: BLE001 - one failure must not hide the others
                print(f"{name:8s} {label:30s} FAILED: {str(e).splitlines()[0][:300]}")
            finally:
                for key, value in saved.items():
                    setattr(mosaic_backward, key, value)
    for impl, options, fuse in (("mosaic", MOSAIC, False), ("mosaic-fused", MOSAIC, True),
                                ("cudnn", None, False)):
        mosaic_backward.FUSE_DQ = fuse  # read when the plan is made, as the step is traced

        def fwd(q, k, v, impl=impl, options=options):
            return scoremod.attention(q, k, v, fn, implementation="cudnn" if impl == "cudnn"
                                      else "pallas", options=options)

        def step(q, k, v, do, fwd=fwd):
            o, vjp = jax.vjp(fwd, q, k, v)
            return (o, *vjp(do))

        try:
            t_fwd = timed(jax.jit(fwd), (q, k, v), reps)
            t_all = timed(jax.jit(step), (q, k, v, do), reps)
            t_bwd = t_all - t_fwd
            print(f"{name:8s} {impl:12s} fwd {t_fwd * 1e3:7.3f} ms, fwd+bwd {t_all * 1e3:7.3f}"
                  f" ms, bwd {t_bwd * 1e3:7.3f} ms = {2.5 * dense / t_bwd / 1e12:6.1f} TF/s "
                  "counted dense", flush=True)
            if impl != "cudnn" and name == "softcap":  # what runs around the kernels
                print(entry_ops(jax.jit(step).lower(q, k, v, do).compile().as_text()))
        except Exception as e:  # noqa: BLE001
            print(f"{name:8s} {impl:12s} FAILED: {str(e).splitlines()[0][:300]}")


def entry_ops(hlo):
    """The optimized program's top-level operations (one line each: kind and result
    shape), the parameters, tuples and bitcasts left out."""
    lines, inside = [], False
    for line in hlo.splitlines():
        if line.startswith("ENTRY"):
            inside = True
            continue
        if inside and line.startswith("}"):
            break
        if inside and "=" in line:
            shape, op = line.split("=", 1)[1].strip().split(" ", 1)
            kind = op.split("(", 1)[0]
            if kind in ("parameter", "tuple", "get-tuple-element", "bitcast", "constant"):
                continue
            target = op.split('custom_call_target="', 1)[1].split('"', 1)[0] \
                if "custom_call_target" in op else ""
            lines.append(f"    {kind} {target} {shape}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
