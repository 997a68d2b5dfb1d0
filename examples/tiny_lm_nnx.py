"""A tiny language model in Flax NNX with scoremod attention, trained on a copy task.

The model is a small pre-norm decoder: token and learned position
embeddings, a few blocks of (RMSNorm, multi-head attention, RMSNorm, MLP),
and an output projection. Its attention is `scoremod.attention`, called
directly inside an `nnx.Module`, with a soft-capped causal score_mod:

    where(q_idx >= kv_idx, 20 * tanh(score / 20), -inf)

The data is synthetic: each sequence repeats a random pattern of
`--period` tokens, so every token after the first period can be predicted
by copying the token `period - 1` positions back, which attention learns.
The script prints the loss falling (all positions, and the predictable
"copy" positions alone), the time per training step and, at the end, the
accuracy of greedy predictions on the copy positions.

It uses optax's Adam when optax is installed (Flax brings it), else plain
SGD written by hand (`--optimizer sgd` picks it anyway). Flax is required:
`pip install flax` (a version that works with the installed jax).

    python examples/tiny_lm_nnx.py
    python examples/tiny_lm_nnx.py --steps 1000 --layers 4 --seq 256
"""

import argparse
import sys
import time

import jax
import jax.numpy as jnp

import scoremod

try:
    from flax import nnx
except ImportError:
    sys.exit("examples/tiny_lm_nnx.py needs Flax NNX, which is not installed: "
             "pip install flax (a release that works with the installed jax)")
try:
    import optax
except ImportError:
    optax = None

CAP = 20.0


def softcap_causal(score, b, h, q_idx, kv_idx):
    return jnp.where(q_idx >= kv_idx, CAP * jnp.tanh(score / CAP), -jnp.inf)


MOD = scoremod.trace(softcap_causal)


class Attention(nnx.Module):
    def __init__(self, d_model, heads, head_dim, dtype, implementation, *, rngs):
        self.heads, self.head_dim = heads, head_dim
        self.dtype, self.implementation = dtype, implementation
        self.qkv = nnx.Linear(d_model, 3 * heads * head_dim, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(heads * head_dim, d_model, use_bias=False, rngs=rngs)

    def __call__(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(x).reshape(b, s, 3, self.heads, self.head_dim).astype(self.dtype)
        o = scoremod.attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], MOD,
                               implementation=self.implementation)
        return self.out(o.astype(x.dtype).reshape(b, s, -1))


class Block(nnx.Module):
    def __init__(self, d_model, heads, head_dim, dtype, implementation, *, rngs):
        self.attn_norm = nnx.RMSNorm(d_model, rngs=rngs)
        self.attn = Attention(d_model, heads, head_dim, dtype, implementation, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(d_model, rngs=rngs)
        self.up = nnx.Linear(d_model, 4 * d_model, rngs=rngs)
        self.down = nnx.Linear(4 * d_model, d_model, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))


class TinyLM(nnx.Module):
    def __init__(self, vocab, seq, d_model, layers, heads, head_dim, dtype, implementation, *,
                 rngs):
        self.tokens = nnx.Embed(vocab, d_model, rngs=rngs)
        self.positions = nnx.Embed(seq, d_model, rngs=rngs)
        self.blocks = nnx.List([Block(d_model, heads, head_dim, dtype, implementation, rngs=rngs)
                                for _ in range(layers)])
        self.norm = nnx.RMSNorm(d_model, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.tokens(tokens) + self.positions(jnp.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def repeating_batch(key, batch, seq, period, vocab):
    """[batch, seq + 1] tokens: a random pattern of ``period`` tokens, repeated."""
    pattern = jax.random.randint(key, (batch, period), 0, vocab)
    return jnp.tile(pattern, (1, (seq + 1) // period + 1))[:, : seq + 1]


def losses(model, tokens, period):
    """Mean next-token loss over all positions and over the copy positions alone."""
    logits = model(tokens[:, :-1])
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1)[..., 0]
    copy = jnp.arange(nll.shape[1]) >= period - 1  # the target is a copy of an earlier token
    return jnp.mean(nll), jnp.sum(nll * copy) / (copy.sum() * nll.shape[0]), logits


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--period", type=int, default=8, help="length of the repeated pattern")
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--lr", type=float, default=None, help="default: 3e-3 (adam), 0.3 (sgd)")
    p.add_argument("--optimizer", choices=["adam", "sgd"], default="adam" if optax else "sgd")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="of q, k, v in attention (the fused path takes 16-bit floats)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=None)
    p.add_argument("--implementation", type=lambda t: None if t == "auto" else t,
                   default=None, choices=[None, "xla", "cudnn"], metavar="{auto,xla,cudnn}",
                   help="auto (the default) is implementation=None")
    args = p.parse_args(argv)
    if args.optimizer == "adam" and optax is None:
        p.error("--optimizer adam needs optax (pip install optax); use --optimizer sgd")
    if args.lr is None:
        args.lr = 3e-3 if args.optimizer == "adam" else 0.3
    return args


def main(argv=None):
    args = parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    # Built under nnx.jit: one compilation instead of one per initializer.
    model = nnx.jit(lambda: TinyLM(args.vocab, args.seq, args.d_model, args.layers, args.heads,
                                   args.head_dim, dtype, args.implementation,
                                   rngs=nnx.Rngs(args.seed)))()
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    probe = jnp.zeros((args.batch, args.seq, args.heads, args.head_dim), dtype)
    impl = args.implementation
    path = impl or scoremod.which_implementation(probe, probe, probe, MOD)[0]
    print(f"TinyLM: {args.layers} layers, d_model {args.d_model}, {args.heads} heads of "
          f"{args.head_dim}, vocab {args.vocab}, {n_params} parameters")
    print(f"mod: {MOD}")
    print(f"device: {jax.devices()[0].device_kind}; implementation={impl!r} runs the {path} path")
    print(f"task: repeat a random pattern of {args.period} tokens; batch {args.batch} x "
          f"{args.seq} tokens; {args.optimizer} lr {args.lr}, {args.steps} steps")

    def loss_fn(model, tokens):
        loss, copy_loss, _ = losses(model, tokens, args.period)
        return loss, copy_loss

    if args.optimizer == "adam":
        optimizer = nnx.jit(lambda m: nnx.Optimizer(m, optax.adam(args.lr), wrt=nnx.Param))(model)

        @nnx.jit
        def train_step(model, optimizer, tokens):
            (loss, copy_loss), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, tokens)
            optimizer.update(model, grads)
            return loss, copy_loss
    else:
        optimizer = None

        @nnx.jit
        def train_step(model, optimizer, tokens):  # plain SGD, by hand
            (loss, copy_loss), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, tokens)
            params = nnx.state(model, nnx.Param)
            nnx.update(model, jax.tree.map(lambda p, g: p - args.lr * g, params, grads))
            return loss, copy_loss

    make_batch = jax.jit(lambda key: repeating_batch(key, args.batch, args.seq, args.period,
                                                     args.vocab))
    key = jax.random.key(args.seed + 1)
    log_every = args.log_every or max(1, args.steps // 10)
    history = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        key, sub = jax.random.split(key)
        loss, copy_loss = train_step(model, optimizer, make_batch(sub))
        if step == 1:
            loss.block_until_ready()
            compiled = time.perf_counter()
            print(f"step    1: loss {float(loss):.4f}, copy loss {float(copy_loss):.4f} "
                  f"(compile + first step {compiled - start:.2f} s)")
            history.append((1, float(loss), float(copy_loss)))
            window_start, window_steps = time.perf_counter(), 0
            continue
        window_steps += 1
        if step % log_every == 0 or step == args.steps:
            loss, copy_loss = float(loss), float(copy_loss)  # waits for the step
            ms = 1e3 * (time.perf_counter() - window_start) / window_steps
            print(f"step {step:4d}: loss {loss:.4f}, copy loss {copy_loss:.4f}, {ms:.2f} ms/step")
            history.append((step, loss, copy_loss))
            window_start, window_steps = time.perf_counter(), 0
    total = time.perf_counter() - compiled if args.steps > 1 else 0.0

    tokens = make_batch(jax.random.key(args.seed + 2))  # held-out batch
    _, copy_loss, logits = nnx.jit(losses, static_argnums=2)(model, tokens, args.period)
    hits = (jnp.argmax(logits, -1) == tokens[:, 1:])[:, args.period - 1:]
    accuracy = float(jnp.mean(hits))
    per_step = 1e3 * total / max(1, args.steps - 1)
    print(f"held-out batch: copy loss {float(copy_loss):.4f}, greedy accuracy on copy positions "
          f"{accuracy:.1%}; {per_step:.2f} ms per step after compilation")
    return {"path": path, "history": history, "first_loss": history[0][1],
            "last_loss": history[-1][1], "accuracy": accuracy, "ms_per_step": per_step}


if __name__ == "__main__":
    main()
