"""Whether packing a group's query heads into query rows pays when decoding (issue:
decoding with the same mod): batch 8, 32 query heads on 8 key/value heads, KV
32768, head dim 128, bf16, one query row and four (speculative decoding).

Unpacked, each query head is its own head of the call: a kernel's query tile holds
one or four live rows and reads its key/value head's K and V once per query head.
Packed, q [b, sq, 32, d] becomes [b, sq * 4, 8, d] (row r = i * 4 + m: row i of the
group's m-th head, h = kv_head * 4 + m), the mod reads ``h * 4 + r % 4`` for the
head and ``offset + r // 4`` for the position, and O and the LSE are unpacked
after: the same attention, K and V read once per key/value head, four times the
live rows per tile. The call is otherwise scoremod's own (``implementation=None``
and the Pallas kernels), under jax.jit.

Split: the packed call with the keys cut into N chunks folded into the batch
(K and V [b, skv, h, d] viewed as [b * N, skv / N, h, d], the mod reading
``b // N`` and ``kv + (b % N) * skv / N``), each chunk's O and LSE joined after:
N times the tiles in flight, the same bytes read. The window's chunks that hold
no key of the window are dropped before the call (the position is static here).

FlexAttention decodes in the same run (torch.compile(flex_attention) at q_len 1
and 4 with enable_gqa, which dispatches to its decoding kernel; the window as a
block mask).

One line per (mod, query rows, route, variant): the time per call, the K and V
bytes the call must read over that time (window: the last 4096 keys only), and
the largest difference of O from the unpacked call's.

    python benchmarks/probes/gqa_pack_decode.py
"""

import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import scoremod

B, HQ, HKV, D = 8, 32, 8, 128
SKV, WINDOW = (int(x) for x in os.environ.get("PROBE_SKV_WINDOW", "32768,4096").split(","))  # small on a CPU
G = HQ // HKV
SLOPES = jnp.asarray(2.0 ** (-8.0 * np.arange(1, HQ + 1) / HQ), jnp.float32)


def mods(off):
    """The mods at query position ``off + q_idx`` (the rows are the last of the row)."""
    return {
        "softcap": lambda s, b, h, q, k: 30.0 * jnp.tanh(s / 30.0),
        "window": lambda s, b, h, q, k: jnp.where((q + off >= k) & (q + off - k < WINDOW), s,
                                                  -jnp.inf),
        "alibi": lambda s, b, h, q, k: s + SLOPES[h] * (k - q - off).astype(jnp.float32),
    }


def packed_mod(fn):
    """``fn`` on the packed call: row r is row r // G of head h * G + r % G."""
    return lambda s, b, h, r, k: fn(s, b, h * G + r % G, r // G, k)


def pack(q):
    b, sq, _, d = q.shape
    return q.reshape(b, sq, HKV, G, d).transpose(0, 1, 3, 2, 4).reshape(b, sq * G, HKV, d)


def unpack(o, sq):
    b, _, _, dv = o.shape
    return o.reshape(b, sq, G, HKV, dv).transpose(0, 1, 3, 2, 4).reshape(b, sq, HQ, dv)


def split_call(fn, q, k, v, sq, n, impl, opts, keep=None):
    """The packed call over ``n`` key chunks folded into the batch (``keep``: the chunk
    indices that hold a live key, all by default), joined by their LSEs."""
    b, skv, h, d = k.shape
    c = skv // n
    keep = list(range(n)) if keep is None else keep
    m = len(keep)
    kc = k.reshape(b, n, c, h, d)[:, keep].reshape(b * m, c, h, d)
    vc = v.reshape(b, n, c, h, d)[:, keep].reshape(b * m, c, h, d)
    qp = jnp.repeat(pack(q), m, axis=0)
    first = jnp.asarray(keep, jnp.int32) * c
    pm = packed_mod(fn)
    mod = lambda s, bb, hh, r, kk: pm(s, bb // m, hh, r, kk + first[bb % m])
    o, lse = scoremod.attention(qp, kc, vc, mod, implementation=impl, options=opts,
                                return_lse=True)
    o = o.reshape(b, m, *o.shape[1:]).astype(jnp.float32)
    lse = lse.reshape(b, m, *lse.shape[1:])  # [b, m, h, rows]
    top = jnp.max(lse, axis=1, keepdims=True)
    w = jnp.exp(lse - jnp.where(jnp.isfinite(top), top, 0.0))  # [b, m, h, rows]
    w = jnp.moveaxis(w, 3, 2)[..., None]  # [b, m, rows, h, 1]
    out = jnp.sum(o * w, axis=1) / jnp.maximum(jnp.sum(w, axis=1), 1e-30)
    return unpack(out.astype(q.dtype), sq)


def flex_decode(sq, k, v):
    """name -> ms per FlexAttention decoding call, or the reason it failed."""
    try:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception as e:  # no torch here
        return {"all": f"no torch: {e}"}
    cfg = torch._dynamo.config
    for limit in ("cache_size_limit", "recompile_limit"):
        if hasattr(cfg, limit):
            setattr(cfg, limit, 1024)
    flex = torch.compile(flex_attention, dynamic=False)
    off = SKV - sq
    torch.manual_seed(0)
    q = torch.randn(B, HQ, sq, D, dtype=torch.bfloat16, device="cuda")
    kt = torch.randn(B, HKV, SKV, D, dtype=torch.bfloat16, device="cuda")
    vt = torch.randn(B, HKV, SKV, D, dtype=torch.bfloat16, device="cuda")
    slopes = torch.tensor(np.asarray(SLOPES), device="cuda")
    window = create_block_mask(lambda b, h, qi, ki: (qi + off >= ki) & (qi + off - ki < WINDOW),
                               None, None, sq, SKV, device="cuda")
    calls = {
        "softcap": lambda: flex(q, kt, vt, score_mod=lambda s, b, h, qi, ki: 30.0 * torch.tanh(s / 30.0),
                                enable_gqa=True),
        "window": lambda: flex(q, kt, vt, block_mask=window, enable_gqa=True),
        "alibi": lambda: flex(q, kt, vt, score_mod=lambda s, b, h, qi, ki:
                              s + slopes[h] * (ki - qi - off), enable_gqa=True),
    }
    out = {}
    for name, call in calls.items():
        try:
            with torch.no_grad():
                call(); call(); torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(50):
                    call()
                torch.cuda.synchronize()
            out[name] = (time.perf_counter() - t0) / 50
        except Exception as e:
            out[name] = f"{type(e).__name__}: {str(e)[:200]}"
    return out


def timed(fn, *args, reps=50):
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps


def main():
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; b{B} hq{HQ} hkv{HKV} "
          f"skv{SKV} d{D} bf16", flush=True)
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    k = jax.random.normal(ks[1], (B, SKV, HKV, D), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, SKV, HKV, D), jnp.float32).astype(jnp.bfloat16)
    routes = {"auto": (None, None),
              "pallas": ("pallas", scoremod.LoweringOptions(pallas_engine="mosaic"))}
    for sq in (1, 4):
        q = jax.random.normal(ks[0], (B, sq, HQ, D), jnp.float32).astype(jnp.bfloat16)
        for name, fn in mods(SKV - sq).items():
            keys = min(SKV, WINDOW + sq) if name == "window" else SKV
            need = 2 * B * keys * HKV * D * 2  # K and V, bf16
            for route, (impl, opts) in routes.items():
                def plain(q, k, v, fn=fn, impl=impl, opts=opts):
                    return scoremod.attention(q, k, v, fn, implementation=impl, options=opts)

                def packed(q, k, v, fn=fn, impl=impl, opts=opts, sq=sq):
                    o = scoremod.attention(pack(q), k, v, packed_mod(fn), implementation=impl,
                                           options=opts)
                    return unpack(o, sq)

                variants = [("unpacked", plain), ("packed", packed)]
                for n in (4, 16, 32):
                    keep = None
                    if name == "window":  # the chunks holding a key of the window
                        c = SKV // n
                        keep = [j for j in range(n) if (j + 1) * c > SKV - sq - WINDOW + 1]
                    variants.append((f"split{n}", lambda q, k, v, fn=fn, impl=impl, opts=opts,
                                     sq=sq, n=n, keep=keep:
                                     split_call(fn, q, k, v, sq, n, impl, opts, keep)))
                want = None
                for label, f in variants:
                    try:
                        jf = jax.jit(f)
                        chosen = "?" if label.startswith("split") else scoremod.which_implementation(
                            pack(q) if label == "packed" else q, k, v,
                            packed_mod(fn) if label == "packed" else fn, implementation=impl,
                            options=opts)[0]
                        secs = timed(jf, q, k, v)
                        out = jf(q, k, v).astype(jnp.float32)
                        want = out if want is None else want
                        err = float(jnp.max(jnp.abs(out - want)))
                        print(f"{name:8s} sq={sq} {route:6s} {label:8s} [{chosen}] "
                              f"{secs * 1e3:.3f} ms, {need / secs / 1e9:.0f} GB/s of K and V, "
                              f"|O - unpacked| {err:.2e}", flush=True)
                    except Exception as e:  # a route that refuses: say so, go on
                        print(f"{name:8s} sq={sq} {route:6s} {label:8s} failed: "
                              f"{type(e).__name__}: {str(e)[:300]}", flush=True)
        if jax.devices()[0].platform == "gpu":
            for name, r in flex_decode(sq, k, v).items():
                keys = min(SKV, WINDOW + sq) if name == "window" else SKV
                need = 2 * B * keys * HKV * D * 2
                print(f"{name:8s} sq={sq} flex   decoding " + (
                    f"{r * 1e3:.3f} ms, {need / r / 1e9:.0f} GB/s of K and V" if isinstance(r, float)
                    else f"failed: {r}"), flush=True)


if __name__ == "__main__":
    main()
