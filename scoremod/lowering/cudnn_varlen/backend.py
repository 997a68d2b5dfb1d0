"""Packed documents on cuDNN's variable-length attention, as a backend.

A segment mask (``lowering/segments.py``) on the plain score is attention
over the runs of equal ids of each row. This backend computes the runs with
XLA inside the program, runs every run as one ragged sequence of cuDNN's
SDPA (which computes only each document's own tiles), and decides at run
time, inside the program, whether that is exact for the ids it was given:

- every non-pad id forms one run and no row has more than
  ``LoweringOptions.max_segments`` runs: the ragged graphs (checked cheaply
  for ids that increase along the row; for self-attention, runs in another
  order are recognized by a second, sort-based check);
- otherwise: the same mod on the fused cuDNN path's dense route (the mask
  computed per tile), so no input gives a wrong result.

The choice is a ``lax.cond`` in the forward (two nested ones when the first
check says no) and the same one, recomputed from the ids, in the backward;
where the ids are constants of the traced program (arrays the mod closes
over, outside any transformation that traces them) it is made once, when
the call is traced, and the program holds one route only; on the ragged
route the sequences' offsets are computed then too, and the program reads
them as constants (no XLA work per call besides the kernels).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from scoremod import kernels_ffi
from scoremod.dsl.scoremod import ScoreMod
from scoremod.errors import CudnnUnavailableError
from scoremod.lowering import segments as seg
from scoremod.lowering.backend import Backend
from scoremod.lowering.cudnn import graph as cg
from scoremod.lowering.cudnn.backend import CUDNN
from scoremod.lowering.cudnn_varlen import layout as lay
from scoremod.lowering.cudnn_varlen.graph import RaggedSpec, build_backward, build_forward
from scoremod.lowering.problem import Problem
from scoremod.options import LoweringOptions

INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True, eq=False)
class KnownLayout:
    """The sequences of ids known when the call was traced, as NumPy arrays;
    equal (and hashed) by their bytes, so plans of other ids differ."""

    ragged: tuple  # lay.Ragged's arrays
    covered_q: object  # [B, Sq] bool, or None

    @functools.cached_property
    def _key(self):
        arrays = self.ragged + (() if self.covered_q is None else (self.covered_q,))
        return tuple((a.dtype.str, a.shape, a.tobytes()) for a in arrays)

    def __eq__(self, other):
        return isinstance(other, KnownLayout) and self._key == other._key

    def __hash__(self):
        return hash(self._key)


@dataclasses.dataclass(frozen=True)
class VarlenPlan:
    """The static part of a call: the mod, its segments (None: the varlen route
    is switched off and the dense route runs alone), and the dense plan."""

    mod: ScoreMod
    shape: Problem
    scale: float
    segments: seg.Segments | None
    max_segments: int
    dense: object  # the fused cuDNN path's plan of the same call
    # "ragged" or "dense" when the ids were known when the call was traced (arrays
    # the mod closes over): decided then, no cond; None: decided per call.
    route: str | None = None
    # With route "ragged": the sequences of those ids, computed when traced, so the
    # program only reads them (no XLA work per call). None: computed in the program.
    known: "KnownLayout | None" = None
    deterministic: bool = False  # LoweringOptions.deterministic: a repeatable backward graph

    @property
    def spec(self) -> RaggedSpec:
        s = self.segments
        return RaggedSpec(self.shape, self.shape.b * self.max_segments, self.scale, s.causal,
                          s.window, self.deterministic)

    def describe(self):
        if self.segments is None or self.route == "dense":
            return self.dense.describe()
        return (f"score_mod `{self.mod}` as ragged sequences (at most {self.max_segments} "
                "per row) on cuDNN's variable-length attention")

    def layout(self, operands) -> lay.Layout:
        """The call's sequences and the run-time check, from the mod's operand values."""
        s = self.shape
        named = dict(zip(self.mod.operand_names, operands))
        return lay.compute(self.segments, named, s.b, s.sq, s.skv, self.max_segments)

    def ragged_inputs(self, layout: lay.Layout) -> list:
        """What the ragged graphs read besides q, k, v (O, dO, stats), in their uid order
        (``graph.RAGGED_UIDS``): the ragged offsets per layout, then the lengths."""
        s = self.shape
        return list(lay.ragged(layout, s.b, s.sq, s.skv, s.hq, s.hkv, s.d, s.dv))

    def sequences(self, operands):
        """(ragged inputs, covered query tokens or None) of this call: the ones
        computed when traced if the ids were known then, else computed now."""
        if self.known is not None:
            return [jnp.asarray(a) for a in self.known.ragged], (
                None if self.known.covered_q is None else jnp.asarray(self.known.covered_q))
        layout = self.layout(operands)
        return self.ragged_inputs(layout), layout.covered_q

    def forward_graph(self):
        spec = dataclasses.replace(self.spec, deterministic=False)  # a backward-only choice
        return cg.cached(("varlen-forward", spec), lambda: build_forward(spec, self.describe))

    def backward_graph(self):
        return cg.cached(("varlen-backward", self.spec),
                         lambda: build_backward(self.spec, self.describe))


class CudnnVarlen(Backend):
    name = "cudnn-varlen"
    # Its plans close over the ragged offsets of ids known at trace time, which
    # custom_partitioning cannot take: under a mesh, XLA gathers its inputs.
    partitioned = False
    specialized = True
    title = "cuDNN's variable-length attention"
    repeatable_backward = True  # under LoweringOptions.deterministic, as the cuDNN path's
    error = CudnnUnavailableError
    hint = "Use implementation=\"cudnn\" or \"xla\", or implementation=None to choose automatically."

    def present(self):
        return CUDNN.present()

    def why_not(self, problem, mod, automatic, options=None):
        if mod is None:
            return "there is no mod (plain attention is the fused cuDNN path's)"
        found = seg.recognize(mod.expr, problem)
        if isinstance(found, str):
            return found
        s = problem
        if max(s.b * s.sq * s.hq, s.b * s.skv * s.hkv) * max(s.d, s.dv) > INT32_MAX:
            return "the ragged offsets of this call would not fit in int32"
        # The dense route (ids that are not increasing runs) is the fused cuDNN
        # path's, which also answers for the GPU, the extension and the frontend.
        return CUDNN.why_not(problem, mod, automatic, options)

    def plan(self, problem, mod, scale, options, return_lse):
        plan = plan_for(mod, problem, scale, options)
        values = mod.operands
        if plan.segments is None or any(v is None or isinstance(v, jax.core.Tracer) for v in values):
            return plan
        # The ids are constants of the program being traced: decide the route now.
        with jax.ensure_compile_time_eval():  # computed now, even inside a jit trace
            known = tuple(jnp.asarray(v) for v in values)
            layout = plan.layout(known)
            ragged = bool(layout.ok) or (plan.segments.self_attention and bool(
                lay.runs_are_documents(plan.segments, dict(zip(plan.mod.operand_names, known)),
                                       problem.b, problem.sq, plan.max_segments)))
            if not ragged:
                return dataclasses.replace(plan, route="dense")
            fixed = KnownLayout(tuple(np.asarray(a) for a in plan.ragged_inputs(layout)),
                                None if layout.covered_q is None else np.asarray(layout.covered_q))
        return dataclasses.replace(plan, route="ragged", known=fixed)

    def forward(self, plan, q, k, v, operands):
        if plan.segments is None:
            return CUDNN.forward(plan.dense, q, k, v, operands)
        if plan.known is not None:
            return _forward(plan, q, k, v, *plan.sequences(operands))
        layout = plan.layout(operands)
        return _choose(plan, layout, operands,
                       lambda: _forward(plan, q, k, v, plan.ragged_inputs(layout), layout.covered_q),
                       lambda: CUDNN.forward(plan.dense, q, k, v, operands))

    def backward(self, plan, q, k, v, o, lse, do, operands, dlse=None, wanted=()):
        if dlse is not None:
            raise self.no_lse_cotangent()
        if plan.segments is None:
            return CUDNN.backward(plan.dense, q, k, v, o, lse, do, operands)
        if plan.known is not None:
            return (*_backward(plan, q, k, v, o, lse, do, plan.sequences(operands)[0]), {})
        layout = plan.layout(operands)
        dense = lambda: CUDNN.backward(plan.dense, q, k, v, o, lse, do, operands)[:3]  # noqa: E731
        return (*_choose(plan, layout, operands,
                         lambda: _backward(plan, q, k, v, o, lse, do, plan.ragged_inputs(layout)),
                         dense), {})


def _choose(plan, layout, operands, ragged, dense):
    """The ragged route where it is exact for these ids, else the dense one (decided
    in the program: increasing runs first, a sort-based check only when they are not)."""
    # Both routes as tuples: lax.cond wants branches of one structure, and the
    # dense backend returns a list (on the H200 every cond-routed call failed).
    ragged_route, dense_route = ragged, dense
    ragged = lambda: tuple(ragged_route())  # noqa: E731
    dense = lambda: tuple(dense_route())  # noqa: E731
    if plan.route is not None:
        return ragged() if plan.route == "ragged" else dense()
    other = dense
    if plan.segments.self_attention:
        s = plan.shape

        def other():
            named = dict(zip(plan.mod.operand_names, operands))
            runs = lay.runs_are_documents(plan.segments, named, s.b, s.sq, plan.max_segments)
            return jax.lax.cond(runs, ragged, dense)
    return jax.lax.cond(layout.ok, ragged, other)


def _forward(plan, q, k, v, ragged, covered_q):
    s = plan.shape
    out = [jax.ShapeDtypeStruct(q.shape[:3] + (s.dv,), q.dtype),
           jax.ShapeDtypeStruct((s.b, s.sq, s.hq), jnp.float32)]  # token-major stats
    carried = (jnp.zeros(out[0].shape, out[0].dtype),) if plan.segments.pads_tokens else ()
    o, stats = _call(plan.forward_graph(), [q, k, v, *ragged], out, carried)
    lse = jnp.swapaxes(stats, 1, 2)
    if covered_q is not None:  # tokens of no sequence: fully masked rows
        lse = jnp.where(covered_q[:, None, :], lse, -jnp.inf)
    return o, lse


def _backward(plan, q, k, v, o, lse, do, ragged):
    out = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    # Rows and keys of no sequence are never written: they start (and stay) zero.
    carried = tuple(jnp.zeros(x.shape, x.dtype) for x in out) if plan.segments.pads_tokens else ()
    stats = jnp.swapaxes(lse, 1, 2)
    return tuple(_call(plan.backward_graph(), [q, k, v, o, do, stats, *ragged], out, carried))


def _call(built, inputs, out_shapes, carried):
    """Runs ``built``; ``carried`` arrays become the outputs of the same index
    (their bytes the graph does not write keep their values)."""
    n = len(inputs)
    return kernels_ffi.call(built.blob, built.graph_id, [*inputs, *carried], out_shapes,
                            built.in_uids + (-1,) * len(carried), built.out_uids,
                            built.scalar_uids, built.scalar_bits, built.workspace,
                            carry={n + i: i for i in range(len(carried))})


@functools.lru_cache(maxsize=1024)
def _cached_plan(mod, shape, scale, options, dense):
    found = seg.recognize(mod.expr, shape) if options.native_masks else None
    segments = found if isinstance(found, seg.Segments) else None
    return VarlenPlan(mod, shape, scale, segments, options.max_segments, dense,
                      deterministic=options.deterministic)


def plan_for(mod, shape: Problem, scale: float, options: LoweringOptions) -> VarlenPlan:
    """The plan of a call; ``native_masks=False`` keeps only the dense route."""
    dense = CUDNN.plan(shape, mod, scale, options, True)
    return _cached_plan(ScoreMod(mod.expr), shape, float(scale), options, dense)


CUDNN_VARLEN = CudnnVarlen()
