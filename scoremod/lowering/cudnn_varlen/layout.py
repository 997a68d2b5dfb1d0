"""The ragged sequences of a segment mask, computed by XLA inside the program.

Each row's runs of equal ids become sequences: at most ``n`` per row (the
static bound), so a call has ``B * n`` sequence slots; unused slots have
length 0. Everything here is jax.numpy on ``[B, S]`` id arrays (no host
round trip), and ``ok`` says whether the varlen route computes the mask
exactly for these ids: every id (other than a pad id) forms one run, the
ids increase along the row, and no row has more than ``n`` runs. Where
``ok`` is False the backend asks :func:`runs_are_documents` (self-attention:
runs in any order), and takes the dense route where that says no too.

    >>> import numpy as np, jax.numpy as jnp
    >>> starts, lens, ids, count, rank = runs(jnp.array([[7, 7, 9, 9, 9, 4]]), 4)
    >>> np.asarray(starts).tolist(), np.asarray(lens).tolist(), int(count[0])
    ([[0, 2, 5, 6]], [[2, 3, 1, 0]], 3)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Layout(NamedTuple):
    """Per sequence slot ``[B, n]`` (token positions inside the row), and the checks."""

    ok: jax.Array  # bool scalar: the varlen route is exact for these ids
    q_start: jax.Array
    q_len: jax.Array  # rows that see at least one key (the rest are fully masked)
    kv_start: jax.Array
    kv_len: jax.Array
    covered_q: jax.Array | None  # [B, Sq] bool: query tokens inside a sequence (None: all)


def ids(side, operands: dict, b: int, s: int) -> jax.Array:
    """The ``[b, s]`` ids one side of the mask reads (broadcast rows included)."""
    a = operands[side.operand]
    if a.ndim == 1:
        row = a[:s]
    elif not side.batched:
        row = a[side.row, :s]
    else:
        return a[:b, :s]
    return jnp.broadcast_to(row, (b, s))


def runs(seg: jax.Array, n: int):
    """(starts, lengths, ids, count, rank) of each row's runs of equal ids.

    ``starts``, ``lengths`` and ``ids`` are ``[B, n]`` (slots past the row's
    run count start at S with length 0); ``count`` is the runs per row,
    ``rank[b, i]`` the run of token i (runs past ``n`` are dropped, which
    ``count > n`` reveals; the first ``n`` are exact).
    """
    b, s = seg.shape
    start = jnp.concatenate([jnp.ones((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    rank = jnp.cumsum(start, axis=1, dtype=jnp.int32) - 1
    count = rank[:, -1] + 1
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, s))
    slot = jnp.where(start, rank, n + 1)  # n + 1: out of range, dropped
    # One slot more than kept: the start of run n ends run n - 1.
    bounds = jnp.full((b, n + 1), s, jnp.int32).at[rows, slot].set(pos, mode="drop")
    starts = bounds[:, :n]
    lengths = bounds[:, 1:] - starts
    run_ids = jnp.take_along_axis(seg, jnp.minimum(starts, s - 1), axis=1)
    return starts, lengths, run_ids, count, rank


def increasing(seg: jax.Array, pads=()) -> jax.Array:
    """Whether, in every row, each id other than ``pads`` forms one run and the
    ids increase along the row (pad tokens may sit anywhere). A cheap, fused
    check; contiguous runs in another order take the dense route."""
    b = seg.shape[0]
    valid = jnp.ones(seg.shape, bool)
    for p in pads:
        valid &= seg != p
    lowest = np.iinfo(np.dtype(seg.dtype)).min
    seen = jax.lax.cummax(jnp.where(valid, seg, lowest), axis=1)
    before = jnp.concatenate([jnp.full((b, 1), lowest, seg.dtype), seen[:, :-1]], axis=1)
    same = jnp.concatenate([jnp.zeros((b, 1), bool), seg[:, 1:] == seg[:, :-1]], axis=1)
    return jnp.all(~valid | same | (seg > before))


def runs_are_documents(segments, operands: dict, b: int, sq: int, n: int) -> jax.Array:
    """Self-attention only: whether every non-pad id forms one run (in any order) and
    no row has more than ``n`` runs: the ragged route is exact for such ids too. A
    sort per row, so it is asked only where :func:`increasing` said no."""
    seg = ids(segments.q_array, operands, b, sq)
    valid = jnp.ones(seg.shape, bool)
    for p in (segments.pad_q, segments.pad_kv):
        if p is not None:
            valid &= seg != p
    start = jnp.concatenate([jnp.ones((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    highest = np.iinfo(np.dtype(seg.dtype)).max
    ordered = jnp.sort(jnp.where(valid, seg, highest), axis=1)  # pads last
    first = jnp.concatenate([jnp.ones((b, 1), bool), ordered[:, 1:] != ordered[:, :-1]], axis=1)
    distinct = jnp.sum(first & (jnp.arange(sq)[None, :] < jnp.sum(valid, 1, keepdims=True)), 1)
    return jnp.all(distinct == jnp.sum(start & valid, 1)) & jnp.all(jnp.sum(start, 1) <= n)


def compute(segments, operands: dict, b: int, sq: int, skv: int, n: int) -> Layout:
    """The sequences of ``segments`` (a ``lowering.segments.Segments``) for these ids."""
    pads = tuple(p for p in (segments.pad_q, segments.pad_kv) if p is not None)
    seg_q = ids(segments.q_array, operands, b, sq)
    q_start, q_len, q_id, q_count, q_rank = runs(seg_q, n)
    if segments.self_attention:
        ok = increasing(seg_q, pads) & jnp.all(q_count <= n)
        kv_start, kv_len, kv_id = q_start, q_len, q_id
    else:
        seg_kv = ids(segments.kv_array, operands, b, skv)
        k_start, k_len, k_id, k_count, _ = runs(seg_kv, n)
        ok = (increasing(seg_q, pads) & increasing(seg_kv, pads) & jnp.all(q_count <= n)
              & jnp.all(k_count <= n))
        if segments.pad_kv is not None:
            k_len = jnp.where(k_id == segments.pad_kv, 0, k_len)
        # Each query run reads the key run of its id (one at most: ids are runs).
        match = (q_id[:, :, None] == k_id[:, None, :]) & (k_len[:, None, :] > 0)
        kv_start = jnp.sum(jnp.where(match, k_start[:, None, :], 0), axis=2)
        kv_len = jnp.sum(jnp.where(match, k_len[:, None, :], 0), axis=2)
        kv_id = q_id
    if segments.pad_kv is not None:
        kv_len = jnp.where(kv_id == segments.pad_kv, 0, kv_len)
    if segments.pad_q is not None:
        q_len = jnp.where(q_id == segments.pad_q, 0, q_len)
    if segments.length is not None:
        kv_len = jnp.clip(jnp.minimum(kv_start + kv_len, _length(segments.length, operands, b))
                          - kv_start, 0, kv_len)
    # Rows that see no key are fully masked: left out of the sequences, so the
    # kernels never meet them (their O is 0 and LSE -inf, as everywhere).
    q_len = jnp.where(kv_len == 0, 0, q_len)
    if segments.window is not None:  # causal window over truncated keys: a suffix sees none
        q_len = jnp.minimum(q_len, kv_len + segments.window - 1)
    # A sequence without query rows has no keys either: its keys' gradients
    # are zero, written by nobody (the backward starts dK, dV at zero).
    kv_len = jnp.where(q_len == 0, 0, kv_len)
    covered = None
    if segments.pads_tokens:
        r = jnp.minimum(q_rank, n - 1)
        offset = jnp.arange(sq, dtype=jnp.int32)[None, :] - jnp.take_along_axis(q_start, r, 1)
        covered = offset < jnp.take_along_axis(q_len, r, 1)
    return Layout(ok, q_start, q_len.astype(jnp.int32), kv_start.astype(jnp.int32),
                  kv_len.astype(jnp.int32), covered)


def _length(length, operands, b):
    if length.operand is None:
        return jnp.full((b, 1), length.constant, jnp.int32)
    a = operands[length.operand].astype(jnp.int32)
    a = a[:b] if length.batched else jnp.broadcast_to(a[:1], (b,))
    return a[:, None]


class Ragged(NamedTuple):
    """What the ragged graphs read besides q, k, v: element offsets of every
    sequence (``B*n + 1`` entries, int32) per tensor layout, and the lengths."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    o: jax.Array
    stats: jax.Array
    seq_q: jax.Array
    seq_kv: jax.Array


def ragged(layout: Layout, b, sq, skv, hq, hkv, d, dv) -> Ragged:
    rows = jnp.arange(b, dtype=jnp.int32)[:, None]
    # An empty slot starts where the sequence before it does: offsets never decrease.
    q_tok = jnp.where(layout.q_len > 0, rows * sq + layout.q_start, rows * sq).reshape(-1)
    kv_tok = jnp.where(layout.kv_len > 0, rows * skv + layout.kv_start, rows * skv).reshape(-1)
    q_tok, kv_tok = jax.lax.cummax(q_tok, axis=0), jax.lax.cummax(kv_tok, axis=0)
    q_tok = jnp.concatenate([q_tok, jnp.array([b * sq], jnp.int32)])
    kv_tok = jnp.concatenate([kv_tok, jnp.array([b * skv], jnp.int32)])
    return Ragged(q_tok * (hq * d), kv_tok * (hkv * d), kv_tok * (hkv * dv), q_tok * (hq * dv),
                  q_tok * hq, layout.q_len.reshape(-1), layout.kv_len.reshape(-1))
