"""A Gemma-2-style decoder stack with scoremod attention: forward and gradients.

What it shows, in the layout of Gemma 2 (small sizes here):

  * attention logits soft-capped at 50 inside the score_mod,
    `50 * tanh(score / 50)`, where `score` is already `q . k * scale`
    (Gemma 2 scales by `query_pre_attn_scalar ** -0.5`, passed as `scale=`);
  * layers alternating between sliding-window causal attention (window 4096
    in the real model; `--window`, small, here) and global causal attention,
    layer 0 being a sliding one: two mods, each traced once, so all layers
    of one kind share one key and one compiled kernel;
  * grouped-query attention (`--kv-heads` < `--heads`), rotary embeddings,
    RMSNorm before *and* after both the attention and the MLP (GeGLU),
    embeddings scaled by sqrt(d_model), tied output embeddings and the final
    logit soft-cap at 30;
  * `jax.value_and_grad` of a next-token loss through the whole stack.

The same model is also run with the attention written in plain jax.numpy
(dense scores, explicit masks) and the losses and gradients are compared.

    python examples/gemma2_block.py
    python examples/gemma2_block.py --layers 6 --seq 512 --window 128
"""

import argparse
import functools
import time

import jax
import jax.numpy as jnp

import scoremod

ATTN_SOFTCAP = 50.0   # Gemma 2: attn_logit_softcapping
FINAL_SOFTCAP = 30.0  # Gemma 2: final_logit_softcapping


def gemma2_mod(window=None):
    """Soft-capped, causal, and (with a window) sliding-window attention."""

    def mod(score, b, h, q_idx, kv_idx):
        keep = q_idx >= kv_idx
        if window is not None:  # a Python value: decided while tracing, part of the key
            keep = keep & (q_idx - kv_idx < window)
        return jnp.where(keep, ATTN_SOFTCAP * jnp.tanh(score / ATTN_SOFTCAP), -jnp.inf)

    return scoremod.trace(mod)


def dense_attention(q, k, v, scale, window=None):
    """The same attention in plain jax.numpy (float32 scores), for comparison."""
    k, v = (jnp.repeat(x, q.shape[2] // x.shape[2], axis=2) for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    s = ATTN_SOFTCAP * jnp.tanh(s / ATTN_SOFTCAP)
    qi, ki = jnp.arange(q.shape[1])[:, None], jnp.arange(k.shape[1])[None, :]
    keep = qi >= ki if window is None else (qi >= ki) & (qi - ki < window)
    p = jax.nn.softmax(jnp.where(keep, s, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32)).astype(q.dtype)


# --- the model ----------------------------------------------------------------


def init_params(key, cfg):
    d, hd, f = cfg.d_model, cfg.head_dim, cfg.mlp_dim
    keys = iter(jax.random.split(key, 1 + 7 * cfg.layers))

    def dense(shape):
        return jax.random.normal(next(keys), shape, jnp.float32) / jnp.sqrt(shape[0])

    layers = [
        {
            "attn_norm": jnp.zeros(d), "post_attn_norm": jnp.zeros(d),
            "mlp_norm": jnp.zeros(d), "post_mlp_norm": jnp.zeros(d),
            "wq": dense((d, cfg.heads * hd)), "wk": dense((d, cfg.kv_heads * hd)),
            "wv": dense((d, cfg.kv_heads * hd)), "wo": dense((cfg.heads * hd, d)),
            "gate": dense((d, f)), "up": dense((d, f)), "down": dense((f, d)),
        }
        for _ in range(cfg.layers)
    ]
    embed = jax.random.normal(next(keys), (cfg.vocab, d), jnp.float32) / jnp.sqrt(d)
    return {"embed": embed, "final_norm": jnp.zeros(d), "layers": layers}


def rms_norm(x, weight, eps=1e-6):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * (1.0 + weight)).astype(x.dtype)  # Gemma: scale by (1 + weight)


def rope(x, base=10000.0):
    """Rotary embeddings on [batch, seq, heads, head_dim] (halves rotated)."""
    half = x.shape[-1] // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freq  # [seq, half]
    sin, cos = jnp.sin(angle)[None, :, None], jnp.cos(angle)[None, :, None]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def layer_windows(cfg):
    """Gemma 2 alternates: even layers sliding-window, odd layers global."""
    return [cfg.window if i % 2 == 0 else None for i in range(cfg.layers)]


def forward(params, tokens, cfg, attend):
    """Logits [batch, seq, vocab]. ``attend(q, k, v, layer)`` is the attention."""
    b, s = tokens.shape
    x = params["embed"][tokens] * jnp.sqrt(float(cfg.d_model))
    for i, p in enumerate(params["layers"]):
        h = rms_norm(x, p["attn_norm"])
        q = (h @ p["wq"]).reshape(b, s, cfg.heads, cfg.head_dim)
        k = (h @ p["wk"]).reshape(b, s, cfg.kv_heads, cfg.head_dim)
        v = (h @ p["wv"]).reshape(b, s, cfg.kv_heads, cfg.head_dim)
        q, k, v = (x.astype(cfg.dtype) for x in (rope(q), rope(k), v))  # bf16 for cuDNN
        o = attend(q, k, v, i).astype(jnp.float32).reshape(b, s, -1)
        x = x + rms_norm(o @ p["wo"], p["post_attn_norm"])
        h = rms_norm(x, p["mlp_norm"])
        h = jax.nn.gelu(h @ p["gate"], approximate=True) * (h @ p["up"])
        x = x + rms_norm(h @ p["down"], p["post_mlp_norm"])
    x = rms_norm(x, params["final_norm"])
    logits = x @ params["embed"].T
    return FINAL_SOFTCAP * jnp.tanh(logits / FINAL_SOFTCAP)


def next_token_loss(params, tokens, cfg, attend):
    logits = forward(params, tokens[:, :-1], cfg, attend)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


# --- the script -----------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--mlp-dim", type=int, default=256)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (+1 for the target)")
    p.add_argument("--window", type=int, default=32, help="sliding window (4096 in Gemma 2)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--implementation", type=lambda t: None if t == "auto" else t,
                   default=None, choices=[None, "xla", "cudnn"], metavar="{auto,xla,cudnn}",
                   help="auto (the default) is implementation=None")
    args = p.parse_args(argv)
    args.dtype = jnp.dtype(args.dtype)
    return args


@jax.jit
def compare(grads, reference):
    """The largest max|a - b| / max|b| over the parameters, and whether all are finite."""
    rel = [jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30)
           for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(reference))]
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(a)) for a in jax.tree.leaves(grads)]))
    return jnp.max(jnp.stack(rel)), finite


def main(argv=None):
    cfg = parse_args(argv)
    scale = cfg.head_dim ** -0.5  # query_pre_attn_scalar = head_dim, as in Gemma 2 2B/9B
    windows = layer_windows(cfg)
    mods = {w: gemma2_mod(w) for w in set(windows)}  # one traced mod per kind of layer
    print(f"{cfg.layers} layers, d_model {cfg.d_model}, {cfg.heads} query heads over "
          f"{cfg.kv_heads} kv heads of dim {cfg.head_dim}, window {cfg.window}, {cfg.dtype.name}")
    layer_mods = [mods[w] for w in windows]
    for i, (w, mod) in enumerate(zip(windows, layer_mods)):
        kind = "global " if w is None else "sliding"
        print(f"  layer {i} {kind} key {mod.key[:12]}  {mod}")

    probe = jnp.zeros((cfg.batch, cfg.seq, cfg.heads, cfg.head_dim), cfg.dtype)
    probe_kv = jnp.zeros((cfg.batch, cfg.seq, cfg.kv_heads, cfg.head_dim), cfg.dtype)
    impl = cfg.implementation
    if impl is None:
        path = scoremod.which_implementation(probe, probe_kv, probe_kv, layer_mods[0])[0]
    else:
        path = impl
    print(f"device: {jax.devices()[0].device_kind}; implementation={impl!r} runs the {path} path")
    if path == "xla" and impl is None:
        reason = scoremod.which_implementation(probe, probe_kv, probe_kv, layer_mods[0])[1]
        print(f"  (not fused because: {reason})")

    def scoremod_attend(q, k, v, layer):
        return scoremod.attention(q, k, v, layer_mods[layer], scale=scale, implementation=impl)

    def dense_attend(q, k, v, layer):
        return dense_attention(q, k, v, scale, windows[layer])

    params = jax.jit(lambda key: init_params(key, cfg))(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (cfg.batch, cfg.seq + 1), 0, cfg.vocab)

    results = {"path": path, "mod_texts": [str(m) for m in layer_mods],
               "mod_keys": [m.key for m in layer_mods]}
    grads = {}
    for label, attend in (("scoremod", scoremod_attend), ("dense jnp", dense_attend)):
        step = jax.jit(jax.value_and_grad(
            functools.partial(next_token_loss, cfg=cfg, attend=attend)))
        t0 = time.perf_counter()
        loss, g = jax.block_until_ready(step(params, tokens))
        t1 = time.perf_counter()
        jax.block_until_ready(step(params, tokens))
        t2 = time.perf_counter()
        grads[label] = g
        print(f"[{label:9s}] loss {float(loss):.5f}; "
              f"compile+run {t1 - t0:.2f} s, run {1e3 * (t2 - t1):.1f} ms")
        results[f"loss_{label.split()[0]}"] = float(loss)
    rel, finite = compare(grads["scoremod"], grads["dense jnp"])
    results["loss_diff"] = abs(results["loss_scoremod"] - results["loss_dense"])
    results["grad_max_rel_diff"], results["grads_finite"] = float(rel), bool(finite)
    print(f"|loss difference| {results['loss_diff']:.2e}; largest max|difference| / "
          f"max|reference| over the {len(jax.tree.leaves(params))} gradients: {float(rel):.2e}"
          f"; all finite: {bool(finite)}")
    return results


if __name__ == "__main__":
    main()
