"""Attention sinks: one logit per (batch and) query head that joins each row's
softmax as one more key with no value.

Row ``i`` of head ``h`` computes ``softmax([s_i0, ..., s_in, sink[b, h]])`` and
drops the sink's column before multiplying by V. Every backend computes it the
same way, around its own kernels, unchanged:

- **forward**: from the kernel's O' and LSE' (without the sink),
  ``LSE = logaddexp(LSE', sink)`` and ``O = O' * exp(LSE' - LSE)``.
- **backward**: the kernel's own backward, given the final O and LSE. The
  sink's column has no value, so its dP is 0, ``P = exp(S - LSE)`` are the
  real keys' probabilities, and ``D = rowsum(dO * O)`` is still the softmax's
  correction term: dQ, dK, dV and the mod's operand gradients come out right
  with nothing changed inside.
- **the sink's gradient**, closed-form: ``d sink = sum_i P_sink,i * (dLSE_i - D_i)``
  with ``P_sink,i = exp(sink - LSE_i)``.

A fully masked row gives O = 0 and LSE = sink; a sink of ``-inf`` is no sink.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from scoremod.errors import ScoreModTypeError

_F32 = jnp.float32


def check(sinks, problem):
    """``sinks`` as float32 [batch, q_heads] (broadcast; gradients flow back to
    the user's array), or a ScoreModTypeError saying what shape it needs."""
    x = jnp.asarray(sinks)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ScoreModTypeError(
            f"sinks must be a float array (one logit per query head), got dtype {x.dtype}")
    want = (problem.b, problem.hq)
    try:
        fits = x.ndim <= 2 and np.broadcast_shapes(x.shape, want) == want
    except ValueError:
        fits = False
    if not fits:
        hint = ""
        if x.ndim >= 1 and x.shape[-1] == problem.hkv != problem.hq:
            hint = (f"; it has one entry per key/value head ({problem.hkv}), but a sink joins "
                    f"the softmax of each query head ({problem.hq})")
        raise ScoreModTypeError(
            f"sinks must have shape [q_heads] = [{problem.hq}] or broadcast to [batch, q_heads] "
            f"= {list(want)}, got shape {tuple(x.shape)}{hint}")
    return jnp.broadcast_to(x.astype(_F32), want)


def layout(sinks) -> str:
    """"head" for sinks with one logit per query head ([q_heads], or [1, q_heads]),
    the same in every batch row; "batch" for sinks that may differ per batch row.
    A backend may join per-head sinks inside its own softmax (cuDNN's forward)."""
    shape = np.shape(sinks)
    return "head" if len(shape) < 2 or shape[0] == 1 else "batch"


def _row(sinks):
    return sinks.astype(_F32)[:, :, None]  # [b, hq] -> [b, hq, 1], against LSE [b, hq, sq]


def combine(o, lse, sinks):
    """``(O, LSE)`` with the sink in each row's softmax, from the kernel's O'
    [b, sq, hq, dv] and LSE' [b, hq, sq] without it."""
    s = _row(sinks)
    lse = lse.astype(_F32)
    # logaddexp, with a zero gradient (not NaN) where both are -inf.
    none = (lse == -jnp.inf) & (s == -jnp.inf)
    total = jnp.where(none, -jnp.inf,
                      jnp.logaddexp(jnp.where(none, 0.0, lse), jnp.where(none, 0.0, s)))
    # exp(LSE' - LSE) as sigmoid(LSE' - sink): 0 for a fully masked row (LSE' = -inf),
    # 1 for a sink of -inf; a row with neither (both -inf) keeps its O' (zeros).
    x = lse - s
    x = jnp.where(jnp.isnan(x), jnp.inf, x)
    kept = jnp.swapaxes(jax.nn.sigmoid(x), 1, 2)[..., None]
    # A row the masked-key rule made NaN stays NaN and passes nothing back to the sink.
    nan = jnp.isnan(o)
    scaled = (jnp.where(nan, jnp.zeros((), o.dtype), o).astype(_F32) * kept).astype(o.dtype)
    return jnp.where(nan, o, scaled), total


def gradient(o, lse, do, dlse, sinks):
    """The sinks' gradient [b, hq] from the final O and LSE (:func:`combine`'s),
    the cotangents dO and dLSE (None: zero)."""
    s = _row(sinks)
    p_sink = jnp.where(s == -jnp.inf, 0.0, jnp.exp(s - lse.astype(_F32)))
    o32 = jnp.where(jnp.isnan(o), 0.0, o.astype(_F32))
    # rowsum(dO * O) as an elementwise product and a sum (one fused reduction), not a
    # dot: XLA may run a float32 dot in TF32 on the GPU
    d = jnp.swapaxes(jnp.sum(do.astype(_F32) * o32, axis=-1), 1, 2)
    if dlse is not None:
        d = d - dlse.astype(_F32)
    return jnp.sum(p_sink * -d, axis=-1)
