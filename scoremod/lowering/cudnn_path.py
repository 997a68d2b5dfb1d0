"""The fused cuDNN path: IR -> cuDNN SDPA graphs run from JAX through XLA FFI.

``attention`` builds (once, at trace time, cached) a forward and a backward
cuDNN graph for the mod and the shapes, then calls them through the
``scoremod_cudnn_execute`` FFI target inside a ``jax.custom_vjp``. No
backward is written by hand: the backward score_mod is the IR's derivative.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from scoremod.dsl import ir
from scoremod.dsl.ir import F32, Node
from scoremod.errors import CudnnUnavailableError, ScoreModError
from scoremod.lowering import cudnn_graph as cg
from scoremod.dsl import ops
from scoremod.lowering import cudnn_rules, masks, split
from scoremod.lowering.reference import scores_and_lse_reference

# Architecture families (compute capability major) where score_mod graphs were
# validated. Families, never exact capabilities: sm_121 behaves as sm_120.
VALIDATED_FAMILIES = (9,)
KNOWN_FAMILIES = (9, 10, 12)
_FUSED_DTYPES = ("float16", "bfloat16")


def _gpu_family():
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return None
    if dev.platform != "gpu":
        return None
    cc = getattr(dev, "compute_capability", None)
    try:
        return int(str(cc).split(".")[0])
    except ValueError:
        return None


def why_not(query, key, value, mod) -> str | None:
    """Why the fused path cannot run this call, or None when it can.

    The mod and the inputs are judged first (pure IR and shape checks), so
    the answer is informative on a machine without a GPU too.
    """
    if mod is not None:
        try:
            cudnn_rules.check_supported(mod.expr, mod.sources)
        except ScoreModError as e:
            return str(e)
    dtype = np.dtype(query.dtype).name
    if dtype not in _FUSED_DTYPES:
        return f"the fused path takes float16 or bfloat16 inputs, got {dtype}"
    d, dv = query.shape[-1], value.shape[-1]
    if d % 8 or dv % 8 or d > 256 or dv > 256:
        return f"cuDNN needs head dims that are multiples of 8 and at most 256, got {d} and {dv}"
    family = _gpu_family()
    if family is None:
        return "no NVIDIA GPU is visible to JAX"
    if family not in KNOWN_FAMILIES:
        return f"score_mod graphs are not supported on compute capability family sm_{family}x"
    from scoremod import kernels_ffi

    if not kernels_ffi.available():
        return kernels_ffi.unavailable_reason()
    try:
        import cudnn  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the install
        return f"the cuDNN frontend Python package is not importable ({e}); pip install nvidia-cudnn-frontend"
    return None


def usable(query, key, value, mod) -> bool:
    """Whether ``implementation=None`` takes the fused path for this call."""
    return why_not(query, key, value, mod) is None and _gpu_family() in VALIDATED_FAMILIES


# --- the static description of one fused call --------------------------------

# Three lowerings that make common mods faster, each on by default and each
# switched off by an environment variable read at import (for comparison and
# as an escape hatch); all three passed their GPU tests (docs/validation.md).


def _switch(name, default, kind):
    text = os.environ.get(name, default)
    try:
        value = int(text)
        if value < 0 or (kind is bool and value > 1):
            raise ValueError
    except ValueError:
        wanted = "0 (off) or 1 (on)" if kind is bool else "a number of query blocks (0: off)"
        raise ValueError(f"environment variable {name}={text!r}: expected {wanted}") from None
    return kind(value)


# Pure band masks (causal, sliding window) run on cuDNN's native mask, which
# skips masked tiles (SCOREMOD_NATIVE_MASKS=0 keeps them as score_mod masks).
NATIVE_MASKS = _switch("SCOREMOD_NATIVE_MASKS", "1", bool)

# A constant factor of the score on every use (softcap's `score / 30`) joins
# cuDNN's attn_scale, where it costs nothing (``cudnn_rules.fold_scale``).
FOLD_SCALE = _switch("SCOREMOD_FOLD_SCALE", "1", bool)

# Band-masked mods with a modifier (softcap + causal) split into at most this
# many query blocks, each a fused call on the keys it can see (``split``, which
# picks the count); 0 or 1: one call. Measured at seq 4096 and 16384 (batch 4,
# 16 heads): 8 blocks beat 4 by 6-9% forward.
SPLIT_BLOCKS = _switch("SCOREMOD_SPLIT_BLOCKS", "8", int)

# Key tiles past the end of the sequence: cuDNN's backward pass evaluates
# score_mod on padding keys (kv_idx >= Skv) of the last tile and, in float16,
# P = exp(score - LSE) can overflow there when the mod grows with kv_idx
# (measured: `score + 0.25 * kv_idx` at Skv=192 gives NaN in dQ). Masking the
# padding inside the mod keeps those entries at zero.
_KV_TILE = 128


def _varies_along_kv_only(dims) -> bool:
    """Whether a tensor input spans kv_idx but not q_idx ([1,1,1,Skv], [B,1,1,Skv], ...).

    Measured on the H200 (cuDNN 9.19, float16, Skv=192): a score_mod adding a
    [1,1,1,Skv] tensor gave the right output and dQ, dK, dV all wrong (zero),
    while the same values as a [1,H,Sq,Skv] tensor were right. Such inputs are
    therefore materialized with the q_idx axis too, the layout the tests
    validate (it costs Sq x Skv memory per input).
    """
    return dims[cg._AXIS["kv_idx"]] > 1 and dims[cg._AXIS["q_idx"]] == 1


def _guard_kv_padding(expr: Node, skv: int) -> Node:
    if skv % _KV_TILE == 0:
        return expr
    inside = ops.apply("lt", ir.var("kv_idx"), ir.const(skv, ir.I32))
    return ops.apply("where", inside, expr, ir.const(float("-inf"), F32))


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    """How one load of the canonical IR becomes an input tensor."""

    node: Node
    spec: cg.TensorSpec
    operand: str | None  # direct: the operand read; None: materialized


class Static:
    """Hashable, static part of a fused call (custom_vjp nondiff argument)."""

    def __init__(self, mod, problem_shapes, dtype, scale, allow_fallback, rows=(None, None)):
        b, sq, skv, hq, hkv, d, dv = problem_shapes
        # The expression only: operand values (maybe tracers) never enter static data.
        self.mod = None if mod is None else type(mod)(mod.expr)
        self.allow_fallback = allow_fallback
        self.sizes = {"b": b, "h": hq, "q_idx": sq, "kv_idx": skv}
        self.scale = float(scale)  # the caller's: the reference fallback uses it
        graph_scale = scale  # cuDNN's attn_scale
        self.band = _native_band(mod, sq, skv)
        if mod is None or self.band is not None:  # plain attention, maybe under a native mask
            self.fwd = self.bwd = None
            self.consts, self.fwd_consts, self.loads, self.fwd_loads = (), (), (), ()
        else:
            expr = _guard_kv_padding(mod.expr, skv)
            if FOLD_SCALE:  # a constant factor on every use of the score joins attn_scale
                expr, factor = cudnn_rules.fold_scale(cudnn_rules.canonical(expr))
                graph_scale = scale * factor
            self.fwd, self.bwd = cudnn_rules.forward_and_backward(expr)
            # What the graphs read: constants and tensors on the emitted paths only
            # (a graph is given exactly the scalars it contains).
            fwd_nodes = cg.emission_order(self.fwd)
            nodes = list(dict.fromkeys(fwd_nodes + cg.emission_order(self.bwd)))
            self.consts = tuple(n for n in nodes if n.op == "const")
            self.fwd_consts = tuple(n for n in fwd_nodes if n.op == "const")
            self.loads = tuple(self._plan_load(n, i) for i, n in enumerate(
                x for x in nodes if x.op in ("load", "materialize")))
            fwd_set = set(fwd_nodes)
            self.fwd_loads = tuple(l for l in self.loads if l.node in fwd_set)
        self.problem = cg.Problem(b, sq, skv, hq, hkv, d, dv, dtype, float(graph_scale),
                                  tuple(l.spec for l in self.loads), self.band, *rows)
        self.fwd_problem = dataclasses.replace(self.problem,
                                               loads=tuple(l.spec for l in self.fwd_loads))
        # The lowered expression too: folding or not, the same mod never shares a graph.
        self.key = (mod.key if mod is not None else None, self.fwd, self.problem)

    def __hash__(self):
        return hash((self.key, self.allow_fallback))

    def __eq__(self, other):
        return (isinstance(other, Static) and other.key == self.key
                and other.allow_fallback == self.allow_fallback)

    def describe(self):
        if self.band is not None:
            return f"score_mod `{self.mod}` as cuDNN's native mask {self.band}"
        return f"score_mod `{self.mod}`" if self.mod is not None else "plain attention"

    def _plan_load(self, node, i):
        uid = cg.UID_LOADS + i
        if node.op == "materialize":
            return self._plan_materialized(node, uid)
        name, shape, dtype = node.args[0].attr
        idx = node.args[1:]
        if dtype not in ("float16", "bfloat16", "float32"):  # ints travel as int32, or as
            dtype = "float32" if node.dtype == F32 else "int32"  # floats when lifted
        direct = all(a.op in ("var", "const") for a in idx) and len(
            {a for a in idx if a.op == "var"}) == sum(a.op == "var" for a in idx)
        dims, strides = [1, 1, 1, 1], [1, 1, 1, 1]
        if direct:
            kept = [(a, n) for a, n in zip(idx, shape) if a.op == "var"]
            sizes = [1 if n == 1 else self.sizes[a.attr] for a, n in kept]
            stride = 1
            for (a, _), size in reversed(list(zip(kept, sizes))):
                dims[cg._AXIS[a.attr]] = size
                strides[cg._AXIS[a.attr]] = stride
                stride *= size
            if _varies_along_kv_only(dims):
                return self._plan_materialized(node, uid)
            return LoadPlan(node, cg.TensorSpec(uid, tuple(dims), tuple(strides), dtype), name)
        return self._plan_materialized(node, uid)

    def _plan_materialized(self, node, uid):
        dims, strides = [1, 1, 1, 1], [1, 1, 1, 1]
        used = {n.attr for n in ir.toposort(node) if n.op == "var"}
        for v in ("b", "h", "q_idx", "kv_idx"):
            if v in used:
                dims[cg._AXIS[v]] = self.sizes[v]
        if _varies_along_kv_only(dims):
            dims[cg._AXIS["q_idx"]] = self.sizes["q_idx"]
        stride = 1
        for ax in (3, 2, 1, 0):
            strides[ax] = stride
            stride *= dims[ax]
        dtype = "float32" if node.dtype == F32 else "int32"
        return LoadPlan(node, cg.TensorSpec(uid, tuple(dims), tuple(strides), dtype), None)

    # --- graphs
    def forward_graph(self):
        return cg.cached(("forward",) + self._graph_key(), lambda: cg.build_forward(
            self.fwd, self.fwd_problem, self.fwd_consts, [l.node for l in self.fwd_loads],
            self.describe))

    def backward_graph(self):
        return cg.cached(("backward",) + self._graph_key(), lambda: cg.build_backward(
            self.fwd, self.bwd, self.problem, self.consts, [l.node for l in self.loads],
            self.describe))

    def _graph_key(self):
        return self.key + (_gpu_family(), cg.backend_version(), cg.frontend_version())

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
                if a.op == "const":
                    x = jnp.take(x, min(max(a.attr, 0), x.shape[axis] - 1), axis=axis)
            kept = [a for a in node.args[1:] if a.op == "var"]
            for axis, a in enumerate(kept):
                want = spec.dims[cg._AXIS[a.attr]]
                if x.shape[axis] != want:
                    x = jax.lax.slice_in_dim(x, 0, want, axis=axis)
            return x.astype(spec.dtype)
        from scoremod.lowering.reference import evaluate

        grids = {
            v: jnp.arange(spec.dims[ax], dtype=jnp.int32).reshape(
                [-1 if i == ax else 1 for i in range(4)])
            for v, ax in cg._AXIS.items()
        }
        expr = node.args[0] if node.op == "materialize" else node
        out = evaluate(expr, grids, values)
        return jnp.broadcast_to(out, spec.dims).astype(spec.dtype)


class Split:
    """Static part of a query-block split (see ``split``): one ``Static`` per
    block, whose graphs read and write the block's rows of the full arrays in
    place (strides of the full arrays, byte offsets per call), so no slice of
    q, k, v, O or dQ is copied."""

    def __init__(self, mod, problem_shapes, dtype, scale, allow_fallback, blocks):
        b, sq, skv, hq, hkv, d, dv = problem_shapes
        self.mod = type(mod)(mod.expr)
        self.scale = float(scale)
        self.allow_fallback = allow_fallback
        self.shapes, self.blocks = problem_shapes, tuple(blocks)
        self.itemsize = np.dtype(dtype).itemsize
        uniform = split.shifted_indices(self.blocks)  # one graph structure for all blocks
        self.parts = tuple(
            Static(split.shifted(mod, blk.q0, blk.k0, uniform),
                   (b, blk.q1 - blk.q0, blk.k1 - blk.k0, hq, hkv, d, dv), dtype, scale,
                   allow_fallback, rows=(sq, skv))
            for blk in self.blocks)
        self.key = ("split", mod.key, self.blocks, tuple(p.key for p in self.parts))

    def __hash__(self):
        return hash((self.key, self.allow_fallback))

    def __eq__(self, other):
        return (isinstance(other, Split) and other.key == self.key
                and other.allow_fallback == self.allow_fallback)

    def describe(self):
        return f"score_mod `{self.mod}` in {len(self.blocks)} query blocks"

    def offsets(self, blk):
        """Byte offsets of the block's first row in q (dQ), k, v, O (dO) and the stats."""
        _, _, _, hq, hkv, d, dv = self.shapes
        n = self.itemsize
        return (blk.q0 * hq * d * n, blk.k0 * hkv * d * n, blk.k0 * hkv * dv * n,
                blk.q0 * hq * dv * n, blk.q0 * 4)


# --- the custom_vjp ------------------------------------------------------------


def _call(built, inputs, out_shapes, offsets=(), carried=()):
    """Runs ``built``; ``carried``: arrays appended to the inputs that become
    the outputs of the same index, updated in place (see ``kernels_ffi.call``)."""
    from scoremod import kernels_ffi

    n = len(inputs)
    carry = {n + i: i for i in range(len(carried))}
    if carried:
        offsets = offsets[:n] + (0,) * len(carried) + offsets[n:]
    return kernels_ffi.call(built.blob, built.graph_id, [*inputs, *carried], out_shapes,
                            built.in_uids + (-1,) * len(carried), built.out_uids,
                            built.scalar_uids, built.scalar_bits, built.workspace,
                            offsets=offsets, carry=carry)


def _forward(static, q, k, v, operands):
    if isinstance(static, Split):
        return _forward_split(static, q, k, v, operands)
    built = static.forward_graph()
    p = static.problem
    out_shapes = _forward_outputs(p.b, p.sq, p.hq, p.dv, q.dtype)
    o, stats = _call(built, [q, k, v, *static.load_arrays(operands, forward=True)], out_shapes)
    return o, stats[..., 0]


def _forward_outputs(b, sq, hq, dv, dtype):
    """Shapes of the forward graph's O [b, sq, hq, dv] and stats [b, hq, sq, 1]."""
    return [jax.ShapeDtypeStruct((b, sq, hq, dv), dtype),
            jax.ShapeDtypeStruct((b, hq, sq, 1), jnp.float32)]


def _forward_split(sp, q, k, v, operands):
    b, sq, _, hq, _, _, dv = sp.shapes
    out_shapes = _forward_outputs(b, sq, hq, dv, q.dtype)
    carried = ()  # the first block's call allocates O and the stats, later ones fill in
    for blk, part in zip(sp.blocks, sp.parts):
        loads = part.load_arrays(operands, forward=True)
        oq, ok, ov, oo, os_ = sp.offsets(blk)
        offsets = (oq, ok, ov) + (0,) * len(loads) + (oo, os_)
        carried = tuple(_call(part.forward_graph(), [q, k, v, *loads], out_shapes, offsets,
                              carried))
    o, stats = carried
    return o, stats[..., 0]


def _backward_split(sp, q, k, v, o, lse, do, operands):
    carried, dks, dvs = (), [], []  # dQ: the first block's call allocates it, later ones fill in
    for blk, part in zip(sp.blocks, sp.parts):
        loads = part.load_arrays(operands)
        oq, ok, ov, oo, _ = sp.offsets(blk)
        stats = lse[:, :, blk.q0:blk.q1, None]  # packed: see Problem.stats_layout
        n = blk.k1 - blk.k0
        out_shapes = [jax.ShapeDtypeStruct(q.shape, q.dtype),
                      jax.ShapeDtypeStruct(k.shape[:1] + (n,) + k.shape[2:], k.dtype),
                      jax.ShapeDtypeStruct(v.shape[:1] + (n,) + v.shape[2:], v.dtype)]
        offsets = (oq, ok, ov, oo, oo, 0) + (0,) * len(loads) + (oq, 0, 0)
        dq, dk, dv = _call(part.backward_graph(), [q, k, v, o, do, stats, *loads], out_shapes,
                           offsets, carried)
        carried = (dq,)
        dks.append(dk)
        dvs.append(dv)

    def summed(parts, like):  # blocks overlap in keys: add their gradients, in float32
        total = sum(jax.lax.pad(p.astype(jnp.float32), jnp.float32(0),
                                [(0, 0, 0), (blk.k0, like.shape[1] - blk.k1, 0), (0, 0, 0),
                                 (0, 0, 0)])
                    for p, blk in zip(parts, sp.blocks))
        return total.astype(like.dtype)

    return carried[0], summed(dks, k), summed(dvs, v)


def _backward(static, q, k, v, o, lse, do, operands):
    if isinstance(static, Split):
        return _backward_split(static, q, k, v, o, lse, do, operands)
    built = static.backward_graph()
    stats = lse[..., None]
    out_shapes = [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
                  jax.ShapeDtypeStruct(v.shape, v.dtype)]
    return _call(built, [q, k, v, o, do, stats, *static.load_arrays(operands)], out_shapes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(static, q, k, v, operands):
    return _forward(static, q, k, v, operands)


def _fused_fwd(static, q, k, v, operands):
    perturbed = [n for n, x in zip(_names(static), operands) if x.perturbed]
    vals = lambda x: x.value  # noqa: E731
    q, k, v = vals(q), vals(k), vals(v)
    operands = jax.tree.map(vals, operands, is_leaf=lambda x: hasattr(x, "perturbed"))
    if perturbed and static.allow_fallback:
        # implementation=None: the reference path computes what cuDNN cannot.
        warnings.warn(
            f"scoremod: gradients for score_mod operands {perturbed} need the reference path; "
            "implementation=None falls back to it for this call (O(S^2) memory).",
            stacklevel=4,
        )
        (o, lse), vjp = jax.vjp(
            lambda q, k, v, ops: scores_and_lse_reference(
                q, k, v, static.mod.bind(**dict(zip(_names(static), ops))),
                static.scale, True),
            q, k, v, operands)
        return (o, lse), {"reference_vjp": vjp}  # a dict marks the fallback residuals
    if perturbed:
        raise CudnnUnavailableError(
            f"gradients with respect to score_mod operands {perturbed} are not computed by the "
            "fused cuDNN path (cuDNN returns dQ, dK, dV only). Use implementation=\"xla\" to "
            "learn them, or wrap them in jax.lax.stop_gradient to keep them fixed."
        )
    o, lse = _forward(static, q, k, v, operands)
    return (o, lse), (q, k, v, o, lse, operands)


def _names(static):
    return static.mod.operand_names if static.mod is not None else ()


def _fused_bwd(static, res, cts):
    from jax.custom_derivatives import SymbolicZero

    if isinstance(res, dict):
        cts = tuple(jnp.zeros(c.shape, c.dtype) if isinstance(c, SymbolicZero) else c for c in cts)
        return res["reference_vjp"](cts)
    q, k, v, o, lse, operands = res
    do, dlse = cts
    if not isinstance(dlse, SymbolicZero):
        raise CudnnUnavailableError(
            "the fused cuDNN path cannot differentiate through the returned LSE; use "
            "implementation=\"xla\", or jax.lax.stop_gradient(lse)."
        )
    if isinstance(do, SymbolicZero):
        do = jnp.zeros(o.shape, o.dtype)
    dq, dk, dv = _backward(static, q, k, v, o, lse, do, operands)
    return dq, dk, dv, jax.tree.map(jnp.zeros_like, operands)


_fused.defvjp(_fused_fwd, _fused_bwd, symbolic_zeros=True)


def attention(query, key, value, mod, scale, return_lse, *, explicit=True):
    """The fused path; ``explicit`` is True when the user asked for it by name
    (otherwise ``usable`` has just said yes, so the checks are not repeated)."""
    reason = why_not(query, key, value, mod) if explicit else None
    if reason is not None:
        raise CudnnUnavailableError(
            f"implementation=\"cudnn\" cannot run this call: {reason}. "
            "Use implementation=\"xla\", or implementation=None to choose automatically."
        )
    shapes = query.shape[:1] + (query.shape[1], key.shape[1], query.shape[2], key.shape[2],
                                query.shape[3], value.shape[3])
    dtype = np.dtype(query.dtype).name
    blocks = _split_blocks(mod, query.shape[1], key.shape[1], query.shape[0] * query.shape[2])
    if blocks is not None:
        static = Split(mod, shapes, dtype, scale, not explicit, blocks)
    else:
        static = Static(mod, shapes, dtype, scale, allow_fallback=not explicit)
    operands = tuple(jnp.asarray(x) for x in mod.operands) if mod is not None else ()
    o, lse = _fused(static, query, key, value, operands)
    return (o, lse) if return_lse else o


def _split_blocks(mod, sq, skv, batch_heads):
    """Query blocks for a band-masked mod (see ``split``), or None for one call."""
    if mod is None or SPLIT_BLOCKS < 2:
        return None
    expr = cudnn_rules.canonical(mod.expr)
    if NATIVE_MASKS and masks.native_band(expr, sq, skv) is not None:
        return None  # a native mask skips masked tiles already
    return split.plan(expr, sq, skv, SPLIT_BLOCKS, batch_heads, _sm_count())


@functools.lru_cache(maxsize=None)
def _sm_count():
    """Streaming multiprocessors of the GPU the fused path runs on (``split.SMS`` elsewhere)."""
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return split.SMS
    count = getattr(dev, "core_count", None) if dev.platform == "gpu" else None
    return count if isinstance(count, int) and count > 0 else split.SMS


def _native_band(mod, sq, skv):
    """The native mask ``mod`` runs under at these sizes (when enabled), or None."""
    if mod is None or not NATIVE_MASKS:
        return None
    return masks.native_band(cudnn_rules.canonical(mod.expr), sq, skv)
