"""Quick start: a score_mod in five lines, attention with it, and its gradients.

The mod soft-caps the scores at 30 (as Gemma 2 does) and masks the future
(causal). `scoremod.attention` runs it with `implementation=None`, which
takes the fused cuDNN kernel on a suitable NVIDIA GPU and the jax.numpy
reference path everywhere else; the script says which one ran. It then
takes gradients with `jax.grad` and compares output and gradients with

  * the reference path, `implementation="xla"` (float32 scores and softmax);
  * a plain jax.numpy attention written out by hand.

On a CPU `None` already is the reference path (the comparison with
`"xla"` is then skipped); the hand-written attention still checks the
numbers.

    python examples/quickstart.py
    python examples/quickstart.py --seq 512 --heads 8 --kv-heads 2   # GQA
"""

import argparse

import jax
import jax.numpy as jnp

import scoremod


# The mod: one score in, one score out. Scalars, not arrays; jnp.where, not `if`.
def softcap_causal(score, b, h, q_idx, kv_idx):
    capped = 30.0 * jnp.tanh(score / 30.0)
    return jnp.where(q_idx >= kv_idx, capped, -jnp.inf)


@jax.jit
def plain_attention(q, k, v, scale):
    """The same attention in plain jax.numpy, float32, for comparison."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    k, v = (jnp.repeat(x, q.shape[2] // x.shape[2], axis=2) for x in (k, v))  # GQA
    hi = jax.lax.Precision.HIGHEST  # float32, not the TF32 GPUs use by default
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=hi) * scale
    s = 30.0 * jnp.tanh(s / 30.0)
    s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v, precision=hi)


def implementation_arg(text):
    return None if text == "auto" else text


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--heads", type=int, default=4, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="key/value heads (GQA); default: --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--implementation", type=implementation_arg, default=None,
                   choices=[None, "xla", "cudnn"], metavar="{auto,xla,cudnn}",
                   help="auto (the default) is implementation=None")
    return p.parse_args(argv)


def path_taken(q, k, v, mod, implementation):
    """"cudnn" or "xla": the path scoremod.attention takes for this call."""
    if implementation is None:
        return scoremod.which_implementation(q, k, v, mod)[0]
    return implementation  # "cudnn" raises CudnnUnavailableError when it cannot run


def max_rel_diff(a, b):
    """max |a - b| / max |b|, in float32."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))


def main(argv=None):
    args = parse_args(argv)
    mod = scoremod.trace(softcap_causal)
    print(f"mod:  {mod}")
    print(f"key:  {mod.key}")
    print(f"grad: {mod.grad}   (d mod / d score, used by the fused backward pass)")

    dtype = jnp.dtype(args.dtype)
    kv_heads = args.kv_heads or args.heads
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (args.batch, args.seq, args.heads, args.head_dim), dtype)
    k = jax.random.normal(kk, (args.batch, args.seq, kv_heads, args.head_dim), dtype)
    v = jax.random.normal(kv, (args.batch, args.seq, kv_heads, args.head_dim), dtype)
    scale = args.head_dim ** -0.5

    impl = args.implementation
    path = path_taken(q, k, v, mod, impl)
    fused = path == "cudnn"
    print(f"device: {jax.devices()[0].device_kind}; q {q.shape}, k/v {k.shape}, {dtype.name}")
    print(f"implementation={impl!r} runs the {path} path")
    if impl is None and not fused:
        print(f"  (not fused because: {scoremod.which_implementation(q, k, v, mod)[1]})")

    def attend(q, k, v, implementation):
        return scoremod.attention(q, k, v, mod, implementation=implementation)

    def loss(q, k, v, implementation):
        return jnp.sum(attend(q, k, v, implementation).astype(jnp.float32) ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)
    attend = jax.jit(attend, static_argnums=3)

    out = attend(q, k, v, impl)
    grads = grad(q, k, v, impl)
    if fused:
        out_ref, grads_ref = attend(q, k, v, "xla"), grad(q, k, v, "xla")
    else:  # the same computation: no need to compile it twice
        out_ref, grads_ref = out, grads
    out_plain = plain_attention(q, k, v, scale)
    grads_plain = jax.jit(jax.grad(lambda q, k, v: jnp.sum(plain_attention(q, k, v, scale) ** 2),
                                   argnums=(0, 1, 2)))(q, k, v)

    results = {"fused": fused, "output_shape": out.shape}
    print("max |difference| / max |reference|:")
    xla_label = "vs implementation='xla'" + ("" if fused else " (the same path here)")
    for name, label, o, gs in (("xla", xla_label, out_ref, grads_ref),
                               ("plain", "vs plain jax.numpy", out_plain, grads_plain)):
        diffs = {"out": max_rel_diff(out, o)}
        diffs.update({f"d{n}": max_rel_diff(a, b) for n, a, b in zip("qkv", grads, gs)})
        print(f"  {label}: " + ", ".join(f"{n} {d:.2e}" for n, d in diffs.items()))
        results[name] = diffs
    return results


if __name__ == "__main__":
    main()
