"""The reference path: the IR evaluated with jax.numpy, and attention around it.

It runs anywhere JAX runs, is jit-able and differentiable (gradients reach
the operands), and materializes the [batch, heads, q, kv] scores in float32.
It is the definition the fused paths are tested against.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from scoremod import device
from scoremod.dsl.scoremod import ScoreMod
from scoremod.lowering.backend import Backend


_PRECISION = jax.lax.Precision.HIGHEST


def modified_scores(query, key, mod, scale):
    """The float32 [B, Hq, Sq, Skv] scores ``mod(scale * q . k, b, h, q_idx, kv_idx)``."""
    b, sq, hq, d = query.shape
    _, skv, hkv, _ = key.shape
    f32 = jnp.float32
    # Query head i reads kv head i // groups (as jax.nn.dot_product_attention).
    q = query.reshape(b, sq, hkv, hq // hkv, d)
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q, key, preferred_element_type=f32,
                   precision=_PRECISION)
    s = s.reshape(b, hq, sq, skv) * jnp.asarray(scale, f32)
    if mod is not None:
        bi = jnp.arange(b, dtype=jnp.int32)[:, None, None, None]
        hi = jnp.arange(hq, dtype=jnp.int32)[None, :, None, None]
        qi = jnp.arange(sq, dtype=jnp.int32)[None, None, :, None]
        ki = jnp.arange(skv, dtype=jnp.int32)[None, None, None, :]
        s = jnp.broadcast_to(mod(s, bi, hi, qi, ki).astype(f32), s.shape)
    return s


def scores_and_lse_reference(query, key, value, mod, scale, return_lse):
    """Attention with ``mod`` applied to the scaled scores; layout [B, S, H, D]."""
    b, sq, hq, d = query.shape
    _, skv, hkv, dv = value.shape
    groups = hq // hkv
    f32 = jnp.float32
    precision = _PRECISION
    s = modified_scores(query, key, mod, scale)
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


# float32 arrays of [B, H, Sq, Skv] entries the reference path holds at once
# at the least: the scores and their gradient (the softmax's exp and the
# mod's intermediates come on top). Only a lower bound: a call refused by it
# could not have run.
_SCORE_ARRAYS = 2


def memory_needed(problem) -> int:
    """Bytes the reference path needs at least for ``problem`` (a lower bound)."""
    return _SCORE_ARRAYS * 4 * problem.scores


def _gib(n):
    return f"{n / 2**30:.1f} GiB"


@dataclasses.dataclass(frozen=True)
class ReferencePlan:
    mod: ScoreMod | None  # the expression only: operand values travel beside it
    scale: float
    return_lse: bool


class Reference(Backend):
    """The reference path as a backend: runs anywhere that has the memory."""

    name = "xla"
    title = "the reference path"
    differentiable = True
    operand_gradients = True
    # As XLA's ops repeat (on a GPU, scatters with --xla_gpu_deterministic_ops=true).
    repeatable_backward = True
    traced_scale = True
    materializes_scores = True

    def why_not(self, problem, mod, automatic, options=None):
        need, have = memory_needed(problem), device.available_memory()
        if have is None or need <= have:
            return None
        smaller = max(1, int(problem.sq * (have / need) ** 0.5) // 128 * 128)
        return (f"the reference path would run out of memory: it materializes the "
                f"[batch, heads, q_len, kv_len] = "
                f"[{problem.b}, {problem.hq}, {problem.sq}, {problem.skv}] float32 scores and "
                f"their gradient, at least {_gib(need)}, more than the {_gib(have)} this device "
                "has free; use the fused path (implementation=\"cudnn\", float16 or bfloat16 "
                "inputs on an NVIDIA GPU), or a smaller shape (a smaller batch, fewer heads, or "
                f"sequences of about {smaller} or less)")

    def plan(self, problem, mod, scale, options, return_lse):
        if not isinstance(scale, jax.core.Tracer):  # a traced scale stays traced
            scale = float(scale)
        return ReferencePlan(None if mod is None else ScoreMod(mod.expr), scale, bool(return_lse))

    def forward(self, plan, q, k, v, operands):
        mod = None if plan.mod is None else ScoreMod(plan.mod.expr, tuple(operands))
        return scores_and_lse_reference(q, k, v, mod, plan.scale, plan.return_lse)

    def backward(self, plan, q, k, v, o, lse, do, operands, dlse=None, wanted=()):
        """A flash-attention backward from the forward's O and LSE, as the fused
        kernels compute it: ``P = exp(S - LSE)``, ``D = rowsum(dO * O) - dLSE``,
        ``dS = P * (dP - D)``, then dQ, dK and the wanted operands' gradients
        through the mod's derivative (JAX's). It reads O and LSE as given
        (attention sinks rescale them), so a stand-in for a kernel built on it
        behaves as one; the pipeline never calls it for this backend, whose
        forward JAX differentiates."""
        names = () if plan.mod is None else plan.mod.operand_names
        learn = [names.index(n) for n in wanted]
        f32 = jnp.float32

        def scores(q, k, *learned):
            ops = list(operands)
            for i, x in zip(learn, learned):
                ops[i] = x
            mod = None if plan.mod is None else ScoreMod(plan.mod.expr, tuple(ops))
            return modified_scores(q, k, mod, plan.scale)

        s, scores_vjp = jax.vjp(scores, q, k, *(operands[i] for i in learn))
        b, sq, hq, _ = q.shape
        _, skv, hkv, dv_ = v.shape
        g = hq // hkv
        p = jnp.where(s == -jnp.inf, 0.0, jnp.exp(s - lse.astype(f32)[..., None]))
        p = p.reshape(b, hkv, g, sq, skv)
        do32 = do.astype(f32).reshape(b, sq, hkv, g, dv_)
        dv = jnp.einsum("bhgqk,bqhgd->bkhd", p, do32, precision=_PRECISION)
        dp = jnp.einsum("bqhgd,bkhd->bhgqk", do32, v.astype(f32), precision=_PRECISION)
        d = jnp.einsum("bqhd,bqhd->bhq", do.astype(f32), o.astype(f32))
        if dlse is not None:
            d = d - dlse.astype(f32)
        ds = p * (dp - d.reshape(b, hkv, g, sq)[..., None])
        dq, dk, *grads = scores_vjp(ds.reshape(b, hq, sq, skv))
        return dq, dk, dv.astype(v.dtype), dict(zip(wanted, grads))


REFERENCE = Reference()
