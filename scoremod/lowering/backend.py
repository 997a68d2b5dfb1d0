"""The interface every backend of ``scoremod.attention`` implements, and the
one pipeline that runs a routed call on any of them.

A backend is one object with a small protocol:

- ``why_not(problem, mod, automatic, options=None)``: why it cannot run this
  call under ``options`` (a LoweringOptions; None: the current ones), a
  sentence, or None. ``automatic`` is True when ``implementation=None``
  asks: a backend may then be stricter (cuDNN only volunteers on the GPU
  families it was validated on).
- ``claims(problem, mod, options, over)``: why it runs the call faster than
  ``over``, the earlier backend that takes it (a measured crossover,
  docs/performance.md), so that ``implementation=None`` picks it; None by
  default. It may weigh what ``over`` models of its own plan:
  ``tile_share`` (the share of score tiles its kernels compute) and
  ``static_tensor_ahead`` (a tensor of the whole [.., Sq, Skv] score matrix,
  of the positions alone, that XLA computes ahead of its kernels).
- ``plan(problem, mod, scale, options, return_lse)``: a hashable, static
  description of the call (everything but array values), with ``mod`` (the
  expression only) and ``scale`` attributes.
- ``forward(plan, q, k, v, operands)`` -> (O, LSE) and
  ``backward(plan, q, k, v, o, lse, do, operands, dlse=None, wanted=())``
  -> (dQ, dK, dV, {operand name: gradient}): ``dlse`` is the LSE's
  cotangent (None: zero; a backend that cannot take one raises its error)
  and ``wanted`` the names of the captured operands whose gradients are
  asked for (only a backend with ``operand_gradients`` is asked).

Class attributes say what it can do: ``differentiable`` (its forward is a
JAX function that JAX differentiates itself, forward mode and second order
included: the reference path; it is called directly), ``operand_gradients``
(its backward computes the mod's captured arrays' gradients),
``repeatable_backward`` (under ``LoweringOptions.deterministic`` its gradients
repeat bitwise), ``traced_scale``,
``partitioned`` (its calls take ``lowering.sharding``'s partitioning rule),
``materializes_scores`` (O(S^2) memory: the warnings say so) and ``specialized`` (it takes one kind of mod; its refusals of
others are not what a warning should give); ``present()`` says whether its
hardware is on this machine (passing over a present backend warns).

Every other backend runs through the same pipeline, :func:`execute`: a
``custom_jvp`` (see "The fused call and its derivatives" below) whose
reverse mode is the backend's backward, around ``lowering.sharding``
(partitioning, vmap folding), whose per-device call applies the masked-key
rule for non-finite V (``lowering.nonfinite``) when asked for: a backend's
kernel need not. Where the user allowed fallbacks (``implementation=None``),
what the backend cannot do runs on the next registered backend that can and
takes the call: operand gradients, the backward of a call that asks for
repeatable gradients (``LoweringOptions.deterministic``) from a backend
whose backward is not, and a call refused only when built on the first with
``operand_gradients`` (the Pallas kernels on a GPU, else the reference
path); forward-mode and second-order derivatives on the first that is
``differentiable`` (the reference path); by name, each is a ScoreModError.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import numpy as np
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from scoremod.errors import CudnnUnavailableError, ScoreModError, UnsupportedOpError
from scoremod.lowering import sharding
from scoremod.lowering import sinks as attention_sinks
from scoremod.lowering.problem import Problem


class Backend:
    """Base of the backends: see the module docstring for the protocol."""

    name: str = ""
    title: str = ""  # how messages name it, e.g. "the fused cuDNN path"
    differentiable: bool = False  # JAX differentiates forward() itself (any order, any mode)
    operand_gradients: bool = False  # its backward computes the mod's captured operands' gradients
    # Under LoweringOptions.deterministic its gradients repeat bitwise from run to run
    # (no atomics, or an order that never changes); that option runs the others'
    # backward elsewhere.
    repeatable_backward: bool = False
    traced_scale: bool = False  # takes a scale that is a traced value (else it is compiled in)
    partitioned: bool = True  # its calls take lowering.sharding's partitioning rule
    materializes_scores: bool = False  # holds [B, H, Sq, Skv] scores: O(S^2) memory
    # Takes one kind of mod only (segment masks): its refusal of another says
    # nothing useful, so a fallback's warning gives the next backend's.
    specialized: bool = False
    error: type = ScoreModError  # raised when asked by name for a call it refuses
    hint: str = ""  # what to do instead, appended to that error

    def refused(self, reason: str) -> ScoreModError:
        """The error for ``implementation=<name>`` on a call it cannot run."""
        return self.error(f"implementation=\"{self.name}\" cannot run this call: {reason}."
                          + (f" {self.hint}" if self.hint else ""))

    def no_lse_cotangent(self) -> ScoreModError:
        """The error of a backward asked for the LSE's cotangent it cannot take."""
        return self.error(f"{self.title} cannot differentiate through the returned LSE; use "
                          "implementation=\"xla\", or jax.lax.stop_gradient(lse).")

    def present(self) -> bool:
        return True

    def why_not(self, problem, mod, automatic: bool, options=None) -> str | None:
        raise NotImplementedError

    def claims(self, problem, mod, options, over) -> str | None:
        return None

    def claims_forward(self, problem, mod, options, over) -> str | None:
        """Why its forward runs the call faster than ``over``'s (the backend that
        takes it, whose backward stays: it runs on this forward's O and LSE), or
        None. Asked where no backend ``claims`` the whole call."""
        return None

    def evaluates_mod(self, problem, mod, options) -> bool:
        """Whether its plan evaluates the mod per score (rather than running native
        masks or plain attention only): what a ``claims_forward`` may weigh."""
        return mod is not None

    def tile_share(self, problem, mod, options) -> float | None:
        """The modelled share of the call's score tiles its kernels compute, forward
        and backward weighted 1 : 2.5 (their FLOPs), or None where it models none: what
        a later backend's ``claims`` weighs against its own."""
        return None

    def static_tensor_ahead(self, problem, mod, options) -> str | None:
        """Where its plan has XLA compute a tensor of the whole [.., Sq, Skv] score
        matrix from the positions alone (no captured array) ahead of its kernels, for
        an op they lack (a static mask through bit operations, on cuDNN): that op and
        why, in words; else None. What a later backend's ``claims`` can spare the call."""
        return None

    def data_tensor_ahead(self, problem, mod, options) -> str | None:
        """Where its plan has XLA compute a float tensor of the whole [.., Sq, Skv]
        score matrix from captured arrays read at both positions ahead of its kernels
        (a table read through other arrays, on cuDNN): that value and its shape, in words;
        else None. What a later backend's ``claims`` can spare the call."""
        return None

    def variant(self, problem, mod, options) -> str | None:
        """Which of its ways runs the call under ``options`` and why, for a backend
        with more than one (the Pallas engines); None for one way."""
        return None

    def plan(self, problem, mod, scale, options, return_lse):
        raise NotImplementedError

    def forward(self, plan, q, k, v, operands, sinks=None):
        """``(O, LSE)``; with ``sinks`` (float32 [b, hq], the same in every batch row:
        only where ``joins_sinks``) the sinks joined inside its softmax."""
        raise NotImplementedError

    def backward(self, plan, q, k, v, o, lse, do, operands, dlse=None, wanted=()):
        raise NotImplementedError

    def splits_keys(self, plan) -> bool:
        """Whether its forward for ``plan`` spreads a query tile's keys over several
        programs itself where the call has too few query tiles to fill the GPU: a
        short-query fold (``lowering.decode``) then packs query heads only."""
        return False

    def fetches_pages(self, plan, page_size: int) -> bool:
        """Whether its forward for ``plan`` reads a paged KV cache of ``page_size``
        keys a page through the page table itself (``paged_forward``); else the
        pages are gathered into rows first."""
        return False

    def paged_forward(self, plan, q, key_pages, value_pages, table, operands):
        """``(O, LSE)`` with K and V as a paged cache [num_pages, page_size, Hkv, D]
        and ``table`` int32 [B, pages per row] (where ``fetches_pages``)."""
        raise NotImplementedError

    def joins_sinks(self, plan, options) -> bool:
        """Whether its forward takes per-head sinks into its own softmax for ``plan``
        (else they join around it: ``lowering/sinks.py``'s combine). Asked through
        :func:`sinks_inside`, the one rule."""
        return False

    def sums_sink_gradient(self, plan, options) -> bool:
        """Whether its backward for ``plan`` sums the gradient of sinks it joined
        inside (``joins_sinks``) itself, in ``backward_with_sinks`` (else the
        pipeline sums it: ``lowering/sinks.py``'s gradient)."""
        return False

    def backward_with_sinks(self, plan, q, k, v, o, lse, do, operands, sinks):
        """``(dQ, dK, dV, d(sinks))`` for ``sinks`` float32 [b, hq], one per head
        (the same in every batch row), where ``sums_sink_gradient``; the sinks'
        gradient may come in any split over the batch rows that sums to theirs."""
        raise NotImplementedError

    def __repr__(self):
        return f"<scoremod backend {self.name!r}>"


def sinks_inside(backend, plan, options, layout) -> bool:
    """Whether a call's sinks (``lowering.sinks.layout``: "head" or "batch"; None
    without) join inside ``backend``'s forward: one logit per head, a backend that
    takes them for ``plan``, and V known finite (``check_values`` runs the forward
    twice around the kernel, lowering/nonfinite.py, which takes no sinks)."""
    return (layout == "head" and not options.check_values
            and backend.joins_sinks(plan, options))


@dataclasses.dataclass(frozen=True)
class Call:
    """A routed call as the pipeline runs it (hashable: JAX's static argument):
    the backend, its plan, the (backend, plan) pairs that compute, when the user
    allowed a fallback, operand gradients and a call refused when built
    (``fallback``) and forward-mode and second-order derivatives
    (``forward_mode_fallback``), None where those are refused; with what it
    takes to plan the same call on other shapes (a device's shard, a vmapped
    batch): :meth:`on`."""

    backend: Backend
    plan: object
    problem: object  # the Problem ``plan`` was made for
    options: object
    return_lse: bool = True
    fallback: tuple | None = None
    forward_mode_fallback: tuple | None = None
    sinks: bool = False  # the call has attention sinks (lowering/sinks.py)
    # ... which the backend's forward joins in its softmax (Backend.joins_sinks: one
    # per head); else they are joined around it
    sinks_inside: bool = False
    # The (backend, plan) whose backward runs on this forward's O and LSE where it
    # computes what is asked (dQ, dK, dV: no operand gradient, no LSE cotangent), a
    # faster one than the forward's backend (Backend.claims_forward); else None.
    backward_on: tuple | None = None

    def on(self, problem, mod, why: str) -> "Call":
        """The same call on ``problem`` with ``mod`` (an expression-only ScoreMod),
        on the same backend, without fallbacks; ``why`` (e.g. "under jax.vmap")
        explains a refusal of the new call."""
        reason = self.backend.why_not(problem, mod, False, self.options)
        if reason is not None:
            raise self.backend.error(
                f"{self.backend.title} cannot run this call {why}: {reason}. Use "
                "implementation=\"xla\" for it.")
        plan = self.backend.plan(problem, mod, self.plan.scale, self.options, self.return_lse)
        backward_on = None
        if self.backward_on is not None:  # the same split where that backend takes it too
            other = self.backward_on[0]
            if other.why_not(problem, mod, False, self.options) is None:
                backward_on = (other, other.plan(problem, mod, self.plan.scale, self.options,
                                                 True))
        return dataclasses.replace(self, plan=plan, fallback=None, forward_mode_fallback=None,
                                   problem=problem, backward_on=backward_on,
                                   sinks_inside=self.sinks_inside
                                   and sinks_inside(self.backend, plan, self.options, "head"))

    def refolded(self, problem, mod, why: str) -> "Call":
        """As :meth:`on`, with the fallbacks (if any) planned for it too."""
        new = self.on(problem, mod, why)

        def again(pair):
            return None if pair is None else (
                pair[0], pair[0].plan(problem, mod, self.plan.scale, self.options, True))

        return dataclasses.replace(new, fallback=again(self.fallback),
                                   forward_mode_fallback=again(self.forward_mode_fallback))

    def to(self, pair) -> "Call":
        """The call on another (backend, plan) pair, a fallback, without fallbacks."""
        return dataclasses.replace(self, backend=pair[0], plan=pair[1], return_lse=True,
                                   fallback=None, forward_mode_fallback=None, backward_on=None,
                                   sinks_inside=self.sinks_inside
                                   and sinks_inside(pair[0], pair[1], self.options, "head"))


def execute(call: Call, q, k, v, operands, sinks=None):
    """``(O, LSE)`` of ``call``, differentiable in q, k, v and ``sinks`` (float32
    [b, hq], with ``call.sinks``; else None) and in the operands where its
    backend or its ``fallback`` computes their gradients. A ``differentiable``
    backend's forward is called directly; any other runs in the ``custom_jvp``
    below, through ``lowering.sharding``."""
    backend = call.backend
    if backend.differentiable:
        return _with_sinks(backend.forward(call.plan, q, k, v, operands), sinks)
    if forward_mode((q, k, v, operands, sinks)):
        return _forward_mode_fallback(call, q, k, v, operands, sinks)
    try:
        return _fused(call, q, k, v, tuple(operands), sinks)
    except UnsupportedOpError as e:  # refused only when building its kernels
        return execute(call.to(_refused_when_built(call, e, "forward")), q, k, v, operands,
                       sinks)


def _with_sinks(out, sinks):
    """A kernel's ``(O, LSE)`` with the sinks joined (lowering/sinks.py), if any."""
    return out if sinks is None else attention_sinks.combine(*out, sinks)


def forward_mode(arrays) -> bool:
    """Whether ``arrays`` carry forward-mode tangents (``jax.jvp`` traces this call).

    JAX's JVP tracer type says so (``jax.grad`` and ``jax.linearize`` trace
    with another; a jitted function's call sees no tracer of the jvp at all:
    those reach ``_TANGENT`` below)."""
    return any(isinstance(x, ad.JVPTracer) for x in jax.tree.leaves(arrays))


def _forward_mode_fallback(call, q, k, v, operands, sinks):
    """``jax.jvp`` of a fused call: a fused backward gives no tangents, so the
    reference path runs the call where the user allowed it (implementation=None);
    its tangents need the reference forward anyway, so the fused one would only
    add work."""
    other, other_plan = _fallback_for(call, _FORWARD_MODE, stacklevel=5)
    return _with_sinks(other.forward(other_plan, q, k, v, operands), sinks)


# --------------------------------------------------------------------------- #
# The fused call and its derivatives.
#
# ``_fused`` is a ``custom_jvp``: its rule runs the fused forward for the primal
# outputs and gives their tangents as one primitive, ``_TANGENT``, linear in the
# tangents of q, k, v and the operands. JAX only ever evaluates or transposes it:
# - transposed (``jax.grad``, ``jax.vjp``: the rule is linearized, then
#   transposed) it is the backend's backward (or, for operand gradients it does
#   not compute, the operand fallback's), and nothing else runs;
# - evaluated (``jax.jvp``, ``jax.linearize``, ``jax.jacfwd``, under ``jax.jit``
#   or not) it is the fallback (reference) path's tangent, with a warning
#   (implementation=None), or the backend's error (asked for by name).
# Its batching rule folds vmapped axes into the batch (as ``lowering.sharding``
# does for the kernels), so both meanings survive ``jax.vmap``. (A
# ``custom_vjp`` has no forward mode at all, and ``custom_derivatives.linear_call``,
# the public primitive with its own transpose, has no batching rule.)
# The backward is a ``custom_jvp`` too: second-order derivatives
# (``jax.hessian``, the gradient of a gradient) differentiate it on the
# fallback path.


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _fused(call, q, k, v, operands, sinks):
    if sinks is not None and call.sinks_inside:
        return sharding.forward(call, q, k, v, operands, sinks)
    return _with_sinks(sharding.forward(call, q, k, v, operands), sinks)


def _zero(t) -> bool:
    from jax.custom_derivatives import SymbolicZero

    return isinstance(t, SymbolicZero)


def _fused_jvp(call, primals, tangents):
    q, k, v, operands, sinks = primals
    perturbed = [n for n, t in zip(_names(call.plan), tangents[3]) if not _zero(t)]
    if perturbed and not call.backend.operand_gradients:
        _operand_fallback(call, perturbed)
    o, lse = _fused(call, q, k, v, operands, sinks)
    with_sinks = () if sinks is None else (sinks,)
    flat = (*tangents[:3], *tangents[3], *(() if sinks is None else (tangents[4],)))
    which = tuple(not _zero(t) for t in flat)
    lin = [t for t in flat if not _zero(t)]
    to, tlse = _TANGENT.bind(q, k, v, o, lse, *operands, *with_sinks, *lin, static=call,
                             which=which)
    return (o, lse), (to, tlse)


_fused.defjvp(_fused_jvp, symbolic_zeros=True)


def _operand_fallback(call, perturbed):
    """The (backend, plan) that computes derivatives for the mod's captured
    operands (implementation=None, with a warning), or the error. Their
    tangents join ``_TANGENT``: transposed (jax.grad) they are that backend's
    backward; evaluated (jax.jvp) the forward-mode fallback's tangents."""
    if call.fallback is None:
        raise CudnnUnavailableError(
            f"gradients with respect to score_mod operands {perturbed} are not computed by "
            f"{call.backend.title} (it returns dQ, dK, dV only). Use implementation=\"xla\" to "
            "learn them, or wrap them in jax.lax.stop_gradient to keep them fixed."
        )
    fallback, _ = call.fallback
    warnings.warn(
        f"scoremod: gradients for score_mod operands {perturbed} need {fallback.title}; "
        f"implementation=None falls back to it for this call{_memory_note(fallback)}.",
        stacklevel=3,
    )
    return call.fallback


def _fallback_for(call, what, stacklevel=3):
    """The fallback (backend, plan) for derivatives the fused backend does not
    compute (``what``), with a warning; the backend's error where the user
    allowed no fallback (a backend asked for by name)."""
    if call.forward_mode_fallback is None:
        raise call.backend.error(
            f"{call.backend.title} has no {what}: it computes reverse-mode gradients "
            "(jax.grad, jax.vjp) only. Use implementation=None (falls back to the reference "
            "path, with a warning) or implementation=\"xla\".")
    fallback, fallback_plan = call.forward_mode_fallback
    warnings.warn(f"scoremod: {what} are not computed by {call.backend.title}; "
                  f"implementation=None falls back to {fallback.title} for them"
                  f"{_memory_note(fallback)}.", stacklevel=stacklevel)
    return fallback, fallback_plan


_FORWARD_MODE = "forward-mode derivatives (jax.jvp, jax.linearize, jax.jacfwd)"
_SECOND_ORDER = ("second-order derivatives (jax.hessian, the gradient of a gradient: the "
                 "fused backward's derivative)")


# ``_TANGENT``'s arguments: q, k, v, O, LSE, the operands, the sinks (with
# ``call.sinks``), then the nonzero tangents of q, k, v, each operand and the
# sinks, in that order; ``which`` says which of those tangents are there.


def _split(args, call, which):
    """``(q, k, v, o, lse, operands, sinks, tangents)`` of ``_TANGENT``'s
    arguments: ``tangents`` of q, k, v, each operand and the sinks (if any),
    None for a zero one; ``sinks`` None without them."""
    n = 5 + len(_names(call.plan))
    q, k, v, o, lse = args[:5]
    sinks = args[n] if call.sinks else None
    lin = iter(args[n + call.sinks:])
    return (q, k, v, o, lse, tuple(args[5:n]), sinks,
            tuple(next(lin) if w else None for w in which))


def _zeros_like(x):
    """A zero tangent of ``x`` (float0 for integer arrays, as JAX wants)."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.zeros(x.shape, x.dtype)
    return np.zeros(x.shape, jax.dtypes.float0)


def _tangent_value(*args, static, which):
    """``_TANGENT`` evaluated: the tangents of (O, LSE) on the fallback path."""
    q, k, v, o, lse, operands, sinks, lin = _split(args, static, which)
    fallback, fallback_plan = _fallback_for(static, _FORWARD_MODE)
    primals = (q, k, v, *operands, *(() if sinks is None else (sinks,)))
    tangents = tuple(_zeros_like(x) if t is None else t for x, t in zip(primals, lin))
    n = len(operands)

    def forward(q, k, v, *rest):
        out = fallback.forward(fallback_plan, q, k, v, rest[:n])
        return _with_sinks(out, rest[n] if sinks is not None else None)

    _, (to, tlse) = jax.jvp(forward, primals, tangents)
    return [to.astype(o.dtype), tlse.astype(lse.dtype)]


def _tangent_avals(*avals, static, which):
    del static, which
    out = (avals[3], avals[4])  # like O and LSE
    vma = frozenset().union(*(getattr(a, "vma", frozenset()) for a in avals))
    return [a.update(vma=vma) for a in out] if vma else list(out)


def _tangent_transpose(cts, *args, static, which):
    """``_TANGENT`` transposed: the backend's backward."""
    call = static
    q, k, v, o, lse, operands, sinks, _ = _split(args, call, which)
    do, dlse = cts
    dlse = None if type(dlse) is ad.Zero else dlse
    if type(do) is ad.Zero:
        do = jnp.zeros(o.shape, o.dtype)
    n = len(operands)
    wanted = tuple(which[3:3 + n])
    if _backward_on_other(call, wanted, dlse):
        # The faster backward, on this forward's O and LSE.
        call = call.to(call.backward_on)
        lse = empty_rows_at_inf(lse)
    elif _backward_elsewhere(call, wanted):
        # The fallback's backward, on this forward's O and LSE (every backward
        # takes them from any forward: the same softmax).
        call = call.to(call.fallback)
    summed_inside = (sinks is not None and which[-1] and dlse is None and not any(wanted)
                     and call.sinks_inside
                     and call.backend.sums_sink_gradient(call.plan, call.options))
    dq, dk, dv, learned, dsinks = _run_backward(call, wanted, q, k, v, o, lse, do, dlse,
                                                operands, sinks, summed_inside)
    by_operand = iter(learned)
    grads = (dq, dk, dv, *(next(by_operand) if w else None for w in wanted))
    if sinks is not None:
        if which[-1] and dsinks is None:  # O and LSE are the final ones: lowering/sinks.py
            dsinks = attention_sinks.gradient(o, lse, do, dlse, sinks)
        grads += (dsinks if which[-1] else None,)
    return [None] * (5 + n + call.sinks) + [g for g, w in zip(grads, which) if w]


def empty_rows_at_inf(lse):
    """``lse`` with -inf (a row that sees no key, nor a sink) made +inf: any backward's
    P = exp(s - LSE) is then 0 on that row, as its O of 0 wants (not exp(-inf + inf))."""
    return jnp.where(lse == -jnp.inf, jnp.inf, lse)


def _backward_on_other(call, wanted, dlse) -> bool:
    """Whether ``call``'s backward runs on its ``backward_on`` backend (whose
    gradients repeat where those are asked for: the route sets it only then): it
    has one, and no operand gradient or LSE cotangent is asked of it."""
    return call.backward_on is not None and not any(wanted) and dlse is None


def _backward_elsewhere(call, wanted) -> bool:
    """Whether ``call``'s backward runs on its fallback: operand gradients its
    backend does not compute (``_operand_fallback`` warned, or raised, already) or
    repeatable gradients it does not give (the error where it has no fallback: a
    backend asked for by name)."""
    if any(wanted) and not call.backend.operand_gradients:
        return True
    if call.options.deterministic and not call.backend.repeatable_backward:
        if call.fallback is None:
            raise call.backend.error(
                f"LoweringOptions(deterministic=True) asks for gradients that repeat bitwise, "
                f"and {call.backend.title}'s backward does not. Use implementation=None (its "
                "backward then runs on a backend whose gradients repeat) or "
                "implementation=\"pallas\", or deterministic=False.")
        fallback = call.fallback[0]
        if fallback.materializes_scores:  # the user asked for this, but not for O(S^2) memory
            warnings.warn(f"scoremod: deterministic=True runs this backward on {fallback.title}"
                          f"{_memory_note(fallback)}: the Pallas kernels do not take this call "
                          "here.", stacklevel=3)
        return True
    return False


def _vjp_on(call, q, k, v, do, dlse, operands, wanted, sinks=None):
    """``(dQ, dK, dV, gradients of the wanted operands)`` by ``call``'s own
    reverse mode (its forward runs for its residuals), the sinks held fixed."""
    learn = [i for i, w in enumerate(wanted) if w]
    dq, dk, dv, grads = vjp_of(lambda q, k, v, ops: execute(call, q, k, v, ops, sinks),
                               q, k, v, do, dlse, operands, learn)
    return dq, dk, dv, tuple(grads)


def vjp_of(forward, q, k, v, do, dlse, operands, learn):
    """``(dQ, dK, dV, [gradients of operands[i] for i in learn])`` by JAX's
    reverse mode of ``forward(q, k, v, operands) -> (O, LSE)`` (the cotangent
    ``dlse`` of LSE too, unless None): the backward of what has no kernel of its
    own (the reference path, a fallback)."""
    def out(q, k, v, *learned):
        ops = list(operands)
        for i, x in zip(learn, learned):
            ops[i] = x
        o, lse = forward(q, k, v, tuple(ops))
        return o if dlse is None else (o, lse)

    _, vjp = jax.vjp(out, q, k, v, *(operands[i] for i in learn))
    dq, dk, dv, *grads = vjp(do if dlse is None else (do, dlse))
    return dq, dk, dv, grads


def _tangent_jvp(primals, tangents, *, static, which):
    """``_TANGENT`` differentiated again (the tangent of a tangent): on the fallback path."""
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    return jax.jvp(lambda *a: _tangent_value(*a, static=static, which=which), primals, tangents)


def _tangent_batched(args, dims, *, static, which):
    """``_TANGENT`` under ``jax.vmap``: the mapped axis folds into the batch (the
    mod rewritten as for the kernels, ``sharding.fold_batch``), so that it stays
    the fused backward when transposed. An operand's tangent folds as its
    operand does (both taken as mapped when either is), so the rewritten mod
    reads both alike."""
    n = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    args = [x if d is None else jnp.moveaxis(x, d, 0) for x, d in zip(args, dims)]
    mapped = [d is not None for d in dims]
    names = _names(static.plan)
    at_sinks = 5 + len(names)
    lin_at = iter(range(at_sinks + static.sinks, len(args)))
    where = [next(lin_at) if w else None for w in which]  # each tangent's argument, if any
    # Batch-major: q, k, v, O, LSE, their tangents, and the sinks [b, hq] with theirs.
    sink_args = [at_sinks, where[-1]] if static.sinks else []
    heads = (list(range(5)) + [i for i in where[:3] if i is not None]
             + [i for i in sink_args if i is not None])
    folded = {i: sharding.fold(args[i], mapped[i], n) for i in heads}
    b = args[0].shape[1] if mapped[0] else args[0].shape[0]
    ops_at = range(5, 5 + len(names))
    op_tangents = where[3:3 + len(names)]
    alike = [mapped[i] or (t is not None and mapped[t]) for i, t in zip(ops_at, op_tangents)]

    def as_mapped(i, flag):
        return args[i] if mapped[i] or not flag else jnp.broadcast_to(args[i], (n,) + args[i].shape)

    values = [as_mapped(i, f) for i, f in zip(ops_at, alike)]
    mod, operands = sharding.fold_batch(static.plan.mod, values, alike, n, b)
    perturbed = [t is not None for t in op_tangents]
    new_perturbed, operand_tangents = [False] * len(operands), ()
    if any(perturbed):
        tangents = [as_mapped(t, f) if t is not None else x
                    for t, f, x in zip(op_tangents, alike, values)]
        _, operand_tangents = sharding.fold_batch(static.plan.mod, tangents, alike, n, b)
        source = dict(zip(names, perturbed))
        new_perturbed = [source[sharding.folded_from(name, source)]
                         for name in mod.operand_names]
    q, k, v = folded[0], folded[1], folded[2]
    sub = static.refolded(Problem.of(q, k, v), mod,
                          "under jax.vmap (the mapped axes folded into the batch)")
    if static.sinks and mapped[at_sinks]:  # sinks per example: not one per head of the batch
        sub = dataclasses.replace(sub, sinks_inside=False)
    sink_tangent = (folded[where[-1]],) if static.sinks and where[-1] is not None else ()
    outs = _TANGENT.bind(*(folded[i] for i in range(5)), *operands,
                         *((folded[at_sinks],) if static.sinks else ()),
                         *(folded[i] for i in where[:3] if i is not None),
                         *(t for t, p in zip(operand_tangents, new_perturbed) if p),
                         *sink_tangent,
                         static=sub, which=(*which[:3], *new_perturbed,
                                            *((which[-1],) if static.sinks else ())))
    return [sharding.unfold(x, n) for x in outs], [0, 0]


_TANGENT = Primitive("scoremod_attention_tangent")
_TANGENT.multiple_results = True
_TANGENT.def_impl(_tangent_value)
_TANGENT.def_abstract_eval(_tangent_avals)
mlir.register_lowering(_TANGENT, mlir.lower_fun(_tangent_value, multiple_results=True))
ad.primitive_transposes[_TANGENT] = _tangent_transpose
ad.primitive_jvps[_TANGENT] = _tangent_jvp
batching.primitive_batchers[_TANGENT] = _tangent_batched


def _run_backward(call, wanted, q, k, v, o, lse, do, dlse, operands, sinks=None,
                  summed_inside=False):
    """``(dQ, dK, dV, gradients of the wanted operands, d(sinks))``, the last None
    unless ``summed_inside``: the backend's backward sums it (its
    ``sums_sink_gradient``)."""
    try:
        return _backward(call, wanted, summed_inside, q, k, v, o, lse, do, dlse, operands, sinks)
    except UnsupportedOpError as e:
        pair = _refused_when_built(call, e, "backward")
        return (*_vjp_on(call.to(pair), q, k, v, do, dlse, operands, wanted, sinks), None)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2))
def _backward(call, wanted, summed_inside, q, k, v, o, lse, do, dlse, operands, sinks):
    """``(dQ, dK, dV, gradients of the wanted operands, d(sinks) or None)``; ``o`` and
    ``lse`` are the call's final ones (with the sinks, which the kernel's backward
    needs only to sum their gradient: ``summed_inside``)."""
    names = tuple(n for n, w in zip(_names(call.plan), wanted) if w)
    return sharding.backward(call, q, k, v, o, lse, do, operands, dlse, names,
                             sinks if summed_inside else None)


@_backward.defjvp
def _backward_jvp(call, wanted, summed_inside, primals, tangents):
    q, k, v, _, _, do, dlse, operands, sinks = primals
    tq, tk, tv, _, _, tdo, tdlse, toperands, tsinks = tangents  # O, LSE move with q, k, v, sinks
    pair = _fallback_for(call, _SECOND_ORDER)
    fallback = call.to(pair)

    def grads(q, k, v, do, dlse, operands, sinks):
        out = _vjp_on(fallback, q, k, v, do, dlse, operands, wanted, sinks)
        if not summed_inside:
            return (*out, None)
        o, lse = execute(fallback, q, k, v, operands, sinks)
        return (*out, attention_sinks.gradient(o, lse, do, dlse, sinks))

    return jax.jvp(grads, (q, k, v, do, dlse, operands, sinks),
                   (tq, tk, tv, tdo, tdlse, toperands, tsinks))


def _memory_note(backend) -> str:
    return " (O(S^2) memory)" if backend.materializes_scores else ""


def _refused_when_built(call, error, what):
    """The fallback (backend, plan) for a call the fused backend turned down only
    when building its kernels (cuDNN's "no engine"), with a warning; the error
    itself where the user allowed no fallback (a backend asked for by name)."""
    if call.fallback is None:
        raise error
    fallback, _ = call.fallback
    warnings.warn(f"scoremod: {call.backend.title} refused the {what} of this call when "
                  f"building it ({str(error)[:300]}); implementation=None runs it on "
                  f"{fallback.title}{_memory_note(fallback)}.", stacklevel=4)
    return call.fallback


def _names(plan):
    return plan.mod.operand_names if plan.mod is not None else ()
