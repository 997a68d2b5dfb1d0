"""Block sparsity: which (query block, key block) tiles of a call a kernel visits.

A :class:`BlockMap` is computed inside the jitted program (it may depend on
captured arrays, e.g. document ids) and read by block-sparse kernels: per
query block, the key blocks to visit in ascending order, and whether each is
*full* (the mask holds on every entry, so the kernel may skip evaluating it);
and the transpose, per key block the query blocks (for dK and dV). Blocks not
listed are *empty*: every score in them is masked, so they contribute nothing.

Leading axes are ``[Bm, Hm]`` with ``Bm`` in ``{1, B}`` and ``Hm`` in
``{1, Hq}``: 1 where the mask does not depend on the batch or the head.

    >>> m = dense_block_map(batch=1, heads=1, sq=256, skv=384, block_q=128, block_kv=128)
    >>> m.q_counts.tolist(), m.q_blocks[0, 0, 1].tolist()
    ([[[3, 3]]], [0, 1, 2])
    >>> m.kv_counts.tolist(), m.kv_blocks[0, 0, 2].tolist()
    ([[[2, 2, 2]]], [0, 1])
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp


class BlockMap(NamedTuple):
    """The tiles a kernel visits (a pytree of int32/bool arrays).

    ``q_blocks[b, h, i, :q_counts[b, h, i]]`` are the key blocks of query block
    ``i`` in ascending order; entries past the count repeat the last valid one
    (a kernel that prefetches the next block re-reads a block it has, instead
    of an arbitrary one). ``kv_blocks``/``kv_counts``/``kv_full`` are the same
    per key block, listing query blocks."""

    q_counts: jnp.ndarray  # int32 [Bm, Hm, nq]
    q_blocks: jnp.ndarray  # int32 [Bm, Hm, nq, nk]
    q_full: jnp.ndarray  # bool  [Bm, Hm, nq, nk], aligned with q_blocks
    kv_counts: jnp.ndarray  # int32 [Bm, Hm, nk]
    kv_blocks: jnp.ndarray  # int32 [Bm, Hm, nk, nq]
    kv_full: jnp.ndarray  # bool  [Bm, Hm, nk, nq], aligned with kv_blocks

    @property
    def block_counts(self):
        """(query blocks, key blocks) of the call."""
        return self.q_blocks.shape[-2], self.kv_blocks.shape[-2]


def num_blocks(size: int, block: int) -> int:
    """Blocks of ``block`` entries that cover ``size`` (the last may be partial)."""
    return -(-size // block)


def dense_block_map(*, batch: int = 1, heads: int = 1, sq: int, skv: int, block_q: int,
                    block_kv: int) -> BlockMap:
    """Every tile visited, none full: correct for any mod (a kernel then
    evaluates the whole mod everywhere)."""
    nq, nk = num_blocks(sq, block_q), num_blocks(skv, block_kv)
    lead = (batch, heads)
    return BlockMap(
        q_counts=jnp.full(lead + (nq,), nk, jnp.int32),
        q_blocks=jnp.broadcast_to(jnp.arange(nk, dtype=jnp.int32), lead + (nq, nk)),
        q_full=jnp.zeros(lead + (nq, nk), jnp.bool_),
        kv_counts=jnp.full(lead + (nk,), nq, jnp.int32),
        kv_blocks=jnp.broadcast_to(jnp.arange(nq, dtype=jnp.int32), lead + (nk, nq)),
        kv_full=jnp.zeros(lead + (nk, nq), jnp.bool_),
    )
