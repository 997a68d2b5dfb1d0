"""T5-style relative position bias: a learnable [num_buckets, heads] table.

T5 adds to each score a learned bias `table[bucket(kv_idx - q_idx), h]`.
Bidirectional bucketing (the encoder's) gives half of the buckets to keys
before the query and half to keys after it; in each half, distances below
`max_exact` get a bucket each, and larger ones share log-spaced buckets up
to `max_distance`, beyond which all distances share the last bucket.

T5 computes the log-spaced bucket with a float `log` and a float -> int
conversion. Both paths run that: the fused path hands a computed index to
XLA, which materializes the looked-up bias before the kernel runs, so the
index may use any op. This example also computes the *same* buckets with
integer ops only (the boundaries of the log-spaced buckets are Python ints
worked out once; the bucket of a distance `n` is `min(n, max_exact)` plus
the number of boundaries `n` has reached) and checks them against T5's
formula: the integer form has no float rounding at bucket boundaries.

What each path does with the mod:

  * reference path (`implementation="xla"`, and `None` on a CPU): runs it,
    and computes gradients for the table too; the script trains the table
    with a few SGD steps and shows that it changes and the loss falls.
  * fused cuDNN path: the table is read through a *computed* index
    (`mod.has_computed_index` is True), so XLA materializes the bias into a
    [1, heads, q_len, kv_len] float32 tensor before the kernel runs
    (correct; it costs that memory). cuDNN returns dQ, dK and dV only, never
    gradients for the table: when the table is being differentiated,
    `implementation="cudnn"` raises, and `implementation=None` falls back to
    the reference path for that call with a warning. A fixed table (wrapped
    in `jax.lax.stop_gradient`, or simply not differentiated) stays fused.

    python examples/t5_relative_bias.py
    python examples/t5_relative_bias.py --implementation xla --steps 50
"""

import argparse
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import scoremod
from scoremod.lowering.cudnn import rules as cudnn_rules


def t5_bucket_reference(relative_position, num_buckets=32, max_distance=128):
    """T5's bidirectional bucketing (as in Hugging Face's T5Attention), in NumPy."""
    num_buckets //= 2
    buckets = (relative_position > 0).astype(np.int32) * num_buckets
    n = np.abs(relative_position)
    max_exact = num_buckets // 2
    with np.errstate(divide="ignore", invalid="ignore"):  # log(0): not used, n < max_exact
        large = max_exact + (np.log(n.astype(np.float32) / max_exact)
                             / math.log(max_distance / max_exact)
                             * (num_buckets - max_exact)).astype(np.int32)
    large = np.minimum(large, num_buckets - 1)
    return buckets + np.where(n < max_exact, n, large)


def log_boundaries(num_buckets, max_distance):
    """The smallest distances of the log-spaced buckets of one half, as Python ints."""
    half = num_buckets // 2
    n = np.arange(half // 2, max_distance + 1)
    buckets = t5_bucket_reference(-n, num_buckets, max_distance)  # kv before q: first half
    return [int(n[np.argmax(buckets >= j)]) for j in range(half // 2 + 1, half)]


def make_bucket_fn(num_buckets, max_distance):
    """bucket(q_idx, kv_idx) with integer ops only (works on scalars and arrays)."""
    half, max_exact = num_buckets // 2, num_buckets // 4
    boundaries = log_boundaries(num_buckets, max_distance)

    def bucket(q_idx, kv_idx):
        rel = kv_idx - q_idx
        n = jnp.abs(rel)
        b = jnp.minimum(n, max_exact) + sum((n >= t).astype(jnp.int32) for t in boundaries)
        return jnp.where(rel > 0, b + half, b)  # keys after the query: second half

    return bucket


def t5_mod(table, bucket):
    def mod(score, b, h, q_idx, kv_idx):
        return score + table[bucket(q_idx, kv_idx), h]

    return scoremod.trace(mod)


def t5_mod_float_log(table, num_buckets, max_distance):
    """The same bias written as T5 writes it (float log, then int)."""
    half, max_exact = num_buckets // 2, num_buckets // 4

    def mod(score, b, h, q_idx, kv_idx):
        rel = kv_idx - q_idx
        n = jnp.abs(rel)
        large = max_exact + (jnp.log(jnp.maximum(n, 1) / max_exact)
                             / math.log(max_distance / max_exact)
                             * (half - max_exact)).astype(jnp.int32)
        large = jnp.minimum(large, half - 1)
        bucket = jnp.where(rel > 0, half, 0) + jnp.where(n < max_exact, n, large)
        return score + table[bucket, h]

    return scoremod.trace(mod)


def fused_verdict(mod):
    """What the fused path makes of a mod, whatever the device (as `scoremod show`)."""
    try:
        cudnn_rules.check_supported(mod.expr, mod.sources)
    except scoremod.ScoreModError as e:
        return f"refused: {e}"
    if mod.has_computed_index:
        return "supported; the table lookup is materialized by XLA into a bias tensor"
    return "supported"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--num-buckets", type=int, default=32)
    p.add_argument("--max-distance", type=int, default=128)
    p.add_argument("--steps", type=int, default=20, help="SGD steps on the table")
    p.add_argument("--lr", type=float, default=3.0)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--implementation", type=lambda t: None if t == "auto" else t,
                   default=None, choices=[None, "xla", "cudnn"], metavar="{auto,xla,cudnn}",
                   help="auto (the default) is implementation=None")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    nb, md, heads, impl = args.num_buckets, args.max_distance, args.heads, args.implementation
    bucket = make_bucket_fn(nb, md)
    rel = np.arange(-4 * md, 4 * md + 1)
    ours = np.asarray(jax.jit(bucket)(0, rel))  # q_idx = 0, kv_idx = rel
    buckets_match = bool(np.array_equal(ours, t5_bucket_reference(rel, nb, md)))
    print(f"{nb} buckets, max distance {md}; log-spaced bucket boundaries "
          f"{log_boundaries(nb, md)}; integer buckets == T5's formula for |rel| <= {4 * md}: "
          f"{buckets_match}")

    teacher = jax.random.normal(jax.random.key(1), (nb, heads), jnp.float32)
    table = jnp.zeros((nb, heads), jnp.float32)
    mod = t5_mod(table, bucket)
    print(f"mod: {mod}")
    print(f"has_computed_index: {mod.has_computed_index}")
    print(f"fused path, integer buckets: {fused_verdict(mod)}")
    print(f"fused path, T5's float log:  {fused_verdict(t5_mod_float_log(table, nb, md))}")

    dtype = jnp.dtype(args.dtype)
    shape = (args.batch, args.seq, heads, args.head_dim)
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, shape, dtype) for key in keys)
    fused_ok = scoremod.which_implementation(q, k, v, mod)[0] == "cudnn"
    print(f"device: {jax.devices()[0].device_kind}; q, k, v {shape} {dtype.name}")
    print(f"forward, implementation={impl!r}: "
          f"{impl or ('cudnn' if fused_ok else 'xla')} path")

    # The bias in plain jax.numpy: check the forward against it.
    pos = np.arange(args.seq)
    bias_ids = t5_bucket_reference(pos[None, :] - pos[:, None], nb, md)  # [q, kv]

    @jax.jit
    def dense(q, k, v, table):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        s = s / math.sqrt(q.shape[-1]) + jnp.transpose(table[bias_ids], (2, 0, 1))
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v.astype(jnp.float32))

    attend = jax.jit(lambda q, k, v, m, impl: scoremod.attention(q, k, v, m, implementation=impl),
                     static_argnums=4)
    target = attend(q, k, v, mod.bind(c0=teacher), impl)  # traced operands are c0, c1, ...
    ref = dense(q, k, v, teacher)
    fwd_diff = float(jnp.max(jnp.abs(target.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
    print(f"max |out - dense jnp with T5 buckets| / max |dense| = {fwd_diff:.2e}")

    # Learn the table: the student (zeros) fits the teacher's outputs. A ScoreMod is a
    # pytree whose leaves are its operands, so jax.grad of a function of the mod returns
    # a ScoreMod holding d loss / d table.
    def loss(m, train_impl):
        out = scoremod.attention(q, k, v, m, implementation=train_impl)
        err = jnp.sum((out.astype(jnp.float32) - target.astype(jnp.float32)) ** 2, axis=-1)
        return jnp.mean(err)  # squared error of each output vector, averaged

    step = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    train_impl = impl
    if impl == "cudnn":
        try:
            step(mod, "cudnn")
        except scoremod.ScoreModError as e:
            print(f"table gradient with implementation='cudnn' raises, as documented:\n  {e}")
            print("training with implementation='xla' instead")
            train_impl = "xla"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first_loss, grads = step(mod, train_impl)
    notes = [str(w.message) for w in caught if "scoremod" in str(w.message)]
    for note in notes:
        print(f"warning: {note}")
    if train_impl is None:
        how = ("reference path (fused path fell back, see the warning)" if notes
               else "cudnn path" if fused_ok else "reference path")
    else:
        how = f"{train_impl} path"
    grad_norm = float(jnp.linalg.norm(grads.operands[0]))
    print(f"training the table ({args.steps} SGD steps, lr {args.lr}) on the {how}; "
          f"first |d loss / d table| = {grad_norm:.3g}")
    losses = [float(first_loss)]
    for i in range(args.steps):
        mod = jax.tree.map(lambda p, g: p - args.lr * g, mod, grads)
        value, grads = step(mod, train_impl)
        losses.append(float(value))
        if i == 0 or (i + 1) % max(1, args.steps // 4) == 0:
            print(f"  step {i + 1:4d}: loss {losses[-1]:.3e}")
    learned = mod.operands[0]
    change = float(jnp.linalg.norm(learned - table))
    print(f"loss {losses[0]:.3e} -> {losses[-1]:.3e}; the table moved by {change:.3g} (norm)")
    return {"buckets_match": buckets_match, "forward_diff": fwd_diff, "grad_norm": grad_norm,
            "losses": losses, "table_change": change, "fell_back_with_warning": bool(notes)}


if __name__ == "__main__":
    main()
