"""Document masking: packed sequences whose tokens never attend across documents.

Training on packed sequences puts several documents, end to end, into each
row of the batch. A `[batch, seq]` array of document ids says which
document each position belongs to; the mod keeps a score only when query
and key are in the same document, and causal:

    same_doc = doc[b, q_idx] == doc[b, kv_idx]
    where(same_doc & (q_idx >= kv_idx), score, -inf)

`doc` is a jax array the mod closes over, so it is an operand: other
packings reuse the same mod key (and the same compiled kernel).

The script checks isolation two ways:

  1. the packed output equals running each document on its own with plain
     causal attention (each document becomes one row of a second batch,
     left-aligned and zero-padded to the packed length, so one call does
     them all; causal attention never looks at the padding after a row);
  2. the gradient of one document's output with respect to keys and values
     is exactly zero at every position outside that document.

    python examples/document_masking.py
    python examples/document_masking.py --batch 4 --seq 1024 --docs 8
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import scoremod


def pack_documents(rng, batch, seq, docs):
    """Random document boundaries: ids [batch, seq] and (row, start, end) spans."""
    ids = np.zeros((batch, seq), np.int32)
    spans = []
    for row in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, seq), size=docs - 1, replace=False))
        bounds = [0, *cuts.tolist(), seq]
        for d, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            ids[row, start:end] = d
            spans.append((row, start, end))
    return jnp.asarray(ids), spans


def document_mod(doc_ids):
    def mod(score, b, h, q_idx, kv_idx):
        same_doc = doc_ids[b, q_idx] == doc_ids[b, kv_idx]
        return jnp.where(same_doc & (q_idx >= kv_idx), score, -jnp.inf)

    return scoremod.trace(mod)


def causal(score, b, h, q_idx, kv_idx):
    return jnp.where(q_idx >= kv_idx, score, -jnp.inf)


def unpack(x, spans):
    """Each span of ``x`` [batch, seq, heads, dim] as its own left-aligned, zero-padded
    row; also the [docs, seq, 1, 1] mask of the real (not padding) positions."""
    seq = x.shape[1]
    rows = np.asarray([r for r, _, _ in spans])[:, None]
    pos = np.asarray([s for _, s, _ in spans])[:, None] + np.arange(seq)  # [docs, seq]
    real = (pos < np.asarray([e for _, _, e in spans])[:, None])[:, :, None, None]
    return jnp.where(real, x[rows, np.minimum(pos, seq - 1)], 0), real


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--docs", type=int, default=4, help="documents per row")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads; default: --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--implementation", type=lambda t: None if t == "auto" else t,
                   default=None, choices=[None, "xla", "cudnn"], metavar="{auto,xla,cudnn}",
                   help="auto (the default) is implementation=None")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    doc_ids, spans = pack_documents(np.random.default_rng(args.seed), args.batch, args.seq,
                                    args.docs)
    mod = document_mod(doc_ids)
    print(f"mod: {mod}")
    for row in range(args.batch):
        lengths = [e - s for r, s, e in spans if r == row]
        print(f"row {row}: documents of lengths {lengths}")

    dtype = jnp.dtype(args.dtype)
    kv_heads = args.kv_heads or args.heads
    kq, kk, kv = jax.random.split(jax.random.key(args.seed), 3)
    q = jax.random.normal(kq, (args.batch, args.seq, args.heads, args.head_dim), dtype)
    k = jax.random.normal(kk, (args.batch, args.seq, kv_heads, args.head_dim), dtype)
    v = jax.random.normal(kv, (args.batch, args.seq, kv_heads, args.head_dim), dtype)
    impl = args.implementation
    path = impl or scoremod.which_implementation(q, k, v, mod)[0]
    print(f"device: {jax.devices()[0].device_kind}; q {q.shape}, k/v {k.shape}; "
          f"implementation={impl!r} runs the {path} path")

    attend = jax.jit(lambda q, k, v, m: scoremod.attention(q, k, v, m, implementation=impl))

    # 1. Packed versus each document on its own.
    packed = attend(q, k, v, mod)
    (q1, real), (k1, _), (v1, _) = (unpack(x, spans) for x in (q, k, v))
    alone = attend(q1, k1, v1, scoremod.trace(causal))
    diff = unpack(packed, spans)[0].astype(jnp.float32) - alone.astype(jnp.float32)
    max_diff = float(jnp.max(jnp.abs(jnp.where(real, diff, 0))))  # real tokens only
    print(f"max |packed - each document alone| over {len(spans)} documents: {max_diff:.2e}")

    # 2. Gradients of one document's output stay inside that document. The second
    #    document of row 0 has another document before it, visible to a causal mask.
    doc = 1 if len(spans) > 1 else 0
    row, start, end = spans[doc]

    def doc_loss(k, v):
        out = scoremod.attention(q, k, v, mod, implementation=impl)
        return jnp.sum(out[row, start:end].astype(jnp.float32) ** 2)

    dk, dv = jax.jit(jax.grad(doc_loss, argnums=(0, 1)))(k, v)
    inside = jnp.zeros((args.batch, args.seq), bool).at[row, start:end].set(True)
    outside = ~inside[:, :, None, None]
    leaked = float(jnp.max(jnp.abs(jnp.where(outside, dk, 0))) +
                   jnp.max(jnp.abs(jnp.where(outside, dv, 0))))
    inside_norm = float(jnp.linalg.norm(jnp.where(outside, 0, dk).astype(jnp.float32)))
    print(f"gradient of document {doc} (row {row}, positions {start}..{end - 1}) w.r.t. k, v: "
          f"max |.| outside it {leaked:.1e}, norm inside {inside_norm:.3g}")

    # Another packing: the same mod key, new operand values.
    other_ids, _ = pack_documents(np.random.default_rng(args.seed + 1), args.batch, args.seq,
                                  args.docs)
    same_key = document_mod(other_ids).key == mod.key
    print(f"another packing gives the same mod key: {same_key}")
    return {"path": path, "max_diff": max_diff, "gradient_leak": leaked,
            "gradient_inside_norm": inside_norm, "same_key": same_key,
            "documents": len(spans)}


if __name__ == "__main__":
    main()
