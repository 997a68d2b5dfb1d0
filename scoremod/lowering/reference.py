"""The reference path: the IR evaluated with jax.numpy, and attention around it.

It runs anywhere JAX runs, is jit-able and differentiable (gradients reach
the operands), and materializes the [batch, heads, q, kv] scores in float32.
It is the definition the fused path is tested against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from scoremod.dsl import ir
from scoremod.dsl.ir import BOOL, F32, I32
from scoremod.dsl.ops import evaluate_op

_JNP_DTYPE = {F32: jnp.float32, I32: jnp.int32, BOOL: jnp.bool_}


def evaluate(expr: ir.Node, inputs: dict, operands: dict):
    """Value of ``expr`` given arrays for the variables and the operands."""
    vals = {}
    for node in ir.toposort(expr):
        if node.op == "const":
            vals[node] = jnp.asarray(node.attr, _JNP_DTYPE[node.dtype])
        elif node.op == "var":
            vals[node] = jnp.asarray(inputs[node.attr], _JNP_DTYPE[node.dtype])
        elif node.op == "operand":
            continue
        elif node.op == "materialize":  # lowering-internal: a value computed ahead
            vals[node] = vals[node.args[0]]
        elif node.op == "load":
            vals[node] = _load(node, operands[node.args[0].attr[0]], [vals[a] for a in node.args[1:]])
        else:
            vals[node] = evaluate_op(node.op, [vals[a] for a in node.args], node.attr)
    return vals[expr]


def _load(node, array, idx):
    array = jnp.asarray(array)
    shape = node.args[0].attr[1]
    # Indices clamp into range, as XLA's dynamic_slice does.
    idx = tuple(jnp.clip(i, 0, n - 1) for i, n in zip(idx, shape))
    out = array[idx] if idx else array
    return out.astype(_JNP_DTYPE[node.dtype])


def scores_and_lse_reference(query, key, value, mod, scale, return_lse):
    """Attention with ``mod`` applied to the scaled scores; layout [B, S, H, D]."""
    b, sq, hq, d = query.shape
    _, skv, hkv, dv = value.shape
    groups = hq // hkv
    f32 = jnp.float32
    precision = jax.lax.Precision.HIGHEST
    # Query head i reads kv head i // groups (as jax.nn.dot_product_attention).
    q = query.reshape(b, sq, hkv, groups, d)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q, key, preferred_element_type=f32, precision=precision)
    s = s.reshape(b, hq, sq, skv) * jnp.asarray(scale, f32)
    if mod is not None:
        bi = jnp.arange(b, dtype=jnp.int32)[:, None, None, None]
        hi = jnp.arange(hq, dtype=jnp.int32)[None, :, None, None]
        qi = jnp.arange(sq, dtype=jnp.int32)[None, None, :, None]
        ki = jnp.arange(skv, dtype=jnp.int32)[None, None, None, :]
        s = jnp.broadcast_to(mod(s, bi, hi, qi, ki).astype(f32), s.shape)
    # A fully masked row (every score -inf) gives output 0 and LSE -inf, with
    # zero gradients, instead of NaN.
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    empty = denom == 0.0
    safe = jnp.where(empty, 1.0, denom)
    p = p / safe
    p = p.reshape(b, hkv, groups, sq, skv)
    # A key of weight 0 (masked, or underflowed) never contributes, even when
    # its value is NaN or inf (0 * nan would make the row NaN); a row that
    # gives weight to a key with a non-finite value is NaN. docs/guide.md,
    # "Masked rows", defines this for every path.
    v = value.astype(f32)
    finite = jnp.isfinite(v)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p, jnp.where(finite, v, 0.0), precision=precision)
    bad_key = jnp.any(~finite, axis=-1).astype(f32)  # [b, skv, hkv]
    touched = jnp.einsum("bhgqk,bkh->bqhg", (p > 0).astype(f32), bad_key, precision=precision)
    out = jnp.where(touched[..., None] > 0, jnp.nan, out)
    out = out.reshape(b, sq, hq, dv).astype(query.dtype)
    if not return_lse:
        return out, None
    lse = jnp.where(empty, -jnp.inf, jnp.log(safe) + m)[..., 0]
    return out, lse
