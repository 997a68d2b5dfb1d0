"""``scoremod.attention``: scaled dot-product attention with a score_mod."""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from scoremod.dsl import ir
from scoremod.dsl.scoremod import ScoreMod, as_score_mod
from scoremod.errors import ScoreModTypeError, ScoreModValueError
from scoremod.lowering.reference import scores_and_lse_reference

IMPLEMENTATIONS = (None, "xla", "cudnn")
_DTYPES = ("float16", "bfloat16", "float32")


def attention(query, key, value, score_mod=None, *, scale=None, implementation=None,
              return_lse=False):
    """Attention whose scaled scores pass through ``score_mod`` before the softmax.

    Layout as ``jax.nn.dot_product_attention``: ``query`` is
    [batch, q_len, q_heads, head_dim], ``key`` and ``value`` are
    [batch, kv_len, kv_heads, head_dim]. When q_heads is a multiple of kv_heads
    this is grouped-query attention: query head ``i`` reads kv head
    ``i // (q_heads // kv_heads)``, and the mod's ``h`` is the query head.

    Args:
      score_mod: a :class:`ScoreMod`, a function ``(score, b, h, q_idx, kv_idx)``
        written in jax.numpy (traced here), a text form, or None.
      scale: multiplies ``q . k`` before the mod; default ``1/sqrt(head_dim)``.
      implementation: ``"xla"`` (reference: float32 scores and softmax, any
        device), ``"cudnn"`` (one fused cuDNN kernel), or None (cudnn when it
        can run this call, else xla).
      return_lse: also return the log-sum-exp of the modified scores,
        float32 [batch, q_heads, q_len].

    A query row whose scores are all ``-inf`` (fully masked) yields an output
    of zeros, an LSE of ``-inf`` and zero gradients.

        >>> import jax, jax.numpy as jnp, scoremod
        >>> q = k = v = jnp.ones((1, 8, 2, 16), jnp.bfloat16)
        >>> causal = lambda s, b, h, qi, ki: jnp.where(qi >= ki, s, -jnp.inf)
        >>> scoremod.attention(q, k, v, causal, implementation="xla").shape
        (1, 8, 2, 16)
    """
    mod = as_score_mod(score_mod)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}"
        )
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    shapes = check_inputs(query, key, value)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    check_scale(scale)
    if mod is not None:
        mod.require_bound()
        check_operand_ranges(mod, shapes)
    if implementation == "cudnn":
        from scoremod.lowering import cudnn_path

        return cudnn_path.attention(query, key, value, mod, scale, return_lse)
    if implementation is None:
        from scoremod.lowering import cudnn_path

        if cudnn_path.usable(query, key, value, mod):
            return cudnn_path.attention(query, key, value, mod, scale, return_lse, explicit=False)
        if cudnn_path._gpu_family() is not None:  # a GPU is here, but not for this call
            _warn_once(cudnn_path.why_not(query, key, value, mod)
                       or "the fused path is not validated on this GPU family")
    out, lse = scores_and_lse_reference(query, key, value, mod, scale, return_lse)
    return (out, lse) if return_lse else out


_WARNED: set = set()


def _warn_once(reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"scoremod: implementation=None uses the reference path here: {reason}",
                      stacklevel=3)


def which_implementation(query, key, value, score_mod=None) -> tuple:
    """``(implementation, reason)`` that ``implementation=None`` would pick.

        >>> import jax.numpy as jnp, scoremod
        >>> q = jnp.ones((1, 8, 2, 64), jnp.float32)
        >>> scoremod.which_implementation(q, q, q)[0]
        'xla'

    ``reason`` says why the fused path is not taken (None when it is). Only
    the IR and the shapes are looked at; nothing is compiled or run.
    """
    from scoremod.lowering import cudnn_path

    mod = as_score_mod(score_mod)
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    check_inputs(query, key, value)
    if cudnn_path.usable(query, key, value, mod):
        return "cudnn", None
    reason = cudnn_path.why_not(query, key, value, mod)
    if reason is None:
        reason = "the fused path is not validated on this GPU family; ask for it by name"
    return "xla", reason


def check_inputs(query, key, value) -> dict:
    """Validate shapes and dtypes; returns the sizes the mod's indices range over."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim != 4:
            raise ScoreModTypeError(
                f"{name} must be [batch, seq, heads, head_dim], got shape {x.shape}; "
                "add a batch axis with x[None] for a single sequence"
            )
        if np.dtype(x.dtype).name not in _DTYPES:
            raise ScoreModTypeError(
                f"{name} has dtype {x.dtype}; use one of {', '.join(_DTYPES)}"
            )
    if not (query.dtype == key.dtype == value.dtype):
        raise ScoreModTypeError(
            f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, "
            f"{value.dtype}"
        )
    b, sq, hq, d = query.shape
    bk, skv, hkv, dk = key.shape
    if value.shape[:3] != key.shape[:3]:
        raise ScoreModTypeError(
            f"key {key.shape} and value {value.shape} must agree on batch, seq and heads"
        )
    if bk != b:
        raise ScoreModTypeError(f"query batch {b} != key batch {bk}")
    if dk != d:
        raise ScoreModTypeError(f"query head_dim {d} != key head_dim {dk}")
    for name, n in (("query sequence length", sq), ("key/value sequence length", skv),
                    ("key/value heads", hkv), ("head_dim", d)):
        if n == 0:
            raise ScoreModValueError(
                f"{name} is 0 (query {tuple(query.shape)}, key {tuple(key.shape)}, value "
                f"{tuple(value.shape)}): attention needs at least one query, one key, one "
                "key/value head and head_dim >= 1; skip the call for empty inputs"
            )
    if hq % hkv:
        raise ScoreModTypeError(
            f"query heads ({hq}) must be a multiple of key/value heads ({hkv}) "
            "for grouped-query attention"
        )
    return {"b": b, "h": hq, "q_idx": sq, "kv_idx": skv}


def check_scale(scale):
    """``scale`` must be one real, finite number (a traced scalar is checked for shape only)."""
    if isinstance(scale, (bool, np.bool_)) or not (
            isinstance(scale, (int, float, np.integer, np.floating))
            or (hasattr(scale, "shape") and hasattr(scale, "dtype"))):
        raise ScoreModTypeError(f"scale must be a number, got {type(scale).__name__}")
    if np.shape(scale) != ():
        raise ScoreModTypeError(
            f"scale must be a scalar, got shape {tuple(np.shape(scale))}; one scale multiplies "
            "every score (fold per-head factors into the score_mod instead)"
        )
    dtype = np.dtype(getattr(scale, "dtype", type(scale)))
    if not (np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.integer)):
        raise ScoreModTypeError(f"scale must be a real number, got dtype {dtype}")
    if isinstance(scale, jax.core.Tracer):
        return  # its value is unknown until the traced function runs
    if not np.isfinite(float(np.asarray(scale, np.float64))):
        raise ScoreModValueError(f"scale must be finite, got {float(np.asarray(scale))}")


def check_operand_ranges(mod: ScoreMod, sizes: dict):
    """An array indexed directly by an index must cover its range (or be size 1).

    Indices clamp, so ``slopes[h]`` with too few slopes would silently reuse the
    last one; this turns that into an error.
    """
    for node in ir.toposort(mod.expr):
        if node.op != "load":
            continue
        name, shape, _ = node.args[0].attr
        for axis, (idx, n) in enumerate(zip(node.args[1:], shape)):
            if idx.op == "var" and n != 1 and n < sizes[idx.attr]:
                raise ScoreModTypeError(
                    f"operand {name} has {n} entries along axis {axis}, indexed by "
                    f"{idx.attr}, which runs to {sizes[idx.attr] - 1} in this call; give it "
                    f"at least {sizes[idx.attr]} entries (or 1 to broadcast)"
                )
