"""The backward as Mosaic GPU kernels for Hopper: dK/dV and dQ on wgmma and TMA.

The same FlashAttention-2 backward as the Triton kernels (``kernels.dkdv``,
``kernels.dq``; the same semantics): scores ``s = scale * q.k``, the mod on
the tile, ``P = exp(mod(s) - LSE)`` (0 on rows whose LSE is -inf),
``dP = dO.V^T``, ``dS = P * (dP - D)`` and the score's gradient through the
mod's symbolic derivative; on tiles the map marks full, the mod without its
mask and that mod's derivative. Both kernels visit the tiles the block map
lists, a program's ``TILE`` rows by a streamed ``BLOCK`` (``DKDV_BLOCKS``,
``DQ_BLOCKS``).

Each program runs three warpgroups: two compute warpgroups that own
``BLOCK`` rows each (``TILE`` keys for dK/dV, queries for dQ) and keep their
gradients in registers, and a memory warpgroup that streams the other side's
tiles (the query, dO, LSE and D tiles for dK/dV; the key and value tiles for
dQ) into ``STAGES`` shared-memory slots with the copy engine, each tile
copied once for both compute warpgroups (one compute warpgroup per program
left the tensor cores idle while it evaluated the mod, and read every
streamed tile twice as often). All five products run
on the tensor cores (``wgmma``): dK/dV computes the transposed tiles
``S^T = K.Q^T`` and ``dP^T = V.dO^T``, so that ``dV += P^T.dO`` and
``dK += dS^T.Q`` take their left operand from registers; dQ computes
``S = Q.K^T``, ``dP = dO.V^T`` and ``dQ += dS.K``.

The mod's value and its local derivative (the derivative with ``dP = 1``;
the derivative is linear in ``dP``) are evaluated in one pass over the IR
(``codegen.evaluate_tile`` with ``mosaic.TILE_RULES``), so a softcap's
``tanh`` is taken once per score, and ``dS`` is multiplied by it (the
Triton backward evaluates the derivative at ``dP = dS``: the same terms,
multiplied in another order). While ``dP`` is on the tensor cores the
compute warpgroup evaluates the mod and ``P``.

dK and dV come out per query head (float32 when several query heads share a
key head: the caller sums each group in float32).

Gradients of captured float arrays read at one position per program (indices
built from b, h and constants: ``slopes[h]``, a learned cap, ``w[h, 2]``):
the cotangent of such a read is its local derivative (at ``dP = 1``, from
``codegen.derivatives``) times ``dS``, evaluated in the same pass as the mod.
The dK/dV kernel sums it over each tile's queries into one float32 per key,
carried across the query tiles in registers, and writes those sums per
(batch, query head, read) ``[B, Hq, reads, Skv]``; ``operand_parts`` sums
them per key block and places each read's total at the position it read,
in the Triton kernels' partial rows, which the backend reduces as it does
theirs. Reads along the keys at positions known when tracing (``w[h,
kv_idx]``: ``along_keys``) take the same per-key sums, which are their
cotangents; reads along the queries (``along_queries``) the dQ kernel's
per-query sums, computed the same way; the backend places each key's (or
query's) at the position it reads, each position summing its keys in a
fixed order. A float array read per score (``bias[b, h, q_idx, kv_idx]``:
``along_dense``) has a cotangent per score: the dQ kernel writes each tile it
visits to [B, Hq, reads, Sq, Skv] through shared memory, and the backend adds
each (batch, head)'s matrix into the entry it reads; so do gathers
(``table[h, rel[q_idx, kv_idx]]``), added by the positions their index takes,
evaluated after the kernels. No atomics: the same bits on every run. Reads at
q_idx - kv_idx have their own kernel (``diagonal_sums``).

Off a GPU (the plan's interpret flag) the kernels run in Mosaic GPU's
interpret mode, a CPU simulation of the warpgroups, barriers, copies and
wgmma, for tests: there the products add into fresh accumulators and left
operands pass through shared memory (what it can simulate); the rest is the
GPU's program.

jax.experimental.pallas.mosaic_gpu is imported when a kernel is built, never
at import (as ``mosaic``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from scoremod.dsl import ir
from scoremod.dsl.ir import F32
from scoremod.dsl.text import format_expr
from scoremod.lowering import patterns
from scoremod.lowering.pallas import codegen, mosaic

BLOCK = 64  # rows per compute warpgroup, and per streamed tile (wgmma's M is 64)
COMPUTE_WGS = 2  # compute warpgroups per program, each owning BLOCK of its rows
TILE = BLOCK * COMPUTE_WGS  # a program's own rows: dK/dV's keys, dQ's queries
STAGES = 2  # streamed tiles in flight
# Registers per thread: the compute warpgroups take what the memory warpgroup gives up
# (2 x 232 + 40 warps' worth fits the 64K registers of a multiprocessor).
COMPUTE_REGISTERS, MEMORY_REGISTERS = 232, 40
ONE_COMPUTE_REGISTERS = 256  # the per-block-diagonal kernel's single compute warpgroup
# The compute warpgroups take turns on the tensor cores (``_Turns``): None, where a
# kernel's rule says (``takes_turns``); True or False for all (a probe's variants).
TURNS = None
# dQ in the dK/dV kernel (``dkdv(with_dq=True)``) where the plan allows it
# (``PallasPlan.fused_dq``). Off: on the H200 (2026-12-06, b4 h16 s4096 d128 bf16,
# benchmarks/results/2026-12-06/run_s24_call1/) the fused kernel alone took longer than
# the two it replaces (plain 2.867 ms against 1.123 + 1.667, softcap 4.473 against
# 1.457 + 2.025, causal 2.039 against 0.672 + 1.110), and a whole call with it failed
# under jax.jit ("No state discharge rule implemented for primitive: custom_jvp_call":
# its global-memory ref inside the custom_jvp).
FUSE_DQ = False
# The block maps' (block_q, block_kv) of each kernel: a program's own rows by a streamed tile.
DKDV_BLOCKS = (BLOCK, TILE)
DQ_BLOCKS = (TILE, BLOCK)
DIAGONAL_BLOCKS = (BLOCK, BLOCK)

LOG2E = mosaic.LOG2E
NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class BackwardSpec(mosaic.MosaicSpec):
    """Everything static about one call's backward kernels (hashable): the
    forward's, and the float operands whose gradients the dK/dV kernel computes
    (their reads at one position per program: ``learning_refusal`` is None for
    each)."""

    learned: tuple = ()


@functools.lru_cache(maxsize=256)
def local_derivative(expr):
    """d(mod)/d(score) as an expression without ``dP`` (the symbolic derivative at
    ``dP = 1``), or None where it is the constant 1."""
    local = ir.substitute(codegen.derivatives(expr).score, {ir.cotangent(): ir.const(1.0, F32)})
    return None if ir.is_const(local, 1.0) else local


def refusal(expr, sources) -> str | None:
    """Why these kernels cannot evaluate the mod or its derivative (the forward
    engine's rules: ``mosaic.refusal``), or None."""
    if expr is None:
        return None
    why = mosaic.refusal(expr, sources, advice=False)
    local = local_derivative(expr)
    if why is None and local is not None:
        why = mosaic.refusal(local, sources, advice=False)
        if why:
            why = "in the mod's derivative, " + why
    return why


def learned_loads(expr, names) -> tuple:
    """The reads (LOAD nodes) of the float operands ``names`` in ``expr``, in
    ``codegen.derivatives`` order: the dK/dV kernel's sums, one per read."""
    if expr is None or not names:
        return ()
    return tuple(n for n, _ in codegen.derivatives(expr).loads if n.args[0].attr[0] in names)


@functools.lru_cache(maxsize=256)
def load_derivatives(expr, loads) -> tuple:
    """Per read in ``loads``: its cotangent at ``dP = 1`` (linear in ``dP``, so
    times dS it is the read's cotangent; 0 for a read ``expr`` does not make:
    the full-tile mod may drop one)."""
    cts = dict(codegen.derivatives(expr).loads)
    one = {ir.cotangent(): ir.const(1.0, F32)}
    return tuple(ir.substitute(cts[n], one) if n in cts else ir.const(0.0, F32) for n in loads)


def reads_arrays(node) -> bool:
    """Whether read ``node``'s index reads captured arrays (``t[kind[kv_idx], 0]``):
    where it reads is known at run time only."""
    return any(n.op == ir.OPERAND for i in node.args[1:] for n in ir.toposort(i))


def along_keys(node) -> bool:
    """Whether read ``node`` is along the keys (``w[h, kv_idx]``, ``w[kv_idx // 4]``,
    ``t[kind[kv_idx], 0]``): the dK/dV kernel's per-key sums are its cotangents,
    which the backend places at the positions it reads (evaluated when tracing, or
    at run time where the index reads captured arrays)."""
    return mosaic.read_axis(node) == "kv_idx"


def along_queries(node) -> bool:
    """``along_keys`` for the queries (``w[q_idx]``): the dQ kernel sums these, per query."""
    return mosaic.read_axis(node) == "q_idx"


def along_blocks(node) -> bool:
    """Whether read ``node`` is at whole blocks of positions (``mosaic.block_sizes``)
    with an index of the positions alone (``table[h, q_idx // 64, kv_idx // 32]``):
    each step of the dK/dV kernel (its ``BLOCK`` queries) meets ``step_blocks`` block
    rows, and its cotangents summed over each one's queries, per key, are what the
    backend places."""
    return mosaic.read_axis(node) == mosaic.BLOCKS and not reads_arrays(node)


def along_dense(node) -> bool:
    """Whether the dQ kernel writes read ``node``'s cotangent per score, on every
    tile it visits, for the backend to add into the entries it reads: a value per
    score (``bias[b, h, q_idx, kv_idx]``: ``mosaic.is_dense``), a gather
    (``table[h, rel[q_idx, kv_idx]]``: ``mosaic.gathered``) whose index reads no
    score (the backend evaluates it again, without the scores), and reads at q_idx -
    kv_idx or at whole blocks whose index reads captured arrays (the block-diagonal
    and per-step sums take indices of the positions alone)."""
    axis = mosaic.read_axis(node)
    return (axis == mosaic.DENSE
            or (axis is False and mosaic.gathered(node) and not mosaic.reads_score(node))
            or (axis in (mosaic.OFFSET, mosaic.BLOCKS) and reads_arrays(node)))


def step_blocks(node) -> int:
    """The most block rows of read ``node`` (``along_blocks``) that one step's
    ``BLOCK`` queries meet (1 where the blocks are whole steps)."""
    return mosaic.blocks_along(mosaic.block_sizes(node)["q_idx"], BLOCK, BLOCK)


def key_loads(expr, names) -> tuple:
    """The ``learned_loads`` whose cotangents the dK/dV kernel sums per key (those
    at one position per program, and those along the keys)."""
    return tuple(n for n in learned_loads(expr, names)
                 if not along_queries(n) and not along_blocks(n) and not along_dense(n))


def block_loads(expr, names) -> tuple:
    """The ``learned_loads`` at whole blocks (``along_blocks``): the dK/dV kernel
    writes their cotangents summed per step and key."""
    return tuple(n for n in learned_loads(expr, names) if along_blocks(n))


def dense_loads(expr, names) -> tuple:
    """The ``learned_loads`` of a value per score (``along_dense``): the dQ kernel
    writes their cotangents per tile."""
    return tuple(n for n in learned_loads(expr, names) if along_dense(n))


def query_loads(expr, names) -> tuple:
    """The ``learned_loads`` whose cotangents the dQ kernel sums per query."""
    return tuple(n for n in learned_loads(expr, names) if along_queries(n))


def learning_refusal(expr, name, sources) -> str | None:
    """Why the dK/dV kernel cannot compute the gradient of float operand ``name``
    of ``expr`` (a read at an index that varies over the tile other than along
    the keys, or a read's derivative it cannot evaluate), or None."""
    loads = learned_loads(expr, (name,))
    dense = [n for n in loads if along_dense(n)]
    if dense and len(dense) < len(loads):
        where = ir.source_of(dense[0], expr, sources)
        return (f"it sums the gradient of a read per score (`{format_expr(dense[0])}`"
                f"{' at ' + where if where else ''}) apart from the array's other reads; "
                f"this mod reads `{name}` both ways")
    for node in loads:
        if not (ir.variables(*node.args[1:]) <= {"b", "h"} or along_keys(node)
                or along_queries(node) or along_blocks(node) or along_dense(node)):
            where = ir.source_of(node, expr, sources)
            return (f"it sums the gradients of reads at indices built from b, h and constants, "
                    f"of reads along the keys or the queries, of reads at whole blocks of "
                    f"positions known when tracing, and of reads per score at an index "
                    f"that reads no score, in arrays of at most 2^31 - 1 entries; "
                    f"`{format_expr(node)}`{' at ' + where if where else ''} is none of these")
    for local in load_derivatives(expr, loads):
        why = mosaic.refusal(local, sources, advice=False)
        if why:
            return f"in the derivative of a read of `{name}`, " + why
    return None


# Ops on the multiprocessors' special-function units: a mod that evaluates one on the
# score keeps a warpgroup off the tensor cores long enough for turns to pay.
_SLOW_OPS = frozenset({"exp", "exp2", "log", "log2", "log1p", "expm1", "tanh", "sigmoid",
                       "sqrt", "rsqrt", "sin", "cos", "tan", "atan", "erf", "erfc"})


def takes_turns(spec, kernel: str) -> bool:
    """Whether ``kernel``'s ("dkdv" or "dq") compute warpgroups take turns, with the
    softmax scale then applied once after the loop. Measured on the H200 (b4 h16
    s4096 d128 bf16, 2026-12-06, ``benchmarks/probes/mosaic_backward_kernels.py``):
    dK/dV with softcap 2.215 -> 2.026 ms, plain 1.661 -> 1.663, causal 1.094 -> 1.183;
    dQ plain 1.159 -> 1.550, softcap 1.487 -> 1.502, causal 0.672 -> 0.761. So dK/dV
    takes turns where the mod evaluates a slow op on the score, dQ never."""
    if TURNS is not None:
        return TURNS
    if kernel != "dkdv" or spec.expr is None:
        return False
    deps = patterns.dependencies(spec.expr)
    return any(n.op in _SLOW_OPS and ir.SCORE in deps[n] for n in ir.toposort(spec.expr))


def _flags(full, blocks, with_full):
    """The full-tile flags as int32, read only with a full-tile mod; else the block ids
    stand in (flags of one value, a constant, would cost XLA a broadcast kernel per
    call: ``mosaic.forward`` does the same)."""
    return full.astype(jnp.int32) if with_full else blocks


def _tile_terms(spec, s, inputs, refs, is_full, *, shape, origin, keys_down=False,
                reads=lambda roots: {}, loads=()):
    """``(modded scores in log2 units, local derivative or None)`` of the
    tile of raw products ``s`` (q.k), -inf past the sequences' ends, whose first
    query and key are ``origin`` (keys down the tile with ``keys_down``);
    ``reads(roots)``: the values of the vector reads under ``roots`` on the tile
    (``Vectors.tile``); with ``loads`` (reads of float operands), a third item:
    each read's cotangent at ``dP = 1`` on the tile (``load_derivatives``)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    layout = plgpu.Layout.WGMMA
    if spec.expr is None:
        return _tails(spec, s * jnp.float32(spec.scale * LOG2E), inputs), None

    variants = [(spec.expr, local_derivative(spec.expr))]
    if spec.full_expr is not None:
        variants.append((spec.full_expr, local_derivative(spec.full_expr)))
    has_local = any(local is not None for _, local in variants)
    load_terms = {expr: load_derivatives(expr, loads) for expr, _ in variants}
    score = s * jnp.float32(spec.scale)

    def tile(x):  # float32 on the whole tile (a constant or a per-program scalar, broadcast)
        x = jnp.asarray(x).astype(jnp.float32)
        if x.ndim == 0:
            x = plgpu.layout_cast(jnp.broadcast_to(x, shape), layout)
        return x

    def run(variant):
        expr, local = variant
        roots = [expr] + ([local] if local is not None else [])
        extra = list(load_terms[expr])
        known = reads(roots + extra)
        known.update(mosaic.position_values(roots + extra, refs, inputs["b"], inputs["h"],
                                            *origin, shape, keys_down, spec.interpret))
        out = codegen.evaluate_tile(roots + extra, dict(inputs, score=score), refs,
                                    gather=mosaic.tile_load(spec.interpret),
                                    rules=mosaic.TILE_RULES, known=known)
        value = tile(out[0]) * jnp.float32(LOG2E)
        terms = tuple(tile(x) for x in out[len(roots):])
        if not has_local:
            return value, None, terms
        return value, tile(out[1] if local is not None else 1.0), terms

    if len(variants) == 1:
        value, local, terms = run(variants[0])
    else:
        value, local, terms = lax.cond(is_full != 0, lambda: run(variants[1]),
                                       lambda: run(variants[0]))
    # Past the sequences' ends the score is 0 and the indices out of range, where
    # the derivatives may be inf or NaN: 0 there, or 0 * inf (P is 0) reaches
    # every real row through dS @ K and every learned array's sum.
    value = _tails(spec, value, inputs)
    if local is not None:
        local = _tails(spec, local, inputs, 0.0)
    if loads:
        return value, local, tuple(_tails(spec, t, inputs, 0.0) for t in terms)
    return value, local


def _copied_reads(spec, operands, b, hq, sq, skv, blocks):
    """``mosaic.CopiedReads`` of every expression a backward kernel evaluates: the
    mod (and its full-tile form), their local derivatives and the learned reads'
    cotangents, for programs of ``blocks`` (queries, keys)."""
    mods = [e for e in (spec.expr, spec.full_expr) if e is not None]
    learned = learned_loads(spec.expr, spec.learned)
    exprs = mods + [local_derivative(e) for e in mods]
    exprs += [t for e in mods for t in load_derivatives(e, learned)]
    return mosaic.CopiedReads.build([e for e in exprs if e is not None], spec.operand_names,
                                    operands, b, hq, *blocks, sq, skv)


class _Vectors:
    """The reads of captured arrays along one tile axis in a backward kernel's
    expressions (``mosaic.vector_reads``): each compute warpgroup's own rows' slice
    (``own``, the axis down the tile) is copied once, the streamed side's slice per
    step beside its tiles (into the step's slot); the tile's values load where an
    expression reads them. Reads at q_idx - kv_idx (``mosaic.offset_reads``)
    come the same way, a window of the program's diagonals per step
    (``mosaic.OffsetDiagonals``), spread over each warpgroup's tile in registers
    (keys down in the dK/dV kernel)."""

    def __init__(self, spec, operands, b, hq, sq, skv, own):
        self.interpret = spec.interpret
        blocks = DQ_BLOCKS if own == "q_idx" else DKDV_BLOCKS
        copied = _copied_reads(spec, operands, b, hq, sq, skv, blocks)
        self.sources, self.side = copied.sources, copied.side
        self.offsets, self.arrays = copied.offsets, copied.arrays
        self.own, self.streamed = own, ("kv_idx" if own == "q_idx" else "q_idx")

    def scratch(self):
        """(shared memory, barriers) for the own (per warpgroup) and the streamed slices."""
        import jax.experimental.pallas.mosaic_gpu as plgpu

        dtype = dict(zip(self.sources, (x.dtype for x in self.arrays)))
        own, streamed = self.side[self.own], self.side[self.streamed]
        smem = ([plgpu.SMEM((COMPUTE_WGS, BLOCK), dtype[src]) for src in own],
                [plgpu.SMEM((STAGES, BLOCK), dtype[src]) for src in streamed]
                + self.offsets.scratch(STAGES))
        ready = ([plgpu.Barrier(num_barriers=COMPUTE_WGS) for _ in own],
                 [plgpu.Barrier(num_barriers=STAGES)
                  for _ in streamed + self.offsets.sources])
        return smem, ready

    def slice(self, refs, src, bi, hi, start):
        import jax.experimental.pallas as pl

        ref = dict(zip(self.sources, refs))[src]
        return ref.at[(*mosaic.vector_row(src, bi, hi), pl.ds(start, BLOCK))]

    def load_own(self, refs, smem, ready, bi, hi, start, wg):
        """Warpgroup ``wg``'s own rows' vectors (from ``start``), in registers (along
        the tile's rows)."""
        import jax.experimental.pallas.mosaic_gpu as plgpu

        for src, buf, bar in zip(self.side[self.own], smem, ready):
            plgpu.copy_gmem_to_smem(self.slice(refs, src, bi, hi, start), buf.at[wg], bar.at[wg])
        out = {}
        for src, buf, bar in zip(self.side[self.own], smem, ready):
            plgpu.barrier_wait(bar.at[wg])
            out[src] = plgpu.load(buf.at[wg], layout=plgpu.Layout.WGMMA.reduce(1))
        return out

    def fetch(self, refs, smem, ready, bi, hi, row0, start, slot):
        """The memory warpgroup's copies of one step's streamed slices (the tile's
        columns from ``start``) and window of diagonals (for the program's rows
        from ``row0``)."""
        import jax.experimental.pallas.mosaic_gpu as plgpu

        for src, buf, bar in zip(self.side[self.streamed], smem, ready):
            plgpu.copy_gmem_to_smem(self.slice(refs, src, bi, hi, start), buf.at[slot],
                                    bar.at[slot])
        n = len(self.side[self.streamed])
        for ref, src, buf, bar in zip(refs[len(self.sources):], self.offsets.sources, smem[n:],
                                      ready[n:]):
            q0, k0 = (row0, start) if self.own == "q_idx" else (start, row0)
            plgpu.copy_gmem_to_smem(self.offsets.at(ref, src, bi, hi, q0, k0),
                                    buf.at[slot], bar.at[slot])

    def wait(self, ready, slot):
        """Every step, whether or not the step reads them (each wait takes one phase)."""
        import jax.experimental.pallas.mosaic_gpu as plgpu

        for bar in ready:
            plgpu.barrier_wait(bar.at[slot])

    def tile(self, own_values, smem, slot, wg):
        """``reads(roots)`` for ``_tile_terms`` on warpgroup ``wg``'s tile: the
        streamed slices load (along the tile's columns) only where ``roots`` read
        them."""
        import jax.experimental.pallas.mosaic_gpu as plgpu

        keys_down = self.own == "kv_idx"
        row, col = (0, wg * BLOCK) if keys_down else (wg * BLOCK, 0)

        def reads(roots):
            n = len(self.side[self.streamed])
            diagonal = mosaic.offset_reads(*roots)
            out = mosaic.offset_values(diagonal, {
                src: self.offsets.tile(buf.at[slot], row, (BLOCK, BLOCK), keys_down,
                                       self.interpret, col=col)
                for src, buf in zip(self.offsets.sources, smem[n:])} if diagonal else {})
            mine = mosaic.vector_reads(*roots)
            if not mine:
                return out
            streamed = {src: plgpu.load(buf.at[slot], layout=plgpu.Layout.WGMMA.reduce(0))
                        for src, buf in zip(self.side[self.streamed], smem)}
            out.update(mosaic.tile_reads(mine, {self.own: own_values, self.streamed: streamed},
                                         {self.own: 0, self.streamed: 1}, (BLOCK, BLOCK)))
            return out

        return reads


class _Turns:
    """The compute warpgroups' turns on the tensor cores, as in the forward: each
    step a warpgroup issues its S and dP products, passes the turn on, evaluates
    the mod and dS while the other's products run, then takes the turn back for
    its gradient products and the next step's S and dP. Without turns the two
    fall into step and evaluate the mod at the same time, the tensor cores idle.
    A turn is a rendezvous of both on one barrier; the second warpgroup starts
    one behind and the first ends with the extra one. Off (``on`` False: the
    kernel's ``takes_turns``): no rendezvous."""

    def __init__(self, barrier, wg, on):
        self.barrier, self.wg, self.on = barrier, wg, on

    def _meet(self):
        import jax.experimental.pallas.mosaic_gpu as plgpu

        plgpu.barrier_arrive(self.barrier)
        plgpu.barrier_wait(self.barrier)

    def start(self):
        import jax.experimental.pallas as pl

        if self.on:
            pl.when(self.wg == 1)(self._meet)

    def end(self):
        import jax.experimental.pallas as pl

        if self.on:
            pl.when(self.wg == 0)(self._meet)

    def pass_on(self):
        if self.on:
            self._meet()

    def take(self, values):
        """``values`` (what the products read), computed before the turn is taken."""
        if self.on:
            values = lax.optimization_barrier(values)
            self._meet()
        return values


def _has_padding(length) -> bool:
    """Whether an axis of ``length`` real rows has padded ones: the backend pads both
    axes to whole ``TILE``s, so a compute warpgroup's whole tile may be padding."""
    return length % TILE != 0


def _tails(spec, value, inputs, outside=NEG_INF):
    """``value`` with ``outside`` on padded keys and queries (``_has_padding``): -inf
    for the modded scores, so that P is 0 there whatever the mod gives (+inf on a
    padded row would make P NaN, and NaN * 0 reaches dK; a padded key's P would
    reach the learned arrays' sums); 0 for derivatives."""
    if _has_padding(spec.skv):
        value = jnp.where(inputs["kv_idx"] < spec.skv, value, outside)
    if _has_padding(spec.sq):
        value = jnp.where(inputs["q_idx"] < spec.sq, value, outside)
    return value


def _tile_inputs(spec, bi, hi, q0, k0, keys_down=False):
    """The variables a mod may read on a step's tile of queries from ``q0`` and
    keys from ``k0`` (``[keys, queries]`` when ``keys_down``, as in the dK/dV
    kernel); the index grids only where an expression reads them."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    exprs = [e for e in (spec.expr, spec.full_expr) if e is not None]
    exprs += [local_derivative(e) for e in exprs]
    q_axis, kv_axis = (1, 0) if keys_down else (0, 1)
    inputs = {"b": bi, "h": hi}
    if _has_padding(spec.sq) or any(mosaic.uses_var(e, "q_idx") for e in exprs):
        inputs["q_idx"] = q0 + plgpu.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), q_axis,
                                                      layout=plgpu.Layout.WGMMA)
    if _has_padding(spec.skv) or any(mosaic.uses_var(e, "kv_idx") for e in exprs):
        inputs["kv_idx"] = k0 + plgpu.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), kv_axis,
                                                       layout=plgpu.Layout.WGMMA)
    return inputs


def _product(left, right):
    """``left @ right^T`` of two [BLOCK, D] shared-memory tiles, float32 in registers."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    def product(acc):
        plgpu.wgmma(acc, left, right.transpose((1, 0)))
        return acc[...]

    return pl.run_scoped(product, plgpu.ACC((BLOCK, BLOCK), jnp.float32))


def _write_rows(tile_smem, value, out, sums, sums_smem, sums_at):
    """A compute warpgroup's gradient rows ``value`` to ``out`` (a gmem slice)
    through ``tile_smem``, and its per-row learned sums through ``sums_smem``
    (one slot per read) to ``sums_at(j)``, in one commit group (not waited)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    tile_smem[...] = value
    for j, total in enumerate(sums):
        sums_smem.at[j][...] = total
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(tile_smem, out, commit_group=False)
    for j in range(len(sums)):
        plgpu.copy_smem_to_gmem(sums_smem.at[j], sums_at(j), commit_group=False)
    plgpu.commit_smem_to_gmem_group()


def _map_index(counts, bi, hi):
    return (0 if counts.shape[0] == 1 else bi), (0 if counts.shape[1] == 1 else hi)


def _memory_warpgroup(wg, count, fetch, free, index=COMPUTE_WGS):
    """Warpgroup ``index`` (after the compute warpgroups), with few registers:
    ``_stream``'s loop of ``fetch``."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    @pl.when(wg == index)
    def _memory():
        plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")
        _stream(count, fetch, free)


def _stream(count, fetch, free):
    """The memory warpgroup's loop: ``fetch(step, slot)`` copies each step's
    tiles into slot ``step % STAGES`` once the compute warpgroup has freed it
    (arrived on ``free`` after step ``step - STAGES``); then it waits out the
    last frees, so that it has seen every phase of those barriers."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    for first in range(STAGES):
        pl.when(first < count)(functools.partial(fetch, first, first))

    def refill(step, carry):
        slot = lax.rem(step, STAGES)
        plgpu.barrier_wait(free.at[slot])
        fetch(step, slot)
        return carry

    def drain(step, carry):
        plgpu.barrier_wait(free.at[lax.rem(step, STAGES)])
        return carry

    lax.fori_loop(STAGES, jnp.maximum(count, STAGES), refill, None)
    lax.fori_loop(jnp.maximum(count - STAGES, 0), count, drain, None)


def dkdv(spec: BackwardSpec, bmap, q, k, v, do, lse2, delta, operands, with_dq=False):
    """Per query head dK, dV [B, Skv, Hq, D] (q's dtype, or float32 where query
    heads share key heads) on arrays padded to whole tiles (``TILE``), the
    sums of the cotangents of the reads of ``spec.learned`` (``key_loads``) per key [B, Hq, reads,
    Skv] (float32; None without such reads), with ``with_dq`` dQ too (else None):
    float32 [B, Sq, Hq, D], and the cotangents of the reads at whole blocks
    (``block_loads``) summed over the queries of each block row a step meets, per key:
    float32 [B, Hq, reads, Sq / BLOCK, rows, Skv] (``rows`` the most ``step_blocks``;
    row ``a`` of step ``i`` the block row ``(i * BLOCK) // t + a``, zeros past the
    step's), written only where the map visits that step's tile (None without such
    reads). ``bmap``: the block map at ``DKDV_BLOCKS``; ``lse2``: the LSE in
    log2 units, +inf on rows that see no key; ``delta``: D [B, Hq, Sq].

    A program owns ``TILE`` keys, ``BLOCK`` per compute warpgroup; both take each
    streamed query tile (Q, dO, LSE and D copied once for the two).

    With ``with_dq`` the kernel computes dQ as well, five products a step instead of the two kernels' seven: each compute
    warpgroup puts its dS^T in shared memory, and one step later (so that the
    warpgroups' turns survive) computes half of dQ's columns for that step's
    queries from both halves of dS and the program's keys, and adds them into a
    float32 dQ in global memory with the copy engine's reduce-add. The order of
    those adds varies from run to run: dQ's low bits do (``deterministic``
    takes the two kernels)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    b, sq, hq, d = q.shape
    skv = k.shape[1]
    dtype = q.dtype
    out_dtype = dtype if spec.groups == 1 else jnp.float32
    n_ops = len(operands)
    with_full = spec.full_expr is not None
    counts, blocks_ = bmap.kv_counts, bmap.kv_blocks
    full = _flags(bmap.kv_full, blocks_, with_full)
    layout = plgpu.Layout.WGMMA
    along_q = plgpu.Layout.WGMMA.reduce(0)  # a vector over the tile's columns (queries)
    along_kv = plgpu.Layout.WGMMA.reduce(1)  # a vector over the tile's rows (keys)
    vectors = _Vectors(spec, operands, b, hq, sq, skv, own="kv_idx")
    n_vec = len(vectors.arrays)
    loads = key_loads(spec.expr, spec.learned)
    blocks = block_loads(spec.expr, spec.learned)
    rows_of = [step_blocks(n) for n in blocks]
    n_rows = max(rows_of, default=1)
    turns_on = takes_turns(spec, "dkdv")
    dq_acc = None  # with_dq: dQ's float32 sums in global memory (set in ``run``)
    # Each warpgroup adds half of dQ's columns where a half is whole swizzled tiles
    # (64 two-byte columns), else all of them for its own keys (twice the adds).
    dq_cols = d // COMPUTE_WGS if d // COMPUTE_WGS % 64 == 0 else d

    def program(counts_ref, blocks_ref, full_ref, q_ref, k_ref, v_ref, do_ref, lse_ref,
                delta_ref, operand_refs, vector_refs, dk_ref, dv_ref, sums_ref, steps_ref,
                scoped):
        (k_smem2, v_smem2, q_smem, do_smem, lse_smem, delta_smem, *out_smem2), \
            (kv_ready, q_ready, do_ready, lse_ready, delta_ready), free, turn, \
            (own_vec_smem, vec_smem), (own_vec_ready, vec_ready), sums_smem, dq_scoped, \
            staging, steps_smem = scoped
        if with_dq:  # dK and dV leave through the memory dS and dQ used
            (ds_smem, dq_smem), out_smem2 = dq_scoped[0]
        else:
            out_smem2 = out_smem2[0]
        sums_smem = sums_smem[0] if sums_smem else None  # with learned reads only
        staging = staging[0] if staging else None  # interpret mode's
        steps_smem = steps_smem[0] if steps_smem else None  # with reads at whole blocks
        wg = lax.axis_index("wg")
        bi, hi = lax.axis_index("batch"), lax.axis_index("heads")
        kv_head = lax.div(hi, jnp.int32(spec.groups))
        tile = lax.axis_index("kv_seq")
        mb, mh = _map_index(counts, bi, hi)
        count = counts_ref[mb, mh, tile]

        def q_start(step):
            return blocks_ref[mb, mh, tile, step] * BLOCK

        @pl.when(wg < COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
            k0 = tile * TILE + wg * BLOCK  # this warpgroup's keys
            k_smem, v_smem, out_smem = k_smem2.at[wg], v_smem2.at[wg], out_smem2.at[wg]
            own = (bi, pl.ds(k0, BLOCK), kv_head)
            plgpu.copy_gmem_to_smem(k_ref.at[own], k_smem, kv_ready.at[2 * wg])
            plgpu.copy_gmem_to_smem(v_ref.at[own], v_smem, kv_ready.at[2 * wg + 1])
            own_vectors = vectors.load_own(vector_refs, own_vec_smem, own_vec_ready, bi, hi, k0,
                                           wg)
            plgpu.barrier_wait(kv_ready.at[2 * wg])
            plgpu.barrier_wait(kv_ready.at[2 * wg + 1])
            refs = dict(zip(spec.operand_names, operand_refs))
            zeros = lambda cols: plgpu.layout_cast(  # noqa: E731
                jnp.zeros((BLOCK, cols), jnp.float32), layout)
            turns = _Turns(turn, wg, turns_on)
            turns.start()
            if with_dq:
                ds_ready, ds_free, done = dq_scoped[1]
                if dq_cols < d:  # this warpgroup's columns of dQ, from all keys
                    cols, keys_of = pl.ds(wg * dq_cols, dq_cols), range(COMPUTE_WGS)
                else:  # all columns, from this warpgroup's keys (both add theirs)
                    cols, keys_of = slice(None), (wg,)

                def put_ds(step, ds):  # this warpgroup's dS^T where both read it
                    slot = lax.rem(step, 2)
                    pl.when(step >= 2)(lambda: plgpu.barrier_wait(ds_free.at[slot]))
                    ds_smem.at[slot, wg][...] = ds
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(ds_ready.at[slot])

                def add_dq(step):  # dQ's columns for step's queries: dS . K, added
                    slot = lax.rem(step, 2)
                    plgpu.barrier_wait(ds_ready.at[slot])

                    def product(acc):
                        for j in keys_of:  # the keys of warpgroup j
                            plgpu.wgmma(acc, ds_smem.at[slot, j].transpose((1, 0)),
                                        k_smem2.at[j, :, cols])
                        return acc[...]

                    part = pl.run_scoped(product, plgpu.ACC((BLOCK, dq_cols), jnp.float32))
                    plgpu.barrier_arrive(ds_free.at[slot])
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last add read it
                    dq_smem.at[wg][...] = part
                    plgpu.commit_smem()
                    rows = pl.ds(q_start(step), BLOCK)
                    if spec.interpret:
                        plgpu.copy_smem_to_gmem(dq_smem.at[wg],
                                                dq_acc.at[tile, wg, bi, rows, hi, cols])
                    else:
                        plgpu.copy_smem_to_gmem(dq_smem.at[wg], dq_acc.at[bi, rows, hi, cols],
                                                reduction_op="add")

            def put_steps(step, xs):  # the block reads' sums over the step's block rows
                slot = lax.rem(step, 2)
                q0 = q_start(step)
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # the slot's last copy read it
                for r, (node, x, n) in enumerate(zip(blocks, xs, rows_of)):
                    if n == 1:  # the step lies in one block row
                        steps_smem.at[wg, slot, r, 0][...] = x.sum(axis=1)
                        continue
                    t = mosaic.block_sizes(node)["q_idx"]
                    first = lax.div(q0, jnp.int32(t)) * t - q0  # its first row, step-relative
                    cols = plgpu.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 1, layout=layout)
                    for a in range(n):
                        inside = (cols >= first + a * t) & (cols < first + (a + 1) * t)
                        steps_smem.at[wg, slot, r, a][...] = jnp.where(inside, x, 0.0).sum(axis=1)
                plgpu.commit_smem()
                i = lax.div(q0, jnp.int32(BLOCK))
                for r, n in enumerate(rows_of):
                    for a in range(n):
                        plgpu.copy_smem_to_gmem(steps_smem.at[wg, slot, r, a],
                                                steps_ref.at[bi, hi, r, i, a, pl.ds(k0, BLOCK)],
                                                commit_group=False)
                plgpu.commit_smem_to_gmem_group()

            def step_fn(step, carry):
                dk, dv, sums = carry
                slot = lax.rem(step, STAGES)
                q0 = q_start(step)
                is_full = full_ref[mb, mh, tile, step] if with_full else None
                qs, dos = q_smem.at[slot], do_smem.at[slot]
                inputs = _tile_inputs(spec, bi, hi, q0, k0, keys_down=True)
                plgpu.barrier_wait(q_ready.at[slot])
                plgpu.barrier_wait(do_ready.at[slot])

                def probabilities(s_acc, dp_acc):
                    # S^T ([keys, queries]: kv_idx down, q_idx across) and dP^T on this
                    # warpgroup's turn; the mod once S^T is in, while dP^T runs.
                    plgpu.wgmma(s_acc, k_smem, qs.transpose((1, 0)))
                    plgpu.wgmma(dp_acc, v_smem, dos.transpose((1, 0)))
                    turns.pass_on()
                    s = plgpu.wgmma_accumulator_load(s_acc, wait_n=1)
                    plgpu.barrier_wait(lse_ready.at[slot])
                    vectors.wait(vec_ready, slot)
                    value, local, *terms = _tile_terms(
                        spec, s, inputs, refs, is_full, shape=(BLOCK, BLOCK), origin=(q0, k0),
                        keys_down=True, reads=vectors.tile(own_vectors, vec_smem, slot, wg),
                        loads=loads + blocks)
                    terms = terms[0] if loads + blocks else ()  # the reads' cotangents at dP = 1
                    lse = plgpu.load(lse_smem.at[slot], layout=along_q)
                    p = jnp.exp2(value - lax.broadcast_in_dim(lse, (BLOCK, BLOCK), [1]))
                    return p, local, terms, dp_acc[...]

                p, local, terms, dp = pl.run_scoped(
                    probabilities, *(plgpu.ACC((BLOCK, BLOCK), jnp.float32),) * 2)
                plgpu.barrier_wait(delta_ready.at[slot])
                dd = plgpu.load(delta_smem.at[slot], layout=along_q)
                ds = p * (dp - lax.broadcast_in_dim(dd, (BLOCK, BLOCK), [1]))
                # Each learned read's cotangent, summed over the tile's queries (per key):
                # over the loop for the reads per key, for this step for those at blocks.
                sums = tuple(acc + (term * ds).sum(axis=1) for acc, term in zip(sums, terms))
                if blocks:
                    put_steps(step, tuple(term * ds for term in terms[len(loads):]))
                if local is not None:
                    ds = ds * local
                if not turns.on:  # with turns, the scale multiplies dK or dQ at the end
                    ds = ds * jnp.float32(spec.scale)
                p, ds, sums = (p.astype(dtype), ds.astype(dtype), sums)
                if with_dq:
                    put_ds(step, ds)
                p, ds, sums = turns.take((p, ds, sums))

                def gradients(accs):  # both issued before one wait
                    dv_acc, dk_acc = accs
                    plgpu.wgmma(dv_acc, mosaic.left_operand(spec, p, staging, 2 * wg), dos)
                    plgpu.wgmma(dk_acc, mosaic.left_operand(spec, ds, staging, 2 * wg + 1), qs)

                dv, dk = mosaic.accumulate(spec, gradients, (dv, dk))
                if with_dq:
                    pl.when(step > 0)(lambda: add_dq(step - 1))
                plgpu.barrier_arrive(free.at[slot])
                return dk, dv, sums

            no_sums = tuple(plgpu.layout_cast(jnp.zeros((BLOCK,), jnp.float32), along_kv)
                            for _ in loads)
            dk, dv, sums = lax.fori_loop(0, count, step_fn, (zeros(d), zeros(d), no_sums))
            turns.end()
            if with_dq:
                pl.when(count > 0)(lambda: add_dq(count - 1))
                # Both warpgroups are past their dQ products and adds before either
                # writes dK to the memory they used.
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                plgpu.barrier_arrive(done)
                plgpu.barrier_wait(done)
            if turns.on:
                dk = dk * jnp.float32(spec.scale)
            rows = (bi, pl.ds(k0, BLOCK), hi)
            # dK with the sums, then dV, through one tile of shared memory (float32
            # ones would not fit beside each other).
            _write_rows(out_smem, dk.astype(out_dtype), dk_ref.at[rows], sums,
                        sums_smem.at[wg] if sums else None,
                        lambda j: sums_ref.at[bi, hi, j, pl.ds(k0, BLOCK)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the tile is free again
            _write_rows(out_smem, dv.astype(out_dtype), dv_ref.at[rows], (), None, None)
            plgpu.wait_smem_to_gmem(0)

        def fetch(step, slot):
            rows = pl.ds(q_start(step), BLOCK)
            plgpu.copy_gmem_to_smem(q_ref.at[bi, rows, hi], q_smem.at[slot], q_ready.at[slot])
            plgpu.copy_gmem_to_smem(lse_ref.at[bi, hi, rows], lse_smem.at[slot],
                                    lse_ready.at[slot])
            plgpu.copy_gmem_to_smem(do_ref.at[bi, rows, hi], do_smem.at[slot], do_ready.at[slot])
            plgpu.copy_gmem_to_smem(delta_ref.at[bi, hi, rows], delta_smem.at[slot],
                                    delta_ready.at[slot])
            vectors.fetch(vector_refs, vec_smem, vec_ready, bi, hi, tile * TILE, q_start(step),
                          slot)

        _memory_warpgroup(wg, count, fetch, free)

    def entry(counts_ref, blocks_ref, full_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
              *rest):
        operand_refs, vector_refs = rest[:n_ops], rest[n_ops:n_ops + n_vec]
        dk_ref, dv_ref, *more = rest[n_ops + n_vec:]
        sums_ref = more.pop(0) if loads else None
        steps_ref = more.pop(0) if blocks else None
        swizzled = mosaic.swizzled()
        own = plgpu.SMEM((COMPUTE_WGS, BLOCK, d), dtype, transforms=swizzled)
        streamed = plgpu.SMEM((STAGES, BLOCK, d), dtype, transforms=swizzled)
        vector = plgpu.SMEM((STAGES, BLOCK), jnp.float32)
        out_tiles = plgpu.SMEM((COMPUTE_WGS, BLOCK, d), out_dtype,
                               transforms=swizzled if out_dtype == dtype else ())
        smem = [own, own, streamed, streamed, vector, vector]
        if not with_dq:
            smem.append(out_tiles)
        ready = ((plgpu.Barrier(num_barriers=2 * COMPUTE_WGS),)
                 + (plgpu.Barrier(num_barriers=STAGES),) * 4)
        free = plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=STAGES)
        sums_smem = [plgpu.SMEM((COMPUTE_WGS, len(loads), BLOCK), jnp.float32)] if loads else []
        # dS^T of both warpgroups for two steps, and each one's dQ columns on their way
        # out; after the loop the same memory takes dK and dV (shared memory is short).
        dq_scoped = [] if not with_dq else [
            plgpu.RefUnion(
                [plgpu.SMEM((2, COMPUTE_WGS, BLOCK, BLOCK), dtype, transforms=swizzled),
                 plgpu.SMEM((COMPUTE_WGS, BLOCK, dq_cols), jnp.float32)], out_tiles),
            [plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=2),
             plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=2),
             plgpu.Barrier(num_arrivals=COMPUTE_WGS)]]
        # The block reads' per-step sums, two slots a warpgroup (one being copied out).
        steps_smem = ([plgpu.SMEM((COMPUTE_WGS, 2, len(blocks), n_rows, BLOCK), jnp.float32)]
                      if blocks else [])
        pl.run_scoped(
            lambda *scoped: program(counts_ref, blocks_ref, full_ref, q_ref, k_ref, v_ref, do_ref,
                                    lse_ref, delta_ref, operand_refs, vector_refs, dk_ref,
                                    dv_ref, sums_ref, steps_ref, scoped),
            smem, ready, free, plgpu.Barrier(num_arrivals=COMPUTE_WGS), *vectors.scratch(),
            sums_smem, dq_scoped, mosaic.staging(spec, 2 * COMPUTE_WGS, BLOCK, BLOCK, dtype),
            steps_smem, collective_axes="wg")

    out = jax.ShapeDtypeStruct((b, skv, hq, d), out_dtype)
    sums = (jax.ShapeDtypeStruct((b, hq, len(loads), skv), jnp.float32),) if loads else ()
    if blocks:
        sums += (jax.ShapeDtypeStruct((b, hq, len(blocks), sq // BLOCK, n_rows, skv),
                                      jnp.float32),)
    kernel = plgpu.kernel(
        entry, out_type=(out, out) + sums, grid=(hq, skv // TILE, b),
        grid_names=("heads", "kv_seq", "batch"), num_threads=COMPUTE_WGS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=mosaic.interpret_params(spec))
    args = (counts, blocks_, full, q, k, v, do, lse2, delta, *operands, *vectors.arrays)

    def returned(outs, dq):  # dK, dV, per key sums or None, dQ or None, per step sums or None
        extra = list(outs[2:])
        sums_out = extra.pop(0) if loads else None
        steps_out = extra.pop(0) if blocks else None
        return outs[0], outs[1], sums_out, dq, steps_out

    if not with_dq:
        return returned(kernel(*args), None)

    @jax.jit  # (a reference in global memory lives inside a jit only)
    def run(*args):
        nonlocal dq_acc
        # Zero where no key tile adds; in interpret mode (no reduce-add) one slice
        # per key tile and warpgroup, summed.
        parts = (skv // TILE, COMPUTE_WGS) if spec.interpret else ()
        dq_acc = jax.new_ref(jnp.zeros(parts + q.shape, jnp.float32), memory_space=plgpu.GMEM)
        outs = kernel(*args)
        dq = jax.freeze(dq_acc)
        dq = dq.sum((0, 1)) if spec.interpret else dq
        if turns_on:  # dS left the scale out
            dq = dq * jnp.float32(spec.scale)
        return outs, dq

    return returned(*run(*args))


def operand_parts(spec: BackwardSpec, sums, operands, windows) -> dict:
    """The partial rows [B, Hq, key blocks, window] of each learned operand
    (``windows``: the backend's (name, axes, size)) from ``dkdv``'s sums per
    key, for its reads at one position per program: summed per key block, each
    read's total placed at the position it reads within the window (one-hot
    products: the same sum on every run); reads ``along_keys`` are the backend's
    to place. ``operands``: the kernel's flat operand arrays (index math may
    read them)."""
    b, hq, n_loads, skv = sums.shape
    loads = key_loads(spec.expr, spec.learned)
    totals = sums.reshape(b, hq, n_loads, skv // BLOCK, BLOCK).sum(-1)
    refs = dict(zip(spec.operand_names, operands))
    grid = {"b": jnp.arange(b, dtype=jnp.int32)[:, None],
            "h": jnp.arange(hq, dtype=jnp.int32)[None, :]}
    parts = {}
    for name, axes, size in windows:
        part = jnp.zeros((b, hq, skv // BLOCK, size), jnp.float32)
        for i, node in enumerate(loads):
            if node.args[0].attr[0] != name or along_keys(node):
                continue
            index = codegen.evaluate_tile(list(node.args[1:]), grid, refs)
            at = jnp.broadcast_to(codegen.flat_index(node, index, axes), (b, hq))
            hot = (at[:, :, None] == jnp.arange(size)[None, None, :]).astype(jnp.float32)
            part = part + totals[:, :, i, :, None] * hot[:, :, None, :]
        parts[name] = part
    return parts


def dq(spec: BackwardSpec, bmap, q, k, v, do, lse2, delta, operands):
    """dQ [B, Sq, Hq, D] in q's dtype on arrays padded to whole tiles (``TILE``),
    the sums of the cotangents of the reads of ``spec.learned`` along the
    queries (``query_loads``) per query [B, Hq, reads, Sq] (float32; None without
    such reads), and the cotangents of its reads per score (``dense_loads``)
    [B, Hq, reads, Sq, Skv] (float32, written on the tiles the map visits only;
    None without such reads); ``bmap``: the block map at ``DQ_BLOCKS``; ``lse2``,
    ``delta`` as for ``dkdv``.

    A program owns ``TILE`` queries, ``BLOCK`` per compute warpgroup; both take
    each streamed key tile (K and V copied once for the two)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    b, sq, hq, d = q.shape
    dtype = q.dtype
    n_tiles = sq // TILE
    n_ops = len(operands)
    with_full = spec.full_expr is not None
    counts, blocks_ = bmap.q_counts, bmap.q_blocks
    full = _flags(bmap.q_full, blocks_, with_full)
    layout = plgpu.Layout.WGMMA
    along_rows = plgpu.Layout.WGMMA.reduce(1)  # a vector over the tile's rows (queries)
    vectors = _Vectors(spec, operands, b, hq, sq, k.shape[1], own="q_idx")
    n_vec = len(vectors.arrays)
    loads = query_loads(spec.expr, spec.learned)
    dense = dense_loads(spec.expr, spec.learned)
    skv = k.shape[1]

    def program(counts_ref, blocks_ref, full_ref, q_ref, k_ref, v_ref, do_ref, lse_ref,
                delta_ref, operand_refs, vector_refs, dq_ref, sums_ref, dense_ref, scoped):
        (q_smem2, do_smem2, lse_smem2, delta_smem2, k_smem, v_smem, *staging), \
            (own_ready, k_ready, v_ready), free, turn, \
            (own_vec_smem, vec_smem), (own_vec_ready, vec_ready), sums_smem, dense_smem = scoped
        sums_smem = sums_smem[0] if sums_smem else None  # with learned reads only
        dense_smem = dense_smem[0] if dense_smem else None  # with learned reads per score
        staging = staging[0] if staging else None  # interpret mode's
        wg = lax.axis_index("wg")
        bi, hi = lax.axis_index("batch"), lax.axis_index("heads")
        kv_head = lax.div(hi, jnp.int32(spec.groups))
        tile = n_tiles - 1 - lax.axis_index("q_seq")  # the longest (causal) tiles first
        mb, mh = _map_index(counts, bi, hi)
        count = counts_ref[mb, mh, tile]

        def kv_start(step):
            return blocks_ref[mb, mh, tile, step] * BLOCK

        @pl.when(wg < COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
            q0 = tile * TILE + wg * BLOCK  # this warpgroup's queries
            q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
            lse_smem, delta_smem = lse_smem2.at[wg], delta_smem2.at[wg]
            rows = (bi, pl.ds(q0, BLOCK), hi)
            vec = (bi, hi, pl.ds(q0, BLOCK))
            mine = [own_ready.at[4 * wg + i] for i in range(4)]
            plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem, mine[0])
            plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem, mine[1])
            plgpu.copy_gmem_to_smem(lse_ref.at[vec], lse_smem, mine[2])
            plgpu.copy_gmem_to_smem(delta_ref.at[vec], delta_smem, mine[3])
            own_vectors = vectors.load_own(vector_refs, own_vec_smem, own_vec_ready, bi, hi, q0,
                                           wg)
            for bar in mine:
                plgpu.barrier_wait(bar)
            lse = plgpu.load(lse_smem, layout=along_rows)
            dd = plgpu.load(delta_smem, layout=along_rows)
            refs = dict(zip(spec.operand_names, operand_refs))
            zeros = lambda cols: plgpu.layout_cast(  # noqa: E731
                jnp.zeros((BLOCK, cols), jnp.float32), layout)

            turns = _Turns(turn, wg, takes_turns(spec, "dq"))
            turns.start()

            def put_dense(k0, xs):  # the reads per score: their cotangents on the tile
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last step's copies
                for j, x in enumerate(xs):
                    dense_smem.at[wg, j][...] = x
                plgpu.commit_smem()
                for j in range(len(xs)):
                    plgpu.copy_smem_to_gmem(
                        dense_smem.at[wg, j],
                        dense_ref.at[bi, hi, j, pl.ds(q0, BLOCK), pl.ds(k0, BLOCK)],
                        commit_group=False)
                plgpu.commit_smem_to_gmem_group()

            def step_fn(step, carry):
                acc, sums = carry
                slot = lax.rem(step, STAGES)
                k0 = kv_start(step)
                is_full = full_ref[mb, mh, tile, step] if with_full else None
                ks, vs = k_smem.at[slot], v_smem.at[slot]
                inputs = _tile_inputs(spec, bi, hi, q0, k0)
                plgpu.barrier_wait(k_ready.at[slot])
                plgpu.barrier_wait(v_ready.at[slot])

                def probabilities(s_acc, dp_acc):  # as in dkdv, untransposed
                    plgpu.wgmma(s_acc, q_smem, ks.transpose((1, 0)))
                    plgpu.wgmma(dp_acc, do_smem, vs.transpose((1, 0)))
                    turns.pass_on()
                    s = plgpu.wgmma_accumulator_load(s_acc, wait_n=1)
                    vectors.wait(vec_ready, slot)
                    value, local, *terms = _tile_terms(
                        spec, s, inputs, refs, is_full, shape=(BLOCK, BLOCK), origin=(q0, k0),
                        reads=vectors.tile(own_vectors, vec_smem, slot, wg), loads=loads + dense)
                    terms = terms[0] if loads + dense else ()  # the reads' cotangents at dP = 1
                    p = jnp.exp2(value - lax.broadcast_in_dim(lse, (BLOCK, BLOCK), [0]))
                    return p, local, terms, dp_acc[...]

                p, local, terms, dp = pl.run_scoped(
                    probabilities, *(plgpu.ACC((BLOCK, BLOCK), jnp.float32),) * 2)
                ds = p * (dp - lax.broadcast_in_dim(dd, (BLOCK, BLOCK), [0]))
                # Each learned read's cotangent, summed over the tile's keys (per query);
                # those per score, written whole.
                sums = tuple(total + (term * ds).sum(axis=1) for total, term in zip(sums, terms))
                if dense:
                    put_dense(k0, tuple(term * ds for term in terms[len(loads):]))
                if local is not None:
                    ds = ds * local
                if not turns.on:  # with turns, the scale multiplies dK or dQ at the end
                    ds = ds * jnp.float32(spec.scale)
                ds, sums = turns.take((ds.astype(dtype), sums))

                def query_grad(acc_refs):
                    plgpu.wgmma(acc_refs[0], mosaic.left_operand(spec, ds, staging, wg), ks)

                (acc,) = mosaic.accumulate(spec, query_grad, (acc,))
                plgpu.barrier_arrive(free.at[slot])
                return acc, sums

            no_sums = tuple(plgpu.layout_cast(jnp.zeros((BLOCK,), jnp.float32), along_rows)
                            for _ in loads)
            acc, sums = lax.fori_loop(0, count, step_fn, (zeros(d), no_sums))
            turns.end()
            if turns.on:
                acc = acc * jnp.float32(spec.scale)
            # The queries' tile is free: dQ leaves through it.
            _write_rows(q_smem, acc.astype(dtype), dq_ref.at[rows], sums,
                        sums_smem.at[wg] if sums else None,
                        lambda j: sums_ref.at[bi, hi, j, pl.ds(q0, BLOCK)])
            plgpu.wait_smem_to_gmem(0)

        def fetch(step, slot):
            rows = pl.ds(kv_start(step), BLOCK)
            plgpu.copy_gmem_to_smem(k_ref.at[bi, rows, kv_head], k_smem.at[slot], k_ready.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[bi, rows, kv_head], v_smem.at[slot], v_ready.at[slot])
            vectors.fetch(vector_refs, vec_smem, vec_ready, bi, hi, tile * TILE, kv_start(step),
                          slot)

        _memory_warpgroup(wg, count, fetch, free)

    def entry(counts_ref, blocks_ref, full_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
              *rest):
        operand_refs, vector_refs = rest[:n_ops], rest[n_ops:n_ops + n_vec]
        dq_ref, *more = rest[n_ops + n_vec:]
        sums_ref = more.pop(0) if loads else None
        dense_ref = more.pop(0) if dense else None
        swizzled = mosaic.swizzled()
        own = plgpu.SMEM((COMPUTE_WGS, BLOCK, d), dtype, transforms=swizzled)
        own_vector = plgpu.SMEM((COMPUTE_WGS, BLOCK), jnp.float32)
        streamed = plgpu.SMEM((STAGES, BLOCK, d), dtype, transforms=swizzled)
        smem = [own, own, own_vector, own_vector, streamed, streamed]
        smem += mosaic.staging(spec, COMPUTE_WGS, BLOCK, BLOCK, dtype)
        ready = (plgpu.Barrier(num_barriers=4 * COMPUTE_WGS), plgpu.Barrier(num_barriers=STAGES),
                 plgpu.Barrier(num_barriers=STAGES))
        free = plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=STAGES)
        sums_smem = [plgpu.SMEM((COMPUTE_WGS, len(loads), BLOCK), jnp.float32)] if loads else []
        dense_smem = ([plgpu.SMEM((COMPUTE_WGS, len(dense), BLOCK, BLOCK), jnp.float32)]
                      if dense else [])
        pl.run_scoped(
            lambda *scoped: program(counts_ref, blocks_ref, full_ref, q_ref, k_ref, v_ref, do_ref,
                                    lse_ref, delta_ref, operand_refs, vector_refs, dq_ref,
                                    sums_ref, dense_ref, scoped),
            smem, ready, free, plgpu.Barrier(num_arrivals=COMPUTE_WGS), *vectors.scratch(),
            sums_smem, dense_smem, collective_axes="wg")

    sums = (jax.ShapeDtypeStruct((b, hq, len(loads), sq), jnp.float32),) if loads else ()
    if dense:
        sums += (jax.ShapeDtypeStruct((b, hq, len(dense), sq, skv), jnp.float32),)
    outs = plgpu.kernel(
        entry, out_type=(jax.ShapeDtypeStruct(q.shape, dtype),) + sums, grid=(hq, n_tiles, b),
        grid_names=("heads", "q_seq", "batch"), num_threads=COMPUTE_WGS + 1, thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=mosaic.interpret_params(spec),
    )(counts, blocks_, full, q, k, v, do, lse2, delta, *operands, *vectors.arrays)
    extra = list(outs[1:])
    return outs[0], (extra.pop(0) if loads else None), (extra.pop(0) if dense else None)


# --- gradients of reads at q_idx - kv_idx: one program per block diagonal ----------------
#
# A read at a relative position (``table[h, q_idx - kv_idx + S - 1]``, T5's buckets) has one
# value per diagonal of the score matrix, so its gradient is a sum of dS (times the read's
# local derivative) along each diagonal. The tiles of one block diagonal (query block i,
# key block i - delta) all cover the same 2 * BLOCK - 1 diagonals at the same places in
# the tile, so one program per block diagonal adds its tiles' cotangents into one register
# tile, in tile order, and sums that tile's diagonals once at the end (through shared
# memory: the reduction costs about as much as a tile's products, so once per program, not
# per tile), then writes them: no atomics, the same bits on every run. It recomputes S and
# dP (two products per tile), as the dQ kernel does. Neighbouring block diagonals overlap
# by BLOCK - 1 diagonals; ``diagonal_gradient`` adds the two shares of each in XLA, in a
# fixed order.


def diagonal_refusal(expr, name, sources) -> str | None:
    """Why ``diagonal_sums`` cannot compute the gradient of float operand ``name``
    (some read of it is not at q_idx - kv_idx, or its index reads captured
    arrays; a read's derivative it cannot evaluate), or None. The mod's reads
    along a tile axis (document ids) stream beside each step's tiles, both
    sides' slices."""
    loads = learned_loads(expr, (name,))
    for node in loads:
        index = node.args[1:]
        if mosaic.read_axis(node) != mosaic.OFFSET or any(
                n.op == ir.OPERAND for i in index for n in ir.toposort(i)):
            return (f"`{format_expr(node)}` is not read at q_idx - kv_idx with an index of the "
                    "positions alone")
    for local in load_derivatives(expr, loads):
        why = mosaic.refusal(local, sources, advice=False)
        if why:
            return f"in the derivative of a read of `{name}`, " + why
    return None


def diagonal_map(bmap, nq, nk):
    """Per block diagonal ``t`` (query block i, key block i - (t - nk + 1)), its visited
    tiles' query blocks in ascending order and whether each is full: (counts [Bm, Hm,
    nq + nk - 1], blocks, full [Bm, Hm, nq + nk - 1, nq]), from the block map's lists."""
    from scoremod.lowering import block_maps

    bm, hm = bmap.q_counts.shape[:2]
    valid = jnp.arange(nk)[None, None, None, :] < bmap.q_counts[..., None]
    idx = (jnp.arange(bm)[:, None, None, None], jnp.arange(hm)[None, :, None, None],
           jnp.arange(nq)[None, None, :, None], bmap.q_blocks)
    visited = jnp.zeros((bm, hm, nq, nk), bool).at[idx].max(valid)
    full = jnp.zeros((bm, hm, nq, nk), bool).at[idx].max(valid & bmap.q_full)
    delta = jnp.arange(nq + nk - 1) - (nk - 1)
    i = jnp.arange(nq)
    j = i[None, :] - delta[:, None]  # [diagonals, nq]
    inside = (j >= 0) & (j < nk)
    jj = jnp.clip(j, 0, nk - 1)

    def skew(x):
        return jnp.take_along_axis(x[:, :, None], jnp.broadcast_to(jj, (bm, hm) + jj.shape)
                                   [..., None], -1)[..., 0] & inside

    # x[:, :, i, j] at (t, i): x[:, :, None] is [Bm, Hm, 1, nq, nk]
    lists = block_maps.block_lists(skew(visited), skew(full))
    return lists.q_counts, lists.q_blocks, lists.q_full


def _diagonal_reduce(x, scratch, interpret):
    """``(lower, upper)`` [BLOCK] (rows layout) of a [BLOCK, BLOCK] tile ``x`` (queries
    down, keys across): ``lower[t]`` the sum of ``x[i, i - t]``, ``upper[t]`` that of
    ``x[i - t, i]`` (0 at t = 0), each in ascending i. On the GPU through ``scratch``
    (float32 [BLOCK, BLOCK] shared memory): every thread stores its elements, then sums
    its rows' diagonals in order (Pallas has no such reduction: written in Mosaic GPU)."""
    n = BLOCK
    if interpret:
        i = jnp.arange(n)[:, None]
        t = jnp.arange(n)[None, :]
        lower = jnp.where(i >= t, x[i, jnp.clip(i - t, 0, n - 1)], 0.0).sum(0)
        upper = jnp.where((i >= t) & (t > 0), x[jnp.clip(i - t, 0, n - 1), i], 0.0).sum(0)
        return lower, upper
    import jax.experimental.mosaic.gpu as mgpu
    import jax.experimental.pallas.mosaic_gpu as plgpu
    import numpy as np
    from jax._src.lib.mlir import ir as mir
    from jax._src.lib.mlir.dialects import arith, memref, vector

    rows = plgpu.Layout.WGMMA.reduce(1)
    out = plgpu.ShapeDtypeStruct((n,), jnp.float32, layout=rows)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()), return_type=(out, out))
    def reduce(ctx, tile, smem):
        del ctx
        tile.store_untiled(smem, optimized=False)
        mgpu.warpgroup_barrier()
        index = mir.IndexType.get()
        layout = mgpu.WGMMA_ROW_LAYOUT
        f32 = mir.F32Type.get()
        vec_type = layout.registers_element_type(f32)
        results = []
        for upper in (False, True):
            regs = np.empty(layout.registers_shape((n,)), dtype=object)
            for (row,), at in zip(layout.thread_idxs((n,)), np.ndindex(regs.shape)):
                total = arith.constant(f32, 0.0)
                for i in range(n):  # diagonal `row`: x[i, i - row] (x[i - row, i] above)
                    off = arith.constant(index, i)
                    other = arith.subi(off, row)
                    ok = arith.cmpi(arith.CmpIPredicate.sge, other, arith.constant(index, 0))
                    safe = arith.select(ok, other, arith.constant(index, 0))
                    at_ = [safe, off] if upper else [off, safe]
                    val = memref.load(smem, at_)
                    val = arith.select(ok, val, arith.constant(f32, 0.0))
                    total = arith.addf(total, val)
                if upper:
                    zero = arith.cmpi(arith.CmpIPredicate.eq, row, arith.constant(index, 0))
                    total = arith.select(zero, arith.constant(f32, 0.0), total)
                regs[at] = vector.broadcast(vec_type, total)
            results.append(mgpu.FragmentedArray(_registers=regs, _layout=layout,
                                                _is_signed=None))
        mgpu.warpgroup_barrier()  # the scratch is reused by the next read's tile
        return tuple(results)

    return reduce(x, scratch)


def diagonal_sums(spec: BackwardSpec, bmap, q, k, v, do, lse2, delta, operands):
    """The sums along each diagonal of the cotangents of the reads of ``spec.learned``
    (all at q_idx - kv_idx: ``diagonal_refusal``), per block diagonal: float32 [B, Hq,
    reads, nq + nk - 1, 2, BLOCK] (``[..., 0, t]``: the diagonal ``t`` below the block
    diagonal's first, ``[..., 1, t]``: ``t`` above), on arrays padded to whole tiles
    (``bmap`` at ``DIAGONAL_BLOCKS``; ``lse2``, ``delta`` as for ``dkdv``). One
    compute warpgroup: its register tile of sums leaves no room for a second."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    b, sq, hq, d = q.shape
    skv = k.shape[1]
    dtype = q.dtype
    nq, nk = bmap.block_counts  # the real lengths' tiles (the arrays may be padded further)
    n_diag = nq + nk - 1
    n_ops = len(operands)
    with_full = spec.full_expr is not None
    counts, blocks_, full = diagonal_map(bmap, nq, nk)
    full = _flags(full, blocks_, with_full)
    along_rows = plgpu.Layout.WGMMA.reduce(1)
    loads = learned_loads(spec.expr, spec.learned)
    copied = _copied_reads(spec, operands, b, hq, sq, skv, DIAGONAL_BLOCKS)
    offsets = copied.offsets
    n_src = len(copied.sources)  # reads along one tile axis: both sides' slices stream
    n_arrays = len(copied.arrays)
    sides = [(axis, src) for axis in ("q_idx", "kv_idx") for src in copied.side[axis]]

    def program(counts_ref, blocks_ref, full_ref, q_ref, k_ref, v_ref, do_ref, lse_ref,
                delta_ref, operand_refs, vector_refs, offset_refs, out_ref, scoped):
        (q_smem, do_smem, lse_smem, delta_smem, k_smem, v_smem, red_smem, out_smem, *staging), \
            (q_ready, do_ready, lse_ready, delta_ready, k_ready, v_ready), free, \
            off_smem, off_ready, vec_smem, vec_ready = scoped
        by_source = dict(zip(copied.sources, vector_refs))
        staging = staging[0] if staging else None
        wg = lax.axis_index("wg")
        bi, hi = lax.axis_index("batch"), lax.axis_index("heads")
        kv_head = lax.div(hi, jnp.int32(spec.groups))
        t = lax.axis_index("diag")
        mb, mh = _map_index(counts, bi, hi)
        count = counts_ref[mb, mh, t]
        shift = t - (nk - 1)  # query block - key block

        def q_block(step):
            return blocks_ref[mb, mh, t, step]

        @pl.when(wg == 0)
        def _compute():
            plgpu.set_max_registers(ONE_COMPUTE_REGISTERS, action="increase")
            # The window of diagonals is the same on every tile of a block diagonal.
            q0_any, k0_any = jnp.maximum(shift, 0) * BLOCK, jnp.maximum(-shift, 0) * BLOCK
            for ref, src, buf, bar in zip(offset_refs, offsets.sources, off_smem, off_ready):
                plgpu.copy_gmem_to_smem(offsets.at(ref, src, bi, hi, q0_any, k0_any), buf, bar)
            for bar in off_ready:
                plgpu.barrier_wait(bar)
            refs = dict(zip(spec.operand_names, operand_refs))

            def tile_reads(slot):
                def reads(roots):
                    diagonal = mosaic.offset_reads(*roots)
                    out = mosaic.offset_values(diagonal, {
                        src: offsets.tile(buf, 0, (BLOCK, BLOCK), False, spec.interpret)
                        for src, buf in zip(offsets.sources, off_smem)}) if diagonal else {}
                    mine = mosaic.vector_reads(*roots)
                    if mine:  # both sides' slices of this step, along the rows and the columns
                        vectors = {"q_idx": {}, "kv_idx": {}}
                        for (axis, src), buf in zip(sides, vec_smem):
                            vectors[axis][src] = plgpu.load(
                                buf.at[slot], layout=plgpu.Layout.WGMMA.reduce(
                                    1 if axis == "q_idx" else 0))
                        out.update(mosaic.tile_reads(mine, vectors, {"q_idx": 0, "kv_idx": 1},
                                                     (BLOCK, BLOCK)))
                    return out

                return reads

            def step_fn(step, accs):
                slot = lax.rem(step, STAGES)
                i = q_block(step)
                q0, k0 = i * BLOCK, (i - shift) * BLOCK
                is_full = full_ref[mb, mh, t, step] if with_full else None
                qs, dos, ks, vs = (q_smem.at[slot], do_smem.at[slot], k_smem.at[slot],
                                   v_smem.at[slot])
                plgpu.barrier_wait(q_ready.at[slot])
                plgpu.barrier_wait(k_ready.at[slot])
                s = _product(qs, ks)  # [queries, keys]
                inputs = _tile_inputs(spec, bi, hi, q0, k0)
                plgpu.barrier_wait(do_ready.at[slot])
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_wait(lse_ready.at[slot])
                for bar in vec_ready:  # every step (each wait takes one phase)
                    plgpu.barrier_wait(bar.at[slot])

                def probabilities(dp_acc):
                    plgpu.wgmma(dp_acc, dos, vs.transpose((1, 0)))  # dP, while ...
                    value, _, terms = _tile_terms(spec, s, inputs, refs, is_full,
                                                  shape=(BLOCK, BLOCK), origin=(q0, k0),
                                                  reads=tile_reads(slot), loads=loads)
                    lse = plgpu.load(lse_smem.at[slot], layout=along_rows)
                    p = jnp.exp2(value - lax.broadcast_in_dim(lse, (BLOCK, BLOCK), [0]))
                    return p, terms, dp_acc[...]  # ... P is computed

                p, terms, dp = pl.run_scoped(probabilities, plgpu.ACC((BLOCK, BLOCK), jnp.float32))
                plgpu.barrier_wait(delta_ready.at[slot])
                dd = plgpu.load(delta_smem.at[slot], layout=along_rows)
                ds = p * (dp - lax.broadcast_in_dim(dd, (BLOCK, BLOCK), [0]))
                plgpu.barrier_arrive(free.at[slot])
                return tuple(acc + term * ds for acc, term in zip(accs, terms))

            zero = plgpu.layout_cast(jnp.zeros((BLOCK, BLOCK), jnp.float32), plgpu.Layout.WGMMA)
            accs = lax.fori_loop(0, count, step_fn, tuple(zero for _ in loads))
            for r, acc in enumerate(accs):
                lower, upper = _diagonal_reduce(acc, red_smem, spec.interpret)
                out_smem.at[r, 0][...] = lower
                out_smem.at[r, 1][...] = upper
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, out_ref.at[bi, hi, :, t])
            plgpu.wait_smem_to_gmem(0)

        def fetch(step, slot):
            i = q_block(step)
            rows, keys = pl.ds(i * BLOCK, BLOCK), pl.ds((i - shift) * BLOCK, BLOCK)
            plgpu.copy_gmem_to_smem(q_ref.at[bi, rows, hi], q_smem.at[slot], q_ready.at[slot])
            plgpu.copy_gmem_to_smem(k_ref.at[bi, keys, kv_head], k_smem.at[slot],
                                    k_ready.at[slot])
            plgpu.copy_gmem_to_smem(do_ref.at[bi, rows, hi], do_smem.at[slot], do_ready.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[bi, keys, kv_head], v_smem.at[slot],
                                    v_ready.at[slot])
            plgpu.copy_gmem_to_smem(lse_ref.at[bi, hi, rows], lse_smem.at[slot],
                                    lse_ready.at[slot])
            plgpu.copy_gmem_to_smem(delta_ref.at[bi, hi, rows], delta_smem.at[slot],
                                    delta_ready.at[slot])
            for (axis, src), buf, bar in zip(sides, vec_smem, vec_ready):
                start = i * BLOCK if axis == "q_idx" else (i - shift) * BLOCK
                plgpu.copy_gmem_to_smem(
                    by_source[src].at[(*mosaic.vector_row(src, bi, hi), pl.ds(start, BLOCK))],
                    buf.at[slot], bar.at[slot])

        _memory_warpgroup(wg, count, fetch, free, index=1)

    def entry(counts_ref, blocks_ref, full_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref,
              *rest):
        operand_refs = rest[:n_ops]
        vector_refs, offset_refs = rest[n_ops:n_ops + n_src], rest[n_ops + n_src:n_ops + n_arrays]
        (out_ref,) = rest[n_ops + n_arrays:]
        tile = plgpu.SMEM((STAGES, BLOCK, d), dtype, transforms=mosaic.swizzled())
        vector = plgpu.SMEM((STAGES, BLOCK), jnp.float32)
        # q, dO, LSE, D, k, v; the diagonal reduction's scratch; the sums' way out
        smem = [tile, tile, vector, vector, tile, tile, plgpu.SMEM((BLOCK, BLOCK), jnp.float32),
                plgpu.SMEM((len(loads), 2, BLOCK), jnp.float32)]
        smem += mosaic.staging(spec, 1, BLOCK, BLOCK, dtype)
        ready = tuple(plgpu.Barrier(num_barriers=STAGES) for _ in range(6))
        free = plgpu.Barrier(num_barriers=STAGES)
        off_smem = [plgpu.SMEM((offsets.window,), x.dtype) for x in offsets.arrays]
        off_ready = [plgpu.Barrier() for _ in offsets.arrays]
        dtypes = dict(zip(copied.sources, (x.dtype for x in copied.arrays)))
        vec_smem = [plgpu.SMEM((STAGES, BLOCK), dtypes[src]) for _, src in sides]
        vec_ready = [plgpu.Barrier(num_barriers=STAGES) for _ in sides]
        pl.run_scoped(
            lambda *scoped: program(counts_ref, blocks_ref, full_ref, q_ref, k_ref, v_ref, do_ref,
                                    lse_ref, delta_ref, operand_refs, vector_refs, offset_refs,
                                    out_ref, scoped),
            smem, ready, free, off_smem, off_ready, vec_smem, vec_ready, collective_axes="wg")

    return plgpu.kernel(
        entry, out_type=jax.ShapeDtypeStruct((b, hq, len(loads), n_diag, 2, BLOCK), jnp.float32),
        grid=(hq, n_diag, b), grid_names=("heads", "diag", "batch"), num_threads=2,
        thread_name="wg", compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=mosaic.interpret_params(spec),
    )(counts, blocks_, full, q, k, v, do, lse2, delta, *operands, *copied.arrays)


def diagonal_gradient(sums, nq, nk):
    """Per read, the sum along every diagonal ``q_idx - kv_idx = d`` of the padded
    score matrix, for d from ``-(nk * BLOCK - 1)`` to ``nq * BLOCK - 1``: float32 [B,
    Hq, reads, (nq + nk) * BLOCK - 1], from ``diagonal_sums``. Block diagonal t's
    diagonal ``t * BLOCK + u - (nk * BLOCK - 1)`` is its upper[BLOCK - 1 - u] for u <
    BLOCK - 1, its lower[u - BLOCK + 1] from there: two shares per diagonal, added."""
    lower, upper = sums[..., 0, :], sums[..., 1, :]
    # window [t, u], u in [0, 2 * BLOCK): upper reversed (u = 0 .. BLOCK - 2), lower, a 0
    window = jnp.concatenate([upper[..., :0:-1], lower, jnp.zeros_like(lower[..., :1])], -1)
    first, second = window[..., :BLOCK], window[..., BLOCK:]
    pad = [(0, 0)] * (window.ndim - 2)
    total = (jnp.pad(first, pad + [(0, 1), (0, 0)]) + jnp.pad(second, pad + [(1, 0), (0, 0)]))
    flat = total.reshape(total.shape[:-2] + (-1,))
    return flat[..., :(nq + nk) * BLOCK - 1]
