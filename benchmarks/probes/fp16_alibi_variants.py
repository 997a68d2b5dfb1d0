"""ALiBi variants in float16 and bfloat16: constant shifts, flipped slopes, the same bias as a tensor (run on a GPU from the repository root)."""
import jax, jax.numpy as jnp, numpy as np
import scoremod
from tests.gpu.test_fused import _inputs, _run, _rel_err

sq = skv = 192; hq = hkv = 4; d = 64
slopes = jnp.asarray([2.0 ** (-8 * (i + 1) / hq) for i in range(hq)], jnp.float32)
alibi_t = (slopes[:, None, None] * (jnp.arange(skv)[None, None, :] - jnp.arange(sq)[None, :, None])).astype(jnp.float32)
MODS = {
    "alibi": lambda s, b, h, q, k: s + slopes[h] * (k - q),
    "plus80": lambda s, b, h, q, k: s + 80.0,
    "plus40": lambda s, b, h, q, k: s + 40.0,
    "plus20": lambda s, b, h, q, k: s + 20.0,
    "plus10": lambda s, b, h, q, k: s + 10.0,
    "minus80": lambda s, b, h, q, k: s - 80.0,
    "alibi_shift_down": lambda s, b, h, q, k: s + slopes[h] * (k - q) - 48.0,
    "alibi_flipped": lambda s, b, h, q, k: s + slopes[h] * (q - k),
    "alibi_tensor": lambda s, b, h, q, k: s + alibi_t[h, q, k],
    "times3": lambda s, b, h, q, k: s * 3.0,
    "times10": lambda s, b, h, q, k: s * 10.0,
}
for dtype in (jnp.float16, jnp.bfloat16):
    q, k, v, do = _inputs(2, sq, skv, hq, hkv, d, dtype)
    for name, fn in MODS.items():
        mod = scoremod.trace(fn)
        got = jax.jit(lambda *a: _run("cudnn", mod, *a))(q, k, v, do)
        want = jax.jit(lambda *a: _run("xla", mod, *a))(q, k, v, do)
        errs = {n: round(_rel_err(g, w), 5) for n, g, w in zip(("O", "LSE", "dQ", "dK", "dV"), got, want)}
        dq = np.asarray(got[2], np.float32)
        bad = ~np.isfinite(dq)
        where = ""
        if bad.any():
            idx = np.argwhere(bad)
            where = f" nonfinite dQ: {bad.sum()} of {bad.size}; heads {sorted(set(idx[:,2].tolist()))}; rows {sorted(set(idx[:,1].tolist()))[:12]}...; values {sorted(set(dq[bad].tolist()))[:3]}"
        again = jax.jit(lambda *a: _run("cudnn", mod, *a))(q, k, v, do)[2]
        same = bool(np.array_equal(np.asarray(again, np.float32), dq, equal_nan=True))
        print(f"{dtype.__name__:8s} {name:18s} {errs} repeat-identical={same}{where}", flush=True)
