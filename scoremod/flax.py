"""Flax drop-in: scoremod attention as the ``attention_fn`` of Flax's attention layers.

:func:`attention_fn` returns a function with the signature Flax calls for the
``attention_fn`` of ``flax.linen.MultiHeadDotProductAttention`` and of
``flax.nnx.MultiHeadAttention`` (the signature of Flax's own
``dot_product_attention``)::

    import flax.linen as nn
    import jax.numpy as jnp
    import scoremod.flax

    softcap = lambda score, b, h, q_idx, kv_idx: 30.0 * jnp.tanh(score / 30.0)
    layer = nn.MultiHeadDotProductAttention(
        num_heads=8, attention_fn=scoremod.flax.attention_fn(softcap))
    # Flax's mask (True = attend) and a bias, if one is given, still apply:
    # scores = where(mask, softcap(q . k / sqrt(d)) + bias, -inf)

This module does not import Flax (the function only has to be called the way
Flax calls it), and ``import scoremod`` never imports it: use
``import scoremod.flax``. Install Flax with ``pip install "scoremod[flax]"``.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from scoremod.attention import check_implementation
from scoremod.attention import attention as _attention
from scoremod.dsl import ir
from scoremod.dsl.ir import F32, const
from scoremod.dsl.ops import apply
from scoremod.dsl.scoremod import ScoreMod, as_score_mod, fresh_operand_name
from scoremod.errors import ScoreModError, ScoreModTypeError

__all__ = ["attention_fn", "combine", "FlaxAttentionError"]

# The axes of Flax's mask and bias, [batch, heads, q_len, kv_len], as mod indices.
_AXES = ("b", "h", "q_idx", "kv_idx")


class FlaxAttentionError(ScoreModError, NotImplementedError):
    """Flax asked for something the scoremod ``attention_fn`` does not do.

    Attention dropout (``dropout_rate > 0`` with ``deterministic=False``),
    sowing the attention weights (``sow_weights=True``), and custom einsums
    (``qk_attn_weights_einsum_cls`` and the like).

        >>> import jax, jax.numpy as jnp, scoremod.flax
        >>> fn = scoremod.flax.attention_fn(implementation="xla")
        >>> x = jnp.ones((1, 4, 2, 8))
        >>> try:
        ...     fn(x, x, x, dropout_rate=0.1, dropout_rng=jax.random.key(0))
        ... except scoremod.flax.FlaxAttentionError as e:
        ...     print(type(e).__name__)
        FlaxAttentionError
    """


def attention_fn(score_mod=None, *, implementation=None):
    """An ``attention_fn`` for Flax's attention layers that applies ``score_mod``.

    Args:
      score_mod: what :func:`scoremod.attention` accepts: a ``ScoreMod``, a
        function ``(score, b, h, q_idx, kv_idx) -> score`` written in
        jax.numpy (traced once, here), a text form, or None.
      implementation: passed to :func:`scoremod.attention`: ``"xla"`` (the
        reference path, any device), ``"cudnn"`` (the fused kernel) or None
        (fused when it can run the call, else the reference path).

    Returns:
      ``fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
      dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
      precision=None, module=None, ...)``, with the keyword arguments of
      Flax's ``dot_product_attention`` (linen and nnx), each by name.
      Pass it as ``attention_fn=`` to ``flax.linen.MultiHeadDotProductAttention``
      or ``flax.nnx.MultiHeadAttention``.

    What each score becomes, with ``s = (q . k) / sqrt(head_dim)``::

        where(mask[b, h, q_idx, kv_idx] and (q_idx >= kv_idx if is_causal),
              score_mod(s, b, h, q_idx, kv_idx) + bias[b, h, q_idx, kv_idx],
              -inf)

    The mod sees the scaled score first (as with :func:`scoremod.attention`);
    Flax's additive ``bias`` is added to the mod's result, and Flax's ``mask``
    (broadcastable to ``[batch, heads, q_len, kv_len]``, nonzero / True =
    attend) masks last. Mask and bias become operands of one combined
    ``ScoreMod`` (size-1 dimensions broadcast), so they run on the fused path
    too. See :func:`combine`.

    Differences from Flax's ``dot_product_attention``:

    - A query row whose keys are all masked gives an output of **zeros**
      (scoremod's rule), where Flax's softmax over ``finfo.min`` gives the
      mean of the values.
    - Exactly one batch dimension: query, key and value must have rank 4,
      ``[batch, length, heads, head_dim]``.
    - No attention dropout: ``dropout_rate > 0`` with ``deterministic=False``
      raises :class:`FlaxAttentionError` (with ``deterministic=True``, or a
      rate of 0, dropout is off and the call runs).
    - ``dtype`` casts query, key and value as Flax does (to ``dtype``, or to
      their common float type) and is the output dtype; the scores and the
      softmax are float32 on both paths, so ``force_fp32_for_softmax`` is
      always in effect.
    - ``q_idx`` and ``kv_idx`` are positions within the call: with Flax's
      ``decode=True`` (one query against the cache) ``q_idx`` is 0, so leave
      causality to the mask Flax adds there.
    - ``precision`` is ignored: the reference path computes its matmuls at
      ``HIGHEST`` precision in float32, the fused kernel at its own.
    - ``module`` (set by Flax only for ``sow_weights=True``) and custom einsums
      raise :class:`FlaxAttentionError`: the attention weights are never
      materialized on the fused path, so they cannot be sown.

    Example (nnx; linen is the same with ``nn.MultiHeadDotProductAttention``)::

        import jax, jax.numpy as jnp
        from flax import nnx
        import scoremod.flax

        fn = scoremod.flax.attention_fn(
            lambda score, b, h, q_idx, kv_idx: 30.0 * jnp.tanh(score / 30.0))
        layer = nnx.MultiHeadAttention(num_heads=4, in_features=64, decode=False,
                                       attention_fn=fn, rngs=nnx.Rngs(0))
        x = jnp.ones((2, 16, 64))
        y = layer(x, mask=nnx.make_causal_mask(x[..., 0]))     # [2, 16, 64]

    A bias Flax's layers do not pass themselves (a learned relative-position
    bias, say) can be bound with ``functools.partial(fn, bias=...)``. So can
    attention sinks (``sinks=``, one learned logit per head: see
    :func:`scoremod.attention`), as a parameter of the module that builds the
    layer::

        class SinkAttention(nn.Module):
            num_heads: int

            @nn.compact
            def __call__(self, x, mask=None):
                sinks = self.param("sinks", nn.initializers.zeros, (self.num_heads,))
                fn = functools.partial(scoremod.flax.attention_fn(softcap), sinks=sinks)
                return nn.MultiHeadDotProductAttention(
                    num_heads=self.num_heads, attention_fn=fn)(x, mask=mask)
    """
    mod = as_score_mod(score_mod)
    if mod is not None:
        mod.require_bound()
    check_implementation(implementation)
    return _FlaxAttention(mod, implementation)


class _FlaxAttention:
    """The callable :func:`attention_fn` returns; ``score_mod`` and ``implementation``
    are readable attributes."""

    def __init__(self, score_mod: ScoreMod | None, implementation):
        self.score_mod = score_mod
        self.implementation = implementation

    def __repr__(self):
        mod = "None" if self.score_mod is None else repr(self.score_mod)
        return f"scoremod.flax.attention_fn({mod}, implementation={self.implementation!r})"

    # Flax linen keeps only the keyword arguments named in this signature
    # (inspect.signature), so every one it may pass is spelled out.
    def __call__(
        self,
        query,
        key,
        value,
        bias=None,
        mask=None,
        broadcast_dropout=True,
        dropout_rng=None,
        dropout_rate=0.0,
        deterministic=False,
        dtype=None,
        precision=None,
        module=None,
        force_fp32_for_softmax=False,
        einsum_dot_general=None,
        qk_attn_weights_einsum=None,
        attn_weights_value_einsum=None,
        promote_dtype=None,
        is_causal=False,
        sinks=None,
    ):
        del broadcast_dropout, dropout_rng  # dropout is refused below when it would apply
        del precision  # see the docstring of attention_fn
        del force_fp32_for_softmax  # scores and softmax are always float32
        if dropout_rate > 0.0 and not deterministic:
            raise FlaxAttentionError(
                f"scoremod.flax.attention_fn has no attention dropout (dropout_rate="
                f"{dropout_rate}, deterministic=False); use dropout_rate=0 on the attention "
                "layer, or call it with deterministic=True"
            )
        if module is not None:
            raise FlaxAttentionError(
                "scoremod.flax.attention_fn cannot sow attention weights (sow_weights=True): "
                "the fused path never materializes them"
            )
        if any(f is not None for f in (einsum_dot_general, qk_attn_weights_einsum,
                                       attn_weights_value_einsum)):
            raise FlaxAttentionError(
                "scoremod.flax.attention_fn does not take custom einsums "
                "(qk_attn_weights_einsum_cls, attn_weights_value_einsum_cls, einsum_dot_general)"
            )
        query, key, value = _promote(query, key, value, dtype, promote_dtype)
        for name, x in (("query", query), ("key", key), ("value", value)):
            if x.ndim != 4:
                raise ScoreModTypeError(
                    f"scoremod.flax.attention_fn takes exactly one batch dimension: {name} must "
                    f"be [batch, length, num_heads, head_dim] (rank 4), got shape {x.shape}; "
                    "reshape the batch dimensions into one"
                )
        b, sq, hq, _ = query.shape
        skv = key.shape[1]
        mod = combine(self.score_mod, mask=mask, bias=bias, is_causal=is_causal,
                      shape=(b, hq, sq, skv))
        return _attention(query, key, value, mod, implementation=self.implementation,
                          sinks=sinks)


def _promote(query, key, value, dtype, promote_dtype):
    """Cast as Flax's dot_product_attention does: to ``dtype``, else to the common type."""
    if promote_dtype is not None:  # nnx's dot_product_attention takes one
        return tuple(jnp.asarray(x) for x in promote_dtype((query, key, value), dtype=dtype))
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    if dtype is None:
        dtype = jnp.result_type(query, key, value)
        if not jnp.issubdtype(dtype, jnp.inexact):
            dtype = jnp.promote_types(dtype, jnp.float32)
    return tuple(x.astype(dtype) for x in (query, key, value))


def combine(score_mod=None, *, mask=None, bias=None, is_causal=False, shape) -> ScoreMod | None:
    """One ScoreMod: ``where(mask & causal, score_mod(score, ...) + bias, -inf)``.

    ``mask`` and ``bias`` are arrays broadcastable (NumPy rules) to ``shape``,
    ``(batch, heads, q_len, kv_len)``; they become operands of the result,
    named ``mask`` and ``bias`` (with a suffix if ``score_mod`` already has
    operands of those names), each with its size-1 dimensions dropped and
    read at the indices of its other dimensions. A nonzero mask entry attends.
    Returns ``score_mod`` itself (maybe None) when there is nothing to add.

        >>> import jax.numpy as jnp, scoremod, scoremod.flax
        >>> causal = jnp.tril(jnp.ones((1, 1, 8, 8), bool))
        >>> mod = scoremod.flax.combine("30.0 * tanh(score / 30.0)", mask=causal,
        ...                             bias=jnp.zeros((4, 8, 8)), shape=(2, 4, 8, 8))
        >>> print(mod)
        mask: bool[8, 8]; bias: float32[4, 8, 8]; where(mask[q_idx, kv_idx], tanh(score / 30.0) * 30.0 + bias[h, q_idx, kv_idx], -inf)
    """
    mod = as_score_mod(score_mod)
    if mask is None and bias is None and not is_causal:
        return mod
    shape = tuple(int(n) for n in shape)
    expr = ir.var(ir.SCORE) if mod is None else mod.expr
    values = {} if mod is None else dict(zip(mod.operand_names, mod.operands))
    if bias is not None:
        bias = jnp.asarray(bias)
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            raise ScoreModTypeError(f"bias must be a float array, got dtype {bias.dtype}")
        if np.dtype(bias.dtype).name not in ("float32", "float16", "bfloat16"):
            bias = bias.astype(jnp.float32)
        read, bias = _read(fresh_operand_name("bias", values), bias, shape, "bias")
        values[read.args[0].attr[0]] = bias
        expr = apply("add", expr, read)
    cond = None
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_:
            mask = mask != 0
        cond, mask = _read(fresh_operand_name("mask", values), mask, shape, "mask")
        values[cond.args[0].attr[0]] = mask
    if is_causal:
        causal = apply("ge", ir.var("q_idx"), ir.var("kv_idx"))
        cond = causal if cond is None else apply("and", cond, causal)
    if cond is not None:
        expr = apply("where", cond, expr, const(-math.inf, F32))
    if expr.dtype != F32:  # pragma: no cover - add and where keep float32
        raise AssertionError(expr)
    return ScoreMod(expr, tuple(values[n.attr[0]] for n in ir.operands_of(expr)))


def _read(name, array, shape, what):
    """A load of ``array`` at the mod's indices, its size-1 dims dropped; and the array."""
    if array.ndim > 4:
        raise ScoreModTypeError(
            f"{what} has shape {array.shape}; it must broadcast to [batch, heads, q_len, "
            f"kv_len] = {list(shape)} (rank 4 at most)"
        )
    full = (1,) * (4 - array.ndim) + tuple(array.shape)
    for n, want in zip(full, shape):
        if n not in (1, want):
            raise ScoreModTypeError(
                f"{what} of shape {array.shape} does not broadcast to [batch, heads, q_len, "
                f"kv_len] = {list(shape)}"
            )
    kept = [axis for axis, n in enumerate(full) if n != 1]
    array = array.reshape(tuple(full[a] for a in kept))
    node = ir.operand(name, array.shape, np.dtype(array.dtype))
    return apply(ir.LOAD, node, *(ir.var(_AXES[a]) for a in kept)), array
