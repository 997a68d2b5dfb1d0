"""``scoremod.attention``: scaled dot-product attention with a score_mod.

The call is checked, described as a :class:`~scoremod.lowering.problem.Problem`,
routed once (``scoremod.route``: the backend of the registry that runs it, its
plan and what takes over what it cannot do), and executed
(``lowering.backend.execute``). Nothing here knows a backend by name.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from scoremod import options as lowering_options
from scoremod import positions, process_caches
from scoremod.dsl import ir
from scoremod.dsl.scoremod import ScoreMod, as_score_mod
from scoremod.errors import ScoreModTypeError, ScoreModValueError
from scoremod.lowering import lowrank, registry
from scoremod.lowering import gathered, paged
from scoremod.lowering import sinks as attention_sinks
from scoremod.lowering.backend import execute
from scoremod.lowering.cudnn import verify as cudnn_verify
from scoremod.lowering.problem import Problem
from scoremod.options import LoweringOptions
from scoremod.route import Choice, refusal, route, warn  # noqa: F401 - Choice: the API's

_DTYPES = ("float16", "bfloat16", "float32")


def attention(query, key, value, score_mod=None, *, scale=None, implementation=None,
              return_lse=False, sinks=None, q_offset=None, kv_lengths=None, page_table=None,
              options: LoweringOptions | None = None):
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
      implementation: the name of a registered backend: ``"xla"`` (alias
        ``"reference"``: float32 scores and softmax, any device), ``"cudnn"``
        (one fused cuDNN kernel), ``"cudnn-varlen"`` (segment masks as
        cuDNN's variable-length attention), ``"pallas"`` (block-sparse Pallas
        kernels generated from the mod, with gradients of captured arrays;
        interpret mode off a GPU); or None: the first backend that can run
        this call (cudnn-varlen for segment masks, else cudnn, else pallas
        on a GPU, else xla), with a warning when a GPU is here but a faster
        route cannot take the call; what the chosen backend cannot do
        (gradients of captured arrays, ``jax.jvp``, a graph cuDNN turns
        down when building it) then runs on the next one that can, with a
        warning.
      return_lse: also return the log-sum-exp of the modified scores,
        float32 [batch, q_heads, q_len] (the sinks included, if any).
      sinks: attention sinks, or None: a float array of shape [q_heads] (or
        broadcastable to [batch, q_heads]), in any float dtype and
        differentiable. Row ``i`` of head ``h`` then computes
        ``softmax([scores_i..., sinks[h]])`` and drops the sink's column
        before multiplying by V: one more key with no value, so that a row
        can put weight on nothing (gpt-oss). A fully masked row yields zeros
        and an LSE of ``sinks[h]``. Works on every backend and with every mod;
        ``jax.grad`` reaches the sinks.
      q_offset: int32 [batch] (or a scalar), or None: the position of each
        row's first query, so that the mod's ``q_idx`` is ``q_offset[b] + i``
        (a chunk of a longer sequence, a decode step). May be traced: a new
        offset never recompiles.
      kv_lengths: int32 [batch] (or a scalar), or None: the keys at or past
        ``kv_lengths[b]`` are masked (a padded batch, the unused tail of a
        KV cache). May be traced. Their values must still be finite unless
        ``LoweringOptions(check_values=True)``, as any masked key's.
      page_table: int32 [batch, pages_per_row], or None: ``key`` and
        ``value`` are then a paged cache [num_pages, page_size, kv_heads,
        head_dim], and row ``b``'s key at logical position ``j`` (the mod's
        ``kv_idx``) is ``key[page_table[b, j // page_size], j % page_size]``.
        Page numbers past the cache clip to its last page.
      options: a :class:`~scoremod.LoweringOptions` (native masks, query-block
        split, scale folding); default: the innermost
        ``scoremod.lowering_options`` block's, else the environment's.

    A query row whose scores are all ``-inf`` (fully masked) yields an output
    of zeros, an LSE of ``-inf`` and zero gradients. So does every row of a
    call without keys (kv_len 0); a call without query rows (batch, q_len
    or q_heads 0) gives empty results. Either runs no kernel, whatever the
    ``implementation`` (one asked for by name still refuses what it refuses).

    Under ``jax.jit`` with sharded inputs, a fused call runs per device on its
    batch and head shards (queries sharded along the sequence attend to the
    gathered keys), and the mod sees global indices; ``jax.vmap`` folds mapped
    axes into the batch (see ``lowering/sharding.py``). Forward-mode and
    second-order derivatives of a fused call (``jax.jvp``, ``jax.linearize``,
    ``jax.jacfwd``, ``jax.hessian``) come from the reference path when
    ``implementation=None``, with a warning (see ``lowering/backend.py``).

        >>> import jax, jax.numpy as jnp, scoremod
        >>> q = k = v = jnp.ones((1, 8, 2, 16), jnp.bfloat16)
        >>> causal = lambda s, b, h, qi, ki: jnp.where(qi >= ki, s, -jnp.inf)
        >>> scoremod.attention(q, k, v, causal, implementation="xla").shape
        (1, 8, 2, 16)
    """
    asked = None if implementation is None else registry.get(implementation)
    options = _options(options)
    query, key, value, table, problem, mod, scale, sinks, sink_layout = _call(
        query, key, value, score_mod, scale, sinks, q_offset, kv_lengths, page_table, runs=True)
    traced_scale = isinstance(scale, jax.core.Tracer)
    if nothing_to_compute(problem):
        return _empty_call(asked, problem, mod, traced_scale, options, return_lse, sinks)
    chosen = route(problem, mod, scale, options, implementation, return_lse, sink_layout)
    warn(chosen)
    operands = () if chosen.mod is None else tuple(jnp.asarray(x) for x in chosen.mod.operands)
    if table is not None and not paged.fetched(chosen, key.shape[1],
                                               (query, key, value, operands, sinks)):
        key, value = positions.gather_pages(key, value, table)  # the pages into rows
        table = None
    if chosen.low_rank is not None:
        values = dict(zip(mod.operand_names, (jnp.asarray(x) for x in mod.operands)))
        query, key = lowrank.augment(chosen.low_rank, query, key, values, scale)
    # With SCOREMOD_JAX_CACHE=1, JAX's compilation cache from the first call on any
    # backend: it keeps the Pallas kernels' compiled code (their first call is mostly that).
    process_caches.setup()
    if table is not None:  # the kernel reads the pages through the table
        o, lse = paged.execute(chosen.call, query, key, value, table, operands, sinks)
    else:
        o, lse = execute(chosen.call, query, key, value, operands, sinks)
    return (o, lse) if return_lse else o


# The cuDNN version check runs its conformance check through this function.
cudnn_verify.use_attention(attention)


def nothing_to_compute(problem: Problem) -> bool:
    """No score to compute: no query row (batch, query heads or queries 0),
    or no key, so that every row is fully masked."""
    return problem.b * problem.hq * problem.sq == 0 or problem.skv == 0


def _empty_call(asked, problem, mod, traced_scale, options, return_lse, sinks=None):
    """The result of a call with nothing to compute, the same for every backend
    (whose kernels need at least one tile): O of zeros, LSE of -inf (the sinks,
    with them), as a fully masked row gives, and so zero gradients (but the
    sinks' through the LSE). A backend asked for by name still refuses what it
    refuses on a call of these shapes with rows."""
    if asked is not None:
        reason = refusal(asked, problem, mod, traced_scale, False, options)
        if reason is not None:
            raise asked.refused(reason)
    p = problem
    o = jnp.zeros((p.b, p.sq, p.hq, p.dv), p.dtype)
    lse = jnp.full((p.b, p.hq, p.sq), -jnp.inf, jnp.float32)
    if sinks is not None:
        o, lse = attention_sinks.combine(o, lse, sinks)
    return (o, lse) if return_lse else o


def which_implementation(query, key, value, score_mod=None, *, scale=None, implementation=None,
                         return_lse=False, sinks=None, q_offset=None, kv_lengths=None,
                         page_table=None, options: LoweringOptions | None = None) -> Choice:
    """``(implementation, reason)``: the backend ``attention`` called with the same
    arguments runs, and why (the same decision: ``scoremod.route``).

        >>> import jax.numpy as jnp, scoremod
        >>> q = jnp.ones((1, 8, 2, 64), jnp.float32)
        >>> choice = scoremod.which_implementation(q, q, q)
        >>> choice[0], list(choice.verdicts)
        ('xla', ['cudnn-varlen', 'cudnn', 'pallas', 'xla'])

    ``reason`` starts with the chosen backend's name and says why it runs the
    call: the first backend in order that takes it; a later one that claims it (the Pallas kernels for relative-position
    tables, cuDNN's variable-length attention for segment masks), and why; or,
    where a faster general backend present on this machine refuses the call,
    that refusal (the case ``attention`` warns about); off a GPU, the fused
    backends' first refusal. ``verdicts`` maps every registered backend to its
    reason for refusing this call, or None when it could run it;
    ``low_rank_bias`` says whether a low-rank additive bias of the mod runs
    inside QK^T (head dim and remaining mod), or why it stays in the mod (None:
    the mod has none); ``variant`` says which of the chosen backend's ways runs
    it and why, where it has several (the Pallas kernels' engine,
    ``LoweringOptions.pallas_engine``), else None; ``sinks`` says how the
    attention sinks join the call (None without them); ``pages`` how a paged
    cache is read (None without a ``page_table``). Only the IR and the shapes are
    looked at; nothing is compiled or run.
    """
    options = _options(options)
    query, key, value, table, problem, mod, scale, sinks, sink_layout = _call(
        query, key, value, score_mod, scale, sinks, q_offset, kv_lengths, page_table, runs=False)
    chosen = route(problem, mod, scale, options, implementation, return_lse, sink_layout)
    choice = chosen.describe()
    if table is not None:
        choice.pages = paged.note(chosen, key.shape[1], (query, key, value, sinks))
    return choice


def _call(query, key, value, score_mod, scale, sinks, q_offset, kv_lengths, page_table, runs):
    """``(query, key, value, page table, problem, mod, scale, sinks, sink layout)`` of
    a call, checked: the problem of the pages gathered into rows (K and V stay
    paged, with the table as int32, else None), the positions and lengths in the mod, the
    default scale, the sinks as float32 [batch, q_heads] and their ``sinks.layout``
    (None without sinks). ``runs``: the call is run, so
    the mod's operands must be bound and cover their index ranges."""
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    sinks_given = sinks
    table = None
    rows = key, value
    if page_table is not None:
        table = positions.check_pages(key, value, page_table)
        rows = positions.paged_rows(key, table), positions.paged_rows(value, table)
    # The inputs first: float64 ones (with x64 on) are refused for what they
    # are, before tracing the mod meets the same x64 in its literals.
    problem = check_inputs(query, *rows)
    mod = as_score_mod(score_mod)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    check_scale(scale)
    if runs and mod is not None:
        mod.require_bound()
    mod = positions.apply_positions(mod, problem.b, q_offset, kv_lengths)
    if runs and mod is not None:
        check_operand_ranges(mod, problem)
    # A table read through an int array (T5's buckets) as one read of the gathered
    # table: the kernels learn it per block diagonal (lowering/gathered.py).
    mod = gathered.fold(mod)
    sink_layout = None
    if sinks is not None:
        sinks = attention_sinks.check(sinks, problem)  # a shape error first
        sink_layout = attention_sinks.layout(sinks_given)
    return query, key, value, table, problem, mod, scale, sinks, sink_layout


def _options(options):
    if options is None:
        return lowering_options.current()
    if not isinstance(options, LoweringOptions):
        raise ScoreModTypeError(f"options must be a scoremod.LoweringOptions, got {options!r}")
    return options


def check_implementation(implementation) -> None:
    """Raises a ScoreModError (also a ValueError) unless ``implementation`` is
    None or the name of a registered backend."""
    if implementation is not None:
        registry.get(implementation)


def check_inputs(query, key, value) -> Problem:
    """Validate shapes and dtypes; returns the call's :class:`Problem`."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.ndim != 4:
            raise ScoreModTypeError(
                f"{name} must be [batch, seq, heads, head_dim], got shape {x.shape}; "
                "add a batch axis with x[None] for a single sequence"
            )
        if np.dtype(x.dtype).name not in _DTYPES:
            raise ScoreModTypeError(
                f"{name} has dtype {x.dtype}; use one of {', '.join(_DTYPES)}"
                + (f" ({name}.astype(jnp.float32))" if x.dtype == np.float64 else "")
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
    # An empty batch, no queries or no keys is a call with nothing to compute
    # (see nothing_to_compute); no kv head or an empty head_dim has no meaning.
    for name, n in (("key/value heads", hkv), ("head_dim", d)):
        if n == 0:
            raise ScoreModValueError(
                f"{name} is 0 (query {tuple(query.shape)}, key {tuple(key.shape)}, value "
                f"{tuple(value.shape)}): attention needs at least one key/value head and "
                "head_dim >= 1"
            )
    if hq % hkv:
        raise ScoreModTypeError(
            f"query heads ({hq}) must be a multiple of key/value heads ({hkv}) "
            "for grouped-query attention"
        )
    return Problem.of(query, key, value)


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


def check_operand_ranges(mod: ScoreMod, problem: Problem):
    """An array indexed directly by an index must cover its range (or be size 1).

    Indices clamp, so ``slopes[h]`` with too few slopes would silently reuse the
    last one; this turns that into an error.
    """
    for node in ir.toposort(mod.expr):
        if node.op != ir.LOAD:
            continue
        name, shape, _ = node.args[0].attr
        for axis, (idx, n) in enumerate(zip(node.args[1:], shape)):
            if idx.op == ir.VAR and n != 1 and n < problem.extent(idx.attr):
                size = problem.extent(idx.attr)
                raise ScoreModTypeError(
                    f"operand {name} has {n} entries along axis {axis}, indexed by "
                    f"{idx.attr}, which runs to {size - 1} in this call; give it "
                    f"at least {size} entries (or 1 to broadcast)"
                    + _layout_hint(idx.attr, n, problem)
                )


# Where each index of the mod runs, in the inputs' [batch, seq, heads, head_dim]
# layout; the extent the index would have with seq and heads swapped.
_RUNS_OVER = {"b": ("axis 0 (batch) of query, key and value", None),
              "h": ("axis 2 (heads) of query", "sq"),
              "q_idx": ("axis 1 (seq) of query", "hq"),
              "kv_idx": ("axis 1 (seq) of key and value", "hkv")}


def _layout_hint(index, n, problem) -> str:
    """The layout the call's sizes come from, and the transpose that makes
    ``n`` entries enough, where inputs given as [batch, heads, seq, head_dim]
    explain the disagreement."""
    p = problem
    where, swapped = _RUNS_OVER[index]
    hint = (f". {index} runs over {where}: the inputs are [batch, seq, heads, head_dim], "
            f"here query {(p.b, p.sq, p.hq, p.d)} and key {(p.b, p.skv, p.hkv, p.d)}")
    if swapped is not None and n >= getattr(p, swapped):
        hint += (" (if yours are [batch, heads, seq, head_dim], swap axes 1 and 2 of "
                 "query, key and value: jnp.swapaxes(x, 1, 2))")
    return hint
