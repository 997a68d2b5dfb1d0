"""The masked-key rule for values that are not finite, on every fused backend.

The rule (docs/guide.md, "Fully masked rows"; ``reference.py`` implements it):
a key of weight 0 never contributes, even when its value vector holds a NaN
or an inf; a row that gives positive weight to such a key is NaN (every
column). A fused kernel multiplies the probabilities with V, so a masked
key's ``0 * inf`` or ``0 * nan`` makes its row NaN. Here, around one
kernel call of any fused backend:

- **All of V finite** (the common case): the call as it is, after one
  reduction over V, ``any(~isfinite(v))``, the ``lax.cond`` predicate, in
  the forward and again in the backward (XLA's conditional on a GPU reads
  the predicate on the host before it launches the branch).
- **Otherwise**: O from V with its non-finite entries replaced by 0, and a
  second call of the same plan on the same shapes (the same compiled
  kernel) whose V marks the keys that hold a non-finite value; the rows
  whose marked output is positive gave those keys weight, and are NaN.
  The backward runs on that sanitized V with dO (and O) zeroed on those
  rows: the reference path's gradient, where the NaN rows pass nothing
  back and a non-finite entry of V gets gradient 0.

``lowering/sharding.py`` calls these per device and on the batch folded
under ``jax.vmap``, so the predicate is each device's own (no collective)
and never batched (a batched predicate would make ``lax.cond`` run both
branches). All this runs only under ``LoweringOptions(check_values=True)``:
by default V is taken to be finite (the test costs a host read per call).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The value marking a key: large, so that the row's marked output (the
# weight it gives marked keys, times this) does not round to 0 in a float16
# output while the kernel's own probabilities are still positive; exact in
# float16 and bfloat16, and far from their overflow (the output is a
# weighted mean, at most this).
_MARK = 2.0 ** 14


def _any_not_finite(v):
    return jnp.any(~jnp.isfinite(v))


def _sanitized(v):
    return jnp.where(jnp.isfinite(v), v, jnp.zeros((), v.dtype))


def _marked(v):
    """Per key and kv head, _MARK where its value vector holds a non-finite
    entry, else 0, over every value channel (V's shape and dtype)."""
    bad = jnp.any(~jnp.isfinite(v), axis=-1, keepdims=True)
    return jnp.broadcast_to(jnp.where(bad, _MARK, 0.0).astype(v.dtype), v.shape)


def _touched(backend, plan, q, k, v, operands):
    """[b, sq, hq, 1]: whether the row gives positive weight to a key whose
    value holds a non-finite entry."""
    marked, _ = backend.forward(plan, q, k, _marked(v), operands)
    return jnp.any(marked > 0, axis=-1, keepdims=True)


def forward(backend, plan, q, k, v, operands, check=True):
    """``backend.forward`` with the masked-key rule for non-finite V; with
    ``check`` False (V known finite: LoweringOptions.check_values), the call alone."""

    def finite():
        return tuple(backend.forward(plan, q, k, v, operands))

    if not check:
        return finite()

    def not_finite():
        o, lse = backend.forward(plan, q, k, _sanitized(v), operands)
        touched = _touched(backend, plan, q, k, v, operands)
        return jnp.where(touched, jnp.nan, o).astype(o.dtype), lse

    return jax.lax.cond(_any_not_finite(v), not_finite, finite)


def backward(backend, plan, q, k, v, o, lse, do, operands, check=True, dlse=None, wanted=()):
    """``backend.backward`` (dQ, dK, dV and the ``wanted`` operands' gradients,
    by name) with the masked-key rule for non-finite V; ``o`` is
    :func:`forward`'s output (with the same ``check``)."""

    def finite():
        return tuple(backend.backward(plan, q, k, v, o, lse, do, operands, dlse, wanted))

    if not check:
        return finite()

    def not_finite():
        touched = _touched(backend, plan, q, k, v, operands)
        zero = jnp.zeros((), o.dtype)
        # The NaN rows pass nothing back through O (their O is replaced too:
        # the kernel's rowsum(dO * O) must be 0 there, not 0 * nan); their LSE
        # is finite and does not depend on V, so its cotangent stays.
        dq, dk, dv, grads = backend.backward(
            plan, q, k, _sanitized(v), jnp.where(touched, zero, o), lse,
            jnp.where(touched, jnp.zeros((), do.dtype), do), operands, dlse, wanted)
        return dq, dk, jnp.where(jnp.isfinite(v), dv, jnp.zeros((), dv.dtype)), grads

    return jax.lax.cond(_any_not_finite(v), not_finite, finite)
