"""One route per call: which backend runs it, with which plan, and why.

``route`` decides once, from everything the decision depends on (the problem,
the mod, the scale, the options, the implementation asked for, ``return_lse``),
and returns a frozen :class:`Route`. ``attention`` executes it;
``which_implementation`` describes it. The two cannot disagree.

The rule: a backend asked for by name runs the call or refuses it. Otherwise
the first registered backend that takes the call runs it, unless a later one
that takes it too claims it (a measured crossover), or claims its forward only
(``claims_forward``: the first one's backward then runs on that forward's O and
LSE where it computes what is asked). What the chosen backend cannot do (gradients of captured arrays,
``jax.jvp``, a graph refused only when built) runs on the first later backend
that can. A warning is due only where the user should act or know: a backend
present on this machine, general (not one kind of mod only) and earlier in the
order, refused this mod, so a slower route runs it. Once per mod and reason.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax

from scoremod.dsl.scoremod import ScoreMod
from scoremod.lowering import decode, lowrank, registry
from scoremod.lowering.backend import Call, sinks_inside
from scoremod.lowering.problem import Problem
from scoremod.options import LoweringOptions


class Choice(tuple):
    """``(implementation, reason)``, with every backend's verdict in ``verdicts``."""

    def __new__(cls, implementation, reason, verdicts, low_rank_bias=None, variant=None,
                sinks=None, backward=None):
        self = super().__new__(cls, (implementation, reason))
        self.verdicts = verdicts
        self.low_rank_bias = low_rank_bias
        self.variant = variant
        self.sinks = sinks
        self.backward = backward  # where the backward runs, when not on the same backend
        self.pages = None  # how a paged KV cache is read (set by which_implementation)
        return self

    @property
    def implementation(self):
        return self[0]

    @property
    def reason(self):
        return self[1]


@dataclasses.dataclass(frozen=True)
class Route:
    """The decision for one call (frozen: it is made once): what runs
    (``call``: the backend, its plan, what takes over what it cannot do, as
    ``lowering.backend.execute`` runs it) and why."""

    call: Call
    mod: ScoreMod | None  # after a low-rank bias moved into q and k, if one did
    low_rank: object  # lowrank.LowRank that moves into q and k, or None
    verdicts: tuple  # ((backend name, its refusal or None), ...), in the registry's order
    reason: str  # why this backend, in the user's words
    warning: str | None  # what the user should know (a faster backend here refused), or None
    low_rank_note: str | None
    variant: str | None  # which of the backend's ways runs it, and why
    sinks_note: str | None = None  # how the attention sinks join the call, if it has them
    backward_note: str | None = None  # where the backward runs, when not on the same backend

    @property
    def backend(self):
        return self.call.backend

    @property
    def plan(self):
        return self.call.plan

    @property
    def problem(self) -> Problem:
        return self.call.problem

    def on(self, problem: Problem, mod, why: str) -> Call:
        """The same backend's call on ``problem`` (a device's shard, a folded batch)."""
        return self.call.on(problem, mod, why)

    def describe(self) -> "Choice":
        return Choice(self.backend.name, self.reason, dict(self.verdicts), self.low_rank_note,
                      self.variant, self.sinks_note, self.backward_note)


def route(problem: Problem, mod, scale, options: LoweringOptions, implementation=None,
          return_lse=False, sinks=None) -> Route:
    """The :class:`Route` of a call whose inputs passed ``attention``'s checks;
    ``sinks``: its attention sinks' ``lowering.sinks.layout`` ("head" or "batch"),
    None without them (True: as "batch")."""
    traced_scale = isinstance(scale, jax.core.Tracer)
    asked = None if implementation is None else registry.get(implementation)
    low_rank, note = None, None
    if options.low_rank_bias:
        found = lowrank.find(mod, problem, scale)
        if isinstance(found, lowrank.LowRank):
            d = problem.d + found.rank + found.pad
            note = (f"a low-rank bias of rank {found.rank} runs inside QK^T: head dim "
                    f"{problem.d} becomes {d}, and the mod `{found.mod}`")
            low_rank, mod = found, found.mod
            problem = dataclasses.replace(problem, d=d)
        elif found is not None:
            note = f"a low-rank bias stays in the mod: {found.reason}"

    def why_not(backend, automatic=True):
        return refusal(backend, problem, mod, traced_scale, automatic, options)


    verdicts = tuple((b.name, why_not(b)) for b in registry.backends())
    warning = None
    if asked is not None:
        reason = why_not(asked, automatic=False)
        if reason is not None:
            raise asked.refused(reason)
        backend, why = asked, f"{asked.name}: asked for by name (implementation=\"{asked.name}\")"
    else:
        backend, why, warning = _choose(problem, mod, dict(verdicts), options)
    backward_on = None
    if asked is None:  # a later backend's forward, this one's backward
        other, claim = _first_claim(backend, problem, mod, dict(verdicts), options,
                                    "claims_forward")
        if other is not None:
            # The backward stays where it computes what is asked (repeatable gradients
            # under deterministic=True); else the claiming backend's own runs.
            if backend.repeatable_backward or not options.deterministic:
                backward_on = (backend, backend.plan(problem, mod, scale, options, True))
            why = (f"{other.name}: it claims the forward from {backend.name}, whose backward "
                   f"runs on its O and LSE: {claim}")
            backend = other
    # With sinks the kernel's LSE is needed: the sinks join it (lowering/sinks.py).
    plan = backend.plan(problem, mod, scale, options, return_lse or sinks)
    fallback = forward_mode_fallback = None
    if asked is None:
        takes = dict(verdicts)
        fallback = _fallback(backend, problem, mod, scale, options, takes,
                             lambda b: b.operand_gradients and (b.repeatable_backward
                                                               or not options.deterministic))
        forward_mode_fallback = _fallback(backend, problem, mod, scale, options, takes,
                                          lambda b: b.differentiable)
    inside = sinks_inside(backend, plan, options, sinks)
    call = Call(backend, plan, problem, options, bool(return_lse), fallback,
                forward_mode_fallback, bool(sinks), inside, backward_on)
    variant = backend.variant(problem, mod, options)
    folded = decode.choose(call)
    if folded is not None:  # short queries: the kernels run the folded call
        fold, inner = folded
        if inside:  # the folded call's chunks are joined first: the sinks join after
            inside = False
            call = dataclasses.replace(call, sinks_inside=False)
        inner_variant = backend.variant(inner.problem, inner.plan.mod, inner.options)
        variant = fold.describe(problem) + (f"; {inner_variant}" if inner_variant else "")
    return Route(call, mod, low_rank, verdicts, why, warning, note, variant,
                 _sinks_note(backend, inside, plan, options) if sinks else None,
                 _backward_note(backend, fallback, options, backward_on))


def _backward_note(backend, fallback, options, backward_on=None) -> str | None:
    if backward_on is not None:
        return (f"the backward runs on {backward_on[0].title}, from {backend.title}'s O and "
                f"LSE (gradients of captured arrays or of the LSE on {backend.title}'s own)")
    if not options.deterministic or backend.repeatable_backward:
        return None
    if fallback is None:
        return (f"deterministic=True: {backend.title} refuses gradients (its backward is not "
                "bitwise repeatable)")
    return (f"deterministic=True: the backward runs on {fallback[0].title}, from "
            f"{backend.title}'s O and LSE ({backend.title}'s backward is not bitwise repeatable)")


def _sinks_note(backend, inside, plan, options) -> str:
    if inside:
        joined = (f"the sinks join the softmax inside {backend.title}'s forward (one logit "
                  "per head, with the kernel's own LSE); its backward runs ")
        if backend.sums_sink_gradient(plan, options):
            return (joined + "on the final O and LSE and sums the sinks' gradient itself "
                    "(with an LSE cotangent, or deterministic=True, the one reduction of "
                    "lowering/sinks.py)")
        return (joined + "unchanged on the final O and LSE, and the sinks' gradient is one "
                "reduction (lowering/sinks.py)")
    if backend.differentiable:
        return (f"the sinks join each row's softmax after {backend.title}'s scores; JAX "
                "differentiates it")
    return (f"the sinks join each row's softmax after {backend.title}'s forward (LSE = "
            "logaddexp(LSE, sink), O scaled by exp(LSE_kernel - LSE)); its backward runs "
            "unchanged on the final O and LSE, and the sinks' gradient is one reduction "
            "(lowering/sinks.py)")


def refusal(backend, problem, mod, traced_scale, automatic, options) -> str | None:
    """Why ``backend`` does not run the call under ``options``, or None."""
    if traced_scale and not backend.traced_scale:
        return ("the scale is a traced value, and this backend compiles the scale into its "
                "kernels: pass a Python float (or fold a learned factor into the score_mod)")
    return backend.why_not(problem, mod, automatic, options)


def _choose(problem, mod, verdicts, options):
    """``(backend, reason, warning or None)`` for ``implementation=None``."""
    from scoremod.errors import ScoreModError

    order = registry.backends()
    taken = next((b for b in order if verdicts[b.name] is None), None)
    if taken is None:
        raise ScoreModError("no implementation can run this call: "
                            + "; ".join(f"{b.name}: {verdicts[b.name]}" for b in order))
    other, why = _claimed(taken, problem, mod, verdicts, options)
    if other is not None:
        return other, why, None
    # Passed over: the general backends before it (a specialized one, such as
    # cudnn-varlen for segment masks, refusing another mod is the normal case).
    passed = [b for b in order[:order.index(taken)] if not b.specialized]
    here = [b for b in passed if b.present()]
    if here:
        warning = "; ".join(f"{b.name} refuses this call: {verdicts[b.name]}" for b in here)
        return taken, f"{taken.name}: {warning}", warning
    if passed:
        return taken, (f"{taken.name}: no faster backend runs on this machine "
                       f"({passed[0].name}: {verdicts[passed[0].name]})"), None
    return taken, f"{taken.name}: the first backend in order that takes the call", None


def _claimed(backend, problem, mod, verdicts, options):
    """``(other, reason)``: the first later backend that claims the call from
    ``backend`` and takes it; else ``(None, None)``."""
    other, why = _first_claim(backend, problem, mod, verdicts, options, "claims")
    if other is None:
        return None, None
    return other, f"{other.name}: it claims the call from {backend.name}: {why}"


def _first_claim(backend, problem, mod, verdicts, options, claim):
    """``(other, its reason)``: the first later backend whose ``claim`` method
    ("claims": the whole call, "claims_forward": its forward) claims the call from
    ``backend`` and that takes it; else ``(None, None)``."""
    for other in _after(backend):
        why = getattr(other, claim)(problem, mod, options, backend)
        if why is not None and verdicts[other.name] is None:
            return other, why
    return None, None


def _after(backend) -> tuple:
    """The backends tried after ``backend`` (all of them for one asked for by name only)."""
    order = registry.backends()
    return order[order.index(backend) + 1:] if backend in order else order


def _fallback(backend, problem, mod, scale, options, verdicts, can):
    """``(backend, plan)`` of the first backend after ``backend`` that ``can`` and
    takes the call (its verdict is None), or None."""
    for other in _after(backend):
        if can(other) and verdicts[other.name] is None:
            return other, other.plan(problem, mod, scale, options, True)
    return None


_WARNED: set = set()


def warn(route_: Route) -> None:
    """The route's warning, once per mod, backend and reason."""
    if route_.warning is None:
        return
    key = (None if route_.mod is None else route_.mod.key, route_.backend.name, route_.warning)
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"scoremod: implementation=None uses {route_.backend.title} here: "
                      f"{route_.warning}", stacklevel=4)
