"""The Pallas kernels: a block-sparse forward, and the FA2 backward (dK/dV, dQ).

Every kernel visits only the tiles a :class:`~scoremod.lowering.block_maps.BlockMap`
lists: the forward and the dQ kernel run one program per (batch, query head,
query block) and loop over that query block's key blocks; the dK/dV kernel
runs one program per (batch, query head, key block) and loops over its query
blocks. Block ids are read from the map inside the loop (its length is the
count the map gives), and the key or query tile is a dynamic slice of the
whole sequence that the program holds.

Scores are float32: ``s = scale * q.k``, then the mod (``codegen``), then an
online softmax (forward) or ``P = exp(mod(s) - LSE)`` (backward). The
backward computes ``dS = P * (dP - D)`` with ``D = rowsum(dO * O) - dLSE``
computed ahead by XLA, and the score's gradient through the mod's symbolic
derivative (``dsl.grad``).

On tiles the map marks full, the plan's ``full_expr`` (the mod without its
mask) replaces the mod, forward and backward (a branch per tile).

Gradients of captured float arrays: in the dK/dV kernel, each program adds
the cotangent of every read of an array, summed over the tile entries that
read one element, into its own row of a partial array ``[B, Hq, key blocks,
elements]`` (the elements along the axes the program does not read at its
own batch or head); the backend sums the rows. No atomics: the result is the
same bit for bit on every run.

Sequences are padded to whole blocks by the caller; entries past the real
lengths are masked (never seen by the softmax, never given a gradient).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from scoremod.lowering.pallas import codegen

# Pallas modules that JAX imports only when a kernel is first lowered define
# config states of jit's trace context (jax 0.12: the fuser's, which interpret
# mode brings in): imported while the first call is traced, they change the cache
# key of every later call after that key was taken, so a jitted decode loop
# compiled twice. Imported here, before any call is traced.
try:
    import jax.experimental.pallas.fuser  # noqa: F401
except ImportError:  # a jax without it defines no such state
    pass

NEG_INF = float("-inf")
# The softmax's exponentials are taken base 2 (one multiply and the hardware's
# exp2), with the running maximum and the LSE kept in log2 units until the end.
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """Everything static about the kernels of one call (hashable)."""

    expr: object  # the mod's IR node, or None for plain attention
    # What the mod is on tiles the block map marks full (every score live;
    # the mask conditions dropped), or None: the whole mod everywhere.
    full_expr: object
    operand_names: tuple  # in the order the operand arrays are passed
    scale: float
    sq: int  # real lengths (the arrays are padded to whole blocks)
    skv: int
    groups: int  # query heads per key/value head
    block_q: int
    block_kv: int
    num_warps: int
    num_stages: int
    interpret: bool

    @property
    def derivatives(self):
        return _derivatives(self.expr)

    @property
    def full_derivatives(self):
        return _derivatives(self.full_expr)


@functools.lru_cache(maxsize=256)
def _derivatives(expr):
    return codegen.derivatives(expr)


def _compiler_params(spec):
    if spec.interpret:
        return None
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=spec.num_warps, num_stages=spec.num_stages)


def _whole():
    """The whole array in every program."""
    return pl.BlockSpec()


def _last_first(axis):
    """The block of a grid axis that runs over blocks in reverse: under a causal
    mask the last query blocks have the most tiles, and starting them first
    shortens the tail. Grid axis 0 is the one the GPU launches fastest, so
    consecutive programs share a (batch, head) and its keys in L2."""
    return pl.num_programs(axis) - 1 - pl.program_id(axis)


def _flags(full):
    """A map's full flags as the kernels read them (int32: Triton has no bool memory)."""
    return full.astype(jnp.int32)


def _map_index(counts_ref, b, h):
    """(batch, head) into a BlockMap whose leading axes may be 1 (shared)."""
    bm, hm = counts_ref.shape[0], counts_ref.shape[1]
    return (b if bm > 1 else 0), (h if hm > 1 else 0)


def _dot(a, b, trans_a=False, trans_b=False):
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _on_tile(spec, general, on_full, inputs, refs, full, shape):
    """``general`` (IR roots) evaluated on the tile, as float32 arrays of
    ``shape``; on a full tile (``full`` a traced flag) ``on_full`` instead."""
    def run(roots):
        return tuple(jnp.broadcast_to(x.astype(jnp.float32), shape)
                     for x in codegen.evaluate_tile(roots, inputs, refs))

    if spec.full_expr is None or full is None:
        return run(general)
    return lax.cond(full != 0, lambda: run(on_full), lambda: run(general))


def _scores(spec, q, k, b, h, q0, k0, refs, full=None):
    """The modded float32 score tile of rows q0.. and keys k0.., and the
    inputs the mod was evaluated on (for its derivatives)."""
    bq, bk = q.shape[0], k.shape[0]
    s = _dot(q, k, trans_b=True) * jnp.float32(spec.scale)
    q_idx = q0 + lax.broadcasted_iota(jnp.int32, (bq, 1), 0)
    kv_idx = k0 + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
    inputs = {"score": s, "b": b, "h": h, "q_idx": q_idx, "kv_idx": kv_idx}
    if spec.expr is not None:
        (s,) = _on_tile(spec, [spec.expr], [spec.full_expr], inputs, refs, full, (bq, bk))
    valid = _valid(spec, q_idx, kv_idx)
    if valid is not None:
        s = jnp.where(valid, s, NEG_INF)
    return s, inputs, valid


def _inside(valid, value):
    """``value`` with 0 on the padding: the mod's derivatives there (score 0,
    indices past the ends) may be inf or NaN, and ``0 * inf`` would reach every
    real row through ``dS @ K`` and every learned array's sum."""
    return value if valid is None else jnp.where(valid, value, 0.0)


def _valid(spec, q_idx, kv_idx):
    """Where the tile is inside the real sequences (None: everywhere, no padding)."""
    masks = []
    if spec.sq % spec.block_q:
        masks.append(q_idx < spec.sq)
    if spec.skv % spec.block_kv:
        masks.append(kv_idx < spec.skv)
    if not masks:
        return None
    out = masks[0]
    for m in masks[1:]:
        out = jnp.logical_and(out, m)
    return out


# --------------------------------------------------------------------------- #
# forward


def _forward_kernel(counts_ref, blocks_ref, full_ref, q_ref, k_ref, v_ref, *rest, spec):
    n_ops = len(spec.operand_names)
    refs = dict(zip(spec.operand_names, rest[:n_ops]))
    o_ref, lse_ref = rest[n_ops:]
    i, b, h = _last_first(0), pl.program_id(1), pl.program_id(2)
    mb, mh = _map_index(counts_ref, b, h)
    bq, bk = spec.block_q, spec.block_kv
    q = q_ref[...]
    dv = v_ref.shape[-1]

    def body(j, carry):
        acc, m, l = carry
        start = pl.multiple_of(blocks_ref[mb, mh, i, j] * bk, bk)
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        s, _, _ = _scores(spec, q, k, b, h, i * bq, start, refs, full_ref[mb, mh, i, j])
        s = s * LOG2E
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == NEG_INF, 0.0, m_new)  # a row masked so far adds nothing
        alpha = jnp.exp2(m - m_safe)
        p = jnp.exp2(s - m_safe[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v)
        return acc, m_new, l

    init = (jnp.zeros((bq, dv), jnp.float32), jnp.full((bq,), NEG_INF, jnp.float32),
            jnp.zeros((bq,), jnp.float32))
    acc, m, l = lax.fori_loop(0, counts_ref[mb, mh, i], body, init)
    empty = l == 0.0  # every score of the row masked: output 0, LSE -inf
    safe = jnp.where(empty, 1.0, l)
    o_ref[...] = jnp.where(empty[:, None], 0.0, acc / safe[:, None]).astype(o_ref.dtype)
    m_safe = jnp.where(m == NEG_INF, 0.0, m)
    lse_ref[...] = jnp.where(empty, NEG_INF, (m_safe + jnp.log2(safe)) * LN2)


def forward(spec: KernelSpec, bmap, q, k, v, operands):
    """O [B, Sq, Hq, Dv] (q's dtype) and LSE [B, Hq, Sq] (float32) on padded arrays."""
    b, sq, hq, d = q.shape
    skv, dv = k.shape[1], v.shape[-1]
    bq, bk, g = spec.block_q, spec.block_kv, spec.groups
    nq = sq // bq
    last = nq - 1  # the grid's first axis runs over query blocks, last first
    in_specs = [
        _whole(), _whole(), _whole(),
        pl.BlockSpec((None, bq, None, d), lambda x, bi, hi: (bi, last - x, hi, 0)),
        pl.BlockSpec((None, skv, None, d), lambda x, bi, hi: (bi, 0, hi // g, 0)),
        pl.BlockSpec((None, skv, None, dv), lambda x, bi, hi: (bi, 0, hi // g, 0)),
    ] + [_whole() for _ in operands]
    out_specs = [
        pl.BlockSpec((None, bq, None, dv), lambda x, bi, hi: (bi, last - x, hi, 0)),
        pl.BlockSpec((None, None, bq), lambda x, bi, hi: (bi, hi, last - x)),
    ]
    out_shape = [jax.ShapeDtypeStruct((b, sq, hq, dv), q.dtype),
                 jax.ShapeDtypeStruct((b, hq, sq), jnp.float32)]
    return pl.pallas_call(
        functools.partial(_forward_kernel, spec=spec),
        grid=(nq, b, hq), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        compiler_params=_compiler_params(spec), interpret=spec.interpret,
        name="scoremod_pallas_forward",
    )(bmap.q_counts, bmap.q_blocks, _flags(bmap.q_full), q, k, v, *operands)


# --------------------------------------------------------------------------- #
# backward


def _tile_gradients(spec, q, k, v, do, lse, delta, b, h, q0, k0, refs, full):
    """``P``, the cotangent of the modded scores ``dS``, the score's gradient
    (times the scale: q.k's), the tile inputs, and where the tile is inside the
    sequences (``_valid``), of one tile."""
    s, inputs, valid = _scores(spec, q, k, b, h, q0, k0, refs, full)
    finite = lse != NEG_INF  # a fully masked row has P = 0 (and LSE -inf)
    lse2 = jnp.where(finite, lse, 0.0) * LOG2E
    p = jnp.where(finite[:, None], jnp.exp2(s * LOG2E - lse2[:, None]), 0.0)
    if valid is not None:
        p = jnp.where(valid, p, 0.0)
    dp = _dot(do, v, trans_b=True)
    ds = p * (dp - delta[:, None])
    if spec.expr is None:
        dscore = ds
    else:
        inputs = dict(inputs, dP=ds)
        on_full = [spec.full_derivatives.score] if spec.full_expr is not None else None
        (dscore,) = _on_tile(spec, [spec.derivatives.score], on_full, inputs, refs, full,
                             ds.shape)
        dscore = _inside(valid, dscore)
    return p, ds, dscore * jnp.float32(spec.scale), inputs, valid


def _dkdv_kernel(counts_ref, blocks_ref, full_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
                 *rest, spec, windows):
    n_ops = len(spec.operand_names)
    refs = dict(zip(spec.operand_names, rest[:n_ops]))
    grad_operands = tuple(name for name, _, _ in windows)
    n_parts = len(grad_operands)
    parts_in = rest[n_ops:n_ops + n_parts]
    dk_ref, dv_ref = rest[n_ops + n_parts:n_ops + n_parts + 2]
    parts = dict(zip(grad_operands, rest[n_ops + n_parts + 2:]))
    del parts_in  # aliased to the outputs ``parts``: zeros to add into
    j, b, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    mb, mh = _map_index(counts_ref, b, h)
    bq, bk = spec.block_q, spec.block_kv
    k, v = k_ref[...], v_ref[...]
    loads = [(node, ct) for node, ct in spec.derivatives.loads
             if node.args[0].attr[0] in parts] if spec.expr is not None else []

    def body(t, carry):
        dk, dv = carry
        start = pl.multiple_of(blocks_ref[mb, mh, j, t] * bq, bq)
        rows = pl.ds(start, bq)
        q, do = q_ref[rows, :], do_ref[rows, :]
        p, ds, dscore, inputs, valid = _tile_gradients(spec, q, k, v, do, lse_ref[rows],
                                                       delta_ref[rows], b, h, start, j * bk,
                                                       refs, full_ref[mb, mh, j, t])
        dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)
        dk = dk + _dot(dscore.astype(q.dtype), q, trans_a=True)
        if loads:
            _add_operand_gradients(loads, inputs, refs, parts, windows, (bq, bk), valid)
        return dk, dv

    init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dk, dv = lax.fori_loop(0, counts_ref[mb, mh, j], body, init)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _add_operand_gradients(loads, inputs, refs, parts, windows, shape, valid):
    """Adds each read's cotangent, summed per element read, into this program's
    partial row (its position within the axes the row covers, ``windows``);
    ``valid``: the tile inside the sequences (the padding adds nothing)."""
    axes_of = {name: axes for name, axes, _ in windows}
    roots = [ct for _, ct in loads]
    for node, _ in loads:
        roots += node.args[1:]
    values = codegen.evaluate_tile(roots, inputs, refs)
    cts, at = values[:len(loads)], len(loads)
    for (node, _), ct in zip(loads, cts):
        n = len(node.args) - 1
        flat = codegen.flat_index(node, values[at:at + n], axes_of[node.args[0].attr[0]])
        at += n
        part = parts[node.args[0].attr[0]]
        idx = jnp.broadcast_to(flat, shape)
        ct = _inside(valid, jnp.broadcast_to(ct.astype(jnp.float32), shape))

        def add(e, carry, idx=idx, ct=ct, part=part):
            total = jnp.sum(jnp.where(idx == e, ct, 0.0))
            part[pl.ds(e, 1)] = part[pl.ds(e, 1)] + jnp.broadcast_to(total, (1,))
            return carry

        lax.fori_loop(jnp.min(idx), jnp.max(idx) + 1, add, None)


def dkdv(spec: KernelSpec, bmap, q, k, v, do, lse, delta, operands, windows: tuple):
    """Per query head dK, dV [B, Skv, Hq, D] (float32), and per float operand to
    learn (``windows``: (name, axes a program's row covers, their element
    count)) a partial gradient [B, Hq, key blocks, elements] (float32)."""
    grad_sizes = {name: size for name, _, size in windows}
    b, sq, hq, d = q.shape
    skv, dv_ = k.shape[1], v.shape[-1]
    bq, bk, g = spec.block_q, spec.block_kv, spec.groups
    nk = skv // bk
    names = tuple(grad_sizes)
    row = lambda ki, bi, hi: (bi, 0, hi, 0)  # noqa: E731
    in_specs = [
        _whole(), _whole(), _whole(),
        pl.BlockSpec((None, sq, None, d), row),
        pl.BlockSpec((None, bk, None, d), lambda ki, bi, hi: (bi, ki, hi // g, 0)),
        pl.BlockSpec((None, bk, None, dv_), lambda ki, bi, hi: (bi, ki, hi // g, 0)),
        pl.BlockSpec((None, sq, None, dv_), row),
        pl.BlockSpec((None, None, sq), lambda ki, bi, hi: (bi, hi, 0)),
        pl.BlockSpec((None, None, sq), lambda ki, bi, hi: (bi, hi, 0)),
    ] + [_whole() for _ in operands]
    part_shapes = [jax.ShapeDtypeStruct((b, hq, nk, grad_sizes[n]), jnp.float32) for n in names]
    part_spec = lambda n: pl.BlockSpec((None, None, None, grad_sizes[n]),  # noqa: E731
                                       lambda ki, bi, hi: (bi, hi, ki, 0))
    in_specs += [part_spec(n) for n in names]
    out_specs = [
        pl.BlockSpec((None, bk, None, d), lambda ki, bi, hi: (bi, ki, hi, 0)),
        pl.BlockSpec((None, bk, None, dv_), lambda ki, bi, hi: (bi, ki, hi, 0)),
    ] + [part_spec(n) for n in names]
    out_shape = [jax.ShapeDtypeStruct((b, skv, hq, d), jnp.float32),
                 jax.ShapeDtypeStruct((b, skv, hq, dv_), jnp.float32)] + part_shapes
    first_part = 9 + len(operands)
    zeros = [jnp.zeros(s.shape, s.dtype) for s in part_shapes]
    outs = pl.pallas_call(
        functools.partial(_dkdv_kernel, spec=spec, windows=windows),
        grid=(nk, b, hq), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        input_output_aliases={first_part + i: 2 + i for i in range(len(names))},
        compiler_params=_compiler_params(spec), interpret=spec.interpret,
        name="scoremod_pallas_dkdv",
    )(bmap.kv_counts, bmap.kv_blocks, _flags(bmap.kv_full), q, k, v, do, lse, delta, *operands,
      *zeros)
    return outs[0], outs[1], dict(zip(names, outs[2:]))


def _dq_kernel(counts_ref, blocks_ref, full_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
               *rest, spec):
    n_ops = len(spec.operand_names)
    refs = dict(zip(spec.operand_names, rest[:n_ops]))
    (dq_ref,) = rest[n_ops:]
    i, b, h = _last_first(0), pl.program_id(1), pl.program_id(2)
    mb, mh = _map_index(counts_ref, b, h)
    bq, bk = spec.block_q, spec.block_kv
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]

    def body(t, dq):
        start = pl.multiple_of(blocks_ref[mb, mh, i, t] * bk, bk)
        cols = pl.ds(start, bk)
        k, v = k_ref[cols, :], v_ref[cols, :]
        _, _, dscore, _, _ = _tile_gradients(spec, q, k, v, do, lse, delta, b, h, i * bq, start,
                                          refs, full_ref[mb, mh, i, t])
        return dq + _dot(dscore.astype(k.dtype), k)

    dq = lax.fori_loop(0, counts_ref[mb, mh, i], body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def dq(spec: KernelSpec, bmap, q, k, v, do, lse, delta, operands):
    """dQ [B, Sq, Hq, D] in q's dtype."""
    b, sq, hq, d = q.shape
    skv, dv_ = k.shape[1], v.shape[-1]
    bq, g = spec.block_q, spec.groups
    nq = sq // bq
    last = nq - 1  # the grid's first axis runs over query blocks, last first
    rows = lambda x, bi, hi: (bi, last - x, hi, 0)  # noqa: E731
    in_specs = [
        _whole(), _whole(), _whole(),
        pl.BlockSpec((None, bq, None, d), rows),
        pl.BlockSpec((None, skv, None, d), lambda x, bi, hi: (bi, 0, hi // g, 0)),
        pl.BlockSpec((None, skv, None, dv_), lambda x, bi, hi: (bi, 0, hi // g, 0)),
        pl.BlockSpec((None, bq, None, dv_), rows),
        pl.BlockSpec((None, None, bq), lambda x, bi, hi: (bi, hi, last - x)),
        pl.BlockSpec((None, None, bq), lambda x, bi, hi: (bi, hi, last - x)),
    ] + [_whole() for _ in operands]
    return pl.pallas_call(
        functools.partial(_dq_kernel, spec=spec),
        grid=(nq, b, hq), in_specs=in_specs,
        out_specs=pl.BlockSpec((None, bq, None, d), rows),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_compiler_params(spec), interpret=spec.interpret,
        name="scoremod_pallas_dq",
    )(bmap.q_counts, bmap.q_blocks, _flags(bmap.q_full), q, k, v, do, lse, delta, *operands)

