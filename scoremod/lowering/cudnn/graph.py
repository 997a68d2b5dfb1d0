"""IR -> cuDNN frontend SDPA graphs, forward and backward, built and serialized.

The forward graph is ``sdpa(q, k, v, score_mod=...)`` producing O and the
softmax statistics (LSE). The backward graph is ``sdpa_backward(...,
score_mod=..., score_mod_bprop=...)``: cuDNN re-runs score_mod on the
recomputed score, then calls score_mod_bprop with dP (the gradient with
respect to score_mod's output). Both callbacks are emitted from the IR by one
table (``table.TABLE``); the backward expression comes from ``dsl.grad`` and reuses
the tensors the score_mod call made (shared ``env``), so nothing in score_mod
dangles (the silent-dV rule).
"""

from __future__ import annotations

import dataclasses
import logging
import struct
import threading
import time

from scoremod import kernels_ffi
from scoremod.dsl import ir
from scoremod.dsl.ir import BOOL, F32, I32, Node
from scoremod.errors import ScoreModError, UnsupportedOpError
from scoremod.lowering.cudnn import frontend_release, plan_store
from scoremod.lowering.cudnn.rules import DP, SCORE
from scoremod.dsl.ir import CONST, VAR
from scoremod.lowering.cudnn.table import INPUT_TENSORS, TABLE
from scoremod.lowering.problem import AXIS, Problem

log = logging.getLogger("scoremod")

(UID_Q, UID_K, UID_V, UID_O, UID_STATS, UID_DO, UID_DQ, UID_DK, UID_DV, UID_SINK,
 UID_DSINK) = range(1, 12)
UID_LOADS, UID_SCALARS = 100, 1000

# Python engines that may claim an SDPA graph and drop score_mod (seed 003).
PYTHON_ENGINE_NAMES = ("sdpa_fwd", "sdpa_bwd", "sdpa_prefill", "sdpa_decode")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """A non-virtual tensor of the graph: cuDNN dims/strides in (b, h, q, kv) order."""

    uid: int
    dims: tuple
    strides: tuple
    dtype: str  # numpy dtype name


@dataclasses.dataclass(frozen=True)
class Built:
    """A serialized graph and what the FFI call needs to run it.

    The plan store checks a record it reads against these annotations (each int in
    signed 64 bits, as the FFI call takes them).
    """

    blob: bytes
    graph_id: int
    in_uids: tuple[int, ...]
    out_uids: tuple[int, ...]
    scalar_uids: tuple[int, ...]
    scalar_bits: tuple[int, ...]
    workspace: int
    plan: str
    seconds: float


def _cudnn():
    import cudnn

    return cudnn


def _dtype(name):
    cudnn = _cudnn()
    return {
        "float16": cudnn.data_type.HALF,
        "bfloat16": cudnn.data_type.BFLOAT16,
        "float32": cudnn.data_type.FLOAT,
        "int32": cudnn.data_type.INT32,
    }[name]


def _ir_dtype(t):
    cudnn = _cudnn()
    return {F32: cudnn.data_type.FLOAT, I32: cudnn.data_type.INT32, BOOL: cudnn.data_type.BOOLEAN}[t]


def bshd(b, s, h, d, rows=None):
    """cuDNN dims and strides of a [b, s, h, d] array, in (b, h, s, d) order;
    with ``rows``, of ``s`` rows inside a [b, rows, h, d] array."""
    return (b, h, s, d), ((rows or s) * h * d, d, h * d, 1)


def emission_order(root: Node) -> list:
    """Nodes to emit for ``root``, children first. A load is an input tensor, so
    its index expressions are NOT emitted: they would dangle in score_mod, and a
    dangling node makes cuDNN compute dV wrong without any error."""
    return ir.toposort(root, stop=lambda n: n.op in INPUT_TENSORS)


class Emitter:
    """Emits IR nodes into one score_mod / score_mod_bprop callback.

    ``env`` maps IR nodes to cuDNN tensors. The backward graph's two callbacks
    share it, so bprop reuses what score_mod computed.
    """

    def __init__(self, env, scalars, loads):
        self.env, self.scalars, self.loads = env, scalars, loads

    def emit(self, g, root: Node, anchor):
        for node in emission_order(root):
            if node in self.env:
                continue
            if node.op == CONST:
                self.env[node] = self.scalars[node]
            elif node.op == VAR:
                t = g.gen_index(input=anchor, axis=AXIS[node.attr])
                t.set_data_type(_ir_dtype(I32))
                self.env[node] = t
            elif node.op in INPUT_TENSORS:
                self.env[node] = self.loads[node]
            else:
                t = TABLE[node.op].emit(g, [self.env[a] for a in node.args])
                t.set_data_type(_ir_dtype(node.dtype))
                self.env[node] = t
        return self.env[root]


# --- graph construction ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GraphSpec:
    """Everything a graph depends on besides the mod (part of the cache key)."""

    shape: Problem  # the call's (or the block's) sizes and dtype
    scale: float
    loads: tuple  # TensorSpec per load, in order
    band: object = None  # masks.Band: cuDNN's native diagonal-band mask, or None
    # Rows of the arrays holding q (o, dO, dQ, stats) and k, v: a query block
    # reads and writes its rows in place (None: the arrays are exactly sq, skv).
    q_rows: int | None = None
    kv_rows: int | None = None
    # The backward's dQ accumulated in a fixed order (LoweringOptions.deterministic):
    # bitwise repeatable at 1.04-1.08x the default backward (measured on the H200,
    # benchmarks/probes/cudnn_deterministic.py).
    deterministic: bool = False
    # The forward joins one sink logit per query head into its softmax (sink_token,
    # float32 [1, hq, 1, 1]); its stats are then the LSE with the sink. Measured on
    # the H200 with cuDNN 9.19: taken with native masks and with a score_mod without
    # one, at no cost (benchmarks/probes/cudnn_sinks.py); refused at one query row.
    # The backward then takes the sink too and writes its gradient (dSink_token,
    # float32 [1, hq, 1, 1], summed over the batch and the graph's rows).
    sink: bool = False

    def stats_layout(self, packed=False):
        # cuDNN < 9.26 takes only a packed stats input in sdpa_backward.
        s = self.shape
        rows = s.sq if packed else (self.q_rows or s.sq)
        return (s.b, s.hq, s.sq, 1), (s.hq * rows, rows, 1, 1)


def _scalar_bits(node: Node) -> int:
    if node.dtype == F32:
        return struct.unpack("<i", struct.pack("<f", node.attr))[0]
    if node.dtype == I32:
        return int(node.attr)
    raise ScoreModError(f"internal: boolean constant {node} reached the cuDNN graph")


def _graph():
    cudnn = _cudnn()
    return cudnn.pygraph(
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
    )


def _io_tensor(g, name, uid, dims, strides, dtype):
    t = g.tensor(name=name, dim=list(dims), stride=list(strides), data_type=_dtype(dtype))
    t.set_uid(uid)
    return t


def _common_inputs(g, p: GraphSpec, consts, load_nodes):
    q = _io_tensor(g, "q", UID_Q, *bshd(p.shape.b, p.shape.sq, p.shape.hq, p.shape.d, p.q_rows), p.shape.dtype)
    k = _io_tensor(g, "k", UID_K, *bshd(p.shape.b, p.shape.skv, p.shape.hkv, p.shape.d, p.kv_rows), p.shape.dtype)
    v = _io_tensor(g, "v", UID_V, *bshd(p.shape.b, p.shape.skv, p.shape.hkv, p.shape.dv, p.kv_rows), p.shape.dtype)
    scalars = {}
    for i, c in enumerate(consts):
        t = g.tensor(name=f"c{i}", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], is_pass_by_value=True,
                     data_type=_ir_dtype(c.dtype))
        t.set_uid(UID_SCALARS + i)
        scalars[c] = t
    loads = {}
    for node, spec in zip(load_nodes, p.loads):
        loads[node] = _io_tensor(g, f"load{spec.uid}", spec.uid, spec.dims, spec.strides, spec.dtype)
    return q, k, v, scalars, loads


def _mask_args(p: GraphSpec) -> dict:
    """sdpa / sdpa_backward arguments for the native mask (none: no mask)."""
    if p.band is None:
        return {"use_causal_mask": False}
    args = {"diagonal_alignment": getattr(_cudnn().diagonal_alignment, p.band.alignment),
            "diagonal_band_right_bound": p.band.right_bound}
    if p.band.left_bound is not None:
        args["diagonal_band_left_bound"] = p.band.left_bound
    return args


def _finalize(g, what, describe):
    """Plan and build; insist on a cuDNN backend engine (seed 003), then serialize."""
    cudnn = _cudnn()
    t0 = time.perf_counter()
    try:
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        # A python engine may take an SDPA graph and silently drop score_mod.
        g.deselect_engines(list(PYTHON_ENGINE_NAMES))
        g.check_support()
        g.build_plans(cudnn.build_plan_policy.HEURISTICS_CHOICE)
    except Exception as e:  # cuDNN's refusal, with the mod spelled out
        raise UnsupportedOpError(
            f"cuDNN refused the {what} graph for {describe()}: {str(e).strip()[:600]}. "
            "Use implementation=\"xla\" for this mod."
        ) from e
    engine = g.selected_engine
    if engine is not None:
        raise ScoreModError(
            f"cuDNN chose the python engine {getattr(engine, 'name', engine)!r} for the {what} "
            "graph even with python engines excluded; such engines can drop score_mod "
            "silently, so scoremod refuses to run it. Use implementation=\"xla\"."
        )
    try:
        plan = g.get_plan_name_at_index(0)
    except Exception:  # naming the plan is a courtesy
        plan = "?"
    blob = bytes(g.serialize(as_bytes=True))
    graph_id = kernels_ffi.hash_graph(blob)
    return blob, graph_id, int(g.get_workspace_size()), plan, time.perf_counter() - t0


def build_forward(fwd: Node, p: GraphSpec, consts, load_nodes, describe) -> Built:
    g = _graph()
    q, k, v, scalars, loads = _common_inputs(g, p, consts, load_nodes)
    em = Emitter({}, scalars, loads)

    def score_mod(gg, score):
        em.env[SCORE] = score
        return _fresh(gg, em.emit(gg, fwd, score), score)

    extra = {}
    if p.sink:
        extra["sink_token"] = _io_tensor(g, "sink", UID_SINK, (1, p.shape.hq, 1, 1),
                                         (p.shape.hq, 1, 1, 1), "float32")
    o, stats = g.sdpa(name="sdpa", q=q, k=k, v=v, attn_scale=p.scale, generate_stats=True,
                      score_mod=score_mod if fwd is not None else None, **_mask_args(p),
                      **extra)
    dims, strides = bshd(p.shape.b, p.shape.sq, p.shape.hq, p.shape.dv, p.q_rows)
    o.set_output(True).set_dim(list(dims)).set_stride(list(strides)).set_data_type(_dtype(p.shape.dtype))
    o.set_uid(UID_O)
    stats.set_output(True).set_data_type(_dtype("float32"))
    dims, strides = p.stats_layout()
    stats.set_dim(list(dims)).set_stride(list(strides))
    stats.set_uid(UID_STATS)
    with frontend_release.releasing(g, em.env):  # nothing of the frontend outlives the build
        blob, gid, ws, plan, secs = _finalize(g, "forward", describe)
    ins = (UID_Q, UID_K, UID_V) + tuple(s.uid for s in p.loads) + ((UID_SINK,) if p.sink else ())
    return Built(blob, gid, ins, (UID_O, UID_STATS), tuple(UID_SCALARS + i for i in range(len(consts))),
                 tuple(_scalar_bits(c) for c in consts), ws, plan, secs)


def build_backward(fwd: Node, bwd: Node, p: GraphSpec, consts, load_nodes, describe) -> Built:
    g = _graph()
    q, k, v, scalars, loads = _common_inputs(g, p, consts, load_nodes)
    o = _io_tensor(g, "o", UID_O, *bshd(p.shape.b, p.shape.sq, p.shape.hq, p.shape.dv, p.q_rows), p.shape.dtype)
    do = _io_tensor(g, "dO", UID_DO, *bshd(p.shape.b, p.shape.sq, p.shape.hq, p.shape.dv, p.q_rows), p.shape.dtype)
    stats = _io_tensor(g, "stats", UID_STATS, *p.stats_layout(packed=True), "float32")
    em = Emitter({}, scalars, loads)

    def score_mod(gg, score):
        em.env[SCORE] = score
        return _fresh(gg, em.emit(gg, fwd, score), score)

    def score_mod_bprop(gg, dp):
        em.env[DP] = dp
        return _fresh(gg, em.emit(gg, bwd, dp), dp)

    mods = {} if fwd is None else {"score_mod": score_mod, "score_mod_bprop": score_mod_bprop}
    if p.sink:
        sink_dims = ((1, p.shape.hq, 1, 1), (p.shape.hq, 1, 1, 1), "float32")
        mods["sink_token"] = _io_tensor(g, "sink", UID_SINK, *sink_dims)
        mods["dSink_token"] = _io_tensor(g, "dsink", UID_DSINK, *sink_dims)
    dq, dk, dv = g.sdpa_backward(name="sdpa_backward", q=q, k=k, v=v, o=o, dO=do, stats=stats,
                                 attn_scale=p.scale, use_deterministic_algorithm=p.deterministic,
                                 **_mask_args(p), **mods)
    # dQ lands in its rows of the full array; a block's dK, dV are its own
    # arrays (blocks overlap in keys, so they are summed afterwards).
    for t, uid, (b, s, h, d, rows) in ((dq, UID_DQ, (p.shape.b, p.shape.sq, p.shape.hq, p.shape.d, p.q_rows)),
                                       (dk, UID_DK, (p.shape.b, p.shape.skv, p.shape.hkv, p.shape.d, None)),
                                       (dv, UID_DV, (p.shape.b, p.shape.skv, p.shape.hkv, p.shape.dv, None))):
        dims, strides = bshd(b, s, h, d, rows)
        t.set_output(True).set_dim(list(dims)).set_stride(list(strides))
        t.set_data_type(_dtype(p.shape.dtype))
        t.set_uid(uid)
    with frontend_release.releasing(g, em.env):  # nothing of the frontend outlives the build
        blob, gid, ws, plan, secs = _finalize(g, "backward", describe)
    ins = ((UID_Q, UID_K, UID_V, UID_O, UID_DO, UID_STATS) + tuple(s.uid for s in p.loads)
           + ((UID_SINK,) if p.sink else ()))
    return Built(blob, gid, ins, (UID_DQ, UID_DK, UID_DV) + ((UID_DSINK,) if p.sink else ()),
                 tuple(UID_SCALARS + i for i in range(len(consts))),
                 tuple(_scalar_bits(c) for c in consts), ws, plan, secs)


def _fresh(g, out, given):
    """cuDNN wants a callback to return a node, not its own input back."""
    if out is not given:
        return out
    t = g.identity(input=given)
    t.set_data_type(_ir_dtype(F32))
    return t


def frontend_version() -> int:
    """The cuDNN frontend Python package's version (from its metadata until imported)."""
    installed = kernels_ffi.installed_frontend_version()
    return installed if installed is not None else kernels_ffi.encode_version(_cudnn().__version__)


def backend_version() -> int:
    """The cuDNN library of this process (the one the FFI handler runs graphs with)."""
    return plan_store.loaded_cudnn_version()


# --- cache -------------------------------------------------------------------

_lock = threading.Lock()
_cache: dict = {}
_building: dict = {}  # key -> the lock held while one thread builds that graph
_stats = {"hits": 0, "misses": 0, "builds": 0, "build_seconds": 0.0}


def cached(key, build):
    """Return the cached graph for ``key``, building it once (threads tracing
    the same call at once, one per device say, wait for one build)."""
    with _lock:
        hit = _cache.get(key)
        if hit is not None:
            _stats["hits"] += 1
            return hit
        gate = _building.setdefault(key, threading.Lock())
    with gate:  # one build per key: threads tracing the same call wait for it
        with _lock:
            hit = _cache.get(key)
            if hit is not None:
                _stats["hits"] += 1
                return hit
            _stats["misses"] += 1
        try:
            built = plan_store.fetch(key, Built)  # a graph an earlier process built (warm start)
            fresh = built is None
            if fresh:
                built = build()
                plan_store.store(key, built)
        except BaseException:
            with _lock:
                _building.pop(key, None)
            raise
        with _lock:
            _cache[key] = built
            _building.pop(key, None)
            if fresh:
                _stats["builds"] += 1
                _stats["build_seconds"] += built.seconds
                log.info("built cuDNN %s graph in %.2f s (plan %s)", key[0], built.seconds,
                         built.plan)
            return built


def cache_info() -> dict:
    """Graph cache counters: hits, misses, builds, build_seconds, size, and the
    on-disk plan cache's disk_hits, disk_misses, disk_writes, disk_rejected.

    Every distinct (mod, shapes, dtype, scale, GPU, cuDNN) builds a forward
    and a backward graph once, at trace time; later calls are hits. A graph
    an earlier process built is loaded from disk instead (a disk hit, no build).

        >>> import scoremod
        >>> sorted(scoremod.cache_info())  # doctest: +NORMALIZE_WHITESPACE
        ['build_seconds', 'builds', 'disk_hits', 'disk_misses', 'disk_rejected',
         'disk_writes', 'hits', 'misses', 'size']
    """
    with _lock:
        return dict(_stats, size=len(_cache), **plan_store.counters())


def cache_entries() -> dict:
    """A copy of the graph cache: ``{key: Built}``, where ``key[0]`` is "forward"
    or "backward" (for tools that time or inspect the built graphs)."""
    with _lock:
        return dict(_cache)


def cache_clear() -> None:
    with _lock:
        _cache.clear()
        for k in _stats:
            _stats[k] = 0 if k != "build_seconds" else 0.0
        plan_store.reset_counters()


# --- for the graphs of other backends (cudnn_varlen builds ragged SDPA graphs) ---
new_graph = _graph  # a pygraph with float32 intermediates and compute
dtype = _dtype  # numpy dtype name -> cuDNN data type
finalize = _finalize  # plan, build, refuse python engines, serialize


def alignment(name: str):
    """cuDNN's diagonal alignment named ``name`` ("TOP_LEFT" or "BOTTOM_RIGHT")."""
    return getattr(_cudnn().diagonal_alignment, name)
