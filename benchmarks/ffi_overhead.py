"""FFI overhead and the end-to-end check of the fused path (needs an NVIDIA GPU).

Times scoremod's fused forward against the very same serialized cuDNN graph
executed directly by the cuDNN frontend's Python API (torch buffers, CUDA
events), and against jax.nn.dot_product_attention(implementation="cudnn").
Then checks jax.jit(jax.grad(loss)) of an attention layer, fused vs reference.

    python benchmarks/ffi_overhead.py --json out.json
"""

import argparse
import json
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import scoremod
from scoremod.lowering.cudnn import graph as cudnn_graph


def shape_arguments(ap):
    """The benchmarks' shape as options: --batch 4, --heads 16, --seq 4096, --head-dim 128."""
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--head-dim", type=int, default=128)


def bf16_inputs(b, s, h, d):
    """q, k, v [b, s, h, d] bfloat16, standard normal from key 0."""
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    return tuple(jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(jnp.bfloat16)
                 for kk in ks)


def time_jax(fn, *args, iters=30, reps=7):
    jax.block_until_ready(fn(*args))
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            r = fn(*args)
        jax.block_until_ready(r)
        out.append((time.perf_counter() - t0) / iters * 1e3)
    return statistics.median(out), min(out), max(out)


def time_frontend(built, q, k, v, iters=30, reps=7):
    """The same graph bytes run by the frontend's Python execute (torch buffers)."""
    import cudnn
    import torch

    g = cudnn.pygraph()
    g.deserialize(built.blob)
    tq = torch.randn(q.shape, dtype=torch.bfloat16, device="cuda")
    tk = torch.randn(k.shape, dtype=torch.bfloat16, device="cuda")
    tv = torch.randn(v.shape, dtype=torch.bfloat16, device="cuda")
    b, s, h, d = q.shape
    o = torch.empty_like(tq)
    stats = torch.empty(b, h, s, 1, dtype=torch.float32, device="cuda")
    ws = torch.empty(max(built.workspace, 1), dtype=torch.uint8, device="cuda")
    pack = {built.in_uids[0]: tq.data_ptr(), built.in_uids[1]: tk.data_ptr(), built.in_uids[2]: tv.data_ptr(),
            built.out_uids[0]: o.data_ptr(), built.out_uids[1]: stats.data_ptr()}
    for uid, bits in zip(built.scalar_uids, built.scalar_bits):
        pack[uid] = torch.tensor([bits], dtype=torch.int32).view(torch.float32).reshape(1, 1, 1, 1)
    for _ in range(3):
        g.execute(pack, ws)
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            g.execute(pack, ws)
        end.record()
        torch.cuda.synchronize()
        out.append(start.elapsed_time(end) / iters)
    return statistics.median(out), min(out), max(out)


def layer_check(b, s, h, d, mod):
    """jit(grad) of a small attention layer: fused vs reference."""
    e = h * d
    ks = jax.random.split(jax.random.PRNGKey(1), 5)
    x = jax.random.normal(ks[0], (b, s, e), jnp.float32).astype(jnp.bfloat16)
    params = {n: (jax.random.normal(k, (e, e), jnp.float32) / math.sqrt(e)).astype(jnp.bfloat16)
              for n, k in zip(("wq", "wk", "wv", "wo"), ks[1:])}

    def loss(params, impl):
        q = (x @ params["wq"]).reshape(b, s, h, d)
        k = (x @ params["wk"]).reshape(b, s, h, d)
        v = (x @ params["wv"]).reshape(b, s, h, d)
        o = scoremod.attention(q, k, v, mod, implementation=impl).reshape(b, s, e)
        return jnp.mean((o @ params["wo"]).astype(jnp.float32) ** 2)

    fused = jax.jit(jax.grad(loss), static_argnums=1)(params, "cudnn")
    ref = jax.jit(jax.grad(loss), static_argnums=1)(params, "xla")
    errs = {}
    for n in params:
        a, r = np.asarray(fused[n], np.float32), np.asarray(ref[n], np.float32)
        errs[n] = float(np.max(np.abs(a - r)) / (np.max(np.abs(r)) + 1e-12))
    return errs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shape_arguments(ap)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    b, s, h, d = a.batch, a.seq, a.heads, a.head_dim
    softcap = scoremod.trace(lambda sc, bi, hi, qi, ki: 30.0 * jnp.tanh(sc / 30.0))
    q, k, v = bf16_inputs(b, s, h, d)
    flops = 4 * b * h * s * s * d
    cudnn_graph.cache_clear()
    t0 = time.perf_counter()
    fused = jax.jit(lambda q, k, v: scoremod.attention(q, k, v, softcap, implementation="cudnn"))
    jax.block_until_ready(fused(q, k, v))
    first_call = time.perf_counter() - t0
    t_fused = time_jax(fused, q, k, v)
    built = next(val for key, val in cudnn_graph.cache_entries().items() if key[0] == "forward")
    t_direct = time_frontend(built, q, k, v)
    plain = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"))
    t_plain = time_jax(plain, q, k, v)
    ratio = t_fused[0] / t_direct[0]
    rows = {
        "scoremod fused (FFI)": t_fused,
        "same graph via frontend Python": t_direct,
        "jax.nn.dot_product_attention cudnn (no mod)": t_plain,
    }
    print(f"softcap forward b{b} h{h} s{s} d{d} bf16 (median/min/max ms, TF/s at median)")
    for name, (med, lo, hi) in rows.items():
        print(f"  {name:46s} {med:7.3f} {lo:7.3f} {hi:7.3f}  {flops / med / 1e9:6.0f} TF/s")
    print(f"  FFI / direct = {ratio:.4f} (target <= 1.03); first call incl. graph build {first_call:.2f} s")
    errs = layer_check(b, s, h, d, softcap)
    print("  layer jit(grad) fused vs reference, max rel err per weight:", {n: f"{e:.2e}" for n, e in errs.items()})
    print("  graph cache:", cudnn_graph.cache_info())
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"shape": [b, s, h, d], "rows": rows, "ffi_over_direct": ratio,
                       "first_call_s": first_call, "layer_grad_rel_err": errs,
                       "cache": cudnn_graph.cache_info(), "jax": jax.__version__}, f, indent=1)
    return 0 if ratio <= 1.03 and max(errs.values()) < 5e-2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
