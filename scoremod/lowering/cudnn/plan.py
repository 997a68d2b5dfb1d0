"""The plan of a fused cuDNN call: which graphs run on which rows, and what they read.

A plan is a tuple of blocks, each one fused call (a forward and a backward
graph, a :class:`Part`) on a range of the queries and the keys. An unsplit
call is a plan of one block covering everything; a band-masked mod with a
modifier may split into query blocks (``split``), whose graphs read and write
the block's rows of the full arrays in place (strides of the full arrays,
byte offsets per call), so no slice of q, k, v, O or dQ is copied.

    >>> import jax.numpy as jnp, scoremod
    >>> from scoremod.lowering.problem import Problem
    >>> mod = scoremod.trace(lambda s, b, h, q, k: jnp.where(q >= k, 30 * jnp.tanh(s / 30), -jnp.inf))
    >>> p = plan_for(mod, Problem(4, 4096, 4096, 16, 16, 128, 128, "bfloat16"), 0.088,
    ...              scoremod.LoweringOptions(sms=132))
    >>> len(p.blocks), p.split, round(p.parts[0].spec.scale * 30, 6)
    (8, True, 0.088)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from scoremod import device
from scoremod.dsl import ir, ops
from scoremod.dsl.evaluate import evaluate
from scoremod.dsl.ir import F32, Node
from scoremod.dsl.scoremod import ScoreMod
from scoremod.lowering.cudnn import graph as cg
from scoremod.lowering import decode
from scoremod.lowering.cudnn import masks, rules, split
from scoremod.dsl.ir import CONST, MATERIALIZE, VAR
from scoremod.lowering.cudnn.table import INPUT_TENSORS
from scoremod.lowering.problem import AXES, AXIS, Problem
from scoremod.options import LoweringOptions

# Tiles past the ends of the sequences: cuDNN's backward pass evaluates
# score_mod on padding keys (kv_idx >= Skv) of the last tile and, in float16,
# P = exp(score - LSE) can overflow there when the mod grows with kv_idx
# (measured: `score + 0.25 * kv_idx` at Skv=192 gives NaN in dQ); on padding
# queries (q_idx >= Sq) a mod that is NaN there makes P NaN, and dV NaN
# (measured: `score * sqrt(f32(Sq - q_idx))` at Sq=12). Masking the padding
# inside the mod keeps those entries at zero.
KV_TILE = 128
Q_TILE = 128  # a multiple of the query tiles cuDNN's backward runs (64 or 128 rows)


def _varies_along_kv_only(dims) -> bool:
    """Whether a tensor input spans kv_idx but not q_idx ([1,1,1,Skv], [B,1,1,Skv], ...).

    Measured on the H200 (cuDNN 9.19, float16, Skv=192): a score_mod adding a
    [1,1,1,Skv] tensor gave the right output and dQ, dK, dV all wrong (zero),
    while the same values as a [1,H,Sq,Skv] tensor were right. Such inputs are
    therefore materialized with the q_idx axis too, the layout the tests
    validate (it costs Sq x Skv memory per input).
    """
    return dims[AXIS["kv_idx"]] > 1 and dims[AXIS["q_idx"]] == 1


def _guard_padding(expr: Node, sq: int, skv: int, outside: float) -> Node:
    """``expr`` with ``outside`` on the padding of the last query and key tiles:
    -inf for the mod (see above), 0 for the score's gradient, which cuDNN's
    backward evaluates there too (score 0, indices past the ends), where the
    derivative may be inf or NaN (sqrt(|s|)'s at 0) and 0 * inf spreads NaN into
    dK and dV (measured on the H200: sqrt(|s|) at Sq=1, Skv=12)."""
    for var, n, tile in (("kv_idx", skv, KV_TILE), ("q_idx", sq, Q_TILE)):
        if n % tile:
            inside = ops.apply("lt", ir.var(var), ir.const(n, ir.I32))
            expr = ops.apply("where", inside, expr, ir.const(outside, F32))
    return expr


def native_band(mod, shape: Problem, options: LoweringOptions):
    """The native mask ``mod`` runs under at these sizes (when enabled), or None."""
    if mod is None or not options.native_masks:
        return None
    return masks.native_band(rules.canonical(mod.expr), shape.sq, shape.skv)


def key_blocks(mod, shape: Problem, options: LoweringOptions):
    """The two key blocks of a pure static mask (``split.by_keys``), or None."""
    if mod is None or options.split_blocks < 2 or not options.native_masks:
        return None
    if masks.native_band(rules.canonical(mod.expr), shape.sq, shape.skv) is not None:
        return None  # one native mask skips the masked tiles already
    return split.by_keys(mod, shape.sq, shape.skv)


def split_blocks(mod, shape: Problem, options: LoweringOptions):
    """Query blocks for a band-masked mod (see ``split``), or None for one call."""
    if mod is None or options.split_blocks < 2:
        return None
    expr = rules.canonical(mod.expr)
    if options.native_masks and masks.native_band(expr, shape.sq, shape.skv) is not None:
        return None  # a native mask skips masked tiles already
    if options.native_masks:  # a pure static mask: blocks where its native form changes
        blocks = split.by_structure(mod, shape.sq, shape.skv, options.split_blocks)
        if blocks is not None:
            return blocks
    blocks = split.plan(expr, shape.sq, shape.skv, options.split_blocks, shape.b * shape.hq,
                        decode.multiprocessors(options))
    if blocks is not None and options.native_masks:
        blocks = split.merged(mod, blocks)
    return blocks


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    """How one load of the canonical IR becomes an input tensor."""

    node: Node
    spec: cg.TensorSpec
    operand: str | None  # direct: the operand read; None: materialized


class Part:
    """The graphs of one block of a plan (of the whole call when unsplit)."""

    def __init__(self, mod, shape: Problem, scale, options: LoweringOptions, rows=(None, None)):
        # The expression only: operand values (maybe tracers) never enter static data.
        self.mod = None if mod is None else ScoreMod(mod.expr)
        self.shape = shape
        graph_scale = scale  # cuDNN's attn_scale
        self.band = native_band(mod, shape, options)
        if mod is None or self.band is not None:  # plain attention, maybe under a native mask
            self.fwd = self.bwd = None
            self.consts, self.fwd_consts, self.loads, self.fwd_loads = (), (), (), ()
        else:
            expr = _guard_padding(mod.expr, shape.sq, shape.skv, float("-inf"))
            # A constant factor on every use of the score joins attn_scale. Not
            # for a mod with its own derivative rules: canonical() keeps values
            # only, so folding would differentiate the bare values (softplus'(0)
            # came out 0 instead of 0.5 on the H200).
            if options.fold_scale and not rules.has_custom_derivatives(expr):
                expr, factor = rules.fold_scale(rules.canonical(expr))
                graph_scale = scale * factor
            self.fwd, self.bwd = rules.forward_and_backward(expr)
            self.bwd = _guard_padding(self.bwd, shape.sq, shape.skv, 0.0)
            # What the graphs read: constants and tensors on the emitted paths only
            # (a graph is given exactly the scalars it contains).
            fwd_nodes = cg.emission_order(self.fwd)
            nodes = list(dict.fromkeys(fwd_nodes + cg.emission_order(self.bwd)))
            self.consts = tuple(n for n in nodes if n.op == CONST)
            self.fwd_consts = tuple(n for n in fwd_nodes if n.op == CONST)
            self.loads = tuple(self._plan_load(n, i) for i, n in enumerate(
                x for x in nodes if x.op in INPUT_TENSORS))
            fwd_set = set(fwd_nodes)
            self.fwd_loads = tuple(l for l in self.loads if l.node in fwd_set)
        self.spec = cg.GraphSpec(shape, float(graph_scale), tuple(l.spec for l in self.loads),
                                 self.band, *rows, deterministic=options.deterministic)
        self.fwd_spec = dataclasses.replace(self.spec, loads=tuple(l.spec for l in self.fwd_loads),
                                            deterministic=False)
        # The lowered expression and the options too: folding or not, the same
        # mod never shares a graph.
        self.key = (mod.key if mod is not None else None, self.fwd, self.spec, options)

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, Part) and other.key == self.key

    def describe(self):
        if self.band is not None:
            return f"score_mod `{self.mod}` as cuDNN's native mask {self.band}"
        return f"score_mod `{self.mod}`" if self.mod is not None else "plain attention"

    def _plan_load(self, node, i):
        uid = cg.UID_LOADS + i
        if node.op == MATERIALIZE:
            return self._plan_materialized(node, uid)
        name, shape, dtype = node.args[0].attr
        idx = node.args[1:]
        if dtype not in ("float16", "bfloat16", "float32"):  # ints travel as int32, or as
            dtype = "float32" if node.dtype == F32 else "int32"  # floats when lifted
        direct = all(a.op in (VAR, CONST) for a in idx) and len(
            {a for a in idx if a.op == VAR}) == sum(a.op == VAR for a in idx)
        dims, strides = [1, 1, 1, 1], [1, 1, 1, 1]
        if direct:
            kept = [(a, n) for a, n in zip(idx, shape) if a.op == VAR]
            sizes = [1 if n == 1 else self.shape.extent(a.attr) for a, n in kept]
            stride = 1
            for (a, _), size in reversed(list(zip(kept, sizes))):
                dims[AXIS[a.attr]] = size
                strides[AXIS[a.attr]] = stride
                stride *= size
            if _varies_along_kv_only(dims):
                return self._plan_materialized(node, uid)
            return LoadPlan(node, cg.TensorSpec(uid, tuple(dims), tuple(strides), dtype), name)
        return self._plan_materialized(node, uid)

    def _plan_materialized(self, node, uid):
        dims, strides = [1, 1, 1, 1], [1, 1, 1, 1]
        used = ir.variables(node)
        for v in AXES:
            if v in used:
                dims[AXIS[v]] = self.shape.extent(v)
        if _varies_along_kv_only(dims):
            dims[AXIS["q_idx"]] = self.shape.sq
        stride = 1
        for ax in (3, 2, 1, 0):
            strides[ax] = stride
            stride *= dims[ax]
        dtype = "float32" if node.dtype == F32 else "int32"
        return LoadPlan(node, cg.TensorSpec(uid, tuple(dims), tuple(strides), dtype), None)

    # --- graphs
    def forward_graph(self, sink=False):
        """The built forward graph (cached per mod, spec, options, GPU and cuDNN);
        with ``sink``, the one that joins a sink per head (``GraphSpec.sink``)."""
        spec = dataclasses.replace(self.fwd_spec, sink=True) if sink else self.fwd_spec
        return cg.cached(("forward",) + self._graph_key() + (("sink",) if sink else ()),
                         lambda: cg.build_forward(self.fwd, spec, self.fwd_consts,
                                                  [l.node for l in self.fwd_loads],
                                                  self.describe))

    def backward_graph(self, sink=False):
        """The built backward graph; with ``sink``, the one that takes the sink per
        head and writes its gradient (``GraphSpec.sink``)."""
        spec = dataclasses.replace(self.spec, sink=True) if sink else self.spec
        return cg.cached(("backward",) + self._graph_key() + (("sink",) if sink else ()),
                         lambda: cg.build_backward(self.fwd, self.bwd, spec, self.consts,
                                                   [l.node for l in self.loads],
                                                   self.describe))

    def _graph_key(self):
        # Versions read without importing the frontend: a warm process whose
        # graphs all come from the on-disk plan cache never imports it.
        return self.key + (device.current().family, cg.backend_version(), cg.frontend_version())

    # --- inputs
    def load_arrays(self, operands, forward=False):
        """The input tensors of the forward (``forward=True``) or backward graph."""
        if self.mod is None:
            return []
        values = dict(zip(self.mod.operand_names, operands))
        return [self._load_array(plan, values)
                for plan in (self.fwd_loads if forward else self.loads)]

    def _load_array(self, plan, values):
        node, spec = plan.node, plan.spec
        if plan.operand is not None:
            x = jnp.asarray(values[plan.operand])
            for axis in range(len(node.args) - 2, -1, -1):  # take const indices, last axis first
                a = node.args[1 + axis]
                if a.op == CONST:
                    x = jnp.take(x, min(max(a.attr, 0), x.shape[axis] - 1), axis=axis)
            kept = [a for a in node.args[1:] if a.op == VAR]
            for axis, a in enumerate(kept):
                want = spec.dims[AXIS[a.attr]]
                if x.shape[axis] != want:
                    x = jax.lax.slice_in_dim(x, 0, want, axis=axis)
            return x.astype(spec.dtype)
        grids = {
            v: jnp.arange(spec.dims[ax], dtype=jnp.int32).reshape(
                [-1 if i == ax else 1 for i in range(4)])
            for v, ax in AXIS.items()
        }
        expr = node.args[0] if node.op == MATERIALIZE else node
        out = evaluate(expr, grids, values)
        return jnp.broadcast_to(out, spec.dims).astype(spec.dtype)


class Plan:
    """A fused call: its blocks and the :class:`Part` running each (hashable,
    static: the fused call's nondiff argument)."""

    def __init__(self, mod, shape: Problem, scale, options: LoweringOptions, key_split=None):
        self.mod = None if mod is None else ScoreMod(mod.expr)
        self.scale = float(scale)  # the caller's: the reference fallback uses it
        self.shape, self.options = shape, options
        # key_split: the blocks split the keys, and their rows join by their LSEs
        # (else they split the queries: each row in one block)
        keyed = key_split if key_split is not None else key_blocks(mod, shape, options)
        blocks = None if key_split is not None else split_blocks(mod, shape, options)
        self.key_split = keyed is not None and blocks is None
        if self.key_split:
            blocks = keyed
        self.split = blocks is not None
        if not self.split:
            self.blocks = (split.Block(0, shape.sq, 0, shape.skv),)
            self.parts = (Part(mod, shape, scale, options),)
        else:
            self.blocks = tuple(blocks)
            self.parts = tuple(
                Part(m, shape.rows(blk.q1 - blk.q0, blk.k1 - blk.k0), scale, options,
                     rows=(shape.sq, shape.skv))
                for blk, m in zip(self.blocks, split.block_mods(mod, self.blocks,
                                                                options.native_masks)))
        # The backward's plan: key blocks where the mask has them, even under a forward
        # of query blocks (measured on the H200, prefix-LM at 4096: the query blocks'
        # forward 0.54 ms against the key blocks' 0.64, whose join costs a pass over
        # O; the key blocks' fwd+bwd 2.45 ms against 3.06: the query blocks' bottom-
        # right causal block's backward visits its masked tiles); else this plan.
        self.backward_plan = self
        if keyed is not None and not self.key_split:
            self.backward_plan = Plan(mod, shape, scale, options, key_split=keyed)
        self.key = (mod.key if mod is not None else None, self.blocks,
                    tuple(p.key for p in self.parts),
                    None if self.backward_plan is self else self.backward_plan.key)

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, Plan) and other.key == self.key

    def describe(self):
        if self.key_split:
            return (f"score_mod `{self.mod}` in {len(self.blocks)} key blocks, each as plain "
                    "attention or under cuDNN's native mask, their rows joined by their LSEs")
        backward = ("" if self.backward_plan is self else
                    f"; the backward in {len(self.backward_plan.blocks)} key blocks")
        if self.split:
            native = sum(p.fwd is None for p in self.parts)
            return (f"score_mod `{self.mod}` in {len(self.blocks)} query blocks"
                    + (f", {native} of them as plain attention or under cuDNN's native mask"
                       if native else "") + backward)
        return self.parts[0].describe() + backward

    def offsets(self, blk):
        """Byte offsets of the block's first row in q (dQ), k, v, O (dO) and the stats;
        () for an unsplit call, whose graphs read whole arrays."""
        if not self.split:
            return ()
        s = self.shape
        n = np.dtype(s.dtype).itemsize
        return (blk.q0 * s.hq * s.d * n, blk.k0 * s.hkv * s.d * n, blk.k0 * s.hkv * s.dv * n,
                blk.q0 * s.hq * s.dv * n, blk.q0 * 4)


@functools.lru_cache(maxsize=1024)
def _cached_plan(mod, shape, scale, options):
    return Plan(mod, shape, scale, options)


def plan_for(mod, shape: Problem, scale: float, options: LoweringOptions) -> Plan:
    """The plan of a call (cached by the mod's expression, shape, scale and
    options, with the device's SM count resolved into the options)."""
    if options.sms is None:
        options = options.replace(sms=decode.multiprocessors(options))
    return _cached_plan(None if mod is None else ScoreMod(mod.expr), shape, float(scale), options)
