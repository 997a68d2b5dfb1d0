"""Probe: the fused backward at exact score ties (zero-padded query rows).

Each mod's value is softplus(s); its derivative is given by a jax.custom_jvp
rule built from one or two ops, so the ratio of fused to reference dQ on the
padded rows (every score exactly 0) shows which op cuDNN evaluates differently
at 0. Prints, per rule: the ratio on padded rows, and the relative dQ error on
the other rows.
"""

import jax
import jax.numpy as jnp
import numpy as np

import scoremod


def with_rule(rule):
    @jax.custom_jvp
    def f(s):
        return jax.nn.softplus(s)

    @f.defjvp
    def f_jvp(primals, tangents):
        (s,), (t,) = primals, tangents
        return f(s), t * rule(s)

    return f


RULES = {
    "exp(s - softplus(s))": lambda s: jnp.exp(s - (jnp.maximum(s, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(s))))),
    "0.5": lambda s: 0.5 + 0.0 * s,
    "exp(s - log 2)": lambda s: jnp.exp(s - 0.6931471805599453),
    "exp(-abs(s)) * 0.5": lambda s: jnp.exp(-jnp.abs(s)) * 0.5,
    "exp(s - max(s, 0)) * 0.5": lambda s: jnp.exp(s - jnp.maximum(s, 0.0)) * 0.5,
    "log1p(exp(-abs(s))) / log 2 * 0.5": lambda s: jnp.log1p(jnp.exp(-jnp.abs(s))) / 0.6931471805599453 * 0.5,
    "sigmoid(s)": lambda s: jax.nn.sigmoid(s),
    "max(s, 0) + 0.5": lambda s: jnp.maximum(s, 0.0) + 0.5,
}


def run(impl, mod, q, k, v, do):
    def f(q, k, v):
        return scoremod.attention(q, k, v, mod, implementation=impl)

    o, vjp = jax.vjp(f, q, k, v)
    return vjp(do)[0]


def main():
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    shape_q, shape_kv = (2, 128, 4, 64), (2, 192, 2, 64)
    q = jax.random.normal(keys[0], shape_q, jnp.float32).astype(jnp.bfloat16).at[:, 96:].set(0)
    k = jax.random.normal(keys[1], shape_kv, jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], shape_kv, jnp.float32).astype(jnp.bfloat16)
    do = jax.random.normal(keys[3], shape_q, jnp.float32).astype(jnp.bfloat16)
    cases = {name: scoremod.trace(lambda s, b, h, qi, ki, f=with_rule(r): f(s)) for name, r in RULES.items()}
    cases["jax.nn.softplus (as traced)"] = scoremod.trace(lambda s, b, h, qi, ki: jax.nn.softplus(s))
    for name, mod in cases.items():
        try:
            got = np.asarray(jax.jit(lambda *a: run("cudnn", mod, *a))(q, k, v, do), np.float32)
        except scoremod.ScoreModError as e:
            print(f"{name:40s} refused: {str(e)[:120]}")
            continue
        want = np.asarray(jax.jit(lambda *a: run("xla", mod, *a))(q, k, v, do), np.float32)
        pad_g, pad_w = got[:, 96:], want[:, 96:]
        ratio = float((pad_g * pad_w).sum() / max((pad_w * pad_w).sum(), 1e-30))
        rest = float(np.abs(got[:, :96] - want[:, :96]).max() / (np.abs(want[:, :96]).max() + 1e-6))
        print(f"{name:40s} padded-row dQ ratio fused/reference {ratio:7.4f}   other rows rel err {rest:.4f}")
        print(f"{'':40s} mod: {mod}")


if __name__ == "__main__":
    main()
