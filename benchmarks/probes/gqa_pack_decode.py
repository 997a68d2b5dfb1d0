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

One line per (mod, query rows, route, packed or not): the time per call, the
K and V bytes the call must read over that time (window: the last 4096 keys
only), and the largest difference of O from the unpacked call's.

    python benchmarks/probes/gqa_pack_decode.py
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

import scoremod

B, HQ, HKV, SKV, D, WINDOW = 8, 32, 8, 32768, 128, 4096
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

                want = None
                for label, f in (("unpacked", plain), ("packed", packed)):
                    try:
                        jf = jax.jit(f)
                        chosen = scoremod.which_implementation(
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


if __name__ == "__main__":
    main()
