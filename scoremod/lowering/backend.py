"""The interface every route of ``scoremod.attention`` implements, and the
``custom_vjp`` that runs a fused backend's plan.

A backend is one object with a small protocol:

- ``why_not(problem, mod, automatic)``: why it cannot run this call (a
  sentence), or None. ``automatic`` is True when ``implementation=None``
  asks: a backend may then be stricter (cuDNN only volunteers on the GPU
  families it was validated on).
  ``why_not_with(problem, mod, automatic, options)`` is the same under the
  call's LoweringOptions (by default ``why_not``; the Pallas backend's
  refusals depend on its engine option).
- ``present()``: whether its hardware is on this machine; passing over a
  present backend warns the user, passing over an absent one does not.
- ``plan(problem, mod, scale, options, return_lse)``: a hashable, static
  description of the call (everything but array values), with ``mod`` (the
  expression only) and ``scale`` attributes.
- ``forward(plan, q, k, v, operands)`` -> (O, LSE) and
  ``backward(plan, q, k, v, o, lse, do, operands)`` -> (dQ, dK, dV).

A backend whose forward JAX can differentiate itself (``differentiable``) is
called directly; the others run inside :func:`run`'s ``custom_vjp``, which
refuses what their backward does not compute (gradients of captured operands
unless ``operand_gradients``, and of the LSE), or, where the user allowed a
fallback, hands the operand gradients to the fallback backend and its plan.
Every fused call goes through ``lowering.sharding`` (partitioning, vmap),
whose per-device call applies the masked-key rule for non-finite V
(``lowering.nonfinite``): a backend's kernel need not.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp

from scoremod.errors import CudnnUnavailableError, ScoreModError, UnsupportedOpError
from scoremod.lowering import sharding


class Backend:
    """Base of the backends: see the module docstring for the protocol."""

    name: str = ""
    title: str = ""  # how messages name it, e.g. "the fused cuDNN path"
    differentiable: bool = False  # JAX differentiates forward() itself
    operand_gradients: bool = False  # its gradients reach the mod's captured operands
    traced_scale: bool = False  # takes a scale that is a traced value (else it is compiled in)
    partitioned: bool = True  # its calls take lowering.sharding's partitioning rule
    forward_mode_derivatives: bool = False  # jax.jvp of its forward works
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

    def present(self) -> bool:
        return True

    def why_not(self, problem, mod, automatic: bool) -> str | None:
        raise NotImplementedError

    def why_not_with(self, problem, mod, automatic: bool, options) -> str | None:
        """``why_not`` for a call under ``options`` (a LoweringOptions): a backend
        whose refusals depend on the options (the Pallas engine) overrides it."""
        return self.why_not(problem, mod, automatic)

    def plan(self, problem, mod, scale, options, return_lse):
        raise NotImplementedError

    def forward(self, plan, q, k, v, operands):
        raise NotImplementedError

    def backward(self, plan, q, k, v, o, lse, do, operands):
        raise NotImplementedError

    def __repr__(self):
        return f"<scoremod backend {self.name!r}>"


@dataclasses.dataclass(frozen=True)
class _Static:
    """The custom_vjp's static argument: a fused backend, its plan, and the
    (backend, plan) that computes operand gradients when the user allowed a
    fallback (None: such gradients are refused); with what it takes to plan
    the same call on other shapes (a device's shard, a vmapped batch)."""

    backend: Backend
    plan: object
    fallback: tuple | None
    problem: object  # the Problem ``plan`` was made for
    options: object
    return_lse: bool

    def replanned(self, problem, mod, why: str) -> "_Static":
        """The same call on ``problem`` with ``mod`` (an expression-only ScoreMod);
        ``why`` (e.g. "under jax.vmap") explains a refusal of the new call."""
        reason = self.backend.why_not_with(problem, mod, False, self.options)
        if reason is not None:
            raise self.backend.error(
                f"{self.backend.title} cannot run this call {why}: {reason}. Use "
                "implementation=\"xla\" for it.")
        plan = self.backend.plan(problem, mod, self.plan.scale, self.options, self.return_lse)
        return dataclasses.replace(self, plan=plan, fallback=None, problem=problem)


def run(backend: Backend, plan, q, k, v, operands, *, problem, options, return_lse,
        fallback=None, forward_mode_fallback=None):
    """``(O, LSE)`` of ``plan`` on ``backend``, differentiable in q, k, v
    (and in the operands where ``backend`` or the ``fallback`` computes them).

    ``fallback`` and ``forward_mode_fallback`` (``(backend, plan)`` pairs, or
    None where the user allowed none) run what ``backend`` cannot: operand
    gradients and a refusal found only when building its kernels, and
    ``jax.jvp``. A fused backend's calls go through ``lowering.sharding``,
    which partitions them over the devices the arrays are sharded on and
    batches them under ``jax.vmap``; ``problem``, ``options`` and
    ``return_lse`` (those the plan was made with) let it plan the same call
    on other shapes."""
    if not backend.forward_mode_derivatives and forward_mode((q, k, v, operands)):
        return _forward_mode_fallback(backend, forward_mode_fallback, q, k, v, operands)
    if backend.differentiable:
        return backend.forward(plan, q, k, v, operands)
    static = _Static(backend, plan, fallback, problem, options, bool(return_lse))
    return _fused(static, q, k, v, operands)


def forward_mode(arrays) -> bool:
    """Whether ``arrays`` carry forward-mode tangents (``jax.jvp`` traces this call).

    JAX has no public test for it; its JVP tracer type is the one that says so
    (``jax.grad`` and ``jax.linearize`` trace with another)."""
    from jax._src.interpreters import ad

    return any(isinstance(x, ad.JVPTracer) for x in jax.tree.leaves(arrays))


def _forward_mode_fallback(backend, fallback, q, k, v, operands):
    """``jax.jvp`` of a fused call: a fused backward gives no tangents, so the
    reference path runs the call where the user allowed it (implementation=None)."""
    if fallback is None:
        raise backend.error(
            f"{backend.title} has no forward-mode derivative (jax.jvp): it computes "
            "reverse-mode gradients only. Use implementation=None (falls back to the reference "
            "path, with a warning) or implementation=\"xla\" for jax.jvp, or jax.grad / jax.vjp.")
    other, other_plan = fallback
    warnings.warn(f"scoremod: jax.jvp needs forward-mode derivatives, which {backend.title} does "
                  f"not compute; implementation=None falls back to {other.title} for this call"
                  f"{_memory_note(other)}.", stacklevel=4)
    return other.forward(other_plan, q, k, v, operands)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(static, q, k, v, operands):
    try:
        return sharding.forward(static, q, k, v, operands)
    except UnsupportedOpError as e:
        other, other_plan = _refused_when_built(static, e, "forward")
        return other.forward(other_plan, q, k, v, operands)


def _memory_note(backend) -> str:
    return " (O(S^2) memory)" if backend.materializes_scores else ""


def _refused_when_built(static, error, what):
    """The fallback (backend, plan) for a call the fused backend turned down only
    when building its kernels (cuDNN's "no engine"), with a warning; the error
    itself where the user allowed no fallback (a backend asked for by name)."""
    if static.fallback is None:
        raise error
    fallback, _ = static.fallback
    warnings.warn(f"scoremod: {static.backend.title} refused the {what} of this call when "
                  f"building it ({str(error)[:300]}); implementation=None runs it on "
                  f"{fallback.title}{_memory_note(fallback)}.", stacklevel=6)
    return static.fallback


def _names(plan):
    return plan.mod.operand_names if plan.mod is not None else ()


def _fused_fwd(static, q, k, v, operands):
    plan = static.plan
    perturbed = [n for n, x in zip(_names(plan), operands) if x.perturbed]
    vals = lambda x: x.value  # noqa: E731
    q, k, v = vals(q), vals(k), vals(v)
    operands = jax.tree.map(vals, operands, is_leaf=lambda x: hasattr(x, "perturbed"))
    if perturbed and static.fallback is not None:
        fallback, fallback_plan = static.fallback
        # implementation=None: the fallback computes what the backend cannot.
        warnings.warn(
            f"scoremod: gradients for score_mod operands {perturbed} need {fallback.title}; "
            f"implementation=None falls back to it for this call{_memory_note(fallback)}.",
            stacklevel=5,
        )
        (o, lse), vjp = jax.vjp(
            lambda q, k, v, ops: fallback.forward(fallback_plan, q, k, v, ops), q, k, v, operands)
        return (o, lse), {"reference_vjp": vjp}  # a dict marks the fallback residuals
    if perturbed:
        raise CudnnUnavailableError(
            f"gradients with respect to score_mod operands {perturbed} are not computed by "
            f"{static.backend.title} (it returns dQ, dK, dV only). Use implementation=\"xla\" to "
            "learn them, or wrap them in jax.lax.stop_gradient to keep them fixed."
        )
    try:
        o, lse = sharding.forward(static, q, k, v, operands)
    except UnsupportedOpError as e:
        other, other_plan = _refused_when_built(static, e, "forward")
        (o, lse), vjp = jax.vjp(
            lambda q, k, v, ops: other.forward(other_plan, q, k, v, ops), q, k, v, operands)
        return (o, lse), {"reference_vjp": vjp}
    return (o, lse), (q, k, v, o, lse, operands)


def _fused_bwd(static, res, cts):
    from jax.custom_derivatives import SymbolicZero

    if isinstance(res, dict):
        cts = tuple(jnp.zeros(c.shape, c.dtype) if isinstance(c, SymbolicZero) else c for c in cts)
        return res["reference_vjp"](cts)
    q, k, v, o, lse, operands = res
    do, dlse = cts
    if not isinstance(dlse, SymbolicZero):
        raise CudnnUnavailableError(
            f"{static.backend.title} cannot differentiate through the returned LSE; use "
            "implementation=\"xla\", or jax.lax.stop_gradient(lse)."
        )
    if isinstance(do, SymbolicZero):
        do = jnp.zeros(o.shape, o.dtype)
    try:
        dq, dk, dv = sharding.backward(static, q, k, v, o, lse, do, operands)
    except UnsupportedOpError as e:
        other, other_plan = _refused_when_built(static, e, "backward")
        _, vjp = jax.vjp(lambda q, k, v: other.forward(other_plan, q, k, v, operands)[0], q, k, v)
        dq, dk, dv = vjp(do)
    return dq, dk, dv, jax.tree.map(jnp.zeros_like, operands)


_fused.defvjp(_fused_fwd, _fused_bwd, symbolic_zeros=True)
