"""Decoding with the same mod (issue: decoding): how fast short queries run as
scoremod folds them (lowering/decode.py), against the call unfolded and against
FlexAttention's decoding, in one run: batch 8, 32 query heads on 8 key/value
heads, KV 32768, head dim 128, bf16, one query row and four (speculative
decoding).

Variants (LoweringOptions.decode_splits): ``unfolded`` (0: each query head its
own head of the call, one live row per query tile, K and V read once per query
head); ``packed`` (1: a group's 4 query heads packed into query rows, K and V
read once per key/value head); ``splitN`` (decode_splits=N: on cuDNN N key
chunks folded into the batch; on the Pallas kernels' Mosaic GPU engine, which
splits keys itself, the packed call with N programs per query tile, each taking
a part of the tile's list of key tiles; joined by their LSEs: N times the tiles
in flight, the same bytes read);
``auto`` (None: the library's choice). For the window, ``dropped8`` is the
packed call by hand over only the chunks of 8 that hold a key of the window
(the position static), what dropping dead chunks would gain; and ``traced``
runs the library's choice with the position as a traced ``q_offset``, as a
decode loop does (the mask then reads an array). Routes: ``implementation=None``
and the Pallas kernels' Mosaic GPU engine, under jax.jit.

FlexAttention decodes in the same run (torch.compile(flex_attention) at q_len 1
and 4 with enable_gqa, which dispatches to its decoding kernel; the window as a
block mask). ``read`` is this GPU's HBM read bandwidth, measured on the same
K and V (a reduction over both).

One line per (mod, query rows, route, variant): the time per call, the K and V
bytes the call must read over that time (window: the last 4096 keys only), and
the largest difference of O from the unfolded call's.

    python benchmarks/probes/gqa_pack_decode.py
    PROBE_SKV_WINDOW=512,64 JAX_PLATFORMS=cpu python benchmarks/probes/gqa_pack_decode.py
    PROBE_ROWS=1 PROBE_MODS=window,softcap python benchmarks/probes/gqa_pack_decode.py

With ``ragged`` in PROBE_MODS (not by default): softcap at one query row with
``kv_lengths`` all SKV, every other row 1000 (the rest SKV), and all 1000, the
bytes read being those of each row's length: whether the time follows them.

With ``paged`` in PROBE_MODS (not by default): the other mods named there on a
paged cache of shuffled pages (64 and 128 keys a page), against the same call on
the rows.

With PROBE_HLO=1, each line is followed by the operations of the compiled call
that launch work on the device (fusions, custom calls, copies: each a kernel),
from XLA's optimized HLO: what the call runs besides the attention kernel. With
PROBE_PROFILE=1, by the profiler: each kernel's time per call
(``kernel_times.py``).
"""

import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

import kernel_times  # this folder's
import scoremod
from scoremod.lowering import decode
from scoremod.lowering.problem import Problem

B, HQ, HKV, D = 8, 32, 8, 128
SKV, WINDOW = (int(x) for x in os.environ.get("PROBE_SKV_WINDOW", "32768,4096").split(","))  # small on a CPU
G = HQ // HKV
ROWS = tuple(int(x) for x in os.environ.get("PROBE_ROWS", "1,4").split(","))
MODS = os.environ.get("PROBE_MODS", "softcap,window,alibi").split(",")
SLOPES = jnp.asarray(2.0 ** (-8.0 * np.arange(1, HQ + 1) / HQ), jnp.float32)


def mods(off):
    """The mods at query position ``off + q_idx`` (the rows are the last of the row)."""
    return {
        "softcap": lambda s, b, h, q, k: 30.0 * jnp.tanh(s / 30.0),
        "window": lambda s, b, h, q, k: jnp.where((q + off >= k) & (q + off - k < WINDOW), s,
                                                  -jnp.inf),
        "alibi": lambda s, b, h, q, k: s + SLOPES[h] * (k - q - off).astype(jnp.float32),
    }


def traced_window(sq):
    """The window at a traced position: ``q_offset`` makes the mod read an array."""
    return lambda s, b, h, q, k: jnp.where((q >= k) & (q - k < WINDOW), s, -jnp.inf)


def split_call(fn, q, k, v, n, impl, opts, keep=None):
    """The packed call over ``n`` key chunks folded into the batch (``keep``: the chunk
    indices that hold a live key, all by default), joined by their LSEs: the library's
    fold (lowering/decode.py) with the dead chunks dropped, which it does not do."""
    b, skv, h, d = k.shape
    c = skv // n
    keep = list(range(n)) if keep is None else keep
    m = len(keep)
    fold = decode.Fold(G, m)
    kc = k.reshape(b, n, c, h, d)[:, keep].reshape(b * m, c, h, d)
    vc = v.reshape(b, n, c, h, d)[:, keep].reshape(b * m, c, h, d)
    first = jnp.asarray(keep, jnp.int32) * c
    mod = lambda s, bb, hh, r, kk: fn(s, bb // m, hh * G + r % G, r // G,  # noqa: E731
                                      kk + first[bb % m])
    o, lse = scoremod.attention(decode.fold_queries(q, fold, HKV), kc, vc, mod,
                                implementation=impl, options=opts, return_lse=True)
    return decode.join(o, lse, fold, Problem.of(q, k, v))[0]


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


_BOOKKEEPING = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast"}


def launches(compiled_text):
    """The entry computation's operations that launch work: 'kind shape' each
    (a custom call with its target), in program order."""
    entry = compiled_text[compiled_text.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    out = []
    for line in entry.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?%?[\w.-]+ = (.+?) ([a-z][\w-]*)\(", line)
        if not m or m.group(2) in _BOOKKEEPING:
            continue
        target = re.search(r'custom_call_target="([^"]+)"', line)
        kind = re.search(r"kind=(k\w+)", line)
        what = target.group(1) if target else (kind.group(1) if kind else "")
        out.append(f"{m.group(2)}{'[' + what + ']' if what else ''} {m.group(1)[:60]}")
    return out


def ragged(q, k, v):
    """Softcap with kv_lengths: all SKV, every other row short, all short."""
    short = min(1000, SKV)
    softcap = lambda s, b, h, qi, ki: 30.0 * jnp.tanh(s / 30.0)  # noqa: E731
    for label, lengths in (("all long", [SKV] * B), ("half short", [short, SKV] * (B // 2)),
                           ("all short", [short] * B)):
        lengths = jnp.asarray(lengths, jnp.int32)
        need = 2 * int(lengths.sum()) * HKV * D * 2
        for route, opts in (("auto", scoremod.LoweringOptions()),
                            ("pallas", scoremod.LoweringOptions(pallas_engine="mosaic"))):
            impl = None if route == "auto" else "pallas"
            try:
                f = jax.jit(lambda q, k, v, n, impl=impl, opts=opts: scoremod.attention(
                    q, k, v, softcap, implementation=impl, options=opts, kv_lengths=n))
                secs = timed(f, q, k, v, lengths)
                print(f"ragged   sq=1 {route:6s} {label:10s} {secs * 1e3:.3f} ms, "
                      f"{need / secs / 1e9:.0f} GB/s of the K and V rows' lengths", flush=True)
            except Exception as e:
                print(f"ragged   sq=1 {route:6s} {label:10s} failed: {type(e).__name__}: "
                      f"{str(e)[:300]}", flush=True)


def paged(q, k, v, sq):
    """The mods on a paged cache (the rows' pages shuffled, page size 64 and 128):
    ms and GB/s of the K and V bytes read, each route's O against the rows'."""
    rng = np.random.default_rng(0)
    offsets = jnp.full((B,), SKV - sq, jnp.int32)
    for page in (64, 128):
        pages = SKV // page
        order = rng.permutation(B * pages)
        table = jnp.asarray(order.reshape(B, pages), jnp.int32)
        inverse = jnp.asarray(np.argsort(order), jnp.int32)  # the cache's page j: row page

        def cache(x):
            return x.reshape(B * pages, page, HKV, D)[inverse]

        kp, vp = cache(k), cache(v)
        for name in ("softcap", "window", "alibi"):
            if name not in MODS:
                continue
            fn = traced_window(sq) if name == "window" else mods(SKV - sq)[name]
            off = offsets if name == "window" else None
            keys = min(SKV, WINDOW + sq) if name == "window" else SKV
            need = 2 * B * keys * HKV * D * 2
            for route, impl, opts in (("auto", None, scoremod.LoweringOptions()),
                                      ("pallas", "pallas",
                                       scoremod.LoweringOptions(pallas_engine="mosaic"))):
                try:
                    f = jax.jit(lambda q, k, v, t, fn=fn, impl=impl, opts=opts, off=off:
                                scoremod.attention(q, k, v, fn, implementation=impl,
                                                   options=opts, q_offset=off, page_table=t))
                    rows = jax.jit(lambda q, k, v, fn=fn, impl=impl, opts=opts, off=off:
                                   scoremod.attention(q, k, v, fn, implementation=impl,
                                                      options=opts, q_offset=off))
                    secs = timed(f, q, kp, vp, table)
                    flat = timed(rows, q, k, v)
                    err = float(jnp.max(jnp.abs(f(q, kp, vp, table).astype(jnp.float32)
                                                - rows(q, k, v).astype(jnp.float32))))
                    print(f"{name:8s} sq={sq} {route:6s} paged{page:<3d} {secs * 1e3:.3f} ms, "
                          f"{need / secs / 1e9:.0f} GB/s of K and V (rows {flat * 1e3:.3f} ms), "
                          f"|O - rows| {err:.2e}", flush=True)
                    if os.environ.get("PROBE_HLO"):
                        ops = launches(f.lower(q, kp, vp, table).compile().as_text())
                        print(f"    {len(ops)} launches: " + "; ".join(ops), flush=True)
                except Exception as e:
                    print(f"{name:8s} sq={sq} {route:6s} paged{page:<3d} failed: "
                          f"{type(e).__name__}: {str(e)[:300]}", flush=True)


def two_warpgroups(q, k, v, fn, impl, opts):
    """The call with ``mosaic.SHORT_ONE_WARPGROUP`` off while it is traced."""
    from scoremod.lowering.pallas import mosaic

    mosaic.SHORT_ONE_WARPGROUP = False
    try:
        return scoremod.attention(q, k, v, fn, implementation=impl, options=opts)
    finally:
        mosaic.SHORT_ONE_WARPGROUP = True


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
    read = timed(jax.jit(lambda k, v: jnp.sum(k, dtype=jnp.float32) + jnp.sum(v, dtype=jnp.float32)),
                 k, v)
    print(f"read: {2 * k.size * 2 / read / 1e9:.0f} GB/s (a reduction over K and V)", flush=True)
    routes = {"auto": None, "pallas": "pallas"}
    for sq in ROWS:
        q = jax.random.normal(ks[0], (B, sq, HQ, D), jnp.float32).astype(jnp.bfloat16)
        for name, fn in mods(SKV - sq).items():
            if name not in MODS:
                continue
            keys = min(SKV, WINDOW + sq) if name == "window" else SKV
            need = 2 * B * keys * HKV * D * 2  # K and V, bf16
            for route, impl in routes.items():
                engine = {"pallas_engine": "mosaic"} if impl else {}
                variants = []
                for label, splits in (("unfolded", 0), ("packed", 1), ("split2", 2), ("split4", 4),
                                      ("split8", 8), ("split16", 16), ("split32", 32),
                                      ("auto", None)):
                    opts = scoremod.LoweringOptions(decode_splits=splits, **engine)
                    variants.append((label, opts, lambda q, k, v, fn=fn, impl=impl, opts=opts:
                                     scoremod.attention(q, k, v, fn, implementation=impl,
                                                        options=opts)))
                if impl:  # the Mosaic forward's packed rows on two compute warpgroups
                    opts = scoremod.LoweringOptions(**engine)
                    variants.append(("2wg", opts, lambda q, k, v, fn=fn, impl=impl, opts=opts:
                                     two_warpgroups(q, k, v, fn, impl, opts)))
                if name == "window":
                    opts = scoremod.LoweringOptions(decode_splits=0, **engine)
                    c = SKV // 8
                    keep = [j for j in range(8) if (j + 1) * c > SKV - sq - WINDOW + 1]
                    variants.append(("dropped8", opts, lambda q, k, v, fn=fn, impl=impl, sq=sq,
                                     opts=opts, keep=keep:
                                     split_call(fn, q, k, v, 8, impl, opts, keep)))
                    opts = scoremod.LoweringOptions(**engine)
                    variants.append(("traced", opts, lambda q, k, v, off, impl=impl, opts=opts,
                                     sq=sq: scoremod.attention(q, k, v, traced_window(sq),
                                                               implementation=impl, options=opts,
                                                               q_offset=off)))
                want = None
                for label, opts, f in variants:
                    try:
                        jf = jax.jit(f)
                        if label in ("dropped8", "traced", "2wg"):
                            chosen = {"dropped8": "by hand", "traced": "q_offset",
                                      "2wg": "two compute warpgroups"}[label]
                        else:
                            choice = scoremod.which_implementation(q, k, v, fn, implementation=impl,
                                                                   options=opts)
                            chosen = f"{choice[0]}: {choice.variant or 'as it is'}"
                        args = (q, k, v) + ((jnp.full((B,), SKV - sq, jnp.int32),)
                                            if label == "traced" else ())
                        secs = timed(jf, *args)
                        out = jf(*args).astype(jnp.float32)
                        want = out if want is None else want
                        err = float(jnp.max(jnp.abs(out - want)))
                        print(f"{name:8s} sq={sq} {route:6s} {label:8s} {secs * 1e3:.3f} ms, "
                              f"{need / secs / 1e9:.0f} GB/s of K and V, |O - unfolded| {err:.2e}"
                              f" [{chosen[:160]}]", flush=True)
                        if os.environ.get("PROBE_HLO"):
                            ops = launches(jf.lower(*args).compile().as_text())
                            print(f"    {len(ops)} launches: " + "; ".join(ops), flush=True)
                        if os.environ.get("PROBE_PROFILE"):
                            kernel_times.report("   ", *kernel_times.profile(
                                lambda jf=jf, args=args: jf(*args)))
                    except Exception as e:  # a route that refuses: say so, go on
                        print(f"{name:8s} sq={sq} {route:6s} {label:8s} failed: "
                              f"{type(e).__name__}: {str(e)[:300]}", flush=True)
        if "ragged" in MODS and sq == 1:
            ragged(q, k, v)
        if "paged" in MODS:
            paged(q, k, v, sq)
        if jax.devices()[0].platform == "gpu":
            for name, r in flex_decode(sq, k, v).items():
                keys = min(SKV, WINDOW + sq) if name == "window" else SKV
                need = 2 * B * keys * HKV * D * 2
                print(f"{name:8s} sq={sq} flex   decoding " + (
                    f"{r * 1e3:.3f} ms, {need / r / 1e9:.0f} GB/s of K and V" if isinstance(r, float)
                    else f"failed: {r}"), flush=True)


if __name__ == "__main__":
    main()
