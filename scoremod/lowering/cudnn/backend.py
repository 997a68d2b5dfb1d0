"""The fused cuDNN path as a backend: IR -> cuDNN SDPA graphs run from JAX through XLA FFI.

``plan`` builds (once, at trace time, cached) the plan of a call; ``forward``
and ``backward`` call its forward and backward graphs through the
``scoremod_cudnn_execute`` FFI target, inside the ``custom_jvp`` of
``lowering.backend.execute``. No backward is written by hand: the backward
score_mod is the IR's derivative.
"""

from __future__ import annotations

import importlib.util
import logging
import sys

import jax
import jax.numpy as jnp

from scoremod import device, kernels_ffi, support
from scoremod import options as lowering_options
from scoremod.dsl import ir
from scoremod.dsl.text import format_expr
from scoremod.errors import CudnnUnavailableError, ScoreModError, UnsupportedOpError
from scoremod.lowering import block_maps, decode
from scoremod.lowering import sinks as attention_sinks
from scoremod.lowering.backend import Backend, empty_rows_at_inf
from scoremod.lowering.cudnn import rules, split, verify
from scoremod.lowering.cudnn.plan import plan_for

log = logging.getLogger("scoremod")

# Architecture families (compute capability major) where score_mod graphs were
# validated. Families, never exact capabilities: sm_121 behaves as sm_120.
VALIDATED_FAMILIES = (9,)
KNOWN_FAMILIES = (9, 10, 12)
FUSED_DTYPES = ("float16", "bfloat16")

# Whether the backward graphs take the sinks and sum their gradient (dSink_token,
# Cudnn.sums_sink_gradient). Off until the GPU suite's sinks tests pass with it on
# the H200 (tests/gpu/test_sinks_gpu.py): cuDNN 9.19's dSink was measured right for
# native masks alone (benchmarks/probes/cudnn_sinks.py), not yet beside a score_mod
# nor through scoremod's graphs; until then the sinks' gradient is the one
# reduction of lowering/sinks.py.
SINK_GRADIENT_IN_GRAPH = False


# Measured on the H200 (cuDNN 9.19, 2026-12-06, benchmarks/results/2026-12-06/run_s24_call2/):
# ALiBi decoding at one query row, b8 with 32 query heads on 8, 32768 keys, its slopes a
# [1, 32, 1, 1] tensor: O off by 1.35 of its largest value (b2, 8 heads on 2 and four
# query rows were right; so were the folds that pack a group's query heads into rows).
# Which of those counts matters is not known, so every call that would run one query
# row whose mod reads a captured array is refused.
ONE_ROW_READS = ("cuDNN 9.19 computed a mod that reads a captured array (ALiBi's slopes) "
                 "wrongly at one query row on the H200 (b8, 32 query heads on 8); it runs "
                 "such a call only where the short-query fold packs grouped query heads "
                 "into more rows (LoweringOptions(decode_splits) not 0, no tiles skipped "
                 "already); the Pallas kernels take the others")


class Cudnn(Backend):
    name = "cudnn"
    title = "the fused cuDNN path"
    error = CudnnUnavailableError
    hint = "Use implementation=\"xla\", or implementation=None to choose automatically."
    # Under LoweringOptions.deterministic its backward graphs are built with cuDNN's
    # deterministic algorithm (graph.GraphSpec.deterministic); by default dQ's
    # accumulation order varies from run to run (last bits, measured on the H200).
    repeatable_backward = True

    def present(self):
        return device.current().family is not None

    def why_not(self, problem, mod, automatic, options=None):
        # The mod and the inputs are judged first (pure IR and shape checks), so
        # the answer is informative on a machine without a GPU too.
        if mod is not None:
            try:
                rules.check_supported(mod.expr, mod.sources)
            except ScoreModError as e:
                return str(e)
        if (problem.sq == 1 and mod is not None and ir.operands_of(mod.expr)
                and not decode.packs_rows(self, problem, mod,
                                          options or lowering_options.current())):
            return ONE_ROW_READS
        if problem.dtype not in FUSED_DTYPES:
            return f"the fused path takes float16 or bfloat16 inputs, got {problem.dtype}"
        d, dv = problem.d, problem.dv
        if d % 8 or dv % 8 or d > 256 or dv > 256:
            return f"cuDNN needs head dims that are multiples of 8 and at most 256, got {d} and {dv}"
        family = device.current().family
        if family is None:
            return "no NVIDIA GPU is visible to JAX"
        if family not in KNOWN_FAMILIES:
            return f"score_mod graphs are not supported on compute capability family sm_{family}x"
        if not kernels_ffi.available():
            return kernels_ffi.unavailable_reason()
        if not _frontend_installed():
            wanted = support.version_text(kernels_ffi.compiled_frontend_version())
            return ("the cuDNN frontend Python package is not installed; pip install --no-deps "
                    f"nvidia-cudnn-frontend=={wanted} (the version the extension was compiled "
                    "against; docs/install.md)")
        mismatch = kernels_ffi.frontend_mismatch()
        if mismatch:
            return mismatch
        if automatic and family not in VALIDATED_FAMILIES:
            return (f"the fused path is not validated on this GPU family (sm_{family}x); "
                    "ask for it by name: implementation=\"cudnn\"")
        return verify.refusal(automatic)

    def plan(self, problem, mod, scale, options, return_lse):
        return plan_for(mod, problem, scale, options)

    def evaluates_mod(self, problem, mod, options):
        # A part with a score_mod graph (not a native mask or plain attention).
        return mod is not None and any(part.fwd is not None
                                       for part in plan_for(mod, problem, 1.0, options).parts)

    def tile_share(self, problem, mod, options):
        # The plan's blocks as its kernels walk them: a score_mod block computes every
        # tile of its rectangle, a block under cuDNN's native mask (or plain attention)
        # the tiles the mask keeps; the backward by its own plan (key blocks).
        if mod is None:
            return 1.0
        kept = block_maps.static_tiles(rules.canonical(mod.expr), problem.sq, problem.skv,
                                       split.TILE)
        if kept is None:
            return 1.0
        plan = plan_for(mod, problem, 1.0, options)

        def share(plan):
            n = 0
            for blk, part in zip(plan.blocks, plan.parts):
                q0, q1 = blk.q0 // split.TILE, -(-blk.q1 // split.TILE)
                k0, k1 = blk.k0 // split.TILE, -(-blk.k1 // split.TILE)
                n += (kept[q0:q1, k0:k1].sum() if part.fwd is None
                      else (q1 - q0) * (k1 - k0))
            return n / kept.size

        return (share(plan) + 2.5 * share(plan.backward_plan)) / 3.5

    def static_tensor_ahead(self, problem, mod, options):
        # A materialized input of the plan over the whole score matrix that reads no
        # captured array: a static mask (or bias) through an op the graphs lack. (A
        # split plan's tensors cover its blocks' tiles, which tile_share counts; masks
        # of captured arrays are the other claim's, by their form.)
        for load, nodes in self._whole_matrix_inputs(problem, mod, options):
            if not any(n.op == ir.OPERAND for n in nodes):
                lacked = next((n for n in nodes if rules.refusal(n)), None)
                if lacked is None:  # computed ahead for another reason: not this case
                    continue
                return (f"`{lacked.op}` ({rules.refusal(lacked)}), so XLA computes a "
                        f"[{','.join(map(str, load.spec.dims))}] tensor ahead")
        return None

    def data_tensor_ahead(self, problem, mod, options):
        # A float input over the whole score matrix computed from captured arrays at
        # both positions (a small table read through others: kind pairs; a paged cache's
        # logical positions; a mask of arrays the Pallas kernels' mask claim does not
        # take). A vector along the keys laid over the queries too, for a cuDNN fault
        # (plan._varies_along_kv_only), is not this case.
        for load, nodes in self._whole_matrix_inputs(problem, mod, options):
            if (load.node.dtype == ir.F32 and any(n.op == ir.OPERAND for n in nodes)
                    and {"q_idx", "kv_idx"} <= ir.variables(load.node)):
                return (f"`{format_expr(load.node)}`, computed by XLA ahead as a "
                        f"[{','.join(map(str, load.spec.dims))}] float32 tensor")
        return None

    def _whole_matrix_inputs(self, problem, mod, options):
        """``(load, its nodes)`` per input its plan materializes over the whole
        [.., Sq, Skv] score matrix."""
        if mod is None:
            return
        for part in plan_for(mod, problem, 1.0, options).parts:
            for load in part.loads:
                if load.operand is None and load.spec.dims[2:] == (problem.sq, problem.skv):
                    yield load, ir.toposort(load.node)

    def joins_sinks(self, plan, options):
        # cuDNN takes a sink with every graph scoremod builds (its native masks, or a
        # score_mod without one), but not at one query row (decode-only mode).
        return all(b.q1 - b.q0 > 1 for b in plan.blocks)

    def forward(self, plan, q, k, v, operands, sinks=None):
        s = plan.shape
        # Which blocks' graphs take the sink (per head, joins_sinks: the first batch
        # row's): every query block (each row is in one), or the first key block
        # (it covers every row; the rows' softmaxes join after).
        takes = [sinks is not None and (i == 0 or not plan.key_split)
                 for i in range(len(plan.parts))]
        try:
            graphs = [part.forward_graph(sink=t) for part, t in zip(plan.parts, takes)]
        except UnsupportedOpError as e:
            if not any(takes):
                raise
            log.info("cuDNN refused a sink in the forward graph (%s); joining it after", e)
            return attention_sinks.combine(*self.forward(plan, q, k, v, operands), sinks)
        sink = None if sinks is None else sinks[0].astype(jnp.float32).reshape(1, s.hq, 1, 1)
        out_shapes = _forward_outputs(s.b, s.sq, s.hq, s.dv, q.dtype)
        carried, outs = {}, []  # the first block's call allocates O and the stats
        for i, (blk, part, graph) in enumerate(zip(plan.blocks, plan.parts, graphs)):
            inputs = [q, k, v, *part.load_arrays(operands, forward=True)] + [sink] * takes[i]
            offsets = plan.offsets(blk)
            if offsets:
                oq, ok, ov, oo, os_ = offsets
                offsets = (oq, ok, ov) + (0,) * (len(inputs) - 3) + (oo, os_)
            if plan.key_split and i:  # its own O and stats, its rows written in place
                carried = {0: jnp.zeros(out_shapes[0].shape, q.dtype),
                           1: jnp.full(out_shapes[1].shape, -jnp.inf, jnp.float32)}
            o, stats = _call(graph, inputs, out_shapes, offsets, carried)
            carried = {0: o, 1: stats}
            outs.append((o, stats[..., 0]))
        return split.joined(outs, plan.blocks) if plan.key_split else outs[-1]

    def backward(self, plan, q, k, v, o, lse, do, operands, dlse=None, wanted=()):
        if dlse is not None:
            raise self.no_lse_cotangent()
        return (*self._backward(plan, q, k, v, o, lse, do, operands)[:3], {})

    def sums_sink_gradient(self, plan, options):
        # cuDNN's backward sums the sinks' gradient itself (dSink_token) beside dQ,
        # dK and dV, sparing a second pass over dO and O (about 45 us at b4 h16
        # s4096 d128: a tenth of a narrow window's backward). Not under
        # deterministic=True: the order of its sum is its own.
        return (SINK_GRADIENT_IN_GRAPH and not options.deterministic
                and self.joins_sinks(plan, options))

    def backward_with_sinks(self, plan, q, k, v, o, lse, do, operands, sinks):
        # A row that sees no key and whose sink is -inf has LSE -inf: P = 0 for its keys
        # and its sink alike.
        try:
            dq, dk, dv, dsink = self._backward(plan, q, k, v, o, empty_rows_at_inf(lse), do,
                                               operands, sinks)
        except UnsupportedOpError as e:
            log.info("cuDNN refused the sink in the backward graph (%s); its gradient is "
                     "summed after", e)
            dq, dk, dv = self._backward(plan, q, k, v, o, lse, do, operands)
            return dq, dk, dv, attention_sinks.gradient(o, lse, do, None, sinks)
        # One sink per head, summed over the batch by cuDNN: the total in the first
        # batch row, which the broadcast of the user's per-head sinks sums back.
        dsinks = jnp.zeros(sinks.shape, jnp.float32).at[0].set(dsink)
        return dq, dk, dv, dsinks

    def _backward(self, plan, q, k, v, o, lse, do, operands, sinks=None):
        """(dQ, dK, dV, the sinks' gradient [hq] summed over the batch: None without
        ``sinks``, whose first batch row the graphs take)."""
        plan = plan.backward_plan  # any partition of the rows or keys takes the final O, LSE
        sink = None if sinks is None else sinks[0].astype(jnp.float32).reshape(1, -1, 1, 1)
        if plan.key_split:
            return _key_split_backward(plan, q, k, v, o, lse, do, operands, sink)
        if not plan.split:
            (part,) = plan.parts
            out_shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
            inputs = [q, k, v, o, do, lse[..., None], *part.load_arrays(operands)]
            return _backward_call(part, inputs, out_shapes, sink=sink)
        dq, dks, dvs, dsink = None, [], [], None  # dQ: the first block's call allocates it,
        for blk, part in zip(plan.blocks, plan.parts):  # later ones fill in; each row in one block
            dq, dk, dv, block_dsink = _block_backward(plan, blk, part, q, k, v, o, lse, do,
                                                      operands, dq, sink)
            dks.append(dk)
            dvs.append(dv)
            if block_dsink is not None:
                dsink = block_dsink if dsink is None else dsink + block_dsink

        def summed(parts, like):  # blocks overlap in keys: add their gradients, in float32
            total = sum(jax.lax.pad(p.astype(jnp.float32), jnp.float32(0),
                                    [(0, 0, 0), (blk.k0, like.shape[1] - blk.k1, 0), (0, 0, 0),
                                     (0, 0, 0)])
                        for p, blk in zip(parts, plan.blocks))
            return total.astype(like.dtype)

        return dq, summed(dks, k), summed(dvs, v), dsink


def _block_backward(plan, blk, part, q, k, v, o, lse, do, operands, dq=None, sink=None):
    """One block's (dQ, dK, dV, the sink's gradient or None), on its rows and keys of
    the full arrays: dQ written into ``dq``'s rows in place (None: a new array, the
    other rows unwritten), dK and dV its keys' own; with ``sink`` ([1, hq, 1, 1]),
    the sink's gradient over its rows."""
    loads = part.load_arrays(operands)
    oq, ok, ov, oo, _ = plan.offsets(blk)
    stats = lse[:, :, blk.q0:blk.q1, None]  # packed: see GraphSpec.stats_layout
    n = blk.k1 - blk.k0
    out_shapes = [jax.ShapeDtypeStruct(q.shape, q.dtype),
                  jax.ShapeDtypeStruct(k.shape[:1] + (n,) + k.shape[2:], k.dtype),
                  jax.ShapeDtypeStruct(v.shape[:1] + (n,) + v.shape[2:], v.dtype)]
    offsets = (oq, ok, ov, oo, oo, 0) + (0,) * len(loads) + (oq, 0, 0)
    return _backward_call(part, [q, k, v, o, do, stats, *loads], out_shapes, offsets,
                          {} if dq is None else {0: dq}, sink)


def _key_split_backward(plan, q, k, v, o, lse, do, operands, sink=None):
    """dQ, dK, dV of key blocks: each block's backward on the joined O and LSE (its
    probabilities are the row's, restricted to its keys), dQ summed over the blocks,
    dK and dV each block's own keys; the sink's gradient (with ``sink``) from the
    first block, whose graph sums it over every row."""
    dq, dks, dvs, dsink = None, [], [], None
    for i, (blk, part) in enumerate(zip(plan.blocks, plan.parts)):
        # dQ into zeros: the block writes its rows only
        block_dq, dk, dv, block_dsink = _block_backward(
            plan, blk, part, q, k, v, o, lse, do, operands, jnp.zeros(q.shape, q.dtype),
            sink if i == 0 else None)
        block_dq = block_dq.astype(jnp.float32)
        dq = block_dq if dq is None else dq + block_dq
        dks.append(dk)
        dvs.append(dv)
        if block_dsink is not None:
            dsink = block_dsink
    return (dq.astype(q.dtype), jnp.concatenate(dks, axis=1), jnp.concatenate(dvs, axis=1),
            dsink)


def _backward_call(part, inputs, out_shapes, offsets=(), carried=None, sink=None):
    """``part``'s backward graph on ``inputs``: (dQ, dK, dV, None); with ``sink``
    ([1, hq, 1, 1]) the graph that takes it after the loads and sums its gradient
    into a zeroed buffer carried to its last output: (dQ, dK, dV, that sum [hq])."""
    if sink is None:
        return (*_call(part.backward_graph(), inputs, out_shapes, offsets, carried), None)
    n = len(inputs)
    if offsets:  # the sink's and its gradient's at 0
        offsets = offsets[:n] + (0,) + offsets[n:] + (0,)
    dq, dk, dv, dsink = _call(part.backward_graph(sink=True), inputs + [sink],
                              out_shapes + [jax.ShapeDtypeStruct(sink.shape, jnp.float32)],
                              offsets, {**(carried or {}), 3: jnp.zeros(sink.shape, jnp.float32)})
    return dq, dk, dv, dsink.reshape(-1)


def _frontend_installed() -> bool:
    """Whether the cuDNN frontend is importable, found without importing it (a
    warm start whose graphs come from the on-disk plan cache never needs it)."""
    if "cudnn" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("cudnn") is not None
    except (ImportError, ValueError):
        return False


def _forward_outputs(b, sq, hq, dv, dtype):
    """Shapes of the forward graph's O [b, sq, hq, dv] and stats [b, hq, sq, 1]."""
    return [jax.ShapeDtypeStruct((b, sq, hq, dv), dtype),
            jax.ShapeDtypeStruct((b, hq, sq, 1), jnp.float32)]


def _call(built, inputs, out_shapes, offsets=(), carried=None):
    """Runs ``built``; ``carried``: ``{output index: array}``, arrays appended to
    the inputs that become those outputs, updated in place (see ``kernels_ffi.call``)."""
    carried = carried or {}
    n = len(inputs)
    carry = {n + i: out for i, out in enumerate(carried)}
    if carried and offsets:
        offsets = offsets[:n] + (0,) * len(carried) + offsets[n:]
    return kernels_ffi.call(built.blob, built.graph_id, [*inputs, *carried.values()], out_shapes,
                            built.in_uids + (-1,) * len(carried), built.out_uids,
                            built.scalar_uids, built.scalar_bits, built.workspace,
                            offsets=offsets, carry=carry)


CUDNN = Cudnn()
