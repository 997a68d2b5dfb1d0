"""The IR as jax.numpy on one score tile, inside a Pallas kernel.

A kernel program holds one ``[block_q, block_kv]`` tile of scores. The mod
is evaluated on it with each op's own jax.numpy implementation (its op-table
entry), so the kernel computes what the reference path computes: ``q_idx``
is a ``[block_q, 1]`` iota plus the tile's first row, ``kv_idx`` a
``[1, block_kv]`` iota plus its first column, ``b`` and ``h`` the program's
scalars. A captured array is read from a flat copy in the kernel's memory:
each index is clamped into range (as the reference path's loads are) and the
element gathered, so a table indexed by a computed index (``bias[kv_idx -
q_idx + 127]``) costs a gather from a small table, never an S x S tensor.

The backward expressions come from ``dsl.grad``: the derivative of the mod
with respect to the score, and to the value of each read of a float array
(what becomes that array's gradient), both in the cotangent ``dP``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from scoremod.dsl import ir
from scoremod.dsl.grad import vjp
from scoremod.dsl.ir import BOOL, CONST, F32, I32, LOAD, MATERIALIZE, OPERAND, OPS, VAR
from scoremod.dsl.text import format_expr

JNP_DTYPE = {F32: jnp.float32, I32: jnp.int32, BOOL: jnp.bool_}

# Ops whose jax.numpy implementation reaches a primitive that Pallas's Triton
# lowering has no rule for (jax 0.11.2; tests/test_pallas.py lowers every op of
# the table through it and checks that exactly these fail).
NOT_LOWERABLE = {
    "erf": "Pallas's Triton lowering has no rule for erf (lax.erf_p)",
    "erfc": "Pallas's Triton lowering has no rule for erfc (lax.erfc_p)",
}


def _round_half_away(x):
    """lax.round (halves away from zero) without its primitive: the fraction
    ``x - trunc(x)`` of a float is exact, so the comparison decides exactly."""
    t = jnp.sign(x) * jnp.floor(jnp.abs(x))
    return t + jnp.where(jnp.abs(x - t) >= 0.5, jnp.sign(x), 0.0)


def _floordiv(a, b):
    """jnp.floor_divide, written with ops the Triton lowering has: on floats
    jax.numpy ends in lax.round, which it lacks (the same steps, round spelled out)."""
    if jnp.issubdtype(jnp.result_type(a), jnp.integer):
        return jnp.floor_divide(a, b)
    mod = lax.rem(*jnp.broadcast_arrays(a, b))
    div = jnp.where(b == 0, a, a - mod) / b
    fix = jnp.logical_and(mod != 0, jnp.sign(b) != jnp.sign(mod))
    return _round_half_away(jnp.where(fix, div - 1.0, div))


def _in_range_shift(n):
    """Whether shift amount ``n`` is a constant in [0, 31] (the IR's constants are
    concrete arrays in the kernel, a tile's values tracers)."""
    return (not isinstance(n, jax.core.Tracer) and jnp.ndim(n) == 0
            and 0 <= int(n) <= 31)


# Shifts with XLA's results for an amount outside [0, 31] (0, or the sign for
# >>): both engines lower lax's shifts to MLIR's shli / shrsi / shrui, for which
# such an amount is poison. A constant amount in range shifts alone.
def _zero_filling(shift):
    """``shift`` (lax's left or logical right shift) with 0 for an amount outside [0, 31]."""

    def rule(x, n):
        if _in_range_shift(n):
            return shift(*jnp.broadcast_arrays(x, n))
        out = shift(*jnp.broadcast_arrays(x, jnp.clip(n, 0, 31)))
        return jnp.where((n >= 0) & (n <= 31), out, 0)

    return rule


def _shift_right_arithmetic(x, n):  # by 31 where out of range: the sign, as XLA gives
    if not _in_range_shift(n):
        n = jnp.where((n >= 0) & (n <= 31), n, 31)
    return lax.shift_right_arithmetic(*jnp.broadcast_arrays(x, n))


# Ops evaluated on tiles by another jax.numpy spelling of the same function.
TILE_RULES = {"floordiv": _floordiv, "left_shift": _zero_filling(lax.shift_left),
              "right_shift": _shift_right_arithmetic,
              "shift_right_logical": _zero_filling(lax.shift_right_logical)}

# The layout every captured array has in a kernel: one flat array of one of
# these dtypes (the IR computes floats in float32 and indices in int32).
KERNEL_DTYPE = {F32: np.float32, I32: np.int32, BOOL: np.int32}


def kernel_operand(value, node):
    """``value`` of operand ``node`` as the kernel reads it: flat, float32 or int32."""
    return jnp.ravel(jnp.asarray(value)).astype(KERNEL_DTYPE[node.dtype])


# A bool array read at an index that varies along one tile axis only (a
# [block_q, 1] or [1, block_kv] vector of flags): with such reads the H200 gave
# the right O and LSE but wrong dQ, dK and dV (up to 1.4x the gradient's size)
# for the catalogue's global_sliding_window, `where(|q - kv| <= W | g[q] | g[kv],
# s, -inf)`, while the same kernels in interpret mode match the reference.
# Reads of bool arrays along both axes (a tile map) and of int arrays along one
# ran right there. Gathering the flags at the whole tile's positions (no i1
# broadcast) left the errors as they were; the Mosaic GPU kernels, which
# broadcast the flags' int32 values and compare after, got the same mod wrong
# on the H200 too (O as well, at 512 x 512), while their interpret mode matched
# the reference. Refused on both engines until the cause is found.
ONE_AXIS_BOOL_READ = ("a bool array read along one tile axis gave wrong results on the H200 on "
                      "both engines (the cause is not found yet)")


def _one_axis_bool_read(node) -> bool:
    return node.dtype == BOOL and _one_axis_read(node)


def _one_axis_read(node) -> bool:
    return node.op == LOAD and len(ir.variables(*node.args[1:]) & {"q_idx", "kv_idx"}) == 1


# The same mask with int flags compared with 0 (`(g[q_idx] != 0) | ...`, the
# workaround the message above gave) came out wrong on the H200 on the Mosaic GPU
# engine too (O off by 0.74 of its scale, 2026-12-06, run_s24_call2), while
# document ids read along one axis and compared (`doc[q] == doc[kv]`, joined by
# `&`) run right, and so do `or`s of conditions on both indices over such reads
# (shared_prefix, vsa_topk's `.any()`, catalogue GPU runs): what the failing masks
# share is an `or` of a condition on one index alone that reads such an array.
# The bisect (benchmarks/probes/global_window_bisect.py, 2026-12-07, run_s29_call2;
# forward only, b2 s512 h4 d128, W16): the Mosaic forward is wrong on the plan's
# block map (O off by 2.2) and right on a dense one with no full-tile mod, for int or
# bool flags and for one side's flags alone; right with the band written as two
# one-sided comparisons instead of `abs(q - kv) <= W`, and with the conditions added
# as ints rather than `or`ed; the Triton forward is right in every variant. On the
# CPU that map visits exactly the live tiles and marks none full (the map computed on
# the GPU was not checked).
ONE_AXIS_READ_UNDER_OR = ("an `or` of a condition on one of q_idx or kv_idx alone that reads "
                          "an array along it (bool flags, or int flags compared with 0: "
                          "Longformer's global tokens) gave wrong results on the H200 (the "
                          "cause is not found yet); implementation=\"cudnn\" computes the "
                          "mask ahead, implementation=\"xla\" runs it")


def _or_over_one_axis_read(node) -> bool:
    return node.op == "or" and any(
        len(ir.variables(a) & {"q_idx", "kv_idx"}) == 1
        and any(_one_axis_read(n) for n in ir.toposort(a)) for a in node.args)


def refusal(expr, sources, ops=True) -> str | None:
    """Why the Pallas kernels cannot evaluate ``expr`` or its derivatives (a
    sentence naming the op and where it was written), or None; without ``ops``,
    the ops the Triton lowering lacks are not counted (the Mosaic GPU kernels
    run them: ``mosaic.refusal`` decides)."""
    for node in ir.toposort(*all_expressions(expr)):
        why = NOT_LOWERABLE.get(node.op) if ops else None
        if _one_axis_bool_read(node):
            why = ONE_AXIS_BOOL_READ
        elif _or_over_one_axis_read(node):
            why = ONE_AXIS_READ_UNDER_OR
        if node.op == MATERIALIZE:
            why = "materialized values are a cuDNN lowering's, not a mod's"
        if why:
            where = ir.source_of(node, expr, sources)
            return (f"it cannot run `{node.op}` in `{format_expr(node)}`"
                    f"{' at ' + where if where else ''}: {why}")
    return None


@dataclasses.dataclass(frozen=True)
class Derivatives:
    """The backward expressions of a mod, in the cotangent ``dP`` of its output.

    ``score``: d(mod)/d(score) times dP. ``loads``: per read of a float
    captured array (a LOAD node), the cotangent of the value it read: summed
    over the tile at the clamped index, that read's share of the array's gradient."""

    score: ir.Node
    loads: tuple  # ((load node, cotangent expression), ...)


def derivatives(expr) -> Derivatives:
    dp = ir.cotangent()
    loads = tuple((n, vjp(expr, dp, wrt=n)) for n in ir.toposort(expr)
                  if n.op == LOAD and n.dtype == F32)
    return Derivatives(vjp(expr, dp), loads)


def all_expressions(expr) -> tuple:
    d = derivatives(expr)
    return (expr, d.score) + tuple(ct for _, ct in d.loads)


def flat_index(node, idx, axes=None):
    """The clamped, flattened position a LOAD ``node`` reads, given its index
    values; with ``axes``, the position within those axes only."""
    shape = node.args[0].attr[1]
    axes = range(len(shape)) if axes is None else axes
    flat = jnp.int32(0)
    stride = 1
    for a in reversed(list(axes)):
        flat = flat + jnp.clip(jnp.asarray(idx[a], jnp.int32), 0, shape[a] - 1) * stride
        stride *= shape[a]
    return flat


def reads_of(expr, name) -> list:
    """The reads (LOAD nodes) of operand ``name`` in ``expr``, in ``ir.toposort`` order."""
    return [n for n in ir.toposort(expr) if n.op == LOAD and n.args[0].attr[0] == name]


def program_axes(expr, name) -> dict:
    """``{axis: "b" or "h"}``: the axes of operand ``name`` that every read indexes
    by ``b`` (or every read by ``h``) directly. One kernel program has one batch
    and one head, so it reads one position along them."""
    uses: dict = {}
    for node in reads_of(expr, name):
        for axis, idx in enumerate(node.args[1:]):
            uses.setdefault(axis, set()).add(idx)
    out = {}
    for axis, idxs in uses.items():
        (idx,) = idxs if len(idxs) == 1 else (None,)
        if idx is not None and idx.op == VAR and idx.attr in ("b", "h"):
            out[axis] = idx.attr
    return out


def evaluate_tile(roots, inputs: dict, refs: dict, gather=None, rules=None, known=None):
    """Values of ``roots`` on a tile.

    ``inputs``: arrays for the variables (``score``, ``b``, ``h``, ``q_idx``,
    ``kv_idx``, and ``dP`` for backward expressions), broadcastable to the tile;
    ``refs``: operand name -> the Pallas ref of its flat kernel copy;
    ``gather``: ``(ref, flat positions, IR dtype) -> values``, the kernel's
    read of a captured array (default: ``_gather`` below, Triton's);
    ``rules``: op name -> a jax.numpy spelling that replaces ``TILE_RULES``'
    and the op table's (another lowering's);
    ``known``: node -> its value on the tile, computed by the caller (what
    it read ahead: the nodes under it are not evaluated)."""
    gather = _gather if gather is None else gather
    rules = TILE_RULES if rules is None else {**TILE_RULES, **rules}
    known = {} if known is None else known
    vals = {}
    for node in ir.toposort(*roots, stop=known.__contains__):
        if node in known:
            vals[node] = known[node]
        elif node.op == CONST:
            vals[node] = jnp.asarray(node.attr, JNP_DTYPE[node.dtype])
        elif node.op == VAR:
            vals[node] = inputs[node.attr]
        elif node.op == OPERAND:
            continue
        elif node.op == LOAD:
            flat = flat_index(node, [vals[a] for a in node.args[1:]])
            vals[node] = gather(refs[node.args[0].attr[0]], flat, node.dtype)
        elif node.op in rules:  # an op's attribute (integer_pow's n) follows its arguments
            attr = () if node.attr is None else (node.attr,)
            vals[node] = rules[node.op](*[vals[a] for a in node.args], *attr)
        else:
            vals[node] = OPS[node.op].evaluate([vals[a] for a in node.args], node.attr)
    return [vals[r] for r in roots]


def _gather(ref, flat, dtype):
    """``ref[flat]`` for a scalar or an array of positions, as IR type ``dtype``."""
    shape = jnp.shape(flat)
    if len(shape) < 2:  # the Triton lowering gathers with 2-D positions
        flat = jnp.broadcast_to(flat, (1,) * (2 - len(shape)) + shape)
    out = ref[flat]
    if len(shape) < 2:
        out = out.reshape(shape) if shape else out[0, 0]
    if dtype == BOOL:
        return out != 0
    return out.astype(JNP_DTYPE[dtype])
