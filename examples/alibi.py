"""ALiBi: causal attention with linear biases, the per-head slopes an operand.

ALiBi (Press et al., "Train Short, Test Long", 2022) adds
`slope[h] * (kv_idx - q_idx)` to each score of head `h`. The standard
slopes for `n` heads are the geometric sequence `2 ** (-8 * i / n)`,
i = 1..n, when `n` is a power of two; otherwise the `2 ** floor(log2 n)`
slopes of that power of two followed by every other slope of the next power
of two (the interpolation of the paper's reference code).

The slopes are a jax array the mod closes over, so scoremod makes them an
**operand**: their shape and dtype are part of the mod's key, their values
are not. The script shows that

  * tracing the same function over other slopes, or `mod.bind(c0=...)`,
    gives the same mod and the same key (so the same compiled kernel);
  * a `jax.jit` function that takes the mod as an argument (a ScoreMod is a
    pytree whose leaves are its operands) compiles once for both;
  * Python-float slopes would instead be constants, and change the key;
  * the outputs match attention with the bias added in plain jax.numpy.

    python examples/alibi.py
    python examples/alibi.py --heads 12 --kv-heads 4
"""

import argparse
import math

import jax
import jax.numpy as jnp

import scoremod


def alibi_slopes(n):
    """The standard ALiBi slopes for ``n`` heads (a list of Python floats)."""

    def power_of_two(n):
        start = 2.0 ** (-8.0 / n)  # = 2 ** (-2 ** -(log2(n) - 3)) of the reference code
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_two(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_two(closest) + alibi_slopes(2 * closest)[0::2][: n - closest]


def alibi_mod(slopes):
    """Causal ALiBi over a [heads] float32 jax array of slopes (an operand)."""

    def mod(score, b, h, q_idx, kv_idx):
        biased = score + slopes[h] * (kv_idx - q_idx)
        return jnp.where(q_idx >= kv_idx, biased, -jnp.inf)

    return scoremod.trace(mod)


@jax.jit
def dense_alibi(q, k, v, slopes):
    """The same attention in plain jax.numpy: an explicit [heads, q, kv] bias."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    k, v = (jnp.repeat(x, q.shape[2] // x.shape[2], axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    rel = jnp.arange(k.shape[1])[None, :] - jnp.arange(q.shape[1])[:, None]  # kv - q
    s = s + slopes[:, None, None] * rel
    s = jnp.where(rel <= 0, s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--heads", type=int, default=12, help="query heads; 12 is not a power of two")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads; default: --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--implementation", type=lambda t: None if t == "auto" else t,
                   default=None, choices=[None, "xla", "cudnn"], metavar="{auto,xla,cudnn}",
                   help="auto (the default) is implementation=None")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    n = args.heads
    slopes = jnp.asarray(alibi_slopes(n), jnp.float32)
    print(f"ALiBi slopes for {n} heads: " + ", ".join(f"{s:.6g}" for s in alibi_slopes(n)))

    mod = alibi_mod(slopes)
    print(f"mod: {mod}")
    print(f"     operands {mod.operand_names}, key {mod.key[:16]}...")

    # Other slope values: the same mod, the same key.
    halved = slopes / 2
    retraced = alibi_mod(halved)
    rebound = mod.bind(c0=halved)  # traced operands are named c0, c1, ... in order of use
    same_key = mod.key == retraced.key == rebound.key and mod.same_ir(retraced)
    print(f"slopes / 2, traced again: key {retraced.key[:16]}...; "
          f"with mod.bind(c0=...): key {rebound.key[:16]}...  same key: {same_key}")
    # A Python float is a constant instead: it is in the text, and in the key.
    const_mods = [scoremod.trace(lambda score, b, h, q_idx, kv_idx, s=s: jnp.where(
        q_idx >= kv_idx, score + s * (kv_idx - q_idx), -jnp.inf)) for s in (0.5, 0.25)]
    const_keys_differ = const_mods[0].key != const_mods[1].key
    print("one Python-float slope for all heads is a constant:")
    for m in const_mods:
        print(f"     {m}  key {m.key[:16]}...")

    dtype = jnp.dtype(args.dtype)
    kv_heads = args.kv_heads or n
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (args.batch, args.seq, n, args.head_dim), dtype)
    k = jax.random.normal(kk, (args.batch, args.seq, kv_heads, args.head_dim), dtype)
    v = jax.random.normal(kv, (args.batch, args.seq, kv_heads, args.head_dim), dtype)
    impl = args.implementation
    path = impl or scoremod.which_implementation(q, k, v, mod)[0]
    print(f"device: {jax.devices()[0].device_kind}; q {q.shape}, k/v {k.shape}; "
          f"implementation={impl!r} runs the {path} path")

    compiles = []

    @jax.jit
    def attend(q, k, v, mod):  # the mod is a pytree argument: its slopes are traced values
        compiles.append(mod.key)  # runs only while tracing, i.e. once per compilation
        return scoremod.attention(q, k, v, mod, implementation=impl)

    results = {"slopes": alibi_slopes(n), "same_key": same_key,
               "constant_keys_differ": const_keys_differ, "path": path}
    for label, m, s in (("slopes", mod, slopes), ("slopes / 2", rebound, halved)):
        out = attend(q, k, v, m)
        ref = dense_alibi(q, k, v, s)
        diff = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
        print(f"[{label:10s}] max |out - dense jnp| / max |dense| = {diff:.2e}")
        results[f"diff {label}"] = diff
    results["compilations"] = len(compiles)
    print(f"jitted attention compiled {len(compiles)} time(s) for both slope arrays")
    return results


if __name__ == "__main__":
    main()
