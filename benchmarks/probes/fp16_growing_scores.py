"""Which float16 mods give non-finite or wrong fused gradients (run on a GPU from the repository root):
scores growing along kv_idx, by form, slope and sequence length; the plan cuDNN picked for each."""
import jax, jax.numpy as jnp, numpy as np
import scoremod
from scoremod.lowering.cudnn import graph as cudnn_graph
from tests.gpu.test_fused import _inputs, _run, _rel_err

def run(tag, fn, sq=192, skv=192, hq=4, hkv=4, d=64, dtype=jnp.float16):
    q, k, v, do = _inputs(2, sq, skv, hq, hkv, d, dtype)
    mod = scoremod.trace(fn)
    before = set(cudnn_graph.cache_entries())
    got = jax.jit(lambda *a: _run("cudnn", mod, *a))(q, k, v, do)
    want = jax.jit(lambda *a: _run("xla", mod, *a))(q, k, v, do)
    plans = [(key[0], cudnn_graph._cache[key].plan) for key in set(cudnn_graph.cache_entries()) - before]
    errs = {n: round(_rel_err(g, w), 5) for n, g, w in zip(("O", "LSE", "dQ", "dK", "dV"), got, want)}
    dq = np.asarray(got[2], np.float32); bad = ~np.isfinite(dq)
    extra = f" nonfinite dQ {bad.sum()}/{bad.size} heads {sorted(set(np.argwhere(bad)[:,2].tolist()))}" if bad.any() else ""
    print(f"{tag:40s} {errs}{extra} plans={plans}", flush=True)

sl = jnp.asarray([2.0 ** (-8 * (i + 1) / 4) for i in range(4)], jnp.float32)
same = jnp.full((4,), 0.25, jnp.float32)
run("alibi", lambda s, b, h, q, k: s + sl[h] * (k - q))
run("alibi bf16", lambda s, b, h, q, k: s + sl[h] * (k - q), dtype=jnp.bfloat16)
run("0.25*(k-q) no load", lambda s, b, h, q, k: s + 0.25 * (k - q))
run("0.25*k", lambda s, b, h, q, k: s + 0.25 * k)
run("0.1*k", lambda s, b, h, q, k: s + 0.1 * k)
run("0.05*k", lambda s, b, h, q, k: s + 0.05 * k)
run("-0.25*k", lambda s, b, h, q, k: s - 0.25 * k)
run("0.25*q", lambda s, b, h, q, k: s + 0.25 * q)
run("same slopes load*(k-q)", lambda s, b, h, q, k: s + same[h] * (k - q))
run("alibi d128", lambda s, b, h, q, k: s + sl[h] * (k - q), d=128)
run("alibi s64", lambda s, b, h, q, k: s + sl[h] * (k - q), sq=64, skv=64)
run("alibi s512", lambda s, b, h, q, k: s + sl[h] * (k - q), sq=512, skv=512)
kvb = jnp.asarray(0.25 * np.arange(192), jnp.float32)
run("kv-vector load 0.25*k", lambda s, b, h, q, k: s + kvb[k])
run("alibi*1 via tanh-free mul", lambda s, b, h, q, k: s * 1.0001 + sl[h] * (k - q))
